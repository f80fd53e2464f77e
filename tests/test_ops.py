"""Forward values and gradients of the fused ops, bitwise against stock TensorFlow on CPU."""
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tf_relupool
from conftest import (DTYPES, all_nan_windows, assert_bitwise_equal, bits, examples,
                      forward_and_input_grad, fused_forward_and_grad, gradient_ops, make_dy,
                      nhwc_padding, nhwc_window, pool_cases, spatial_pair, stock_forward_and_grad,
                      to_nhwc)


def _run_case(case, keep):
    z = tf.constant(case["z"], dtype=case["dtype"])
    args = (case["ksize"], case["strides"], case["padding"], case["data_format"])
    rows, cols = (1, 2) if case["data_format"] == "NHWC" else (2, 3)
    k = spatial_pair(case["ksize"], case["data_format"])
    if case["padding"] == "VALID" and (k[0] > z.shape[rows] or k[1] > z.shape[cols]):
        # Stock TF refuses this (negative size) or, with oneDNN on, dies of SIGFPE; the fused op
        # returns an empty result and a zero gradient.
        y, dz = fused_forward_and_grad(z, None, *args, keep=keep)
        assert y.shape[rows] == 0 or y.shape[cols] == 0
        with tf.GradientTape() as tape:
            tape.watch(z)
            y = tf_relupool.relu_max_pool2d(z, *args, keep=keep)
        dz = tape.gradient(y, z, output_gradients=tf.ones_like(y))
        assert dz.shape == z.shape and not np.any(dz.numpy())
        return
    y_stock, _ = stock_forward_and_grad(z, None, *args)
    dy = make_dy(case, y_stock.shape)
    y_stock, dz_stock = stock_forward_and_grad(z, dy, *args)
    y, dz = fused_forward_and_grad(z, dy, *args, keep=keep)
    assert y.dtype == z.dtype and dz.dtype == z.dtype
    assert_bitwise_equal(y, y_stock, "forward")
    assert_bitwise_equal(dz, dz_stock, "gradient")


@pytest.mark.parametrize("keep", ["argmax", "input"])
@given(case=pool_cases())
def test_bitwise_equal_to_stock(case, keep):
    _run_case(case, keep)


@pytest.mark.parametrize("keep", ["argmax", "input"])
@given(case=pool_cases(dtypes=[tf.float32], max_spatial=24))
@settings(max_examples=examples(100))
def test_bitwise_equal_to_stock_larger_images(case, keep):
    _run_case(case, keep)


