"""What the switch fuses in a Keras model's training step, pair by pair, on both routes.

    report = tf_relupool.fusion_report(model, batch_size=32)
    print(report)                # a table: each ReLU + max pool, fused or why not, bytes saved
    report.pairs                 # the same as dicts

The model's training step (forward, loss, gradients of its trainable weights) is traced, not
run, twice with the switch on:

- "xla": inside `tf.function(jit_compile=True)` (Keras' default compile on a GPU), where the
  trace-time fusion (tf_relupool/keras_fusion.py) decides each max pool as Keras or tf.nn
  calls it; tracing is enough, nothing is compiled;
- "grappler": without XLA (`jit_compile=False`, a CPU-only machine, tf.distribute), where the
  graph pass decides; its decisions come from running the pass over the traced graph offline
  (tf_relupool._clib.rewrite_serialized_graph), as Grappler would.

Bytes saved per step, for a fused pair: the pool's input (the ReLU's output, or its padded
copy), which stock keeps for the pool's backward, minus the one-byte codes the fused op keeps
instead, at the traced batch size.

With `activations=True` the XLA trace also runs `enable_recompute(activations=True)` and lists
every segment (tf_relupool/segments.py): recomputed, or why it took stock's route, and for a
recomputed one the bytes of its output, which stock keeps for the next layer's gradient (an
upper bound of what XLA frees: it may keep a copy of its own), and every activation of the table
that starts no segment, with why (its input is kept by nothing else, say).

Routes available: the XLA route needs no op library; the graph pass does. Where the library is
missing (a no-compiler install, docs/install.md) the report says so on its first line, and the
"grappler" route lists no pairs.
"""
import collections

from tf_relupool import _loader, _state

Pair = collections.namedtuple("Pair", "route where fused reason bytes_saved")


class FusionReport:
    """The decisions of fusion_report (`pairs`: a list of dicts; str(): a Markdown table)."""

    def __init__(self, pairs, batch_size, routes=("xla", "grappler"), segments=None,
                 unavailable=None):
        self.pairs = pairs
        self.batch_size = batch_size
        self.routes = tuple(routes)
        self.segments = segments  # None, or [dicts] with activations=True
        #: {route: why it cannot run here} (the graph pass without the op library)
        self.unavailable = dict(unavailable or {})

    def available(self, route):
        """Whether `route` ("xla", "grappler") can fuse in this installation."""
        return route not in self.unavailable

    def fused(self, route):
        return [p for p in self.pairs if p["route"] == route and p["fused"]]

    def bytes_saved(self, route):
        return sum(p["bytes_saved"] or 0 for p in self.fused(route))

    def __str__(self):
        lines = ["Routes: " + "; ".join(
                     f"{r}: " + ("unavailable (below)" if r in self.unavailable else "available")
                     for r in ("xla", "grappler")),
                 f"Training step at batch {self.batch_size}:", "",
                 "| route | where | fused | why not | saved per step |", "|---|---|---|---|---|"]
        for p in self.pairs:
            saved = "" if p["bytes_saved"] is None else f"{p['bytes_saved'] / 2 ** 20:.2f} MiB"
            fused = "no" if not p["fused"] else (
                "yes" if p.get("activation") in (None, "Relu") else f"yes ({p['activation']})")
            lines.append(f"| {p['route']} | {p['where']} | {fused} | {p['reason'] or ''} | "
                         f"{saved} |")
        for route in self.routes:
            if route in self.unavailable:
                lines.append(f"\n{route}: unavailable, nothing fused: {self.unavailable[route]}")
                continue
            lines.append(f"\n{route}: {len(self.fused(route))} of "
                         f"{sum(p['route'] == route for p in self.pairs)} ReLU + max-pool "
                         f"pair(s) fused, {self.bytes_saved(route) / 2 ** 20:.2f} MiB saved per "
                         "step")
        if self.segments is not None:
            lines += ["", "Activations recomputed under XLA (enable_recompute(activations=True)):",
                      "", "| where | what | recomputed | why not | saved per step |",
                      "|---|---|---|---|---|"]
            for g in self.segments:
                saved = "" if g["bytes_saved"] is None else f"{g['bytes_saved'] / 2 ** 20:.2f} MiB"
                lines.append(f"| {g['where']} | {g['what']} | "
                             f"{'yes' if g['recomputed'] else 'no'} | {g['reason'] or ''} | "
                             f"{saved} |")
            done = [g for g in self.segments if g["recomputed"]]
            outside = sum(not g["segment"] for g in self.segments)
            lines.append(f"\n{len(done)} of {len(self.segments) - outside} segment(s) "
                         f"recomputed, {sum(g['bytes_saved'] or 0 for g in done) / 2 ** 20:.2f} "
                         f"MiB saved per step at most; {outside} activation(s) in no segment")
        return "\n".join(lines)

    __repr__ = __str__


