"""End to end with Keras: bitwise-equal training, MirroredStrategy, SavedModel in a fresh process.

Op determinism and logical devices are process-wide, so those tests run in subprocesses (which
import the same tf_relupool as this process: the installed one, or PYTHONPATH's).
"""
import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_relupool

MODEL_CODE = """
import json, sys, numpy as np, tensorflow as tf, keras
import tf_relupool
L = keras.layers

def cnn(fused, keep=None):
    # a small CIFAR-shaped CNN: two conv blocks (3x3 convs, 2x2 pools), dense head
    keras.utils.set_random_seed(0)
    def block(filters):
        if fused:
            return [L.Conv2D(filters, 3, padding="same"), tf_relupool.ReluMaxPool2D(keep=keep)]
        return [L.Conv2D(filters, 3, padding="same", activation="relu"), L.MaxPooling2D()]
    return keras.Sequential([keras.Input((32, 32, 3)), *block(8), *block(8),
                             L.Flatten(), L.Dense(10)])

def data(n=32, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 32, 32, 3)).astype("float32"),
            rng.integers(0, 10, size=(n,)).astype("int32"))

def compile_(model):
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
"""

TRAIN_SCRIPT = MODEL_CODE + """
tf.config.experimental.enable_op_determinism()
x, y = data()

def train(model):
    compile_(model)
    losses = [float(model.train_on_batch(x[i:i + 8], y[i:i + 8])) for i in range(0, 32, 8)]
    return {"losses": [np.float32(l).tobytes().hex() for l in losses],
            "weights": [w.tobytes().hex() for w in model.get_weights()],
            "ops": sorted({op.type for op in tf.function(model).get_concrete_function(
                tf.TensorSpec((8, 32, 32, 3))).graph.get_operations()} & {
                "Relu", "MaxPool", "ReluMaxPool", "ReluMaxPoolWithWindowArgmax"})}

out = {"stock": train(cnn(False))}
for keep in ("argmax", "input"):
    out["layer_" + keep] = train(cnn(True, keep))
    out["rewrite_" + keep] = train(tf_relupool.rewrite_model(cnn(False), keep=keep))
    with tf_relupool.recompute(keep):   # the switch with keep=None layers from the rewrite
        out["switch_" + keep] = train(tf_relupool.rewrite_model(cnn(False)))
print("RESULT" + json.dumps(out))
"""

MIRRORED_SCRIPT = MODEL_CODE + """
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.config.experimental.enable_op_determinism()
x, y = data()

def fit(strategy, fused):
    with strategy.scope():
        model = compile_(cnn(fused, keep="argmax" if fused else None))
    losses = []
    cb = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"])))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    model.fit(ds, epochs=1, verbose=0, callbacks=[cb])
    return losses

two = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
assert two.num_replicas_in_sync == 2
one = tf.distribute.OneDeviceStrategy("/cpu:0")
print("RESULT" + json.dumps({"one_stock": fit(one, False), "one_fused": fit(one, True),
                             "two_stock": fit(two, False), "two_fused": fit(two, True)}))
"""


def run_python(code, tmp_path, *args, timeout=300, cpu_only=False):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("TF_RELUPOOL_RECOMPUTE", None)
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT")[-1])


def test_training_bitwise_identical_stock_layer_rewrite_switch(tmp_path):
    out = run_python(TRAIN_SCRIPT, tmp_path)
    stock = out.pop("stock")
    assert stock["ops"] == ["MaxPool", "Relu"]
    assert len(set(stock["losses"])) > 1  # the model does train
    expected_ops = {"argmax": ["ReluMaxPoolWithWindowArgmax"], "input": ["ReluMaxPool"]}
    for name, got in out.items():
        assert got["ops"] == expected_ops[name.split("_")[1]], name
        assert got["losses"] == stock["losses"], f"{name}: losses differ from stock"
        assert got["weights"] == stock["weights"], f"{name}: weights differ from stock"


