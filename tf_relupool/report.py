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

Rows name the model's own layers by their Keras path ("sequential/max_pooling2d": the model,
then the layer's name as `model.layers` gives it), on both routes: each op of the traced step is
mapped to the Keras layers being called when it was built. A function called on
the model's symbolic tensors (`keras.activations.swish(x)`, `keras.ops.nn.relu(x)`) is an
operation of the model's graph, and its rows name it ("functional/silu"). Reasons name the layer
an op comes from ("the pool's input comes from layer 'bn' (BatchNormalization, its op AddV2)"),
not the op alone.

Bytes saved per step, for a fused pair: the pool's input (the ReLU's output, or its padded
copy), which stock's graph keeps for the pool's backward, minus the one-byte codes the fused op
keeps instead, at the traced batch size. It counts those tensors, not XLA's allocation: XLA's
temporary buffer can change by more or by less (XLA decides which tensors it keeps, copies or
fuses, and reuses freed buffers); the report prints this (BYTES_NOTE), and
`python -m tf_relupool.measure` measures a step's peak.

3-D max pools: the XLA route fuses them; the graph pass covers 2-D pools only, and the
"grappler" route lists each 3-D pool as not fused, saying so (NOT_COVERED_3D).

With `activations=True` the XLA trace also runs `enable_recompute(activations=True)` and lists
every segment (tf_relupool/segments.py): recomputed, or why it took stock's route, and for a
recomputed one the bytes of its output, which stock keeps for the next layer's gradient (an
upper bound of what XLA frees: it may keep a copy of its own), and every activation of the table
that starts no segment, with why (its input is kept by nothing else, say). An activation whose
output a fused max pool reads (a ReLU or LeakyReLU before a pool) is listed as taken by that pool
fusion, with the pool's row named: the pool keeps one-byte codes instead of its output, and it
counts neither as a segment nor as an activation in no segment.

