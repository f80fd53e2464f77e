"""Shared helpers: stock-TensorFlow references, bitwise comparison, hypothesis strategies.

Tests import the installed tf_relupool (run from the repository root with the venv's pytest,
the source tree's tf_relupool/ has no compiled library unless built in place).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The fusion's tests test its form on every CPU: where XLA emits AVX-512 code, the switch's
# default (`exact`) gives a ReLU + max pool after a bias or a BatchNormalization stock's route
# (tf_relupool.xla.reordered_sum_reason), so the suite asks for the fusion there
# (enable_recompute(exact=False)'s environment default; subprocesses inherit it); the default
# itself is tested with exact=True (test_xla.py's test_exact_*).
os.environ.setdefault("TF_RELUPOOL_EXACT", "0")

import contextlib
import importlib.util
import sys

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

settings.register_profile(
    "default", deadline=None, max_examples=int(os.environ.get("TF_RELUPOOL_EXAMPLES", "300")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("default")


def examples(n):
    """A test's own example count, capped by TF_RELUPOOL_EXAMPLES (the profile's count), so that
    a run that asks for fewer examples gets fewer everywhere."""
    return min(n, settings.default.max_examples)


DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x):
    """The raw bit patterns of a float tensor/array; every NaN maps to one pattern."""
    a = np.asarray(x.numpy() if hasattr(x, "numpy") else x)
    u = a.view(_UINT[a.dtype.itemsize]).copy()
    nan = np.isnan(a.astype(np.float64))
    u[nan] = 0
    return u, nan


def assert_bitwise_equal(actual, expected, what=""):
    a, a_nan = bits(actual)
    e, e_nan = bits(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    np.testing.assert_array_equal(a_nan, e_nan, err_msg=f"{what}: NaN positions differ")
    bad = np.flatnonzero(a != e)
    assert bad.size == 0, (
        f"{what}: {bad.size} of {a.size} elements differ in their bits; first at flat index "
        f"{bad[0]}: got {np.asarray(actual).ravel()[bad[0]]!r}, stock {np.asarray(expected).ravel()[bad[0]]!r}")


def to_nhwc(x, data_format):
    return x if data_format == "NHWC" else tf.transpose(x, [0, 2, 3, 1])


def from_nhwc(x, data_format):
    return x if data_format == "NHWC" else tf.transpose(x, [0, 3, 1, 2])


def spatial_pair(value, data_format):
    """(rows, cols) of a window/stride argument in any form tf.nn.max_pool2d accepts. Written
    here, not taken from tf_relupool/_geometry.py: the stock references are built from it, so a
    misreading in the package's normalize_window must not reach both sides of a comparison."""
    if isinstance(value, (int, np.integer)):
        return int(value), int(value)
    value = [int(v) for v in value]
    if len(value) == 1:
        return value[0], value[0]
    if len(value) == 2:
        return value[0], value[1]
    return tuple(value[1:3]) if data_format == "NHWC" else tuple(value[2:4])


def nhwc_window(value, data_format):
    """A ksize/strides argument of pool_cases in the form for an NHWC call (a 4-entry NCHW one
    reordered)."""
    if data_format == "NCHW" and isinstance(value, list) and len(value) == 4:
        return [value[0], value[2], value[3], value[1]]
    return value


def nhwc_padding(padding, data_format):
    """A padding argument of pool_cases in the form for an NHWC call (explicit pairs reordered)."""
    if isinstance(padding, str) or data_format == "NHWC":
        return padding
    return [padding[0], padding[2], padding[3], padding[1]]


