"""Replaying traced TensorFlow ops: the ops between two tensors of a traced graph, applied again
to other inputs with stock's op types, attributes and operand order, recorded on gradient tapes
as stock's own calls record them (so that a tape's gradient of the replay is stock's gradient
graph: the same gradient functions, the same order of the sums where a tensor has several
readers)."""
import inspect

#: op types whose Python wrapper pauses the tapes around the op (tf.stop_gradient): replayed so
#: too, since a recorded StopGradient changes the order in which a tape sums gradients
_UNRECORDED = {"StopGradient"}


def between(source, target, limit=256, stops=()):
    """The ops on a path from tensor `source` to tensor `target`, in the graph's creation order
    (ancestors of target that depend on source; source's producer excluded), or None where
    target's ancestors short of source and of the tensors `stops` (inputs the path reads, such
    as a residual shortcut) are more than `limit` ops (a path around source)."""
    stop = {t.name for t in stops} | {source.name}
    ancestors, stack = set(), [target.op]
    while stack:
        op = stack.pop()
        if op.name in ancestors:
            continue
        ancestors.add(op.name)
        if len(ancestors) > limit:
            return None
        stack.extend(t.op for t in op.inputs if t.name not in stop)
    out, dependent = [], set()
    for op in target.graph.get_operations():  # creation order is a topological order
        if op.name in ancestors and any(t.name == source.name or t.op.name in dependent
                                        for t in op.inputs):
            dependent.add(op.name)
            out.append(op)
    return out


def outside_inputs(ops, source):
    """The tensors `ops` read that neither `source` nor one of the ops makes, constants
    excluded, in first-read order."""
    made = {op.name for op in ops}
    out, seen = [], set()
    for op in ops:
        for t in op.inputs:
            if (t.name != source.name and t.op.name not in made and t.op.type != "Const"
                    and t.name not in seen):
                seen.add(t.name)
                out.append(t)
    return out


def _inferred(op_def):
    """The attributes TensorFlow infers from an op's inputs (types, list lengths)."""
    return {name for arg in op_def.input_arg
            for name in (arg.type_attr, arg.number_attr, arg.type_list_attr) if name}


def apply_op(op, inputs):
    """`op` applied to `inputs` (one per op input) through tf.raw_ops: the same type and
    attributes; its outputs as a list."""
    import tensorflow as tf
    if op.type in _UNRECORDED:
        return [tf.stop_gradient(inputs[0])]
    fn = getattr(tf.raw_ops, op.type)
    params = list(inspect.signature(fn).parameters)
    if len(op.op_def.input_arg) != len(inputs):
        raise ValueError(f"{op.type} takes {len(op.op_def.input_arg)} inputs, got {len(inputs)}")
    kwargs = dict(zip(params, inputs))
    inferred = _inferred(op.op_def)
    for attr in op.op_def.attr:
        if attr.name not in inferred and attr.name in params:
            kwargs[attr.name] = op.get_attr(attr.name)
    out = fn(**kwargs)
    if isinstance(out, tf.Operation):
        return []
    return [out] if isinstance(out, tf.Tensor) else list(out)


def apply(ops, substitutes):
    """`ops` (from `between`) replayed with the tensors of `substitutes` ({name: tensor}) in
    place of the originals: {original tensor name: replayed tensor} for every output."""
    mapped = dict(substitutes)
    for op in ops:
        outs = apply_op(op, [mapped.get(t.name, t) for t in op.inputs])
        for t, t2 in zip(op.outputs, outs):
            mapped[t.name] = t2
    return mapped
