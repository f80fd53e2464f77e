"""Fuzzer for tf_relupool's ops: random calls, valid and invalid, each batch in its own process.

Every call must either succeed (and then give sane results) or raise a named Python/TF error;
a crash (signal, abort, CHECK failure) of the worker process is a failure, reported with the
call that was running so it can be replayed.

    python tests/fuzz_ops.py --calls 10000 --seed 1        # the driver (what `make fuzz` runs)
    python tests/fuzz_ops.py --worker --seed 5 --calls 200  # one batch in this process
    python tests/fuzz_ops.py --replay 5:137                 # print call 137 of seed 5, then run it

Run it from outside the source tree (or with the installed package first on sys.path).
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Errors a call may raise. TypeError is only expected for Python values of the wrong type.
ALLOWED_TF_ERRORS = ("InvalidArgumentError", "NotFoundError", "ResourceExhaustedError",
                     "UnimplementedError", "FailedPreconditionError", "OutOfRangeError")
ALLOWED_PY_ERRORS = ("ValueError", "TypeError")
MAX_ELEMENTS = 1 << 21  # largest input we create (fits any machine; 'large within memory')


class SanityError(AssertionError):
    """A call succeeded with a wrong result."""


# ---------------------------------------------------------------------------------------------
# Random cases. Everything is drawn from a numpy Generator seeded per call, so a call can be
# replayed alone from (seed, index).

def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _spatial(rng):
    r = rng.random()
    if r < 0.05:
        return 0
    if r < 0.15:
        return 1
    if r < 0.2:
        return int(rng.integers(30, 200))  # large
    return int(rng.integers(1, 14))


def _shape(rng, fmt):
    n = 0 if rng.random() < 0.04 else int(rng.integers(1, 4))
    c = 0 if rng.random() < 0.04 else int(_pick(rng, [1, 1, 2, 3, 4, 7, 8, 16, 33]))
    h, w = _spatial(rng), _spatial(rng)
    while n * c * h * w > MAX_ELEMENTS:
        h, w = max(1, h // 2), max(1, w // 2)
    return [n, h, w, c] if fmt == "NHWC" else [n, c, h, w]


def _window(rng, invalid):
    """(kh, kw) as ints, mostly small; sometimes huge or invalid when `invalid`."""
    def one():
        r = rng.random()
        if invalid and r < 0.1:
            return int(_pick(rng, [0, -1, -7, 2**31, 2**31 - 1, 2**40, -(2**63)]))
        if r < 0.15:
            return int(rng.integers(6, 40))
        return int(rng.integers(1, 6))
    return one(), one()


def _four(fmt, hw, outer=(1, 1)):
    kh, kw = hw
    return [outer[0], kh, kw, outer[1]] if fmt == "NHWC" else [outer[0], outer[1], kh, kw]


def _attr_list(rng, fmt, invalid):
    """A raw-op ksize/strides attribute: usually valid, sometimes wrong in some way."""
    hw = _window(rng, invalid)
    if invalid and rng.random() < 0.15:
        return _pick(rng, [[], [2], [1, 2, 2], [1, 2, 2, 1, 1],
                           _four(fmt, hw, (2, 1)), _four(fmt, hw, (1, 3)), _four(fmt, hw, (0, 1))])
    return _four(fmt, hw)


def _api_window_arg(rng, fmt, invalid):
    """ksize/strides in the Python API's forms, sometimes malformed."""
    hw = _window(rng, invalid)
    form = rng.random()
    if invalid and form < 0.12:
        return _pick(rng, ["2", 2.0, None, True, [2, "2"], [1.5, 2], [[2, 2]], (), [1, 2, 3],
                           [2, 2, 2, 2, 2], _four(fmt, hw, (2, 1)), {"k": 2}])
    if form < 0.35:
        return hw[0]
    if form < 0.45:
        return [hw[0]]
    if form < 0.75:
        return list(hw)
    return _four(fmt, hw)


DTYPES = ["float16", "bfloat16", "float32", "float64"]
BAD_DTYPES = ["int32", "uint8", "int64", "int8", "complex64", "bool"]


