"""Grappler-style rewrite of a GraphDef: MaxPool(Relu(z)) and its gradient -> the fused ops.

Patterns, on the top-level nodes of a GraphDef (function libraries are copied unchanged):

  forward only:      z -> Relu -> MaxPool            (the Relu's only consumer is the MaxPool)
  with its gradient: z -> Relu -> MaxPool, MaxPoolGrad(Relu, MaxPool, dy) -> ReluGrad(., Relu)
                     (the Relu's only consumers are the MaxPool, the MaxPoolGrad and the ReluGrad,
                     and the MaxPoolGrad's only consumer is the ReluGrad)

become, for keep="argmax": ReluMaxPoolWithWindowArgmax(z) and
ReluMaxPoolGradFromWindowArgmax(Shape(z), dy, window_argmax); for keep="input": ReluMaxPool(z) and
ReluMaxPoolGrad(z, dy). The fused forward takes the MaxPool's name and the fused gradient the
ReluGrad's name, so their consumers need no rewiring; control edges on removed nodes move to the
node that replaces them. A Relu with any other consumer is left in place, with one log line.
"""
import copy
import logging

import tensorflow as tf

from tf_relupool import config
from tf_relupool._loader import load_library
from tf_relupool.ops import KEEP_ARGMAX, KEEP_CHOICES, KEEP_INPUT, SUPPORTED_DTYPES, argmax_dtype_for

logger = logging.getLogger("tf_relupool")

_POOL_ATTRS = ("ksize", "strides", "padding", "data_format")
_SUPPORTED_ENUMS = {d.as_datatype_enum for d in SUPPORTED_DTYPES}


def resolve_graph_keep(keep):
    """keep for a static rewrite: the argument, else the switch's mode, else "argmax"."""
    if keep is None:
        keep = config.recompute_mode() or KEEP_ARGMAX
    if keep not in KEEP_CHOICES:
        raise ValueError(f"keep must be None or one of {KEEP_CHOICES}, got {keep!r}")
    return keep


def _parse(inp):
    """'^a' -> ('a', None); 'a' -> ('a', 0); 'a:2' -> ('a', 2)."""
    if inp.startswith("^"):
        return inp[1:], None
    name, _, idx = inp.rpartition(":")
    if name and idx.isdigit():
        return name, int(idx)
    return inp, 0


def _ref(name, idx):
    return name if idx == 0 else f"{name}:{idx}"


class _Graph:
    def __init__(self, graph_def):
        self.nodes = {n.name: n for n in graph_def.node}
        self.data_consumers = {}   # (name, idx) -> [(consumer name, input position)]
        self.control_consumers = {}  # name -> [consumer name]
        for n in graph_def.node:
            for pos, inp in enumerate(n.input):
                src, idx = _parse(inp)
                if idx is None:
                    self.control_consumers.setdefault(src, []).append(n.name)
                else:
                    self.data_consumers.setdefault((src, idx), []).append((n.name, pos))

    def producer(self, inp):
        src, idx = _parse(inp)
        return self.nodes.get(src), idx

    def consumers(self, name, idx=0):
        return self.data_consumers.get((name, idx), [])


def _data_inputs(node):
    return [i for i in node.input if not i.startswith("^")]


def _control_inputs(node):
    return [i for i in node.input if i.startswith("^")]


def _same_pool_attrs(a, b):
    return all(a.attr[k] == b.attr[k] for k in _POOL_ATTRS)