def window_bounds(size, k, s, padding, pads=(0, 0)):
    """First and last + 1 input index of each pooling window along one axis, clipped to the input
    (TensorFlow's VALID/SAME output sizes and SAME padding before = total // 2; explicit padding:
    `pads` = (before, after))."""
    if not isinstance(padding, str):
        out, before = max(0, (size + pads[0] + pads[1] - k) // s + 1), pads[0]
    elif padding == "VALID":
        out, before = max(0, -(-(size - k + 1) // s)), 0
    else:
        out = -(-size // s)
        before = max((out - 1) * s + k - size, 0) // 2
    start = np.arange(out, dtype=np.int64) * s - before
    return np.clip(start, 0, size), np.clip(start + k, 0, size)


def window_grid(h, w, ksize, strides, padding, data_format):
    """window_bounds along rows and columns of an h x w plane for a pooling call's arguments
    (ksize/strides in any tf.nn.max_pool2d form, padding a string or explicit pairs in
    data_format order): ((r0, r1), (c0, c1))."""
    (kh, kw), (sh, sw) = spatial_pair(ksize, data_format), spatial_pair(strides, data_format)
    pads = nhwc_padding(padding, data_format)
    rows, cols = ((0, 0), (0, 0)) if isinstance(pads, str) else (pads[1], pads[2])
    return window_bounds(h, kh, sh, padding, rows), window_bounds(w, kw, sw, padding, cols)


def all_nan_windows(z, ksize, strides, padding, data_format):
    """Mask over the pooled output (in data_format's layout): True where every in-bounds value of
    the window is NaN, i.e. where relu(z) holds nothing but NaN. Computed in numpy from window
    counts (a summed-area table), independently of TensorFlow's pooling."""
    z = np.asarray(z.numpy() if hasattr(z, "numpy") else z)
    if data_format == "NCHW":
        z = z.transpose(0, 2, 3, 1)
    n, h, w, c = z.shape
    (r0, r1), (c0, c1) = window_grid(h, w, ksize, strides, padding, data_format)
    table = np.zeros([n, h + 1, w + 1, c], np.int64)
    table[:, 1:, 1:] = (~np.isnan(z.astype(np.float64))).cumsum(1).cumsum(2)
    numbers = (table[:, r1[:, None], c1[None, :]] - table[:, r0[:, None], c1[None, :]]
               - table[:, r1[:, None], c0[None, :]] + table[:, r0[:, None], c0[None, :]])
    sizes = ((r1 - r0)[:, None] * (c1 - c0)[None, :])[None, :, :, None]
    mask = (numbers == 0) & (sizes > 0)
    return mask if data_format == "NHWC" else mask.transpose(0, 3, 1, 2)


def defined_pool_output(y_stock, z, ksize, strides, padding, data_format):
    """Stock's max_pool2d(relu(z)) with its one machine-dependent value replaced by tf_relupool's
    definition; every other element is stock's, unchanged (a numpy array of y_stock's dtype).

    A window whose ReLU'd values are all NaN keeps its start value. tf_relupool defines that as
    the dtype's lowest finite value for every dtype. Stock float32/float64 give that everywhere;
    stock float16/bfloat16 give the lowest finite value on some machines (its Eigen kernels, e.g.
    TF_ENABLE_ONEDNN_OPTS=0) and -Inf on others (oneDNN: bfloat16 on AVX-512 AMD EPYC, both on an
    AVX-512 Intel Xeon). So for 16-bit dtypes this asserts that stock gave one of those two there
    and substitutes the lowest finite value; anything else stock gives there fails.
    """
    y = np.array(y_stock.numpy() if hasattr(y_stock, "numpy") else y_stock)
    if y.dtype.itemsize != 2 or y.size == 0:
        return y
    mask = all_nan_windows(z, ksize, strides, padding, data_format)
    assert mask.shape == y.shape, f"window mask {mask.shape} vs pooled output {y.shape}"
    lowest = np.array(tf.as_dtype(y.dtype).min, y.dtype)
    allowed = {int(lowest.view(np.uint16)), int(np.array(-np.inf, y.dtype).view(np.uint16))}
    u = y.view(np.uint16)
    unexpected = sorted({int(v) for v in u[mask]} - allowed)
    assert not unexpected, (
        f"stock {y.dtype} pooled an all-NaN window to bits {[hex(v) for v in unexpected]}, "
        f"neither -Inf nor the lowest finite value {lowest!r}")
    # Any window holding a non-NaN value pools to >= -0, never to those two: this catches a mask
    # that misses an all-NaN window, on every machine.
    assert not np.isin(u[~mask], list(allowed)).any(), "all-NaN window outside the mask"
    y[mask] = lowest
    return y


def stock_forward_and_grad(z, dy, ksize, strides, padding, data_format, defined=True):
    """tf.nn.max_pool2d(tf.nn.relu(z)) and its gradient for dy, in eager mode.

    Stock runs on the CPU even where a GPU is visible: stock's CPU kernels are the definition
    (stock's GPU pooling differs in NaN, -0 and tie handling and summation order), while the fused
    op under test runs on the default device (the GPU kernels must equal the CPU kernels).
    Stock CPU pooling supports only NHWC (without oneDNN), so NCHW goes through transposes (which
    move values without changing them). With `defined` (the default), the forward values of
    all-NaN windows, where stock differs between machines, are checked to be one of stock's
    values and replaced by the definition (defined_pool_output); the gradient is stock's.
    """
    with tf.device("/CPU:0"):
        with tf.GradientTape() as tape:
            tape.watch(z)
            y = from_nhwc(tf.nn.max_pool2d(tf.nn.relu(to_nhwc(z, data_format)),
                                           nhwc_window(ksize, data_format),
                                           nhwc_window(strides, data_format),
                                           nhwc_padding(padding, data_format),
                                           data_format="NHWC"), data_format)
        dz = tape.gradient(y, z, output_gradients=dy) if dy is not None else None
    if defined:
        y = tf.constant(defined_pool_output(y, z, ksize, strides, padding, data_format), y.dtype)
    return y, dz


def fused_forward_and_grad(z, dy, ksize, strides, padding, data_format, keep):
    import tf_relupool
    with tf.GradientTape() as tape:
        tape.watch(z)
        y = tf_relupool.relu_max_pool2d(z, ksize, strides, padding, data_format, keep=keep)
    dz = tape.gradient(y, z, output_gradients=dy) if dy is not None else None
    return y, dz


SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan]


@st.composite
def pool_cases(draw, dtypes=DTYPES, allow_nan=True, max_spatial=9):
    """A random pooling configuration with data full of ties, non-positive windows and specials."""
    data_format = draw(st.sampled_from(["NHWC", "NCHW"]))
    padding = draw(st.sampled_from(["VALID", "SAME", "EXPLICIT"]))
    dtype = draw(st.sampled_from(dtypes))
    n = draw(st.integers(0, 3) if draw(st.integers(0, 9)) == 0 else st.integers(1, 3))
    c = draw(st.integers(0, 4) if draw(st.integers(0, 9)) == 0 else st.integers(1, 4))
    h = draw(st.integers(1, max_spatial))
    w = draw(st.integers(1, max_spatial))
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    sh, sw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    # The argument forms tf.nn.max_pool2d accepts.
    form = draw(st.sampled_from(["int", "pair", "four"]))
    if form == "int":
        ksize, strides = kh, sh
        kw, sw = kh, sh  # the window the call gets
    elif form == "pair":
        ksize, strides = [kh, kw], [sh, sw]
    else:
        ksize = [1, kh, kw, 1] if data_format == "NHWC" else [1, 1, kh, kw]
        strides = [1, sh, sw, 1] if data_format == "NHWC" else [1, 1, sh, sw]
    shape = [n, h, w, c] if data_format == "NHWC" else [n, c, h, w]
    if padding == "EXPLICIT":
        # tf.nn.max_pool2d's explicit form: (before, after) per dimension, each below the window.
        # Stock refuses an input that does not fill one window with its padding ("output size
        # would be negative"): then pad as much as allowed.
        rows = [draw(st.integers(0, kh - 1)), draw(st.integers(0, kh - 1))]
        cols = [draw(st.integers(0, kw - 1)), draw(st.integers(0, kw - 1))]
        rows = rows if h + sum(rows) >= kh else [kh - 1, kh - 1]
        cols = cols if w + sum(cols) >= kw else [kw - 1, kw - 1]
        padding = ([[0, 0], rows, cols, [0, 0]] if data_format == "NHWC"
                   else [[0, 0], [0, 0], rows, cols])
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    # Small integers: many ties and many windows with no positive value.
    low = draw(st.sampled_from([-4, -2, -1]))
    z = rng.integers(low, 3, size=shape).astype(np.float64)
    if draw(st.booleans()):
        z = z + rng.normal(size=shape) * draw(st.sampled_from([0.0, 0.5]))
    specials = SPECIALS if allow_nan else SPECIALS[:-1]
    special_rate = draw(st.sampled_from([0.0, 0.05, 0.2]))
    mask = rng.random(shape) < special_rate
    z[mask] = rng.choice(specials, size=int(mask.sum()))
    if dtype in (tf.float32, tf.float64):
        # Stock Relu maps -0 to -0 or +0 depending on the element's position in Eigen's vector
        # packets, so the sign of such a zero output is undefined in stock; see
        # test_negative_zero_follows_std_max. Half and bfloat16 keep -0 everywhere.
        z[z == 0] = 0.0
    return dict(z=z, dtype=dtype, ksize=ksize, strides=strides, padding=padding,
                data_format=data_format, rng_seed=seed)


def make_dy(case, y_shape):
    """Upstream gradient: signed values (so zero signs matter), sometimes with specials."""
    rng = np.random.default_rng(case["rng_seed"] + 1)
    dy = rng.integers(-3, 4, size=y_shape).astype(np.float64) + rng.normal(size=y_shape) * 0.25
    if rng.random() < 0.2 and dy.size:
        m = rng.random(y_shape) < 0.1
        dy[m] = rng.choice([np.inf, -np.inf, np.nan, -0.0], size=int(m.sum()))
    return tf.constant(dy, dtype=case["dtype"])


GPU_VISIBLE = bool(tf.config.list_physical_devices("GPU"))


def cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo (x86-64 Linux), or None where it has none."""
    from tf_relupool import _cpuinfo
    return _cpuinfo.flags()


@pytest.fixture(scope="session")
def lib():
    import tf_relupool
    return tf_relupool.load_library()


BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")


@contextlib.contextmanager
def global_policy(name):
    """Keras' global dtype policy set to `name` inside the block, float32 again after it."""
    import keras
    keras.mixed_precision.set_global_policy(name)
    try:
        yield name
    finally:
        keras.mixed_precision.set_global_policy("float32")


def benchmark_cli(name, *args, timeout=120):
    """benchmarks/<name>.py run with `args` in a fresh process, as a user runs it (the
    CompletedProcess, output as text)."""
    import subprocess
    return subprocess.run([sys.executable, os.path.join(BENCHMARKS, name + ".py"), *args],
                          capture_output=True, text=True, timeout=timeout)


def benchmarks_module(name):
    """A benchmarks/ script as a module, for tests of its own logic (its report, its arguments'
    values); what the package shares with the scripts is tf_relupool/_harness.py's, and a
    script's command line runs in a subprocess (benchmark_cli). None imports TensorFlow at module
    level; benchmarks/ goes on sys.path, where the scripts find harness.py."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def xla_hlo(fn, *args):
    """The HLO XLA compiles `fn(*args)` to under tf.function(jit_compile=True). Getting it
    compiles the function: it raises where an op has no XLA kernel (the op library's ops
    included: "Detected unsupported operations ... ReluMaxPool"). Also asserts that the traced
    graph holds none of the op library's ops. What `supports_jit` only promises, this checks."""
    jitted = tf.function(fn, jit_compile=True)
    hlo = jitted.experimental_get_compiler_ir(*args)(stage="hlo")
    types = {op.type for op in jitted.get_concrete_function(*args).graph.get_operations()}
    assert not any(t.startswith("ReluMaxPool") for t in types), types
    return hlo


def _strip_braced(line, key):
    """`line` without `key` and the balanced {...} after it: on a GPU, backend_config carries the
    cuDNN algorithm and the scheduling hints each compilation's autotuning picks, which two
    compilations of the same HLO need not share."""
    at = line.find(key + "{")
    if at < 0:
        return line
    depth, end = 0, at + len(key)
    for end in range(at + len(key), len(line)):
        depth += {"{": 1, "}": -1}.get(line[end], 0)
        if depth == 0:
            break
    return line[:at] + line[end + 1:]


#: what `optimized_hlo_shape(..., kernels=False)` leaves out: how instructions are grouped into
#: fusions (kernels), not what they compute
_GROUPING_OPS = ("parameter", "tuple", "get-tuple-element", "fusion", "bitcast")


def optimized_hlo_shape(fn, *args, kernels=True):
    """The HLO XLA runs for `fn(*args)` under tf.function(jit_compile=True), after its
    optimizations, with names and metadata removed and the lines sorted: two functions with the
    same shape compile to the same fusions and instructions, so they give the same bits on every
    CPU (the same code). Where two shapes differ, XLA's code can add in another order, which
    shows only on some CPUs (an AVX2-only CPU's vector width, say).

    kernels=False: the instructions alone, their grouping into fusions left out (the lines that
    only pass values between fusions, and the fusions' headers): on a GPU two graphs of the same
    computation whose gradient ops were built in another order can have XLA's sibling
    multi-output fusion group the same reductions into other kernels, each reduction computed
    alike."""
    text = tf.function(fn, jit_compile=True).experimental_get_compiler_ir(*args)(
        stage="optimized_hlo")
    return hlo_shape(text, kernels)


def hlo_shape(text, kernels=True):
    """optimized_hlo_shape of an HLO module's text."""
    import re
    lines = []
    for line in text.splitlines():
        if line.startswith("HloModule"):
            continue
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        line = _strip_braced(line, ", backend_config=")
        if not kernels:
            op = re.match(r"\s*(ROOT )?%[\w.\-]+ = \S+(?: \S+)*? ([a-z\-]+)\(", line)
            if op is None or op.group(2) in _GROUPING_OPS:
                continue
            line = re.sub(r"^\s*(ROOT )?", "", re.sub(r", calls=%[\w.\-]+", "", line))
            line = re.sub(r"/\*index=\d+\*/", "", line)
        line = re.sub(r"%[\w.\-]+", "%v", line)
        line = re.sub(r"\b[A-Za-z_][\w\-]*(\.\d+)+\b", "v", line)  # x.409 (older XLA's params)
        lines.append(re.sub(r"\b(fused_computation|wrapped_\w+|region)[\w.]*", "f", line).strip())
    return sorted(l for l in lines if l)


def forward_and_input_grad(fn, loss=None):
    """A function of z: (fn(z), d<fn(z), 1>/dz), or with `loss` (fn(z), d loss(fn(z))/dz), for
    compiling both directions."""
    def step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            y = fn(z)
            target = y if loss is None else loss(y)
        return y, tape.gradient(target, z, output_gradients=tf.ones_like(target))
    return step


def xla_value_and_grad(fn, z, dy):
    """(fn(z), d<fn(z), dy>/dz) in one XLA-compiled function."""
    @tf.function(jit_compile=True)
    def run(z, dy):
        with tf.GradientTape() as tape:
            tape.watch(z)
            y = fn(z)
        return y, tape.gradient(y, z, output_gradients=dy)
    return run(z, dy)


def xla_train_step(model, x, y):
    """(step, step(x, y)): a jit-compiled function of one training step's loss (sparse
    categorical cross-entropy of logits) and trainable variables' gradients, and its result."""
    import keras
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)
    return step, step(x, y)


def sgd_step(model, lr, from_logits=True, name=None):
    """A jit-compiled SGD step of `model` on (x, y): the mean sparse categorical cross-entropy,
    its gradients for the trainable variables, each variable moved by -lr times its gradient;
    returns (loss, gradients). `name`: the function's name, which XLA's module names carry."""
    import keras
    tvars = model.trainable_variables

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True), from_logits=from_logits))
        grads = tape.gradient(loss, tvars)
        for v, g in zip(tvars, grads):
            v.assign_sub(lr * g)
        return loss, grads
    if name:
        step.__name__ = name
    return tf.function(step, jit_compile=True)