def _step(model):
    """The model's training step: forward, a loss over its outputs, the weights' gradients."""
    import tensorflow as tf

    def step(x):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                             for o in tf.nest.flatten(out)])
        return tape.gradient(loss, model.trainable_variables)
    return step


def _spec(model, batch_size):
    import tensorflow as tf
    shape = model.input_shape
    if isinstance(shape, list) or not isinstance(shape, tuple):
        raise ValueError("fusion_report: `model` must have one input, got input shape "
                         f"{shape!r}")
    if any(d is None for d in shape[1:]):
        raise ValueError(f"fusion_report: the model's input shape {shape} has unknown "
                         "dimensions; build it with a fixed shape (keras.Input((32, 32, 3)))")
    return tf.TensorSpec((batch_size,) + tuple(shape[1:]), model.inputs[0].dtype)


def _xla_pairs(model, spec, keep, activations=False):
    """(pairs, segment rows) of the XLA trace; the rows are [] without `activations`."""
    import tensorflow as tf
    from tf_relupool import config, keras_fusion, segments
    with config.recompute(keep, activations=activations), keras_fusion.recording() as events, \
            segments.recording() as traced:
        tf.function(_step(model), jit_compile=True).get_concrete_function(spec)
    segment_rows = []
    for g in traced:
        out = g.output
        recomputed = g.route == "recomputed"
        segment_rows.append({
            "where": g.where, "what": g.name, "recomputed": recomputed,
            "segment": not isinstance(g, segments.Uncovered),
            "reason": None if recomputed else (g.route or "no gradient traced"),
            "bytes_saved": (out.shape.num_elements() * out.dtype.size
                            if recomputed and out.shape.is_fully_defined() else None)})
    pairs = []
    names = _layer_names(model)
    for e in events:
        saved = (e["pool_input_bytes"] - e["code_bytes"]
                 if e.get("pool_input_bytes") is not None else None)
        reason = e.get("reason")
        producer = _producer_layer(e.get("input_op"), names - {model.name})
        if reason and producer:
            reason = f"after layer {producer!r}: {reason}"
        pairs.append({"route": "xla", "where": e["scope"] or e.get("input_op") or "?",
                      "fused": e["fused"], "reason": reason,
                      "activation": e.get("activation"),
                      "bytes_saved": saved if e["fused"] else None})
    return pairs, segment_rows


def _layer_names(model):
    """The names of the model's layers, nested models' included."""
    names, todo = set(), [model]
    while todo:
        layer = todo.pop()
        names.add(layer.name)
        todo.extend(getattr(layer, "layers", []))
    return names


def _producer_layer(op_name, names):
    """The user's layer whose call made the op `op_name` ("functional_1/bn_1/batchnorm/add_1"
    -> "bn"): the first scope of the op's name that is a layer name, as it is or without the
    "_N" TensorFlow appends to a scope traced again; None if none is."""
    import re
    for part in (op_name or "").split("/")[:-1]:
        candidates = [part]
        while re.search(r"_\d+$", candidates[-1]):
            candidates.append(re.sub(r"_\d+$", "", candidates[-1]))
        for c in candidates:
            if c in names:
                return c
    return None


_POOLS = ("MaxPool", "MaxPoolV2")
_FUSED = ("ReluMaxPool", "ReluMaxPoolWithWindowArgmax")


