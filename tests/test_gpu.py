"""GPU OpKernels through TensorFlow: bitwise equal to the CPU kernels, placed on the GPU, errors.

Skipped without a visible GPU. On the H200: `make gpu-test` (see Makefile) with the trimmed
TensorFlow bundle (../shared/tools/tf-gpu). The CPU kernels are the reference: they are bitwise
equal to stock TensorFlow on CPU (tests/test_ops.py, tests/test_higher_order.py), and stock on the
GPU is not itself bitwise-defined (cuDNN's NaN and tie rules, summation order with overlapping
windows), so GPU results are compared with the CPU kernels, not with stock GPU ops.
"""
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given

import tf_relupool
from conftest import assert_bitwise_equal, gradient_ops, pool_cases

pytestmark = pytest.mark.skipif(not tf.config.list_physical_devices("GPU"),
                                reason="no GPU visible to TensorFlow")

KEEPS = ["argmax", "input"]


def _all_orders(z, dy, ddz, args, keep, device):
    """Forward, first-order and second-order results of the fused op, all on `device`."""
    with tf.device(device):
        z, dy, ddz = tf.identity(z), tf.identity(dy), tf.identity(ddz)
        with tf.GradientTape() as t2:
            t2.watch(dy)
            with tf.GradientTape() as t1:
                t1.watch(z)
                y = tf_relupool.relu_max_pool2d(z, *args, keep=keep)
            dz = t1.gradient(y, z, output_gradients=dy)
        ddy = t2.gradient(dz, dy, output_gradients=ddz)
    return y, dz, ddy


@pytest.mark.parametrize("keep", KEEPS)
@given(case=pool_cases())
def test_gpu_equals_cpu_bitwise_all_orders(case, keep):
    z = tf.constant(case["z"], dtype=case["dtype"])
    args = (case["ksize"], case["strides"], case["padding"], case["data_format"])
    with tf.device("/CPU:0"):
        y_shape = tf_relupool.relu_max_pool2d(z, *args, keep=keep).shape
    rng = np.random.default_rng(case["rng_seed"])
    dy = tf.constant(rng.normal(size=y_shape), case["dtype"])
    ddz = tf.constant(rng.normal(size=z.shape), case["dtype"])
    cpu = _all_orders(z, dy, ddz, args, keep, "/CPU:0")
    gpu = _all_orders(z, dy, ddz, args, keep, "/GPU:0")
    for name, a, b in zip(("forward", "gradient", "second order"), gpu, cpu):
        assert_bitwise_equal(a, b, f"GPU vs CPU {name}")


def test_every_op_runs_on_the_gpu():
    lib = tf_relupool.load_library()
    attrs = dict(ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="VALID")
    with tf.device("/GPU:0"):
        z = tf.random.normal([2, 8, 8, 4])
        y = lib.relu_max_pool(z, **attrs)
        y2, codes = lib.relu_max_pool_with_window_argmax(z, **attrs)
        dz = lib.relu_max_pool_grad(z, y, **attrs)
        dz2 = lib.relu_max_pool_grad_from_window_argmax(tf.shape(z), y, codes, **attrs)
        ddy = lib.relu_max_pool_grad_grad_from_window_argmax(dz, codes, **attrs)
    for t in (y, y2, codes, dz, dz2, ddy):
        assert "GPU:0" in t.device, t.device


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("op", ["grad", "grad_grad"])
def test_invalid_codes_on_the_gpu(op, validate):
    """validate_window_argmax=True: InvalidArgumentError naming the first bad code, reported
    without blocking (AsyncOpKernel). False: no report, no crash, and the bad code reads as 'no
    gradient' (the kernels bounds-check every code)."""
    lib = tf_relupool.load_library()
    attrs = dict(ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="VALID",
                 validate_window_argmax=validate)
    codes = tf.constant([0, 3, 9, 255], tf.uint8, shape=[1, 2, 2, 1])
    with tf.device("/GPU:0"):
        dy = tf.ones([1, 2, 2, 1])
        ddz = tf.ones([1, 4, 4, 1])

        def call():
            if op == "grad":
                return lib.relu_max_pool_grad_from_window_argmax([1, 4, 4, 1], dy, codes, **attrs)
            return lib.relu_max_pool_grad_grad_from_window_argmax(ddz, codes, **attrs)

        if validate:
            with pytest.raises(tf.errors.InvalidArgumentError, match=r"window_argmax\[2\] = 9"):
                call().numpy()
        else:
            out = call().numpy()
            if op == "grad":
                assert out.sum() == 2  # codes 0 and 3 route 1 each; 9 and 255 route nothing
            else:
                assert out.ravel().tolist() == [1, 1, 0, 0]
    # The device is still usable after the error.
    with tf.device("/GPU:0"):
        assert float(tf.reduce_sum(tf.ones([3]))) == 3.0