def _values(rng, tf, shape, dtype):
    """Input values: small integers (ties, non-positive windows), noise, specials."""
    import numpy as np
    z = rng.integers(-4, 3, size=shape).astype(np.float64)
    if rng.random() < 0.5:
        z += rng.normal(size=shape) * 0.5
    if rng.random() < 0.3 and z.size:
        m = rng.random(shape) < 0.1
        z[m] = rng.choice([0.0, -0.0, np.inf, -np.inf, np.nan], size=int(m.sum()))
    if dtype in BAD_DTYPES:
        if dtype == "bool":
            return tf.constant(z > 0)
        if dtype == "complex64":
            return tf.constant(np.nan_to_num(z, posinf=1, neginf=-1).astype(np.complex64))
        return tf.constant(np.nan_to_num(z, posinf=1, neginf=-1).astype(np.int64) % 100, getattr(tf, dtype))
    if dtype in ("float32", "float64"):
        z[z == 0] = 0.0  # stock Relu's sign of zero is position-dependent for these
    return tf.constant(z, getattr(tf, dtype))


def _padding(rng, invalid):
    if invalid and rng.random() < 0.1:
        return _pick(rng, ["FULL", "EXPLICIT", "", "same ", None, 0, [[0, 0]] * 4, b"SAME"])
    return _pick(rng, ["VALID", "SAME", "valid", "Same"] if rng.random() < 0.1 else ["VALID", "SAME"])


def _format(rng, invalid):
    if invalid and rng.random() < 0.08:
        return _pick(rng, ["NCDHW", "NWHC", "", None, 4, "HWCN"])
    return _pick(rng, ["NHWC", "NCHW"])


# ---------------------------------------------------------------------------------------------
# Result checks for calls that succeed.

def _same_values(a, b, what):
    """Equal values, NaNs equal, +0 == -0 (stock's zero sign is not defined everywhere)."""
    import numpy as np
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise SanityError(f"{what}: shape {a.shape} != {b.shape}")
    bad = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SanityError(f"{what}: {int(bad.sum())} of {a.size} differ, first at {i}: "
                          f"{a.ravel()[i]!r} vs {b.ravel()[i]!r}")


def _same_bits(a, b, what):
    import numpy as np
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise SanityError(f"{what}: {a.shape}/{a.dtype} != {b.shape}/{b.dtype}")
    na, nb = np.isnan(a.astype(np.float64)), np.isnan(b.astype(np.float64))
    ua = a.view(f"u{a.itemsize}").copy()
    ub = b.view(f"u{b.itemsize}").copy()
    ua[na] = 0
    ub[nb] = 0
    if not (np.array_equal(na, nb) and np.array_equal(ua, ub)):
        raise SanityError(f"{what}: bits differ")


def _stock_can_run(ksize, strides):
    """Stock MaxPool itself segfaults for windows near 2**31 (e.g. ksize [1, 3, 2**31 - 1, 1],
    SAME, TF 2.21), so the reference is only consulted for ordinary windows."""
    return max(ksize) <= 1024 and max(strides) <= 1024


def _stock(tf, z, dy, ksize, strides, padding, fmt):
    """Stock max_pool2d(relu(z)) and its gradient (NCHW through transposes: stock CPU is NHWC
    without oneDNN), with the forward value of all-NaN 16-bit windows, which differs between
    machines, checked and replaced by the definition: conftest.defined_pool_output, shared with
    the pytest tests (this file's directory is on sys.path, as the script's or test_fuzz's)."""
    from conftest import defined_pool_output
    to = (lambda x: x) if fmt == "NHWC" else (lambda x: tf.transpose(x, [0, 2, 3, 1]))
    back = (lambda x: x) if fmt == "NHWC" else (lambda x: tf.transpose(x, [0, 3, 1, 2]))
    k = [ksize[0], ksize[2], ksize[3], ksize[1]] if fmt == "NCHW" else ksize
    s = [strides[0], strides[2], strides[3], strides[1]] if fmt == "NCHW" else strides
    with tf.device("/CPU:0"):  # stock's CPU kernels are the definition, also on a GPU machine
        with tf.GradientTape() as tape:
            tape.watch(z)
            y = back(tf.nn.max_pool2d(tf.nn.relu(to(z)), k, s, padding, data_format="NHWC"))
        dz = tape.gradient(y, z, output_gradients=dy) if dy is not None else None
    try:
        y = defined_pool_output(y, z, ksize, strides, padding, fmt)
    except AssertionError as e:
        raise SanityError(f"stock reference: {e}") from None
    return y, dz