def _match(g, pool):
    """A fusion plan for MaxPool node `pool`, or None (with the reason logged)."""
    data = _data_inputs(pool)
    relu, idx = g.producer(data[0]) if data else (None, None)
    if relu is None or relu.op != "Relu" or idx != 0:
        return None  # not a ReLU + max pool pattern: nothing to say
    where = f"rewrite_graph: MaxPool {pool.name!r} after Relu {relu.name!r} not fused"
    if relu.attr["T"].type not in _SUPPORTED_ENUMS or pool.attr["T"].type != relu.attr["T"].type:
        logger.info("%s: dtype %s is not supported", where, tf.as_dtype(relu.attr["T"].type).name)
        return None
    fmt = pool.attr["data_format"].s.decode()
    pad = pool.attr["padding"].s.decode()
    if fmt not in ("NHWC", "NCHW") or pad not in ("VALID", "SAME"):
        logger.info("%s: data_format %s / padding %s is not supported", where, fmt, pad)
        return None
    grads = []
    others = []
    for name, pos in g.consumers(relu.name):
        node = g.nodes[name]
        if name == pool.name:
            continue
        if node.op == "MaxPoolGrad" and pos == 0 and _parse(_data_inputs(node)[1]) == (pool.name, 0) \
                and _same_pool_attrs(node, pool):
            grads.append(node)
        elif node.op == "ReluGrad" and pos == 1:
            continue  # checked below, against the MaxPoolGrad that feeds it
        else:
            others.append(name)
    relu_grads = [g.nodes[n] for n, pos in g.consumers(relu.name)
                  if g.nodes[n].op == "ReluGrad" and pos == 1]
    plan = {"relu": relu, "pool": pool, "pool_grad": None, "relu_grad": None}
    if len(grads) > 1:
        others += [n.name for n in grads]
    elif grads:
        pool_grad = grads[0]
        users = g.consumers(pool_grad.name)
        relu_grad = g.nodes[users[0][0]] if len(users) == 1 else None
        if relu_grad is None or relu_grad.op != "ReluGrad" or users[0][1] != 0 or \
                _parse(_data_inputs(relu_grad)[1]) != (relu.name, 0):
            logger.info("%s: its MaxPoolGrad %r does not feed exactly one matching ReluGrad "
                        "(consumers: %s)", where, pool_grad.name, [u for u, _ in users])
            return None
        plan.update(pool_grad=pool_grad, relu_grad=relu_grad)
    matched = {plan["relu_grad"].name} if plan["relu_grad"] is not None else set()
    others += [n.name for n in relu_grads if n.name not in matched]
    if others:
        logger.info("%s: the Relu has other consumers %s, left in place", where, sorted(others))
        return None
    return plan


def _attr_copy(dst, src, keys):
    for k in keys:
        dst.attr[k].CopyFrom(src.attr[k])


def rewrite_graph(graph_def, keep=None):
    """Returns a copy of `graph_def` with MaxPool(Relu(z)) (and its gradient) fused.

    Args:
      graph_def: a `tf.compat.v1.GraphDef`, e.g. `concrete_fn.graph.as_graph_def()`.
      keep: "argmax" (fused ops keeping 1-byte argmax codes), "input" (keeping z), or None:
        the global switch's mode (`tf_relupool.recompute_mode()`) when it is on, else "argmax".
        The switch is read once, now: the result is a static graph.

    Returns:
      A new GraphDef; `graph_def` is not modified. Patterns that cannot be fused (a Relu with
      other consumers, unsupported dtype or padding) are left in place with one log line each
      (logger "tf_relupool", level INFO).

    Example: fuse a concrete function with its gradient and run the result:

        import tensorflow as tf, tf_relupool
        w = tf.Variable(tf.random.normal([3, 3, 3, 8]))

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                y = tf.nn.max_pool2d(tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME")), 2, 2, "VALID")
                loss = tf.reduce_sum(y * y)
            return loss, tape.gradient(loss, w)

        cf = step.get_concrete_function(tf.TensorSpec([4, 16, 16, 3]))
        fused = tf_relupool.rewrite_function(cf)     # rewrite_graph + import, as below
        loss, dw = fused(tf.random.normal([4, 16, 16, 3]))

        # or by hand, which is what rewrite_function does:
        gd = tf_relupool.rewrite_graph(cf.graph.as_graph_def())
        def run(x):   # explicit inputs first in cf.inputs, then the captured variables
            g = tf.compat.v1.get_default_graph()
            feeds = [x] + [g.capture(t) for t in cf.captured_inputs]
            return tf.graph_util.import_graph_def(
                gd, input_map=dict(zip([t.name for t in cf.inputs], feeds)),
                return_elements=[t.name for t in cf.outputs], name="")
        fused = tf.compat.v1.wrap_function(run, [tf.TensorSpec([4, 16, 16, 3])])
        loss, dw = fused(tf.random.normal([4, 16, 16, 3]))
    """
    keep = resolve_graph_keep(keep)
    load_library()  # the fused ops must be registered for the result to be importable
    out = copy.deepcopy(graph_def)
    g = _Graph(out)
    plans = [p for p in (_match(g, n) for n in out.node if n.op == "MaxPool") if p is not None]
    if not plans:
        logger.info("rewrite_graph: nothing to fuse")
        return out
    removed = {}    # removed node name -> name of the node whose control edge replaces it
    replaced = {}   # node name -> new NodeDef
    added = []
    for p in plans:
        relu, pool, pool_grad, relu_grad = p["relu"], p["pool"], p["pool_grad"], p["relu_grad"]
        z = _data_inputs(relu)[0]
        fwd = tf.compat.v1.NodeDef(name=pool.name, device=pool.device)
        fwd.input.extend([z] + _control_inputs(relu) + _control_inputs(pool))
        fwd.op = "ReluMaxPoolWithWindowArgmax" if keep == KEEP_ARGMAX else "ReluMaxPool"
        _attr_copy(fwd, pool, ("T",) + _POOL_ATTRS)
        fmt = pool.attr["data_format"].s.decode()
        if keep == KEEP_ARGMAX:
            targmax = argmax_dtype_for([None] * 4, list(pool.attr["ksize"].list.i), fmt)
            fwd.attr["Targmax"].type = targmax.as_datatype_enum
        replaced[pool.name] = fwd
        removed[relu.name] = pool.name
        logger.info("rewrite_graph: fused Relu %r + MaxPool %r%s (keep=%s)", relu.name, pool.name,
                    "" if pool_grad is None else
                    f" and their gradient {pool_grad.name!r} + {relu_grad.name!r}", keep)
        if pool_grad is None:
            continue
        dy = _data_inputs(pool_grad)[2]
        bwd = tf.compat.v1.NodeDef(name=relu_grad.name, device=relu_grad.device)
        controls = _control_inputs(pool_grad) + _control_inputs(relu_grad)
        if keep == KEEP_ARGMAX:
            shape = tf.compat.v1.NodeDef(name=_unique(g, relu_grad.name + "/input_shape"),
                                         op="Shape", device=relu_grad.device)
            shape.input.append(z)
            shape.attr["T"].CopyFrom(relu.attr["T"])
            shape.attr["out_type"].type = tf.int32.as_datatype_enum
            g.nodes[shape.name] = shape
            added.append(shape)
            bwd.op = "ReluMaxPoolGradFromWindowArgmax"
            bwd.input.extend([shape.name, dy, f"{pool.name}:1"] + controls)
            bwd.attr["Targmax"].type = fwd.attr["Targmax"].type
            bwd.attr["Tshape"].type = tf.int32.as_datatype_enum
            # The codes come straight from the fused forward: valid by construction (ops.py).
            bwd.attr["validate_window_argmax"].b = False
        else:
            bwd.op = "ReluMaxPoolGrad"
            bwd.input.extend([z, dy] + controls)
        _attr_copy(bwd, pool_grad, ("T",) + _POOL_ATTRS)
        replaced[relu_grad.name] = bwd
        removed[pool_grad.name] = relu_grad.name
    nodes = []
    for n in out.node:
        if n.name in removed:
            continue
        n = replaced.get(n.name, n)
        # Control edges on removed nodes move to their replacements (deduplicated).
        if any(i.startswith("^") and i[1:] in removed for i in n.input):
            fixed = []
            for i in n.input:
                if i.startswith("^") and i[1:] in removed:
                    i = "^" + removed[i[1:]]
                if i not in fixed or not i.startswith("^"):
                    fixed.append(i)
            del n.input[:]
            n.input.extend(fixed)
        nodes.append(n)
    del out.node[:]
    out.node.extend(nodes + added)
    return out


