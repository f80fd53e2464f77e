"""The op library's GPU build, checked on a CPU-only machine.

The GPU kernels themselves are tested by the TensorFlow-free harness (`make gpu-check` on a machine
with an NVIDIA GPU, see gpu_check/). Here: when nvcc was found at build time the library holds GPU
kernels for all four ops in all four dtypes, links no CUDA runtime that TensorFlow could interpose,
and still loads and runs its CPU kernels without a GPU.
"""
import subprocess

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import kernels

import tf_relupool
from tf_relupool import _build_info
from tf_relupool._loader import library_path, load_library

OPS = ("ReluMaxPool", "ReluMaxPoolGrad", "ReluMaxPoolWithWindowArgmax",
       "ReluMaxPoolGradFromWindowArgmax", "ReluMaxPoolGradGradFromWindowArgmax")
DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

needs_cuda = pytest.mark.skipif(
    not getattr(_build_info, "WITH_CUDA", False),
    reason="the op library was built without CUDA kernels (no nvcc found, or TF_RELUPOOL_CUDA=0)")


def _registered(op, device):
    """{T: set of Targmax (or None)} of the kernels registered for `op` on `device`."""
    load_library()
    found = {}
    for k in kernels.get_registered_kernels_for_op(op).kernel:
        if k.device_type != device:
            continue
        attrs = {c.name: c.allowed_values.list.type[0] for c in k.constraint}
        found.setdefault(tf.as_dtype(attrs["T"]), set()).add(
            tf.as_dtype(attrs["Targmax"]) if "Targmax" in attrs else None)
    return found


def test_build_info_records_cuda():
    assert isinstance(getattr(_build_info, "WITH_CUDA", None), bool)
    if _build_info.WITH_CUDA:
        assert _build_info.CUDA_VERSION and "80" in _build_info.CUDA_ARCHS and "90" in _build_info.CUDA_ARCHS


@needs_cuda
@pytest.mark.parametrize("op", OPS)
def test_gpu_kernels_registered_for_all_dtypes(op):
    gpu = _registered(op, "GPU")
    assert set(gpu) == set(DTYPES), f"{op}: GPU kernels for {sorted(d.name for d in gpu)}"
    if "Argmax" in op:
        # int32 codes stay on the CPU: TensorFlow keeps int32 tensors of GPU kernels in host memory.
        for dtype in DTYPES:
            assert gpu[dtype] == {tf.uint8, tf.uint16}


@needs_cuda
def test_cuda_runtime_is_static_and_hidden():
    """No CUDA runtime symbol is imported (TensorFlow's CUDA 12 stand-ins would bind to it) or
    exported, and neither libcudart nor libcudnn is a load-time dependency."""
    path = library_path()
    undefined = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True,
                               text=True, check=True).stdout
    assert not [l for l in undefined.splitlines() if "cuda" in l.lower()], undefined
    exported = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True,
                              text=True, check=True).stdout
    assert not [l for l in exported.splitlines() if l.split()[-1].startswith(("cuda", "__cuda"))]
    needed = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    assert "libcudart" not in needed and "libcudnn" not in needed


def test_implementation_attr_defaults_to_fused():
    lib = load_library()
    x = tf.constant(np.arange(-8, 8, dtype=np.float32).reshape(1, 4, 4, 1))
    want = tf.nn.max_pool2d(tf.nn.relu(x), 2, 2, "VALID")
    for impl in ("fused", "cudnn"):  # the CPU kernels ignore it
        got = lib.relu_max_pool(x, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="VALID",
                                implementation=impl)
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        lib.relu_max_pool(x, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="VALID",
                          implementation="triton")


def test_cpu_ops_run_with_gpu_kernels_registered():
    x = tf.random.stateless_normal([2, 9, 7, 5], seed=[1, 2])
    with tf.device("/CPU:0"):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf_relupool.relu_max_pool2d(x, 3, 2, "SAME")
        dz = tape.gradient(y, x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y_ref = tf.nn.max_pool2d(tf.nn.relu(x), 3, 2, "SAME")
        dz_ref = tape.gradient(y_ref, x)
    np.testing.assert_array_equal(y.numpy(), y_ref.numpy())
    np.testing.assert_array_equal(dz.numpy(), dz_ref.numpy())
