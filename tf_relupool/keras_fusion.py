"""The switch under XLA: stock ReLU + max pool fused where they are traced.

Keras 3 compiles a model's train/predict functions with XLA by default on a GPU
(`compile(jit_compile="auto")`), and XLA-compiled functions never reach Grappler, where the
switch fuses stock graphs otherwise (tf_relupool/grappler.py). So while the switch is on,
tf_relupool wraps

- the max pooling of Keras' TensorFlow backend (`keras.src.backend.tensorflow.nn.max_pool`,
  which `MaxPooling2D` and `keras.ops.max_pool` call), and
- TensorFlow's `tf.nn.max_pool2d` and `tf.nn.max_pool` (4-D; the attributes of the `tf.nn` and
  `tf.compat.v2.nn` modules, which calls like `tf.nn.max_pool2d(...)` look up when they run),

and inside an XLA-compiled function a 2-D max pool whose input is, at trace time, the output of
a `Relu` op, or a zero-constant `Pad` of one (the ResNet stem's `ZeroPadding2D`), becomes the
fused op in its XLA form (tf_relupool/xla.py) over the ReLU's input. Keras' wrapper is still
needed beside TensorFlow's: for channels_first, Keras transposes the input to NHWC before it
calls `tf.nn.max_pool`, and TensorFlow's wrapper sees a Transpose there, not a ReLU; each
wrapper calls the functions it wraps with the other one stepped aside. Those are the trace-time
patterns of the pattern table (cc/grappler/patterns.h, which the Grappler pass reads), held in
Python too (tf_relupool.patterns.TRACE_PATTERNS, checked against the library's table): the
route needs no op library. Everywhere else (no XLA, another producer, 1-D/3-D pooling, a window
given as a tensor, `tf.raw_ops.MaxPool`, a `max_pool2d` imported by name before the switch
turned on) the wrapped functions run unchanged.

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

The wrappers (and gradient_sources' wrapper of `tf.GradientTape.gradient`) are installed when
the switch turns on and removed when it turns off (`disable_recompute()`, the end of a
`recompute()` block): with the switch off, the wrapped functions are the original objects again.
When they are installed, a probe traces a tiny ReLU + `MaxPooling2D` (channels_first: only
Keras' wrapper fuses it) and a ReLU + `tf.nn.max_pool2d` / `tf.nn.max_pool` inside
`tf.function(jit_compile=True)` (tracing only, no compilation) and warns, naming the path,
where the call does not reach the wrapper. The switch is read at trace time, like everything
else it does: functions traced before it changed keep what they were traced with.
"""
import logging
import threading

import numpy as np

from tf_relupool import _geometry, _reentry, _state, gradient_sources, patterns, segments
from tf_relupool._hooks import Hooks

logger = logging.getLogger("tf_relupool")

_hooks = Hooks()  # Keras' max_pool and tf.nn's while the switch is on
_TF_NAMES = ("max_pool2d", "max_pool")
_local = threading.local()  # .probe: the names reached
_stats = {"fused": 0, "fused_through_pad": 0, "fused_monotone": 0}
#: xla.UNKNOWN_SIZE, xla.LARGE_WINDOW, xla.REORDERED_SUM
_fallen_back = {"unknown_size": 0, "large_window": 0, "reordered_sum": 0}
_DTYPES = ("float16", "bfloat16", "float32", "float64")
_warned = set()  # the roles without a rule here, warned once


def _record(**event):
    """Adds a decision to the events of an active recording() on this thread."""
    if _recorder.active():
        from tf_relupool import _compat
        # the user's layer names (Keras' scope); TensorFlow's scope adds "_1" to re-traced names
        event["scope"] = _compat.keras_layer_path() or _name_scope()
        _recorder.add(event)


def _name_scope():
    import tensorflow as tf
    return tf.compat.v1.get_default_graph().get_name_scope()


_recorder = _reentry.Recorder()


def recording():
    """Collects, on this thread, each trace-time decision of the switch under XLA while the
    block runs: a list of dicts {"fused": bool, "reason" (when not fused), "path", "scope",
    "input_op", "pool_input_bytes", "code_bytes"}; tf_relupool.fusion_report reads it."""
    return _recorder.recording()


