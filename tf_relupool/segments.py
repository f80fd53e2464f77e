"""Activations recomputed in the backward pass under XLA: `enable_recompute(activations=True)`.

In stock training a conv -> BatchNormalization -> activation -> conv block keeps, for the
backward pass, the BN input z (BN's own gradient reads it), the activation's output a (the next
conv's kernel gradient reads it) and, for activations such as swish, a value inside the
activation (its gradient reads it; XLA keeps what it cannot fuse twice). With the switch's
`activations=True`, inside XLA-compiled functions, a and those values are recomputed in the
backward pass from z and BN's per-channel `inv`/`shift` (and an SE gate, a kept shortcut)
instead. What is covered is data (tf_relupool/segment_table.py): the activations, what a segment
starts from, and the consumers whose gradient would keep its output.

While the switch is on with `activations=True`, trace-time hooks are installed (removed when it
turns off; tf_relupool/_hooks.py):

- `keras.layers.BatchNormalization.call`: after stock's call, a covered BN (training, trainable,
  no renorm, not synchronized, no mask, the input's dtype the layer's compute dtype) has its
  output y registered with the tensors stock's `tf.nn.batch_normalization` made:
  y = z * inv + shift (read off the traced graph: stock's ops; the moving statistics are stock's
  call's). Under mixed precision y = cast(z32 * inv + shift), z32 stock's float32 cast of the
  input, which is what is registered;
- each activation of the table: where its input u is covered (a registered y, an `Add` of one
  with a tensor of the same shape, or another segment's output), its output becomes G's, a
  `tf.custom_gradient` whose forward is stock's call on u;
- the gate multiply (`layers.Multiply`, `ops.multiply`) of a segment's output and a per-channel
  gate: G again, its forward stock's multiply; a multiply x * h(x) of a covered x, h a chain of
  segment_table.COMPOSITES (Keras 2's hard swish): G of x, whose forward is stock's multiply of
  x and the traced h(x), and whose recomputation replays h's ops on the recomputed x;
- each consumer of the table (convolutions, Dense's matmul) of a G output becomes C, a custom
  gradient whose forward is stock's call and whose backward recomputes G's output from the
  segment's kept inputs for the kernel's gradient (the input's gradient needs the kernel alone).

G's gradient is always stock's gradient function of its op, given to its traced input u, from
where the tape goes on through stock's ops (so gradients with respect to u, or summed there from
several consumers, are stock's). On the recompute route the values that gradient reads come from
u recomputed from the segment's kept inputs instead of the forward's copy; for activations marked
`hold` that recomputation runs behind the barrier. C's recomputation always does. Only the
full-size inputs and a consumer's kernels are held; BN's per-channel inv/shift and a gate stay
free (held, their arithmetic fused otherwise and the bits changed). The barrier:
XLA's optimization barrier on a GPU; on the CPU, whose pipeline deletes that barrier before
fusion and scheduling, `select(p, x, 0)` of every recomputation input, where p is a tautology read
from the incoming gradient ((e == e) | (e != e)), exact for every value.
`TF_RELUPOOL_BN_RELU_BARRIER` ("xla", "select", default "auto": "xla" where a GPU is visible and
TensorFlow registers the op) picks it.

A segment recomputes only where its output's consumers are C's, other segments, or ops whose
gradient reads none of their inputs (Add, Mean), and its input feeds nothing else; otherwise G
and its C's take stock's route: stock's gradient from the forward's values, stock's graph (the
step XLA compiles is stock's). The decision is made when the gradient is traced, when every
consumer is known. A ReLU (default arguments) that feeds a max pool stays with the switch's pool
fusion (keras_fusion asks `relu_input`).

XLA only: outside XLA-compiled functions nothing here applies (the Grappler pass does not
recompute activations).
"""
import collections
import functools
import logging
import os
import weakref

from tf_relupool import _reentry, _state, gradient_sources, segment_table
from tf_relupool._hooks import Hooks

logger = logging.getLogger("tf_relupool")

BARRIER_ENV_VAR = "TF_RELUPOOL_BN_RELU_BARRIER"
BARRIERS = ("auto", "xla", "select")

_hooks = Hooks()  # the table's Keras functions while the recomputation is on
_stats = collections.Counter()
_DTYPES = ("float16", "bfloat16", "float32", "float64")


class _Graphs:
    """Per traced graph (weakly held): the registered BN outputs, the segments by G's output,
    and the names of the ops the segments made (G's and C's)."""

    def __init__(self):
        self._by_graph = weakref.WeakKeyDictionary()

    def of(self, graph):
        entry = self._by_graph.get(graph)
        if entry is None:
            entry = self._by_graph[graph] = dict(bn={}, bn_in={}, conv={}, segments={},
                                                      ops=set(), held_roots={})
        return entry