def forward_tensors_the_backward_reads(fn, shape):
    """The non-constant tensors of the forward pass of fn (z of `shape`, traced inside an
    XLA-compiled function) that ops of the backward pass read: what is kept between them."""
    found = []

    def step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            y = fn(z)
        graph = tf.compat.v1.get_default_graph()
        forward = set(graph.get_operations())
        dz = tape.gradient(y, z, output_gradients=tf.ones_like(y))
        found.extend({t.ref(): t for op in graph.get_operations() if op not in forward
                      for t in op.inputs if t.op in forward and t.op.type != "Const"}.values())
        return dz
    tf.function(step, jit_compile=True).get_concrete_function(tf.TensorSpec(shape))
    return found


def gradient_ops(fn, z, op_type):
    """The ops of type `op_type` in the graph of tf.function(forward_and_input_grad(fn)) at z."""
    graph = tf.function(forward_and_input_grad(fn)).get_concrete_function(z).graph
    return [op for op in graph.get_operations() if op.type == op_type]


def derivatives(f, z, dy, ddz, g=None):
    """y = f(z); dz = J^T dy; ddy = d<dz, ddz>/d dy (second order); with `g`, also
    dddz = d<ddy, g>/d ddz (third order)."""
    with tf.GradientTape() as t3:
        t3.watch(ddz)
        with tf.GradientTape() as t2:
            t2.watch(dy)
            with tf.GradientTape() as t1:
                t1.watch(z)
                y = f(z)
            dz = t1.gradient(y, z, output_gradients=dy)
        ddy = t2.gradient(dz, dy, output_gradients=ddz)
    if g is None:
        return y, dz, ddy
    return y, dz, ddy, t3.gradient(ddy, ddz, output_gradients=g)


