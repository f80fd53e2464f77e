"""Second- and third-order gradients of the fused ops, bitwise against stock TensorFlow on CPU.

Where a GPU is visible the fused op-level cases run on it against stock on the CPU; the model
tests (convolutions, whose GPU bits depend on cuDNN's algorithm) run wholly on the CPU.

Stock differentiates its backward: MaxPoolGrad -> MaxPoolGradGrad (gathers by value: the first
window position equal to the pooled output) and ReluGrad -> ReluGrad. The fused backward ops
gather through the window argmax instead; the two agree on every window without NaN, which is
compared bitwise with stock here. Windows holding NaN are checked against the written definition
(docs/semantics.md, "Higher-order gradients"), computed independently in NumPy, and so is the
third order under explicit padding with NaN (stock's stand-in there differs, see _check_case);
VALID windows larger than the input, which stock refuses, give an empty second order and a
third order of +0.
"""
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings

import tf_relupool
from conftest import (DTYPES, assert_bitwise_equal, derivatives, from_nhwc, nhwc_padding,
                      pool_cases, spatial_pair, to_nhwc, window_grid)

KEEPS = ["argmax", "input"]


def _stock_fn(ksize, strides, padding, data_format):
    """Stock max_pool2d(relu(z)) in `data_format` (NCHW through exact transposes: stock CPU
    pooling is NHWC-only without oneDNN)."""
    k, s = spatial_pair(ksize, data_format), spatial_pair(strides, data_format)
    pad = nhwc_padding(padding, data_format)
    if not isinstance(pad, str):
        # Stock's MaxPoolGradGrad has no explicit padding: the same pooling as a VALID one over
        # relu(z) padded with -Inf (never a window's maximum; every window holds an input value),
        # whose derivatives of every order stock defines (Pad's is an exact Slice).
        return lambda z: from_nhwc(tf.nn.max_pool2d(
            tf.pad(tf.nn.relu(to_nhwc(z, data_format)), pad, constant_values=-np.inf), k, s,
            "VALID"), data_format)
    return lambda z: from_nhwc(tf.nn.max_pool2d(tf.nn.relu(to_nhwc(z, data_format)), k, s, pad),
                               data_format)


def _fused_fn(ksize, strides, padding, data_format, keep):
    return lambda z: tf_relupool.relu_max_pool2d(z, ksize, strides, padding, data_format, keep=keep)


def _window_has_nan(z, ksize, strides, padding, data_format):
    nan = tf.cast(tf.math.is_nan(tf.cast(z, tf.float64)), tf.float32)
    k, s = spatial_pair(ksize, data_format), spatial_pair(strides, data_format)
    pooled = from_nhwc(tf.nn.max_pool2d(to_nhwc(nan, data_format), k, s,
                                        nhwc_padding(padding, data_format)), data_format)
    return pooled.numpy() > 0


def _definition_grad_grad(z, ddz, ksize, strides, padding, data_format):
    """docs/semantics.md's definition, in NumPy: scan the window row-major from the lowest value, a position
    takes over when `max < relu(v)`; if the first position is NaN or the maximum is not positive,
    ddy = ddz[first in-bounds position] * 0, else ddy = ddz[argmax] * 1."""
    zz = np.asarray(to_nhwc(tf.cast(z, tf.float64), data_format))
    dd = np.asarray(to_nhwc(tf.cast(ddz, tf.float64), data_format))
    n, h, w, c = zz.shape
    (r0, _), (c0, _) = window_grid(h, w, ksize, strides, padding, data_format)
    out = np.zeros([n, len(r0), len(c0), c])
    for pooled, source, keep in _selections(z, ksize, strides, padding, data_format):
        out[pooled] = dd[source] * (1.0 if keep else 0.0)
    return from_nhwc(tf.constant(out), data_format)


def _positive_zero(x):
    return x + np.zeros((), x.dtype)


