"""Shared helpers: stock-TensorFlow references, bitwise comparison, hypothesis strategies.

Tests import the installed tf_relupool (run from the repository root with the venv's pytest,
the source tree's tf_relupool/ has no compiled library unless built in place).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

settings.register_profile(
    "default", deadline=None, max_examples=int(os.environ.get("TF_RELUPOOL_EXAMPLES", "300")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("default")

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


def stock_forward_and_grad(z, dy, ksize, strides, padding, data_format):
    """tf.nn.max_pool2d(tf.nn.relu(z)) and its gradient for dy, in eager mode.

    Stock CPU pooling supports only NHWC, so NCHW goes through transposes (which move values
    without changing them).
    """
    if data_format == "NCHW":
        # 4-entry NCHW windows/strides in NHWC order for the transposed stock call.
        ksize, strides = [[v[0], v[2], v[3], v[1]] if isinstance(v, list) and len(v) == 4 else v
                          for v in (ksize, strides)]
    with tf.GradientTape() as tape:
        tape.watch(z)
        y = from_nhwc(tf.nn.max_pool2d(tf.nn.relu(to_nhwc(z, data_format)), ksize, strides, padding,
                                       data_format="NHWC"), data_format)
    dz = tape.gradient(y, z, output_gradients=dy) if dy is not None else None
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
    padding = draw(st.sampled_from(["VALID", "SAME"]))
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
    elif form == "pair":
        ksize, strides = [kh, kw], [sh, sw]
    else:
        ksize = [1, kh, kw, 1] if data_format == "NHWC" else [1, 1, kh, kw]
        strides = [1, sh, sw, 1] if data_format == "NHWC" else [1, 1, sh, sw]
    shape = [n, h, w, c] if data_format == "NHWC" else [n, c, h, w]
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


@pytest.fixture(scope="session")
def lib():
    import tf_relupool
    return tf_relupool.load_library()