def _grappler_pairs(model, spec, keep):
    import tensorflow as tf
    from tf_relupool import _clib
    concrete = tf.function(_step(model), jit_compile=False).get_concrete_function(spec)
    graph_def = concrete.graph.as_graph_def()
    before = {n.name: n for n in graph_def.node}
    pools = [n for n in graph_def.node if n.op in _POOLS]
    fused_count, data, log = _clib.rewrite_serialized_graph(
        graph_def.SerializeToString(), keep, preserve=[o.op.name for o in concrete.outputs])
    after = {}
    if data is not None:
        rewritten = tf.compat.v1.GraphDef()
        rewritten.ParseFromString(data)
        after = {n.name: n for n in rewritten.node}
    pairs = []
    for pool in pools:
        source = before.get(pool.input[0].split(":")[0].lstrip("^"))
        node = after.get(pool.name)
        fused = node is not None and node.op in _FUSED
        if not fused and data is not None and pool.name not in after:
            fused = any(n.op in _FUSED and pool.name in n.name for n in after.values())
        reason = None
        if not fused:
            mentions = [line for line in log if pool.name in line]
            if mentions:
                reason = mentions[0]
            elif source is not None and source.op not in ("Relu", "Pad", "PadV2"):
                reason = f"the pool's input comes from {source.op}, not a ReLU (or a zero Pad of one)"
            else:
                reason = ("left stock by the graph pass (tf_relupool.grappler.set_verbose() logs "
                          "its reasons)")
        saved = None
        if fused:
            shape = tf.TensorShape(concrete.graph.get_operation_by_name(pool.name).inputs[0].shape)
            out = tf.TensorShape(concrete.graph.get_operation_by_name(pool.name).outputs[0].shape)
            dtype = concrete.graph.get_operation_by_name(pool.name).inputs[0].dtype
            if shape.is_fully_defined() and out.is_fully_defined():
                saved = shape.num_elements() * dtype.size - out.num_elements()
        pairs.append({"route": "grappler", "where": pool.name.rsplit("/", 1)[0], "fused": fused,
                      "reason": reason, "bytes_saved": saved})
    return pairs


def fusion_report(model, batch_size=32, routes=("xla", "grappler"), keep="argmax",
                  activations=False):
    """What `enable_recompute(keep)` fuses in `model`'s training step, pair by pair (module doc).

    Args:
      model: a built Keras model with one input of known shape (batch aside).
      batch_size: the batch the step is traced at (bytes saved scale with it).
      routes: "xla" (Keras' default compile on a GPU), "grappler" (no XLA), or both.
      keep: the switch's mode, "argmax" (default) or "input".
      activations: also list the activation segments of enable_recompute(activations=True)
        (XLA route only).

    Returns:
      A FusionReport: `pairs` (route, where, fused, reason, bytes_saved) and a printable table.

    Raises:
      ValueError: a bad argument, named.
    """
    keep = _state.check_keep(keep, allow_bool=True)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"fusion_report: batch_size must be an int >= 1, got {batch_size!r}")
    routes = (routes,) if isinstance(routes, str) else tuple(routes)
    bad = [r for r in routes if r not in ("xla", "grappler")]
    if bad or not routes:
        raise ValueError(f"fusion_report: routes must be 'xla' and/or 'grappler', got {routes!r}")
    if not isinstance(activations, bool):
        raise ValueError(f"fusion_report: activations must be True or False, got {activations!r}")
    if activations and "xla" not in routes:
        raise ValueError("fusion_report: activations=True needs the 'xla' route (activations "
                         f"are recomputed under XLA only), got routes={routes!r}")
    spec = _spec(model, batch_size)
    pairs, segment_rows = [], None
    unavailable = {}
    try:
        _loader.load_library()
    except _loader.OpLibraryError as e:
        unavailable["grappler"] = str(e)
    if "xla" in routes:
        pairs, rows = _xla_pairs(model, spec, keep, activations)
        segment_rows = rows if activations else None
    if "grappler" in routes and "grappler" not in unavailable:
        pairs += _grappler_pairs(model, spec, keep)
    return FusionReport(pairs, batch_size, routes, segment_rows, unavailable)