def stats():
    """Counts since import of the trace-time fusion's decisions: {"fused": n,
    "fused_through_pad": m (of n), "fused_monotone": k (of n: a non-decreasing activation other
    than ReLU), "fallen_back": {reason: k}}, where a reason (xla.UNKNOWN_SIZE,
    xla.LARGE_WINDOW, xla.REORDERED_SUM) made a ReLU + max pool run stock's ops inside XLA (with a warning)."""
    return dict(_stats, fallen_back=dict(_fallen_back))


def _backend_nn():
    """Keras' TensorFlow backend `nn` module, or None (another backend, or no Keras 3)."""
    from tf_relupool import _compat
    return _compat.keras_tf_backend().get("nn")


def _tf_nn_modules():
    """The module objects whose max_pool2d/max_pool TensorFlow code calls: tf.nn and
    tf.compat.v2.nn (one function object, two modules)."""
    import tensorflow as tf
    modules = [tf.nn]
    v2 = getattr(getattr(getattr(tf, "compat", None), "v2", None), "nn", None)
    if v2 is not None and v2 is not tf.nn:
        modules.append(v2)
    return modules


def set_enabled(on, probe_now=True):
    """Installs (on) or removes (off) the wrappers around Keras' TensorFlow max_pool and
    TensorFlow's tf.nn.max_pool2d / tf.nn.max_pool, and the tape wrapper the fused gradient asks
    (gradient_sources); after an install, probes that the calls reach them (module doc): now, or
    with `probe_now` False (the switch set from the environment at import, which must not
    initialize TensorFlow's context) at the first tf.GradientTape.gradient call. Config calls it
    when the switch (_state.mode(), which the wrappers read when traced) turns on or off."""
    gradient_sources.require("keras_fusion", on)
    if not on:
        _hooks.remove()
        return
    nn = _backend_nn()
    targets = [] if nn is None else [(nn, "max_pool", lambda original: _keras_wrapper())]
    targets += [(module, name, lambda original, name=name: _tf_wrapper(name, original))
                for module in _tf_nn_modules() for name in _TF_NAMES]
    if _hooks.install(targets):
        if probe_now:
            _check_dispatch(nn)
        else:
            gradient_sources.before_next_gradient(lambda: _check_dispatch(_backend_nn()))


def installed():
    """Whether Keras' max_pool is wrapped now."""
    nn = _backend_nn()
    return nn is not None and _hooks.original(nn, "max_pool") is not None


def _const(tensor):
    import tensorflow as tf
    try:
        return tf.get_static_value(tensor)
    except (TypeError, ValueError):
        return None


def _fusable_input(inputs):
    """(z, pad, skipped, activation) where `inputs`, a max pool's input, completes a trace-time
    pattern of the table (tf_relupool.patterns, the one the Grappler pass reads): Relu(z) -> (z,
    None, (relu,), None); Pad(Relu(z)) padding with a value c that ReLU keeps bit for bit (c >=
    +0, not NaN) -> (z, (paddings, c), (pad, relu), None); f(z) for a non-decreasing f of
    xla.MONOTONE -> (z, None, (f,), (its row, its op)): `skipped` are the tensors between z and
    the pool; else None."""
    trace_patterns = patterns.trace_patterns()  # in Python: no op library needed
    for p in trace_patterns:
        if p.chain[0] == "pool":
            found = _match(inputs, p.chain[1:])
            if found is not None:
                return found
    return None


def _match(tensor, roles):
    """(z, pad, skipped, activation) when `tensor` is made by ops playing `roles` in turn, the
    last one a ReLU or a non-decreasing activation."""
    from tf_relupool import xla
    pad = None
    skipped = []
    for i, role in enumerate(roles):
        if role == "relu" and i == len(roles) - 1:
            u = segments.relu_input(tensor)  # an activation segment's output (segments.py)
            if u is not None:
                return u, pad, tuple(skipped + [tensor]), None
        if role == "monotone" and i == len(roles) - 1:
            inner = segments.activation_output(tensor)  # likewise
            row = None if inner is None else xla.monotone(inner.op)
            if row is not None:
                return inner.op.inputs[0], pad, tuple(skipped + [tensor]), (row, inner.op)
        op = getattr(tensor, "op", None)
        if op is None or op.type not in patterns.trace_role_ops(role):
            return None
        skipped.append(tensor)
        if role == "relu":
            return (op.inputs[0], pad, tuple(skipped), None) if i == len(roles) - 1 else None
        if role == "monotone":
            row = xla.monotone(op)
            if i != len(roles) - 1 or row is None:
                return None
            return op.inputs[0], pad, tuple(skipped), (row, op)
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


