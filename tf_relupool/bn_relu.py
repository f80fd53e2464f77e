"""BatchNorm + ReLU recomputed in the backward under XLA: `enable_recompute(bn_relu=True)`.

In stock training a conv -> BatchNormalization -> ReLU -> conv block keeps two full-size tensors
for the backward pass: the BN input z (BN's own gradient reads it) and the ReLU output a (the next
conv's kernel gradient and ReLU's gradient read it). With `bn_relu=True`, inside XLA-compiled
functions, the ReLU output is recomputed in the backward pass from z and BN's per-channel
`inv`/`shift` instead of being kept (docs/bn_relu_recompute.md has the findings and figures).

While the switch is on with `bn_relu=True`, three trace-time hooks are installed (removed when it
turns off):

- `keras.layers.BatchNormalization.call`: after stock's call, a BN whose case is covered
  (training, trainable, no renorm, not synchronized, no mask, the input's dtype the layer's
  compute dtype) has its output y registered with the tensors stock's
  `tf.nn.batch_normalization` made: y = z * inv + shift (read off the traced graph, so they are
  stock's ops; BN's moving statistics are assigned by stock's call, untouched). Under mixed
  precision (float16 or bfloat16 input) Keras normalizes in float32: y = cast(z32 * inv + shift)
  with z32 stock's float32 cast of the input, and z32 is what is registered;
- Keras' `activations.ReLU.static_call` (what `layers.ReLU()`, `Activation("relu")` and
  `keras.activations.relu` call): a ReLU with default arguments whose input is a registered y,
  or the `Add` of a registered y with a registered y' (projection shortcut) or any other tensor
  of the same shape (a kept shortcut), becomes G, a `tf.custom_gradient` over
  relu(z * inv + shift [+ z' * inv' + shift' | + s]) computed with the same ops in the same
  order as stock (Mul, AddV2, [Cast,] AddV2, Relu);
- `keras.src.backend.tensorflow.nn.conv` (what `Conv2D` calls): a 2-D convolution (not grouped)
  of a G output becomes C, a custom gradient whose forward is stock's convolution and whose
  backward recomputes G's output for the kernel gradient (the input gradient needs the kernel
  alone), so that neither C nor G keeps the ReLU output.

G's backward recomputes the ReLU output and differentiates it with stock's registered gradients
(ReluGrad, AddV2's and Mul's broadcasting gradients), without a barrier: XLA merges that copy
with the forward's and, as for stock, fuses relu(z * inv + shift) into ReluGrad's fusion, which
keeps stock's fusion and bits (a barrier there changed them; docs/bn_relu_recompute.md). C's
backward (Conv2DBackpropInput from the kernel, Conv2DBackpropFilter from the recomputed output)
runs behind a barrier, so that XLA can neither merge its recomputation with the forward's (CSE)
nor schedule it before the backward reaches it: XLA's optimization barrier on a GPU; on the CPU,
whose pipeline deletes that barrier before fusion and scheduling, `select(p, x, 0)` of every
recomputation input, where p is a tautology read from the incoming gradient
((e == e) | (e != e)), exact for every value. `TF_RELUPOOL_BN_RELU_BARRIER` ("xla", "select",
default "auto": "xla" where a GPU is visible and TensorFlow registers the op) picks it. The tape
sums the consumers' gradients at G's output as stock sums them at the ReLU's output.

Whether a segment recomputes is decided when its gradient is traced, when every consumer of the
forward is known. It recomputes only where the ReLU output's consumers are C's, other segments,
or ops whose gradient reads none of their inputs (Add, Mean: global average pooling), the BN
outputs and the Add output feed nothing else, and the gradient being computed is not taken with
respect to a tensor the rewrite skips (the BN output y, the Add's output; tf_relupool/
gradient_sources.py). Otherwise G's gradient is stock's, ReluGrad(da, a) into the ReLU's traced
input, from where the tape continues through stock's Add and BN ops (and C's gradient reads the
ReLU output as stock does): stock's bits, no saving. A ReLU that feeds a max pool stays with the
switch's pool fusion (keras_fusion asks `relu_input`), whose route is stock's there too.

XLA only: outside XLA-compiled functions nothing here applies (the Grappler pass does not cover
BN + ReLU).
"""
import collections
import functools
import logging
import os
import threading
import weakref

from tf_relupool import _state, gradient_sources

logger = logging.getLogger("tf_relupool")

BARRIER_ENV_VAR = "TF_RELUPOOL_BN_RELU_BARRIER"
BARRIERS = ("auto", "xla", "select")

