"""The switch for stock Keras models under XLA: ReLU + max pool fused where Keras traces them.

Keras 3 compiles a model's train/predict functions with XLA by default on a GPU
(`compile(jit_compile="auto")`), and XLA-compiled functions never reach Grappler, where the
switch fuses stock graphs otherwise (tf_relupool/grappler.py). So while the switch is on,
tf_relupool wraps the max pooling of Keras' TensorFlow backend (`keras.src.backend.tensorflow.nn
.max_pool`, which `MaxPooling2D` and `keras.ops.max_pool` call): inside an XLA-compiled function,
a 2-D max pool whose input is, at trace time, the output of a `Relu` op, or a zero-constant
`Pad` of one (the ResNet stem's `ZeroPadding2D`), becomes the fused op in its XLA form
(tf_relupool/xla.py) over the ReLU's input. Those are the trace-time patterns of the pattern
table (cc/grappler/patterns.h, which the Grappler pass reads), held in Python too
(tf_relupool.patterns.TRACE_PATTERNS, checked against the library's table): the route needs no
op library.
Everywhere else (no XLA, another producer, 1-D/3-D pooling) the wrapped function calls Keras'
own unchanged.

Exact: the fused op computes max_pool(relu(z)) and its gradient bit for bit as stock does under
XLA. The `Relu` op stays in the graph; when nothing else reads it, XLA drops it, otherwise its
other consumers get it as before, and z's gradient is the sum of the fused op's and theirs (for
one other consumer, the same sum stock makes, addition being commutative; docs/xla.md). The
fused op takes the pool's traced input as a second, formal input: when the gradient being
computed is taken with respect to a tensor the fusion skips (the ReLU's output, a Pad's; a
Grad-CAM `tape.gradient(score, activation)`), its gradient function returns stock's gradient of
the pool into that input instead, and the tape continues through stock's Relu into z as stock
does (tf_relupool/gradient_sources.py: how the sources are known, and the stock route where
they are not, e.g. `tf.gradients`).

The wrapper (and gradient_sources' wrapper of `tf.GradientTape.gradient`) is installed when the
switch turns on and removed when it turns off (`disable_recompute()`, the end of a `recompute()`
block): with the switch off, Keras' function is the original object again. The switch is read at trace time, like everything else it does.
"""
import logging
import threading

import numpy as np

from tf_relupool import gradient_sources, patterns

logger = logging.getLogger("tf_relupool")

_lock = threading.Lock()
_original = []  # [Keras' own max_pool] while the wrapper is installed
_stats = {"fused": 0, "fused_through_pad": 0}
_fallen_back = {"unknown_size": 0, "large_window": 0}  # xla.UNKNOWN_SIZE, xla.LARGE_WINDOW
_DTYPES = ("float16", "bfloat16", "float32", "float64")
_warned = set()  # the roles without a rule here, warned once


def stats():
    """Counts since import of the trace-time fusion's decisions: {"fused": n,
    "fused_through_pad": m (of n), "fallen_back": {reason: k}}, where a reason (xla.UNKNOWN_SIZE,
    xla.LARGE_WINDOW) made a ReLU + max pool run stock's ops inside XLA (with a warning)."""
    return dict(_stats, fallen_back=dict(_fallen_back))


def _backend_nn():
    """Keras' TensorFlow backend `nn` module, or None (another backend, or no Keras 3)."""
    try:
        import keras
        if keras.backend.backend() != "tensorflow":
            return None
        from keras.src.backend.tensorflow import nn
        return nn
    except ImportError:
        return None


def set_enabled(on):
    """Installs (on) or removes (off) the wrapper around Keras' TensorFlow max_pool."""
    gradient_sources.set_enabled(on)
    nn = _backend_nn()
    if nn is None:
        return
    with _lock:
        if on and not _original:
            _original.append(nn.max_pool)
            nn.max_pool = _max_pool
        elif not on and _original:
            nn.max_pool = _original.pop()


def installed():
    """Whether Keras' max_pool is wrapped now."""
    return bool(_original)


def _const(tensor):
    import tensorflow as tf
    try:
        return tf.get_static_value(tensor)
    except (TypeError, ValueError):
        return None