def _normalised(arg, fmt):
    """4-entry list of an API window argument (which is valid when this is called)."""
    if isinstance(arg, int):
        arg = [arg, arg]
    arg = list(arg)
    if len(arg) == 1:
        arg = arg * 2
    if len(arg) == 2:
        return _four(fmt, arg)
    return arg


# ---------------------------------------------------------------------------------------------
# The kinds of call.

def call_api(rng, tf, tfr, lib):
    """Python API forward (+ gradient through the registered gradients), both keep modes."""
    import numpy as np
    invalid = rng.random() < 0.3
    fmt = _format(rng, invalid)
    f4 = fmt if fmt in ("NHWC", "NCHW") else "NHWC"
    dtype = _pick(rng, BAD_DTYPES) if invalid and rng.random() < 0.1 else _pick(rng, DTYPES)
    shape = _shape(rng, f4)
    if invalid and rng.random() < 0.08:
        shape = _pick(rng, [shape[:3], shape + [1], [], [2]])
    z = _values(rng, tf, shape, dtype)
    ksize = _api_window_arg(rng, f4, invalid)
    strides = _api_window_arg(rng, f4, invalid)
    padding = _padding(rng, invalid)
    keep = _pick(rng, ["argmax", "input", "relu", None]) if invalid and rng.random() < 0.1 else \
        _pick(rng, ["argmax", "input"])
    with tf.GradientTape() as tape:
        tape.watch(z)
        y = tfr.relu_max_pool2d(z, ksize, strides, padding, data_format=fmt, keep=keep)
    dy = tf.constant(rng.normal(size=y.shape.as_list()), z.dtype)
    dz = tape.gradient(y, z, output_gradients=dy)
    # Valid call: compare with stock and with the other keep mode.
    # A padding list is an explicit padding, which the API takes as tf.nn.max_pool2d does; the
    # only one drawn here is all zeros, which is VALID.
    fmt_u, pad_u = fmt.upper(), padding.upper() if isinstance(padding, str) else "VALID"
    k4, s4 = _normalised(ksize, fmt_u), _normalised(strides, fmt_u)
    if z.shape.num_elements() and y.shape.num_elements() and _stock_can_run(k4, s4):
        ys, dzs = _stock(tf, z, dy, k4, s4, pad_u, fmt_u)
        _same_values(y.numpy(), ys, "forward vs stock")
        _same_values(dz.numpy(), dzs.numpy(), "gradient vs stock")
    other = "input" if keep == "argmax" else "argmax"
    with tf.GradientTape() as tape:
        tape.watch(z)
        y2 = tfr.relu_max_pool2d(z, ksize, strides, padding, data_format=fmt, keep=other)
    dz2 = tape.gradient(y2, z, output_gradients=dy)
    _same_bits(y.numpy(), y2.numpy(), "forward argmax vs input mode")
    _same_bits(dz.numpy(), dz2.numpy(), "gradient argmax vs input mode")
    assert np.asarray(dz).shape == tuple(shape)


def call_raw_forward(rng, tf, tfr, lib):
    invalid = rng.random() < 0.35
    fmt = _format(rng, invalid) if rng.random() < 0.9 else "NHWC"
    f4 = fmt if fmt in ("NHWC", "NCHW") else "NHWC"
    dtype = _pick(rng, BAD_DTYPES) if invalid and rng.random() < 0.15 else _pick(rng, DTYPES)
    shape = _shape(rng, f4)
    if invalid and rng.random() < 0.1:
        shape = _pick(rng, [shape[:3], shape + [1], [5]])
    z = _values(rng, tf, shape, dtype)
    ksize, strides = _attr_list(rng, f4, invalid), _attr_list(rng, f4, invalid)
    padding = _padding(rng, invalid)
    targmax = _pick(rng, ["uint8", "uint16", "int32"] + (["int64", "float32", "uint32"] if invalid else []))
    y = lib.relu_max_pool(z, ksize=ksize, strides=strides, padding=padding, data_format=fmt)
    y2, codes = lib.relu_max_pool_with_window_argmax(z, ksize=ksize, strides=strides,
                                                     padding=padding, data_format=fmt,
                                                     Targmax=getattr(tf, targmax))
    _same_bits(y.numpy(), y2.numpy(), "ReluMaxPool vs WithWindowArgmax")
    if fmt == "NHWC" and y.shape.num_elements() and _stock_can_run(ksize, strides):
        ys, _ = _stock(tf, z, None, ksize, strides, padding, "NHWC")
        _same_values(y.numpy(), ys, "raw forward vs stock")