_graphs = _Graphs()


def stats():
    """Counts since import: {"segments": G's built at trace time, "convs": C's built,
    "recomputed": G gradients traced with the recomputation, "stock": G gradients traced on
    stock's route, "stock_reasons": {reason: n}, "by_activation": {name: G's built}}."""
    out = {k: _stats[k] for k in ("segments", "convs", "recomputed", "stock")}
    out["stock_reasons"] = {k[len("stock:"):]: v for k, v in _stats.items()
                            if k.startswith("stock:")}
    out["by_activation"] = {k[len("act:"):]: v for k, v in _stats.items() if k.startswith("act:")}
    return out


def installed():
    """Whether the hooks are installed now."""
    return _hooks.installed()


def _owners():
    """{owner name of segment_table: object} in this Keras; {} without Keras 3's TensorFlow
    backend."""
    from tf_relupool import _compat
    backend = _compat.keras_tf_backend()
    if not backend:
        return {}
    import keras
    return dict(backend, **_compat.keras_activation_classes(),
                BatchNormalization=keras.layers.BatchNormalization)


def _targets():
    """[(owner, attribute, wrapper factory)] of the hooks (module doc)."""
    owners = _owners()
    if not owners:
        return []
    out = [(owners["BatchNormalization"], "call", _bn_call_wrapper)]
    seen = set()
    for row in segment_table.ACTIVATIONS:
        owner = owners.get(row.owner)
        if owner is None or row.attr not in owner.__dict__ or (row.owner, row.attr) in seen:
            continue
        seen.add((row.owner, row.attr))
        out.append((owner, row.attr, functools.partial(_activation_wrapper, row)))
    for row in segment_table.EXTENDERS:
        owner = owners.get(row.owner)
        if owner is not None and row.attr in owner.__dict__:
            out.append((owner, row.attr, _EXTENDER_WRAPPERS[row.name]))
    for row in segment_table.CONSUMERS:
        owner = owners.get(row.owner)
        if owner is not None and row.attr in owner.__dict__:
            out.append((owner, row.attr, functools.partial(_consumer_wrapper, row)))
    return out


def set_enabled(on):
    """Installs (on) or removes (off) the hooks, and requires (or releases) the tape wrapper
    their gradient-source check reads (gradient_sources); config calls it when the switch's
    activation part (_state.activations(), which the hooks read when traced) changes. Removing
    restores each original unless something else replaced it since (that stays). After an
    install, a probe traces a tiny conv -> BN -> ReLU -> conv inside
    tf.function(jit_compile=True) (no compilation) and warns where Keras' calls did not reach the
    hooks."""
    gradient_sources.require("segments", on)
    if not on:
        _hooks.remove()
    elif _hooks.install(_targets()):
        _check_dispatch()


def _check_dispatch():
    """The probe of set_enabled: one segment at the ReLU and one C at the Conv2D after it."""
    import tensorflow as tf
    from keras import layers
    saved = collections.Counter(_stats)
    # named: Keras' automatic layer names stay as they were; float32: a mixed-precision policy
    # would not be covered; constant initializers: a random one takes its seed from Python's
    # `random` when constructed (keras.random.make_default_seed), which would move the user's
    # seeded experiment
    kw = dict(dtype="float32")
    conv = dict(kernel_initializer="ones", bias_initializer="zeros", **kw)
    conv1 = layers.Conv2D(2, 1, use_bias=False, name="tf_relupool_probe_conv1", **conv)
    bn = layers.BatchNormalization(name="tf_relupool_probe_bn", **kw)
    relu = layers.ReLU(name="tf_relupool_probe_relu", **kw)
    conv2 = layers.Conv2D(2, 1, name="tf_relupool_probe_conv2", **conv)
    counts = {}

    def block(x):  # traced once for both paths (Hooks.probe)
        before = collections.Counter(_stats)
        out = conv2(relu(bn(conv1(x), training=True)))
        counts.update(segments=_stats["segments"] - before["segments"],
                      convs=_stats["convs"] - before["convs"])
        return out
    try:
        _hooks.probe("keras", {
            "a ReLU after BatchNormalization (no segment there)":
                (block, tf.TensorSpec([1, 2, 2, 2]), lambda: counts.get("segments", 0) > 0),
            "the Conv2D after it (no recomputing consumer there)":
                (block, tf.TensorSpec([1, 2, 2, 2]), lambda: counts.get("convs", 0) > 0)},
            "BatchNorm and activations run stock's ops there under "
            "enable_recompute(activations=True)")
    finally:
        _stats.clear()
        _stats.update(saved)


def _active():
    if not _state.activations():
        return False
    from tf_relupool import xla
    return xla.in_xla_context()