def test_mirrored_strategy_two_cpus_same_losses_as_one(tmp_path):
    out = run_python(MIRRORED_SCRIPT, tmp_path)
    assert len(out["one_stock"]) == 4
    # The fused op changes nothing on either device layout, bit for bit.
    assert out["one_fused"] == out["one_stock"]
    assert out["two_fused"] == out["two_stock"]
    # Two replicas all-reduce half-batch gradients: the same losses up to float rounding.
    np.testing.assert_allclose(out["two_fused"], out["one_fused"], rtol=1e-5, atol=1e-6)


LOAD_SCRIPT = """
import json, sys, numpy as np, tensorflow as tf
path, x_path = sys.argv[1], sys.argv[2]
x = np.load(x_path)
result = {}
try:
    tf.saved_model.load(path)           # tf_relupool not imported: the ops are not registered
    result["without_import"] = "loaded"
except Exception as e:
    result["without_import"] = f"{type(e).__name__}: {e}"
import tf_relupool
result["hint"] = tf_relupool.saved_model.missing_op_message(result["without_import"])
loaded = tf.saved_model.load(path)
outs = {k: loaded.signatures["serving_default"](inputs=tf.constant(x))
        for k in ["plain"]}
result["outputs"] = {k: np.asarray(list(v.values())[0]).tobytes().hex() for k, v in outs.items()}
helper = tf_relupool.load_saved_model(path)
result["helper"] = np.asarray(list(helper.signatures["serving_default"](
    inputs=tf.constant(x)).values())[0]).tobytes().hex()
print("RESULT" + json.dumps(result))
"""


@pytest.mark.parametrize("keep", ["argmax", "input"])
def test_saved_model_fresh_process(tmp_path, keep):
    keras.utils.set_random_seed(3)
    L = keras.layers
    model = keras.Sequential([keras.Input((12, 12, 3)), L.Conv2D(4, 3, activation="relu"),
                              L.MaxPooling2D(), L.Flatten(), L.Dense(3)])
    model = tf_relupool.rewrite_model(model, keep=keep)
    x = np.random.default_rng(4).normal(size=(2, 12, 12, 3)).astype("float32")
    # On the CPU, here and in the loading process: what is tested is that the SavedModel loads
    # and computes the same function; on a GPU the eager call and the loaded graph would pick
    # different convolution kernels (remapper fusion, cuDNN algorithms) for the stock conv.
    with tf.device("/CPU:0"):
        expected = model(x).numpy()
    path = str(tmp_path / "sm")
    tf.saved_model.save(model, path)
    np.save(tmp_path / "x.npy", x)
    out = run_python(LOAD_SCRIPT, tmp_path, path, str(tmp_path / "x.npy"), cpu_only=True)
    op = "ReluMaxPoolWithWindowArgmax" if keep == "argmax" else "ReluMaxPool"
    assert out["without_import"].startswith("RuntimeError")  # TensorFlow's own error
    assert f"Op type not registered '{op}'" in out["without_import"]
    assert "import tf_relupool" in out["hint"]
    assert out["outputs"]["plain"] == expected.tobytes().hex()
    assert out["helper"] == expected.tobytes().hex()


def test_missing_op_message_only_for_our_ops():
    ours = RuntimeError("Op type not registered 'ReluMaxPoolGrad' in binary running on vm.")
    other = RuntimeError("Op type not registered 'FancyOp' in binary running on vm.")
    assert "import tf_relupool" in tf_relupool.saved_model.missing_op_message(ours)
    assert tf_relupool.saved_model.missing_op_message(other) is None
    assert tf_relupool.saved_model.missing_op_message(ValueError("x")) is None