def _codes_for(rng, tf, lib, z, attrs, targmax):
    _, codes = lib.relu_max_pool_with_window_argmax(z, Targmax=targmax, **attrs)
    return codes


def _raw_case(rng, tf):
    """A valid raw-op case: format, shape, input values and attributes."""
    fmt = _pick(rng, ["NHWC", "NCHW"])
    shape = _shape(rng, fmt)
    z = _values(rng, tf, shape, _pick(rng, DTYPES))
    attrs = dict(ksize=_attr_list(rng, fmt, False), strides=_attr_list(rng, fmt, False),
                 padding=_pick(rng, ["VALID", "SAME"]), data_format=fmt)
    return fmt, shape, z, attrs


def call_raw_grads(rng, tf, tfr, lib):
    """ReluMaxPoolGrad and ReluMaxPoolGradFromWindowArgmax with good, bad and corrupted inputs."""
    import numpy as np
    fmt, shape, z, attrs = _raw_case(rng, tf)
    dtype = z.dtype.name
    targmax = _pick(rng, [tf.uint8, tf.uint16, tf.int32])
    try:
        y, codes = lib.relu_max_pool_with_window_argmax(z, Targmax=targmax, **attrs)
    except tf.errors.InvalidArgumentError:
        # Window too big for the code type: then the compact gradient must refuse it too.
        targmax = tf.int32
        y, codes = lib.relu_max_pool_with_window_argmax(z, Targmax=targmax, **attrs)
    dy = tf.constant(rng.normal(size=y.shape.as_list()), z.dtype)
    mode = rng.random()
    if mode < 0.3:
        # Valid: both gradients agree bitwise.
        dz = lib.relu_max_pool_grad(z, dy, **attrs)
        shape_t = tf.constant(shape, _pick(rng, [tf.int32, tf.int64]))
        dz2 = lib.relu_max_pool_grad_from_window_argmax(shape_t, dy, codes, **attrs)
        _same_bits(dz.numpy(), dz2.numpy(), "grad from input vs from argmax")
        if (fmt == "NHWC" and z.shape.num_elements() and y.shape.num_elements()
                and _stock_can_run(attrs["ksize"], attrs["strides"])):
            _, dzs = _stock(tf, z, dy, attrs["ksize"], attrs["strides"], attrs["padding"], fmt)
            _same_values(dz.numpy(), dzs.numpy(), "raw grad vs stock")
        return
    if mode < 0.6:
        # Corrupted codes: random bits, positions in the padding / past the window, sentinel.
        c = codes.numpy().copy()
        if c.size:
            n = int(rng.integers(1, 4))
            idx = rng.integers(c.size, size=n)
            info = np.iinfo(c.dtype)
            kind = _pick(rng, ["random", "past", "sentinel", "negative", "padding"])
            flat = c.reshape(-1)
            for i in idx:
                if kind == "random":
                    flat[i] = rng.integers(info.min, int(info.max) + 1, dtype=np.int64)
                elif kind == "past":
                    kh, kw = (attrs["ksize"][1:3] if fmt == "NHWC" else attrs["ksize"][2:4])
                    flat[i] = min(int(info.max), kh * kw + int(rng.integers(0, 3)))
                elif kind == "sentinel":
                    flat[i] = info.max
                elif kind == "negative":
                    flat[i] = info.min if info.min < 0 else info.max - 1
                else:
                    flat[i] = rng.integers(0, min(int(info.max), 64))
        shape_t = tf.constant(shape, tf.int32)
        dz = lib.relu_max_pool_grad_from_window_argmax(shape_t, dy, tf.constant(c), **attrs)
        assert dz.shape.as_list() == shape
        return
    if mode < 0.8:
        # Mismatched shapes / dtypes of grad, argmax, input_shape.
        which = _pick(rng, ["grad", "argmax", "shape", "dtype"])
        gshape = y.shape.as_list()
        bad = list(gshape)
        bad[int(rng.integers(4))] += int(_pick(rng, [1, -1, 5]))
        bad = [max(0, b) for b in bad]
        if which == "grad":
            g = tf.zeros(bad if rng.random() < 0.8 else bad[:3], z.dtype)
            if rng.random() < 0.5:
                lib.relu_max_pool_grad(z, g, **attrs)
            else:
                lib.relu_max_pool_grad_from_window_argmax(shape, g, codes, **attrs)
        elif which == "argmax":
            lib.relu_max_pool_grad_from_window_argmax(shape, dy, tf.zeros(bad, targmax), **attrs)
        elif which == "shape":
            s = list(shape)
            s[int(rng.integers(4))] += int(_pick(rng, [1, 2, -1]))
            if rng.random() < 0.3:
                s = _pick(rng, [s[:3], s + [1], [[1, 2], [3, 4]], []])
            lib.relu_max_pool_grad_from_window_argmax(s, dy, codes, **attrs)
        else:
            other = _pick(rng, [d for d in DTYPES if d != dtype])
            lib.relu_max_pool_grad(z, tf.cast(dy, getattr(tf, other)), **attrs)
        return
    # Negative and huge input_shape values (the compact gradient trusts no one).
    big = _pick(rng, [-1, -2, -(2**31), 2**31, 2**40, 2**62, 2**63 - 1, 2**32 + 1])
    s = list(shape)
    s[int(rng.integers(4))] = big
    if rng.random() < 0.3:
        s[int(rng.integers(4))] = _pick(rng, [2**62, 2**63 - 1, -5])
    dt = tf.int64 if rng.random() < 0.8 else tf.int32
    if dt == tf.int32:
        s = [int(np.int64(v).astype(np.int32)) if abs(v) >= 2**31 else v for v in s]
    k = _pick(rng, [attrs["ksize"], _four(fmt, (2**31 - 1, 2**31 - 1))])
    lib.relu_max_pool_grad_from_window_argmax(tf.constant(s, dt), dy, codes,
                                              **dict(attrs, ksize=k, strides=k))