def graph_entry(t):
    """The segments' record of the graph `t` is traced in (segments, BN outputs, convolutions,
    held roots), or None for an eager tensor."""
    graph = getattr(t, "graph", None)
    return None if graph is None else _graphs.of(graph)


class _Ours:
    """Records the ops made inside the block as the segments' own (G's and C's, forward and
    backward), so that the consumer checks see only the model's ops."""

    def __init__(self, graph):
        self.graph = graph
        self.new = set()

    def __enter__(self):
        self._count = len(self.graph.get_operations())
        return self

    def __exit__(self, *exc):
        self.new = {op.name for op in self.graph.get_operations()[self._count:]}
        _graphs.of(self.graph)["ops"].update(self.new)


#: inside an activation hook's stock call: the hooks it reaches pass through
_stock_call = _reentry.Reentry()


# ------------------------------------------------------------------------- BatchNormalization

def _covered_bn(layer, inputs, training, mask):
    """Why this BatchNormalization call is not covered, or None where it is."""
    if training is not True or not layer.trainable:
        return "not training"
    if getattr(layer, "renorm", False):
        return "renorm"
    if getattr(layer, "synchronized", False):
        return "synchronized"
    if mask is not None:
        return "mask"
    dtype = getattr(getattr(inputs, "dtype", None), "name", None)
    if dtype not in _DTYPES or layer.compute_dtype != dtype:
        return "dtype"
    return None


def _bn_call_wrapper(original):
    @functools.wraps(original)
    def call(self, inputs, training=None, mask=None):
        outputs = original(self, inputs, training=training, mask=mask)
        if _active() and _covered_bn(self, inputs, training, mask) is None:
            _register_bn(inputs, outputs)
        return outputs
    call._tf_relupool_wraps = original
    return call


def _register_bn(z, y):
    """Registers y = z * inv + shift (stock's tf.nn.batch_normalization as traced), or, for a
    float16/bfloat16 input (mixed precision), y = cast(cast(z, float32) * inv + shift): then the
    registered z is stock's float32 cast of the input."""
    import tensorflow as tf
    if not (isinstance(y, tf.Tensor) and isinstance(z, tf.Tensor)) or y.shape.rank is None:
        return
    norm = y.op.inputs[0] if y.op.type == "Cast" else y
    if norm.op.type != "AddV2" or norm.op.inputs[0].op.type != "Mul":
        return
    mul = norm.op.inputs[0].op
    z_in = mul.inputs[0]
    if norm is not y:  # mixed precision: z_in must be stock's cast of the BN input
        if z_in.op.type != "Cast" or z_in.op.inputs[0].name != z.name or y.dtype != z.dtype:
            return
    elif z_in.name != z.name:
        return
    inv, shift = mul.inputs[1], norm.op.inputs[1]
    if not (y.shape.is_fully_defined() and z_in.shape == y.shape
            and inv.dtype == z_in.dtype and shift.dtype == z_in.dtype):
        return
    graph_entry(y)["bn"][y.name] = (z_in, inv, shift)
    graph_entry(y)["bn_in"][y.name] = z


# ------------------------------------------------------------------------- sources

class Source:
    """How a segment's input u is recomputed from tensors kept anyway: `roots` and
    `value(roots)` (stock's ops in stock's order), and the tensors the chain skips."""

    def __init__(self, roots, value, skipped, shortcut=False):
        self.roots = list(roots)
        self.value = value
        self.skipped = tuple(skipped)
        self.shortcut = shortcut  # a kept full-size tensor (an Add's shortcut) among the roots


def _bn_value(y):
    """value(z, inv, shift) of a registered BN output y: z * inv + shift, cast to y's dtype under
    mixed precision as stock casts it."""
    import tensorflow as tf

    def value(ts):
        v = ts[0] * ts[1] + ts[2]
        return v if v.dtype == y.dtype else tf.cast(v, y.dtype)
    return value


def _source(u):
    """A Source for u (a registered BN output, an Add of one and a same-shaped tensor, another
    segment's output), or None where u is not covered."""
    import tensorflow as tf
    if not isinstance(u, tf.Tensor) or not u.shape.is_fully_defined():
        return None
    entry = graph_entry(u)
    seg = entry["segments"].get(u.name)
    if seg is not None:
        return seg.as_source()
    bns = entry["bn"]
    if u.name in bns:
        return Source(bns[u.name], _bn_value(u), (u,))
    if u.op.type not in ("AddV2", "Add") or len(u.op.inputs) != 2:
        return None
    parts, roots = [], []
    for t in u.op.inputs:
        if t.shape != u.shape or t.dtype != u.dtype:
            return None
        if t.name in bns and not any(p[0] == "bn" and p[1] is t for p in parts):
            parts.append(("bn", t, len(roots)))
            roots += list(bns[t.name])
        else:
            parts.append(("keep", t, len(roots)))
            roots.append(t)
    if not any(p[0] == "bn" for p in parts):
        return None

    def value(ts):
        vals = [_bn_value(t)(ts[i:i + 3]) if kind == "bn" else ts[i] for kind, t, i in parts]
        return vals[0] + vals[1]
    return Source(roots, value, tuple(p[1] for p in parts if p[0] == "bn") + (u,),
                  any(p[0] == "keep" for p in parts))


