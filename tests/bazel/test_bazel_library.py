"""The tests of //:op_tests really run against the library Bazel built (see run_tests.py)."""
import hashlib
import os

import tensorflow as tf
from tensorflow.python.framework import kernels

import tf_relupool
from tf_relupool import _build_info, _loader


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_package_is_the_assembled_one_with_the_bazel_library():
    bazel_lib = os.environ["TF_RELUPOOL_BAZEL_LIBRARY"]
    assert os.path.dirname(tf_relupool.__file__) == os.path.dirname(_loader.library_path())
    assert "site-packages" not in tf_relupool.__file__
    assert _sha256(_loader.library_path()) == _sha256(bazel_lib)


def test_build_info_matches_the_running_tensorflow():
    assert _build_info.TF_VERSION == tf.__version__
    assert "Bazel" in (_build_info.__doc__ or "")


def test_cpu_kernels_registered_and_run():
    tf_relupool.load_library()
    for op in ("ReluMaxPool", "ReluMaxPoolGrad", "ReluMaxPoolWithWindowArgmax",
               "ReluMaxPoolGradFromWindowArgmax"):
        devices = {k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}
        assert "CPU" in devices, op
        assert ("GPU" in devices) == bool(_build_info.WITH_CUDA), (op, devices)
    z = tf.constant([[[[-1.0], [2.0]], [[3.0], [-4.0]]]])
    y = tf_relupool.relu_max_pool2d(z, 2, 2, "VALID")
    assert y.numpy().ravel().tolist() == [3.0]