def _unique(g, name):
    candidate, i = name, 1
    while candidate in g.nodes:
        candidate, i = f"{name}_{i}", i + 1
    return candidate


def rewrite_function(concrete_function, keep=None):
    """Rewrites a concrete function's graph with `rewrite_graph` and returns a callable for it.

    Args:
      concrete_function: `f.get_concrete_function(...)` of a `tf.function` `f`; the ops to fuse
        must be in its own graph (ops inside nested functions are not rewritten).
      keep: as for `rewrite_graph`.

    Returns:
      A `tf.compat.v1.wrap_function` result taking the same explicit (flat) tensor arguments as
      `concrete_function` and returning its structured outputs. Captured variables are
      captured again: the rewritten function reads and writes the same variables.
    """
    cf = concrete_function
    if not hasattr(cf, "graph") or not hasattr(cf, "captured_inputs"):
        raise ValueError("rewrite_function takes a concrete function "
                         "(tf.function(...).get_concrete_function(...)), got "
                         f"{type(cf).__name__}")
    graph_def = rewrite_graph(cf.graph.as_graph_def(), keep=keep)
    captured = list(cf.captured_inputs)
    n_explicit = len(cf.inputs) - len(captured)
    input_names = [t.name for t in cf.inputs]
    output_names = [t.name for t in cf.outputs]
    specs = [tf.TensorSpec(t.shape, t.dtype, name=t.op.name) for t in cf.inputs[:n_explicit]]
    structure = cf.structured_outputs

    def imported(*args):
        graph = tf.compat.v1.get_default_graph()
        inside = [graph.capture(t) for t in captured]  # eager handles -> this graph's inputs
        feeds = dict(zip(input_names, list(args) + inside))
        outs = tf.graph_util.import_graph_def(graph_def, input_map=feeds,
                                              return_elements=output_names, name="")
        return tf.nest.pack_sequence_as(structure, outs, expand_composites=True)

    return tf.compat.v1.wrap_function(imported, specs)