def _selections(z, ksize, strides, padding, data_format):
    """Per pooled element (NHWC order): the input position docs/semantics.md's definition
    routes to and whether it routes (see _definition_grad_grad)."""
    zz = np.asarray(to_nhwc(tf.cast(z, tf.float64), data_format))
    n, h, w, c = zz.shape
    (r0, r1), (c0, c1) = window_grid(h, w, ksize, strides, padding, data_format)
    for b, i, j, ch in np.ndindex(n, len(r0), len(c0), c):
        rows, cols = range(r0[i], r1[i]), range(c0[j], c1[j])
        best, pos = -np.inf, (rows[0], cols[0])
        for r in rows:
            for q in cols:
                v = zz[b, r, q, ch]
                v = 0.0 if v < 0 else v
                if best < v:
                    best, pos = v, (r, q)
        keep = best > 0 and not np.isnan(zz[b, rows[0], cols[0], ch])
        yield (b, i, j, ch), (b, *(pos if keep else (rows[0], cols[0])), ch), keep


def _definition_third_order(z, g, ksize, strides, padding, data_format):
    """d<ddy, g>/d ddz of the definition: each pooled element adds g * (1 if it routes, else 0)
    at its selection, in output order from +0, in g's dtype."""
    gg = np.asarray(to_nhwc(g, data_format))
    out = np.zeros(np.asarray(to_nhwc(z, data_format)).shape, gg.dtype)
    one, zero = np.ones((), gg.dtype), np.zeros((), gg.dtype)
    for at, pos, keep in _selections(z, ksize, strides, padding, data_format):
        out[pos] = out[pos] + gg[at] * (one if keep else zero)
    return from_nhwc(tf.constant(out), data_format)


def _check_case(case, keep):
    dtype = case["dtype"]
    z = tf.constant(case["z"], dtype=dtype)
    args = (case["ksize"], case["strides"], case["padding"], case["data_format"])
    rows, cols = (1, 2) if case["data_format"] == "NHWC" else (2, 3)
    k = spatial_pair(case["ksize"], case["data_format"])
    rng = np.random.default_rng(case["rng_seed"] + 7)
    if case["padding"] == "VALID" and (k[0] > z.shape[rows] or k[1] > z.shape[cols]):
        # No window fits: stock refuses it; the definition is an empty pooled output, so an
        # empty second order and a third order of +0 everywhere.
        y_shape = _fused_fn(*args, keep)(z).shape
        assert y_shape[rows] == 0 or y_shape[cols] == 0, y_shape
        dy, g = tf.zeros(y_shape, dtype), tf.zeros(y_shape, dtype)
        ddz = tf.constant(rng.normal(size=z.shape), dtype)
        _, _, ddy_f, dddz_f = derivatives(_fused_fn(*args, keep), z, dy, ddz, g)
        assert ddy_f.dtype == dtype and ddy_f.shape == y_shape, (ddy_f.shape, y_shape)
        assert_bitwise_equal(dddz_f, tf.zeros_like(z), "third order, no window")
        return
    y_shape = _stock_fn(*args)(z).shape
    dy = tf.constant(rng.normal(size=y_shape), dtype)
    ddz = tf.constant(rng.integers(-3, 4, size=z.shape) + rng.normal(size=z.shape) * 0.5, dtype)
    g = tf.constant(rng.normal(size=y_shape), dtype)
    with tf.device("/CPU:0"):  # stock's CPU kernels are the definition (see conftest)
        _, _, ddy_s, dddz_s = derivatives(_stock_fn(*args), z, dy, ddz, g)
    _, _, ddy_f, dddz_f = derivatives(_fused_fn(*args, keep), z, dy, ddz, g)
    assert ddy_f.dtype == dtype and ddy_f.shape == y_shape
    nan_window = _window_has_nan(z, *args)
    expected = np.where(nan_window, tf.cast(_definition_grad_grad(z, ddz, *args), dtype).numpy(),
                        ddy_s.numpy())
    assert_bitwise_equal(ddy_f, expected, "second order (stock; NaN windows: the definition)")
    if not isinstance(case["padding"], str) and np.isnan(case["z"]).any():
        # The -Inf-padded stand-in for stock (see _stock_fn) routes a window whose first element
        # is NaN through the padding, where stock's explicit padding (first order, test_ops.py)
        # and the fused ops use the first in-bounds element: the definition instead of stock,
        # zeros' sign not compared (where g * 0 lands alone, the fused ops keep its sign).
        dddz_s = tf.constant(_positive_zero(_definition_third_order(z, g, *args).numpy()))
        dddz_f = tf.constant(_positive_zero(dddz_f.numpy()))
    assert_bitwise_equal(dddz_f, dddz_s, "third order")