def _identity_source(u):
    """PRODUCERS' identity: u itself kept (an activation whose gradient reads its input keeps
    it anyway), or None for a tensor of unknown shape, not floating point, or per-channel (an SE
    block's squeeze, [N, 1, 1, C]: nothing worth recomputing)."""
    import tensorflow as tf
    if (not isinstance(u, tf.Tensor) or not u.shape.is_fully_defined() or u.shape.rank < 2
            or not u.dtype.is_floating
            or (u.shape.rank > 2 and sum(d > 1 for d in u.shape[1:]) <= 1)):
        return None
    return Source([u], lambda ts: ts[0], ())


# ------------------------------------------------------------------------- G

class Segment:
    """One traced G: its op (stock's call) applied to its input u, and how its output is
    recomputed from the kept roots."""

    def __init__(self, name, source, op, hold, extra=(), side=(), again=None):
        self.name = name            # the activation's table name, or "gate"
        self.source = source        # how u is recomputed
        self.op = op                # op(u_value, *extra_values): stock's call
        # G's recomputation behind the barrier; not with a kept shortcut among the roots (held,
        # it changed the fusion of an identity block's sum and its bits: docs/activations.md)
        self.hold = hold and not source.shortcut
        self.extra = list(extra)    # kept tensors the op reads besides u (the gate)
        # tensors G's forward reads after those, recomputed instead (again(u, *extra): the op
        # with them recomputed from u; COMPOSITES' h(x)); stock's route passes their gradients on
        self.side = list(side)
        self.again = again or op
        self.roots = source.roots + self.extra
        self.skipped = source.skipped
        self.u = None               # the traced input
        self.output = None          # G's output, what every consumer reads
        self.inner = None           # stock's op output inside G (activation_output)
        self.ops = set()            # the names of G's forward ops
        self.where = ""             # the Keras layers being called when it was traced
        self.route = None           # "recomputed" or stock's reason, once its gradient is traced
        self.unread = ()            # ops whose outputs only G reads (COMPOSITES' h)

    def held(self):
        """Whether G's recomputation runs behind the barrier: the table's `hold`, except where
        the roots hold a kept shortcut or the output feeds an Add (a residual sum) or a Mul (an
        SE gate): held there, an identity block's fusion of that sum and its bits changed, and
        MobileNetV3Small's (a ReLU into an SE gate; docs/activations.md, "Exactness")."""
        return self.hold and not any(op.type in ("AddV2", "Add", "Mul")
                                     for op in self.output.consumers())

    @property
    def default_relu(self):
        """A ReLU with default arguments (relu_input: what the pool fusion takes)."""
        return self.name == "relu"

    @property
    def activation_input(self):
        """The tensor the activation's stock call reads in G's forward: u."""
        return self.u

    def recomputed_gradients(self, roots, u_in, extra, n_side, da):
        """The recompute route's gradients of G's output (its incoming gradient da) with
        respect to u, the extra inputs and the n_side side inputs: the op's output recomputed
        from the source's `roots` (behind the barrier where held()) and differentiated with
        stock's gradient functions; the side inputs get none."""
        import tensorflow as tf
        held = hold(roots, [da], free=small_roots(roots, u_in))[0] if self.held() else roots
        with tf.GradientTape() as tape:
            u2 = self.source.value(held)
            tape.watch([u2] + extra)
            a2 = self.again(u2, *extra)
        return tape.gradient(a2, [u2] + extra, output_gradients=da) + [None] * n_side

    def as_source(self):
        """The Source of an op applied to this segment's output (a chain)."""
        return Source(self.roots, self.value, self.skipped + (self.output,),
                      self.source.shortcut)

    def value(self, ts):
        """The segment's output recomputed from roots `ts`."""
        n = len(self.source.roots)
        return self.again(self.source.value(ts[:n]), *ts[n:])

    def _other_consumers_of_u(self, entry):
        """The ops reading u besides this G's own: the model's, or another segment's G (a C's
        recomputation reads u where u is a root itself: PRODUCERS' identity)."""
        g_ops = set().union(*(seg.ops for seg in entry["segments"].values()))
        c_ops = entry["ops"] - g_ops
        return {op.name for op in self.u.consumers()} - self.ops - c_ops

    def _chain_skipped(self):
        """The skipped tensors inside this segment's chain whose other readers send it to
        stock's route."""
        return self.skipped[:-1]

    def stock_reason(self):
        """Why this segment's gradient must be stock's (module doc), or None. Asked by G and by
        every C of the segment: on stock's route neither recomputes, and XLA compiles stock's
        step."""
        entry = graph_entry(self.output)
        ours = entry["ops"]
        if any(c.name not in self.ops for op in self.unread for c in op.outputs[0].consumers()):
            return f"the {self.name}'s h(x) also feeds other ops"
        for op in self.output.consumers():
            if op.name not in ours and op.type not in segment_table.KEEP_NOTHING:
                return f"the {self.name} output also feeds " + op.type
        if self.name == "gate":  # x also feeds the squeeze (a Mean): x is recomputed for both
            if any(op.name not in ours and op.type not in segment_table.KEEP_NOTHING
                   for op in self.u.consumers()):
                return "the gated tensor also feeds other ops"
        elif self._other_consumers_of_u(entry):  # another
            # another segment's G too: stock sums their
            # gradients at u, and XLA's fusion of that sum decides the bits
            return f"the {self.name} input feeds other ops"
        for t in self._chain_skipped():
            if t.name in entry["bn"] and any(op.name != self.u.op.name and op.name not in ours
                                             for op in t.consumers()):
                return "a BN output feeds other ops"
        if gradient_sources.route(self.skipped + (self.u,)) != gradient_sources.FUSED:
            return "the gradient is taken with respect to a skipped tensor, or unknown"
        return None