def test_registered_gradient_skips_the_host_round_trip():
    """The gradient graph reads codes straight from the fused forward: no validation report."""
    z = tf.random.normal([2, 8, 8, 4])
    grads = gradient_ops(lambda x: tf_relupool.relu_max_pool2d(x, 2, 2, "VALID"), z,
                         "ReluMaxPoolGradFromWindowArgmax")
    assert grads and not any(op.get_attr("validate_window_argmax") for op in grads)


def _stem_gradients(device, data_format, fused, z, dy):
    """d/dz of max_pool(pad(relu(z)), 3, 2, VALID) (ResNet's stem), stock ops or the fused op on
    pad(z), on `device`, in `data_format` (z, dy and the result NHWC)."""
    pads = [[0, 0], [1, 1], [1, 1], [0, 0]]
    with tf.device(device):
        z, dy = tf.identity(z), tf.identity(dy)
        if data_format == "NCHW":
            z, dy = tf.transpose(z, [0, 3, 1, 2]), tf.transpose(dy, [0, 3, 1, 2])
            pads = [pads[0], pads[3], pads[1], pads[2]]
        with tf.GradientTape() as tape:
            tape.watch(z)
            if fused:
                y = tf_relupool.relu_max_pool2d(tf.pad(z, pads), 3, 2, "VALID", data_format)
            else:
                y = tf.nn.max_pool2d(tf.pad(tf.nn.relu(z), pads), 3, 2, "VALID", data_format)
        dz = tape.gradient(y, z, output_gradients=dy)
        return (tf.transpose(dz, [0, 2, 3, 1]) if data_format == "NCHW" else dz).numpy()


def test_overlapping_windows_add_up_like_stock_nhwc_on_the_gpu():
    """Overlapping windows (3x3 stride 2: an element can be the maximum of up to four windows,
    whose gradients are added): the fused gradient, NHWC and NCHW on the GPU, adds them in
    output order, bit for bit like stock's CPU kernel and stock's NHWC GPU kernel. Stock's NCHW
    GPU gradient (cuDNN) adds them in an order of its own, which differs again with op
    determinism (docs/grappler.md: 13 resp. 111 of 32768 entries on the H200, rounding
    only): not a reference here, printed for the record."""
    rng = np.random.default_rng(7)
    z = tf.constant(rng.normal(0, 1, (2, 16, 16, 64)), tf.float32)
    dy = tf.constant(rng.choice([-1, 1], (2, 8, 8, 64)) * 10.0 ** rng.uniform(-2, 8, (2, 8, 8, 64)),
                     tf.float32)
    stock_cpu = _stem_gradients("/CPU:0", "NHWC", False, z, dy)
    stock_gpu_nhwc = _stem_gradients("/GPU:0", "NHWC", False, z, dy)
    assert_bitwise_equal(stock_gpu_nhwc, stock_cpu, "stock NHWC GPU vs stock CPU")
    for data_format in ("NHWC", "NCHW"):
        fused = _stem_gradients("/GPU:0", data_format, True, z, dy)
        assert_bitwise_equal(fused, stock_gpu_nhwc, f"fused {data_format} GPU vs stock NHWC GPU")
    stock_gpu_nchw = _stem_gradients("/GPU:0", "NCHW", False, z, dy)
    differ = int(np.sum(stock_gpu_nchw != stock_cpu))
    rel = float(np.max(np.abs(stock_gpu_nchw - stock_cpu)) / np.max(np.abs(stock_cpu)))
    print(f"stock NCHW GPU vs stock CPU: {differ} of {stock_cpu.size} entries differ, "
          f"largest by {rel:.2g} of the largest entry")
    assert rel < 1e-6  # a summation order, nothing else