@pytest.mark.parametrize("keep", KEEPS)
@given(case=pool_cases())
def test_second_and_third_order_bitwise_equal_to_stock(case, keep):
    _check_case(case, keep)


def test_nan_windows_follow_the_definition_not_stock():
    """The one documented difference: a window whose first value is NaN and whose maximum is
    positive. Stock's MaxPoolGradGrad gathers at the maximum (by value); the first-order backward,
    stock's included, routes to the NaN (times zero), and so does the fused second order."""
    z = tf.constant([[np.nan, 2.0], [1.0, -1.0]], tf.float32)[None, :, :, None]
    dy = tf.ones([1, 1, 1, 1])
    ddz = tf.constant([[5.0, 7.0], [11.0, 13.0]])[None, :, :, None]
    g = tf.ones([1, 1, 1, 1])
    _, _, ddy_s, _ = derivatives(_stock_fn(2, 2, "VALID", "NHWC"), z, dy, ddz, g)
    assert ddy_s.numpy().ravel().tolist() == [7.0]  # stock: ddz at the maximum, 2.0
    for keep in KEEPS:
        _, dz, ddy, _ = derivatives(_fused_fn(2, 2, "VALID", "NHWC", keep), z, dy, ddz, g)
        assert ddy.numpy().ravel().tolist() == [0.0]  # ddz[first] * 0
        assert not np.any(dz.numpy())  # first order: routed to the NaN, times zero (as stock)


def test_gradient_with_respect_to_z_is_unconnected_and_zero():
    """Stock's gradient of its backward with respect to z is zero; the fused ops return None
    (nothing is added, so a -0 elsewhere stays -0) and unconnected_gradients='zero' gives zeros."""
    z = tf.constant(np.random.default_rng(1).normal(size=[1, 4, 4, 2]), tf.float32)
    for keep in KEEPS:
        with tf.GradientTape(persistent=True) as t2:
            t2.watch(z)
            with tf.GradientTape() as t1:
                t1.watch(z)
                y = tf_relupool.relu_max_pool2d(z, 2, 2, "VALID", keep=keep)
            dz = t1.gradient(y, z)
        assert t2.gradient(dz, z) is None
        zeros = t2.gradient(dz, z, unconnected_gradients="zero")
        assert zeros.shape == z.shape and not np.any(zeros.numpy())


# ---- Small models: conv + pool, gradient penalty, Hessian-vector products, tf.hessians ----

def _model_inputs(dtype, seed=0):
    """Small integers: the convolution's outputs tie and are often <= 0."""
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.integers(-2, 3, size=[2, 9, 8, 2]), dtype)
    w = tf.Variable(tf.constant(rng.integers(-1, 2, size=[2, 2, 2, 3]), dtype))
    v = tf.constant(rng.normal(size=w.shape) * 0.5, dtype)
    return x, w, v


def _model(x, w, pool, data_format):
    """conv (NHWC) -> relu+maxpool in `data_format` -> a smooth head; out has one value per image."""
    h = tf.nn.conv2d(x, w, 1, "VALID")
    p = to_nhwc(pool(from_nhwc(h, data_format)), data_format)
    return tf.reduce_sum(tf.tanh(p) * tf.cast(tf.range(1, p.shape[-1] + 1), p.dtype), axis=[1, 2, 3])


def _pools(window, data_format, keep):
    k, s, pad = window
    return (_stock_fn(k, s, pad, data_format), _fused_fn(k, s, pad, data_format, keep))


WINDOWS = {"disjoint": (2, 2, "VALID"), "overlapping": (3, 2, "SAME")}


def _model_params():
    return [pytest.param(d, f, k, wn, id=f"{d.name}-{f}-{k}-{wn}")
            for d in DTYPES for f in ("NHWC", "NCHW") for k in KEEPS for wn in WINDOWS]