#: while a wrapper calls what it wraps: the wrappers pass straight through
_bypass = _reentry.Reentry()


def _active():
    from tf_relupool import xla
    return not _bypass.active() and _state.mode() is not None and xla.in_xla_context()


#: Why a channels_first 1-D or 3-D pool (by input rank) takes stock's route under the switch.
_CHANNELS_FIRST = {
    3: "a channels_first 1-D pool (on a GPU, stock's XLA fuses the convolution before it with its "
       "ReLU into one cuDNN call and the fused form does not; the convolutions' kernel gradients "
       "differed in the last bits; docs/xla.md)",
    5: "a channels_first 3-D pool (the XLA form's 3-D tests cover channels_last only)",
}


def _fuse(inputs, ksize, strides, padding, fmt, stock_pool, path):
    """The fused XLA form in place of `stock_pool(inputs)` (ksize/strides: 4-entry attributes in
    `fmt`, padding "VALID"/"SAME"), stock's pool where a fallback reason applies, or None where
    `inputs` completes no trace-time pattern. `path` names the wrapper (for the probe). A 3-D
    input is a 1-D pool (MaxPooling1D: `fmt` "NHWC" for NWC, the window's rows 1), which stock
    runs as a 2-D pool over a height of 1: so does the fused form; a 5-D input a 3-D pool
    (MaxPooling3D, `fmt` "NDHWC"). Both channels_last only (_CHANNELS_FIRST)."""
    import tensorflow as tf
    from tf_relupool import xla
    rank = inputs.shape.rank if isinstance(inputs, tf.Tensor) else None
    if not (rank in (3, 4, 5) and padding in ("VALID", "SAME") and inputs.dtype.name in _DTYPES):
        if getattr(_local, "probe", None) is None:
            _record(fused=False, path=path, input_op=getattr(getattr(inputs, "op", None), "name",
                                                              None),
                    reason="not a 3-D, 4-D or 5-D floating-point input (a 1-D, 2-D or 3-D pool) "
                           "with VALID or SAME padding")
        return None
    if rank != 4 and fmt not in ("NHWC", "NDHWC"):
        if getattr(_local, "probe", None) is None:
            _record(fused=False, path=path, input_op=inputs.op.name,
                    reason=_CHANNELS_FIRST[rank])
        return None
    if rank == 3:  # a 1-D pool: the 2-D form over a height of 1, its output squeezed
        axis = 1

        def stock_pool_2d(t):
            return tf.expand_dims(stock_pool(tf.squeeze(t, [axis])), axis)
        out = _fuse_pool(inputs, ksize, strides, padding, fmt, stock_pool_2d, path,
                       lambda t: tf.expand_dims(t, axis))
        return None if out is None else tf.squeeze(out, [axis])
    return _fuse_pool(inputs, ksize, strides, padding, fmt, stock_pool, path, lambda t: t)