@pytest.mark.parametrize("keep", ["argmax", "input"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_resnet_stem_pool_3x3_stride_2_same(keep, dtype):
    """Overlapping windows: one input element receives gradient from up to four windows."""
    rng = np.random.default_rng(3)
    z = tf.constant(rng.integers(-2, 3, size=[2, 17, 16, 8]), dtype=dtype)
    y_stock, _ = stock_forward_and_grad(z, None, 3, 2, "SAME", "NHWC")
    dy = tf.constant(rng.normal(size=y_stock.shape), dtype=dtype)
    y_stock, dz_stock = stock_forward_and_grad(z, dy, 3, 2, "SAME", "NHWC")
    y, dz = fused_forward_and_grad(z, dy, 3, 2, "SAME", "NHWC", keep)
    assert_bitwise_equal(y, y_stock, "forward")
    assert_bitwise_equal(dz, dz_stock, "gradient")
    # The case must really exercise accumulation: some element gets dy from several windows.
    counts = tf.nn.max_pool_with_argmax(tf.nn.relu(tf.cast(z, tf.float32)), 3, 2, "SAME")[1]
    assert np.bincount(counts.numpy().ravel()).max() > 1


@given(case=pool_cases())
def test_all_nan_window_mask_matches_stock_pooling_of_a_nan_indicator(case):
    """conftest.all_nan_windows (numpy window counts) against stock pooling of 'is not NaN'."""
    z = case["z"]
    fmt = case["data_format"]
    nhwc = to_nhwc(tf.constant(z), fmt)
    k, s = nhwc_window(case["ksize"], fmt), nhwc_window(case["strides"], fmt)
    kh, kw = spatial_pair(case["ksize"], fmt)
    assume(case["padding"] != "VALID" or (kh <= nhwc.shape[1] and kw <= nhwc.shape[2]))
    indicator = tf.cast(~tf.math.is_nan(nhwc), tf.float32)
    want = tf.nn.max_pool2d(indicator, k, s, nhwc_padding(case["padding"], fmt)).numpy() == 0
    got = to_nhwc(tf.constant(all_nan_windows(z, case["ksize"], case["strides"], case["padding"],
                                              fmt)), fmt).numpy()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("keep", ["argmax", "input"])
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_all_nan_window_yields_the_lowest_finite_value(keep, data_format, dtype):
    """A window whose ReLU'd values are all NaN pools to the dtype's lowest finite value, for
    every dtype. Stock float16/bfloat16 give that or -Inf depending on the machine (checked to be
    one of the two by stock_forward_and_grad); everything else, and the gradient, is stock's."""
    rng = np.random.default_rng(9)
    z = rng.integers(-2, 3, size=[2, 7, 6, 3]).astype(np.float64)
    # 3x3 stride 2 SAME on 7x6: the first window covers padding row -1 and rows 0-1, columns 0-2.
    z[0, 0:2, 0:3, 0] = np.nan
    z[0, 3:6, 2:5, 2] = np.nan      # an inner window (1, 1) and NaNs shared with its neighbours
    z[1, :, :, 1] = np.nan          # a whole channel
    z[1, 2, 4, 2] = np.nan          # a lone NaN among numbers: not an all-NaN window
    if data_format == "NCHW":
        z = z.transpose(0, 3, 1, 2)
    z = tf.constant(z, dtype)
    mask = all_nan_windows(z, 3, 2, "SAME", data_format)
    m = to_nhwc(tf.constant(mask), data_format).numpy()
    assert m[0, 0, 0, 0] and m[0, 2, 1, 2] and m[1, :, :, 1].all() and m.sum() == 2 + 12
    y_stock, _ = stock_forward_and_grad(z, None, 3, 2, "SAME", data_format)
    dy = tf.constant(rng.normal(size=y_stock.shape), dtype)
    y_stock, dz_stock = stock_forward_and_grad(z, dy, 3, 2, "SAME", data_format)
    y, dz = fused_forward_and_grad(z, dy, 3, 2, "SAME", data_format, keep)
    lowest_bits = bits(np.array([dtype.min], dtype.as_numpy_dtype))[0][0]
    assert np.all(bits(y)[0][mask] == lowest_bits)
    assert not np.isnan(y.numpy().astype(np.float64)).any()
    assert_bitwise_equal(y, y_stock, "forward")
    assert_bitwise_equal(dz, dz_stock, "gradient")


@pytest.mark.parametrize("keep", ["argmax", "input"])
def test_all_negative_windows_give_zero_gradient(keep):
    z = tf.constant(-np.arange(1, 1 + 2 * 6 * 6 * 3, dtype=np.float32).reshape(2, 6, 6, 3))
    dy = tf.ones([2, 3, 3, 3])
    y, dz = fused_forward_and_grad(z, dy, 2, 2, "VALID", "NHWC", keep)
    assert np.all(y.numpy() == 0)
    assert np.all(dz.numpy() == 0)


def test_ties_route_gradient_to_first_maximum_in_row_major_order():
    # One 3x3 window whose maximum 5 appears at (0, 2), (1, 0) and (2, 2).
    z = tf.constant([[1, 2, 5], [5, 0, -1], [3, 4, 5]], tf.float32)[None, :, :, None]
    for keep in ("argmax", "input"):
        _, dz = fused_forward_and_grad(z, tf.ones([1, 1, 1, 1]), 3, 3, "VALID", "NHWC", keep)
        expected = np.zeros([3, 3], np.float32)
        expected[0, 2] = 1
        np.testing.assert_array_equal(dz.numpy()[0, :, :, 0], expected)


def test_wide_windows_use_wider_argmax_codes(lib):
    """Windows of 255 positions or more need uint16 codes; the gradient stays exact."""
    rng = np.random.default_rng(5)
    z = tf.constant(rng.integers(-3, 3, size=[1, 20, 21, 2]), tf.float32)
    ksize = [16, 17]
    _, codes = lib.relu_max_pool_with_window_argmax(z, ksize=[1, 16, 17, 1], strides=[1, 4, 4, 1],
                                                     padding="VALID", Targmax=tf.uint16)
    assert codes.dtype == tf.uint16
    assert tf_relupool.ops.argmax_dtype_for(z.shape, [1, 16, 17, 1]) == tf.uint16
    assert tf_relupool.ops.argmax_dtype_for(z.shape, [1, 3, 3, 1]) == tf.uint8
    y_stock, _ = stock_forward_and_grad(z, None, ksize, 4, "VALID", "NHWC")
    dy = tf.constant(rng.normal(size=y_stock.shape), tf.float32)
    y_stock, dz_stock = stock_forward_and_grad(z, dy, ksize, 4, "VALID", "NHWC")
    y, dz = fused_forward_and_grad(z, dy, ksize, 4, "VALID", "NHWC", "argmax")
    assert_bitwise_equal(y, y_stock, "forward")
    assert_bitwise_equal(dz, dz_stock, "gradient")


def test_window_argmax_codes_name_the_positive_maximum(lib):
    z = tf.constant([[[-1, 3], [7, 7]], [[-1, -2], [-3, -4]]], tf.float32)  # two 2x2 images
    z = tf.reshape(tf.transpose(z, [0, 1, 2]), [2, 2, 2, 1])
    y, codes = lib.relu_max_pool_with_window_argmax(z, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1],
                                                     padding="VALID")
    assert codes.dtype == tf.uint8
    # First image: maximum 7 first at row 1, column 0 -> code 1 * 2 + 0. Second: no positive
    # value -> the sentinel 255.
    np.testing.assert_array_equal(codes.numpy().ravel(), [2, 255])
    np.testing.assert_array_equal(y.numpy().ravel(), [7, 0])


@pytest.mark.parametrize("keep", ["argmax", "input"])
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
def test_gradient_matches_finite_differences_float64(keep, data_format):
    rng = np.random.default_rng(11)
    shape = [2, 7, 6, 3] if data_format == "NHWC" else [2, 3, 7, 6]
    # Distinct values far from zero: the function is smooth (linear) around this point.
    z = rng.permutation(np.arange(np.prod(shape)) - 40).reshape(shape).astype(np.float64) * 0.1 + 0.05
    z = tf.constant(z)

    def f(x):
        return tf_relupool.relu_max_pool2d(x, 3, 2, "SAME", data_format, keep=keep)

    theoretical, numerical = tf.test.compute_gradient(f, [z], delta=1e-4)
    np.testing.assert_allclose(theoretical[0], numerical[0], atol=1e-6)
    assert np.count_nonzero(theoretical[0]) > 0


@pytest.mark.parametrize("keep", ["argmax", "input"])
def test_works_in_tf_function_and_with_unknown_shapes(keep):
    rng = np.random.default_rng(2)
    z = tf.constant(rng.normal(size=[3, 8, 8, 4]), tf.float32)
    dy = tf.constant(rng.normal(size=[3, 4, 4, 4]), tf.float32)

    @tf.function(input_signature=[tf.TensorSpec([None, None, None, 4], tf.float32)] * 2)
    def step(x, g):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf_relupool.relu_max_pool2d(x, 2, 2, "VALID", keep=keep)
        return y, tape.gradient(y, x, output_gradients=g)

    y, dz = step(z, dy)
    y_stock, dz_stock = stock_forward_and_grad(z, dy, 2, 2, "VALID", "NHWC")
    assert_bitwise_equal(y, y_stock, "forward")
    assert_bitwise_equal(dz, dz_stock, "gradient")


@pytest.mark.parametrize("keep", ["argmax", "input"])
def test_second_use_of_the_output_adds_gradients(keep):
    rng = np.random.default_rng(4)
    z = tf.constant(rng.normal(size=[2, 6, 6, 3]), tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(z)
        y = tf_relupool.relu_max_pool2d(z, 2, 2, "VALID", keep=keep)
        loss = tf.reduce_sum(y * y) + tf.reduce_sum(3.0 * y)
    dz = tape.gradient(loss, z)
    with tf.GradientTape() as tape:
        tape.watch(z)
        y = tf.nn.max_pool2d(tf.nn.relu(z), 2, 2, "VALID")
        loss = tf.reduce_sum(y * y) + tf.reduce_sum(3.0 * y)
    assert_bitwise_equal(dz, tape.gradient(loss, z), "gradient")


def test_persistent_tape_can_take_the_gradient_twice():
    z = tf.constant(np.random.default_rng(6).normal(size=[1, 4, 4, 2]), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(z)
        y = tf_relupool.relu_max_pool2d(z, 2, 2, "VALID")
    first, second = tape.gradient(y, z), tape.gradient(y, z)
    assert_bitwise_equal(first, second, "gradient")


@pytest.mark.parametrize("keep", ["argmax", "input"])
@pytest.mark.parametrize("shape, k, s, padding, pooled", [
    ([0, 4, 4, 3], 2, 2, "SAME", [0, 2, 2, 3]),    # no images
    ([2, 4, 4, 0], 2, 2, "VALID", [2, 2, 2, 0]),   # no channels
    ([2, 3, 3, 1], 5, 1, "VALID", [2, 0, 0, 1]),   # VALID window larger than the input
    ([1, 2, 2, 1], 3, 2, "VALID", [1, 0, 0, 1]),
])
def test_empty_results_and_zero_gradients(keep, shape, k, s, padding, pooled):
    z = tf.random.normal(shape)
    with tf.GradientTape() as tape:
        tape.watch(z)
        y = tf_relupool.relu_max_pool2d(z, k, s, padding, keep=keep)
    assert y.shape == pooled
    dz = tape.gradient(y, z, output_gradients=tf.ones_like(y))
    assert dz.shape == z.shape and not np.any(dz.numpy())
    if 0 not in shape[1:3] and pooled[1] > 0:
        assert y.shape == tf.nn.max_pool2d(z, k, s, padding).shape


@pytest.mark.parametrize("keep", ["argmax", "input"])
def test_windows_and_strides_far_larger_than_input_under_same(keep):
    rng = np.random.default_rng(8)
    z = tf.constant(rng.integers(-2, 3, size=[2, 5, 3, 2]), tf.float32)
    for k, s in [(1000, 1000), (7, 1), (1, 9), (9, 9)]:
        y_stock, _ = stock_forward_and_grad(z, None, k, s, "SAME", "NHWC")
        dy = tf.constant(rng.normal(size=y_stock.shape), tf.float32)
        y_stock, dz_stock = stock_forward_and_grad(z, dy, k, s, "SAME", "NHWC")
        y, dz = fused_forward_and_grad(z, dy, k, s, "SAME", "NHWC", keep)
        assert_bitwise_equal(y, y_stock, f"forward k={k} s={s}")
        assert_bitwise_equal(dz, dz_stock, f"gradient k={k} s={s}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_negative_zero_follows_std_max(dtype):
    """relu(-0) = -0, as std::max(-0, 0): a window starting with -0 and no positive value gives -0.

    Stock does this for half/bfloat16 always and for float/double outside vector packets.
    """
    z = tf.constant([[-0.0, -1.0], [-1.0, -0.0]], dtype)[None, :, :, None]
    for keep in ("argmax", "input"):
        y, _ = fused_forward_and_grad(z, None, [1, 2], [1, 2], "VALID", "NHWC", keep)
        np.testing.assert_array_equal(np.signbit(y.numpy().astype(np.float64)).ravel(), [True, False])


def test_gradient_op_inherits_the_implementation_attribute():
    z = tf.random.normal([1, 4, 4, 2])

    def fused(x):
        return tf_relupool.relu_max_pool2d(x, 2, 2, "VALID", keep="input", implementation="cudnn")

    grads = gradient_ops(fused, z, "ReluMaxPoolGrad")
    assert grads and all(op.get_attr("implementation") == b"cudnn" for op in grads)
    # On CPU the attribute changes nothing.
    stock_grad = stock_forward_and_grad(z, tf.ones([1, 2, 2, 2]), 2, 2, "VALID", "NHWC")[1]
    assert_bitwise_equal(tf.function(forward_and_input_grad(fused))(z)[1], stock_grad, "gradient")