@pytest.mark.parametrize("dtype, data_format, keep, window", _model_params())
def test_gradient_penalty_and_hessian_vector_product(dtype, data_format, keep, window):
    """WGAN-GP style: d/dw of sum((d out / d x)^2) through conv + pool; and a Hessian-vector
    product of the plain loss by forward-over-backward (tf.autodiff.ForwardAccumulator)."""
    with tf.device("/CPU:0"):
        _gradient_penalty_and_hvp(dtype, data_format, keep, window)


def _gradient_penalty_and_hvp(dtype, data_format, keep, window):
    x, w, v = _model_inputs(dtype)
    results = []
    for pool in _pools(WINDOWS[window], data_format, keep):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(x)
                out = _model(x, w, pool, data_format)
            dx = inner.gradient(out, x)
            penalty = tf.reduce_sum(tf.square(dx))
        gp = outer.gradient(penalty, w)
        with tf.autodiff.ForwardAccumulator(primals=w, tangents=v) as acc:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(_model(x, w, pool, data_format)))
            grad = tape.gradient(loss, w)
        results.append((gp, acc.jvp(grad)))
    (gp_s, hvp_s), (gp_f, hvp_f) = results
    assert np.any(gp_s.numpy()) and np.any(hvp_s.numpy())  # the case exercises second order
    assert_bitwise_equal(gp_f, gp_s, "gradient penalty")
    assert_bitwise_equal(hvp_f, hvp_s, "Hessian-vector product")


@pytest.mark.parametrize("keep", KEEPS)
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=lambda d: d.name)
def test_tf_hessians_of_a_small_model(dtype, data_format, keep):
    with tf.device("/CPU:0"):
        _hessians_equal(dtype, data_format, keep)


def _hessians_equal(dtype, data_format, keep):
    x, w, _ = _model_inputs(dtype, seed=3)
    hessians = []
    for pool in _pools(WINDOWS["overlapping"], data_format, keep):
        @tf.function
        def hessian(w0):
            return tf.hessians(tf.reduce_sum(tf.square(_model(x, w0, pool, data_format))), w0)[0]
        hessians.append(hessian(tf.convert_to_tensor(w)))
    assert np.any(hessians[0].numpy())
    assert_bitwise_equal(hessians[1], hessians[0], "tf.hessians")


def test_grad_grad_op_rejects_bad_input(lib):
    grad = tf.zeros([1, 4, 4, 1])
    attrs = dict(ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="VALID")
    good = tf.zeros([1, 2, 2, 1], tf.uint8)
    out = lib.relu_max_pool_grad_grad_from_window_argmax(grad, good, **attrs)
    assert out.shape == [1, 2, 2, 1]
    with pytest.raises(tf.errors.InvalidArgumentError, match="window_argmax must have the pooled"):
        lib.relu_max_pool_grad_grad_from_window_argmax(grad, tf.zeros([1, 3, 2, 1], tf.uint8), **attrs)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"window_argmax\[2\] = 4"):
        lib.relu_max_pool_grad_grad_from_window_argmax(
            grad, tf.constant([0, 3, 4, 255], tf.uint8, shape=[1, 2, 2, 1]), **attrs)
    with tf.device("/CPU:0"):  # the CPU kernels report invalid codes whatever the attribute says
        for op, args in ((lib.relu_max_pool_grad_grad_from_window_argmax, (grad,)),
                         (lib.relu_max_pool_grad_from_window_argmax, ([1, 4, 4, 1], tf.ones([1, 2, 2, 1])))):
            with pytest.raises(tf.errors.InvalidArgumentError, match=r"window_argmax\[1\] = 7"):
                op(*args, tf.constant([0, 7, 1, 255], tf.uint8, shape=[1, 2, 2, 1]),
                   validate_window_argmax=False, **attrs)
    with pytest.raises(tf.errors.InvalidArgumentError, match="ksize"):
        lib.relu_max_pool_grad_grad_from_window_argmax(
            grad, good, ksize=[1, 0, 2, 1], strides=[1, 2, 2, 1], padding="VALID")
    with pytest.raises(tf.errors.InvalidArgumentError, match="input"):
        lib.relu_max_pool_grad_grad_from_window_argmax(tf.zeros([4, 4, 1]), good, **attrs)