def _conv_pool_step(x, w, b, d):
    """A conv + bias + ReLU + overlapping 3x3/2 SAME max pool + dense step: the loss and the
    gradients with respect to the pre-ReLU activation z, the kernel and the bias."""
    with tf.GradientTape() as tape:
        tape.watch([w, b])
        z = tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), b)
        tape.watch(z)
        y = tf.nn.max_pool2d(tf.nn.relu(z), 3, 2, "SAME")
        loss = tf.reduce_sum(tf.reshape(y, (x.shape[0], -1)) @ d)
    return [loss] + tape.gradient(loss, [z, w, b])


def test_overlapping_windows_after_a_conv_onednn_graph_order():
    """Where stock disagrees with itself (docs/semantics.md): with oneDNN on, stock's graph-mode
    MaxPoolGrad (TensorFlow's MklLayoutRewritePass puts oneDNN's pooling backward there) adds the
    gradients of windows that share their maximum in an order of its own, while its eager
    kernel, its Eigen kernels (oneDNN off) and tf_relupool add them in output order. The switch
    (Grappler pass) in tf.function must equal stock's eager loss and dz; stock's own
    graph may differ only at elements that are the maximum of three or more windows (where the
    order of additions can matter) and in what depends on them; with oneDNN off, stock's graph
    equals its eager step too. The kernel and bias gradients are TensorFlow's graph-mode kernels
    applied to dz: on an Intel Xeon with AMX (the H200 host, 2026-12-04) oneDNN gives the
    bias gradient of a graph in another order than eager's (29 of 32 elements, last bits, for
    the same dz), so they are compared with the same graph-mode kernels applied to stock eager's
    dz. On the CPU (where oneDNN is), also when a GPU is visible."""
    with tf.device("/CPU:0"):
        _onednn_graph_order()


def _onednn_graph_order():
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(8, 16, 16, 3)).astype(np.float32))
    w = tf.constant(rng.normal(0, 0.3, (3, 3, 3, 32)).astype(np.float32))
    b = tf.constant(rng.normal(0, 0.1, (32,)).astype(np.float32))
    d = tf.constant(rng.normal(0, 0.1, (8 * 8 * 32, 10)).astype(np.float32))
    eager = _conv_pool_step(x, w, b, d)
    stock_graph = tf.function(_conv_pool_step)(x, w, b, d)
    try:
        tf_relupool.enable_recompute()
        fused_graph = tf.function(_conv_pool_step)(x, w, b, d)
    finally:
        tf_relupool.disable_recompute()
    names = ("loss", "dz", "kernel gradient", "bias gradient")
    # What TensorFlow's graph computes from dz (oneDNN may merge the two into one kernel).
    from_dz = tf.function(lambda x, g: [tf.raw_ops.Conv2DBackpropFilter(
        input=x, filter_sizes=tf.shape(w), out_backprop=g, strides=[1, 1, 1, 1],
        padding="SAME"), tf.raw_ops.BiasAddGrad(out_backprop=g)])(x, eager[1])
    for name, got, want in zip(names, fused_graph, eager[:2] + from_dz):
        np.testing.assert_array_equal(got.numpy().view(np.uint32), want.numpy().view(np.uint32),
                                      err_msg=f"switch in tf.function vs stock: {name}")
    # How many windows pick each element as their maximum (stock eager, dy = 1: exact counts).
    z = tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), b)
    with tf.GradientTape() as tape:
        tape.watch(z)
        y = tf.nn.max_pool2d(tf.nn.relu(z), 3, 2, "SAME")
    windows = tape.gradient(y, z, output_gradients=tf.ones_like(y)).numpy()
    differs = stock_graph[1].numpy().view(np.uint32) != eager[1].numpy().view(np.uint32)
    assert not (differs & (windows < 3)).any(), "stock's graph differs where order cannot matter"
    assert stock_graph[0].numpy() == eager[0].numpy()  # the forward is the same
    if not differs.any():
        for name, got, want in zip(names[2:], stock_graph[2:], eager[2:]):
            np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=name)
    if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0":
        assert not differs.any(), "with oneDNN off stock's graph and eager gradients agree"