_lock = threading.Lock()
_patches = []  # [(owner, attribute, original, wrapper)] while installed
_stats = collections.Counter()
#: ops whose gradient reads none of their inputs' values: a ReLU output they read is not kept
_KEEP_NOTHING = frozenset({"AddV2", "Add", "Mean", "Shape", "ShapeN", "Size", "Rank"})
_DTYPES = ("float16", "bfloat16", "float32", "float64")


class _Graphs:
    """Per traced graph (weakly held): the registered BN outputs, the segments by G's output,
    and the names of the ops the segments made (G's and C's)."""

    def __init__(self):
        self._by_graph = weakref.WeakKeyDictionary()

    def of(self, graph):
        entry = self._by_graph.get(graph)
        if entry is None:
            entry = self._by_graph[graph] = dict(bn={}, segments={}, ops=set())
        return entry


_graphs = _Graphs()


def stats():
    """Counts since import: {"segments": G's built at trace time, "convs": C's built,
    "recomputed": G gradients traced with the recomputation, "stock": G gradients traced on
    stock's route, "stock_reasons": {reason: n}}."""
    out = {k: _stats[k] for k in ("segments", "convs", "recomputed", "stock")}
    out["stock_reasons"] = {k[len("stock:"):]: v for k, v in _stats.items()
                            if k.startswith("stock:")}
    return out


def installed():
    """Whether the hooks are installed now."""
    return bool(_patches)


def _targets():
    """[(owner, attribute, wrapper factory)] of the hooks (module doc); [] without Keras 3's
    TensorFlow backend."""
    try:
        import keras
        if keras.backend.backend() != "tensorflow":
            return []
        from keras.src.activations import activations
        from keras.src.backend.tensorflow import nn
        from keras.src.layers.normalization.batch_normalization import BatchNormalization
    except ImportError:
        return []
    return [(BatchNormalization, "call", _bn_call_wrapper),
            (activations.ReLU, "static_call", _relu_wrapper),
            (nn, "conv", _conv_wrapper)]


def set_enabled(on):
    """Installs (on) or removes (off) the hooks. Removing restores each original unless
    something else replaced it since (that stays). After an install, a probe traces a tiny
    conv -> BN -> ReLU -> conv inside tf.function(jit_compile=True) (no compilation) and warns
    where Keras' calls did not reach the hooks."""
    installed_now = False
    with _lock:
        if on and not _patches:
            for owner, name, factory in _targets():
                original = owner.__dict__[name]
                wrapper = factory(original)
                _patches.append((owner, name, original, wrapper))
                setattr(owner, name, wrapper)
                installed_now = True
        elif not on:
            while _patches:
                owner, name, original, wrapper = _patches.pop()
                if owner.__dict__.get(name) is wrapper:
                    setattr(owner, name, original)
    if installed_now and not _probed:
        _check_dispatch()


_probed = []  # [True] once a probe found every hook reached


def _check_dispatch():
    """The probe of set_enabled: one segment and one C traced, else a warning."""
    import tensorflow as tf
    from keras import layers
    saved = collections.Counter(_stats)
    try:
        # named: Keras' automatic layer names stay as they were; float32: a mixed-precision
        # policy would not be covered
        kw = dict(dtype="float32")
        conv1 = layers.Conv2D(2, 1, use_bias=False, name="tf_relupool_probe_conv1", **kw)
        bn = layers.BatchNormalization(name="tf_relupool_probe_bn", **kw)
        relu = layers.ReLU(name="tf_relupool_probe_relu", **kw)
        conv2 = layers.Conv2D(2, 1, name="tf_relupool_probe_conv2", **kw)
        tf.function(lambda x: conv2(relu(bn(conv1(x), training=True))), jit_compile=True,
                    autograph=False).get_concrete_function(tf.TensorSpec([1, 2, 2, 2]))
        reached = (_stats["segments"] > saved["segments"], _stats["convs"] > saved["convs"])
    except Exception as e:  # noqa: BLE001 - the probe must not break enable_recompute()
        reached, error = (False, False), e
    else:
        error = None
    finally:
        _stats.clear()
        _stats.update(saved)
    if all(reached):
        _probed.append(True)
        return
    logger.warning(
        "tf_relupool: enable_recompute(bn_relu=True): a conv -> BatchNormalization -> ReLU -> "
        "conv traced inside tf.function(jit_compile=True) did not reach tf_relupool's hooks "
        "(%s); BatchNorm + ReLU run stock's ops there (no saving, stock's results). Keras may "
        "have moved the functions tf_relupool wraps.",
        f"the probe failed: {error}" if error else
        "no segment at the ReLU" if not reached[0] else "no segment at the Conv2D")