def segment_of(t):
    """The segment whose output `t` is, else None."""
    entry = graph_entry(t)
    return None if entry is None else entry["segments"].get(getattr(t, "name", None))


def relu_input(t):
    """The ReLU's traced input where `t` is the output of a segment of a ReLU with default
    arguments, else None: the switch's pool fusion treats G's output as a Relu of it
    (keras_fusion)."""
    seg = segment_of(t)
    return seg.activation_input if seg is not None and seg.default_relu else None


def activation_output(t):
    """Stock's activation output inside G where `t` is the output of a segment of one activation
    op applied to the segment's input (no gate, no pad), else None: the pool fusion reads that
    op, as it would outside a segment (keras_fusion)."""
    seg = segment_of(t)
    inner = getattr(seg, "inner", None)
    if (inner is None or not inner.op.inputs
            or inner.op.inputs[0].name != seg.activation_input.name):
        return None
    return inner


_recorder = _reentry.Recorder()


def recording():
    """Collects, on this thread, the segments traced while the block runs (a list of Segment:
    `.name`, `.where` (the Keras layers being called), `.route` ("recomputed", a reason, or None
    where no gradient was traced), `.output`); tf_relupool.fusion_report reads it."""
    return _recorder.recording()


def segment_output(seg, u):
    """G's output for seg applied to the traced input u (module doc)."""
    import tensorflow as tf
    from tf_relupool import _compat
    n = len(seg.roots)
    seg.u = u
    seg.where = _compat.keras_layer_path() or u.op.name
    _recorder.add(seg)

    @tf.custom_gradient
    def g(*args):
        ts, u_in, side = list(args[:n]), args[n], list(args[n + 1:])
        extra = ts[len(seg.source.roots):]
        with tf.GradientTape(persistent=True) as forward:
            forward.watch([u_in] + extra + side)
            out = seg.op(u_in, *extra, *side)
        seg.inner = out if isinstance(out, tf.Tensor) else None

        def grad(da):
            with _Ours(da.graph):
                return _grad(da)

        def _grad(da):
            reason = seg.stock_reason()
            seg.route = reason or "recomputed"
            if reason is None:
                _stats["recomputed"] += 1
                grads = seg.recomputed_gradients(ts[:len(seg.source.roots)], u_in, extra,
                                                 len(side), da)
            else:
                _stats["stock"] += 1
                _stats["stock:" + reason] += 1
                grads = forward.gradient(out, [u_in] + extra + side, output_gradients=da)
            k = 1 + len(extra)
            du, dextra, dside = grads[0], list(grads[1:k]), list(grads[k:])
            return [None] * (n - len(extra)) + dextra + [du] + dside

        return out, grad

    with _Ours(u.graph) as ours:
        seg.output = g(*seg.roots, u, *seg.side)
    seg.ops = ours.new
    graph_entry(u)["segments"][seg.output.name] = seg
    _stats["segments"] += 1
    _stats["act:" + seg.name] += 1
    return seg.output


#: a study lever: "all", or names of segment_table rows (and "gate"), comma-separated, whose G's
#: recomputation is held whatever the table says; "none": no G held
HOLD_ENV_VAR = "TF_RELUPOOL_SEGMENT_HOLD"