def call_graph(rng, tf, tfr, lib):
    """Graph mode: the shape functions, with unknown dims and constant (possibly bad) shapes."""
    fmt = _pick(rng, ["NHWC", "NCHW"])
    shape = _shape(rng, fmt)
    dtype = getattr(tf, _pick(rng, DTYPES))
    invalid = rng.random() < 0.3
    attrs = dict(ksize=_attr_list(rng, fmt, invalid), strides=_attr_list(rng, fmt, invalid),
                 padding=_padding(rng, False), data_format=fmt)
    spec_shape = [None if rng.random() < 0.3 else d for d in shape]
    if rng.random() < 0.1:
        spec_shape = None

    @tf.function(input_signature=[tf.TensorSpec(spec_shape, dtype)])
    def f(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            y = tfr.relu_max_pool2d(z, attrs["ksize"], attrs["strides"], attrs["padding"], fmt,
                                    keep=_pick(rng, ["argmax", "input"]))
        return y, tape.gradient(y, z)

    z = _values(rng, tf, shape, _pick(rng, [dtype.name]))
    y, dz = f(z)
    assert dz.shape.as_list() == shape

    big = _pick(rng, [-1, -3, 2**62, 2**63 - 1, 7])

    @tf.function
    def g():
        s = list(shape)
        s[int(rng.integers(4))] = big
        return lib.relu_max_pool_grad_from_window_argmax(
            tf.constant(s, tf.int64), tf.zeros([1, 1, 1, 1], dtype), tf.zeros([1, 1, 1, 1], tf.uint8),
            **attrs)

    g.get_concrete_function()


def call_raw_grad_grad(rng, tf, tfr, lib):
    """ReluMaxPoolGradGradFromWindowArgmax with good, corrupted and mismatched inputs. Valid calls
    check that it is the transpose of ReluMaxPoolGradFromWindowArgmax: <GG(ddz), dy> equals
    <ddz, G(dy)>, computed exactly (float64 sums of small integers)."""
    import numpy as np
    _, shape, z, attrs = _raw_case(rng, tf)
    dtype = z.dtype
    try:
        y, codes = lib.relu_max_pool_with_window_argmax(z, Targmax=tf.uint16, **attrs)
    except tf.errors.InvalidArgumentError:
        y, codes = lib.relu_max_pool_with_window_argmax(z, Targmax=tf.int32, **attrs)
    ddz = tf.constant(rng.integers(-4, 5, size=shape), dtype)
    mode = rng.random()
    if mode < 0.5:
        ddy = lib.relu_max_pool_grad_grad_from_window_argmax(ddz, codes, **attrs)
        assert ddy.shape == y.shape and ddy.dtype == z.dtype
        dy = tf.constant(rng.integers(-4, 5, size=y.shape.as_list()), dtype)
        dz = lib.relu_max_pool_grad_from_window_argmax(shape, dy, codes, **attrs)
        f64 = lambda t: np.nan_to_num(t.numpy().astype(np.float64))  # noqa: E731
        lhs, rhs = float(np.sum(f64(ddy) * f64(dy))), float(np.sum(f64(ddz) * f64(dz)))
        if lhs != rhs:
            raise SanityError(f"grad-grad is not the transpose of grad: {lhs} != {rhs}")
        return
    if mode < 0.75:
        c = codes.numpy().copy()
        if c.size:
            flat = c.reshape(-1)
            flat[int(rng.integers(c.size))] = _pick(rng, [np.iinfo(c.dtype).max - 1, 300, 4095])
        lib.relu_max_pool_grad_grad_from_window_argmax(ddz, tf.constant(c), **attrs)
        return
    bad = y.shape.as_list()
    bad[int(rng.integers(4))] += 1
    if rng.random() < 0.5:
        lib.relu_max_pool_grad_grad_from_window_argmax(ddz, tf.zeros(bad, codes.dtype), **attrs)
    else:
        lib.relu_max_pool_grad_grad_from_window_argmax(ddz[..., :1] if rng.random() < 0.5
                                                       else ddz[0], codes, **attrs)


KINDS = [(call_api, 0.3), (call_raw_forward, 0.2), (call_raw_grads, 0.25),
         (call_raw_grad_grad, 0.15), (call_graph, 0.1)]


def describe_call(seed, index):
    import numpy as np
    rng = np.random.default_rng([seed, index])
    weights = np.array([w for _, w in KINDS])
    return KINDS[int(rng.choice(len(KINDS), p=weights / weights.sum()))][0].__name__


def run_one(seed, index, tf, tfr, lib):
    """Runs call `index` of `seed`; returns 'ok' or the error's class name. Raises SanityError."""
    import numpy as np
    rng = np.random.default_rng([seed, index])
    weights = np.array([w for _, w in KINDS])
    fn = KINDS[int(rng.choice(len(KINDS), p=weights / weights.sum()))][0]
    try:
        fn(rng, tf, tfr, lib)
        return fn.__name__, "ok", None
    except SanityError:
        raise
    except (tf.errors.OpError, ValueError, TypeError) as e:
        return fn.__name__, type(e).__name__, _message(e)


def _message(e):
    """The informative line of an error (tf.function's errors end with it)."""
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    if not lines:
        return ""
    line = lines[-1] if lines[0].startswith("in user code") else lines[0]
    return line[:300]


def worker(seed, first, calls, progress_file, verbose=False):
    """Runs calls [first, first + calls) of `seed` in this process; prints a JSON summary."""
    import warnings
    import numpy as np
    import tensorflow as tf
    import tf_relupool as tfr
    tf.get_logger().setLevel("ERROR")
    warnings.simplefilter("ignore")
    np.seterr(all="ignore")
    lib = tfr.load_library()
    counts = collections.Counter()
    unexpected = []
    messages = {}
    for i in range(first, first + calls):
        if progress_file:
            with open(progress_file, "w") as f:
                f.write(f"{seed}:{i}")
        try:
            kind, result, msg = run_one(seed, i, tf, tfr, lib)
        except SanityError as e:
            counts["wrong_result"] += 1
            unexpected.append(f"{seed}:{i} wrong result: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - anything else is unexpected
            counts["unexpected:" + type(e).__name__] += 1
            unexpected.append(f"{seed}:{i} {type(e).__name__}: {e}\n{traceback.format_exc()}")
            continue
        counts[result] += 1
        if result != "ok":
            if result not in ALLOWED_TF_ERRORS + ALLOWED_PY_ERRORS:
                unexpected.append(f"{seed}:{i} {kind}: {result}: {msg}")
            elif not msg.strip():
                unexpected.append(f"{seed}:{i} {kind}: {result} with an empty message")
            messages.setdefault(result, f"{kind}: {msg}")
        if verbose:
            print(f"{seed}:{i} {kind}: {result} {msg or ''}", flush=True)
    print(json.dumps({"counts": counts, "unexpected": unexpected, "examples": messages}))


def run_batches(calls, seed, batch=500, python=None, timeout=600, jobs=1, env=None):
    """Runs `calls` calls of `seed` in worker processes of `batch` calls; returns a summary."""
    python = python or sys.executable
    summary = {"calls": 0, "counts": collections.Counter(), "crashes": [], "unexpected": [],
               "examples": {}}
    tmp = tempfile.mkdtemp(prefix="tfrp_fuzz_")
    batches = [(first, min(batch, calls - first)) for first in range(0, calls, batch)]
    pending = list(batches)
    running = []
    script = os.path.abspath(__file__)

    def start(first, n):
        prog = os.path.join(tmp, f"progress_{first}")
        cmd = [python, script, "--worker", "--seed", str(seed), "--first", str(first),
               "--calls", str(n), "--progress", prog]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=tmp, env=env)
        return (p, first, n, prog, time.time())

    while pending or running:
        while pending and len(running) < jobs:
            running.append(start(*pending.pop(0)))
        p, first, n, prog, t0 = running.pop(0)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        last = open(prog).read() if os.path.exists(prog) else f"{seed}:{first} (before the first call)"
        result = None
        for line in reversed(out.strip().splitlines()):
            if line.startswith("{"):
                result = json.loads(line)
                break
        if p.returncode != 0 or result is None:
            how = (f"signal {-p.returncode}" if p.returncode < 0 else f"exit status {p.returncode}")
            summary["crashes"].append(f"worker for calls {first}..{first + n - 1} died ({how}) in "
                                      f"call {last} ({describe_call(*map(int, last.split(':')[:2])) if ':' in last and last.split(':')[1].isdigit() else '?'}); "
                                      f"replay: python tests/fuzz_ops.py --replay {last.split(' ')[0]}\n"
                                      + err[-3000:])
            done = int(last.split(":")[1]) - first if ":" in last and last.split(":")[1].isdigit() else 0
            summary["calls"] += done + 1
            if result is None:
                # Carry on after the crashing call so one crash does not hide the rest.
                rest = n - done - 1
                if rest > 0:
                    pending.insert(0, (first + done + 1, rest))
                continue
        summary["calls"] += sum(result["counts"].values()) if p.returncode == 0 else 0
        summary["counts"].update(result["counts"])
        summary["unexpected"].extend(result["unexpected"])
        for k, v in result["examples"].items():
            summary["examples"].setdefault(k, v)
    summary["counts"]["crash"] = len(summary["crashes"])
    return summary


def report(summary, seed, elapsed):
    c = summary["counts"]
    errors = {k: v for k, v in sorted(c.items()) if k not in ("ok", "crash")}
    lines = [f"fuzz: seed {seed}: {summary['calls']} calls in {elapsed:.0f} s: {c.get('ok', 0)} ok, "
             f"{sum(errors.values())} errors, {len(summary['crashes'])} crashes"]
    for k, v in errors.items():
        lines.append(f"  {k}: {v}" + (f"   e.g. {summary['examples'][k][:160]}" if k in summary["examples"] else ""))
    for u in summary["unexpected"][:20]:
        lines.append("UNEXPECTED: " + u[:2000])
    for cr in summary["crashes"][:20]:
        lines.append("CRASH: " + cr)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1000, help="calls per worker process")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes at once")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--progress", default=None)
    ap.add_argument("--replay", default=None, help="SEED:INDEX of one call to run verbosely")
    a = ap.parse_args()
    if a.replay:
        seed, index = map(int, a.replay.split(":"))
        print(f"replaying {describe_call(seed, index)} {seed}:{index}", flush=True)
        worker(seed, index, 1, None, verbose=True)
        return 0
    if a.worker:
        worker(a.seed, a.first, a.calls, a.progress)
        return 0
    t0 = time.time()
    summary = run_batches(a.calls, a.seed, a.batch, jobs=a.jobs)
    print(report(summary, a.seed, time.time() - t0))
    bad = summary["crashes"] or summary["unexpected"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