def _active():
    if not (_state.mode() is not None and _state.bn_relu()):
        return False
    from tf_relupool import xla
    return xla.in_xla_context()


def _key(t):
    return getattr(t, "name", None)


def _entry(t):
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
    registered z is stock's float32 cast of the input, so that the gradient at it is summed in
    float32 (moments and normalization) before stock's cast back, as stock sums it."""
    import tensorflow as tf
    if not (isinstance(y, tf.Tensor) and isinstance(z, tf.Tensor)) or y.shape.rank != 4:
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
    _entry(y)["bn"][y.name] = (z_in, inv, shift)


# ------------------------------------------------------------------------- ReLU: G

class Segment:
    """One BN [+ Add] + ReLU traced as G: its recomputation inputs and function."""

    def __init__(self, u, terms, add_order):
        self.u = u                  # the ReLU's traced input (y, or the Add's output)
        self.terms = terms          # [("bn", y, (z, inv, shift)) or ("keep", s)]
        self.add_order = add_order  # None, or the Add's inputs as term indices, in its order
        self.inputs = []
        for term in terms:
            self.inputs += list(term[2]) if term[0] == "bn" else [term[1]]
        self.output = None          # G's output, what every consumer reads
        self.ops = set()            # the names of G's forward ops

    def compute(self, ts):
        """relu(z * inv + shift [+ ...]) from `ts` (like self.inputs), stock's ops in order."""
        import tensorflow as tf
        values, i = [], 0
        for term in self.terms:
            if term[0] == "bn":
                v = ts[i] * ts[i + 1] + ts[i + 2]
                # mixed precision: stock's cast of the float32 normalization to the BN's dtype
                values.append(v if v.dtype == term[1].dtype else tf.cast(v, term[1].dtype))
                i += 3
            else:
                values.append(ts[i])
                i += 1
        u = values[0] if self.add_order is None else (
            values[self.add_order[0]] + values[self.add_order[1]])
        return tf.nn.relu(u)

    def skipped(self):
        """The tensors the rewrite skips: the BN outputs and the ReLU's input."""
        return tuple(t[1] for t in self.terms if t[0] == "bn") + (self.u,)

    def stock_reason(self):
        """Why this segment's gradient must be stock's (module doc), or None. Asked by G and by
        every C of the segment, so that on stock's route neither recomputes: the graph is then
        stock's, whose bits XLA's CPU code keeps on every CPU (a C recomputing beside G's stock
        route changed the fusions, and an AVX2-only CPU's sums)."""
        reason = self._graph_reason()
        if reason is None and gradient_sources.route(self.skipped()) != gradient_sources.FUSED:
            reason = "the gradient is taken with respect to a skipped tensor, or unknown"
        return reason

    def _graph_reason(self):
        ours = _entry(self.output)["ops"]
        for op in self.output.consumers():
            if op.name not in ours and op.type not in _KEEP_NOTHING:
                return "the ReLU output also feeds " + op.type
        if {op.name for op in self.u.consumers()} - self.ops:  # another segment's G too
            return "the ReLU's input feeds other ops"
        for term in self.terms:
            if term[0] == "bn" and term[1] is not self.u:
                if any(op.name != self.u.op.name for op in term[1].consumers()):
                    return "a BN output feeds other ops"
        return None


def _segment_of(t):
    entry = _entry(t)
    return None if entry is None else entry["segments"].get(_key(t))


def relu_input(t):
    """The ReLU's traced input where `t` is a segment's output (G), else None: the switch's pool
    fusion treats G's output as a Relu of it (keras_fusion)."""
    seg = _segment_of(t)
    return None if seg is None else seg.u


def _relu_wrapper(original):
    fn = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(fn)
    def static_call(x, negative_slope=0.0, max_value=None, threshold=0.0):
        if (negative_slope == 0 and max_value is None and threshold == 0 and _active()):
            out = _segment(x)
            if out is not None:
                return out
        return fn(x, negative_slope=negative_slope, max_value=max_value, threshold=threshold)
    return staticmethod(static_call)