def _hold_g(name, hold):
    """The table's `hold` for the row `name`, unless HOLD_ENV_VAR says otherwise."""
    value = os.environ.get(HOLD_ENV_VAR, "").strip().lower()
    if not value:
        return hold
    names = {v.strip() for v in value.split(",")}
    return "all" in names or name in names


_RELU_ARGS = ("negative_slope", "max_value", "threshold")  # ReLU.static_call's, in order


def _relu_name(row, args, kwargs):
    """The table's name, or for ReLU's static_call the form its arguments make: "relu" only
    with default arguments (the one the pool fusion takes), "relu6", "relu(max_value)",
    "relu(negative_slope, threshold)"."""
    if row.owner != "ReLU":
        return row.name
    given = dict(zip(_RELU_ARGS, args), **kwargs)
    slope, top, threshold = (given.get(k) for k in _RELU_ARGS)
    if not slope and not threshold and top is not None:
        return "relu6" if top == 6 else "relu(max_value)"
    return "relu" if not (slope or threshold) else "relu(negative_slope, threshold)"


def _activation_wrapper(row, original):
    fn = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(fn)
    def activation(x, *args, **kwargs):
        def stock(t):
            with _stock_call:
                return fn(t, *args, **kwargs)
        if not _stock_call.active() and _active():
            source = _source(x)
            if source is None and row.reads_input:
                source = _identity_source(x)
            name = _relu_name(row, args, kwargs)
            if source is not None and _state.memory_budget() < 1 and not row.reads_input:
                from tf_relupool import conv_recompute  # it builds on this module
                out = conv_recompute.block(graph_entry(x), x, stock, "conv+bn+" + name, source,
                                           _hold_g(row.name, row.hold))
                if out is not None:
                    return out
            if source is not None:
                seg = Segment(name, source, stock, _hold_g(row.name, row.hold))
                out = segment_output(seg, x)
                if row.attr == "sigmoid":  # Keras' sigmoid marks its output with its logits
                    from tf_relupool import _compat
                    _compat.keras_mark_logits(out, x)
                return out
            out = stock(x)
            _record_uncovered(name, x, row, out)
            return out
        return stock(x)
    return staticmethod(activation) if isinstance(original, staticmethod) else activation


Uncovered = collections.namedtuple("Uncovered", "name where route output")


def _record_uncovered(name, u, row, out):
    """For fusion_report: an activation of the table that starts no segment, and why."""
    import tensorflow as tf
    from tf_relupool import _compat
    if not _recorder.active():
        return
    if not isinstance(u, tf.Tensor) or not u.shape.is_fully_defined():
        why = "its input's shape is not fully known at trace time"
    elif row.reads_input and u.dtype.is_floating and u.shape.rank > 2:
        why = "its input is per-channel (an SE block's squeeze): nothing worth recomputing"
    else:
        op = u.op.type
        why = (f"its input (from {op}) is kept by nothing else: a segment starts at a "
               "BatchNormalization output, an Add of one, or another segment's output" +
               (", or any full-size input" if row.reads_input else
                "; recomputing from it would keep it instead of the output"))
    _recorder.add(Uncovered(name, _compat.keras_layer_path() or getattr(u, "name", "?"),
                            "not in a segment: " + why, out))


def _per_channel(gate, x):
    """Whether `gate` broadcasts over x's batch and spatial dimensions per channel ([N, 1, .., C]
    or [N, C, 1, ..]): a squeeze-and-excitation gate."""
    gs, xs = gate.shape, x.shape
    if gs.rank != xs.rank or not gs.is_fully_defined() or gs.rank < 3:
        return False
    dims = [d for d in range(gs.rank) if gs[d] != 1]
    return all(gs[d] == xs[d] for d in dims) and len(dims) <= 2 and gs.num_elements() < (
        xs.num_elements())


def _activation_row(name):
    return next(r for r in segment_table.ACTIVATIONS if r.name == name)


def _scalar_const(t):
    return t.op.type == "Const" and t.shape.rank == 0


def _composite_chain(x, h):
    """(row, [h's ops from x on]) where h is a COMPOSITES row's chain applied to x alone (each
    step's other operand a scalar constant, each step read by the next alone), else None."""
    ops, t = [], h
    while t.name != x.name:
        op = t.op
        rest = [i for i in op.inputs if not _scalar_const(i)]
        if len(rest) != 1 or len(ops) > 8 or (ops and len(t.consumers()) != 1):
            return None
        ops.insert(0, op)
        t = rest[0]
    chain = tuple(op.type for op in ops)
    row = next((r for r in segment_table.COMPOSITES if r.chain == chain), None)
    return None if row is None else (row, ops)


