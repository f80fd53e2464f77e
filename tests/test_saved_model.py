"""tf_relupool.saved_model: the hint for SavedModels that name tf_relupool's ops covers every op the
library registers (cc/ops/relu_max_pool_ops.cc), the second-order one included."""
import os
import re
import subprocess
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

import tf_relupool
from tf_relupool import saved_model
from tf_relupool._loader import load_library

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _registered_ops():
    """The op names of cc/ops/relu_max_pool_ops.cc's REGISTER_OPs, each registered in TensorFlow
    once the library is loaded."""
    with open(os.path.join(ROOT, "cc", "ops", "relu_max_pool_ops.cc")) as f:
        names = re.findall(r'REGISTER_OP\("(\w+)"\)', f.read())
    load_library()
    for name in names:
        assert op_def_registry.get(name) is not None, name
    return names


def test_op_names_are_every_registered_op():
    names = _registered_ops()
    assert "ReluMaxPoolGradGradFromWindowArgmax" in names
    assert sorted(saved_model.OP_NAMES) == sorted(names)
    for name in names:
        error = RuntimeError(f"Op type not registered '{name}' in binary running on vm.")
        assert "import tf_relupool" in saved_model.missing_op_message(error), name


def test_second_order_op_in_a_saved_model_gets_the_hint(tmp_path):
    """A function that differentiates twice through keep="argmax" holds
    ReluMaxPoolGradGradFromWindowArgmax; a SavedModel with it, loaded where tf_relupool is not
    imported, fails with TensorFlow's error for that op, which the hint must recognise."""
    z = tf.constant(np.random.default_rng(0).normal(size=(1, 4, 4, 2)), tf.float32)

    @tf.function
    def second_order(z):
        with tf.GradientTape() as outer:
            outer.watch(z)
            with tf.GradientTape() as inner:
                inner.watch(z)
                y = tf_relupool.relu_max_pool2d(z, 2, 2, "VALID", keep="argmax")
                loss = tf.reduce_sum(y * y)
            dz = inner.gradient(loss, z)
            penalty = tf.reduce_sum(dz * dz)
        return outer.gradient(penalty, z)

    ops = {op.type for op in second_order.get_concrete_function(z).graph.get_operations()}
    assert "ReluMaxPoolGradGradFromWindowArgmax" in ops

    module = tf.Module()
    module.f = tf.function(
        lambda grad, codes: load_library().relu_max_pool_grad_grad_from_window_argmax(
            grad, codes, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="VALID"),
        input_signature=[tf.TensorSpec([1, 4, 4, 2], tf.float32),
                         tf.TensorSpec([1, 2, 2, 2], tf.uint8)])
    path = str(tmp_path / "sm")
    tf.saved_model.save(module, path)
    code = ("import tensorflow as tf, sys\n"
            "try:\n"
            "    tf.saved_model.load(sys.argv[1]); print('loaded')\n"
            "except Exception as e:\n"
            "    print(f'RESULT {e}')\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    error = proc.stdout.split("RESULT ", 1)[-1]
    assert "Op type not registered 'ReluMaxPoolGradGradFromWindowArgmax'" in error, proc.stdout
    assert "import tf_relupool" in saved_model.missing_op_message(error)