Routes available: the XLA route needs no op library; the graph pass does. Where the library is
missing (a no-compiler install, docs/install.md) the report says so on its first line, and the
"grappler" route lists no pairs.
"""
import collections
import contextlib
import re
import threading

from tf_relupool import _loader, _state

Pair = collections.namedtuple("Pair", "route where fused reason bytes_saved")


#: what the report's byte figures count, printed under its tables
BYTES_NOTE = (
    "Bytes: a fused pair's \"saved per step\" is the pool's input (the activation's output, or "
    "its padded copy) that stock's graph keeps for the pool's gradient, less the one byte per "
    "pooled element the fused op keeps instead, at the traced batch size; a recomputed "
    "segment's is its output's size, plus its convolution's output where that is recomputed "
    "too (at most what XLA frees: it may keep a copy of its own). "
    "They count those tensors only, not what XLA allocates: XLA's temporary buffer can change "
    "by more or by less (XLA decides which tensors it keeps, copies or fuses, and reuses freed "
    "buffers). python -m tf_relupool.measure measures a step's peak memory.")


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
                         "step (bytes below)")
            flat = sum(p["route"] == route and p.get("rank") == 3 for p in self.pairs)
            if flat:
                lines.append(f"{route}: {flat} 3-D max pool(s) not covered on this route (the "
                             "graph pass fuses 2-D pools only)")
        if self.segments is not None:
            convs = any(g.get("convolution") for g in self.segments)
            lines += ["", "Activations recomputed under XLA (enable_recompute(activations=True))" +
                      ("; convolution: memory_budget's plan for a conv -> BatchNormalization -> "
                       "activation block" if convs else "") + ":",
                      "", "| where | what | recomputed | why not | saved per step |" +
                      (" convolution |" if convs else ""),
                      "|---|---|---|---|---|" + ("---|" if convs else "")]
            for g in self.segments:
                saved = "" if g["bytes_saved"] is None else f"{g['bytes_saved'] / 2 ** 20:.2f} MiB"
                c = g.get("convolution")
                conv = "" if not c else (
                    f" {'recomputed' if c['recomputed'] else 'kept'}: "
                    f"{c['bytes'] / 2 ** 20:.2f} MiB, {c['flops'] / 1e6:.1f} MFLOP |")
                lines.append(f"| {g['where']} | {g['what']} | "
                             f"{'yes' if g['recomputed'] else 'no'} | {g['reason'] or ''} | "
                             f"{saved} |" + (conv or (" |" if convs else "")))
            done = [g for g in self.segments if g["recomputed"]]
            pooled = sum(bool(g.get("pool_fusion")) for g in self.segments)
            outside = sum(not g["segment"] and not g.get("pool_fusion") for g in self.segments)
            lines.append(f"\n{len(done)} of {len(self.segments) - outside - pooled} segment(s) "
                         f"recomputed, {sum(g['bytes_saved'] or 0 for g in done) / 2 ** 20:.2f} "
                         f"MiB saved per step at most; {outside} activation(s) in no segment" +
                         (f"; {pooled} taken by the ReLU + max-pool fusion" if pooled else ""))
        lines += ["", BYTES_NOTE]
        return "\n".join(lines)

    __repr__ = __str__


def _step(model, paths):
    """The model's training step: forward, a loss over its outputs, the weights' gradients.
    Tracing it fills `paths`: {op name: the Keras layers being called when the op was built}."""
    import tensorflow as tf
    from tf_relupool import _compat

    def step(x):
        graph = tf.compat.v1.get_default_graph()

        def built(op):
            if op.graph is graph:
                paths[op.name] = _compat.keras_layer_path()
        with _compat.tf_op_creation_callback(built):
            with tf.GradientTape() as tape:
                out = model(x, training=True)
                loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                                 for o in tf.nest.flatten(out)])
            return tape.gradient(loss, model.trainable_variables)
    return step


#: held by a report while it traces: one report at a time (the switch it sets is the process's)
_lock = threading.RLock()


@contextlib.contextmanager
def _operations_scoped(model):
    """While the block runs, each operation of the model's graphs that is not a layer (a function
    such as `keras.activations.swish` or `keras.ops.nn.relu` called on the model's symbolic
    tensors) is called inside a Keras name scope of its own name, so that what it builds is named
    "model/silu" as a layer's ops are, not after the model alone. The wrapped call computes what
    the operation's own does; each operation's `call` is put back when the block ends. Blocks are
    open one at a time (_lock): the operations are objects a model shares with every caller.
    Where this Keras exports no Operation or name_scope, nothing is wrapped."""
    import keras
    operation = getattr(keras, "Operation", None)
    if getattr(keras, "name_scope", None) is None:
        operation = None
    with _lock:
        patched = []
        try:
            for op in _objects(model).values():
                if (operation is None or not isinstance(op, operation)
                        or isinstance(op, keras.layers.Layer) or "call" in vars(op)):
                    continue
                original = op.call

                def call(*args, _op=op, _call=original, **kwargs):
                    with keras.name_scope(_op.name, caller=_op):
                        return _call(*args, **kwargs)
                op.call = call
                patched.append(op)
            yield
        finally:
            for op in patched:
                del op.call


def _objects(model):
    """{name: layer or operation} of the model's layers and the operations of its graphs, nested
    models' included."""
    found, seen, todo = {}, set(), [model]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        found.setdefault(obj.name, obj)
        todo.extend(getattr(obj, "layers", None) or [])
        todo.extend(getattr(obj, "operations", None) or [])
    return found


class _Names:
    """The model's own names for the ops of a traced step."""

    def __init__(self, model, paths):
        self.paths = paths
        self.objects = _objects(model)
        self.model = model.name

    def path(self, op_name):
        """The Keras layers being called when op `op_name` was built ("sequential/conv2d"), or
        None (an op outside every layer, or not seen)."""
        path = self.paths.get(op_name)
        return path if path and path != self.model else None

    def of(self, op_name, op_type=None):
        """The layer or operation that built op `op_name`, as a reason names it ("layer 'bn'
        (BatchNormalization)", with ", its op AddV2" given `op_type`), or None."""
        path = self.path(op_name)
        if path is None:
            return None
        import keras
        name = path.rsplit("/", 1)[-1]
        obj = self.objects.get(name)
        kind = "layer" if obj is None or isinstance(obj, keras.layers.Layer) else "operation"
        detail = [type(obj).__name__] if obj is not None else []
        if op_type:
            detail.append(f"its op {op_type}")
        return f"{kind} {name!r}" + (f" ({', '.join(detail)})" if detail else "")

    def replaced(self, text):
        """`text` (a line of the graph pass's log) with each op name in it
        ("sequential_1/conv2d_1/Relu") replaced by the Keras path of the layer that built it."""
        return re.sub(r"[\w./-]+", lambda m: self.path(m.group(0)) or m.group(0), text)


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