def _replay(ops, u):
    """ops (an elementwise chain from a tensor x), applied to u instead: stock's op types,
    constants and operand order."""
    import tensorflow as tf
    t = u
    for op in ops:
        args = [t if not _scalar_const(i) else i for i in op.inputs]
        t = getattr(tf.raw_ops, op.type)(**{a.name: v for a, v in zip(op.op_def.input_arg, args)})
    return t


def _composite(x1, x2, original):
    """A COMPOSITES row's product x * h(x) of a covered x: its segment's output, else None."""
    for x, h, first in ((x1, x2, True), (x2, x1, False)):
        if x.shape != h.shape:
            continue
        found = _composite_chain(x, h)  # the op-type walk first: cheaper than _source
        if found is None:
            continue
        source = _source(x)
        if source is None:
            continue
        row, ops = found

        def op(u, hu, first=first):
            with _stock_call:
                return original(u, hu) if first else original(hu, u)

        def again(u, ops=ops, op=op):  # h(u) recomputed: the chain replayed on u
            with _stock_call:
                return op(u, _replay(ops, u))
        held_g = _hold_g(row.name, _activation_row(row.name).hold)
        out = segment_output(Segment(row.name, source, op, held_g, side=[h], again=again), x)
        seg = segment_of(out)
        seg.ops |= {o.name for o in ops}  # h's ops: x's readers that are the segment's own
        seg.unread = ops
        _recorder.discard(lambda e: isinstance(e, Uncovered) and any(
            getattr(e.output, "name", None) == o.outputs[0].name for o in ops))
        return out
    return None


def _gate_wrapper(original):
    @functools.wraps(original)
    def multiply(x1, x2):
        import tensorflow as tf
        if not _stock_call.active() and _active() and isinstance(x1, tf.Tensor) and isinstance(
                x2, tf.Tensor) and x1.dtype == x2.dtype:
            for x, gate, first in ((x1, x2, True), (x2, x1, False)):
                prev = segment_of(x)
                if prev is not None and _per_channel(gate, x):
                    def op(u, g, first=first):
                        with _stock_call:
                            return original(u, g) if first else original(g, u)
                    return segment_output(Segment("gate", prev.as_source(), op,
                                           _hold_g("gate", False), [gate]), x)
            out = _composite(x1, x2, original)
            if out is not None:
                return out
        return original(x1, x2)
    multiply._tf_relupool_wraps = original
    return multiply


def _pad_wrapper(original):
    @functools.wraps(original)
    def pad(x, pad_width, mode="constant", constant_values=None):
        prev = (segment_of(x) if _active() and not _stock_call.active()
                and str(mode).lower() == "constant" and not constant_values else None)
        if prev is not None and not prev.default_relu:  # ReLU -> Pad -> max pool: the pool
            # fusion's pattern (keras_fusion), which keeps one-byte codes instead
            def op(u):
                with _stock_call:
                    return original(u, pad_width, mode, constant_values)
            return segment_output(Segment("zero_pad", prev.as_source(), op, False), x)
        return original(x, pad_width, mode, constant_values)
    pad._tf_relupool_wraps = original
    return pad


_EXTENDER_WRAPPERS = {"gate": _gate_wrapper, "zero_pad": _pad_wrapper}


# ------------------------------------------------------------------------- C

def _consumer_wrapper(row, original):
    @functools.wraps(original)
    def consumer(inputs, *args, **kwargs):
        active = _active() and not _stock_call.active()
        seg = segment_of(inputs) if active else None
        if active and _state.memory_budget() < 1 and row.recompute is not None:
            return _registered_conv(seg, row, original, inputs, args, kwargs)
        if seg is not None:
            return _consume(seg, row, original, inputs, args, kwargs)
        return original(inputs, *args, **kwargs)
    consumer._tf_relupool_wraps = original
    return consumer


def _kernel_slots(args):
    import tensorflow as tf
    return [i for i, v in enumerate(args) if isinstance(v, (tf.Tensor, tf.Variable))
            or hasattr(v, "value") and hasattr(v, "assign")]


def _registered_conv(seg, row, original, inputs, args, kwargs):
    """A convolution under a memory budget below 1: its kernels read once as tensors, its
    output (stock's call, or C's where its input is a segment's) registered with how to
    recompute it (conv_recompute.register)."""
    import tensorflow as tf
    slots = _kernel_slots(args)
    full = list(args)
    for i in slots:
        full[i] = tf.convert_to_tensor(args[i])
    kernels = [full[i] for i in slots]

    def call(x, ws):
        again = list(full)
        for i, w in zip(slots, ws):
            again[i] = w
        with _stock_call:
            return original(x, *again, **kwargs)
    out = (_consume(seg, row, original, inputs, tuple(full), kwargs) if seg is not None
           else original(inputs, *full, **kwargs))
    if isinstance(out, tf.Tensor) and kernels:
        from tf_relupool import conv_recompute
        conv_recompute.register(graph_entry(out), out, inputs, kernels, call, row.recompute)
    return out