def _match(u):
    """A Segment for relu(u), or None where u is not a covered pattern."""
    import tensorflow as tf
    if not isinstance(u, tf.Tensor) or u.shape.rank != 4 or not u.shape.is_fully_defined():
        return None
    bns = _entry(u)["bn"]
    if u.name in bns:
        return Segment(u, [("bn", u, bns[u.name])], None)
    if u.op.type not in ("AddV2", "Add") or len(u.op.inputs) != 2:
        return None
    terms = []
    for t in u.op.inputs:
        if t.shape != u.shape or t.dtype != u.dtype:
            return None
        if t.name in bns and not any(t is term[1] for term in terms):
            terms.append(("bn", t, bns[t.name]))
        else:
            terms.append(("keep", t))
    if not any(term[0] == "bn" for term in terms):
        return None
    return Segment(u, terms, (0, 1))


def _segment(u):
    """G's output for relu(u) where u is covered, else None."""
    import tensorflow as tf
    from tensorflow.python.ops import gen_nn_ops
    seg = _match(u)
    if seg is None:
        return None
    n = len(seg.inputs)

    @tf.custom_gradient
    def bn_relu(*args):
        ts = list(args[:n])

        def grad(da):
            with _Ours(da.graph):
                return _grad(da)

        def _grad(da):
            reason = seg.stock_reason()
            if reason is None:
                _stats["recomputed"] += 1
                # No barrier here: XLA merges this copy with the forward's and, as in stock,
                # fuses relu(z * inv + shift) into ReluGrad's fusion from z. A barrier would
                # change that fusion and with it the bits (docs/bn_relu_recompute.md). The saving
                # is the C's: the kernel gradients' copies of the ReLU output.
                with tf.GradientTape() as tape:
                    tape.watch(ts)
                    a = seg.compute(ts)
                return list(tape.gradient(a, ts, output_gradients=da)) + [None]
            _stats["stock"] += 1
            _stats["stock:" + reason] += 1
            # Stock's Relu gradient into the ReLU's traced input; the tape goes on through stock's
            # Add and BN ops from there.
            return [None] * n + [gen_nn_ops.relu_grad(da, seg.output)]

        return seg.compute(ts), grad

    with _Ours(u.graph) as ours:
        seg.output = bn_relu(*seg.inputs, u)
    seg.ops = ours.new
    _entry(u)["segments"][seg.output.name] = seg
    _stats["segments"] += 1
    return seg.output


# ------------------------------------------------------------------------- Conv2D: C

def _conv_wrapper(original):
    @functools.wraps(original)
    def conv(inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1):
        seg = _segment_of(inputs) if _active() else None
        if seg is not None and len(getattr(kernel, "shape", ())) == 4:
            from keras.src.backend import standardize_data_format
            first = standardize_data_format(data_format) == "channels_first"
            if inputs.shape[1 if first else -1] == kernel.shape[-2]:  # not grouped
                return _conv(seg, original, inputs, kernel,
                             (strides, padding, data_format, dilation_rate))
        return original(inputs, kernel, strides, padding, data_format, dilation_rate)
    conv._tf_relupool_wraps = original
    return conv


def _conv(seg, original, a, kernel, args):
    """C: stock's convolution of G's output `a`; the kernel gradient from a recomputed `a`."""
    import tensorflow as tf
    k = tf.convert_to_tensor(kernel)
    n = len(seg.inputs)

    def convolve(x, w):
        return original(x, w, *args)

    @tf.custom_gradient
    def conv_of_bn_relu(a_in, k_in, *ts):
        ts = list(ts)

        def grad(dy):
            with _Ours(dy.graph):
                return _grad(dy)

        def _grad(dy):
            if seg.stock_reason() is None:
                xs, (dy_held,) = _hold(ts + [k_in], [dy])
                with tf.GradientTape() as tape:
                    a2 = seg.compute(xs[:n])
                    tape.watch([a2, xs[n]])
                    y = convolve(a2, xs[n])
                da, dk = tape.gradient(y, [a2, xs[n]], output_gradients=dy_held)
            else:
                with tf.GradientTape() as tape:
                    tape.watch([a_in, k_in])
                    y = convolve(a_in, k_in)
                da, dk = tape.gradient(y, [a_in, k_in], output_gradients=dy)
            return [da, dk] + [None] * n

        return convolve(a_in, k_in), grad

    with _Ours(a.graph):
        out = conv_of_bn_relu(a, k, *seg.inputs)
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
    try:
        from tensorflow.compiler.tf2xla.ops import gen_xla_ops
        return gen_xla_ops.xla_optimization_barrier
    except (ImportError, AttributeError):
        return None


def _hold(ts, dys):
    """`ts` and `dys` behind the barrier: a recomputation from the returned ts can neither be
    merged with the forward's nor run before the incoming gradients `dys` exist."""
    import tensorflow as tf
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