def _fuse_pool(traced_input, ksize, strides, padding, fmt, stock_pool, path, to_2d):
    """_fuse once the pool's input as traced (`traced_input`) and its pattern's z are made 4-D
    (a 1-D pool) by `to_2d`, which `stock_pool` takes."""
    from tf_relupool import xla
    found = _fusable_input(traced_input)
    if found is None:
        if getattr(_local, "probe", None) is None:
            _record(fused=False, path=path, input_op=traced_input.op.name,
                    reason=_why_not(traced_input))
        return None
    inputs = to_2d(traced_input)
    probe = getattr(_local, "probe", None)
    if probe is not None:  # _check_dispatch: reached; nothing built, nothing counted
        probe.add(path)
        return stock_pool(inputs)
    z, pad, skipped, activation = found
    z = to_2d(z)
    try:
        reason = xla.unsupported_reason(inputs.shape, ksize, strides, padding, [], fmt)
    except ValueError:  # no window fits the input: stock's own function reports it
        return stock_pool(inputs)
    if reason is None and _state.exact():
        why = xla.reordered_sum_reason(z)
        reason = None if why is None else (xla.REORDERED_SUM, why)
    if reason is not None:
        _fallen_back[reason[0]] += 1
        xla.warn_fallback(*reason)
        _record(fused=False, path=path, input_op=inputs.op.name, reason=reason[1])
        return stock_pool(inputs)
    if pad is not None:
        z = xla.pad_for_pool(z, pad[0], pad[1])  # dz ends in a select, as stock's
    _stats["fused"] += 1
    _stats["fused_through_pad"] += pad is not None
    _stats["fused_monotone"] += activation is not None
    if _recorder.active():
        known = inputs.shape.is_fully_defined()
        _record(fused=True, path=path, input_op=inputs.op.name, through_pad=pad is not None,
                activation="Relu" if activation is None else activation[1].type,
                pool_input_bytes=(inputs.shape.num_elements() * inputs.dtype.size
                                  if known else None),
                code_bytes=(_pooled_elements(inputs.shape, ksize, strides, padding, fmt)
                            if known else None))
    return xla.relu_max_pool2d(z, ksize, strides, padding, [], fmt,
                               traced=xla.TracedPool(inputs, skipped, stock_pool),
                               activation=activation)


def _why_not(traced_input):
    """Why the pool whose input is `traced_input` completes no trace-time pattern."""
    from tf_relupool import xla
    inner = segments.activation_output(traced_input)
    op = (inner if inner is not None else traced_input).op
    row = xla.MONOTONE.get(op.type)
    if row is not None and row.not_fused:
        return f"{op.type} before the pool: {row.not_fused}"
    return (f"the pool's input comes from {op.type}, not a ReLU (or a zero Pad of one) nor a "
            "non-decreasing activation whose gradient is a select (" +
            ", ".join(sorted(patterns.trace_role_ops("monotone"))) + ")")


def _pooled_elements(shape, ksize, strides, padding, fmt):
    """Elements of the pool's output (one byte of code each under the fusion)."""
    from tf_relupool import xla
    dims = xla.pool_geometry(_geometry.spatial(shape, fmt), ksize, strides, padding, [], fmt)
    channels = shape[-1] if _geometry.spatial_axes(fmt)[0] == 1 else shape[1]
    return int(shape[0]) * int(channels) * int(np.prod([d[-1] for d in dims]))


def _no_autograph(fn):
    """`fn` left unconverted by AutoGraph (it branches on Python values only): a traced call
    goes straight to it, as to the function it wraps."""
    import tensorflow as tf
    return tf.autograph.experimental.do_not_convert(fn)


_keras_wrappers = []


def _keras_wrapper():
    """The object installed as Keras' max_pool (_max_pool, left unconverted by AutoGraph)."""
    if not _keras_wrappers:
        _keras_wrappers.append(_no_autograph(_max_pool))
    return _keras_wrappers[0]


def _max_pool(inputs, pool_size, strides=None, padding="valid", data_format=None):
    """Keras' TensorFlow max_pool, fused with a ReLU in front of it under XLA (module doc)."""
    nn = _backend_nn()
    original = _hooks.original(nn, "max_pool") or nn.max_pool

    def stock_pool(t):
        with _bypass:
            return original(t, pool_size, strides, padding, data_format)
    if _active() and isinstance(padding, str):
        from tf_relupool import _compat
        rank = getattr(getattr(inputs, "shape", None), "rank", None)
        last = _compat.keras_data_format(data_format) == "channels_last"
        fmt = ("NDHWC" if last else "NCDHW") if rank == 5 else ("NHWC" if last else "NCHW")
        try:
            ksize = _attr(pool_size, fmt, rank)
            stride_attr = _attr(pool_size if strides is None else strides, fmt, rank)
        except (TypeError, ValueError):  # not ints: Keras' own function says what is wrong
            return stock_pool(inputs)
        out = _fuse(inputs, ksize, stride_attr, padding.upper(), fmt, stock_pool, "keras")
        if out is not None:
            return out
    return stock_pool(inputs)


