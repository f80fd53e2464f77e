"""What a call of a graph function really ran, from TensorFlow's run metadata.

    from tf_relupool import run_metadata
    loss, counts = run_metadata.executed_ops(train_step, x, y)
    counts.get("ReluMaxPoolWithWindowArgmax", 0)   # the switch fused this step's pairs

This is how to check what a training step executes (after Grappler, tf_relupool's graph
optimizer included, and TensorFlow's later passes), e.g. that a stock Keras model runs the fused
ops with the switch on. Only calls of graph functions (`tf.function`, Keras' train function) are
recorded; eager ops are not.
"""


def _run_metadata(fn, args, kwargs):
    """Calls fn once with TensorFlow's run-metadata collection on: (result, RunMetadata)."""
    from tf_relupool import _compat
    ctx = _compat.tf_eager_context()
    ctx.enable_graph_collection()
    try:
        out = fn(*args, **kwargs)
        meta = ctx.export_run_metadata()
    finally:
        ctx.disable_graph_collection()
    return out, meta


def executed_nodes(fn, *args, **kwargs):
    """Calls `fn(*args, **kwargs)` once and returns (its result, the NodeDefs TensorFlow ran).

    The nodes are those of the partition graphs TensorFlow's executor ran for the call: after
    Grappler (tf_relupool's optimizer included) and TensorFlow's later passes (oneDNN's layout
    rewrite, the placement of a function on its device), across every function the call ran. It
    uses TensorFlow's run-metadata collection (`context.enable_graph_collection`), which holds for
    this call only.
    """
    out, meta = _run_metadata(fn, args, kwargs)
    return out, [n for fg in meta.function_graphs for g in fg.partition_graphs for n in g.node]


def optimized_nodes(fn, *args, **kwargs):
    """Like executed_nodes, but the nodes of each function's graph as Grappler left it
    (tf_relupool's optimizer included), before TensorFlow's later passes: stock op names (MaxPool,
    not oneDNN's _MklNativeMaxPool), as the pass sees and writes them."""
    out, meta = _run_metadata(fn, args, kwargs)
    return out, [n for fg in meta.function_graphs for n in fg.post_optimization_graph.node]


def executed_ops(fn, *args, **kwargs):
    """Like executed_nodes, but the count of each op type: (result, {op type: count})."""
    out, nodes = executed_nodes(fn, *args, **kwargs)
    counts = {}
    for n in nodes:
        counts[n.op] = counts.get(n.op, 0) + 1
    return out, counts