def _xla_pairs(model, spec, keep, activations=False, memory_budget=1):
    """(pairs, segment rows) of the XLA trace; the rows are [] without `activations`."""
    import tensorflow as tf
    from tf_relupool import config, conv_recompute, keras_fusion, segments
    paths = {}
    with config.recompute(keep, activations=activations, memory_budget=memory_budget), \
            keras_fusion.recording() as events, \
            segments.recording() as traced, _operations_scoped(model):
        tf.function(_step(model, paths), jit_compile=True).get_concrete_function(spec)
    names = _Names(model, paths)
    pairs, pooled = [], {}
    for e in events:
        saved = (e["pool_input_bytes"] - e["code_bytes"]
                 if e.get("pool_input_bytes") is not None else None)
        where = e["scope"] or e.get("input_op") or "?"
        if e["fused"]:
            pooled[e.get("input_op")] = where
        pairs.append({"route": "xla", "where": where, "fused": e["fused"],
                      "reason": _pool_reason(e.get("reason"), e.get("input_op"), names),
                      "activation": e.get("activation"),
                      "bytes_saved": saved if e["fused"] else None})
    segment_rows = []
    for g in traced:
        out = g.output
        recomputed = g.route == "recomputed"
        pool = pooled.get(getattr(getattr(out, "op", None), "name", None))
        if pool is not None and not recomputed:
            reason = (f"taken by the ReLU + max-pool fusion of {pool!r} (its row above): the "
                      "pool keeps one-byte codes for its gradient, not this output")
        else:
            reason = None if recomputed else _segment_reason(g, names)
        segment_rows.append({
            "where": g.where, "what": g.name, "recomputed": recomputed,
            "segment": not isinstance(g, segments.Uncovered),
            "pool_fusion": None if recomputed else pool,
            "reason": reason,
            "bytes_saved": (out.shape.num_elements() * out.dtype.size
                            if recomputed and out.shape.is_fully_defined() else None),
            "convolution": conv_recompute.convolution_row(g)})
        row = segment_rows[-1]
        if recomputed and row["convolution"] and row["convolution"]["recomputed"]:
            row["bytes_saved"] += row["convolution"]["bytes"]
    return pairs, segment_rows


def _pool_reason(reason, input_op, names):
    """A pool's reason, naming the layer its input comes from instead of that layer's last op."""
    if not reason:
        return reason
    m = re.match(r"the pool's input comes from (\w+),", reason)
    source = names.of(input_op, m.group(1) if m else None)
    if source is None:
        return reason
    if m:
        return f"the pool's input comes from {source},{reason[m.end():]}"
    return f"after {source}: {reason}"


def _segment_reason(g, names):
    """Why segment row `g` (segments.Segment or Uncovered) is not recomputed, naming the layers
    where its reason names an op: the consumer its output also feeds, the producer of its input."""
    reason = g.route or "no gradient traced"
    out = getattr(g, "output", None)
    m = re.search(r"output also feeds (\w+)$", reason)
    if m and out is not None:
        ours = getattr(g, "ops", set())
        for op in out.consumers():
            if op.type == m.group(1) and op.name not in ours:
                layer = names.of(op.name)
                if layer is not None:
                    return reason[:m.start(1)] + layer
                break
        return reason
    m = re.search(r"its input \(from (\w+)\)", reason)
    if m and out is not None:
        op = _ancestor(out.op, m.group(1))
        source = names.of(op.name, m.group(1)) if op is not None else None
        if source is not None:
            own = names.path(op.name) == g.where
            return (reason[:m.start()] +
                    (f"its input ({m.group(1)} inside the same layer, before its activation)"
                     if own else f"its input (from {source})") + reason[m.end():])
    return reason


def _ancestor(op, op_type, depth=8):
    """The nearest op of type `op_type` among `op`'s inputs, theirs, ... (breadth first, at most
    `depth` ops deep), or None."""
    level, seen = [op], set()
    for _ in range(depth):
        level = [t.op for o in level for t in o.inputs if t.op.name not in seen]
        for o in level:
            seen.add(o.name)
            if o.type == op_type:
                return o
    return None