def _tf_wrapper(fn_name, original):
    """tf.nn.max_pool2d or tf.nn.max_pool (`original`), fused with a ReLU in front of it under
    XLA for 4-D inputs (module doc)."""
    def wrapper(input, ksize, strides, padding, data_format=None, name=None):  # noqa: A002
        if data_format is None and fn_name == "max_pool2d":
            data_format = "NHWC"

        def stock_pool(t):
            with _bypass:
                return original(t, ksize, strides, padding, data_format=data_format, name=name)
        fmt = "NHWC" if data_format is None else data_format
        if (_active() and isinstance(padding, str) and fmt in ("NHWC", "NCHW")
                and getattr(getattr(input, "shape", None), "rank", None) == 4):  # 2-D pools only
            try:
                k4 = _geometry.normalize_window(ksize, "ksize", fmt)
                s4 = _geometry.normalize_window(strides, "strides", fmt)
            except ValueError:  # a tensor, another rank's form: stock's own function
                return stock_pool(input)
            out = _fuse(input, k4, s4, padding.upper(), fmt, stock_pool, f"tf.nn.{fn_name}")
            if out is not None:
                return out
        return stock_pool(input)
    wrapper.__name__ = wrapper.__qualname__ = fn_name
    wrapper = _no_autograph(wrapper)
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original
    wrapper._tf_relupool_wraps = original
    return wrapper


def tf_nn_installed():
    """Whether tf.nn.max_pool2d and tf.nn.max_pool are wrapped now."""
    return any(_hooks.original(m, n) is not None for m in _tf_nn_modules() for n in _TF_NAMES)


def _check_dispatch(nn):
    """Traces a tiny ReLU + max pool through each wrapped path inside a jit-compiled function
    (no compilation) and warns for each path whose call does not reach its wrapper (module
    doc); a pair of modules that passed is not probed again."""
    import tensorflow as tf
    spec = tf.TensorSpec([1, 2, 2, 2])
    # (the name the wrapper records, the function traced), by the name a warning gives
    paths = {
        "tf.nn.max_pool2d": ("tf.nn.max_pool2d",
                             lambda x: tf.nn.max_pool2d(tf.nn.relu(x), 2, 2, "VALID")),
        "tf.nn.max_pool": ("tf.nn.max_pool",
                           lambda x: tf.nn.max_pool(tf.nn.relu(x), 2, 2, "VALID")),
    }
    if nn is not None:
        import keras
        # named: Keras' automatic layer names stay as they were; float32: a mixed-precision
        # policy would cast the ReLU's output first
        layer = keras.layers.MaxPooling2D(2, data_format="channels_first",
                                          name="tf_relupool_probe", dtype="float32")
        paths["Keras' MaxPooling2D / keras.ops.max_pool (the wrapper of Keras' TensorFlow "
              "backend max_pool)"] = ("keras", lambda x: layer(tf.nn.relu(x)))
    _local.probe = reached = set()
    try:
        _hooks.probe((id(nn), tuple(id(m) for m in _tf_nn_modules())),
                     {name: (fn, spec, lambda path=path: path in reached)
                      for name, (path, fn) in paths.items()},
                     "stock ReLU + max pool there are not fused under XLA")
    finally:
        _local.probe = None


def _attr(v, fmt, rank=4):
    """A Keras pool_size/strides as the op's 4-entry attribute in `fmt`; for a 3-D input (a 1-D
    pool) the window over a height of 1; for a 5-D input (a 3-D pool) the 5-entry one."""
    if rank == 3:
        (k,) = (int(v),) if np.ndim(v) == 0 else tuple(int(x) for x in v)
        return _geometry.window_attr(1, k, fmt)
    if rank == 5:
        k = (int(v),) * 3 if np.ndim(v) == 0 else tuple(int(x) for x in v)
        if len(k) != 3:
            raise ValueError(f"a 3-D pool's window has 3 entries, got {v!r}")
        return [1, *k, 1] if fmt == "NDHWC" else [1, 1, *k]
    return _geometry.window_attr(*_pair(v), fmt)


def _pair(v):
    return (int(v), int(v)) if np.ndim(v) == 0 else tuple(int(x) for x in v)