def _consume(seg, row, original, a, args, kwargs):
    """C: stock's `original(a, *args, **kwargs)`; the gradients of its tensor arguments from a
    recomputed `a` on the recompute route."""
    import tensorflow as tf
    # tensor arguments (kernels: variables read as tensors) travel through the custom gradient
    slots = _kernel_slots(args)
    if not slots:
        return original(a, *args, **kwargs)
    ws = [tf.convert_to_tensor(args[i]) for i in slots]
    n, k = len(seg.roots), len(ws)

    def call(x, w):
        full = list(args)
        for i, v in zip(slots, w):
            full[i] = v
        return original(x, *full, **kwargs)

    @tf.custom_gradient
    def c(a_in, *rest):
        w_in, ts = list(rest[:k]), list(rest[k:])

        def grad(dy):
            with _Ours(dy.graph):
                return _grad(dy)

        def _grad(dy):
            if seg.stock_reason() is None:
                xs, (dy_held,) = hold(ts + w_in, [dy], free=small_roots(ts, a_in))
                with tf.GradientTape() as tape:
                    a2 = seg.value(xs[:n])
                    tape.watch([a2] + xs[n:])
                    y = call(a2, xs[n:])
                grads = tape.gradient(y, [a2] + xs[n:], output_gradients=dy_held)
            else:
                with tf.GradientTape() as tape:
                    tape.watch([a_in] + w_in)
                    y = call(a_in, w_in)
                grads = tape.gradient(y, [a_in] + w_in, output_gradients=dy)
            return list(grads) + [None] * n

        return call(a_in, w_in), grad

    with _Ours(a.graph):
        out = c(a, *ws, *seg.roots)
    _stats["convs"] += 1
    return out


# ------------------------------------------------------------------------- the barrier

def barrier_kind():
    """"xla" or "select": the barrier the recomputation runs behind (module doc)."""
    value = os.environ.get(BARRIER_ENV_VAR, "auto").strip().lower() or "auto"
    if value not in BARRIERS:
        raise ValueError(f"{BARRIER_ENV_VAR}={value!r} is not one of {BARRIERS}")
    if value != "auto":
        return value
    import tensorflow as tf
    if tf.config.list_logical_devices("GPU") and _xla_barrier() is not None:
        return "xla"
    return "select"


def _xla_barrier():
    from tf_relupool import _compat
    return _compat.tf_xla_optimization_barrier()


def small_roots(roots, full):
    """The indices of the roots smaller than the tensor `full` (BN's per-channel inv and shift,
    a gate): hold leaves them free. Not those a block recomputes a convolution from
    (conv_recompute: entry["held_roots"], {name: the blocks that would}, asked at gradient
    time, when the plan is known), which must be held whatever their size."""
    held = graph_entry(full)["held_roots"]
    return {i for i, t in enumerate(roots)
            if t.shape.num_elements() < full.shape.num_elements()
            and (getattr(t, "graph", None) is None or not any(
                block.recomputes_convolution() for block in held.get(t.name, ())))}


def hold(ts, dys, free=()):
    """`ts` and `dys` behind the barrier: a recomputation from the returned ts can neither be
    merged with the forward's nor run before the incoming gradients `dys` exist. The indices in
    `free` are returned as they are: the small per-channel roots, which XLA computes for stock
    inside every consumer's fusion (a held copy is computed once, and its bits differed: a
    relu6 block's kernel gradients on the CPU). The rest, the full-size roots and a consumer's
    kernels, are held (held kernels gave a smaller CPU temp buffer: docs/activations.md)."""
    import tensorflow as tf
    if free:
        pick = [i for i in range(len(ts)) if i not in free]
        held, dys = hold([ts[i] for i in pick], dys)
        out = list(ts)
        for i, t in zip(pick, held):
            out[i] = t
        return out, dys
    if barrier_kind() == "xla":
        barrier = _xla_barrier()
        if barrier is None:
            raise RuntimeError(
                f"tf_relupool: {BARRIER_ENV_VAR}=xla, but TensorFlow's XlaOptimizationBarrier op "
                "is not available (tensorflow.compiler.tf2xla.ops._xla_ops.so)")
        held = barrier(list(ts) + list(dys))
        return list(held[:len(ts)]), list(held[len(ts):])
    e = tf.reshape(dys[0], [-1])[0]
    p = tf.logical_or(tf.equal(e, e), tf.not_equal(e, e))  # true for every e, NaN included
    return [tf.where(p, t, tf.zeros_like(t)) for t in ts], list(dys)
