"""Rewrite of a GraphDef: MaxPool(Relu(z)) and its gradient -> the fused ops.

One implementation: `rewrite_graph` runs the Grappler pass of cc/grappler/ (the one
`enable_recompute()` registers inside TensorFlow) over the GraphDef, through the op library's
`tf_relupool_rewrite_graph` C function (ctypes), with nodes that have no device taken as CPU
nodes. So its patterns are the pass's (cc/grappler/README.md, "Patterns"), on the top-level
nodes of a GraphDef (function libraries are copied unchanged):

  forward only:      z -> Relu -> MaxPool            (the Relu's only consumer is the MaxPool)
  with its gradient: z -> Relu -> MaxPool, MaxPoolGrad(Relu, MaxPool, dy) -> ReluGrad(., Relu)
                     (the Relu's only consumers are the MaxPool, the MaxPoolGrad and the ReluGrad,
                     and the MaxPoolGrad's only consumer is the ReluGrad)
  also:              MaxPoolV2 (constant ksize/strides) with MaxPoolGradV2; a constant zero Pad
                     between the Relu and the pool (ResNet/DenseNet stems: the Pad moves before
                     the ReLU, its gradient Slice after the fused gradient); Relu(MaxPool(z));
                     remapper's _FusedConv2D(BiasAdd, Relu) in place of the Relu

become, for keep="argmax": ReluMaxPoolWithWindowArgmax(z) and
ReluMaxPoolGradFromWindowArgmax(Shape(z), dy, window_argmax); for keep="input": ReluMaxPool(z) and
ReluMaxPoolGrad(z, dy). The fused forward takes the MaxPool's name and the fused gradient the
ReluGrad's name, so their consumers need no rewiring; control edges on removed nodes move to the
node that replaces them. A Relu with any other consumer is left in place, with one log line.
"""
import logging

import tensorflow as tf

from tf_relupool import _state
from tf_relupool._loader import load_library

logger = logging.getLogger("tf_relupool")


def resolve_graph_keep(keep):
    """keep for a static rewrite: the argument, else the switch's mode, else "argmax"."""
    keep = _state.check_keep(keep, allow_none=True)
    return keep or _state.mode() or _state.KEEP_ARGMAX


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
    from tf_relupool import _clib, grappler  # the pass lives in the op library
    fused, data, lines = _clib.rewrite_serialized_graph(graph_def.SerializeToString(), keep)
    if data is not None:
        grappler.ensure_registered()  # the result holds fused ops: their layout pass
    for line in lines:
        logger.info("rewrite_graph: %s (keep=%s)", line, keep)
    out = tf.compat.v1.GraphDef()
    if data is None:
        logger.info("rewrite_graph: nothing to fuse")
        out.CopyFrom(graph_def)
    else:
        out.ParseFromString(data)
    return out


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
        # cf.outputs leaves out the None entries of the structure (e.g. a gradient of None).
        flat = iter(outs)
        filled = [None if a is None else next(flat)
                  for a in tf.nest.flatten(structure, expand_composites=True)]
        return tf.nest.pack_sequence_as(structure, filled, expand_composites=True)

    return tf.compat.v1.wrap_function(imported, specs)