_POOLS = ("MaxPool", "MaxPoolV2")
_POOLS_3D = ("MaxPool3D",)
_FUSED = ("ReluMaxPool", "ReluMaxPoolWithWindowArgmax")
#: a 3-D max pool's row on the Grappler route
NOT_COVERED_3D = ("a 3-D max pool (MaxPool3D): the graph pass covers 2-D pools only; without "
                  "XLA it runs stock's ops (the \"xla\" route covers 3-D pools)")


def _grappler_pairs(model, spec, keep):
    import tensorflow as tf
    from tf_relupool import _clib
    paths = {}
    with _operations_scoped(model):
        concrete = tf.function(_step(model, paths),
                               jit_compile=False).get_concrete_function(spec)
    names = _Names(model, paths)
    graph_def = concrete.graph.as_graph_def()
    before = {n.name: n for n in graph_def.node}
    pools = [n for n in graph_def.node if n.op in _POOLS + _POOLS_3D]
    fused_count, data, log = _clib.rewrite_serialized_graph(
        graph_def.SerializeToString(), keep, preserve=[o.op.name for o in concrete.outputs])
    after = {}
    if data is not None:
        rewritten = tf.compat.v1.GraphDef()
        rewritten.ParseFromString(data)
        after = {n.name: n for n in rewritten.node}
    pairs = []
    for pool in pools:
        source_name = pool.input[0].split(":")[0].lstrip("^")
        source = before.get(source_name)
        node = after.get(pool.name)
        fused = node is not None and node.op in _FUSED
        if not fused and data is not None and pool.name not in after:
            fused = any(n.op in _FUSED and pool.name in n.name for n in after.values())
        reason = None
        if not fused:
            mentions = [line for line in log if pool.name in line]
            if pool.op in _POOLS_3D:
                reason = NOT_COVERED_3D
            elif mentions:
                reason = names.replaced(mentions[0])
            elif source is not None and source.op not in ("Relu", "Pad", "PadV2"):
                reason = (f"the pool's input comes from "
                          f"{names.of(source_name, source.op) or source.op}, not a ReLU (or a "
                          "zero Pad of one)")
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
        pairs.append({"route": "grappler",
                      "where": names.path(pool.name) or pool.name.rsplit("/", 1)[0],
                      "fused": fused, "reason": reason, "bytes_saved": saved,
                      "rank": 3 if pool.op in _POOLS_3D else 2})
    return pairs


def fusion_report(model, batch_size=32, routes=("xla", "grappler"), keep="argmax",
                  activations=False, memory_budget=None):
    """What `enable_recompute(keep)` fuses in `model`'s training step, pair by pair (module doc).

    Calls on several threads run one at a time: each sets the process's switch while it traces,
    and puts it back.

    Args:
      model: a built Keras model with one input of known shape (batch aside).
      batch_size: the batch the step is traced at (bytes saved scale with it).
      routes: "xla" (Keras' default compile on a GPU), "grappler" (no XLA), or both.
      keep: the switch's mode, "argmax" (default) or "input".
      activations: also list the activation segments of enable_recompute(activations=True)
        (XLA route only).
      memory_budget: None, or a number in [0, 1]: list the segments of
        enable_recompute(memory_budget=...) (XLA route only), each block's convolution with the
        plan's choice (recomputed or kept), its output's bytes and the recomputation's FLOPs.

    Returns:
      A FusionReport: `pairs` (dicts: route, where (the pool's Keras path), fused, reason (why
      not, naming the model's layers), bytes_saved; "xla" pairs also activation, "grappler"
      pairs rank, 3 for a 3-D pool, else 2), `segments` with `activations` (dicts: where, what,
      recomputed, segment, pool_fusion (the fused pool's path where a pool fusion took the
      activation, else None), reason, bytes_saved, convolution (None, or for a block under
      memory_budget: recomputed, bytes, flops)) and a printable table.

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
    if memory_budget is not None:
        from tf_relupool import config
        try:
            memory_budget = config.check_memory_budget(memory_budget)
        except ValueError as e:
            raise ValueError(f"fusion_report: {e}") from None
        activations = True
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
    with _lock:
        if "xla" in routes:
            pairs, rows = _xla_pairs(model, spec, keep, activations,
                                     1 if memory_budget is None else memory_budget)
            segment_rows = rows if activations else None
        if "grappler" in routes and "grappler" not in unavailable:
            pairs += _grappler_pairs(model, spec, keep)
    return FusionReport(pairs, batch_size, routes, segment_rows, unavailable)