def _fusable_input(inputs):
    """(z, pad, skipped) where `inputs`, a max pool's input, completes a trace-time pattern of
    the table (tf_relupool.patterns, the one the Grappler pass reads): Relu(z) -> (z, None,
    (relu,)); Pad(Relu(z)) padding with a value c that ReLU keeps bit for bit (c >= +0, not NaN)
    -> (z, (paddings, c), (pad, relu)): `skipped` are the tensors between z and the pool; else
    None."""
    trace_patterns = patterns.trace_patterns()  # in Python: no op library needed
    for p in trace_patterns:
        if p.chain[0] == "pool":
            found = _match(inputs, p.chain[1:])
            if found is not None:
                return found
    return None


def _match(tensor, roles):
    """(z, pad, skipped) when `tensor` is made by ops playing `roles` in turn, the last one a
    ReLU."""
    pad = None
    skipped = []
    for i, role in enumerate(roles):
        op = getattr(tensor, "op", None)
        if op is None or op.type not in patterns.trace_role_ops(role):
            return None
        skipped.append(tensor)
        if role == "relu":
            return (op.inputs[0], pad, tuple(skipped)) if i == len(roles) - 1 else None
        if role != "pad":
            if role not in _warned:
                _warned.add(role)
                logger.warning("tf_relupool: the trace-time fusion has no rule for the pattern "
                               "role %r; patterns with it run stock's ops", role)
            return None
        pad = _pad_constant(op, tensor)
        if pad is None:
            return None
        tensor = op.inputs[0]
    return None


def _pad_constant(op, output):
    """(paddings, c) of a 4-D Pad/PadV2 with constant paddings and a value c that ReLU keeps bit
    for bit (c >= +0, not NaN), else None."""
    if len(op.inputs[0].shape) != 4:
        return None
    paddings = _const(op.inputs[1])
    c = 0 if op.type == "Pad" else _const(op.inputs[2])
    if paddings is None or c is None:
        return None
    c = np.asarray(c, dtype=output.dtype.as_numpy_dtype)
    if c.shape != () or np.isnan(c) or np.signbit(c):
        return None
    return paddings.tolist(), c


def _max_pool(inputs, pool_size, strides=None, padding="valid", data_format=None):
    """Keras' TensorFlow max_pool, fused with a ReLU in front of it under XLA (module doc)."""
    original = _original[0] if _original else None
    from tf_relupool import config, xla
    if original is None or config.recompute_mode() is None or not xla.in_xla_context():
        return (original or _backend_nn().max_pool)(inputs, pool_size, strides, padding,
                                                    data_format)
    import keras
    import tensorflow as tf
    found = None
    if (isinstance(inputs, tf.Tensor) and inputs.shape.rank == 4 and isinstance(padding, str)
            and padding.upper() in ("VALID", "SAME") and inputs.dtype.name in _DTYPES):
        found = _fusable_input(inputs)
    if found is None:
        return original(inputs, pool_size, strides, padding, data_format)
    z, pad, skipped = found
    data_format = keras.src.backend.standardize_data_format(data_format)
    fmt = "NHWC" if data_format == "channels_last" else "NCHW"
    from tf_relupool import xla
    ksize = _attr(pool_size, fmt)
    stride_attr = _attr(pool_size if strides is None else strides, fmt)
    reason = xla.unsupported_reason(inputs.shape, ksize, stride_attr, padding.upper(), [], fmt)
    if reason is not None:
        _fallen_back[reason[0]] += 1
        xla.warn_fallback(*reason)
        return original(inputs, pool_size, strides, padding, data_format)
    if pad is not None:
        z = tf.pad(z, pad[0], constant_values=tf.constant(pad[1], z.dtype))
    _stats["fused"] += 1
    _stats["fused_through_pad"] += pad is not None

    def stock_pool(t):
        return original(t, pool_size, strides, padding, data_format)
    return xla.relu_max_pool2d(z, ksize, stride_attr, padding.upper(), [], fmt,
                               traced=xla.TracedPool(inputs, skipped, stock_pool))


def _attr(v, fmt):
    """A Keras pool_size/strides as the op's 4-entry attribute in `fmt`."""
    h, w = _pair(v)
    return [1, h, w, 1] if fmt == "NHWC" else [1, 1, h, w]


def _pair(v):
    return (int(v), int(v)) if np.ndim(v) == 0 else tuple(int(x) for x in v)