@pytest.fixture
def switch_off(monkeypatch):
    """The switch off before and after the test, and the process's XLA_FLAGS left as the test
    found them (modules take it with `pytestmark = pytest.mark.usefixtures("switch_off")`).
    Turning the switch on points XLA at the persistent autotune cache through XLA_FLAGS
    (autotune_cache.install, once per process, while TensorFlow has not started), which would
    otherwise stay in os.environ for the tests that follow and their subprocesses (the workers of
    test_distribute.py), depending on which test first turned the switch on."""
    import tf_relupool
    from tf_relupool import autotune_cache
    monkeypatch.setattr(autotune_cache, "_state", dict(autotune_cache._state))
    xla_flags = os.environ.get("XLA_FLAGS")
    tf_relupool.disable_recompute()
    yield
    tf_relupool.disable_recompute()
    if xla_flags is None:
        os.environ.pop("XLA_FLAGS", None)
    else:
        os.environ["XLA_FLAGS"] = xla_flags


def xla_temp_and_digest(model, size, batch, variants, tmp_path, head="softmax"):
    """({variant: digest, "stats": ...}, {variant: XLA's preallocated temp bytes}) of
    tests/xla_step_digest.py run in one subprocess for `variants` (comma-separated), with XLA's
    buffer assignments dumped under tmp_path."""
    import json
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    dump = str(tmp_path / ("dump_" + variants.replace(",", "_")))
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                                      " --xla_dump_hlo_module_re=.*digest_step.*").strip())
    proc = subprocess.run([sys.executable, os.path.join(here, "xla_step_digest.py"), model,
                           str(size), str(batch), variants, head],
                          capture_output=True, text=True, timeout=900, cwd=here, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    from tf_relupool import _harness
    temps = {}
    for variant in variants.split(","):
        temps[variant] = _harness.xla_temp_bytes(dump, f"digest_step_{variant}")
        assert temps[variant] is not None, (variant, sorted(os.listdir(dump))[:20])
    return json.loads(lines[-1][len("RESULT "):]), temps
