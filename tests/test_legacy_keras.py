"""tf.keras as Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1): what `import tf_relupool` and
`enable_recompute()` do there (docs/keras.md, "tf.keras (Keras 2, TF_USE_LEGACY_KERAS=1)").

The Grappler pass fuses a tf.keras model's training step (no XLA, tf.keras' default) bitwise
like the switch off; under XLA (`jit_compile=True`) nothing is fused, stock ops run; turning the
switch on warns once, saying so. TensorFlow reads TF_USE_LEGACY_KERAS when it binds tf.keras,
so each case runs in a fresh subprocess with the variable set (this process's TensorFlow is
already imported). Skipped where tf-keras is not installed (the main test venv); run it in a
venv with tf-keras (docs/keras.md has the commands).
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tf_keras")

HERE = os.path.dirname(os.path.abspath(__file__))
LEGACY = {"TF_USE_LEGACY_KERAS": "1"}

TRAIN_SCRIPT = """
import json, os, warnings
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
with warnings.catch_warnings(record=True) as at_import:
    warnings.simplefilter("always")
    import tf_relupool
from tf_relupool import grappler, keras_fusion, run_metadata

K = tf.keras
POOL_OPS = {"Relu", "MaxPool", "MaxPoolGrad", "ReluGrad", "ReluMaxPoolWithWindowArgmax",
            "ReluMaxPoolGradFromWindowArgmax", "ReluMaxPool", "ReluMaxPoolGrad"}


def build(weights=None):
    m = K.Sequential([K.Input((16, 16, 3)),
                      K.layers.Conv2D(4, 3, padding="same", activation="relu"),
                      K.layers.MaxPooling2D(), K.layers.Flatten(), K.layers.Dense(3)])
    if weights is not None:
        m.set_weights(weights)
    return m


K.utils.set_random_seed(0)
initial = build().get_weights()
x = tf.random.stateless_normal([16, 16, 16, 3], seed=[1, 2])
y = tf.random.stateless_uniform([16], [3, 4], maxval=3, dtype=tf.int32)


def train(jit_compile=None):
    # 4 SGD steps from the same initial weights: 2 train_on_batch (the first recording the ops
    # the train function ran after Grappler), then fit over 2 batches
    m = build(initial)
    m.compile(K.optimizers.SGD(0.05), K.losses.SparseCategoricalCrossentropy(from_logits=True),
              jit_compile=jit_compile)
    grappler.reset_stats()
    xla_before = keras_fusion.stats()["fused"]
    first, nodes = run_metadata.optimized_nodes(m.train_on_batch, x[:8], y[:8])
    losses = [first, m.train_on_batch(x[8:], y[8:])]
    losses += m.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False).history["loss"]
    return dict(losses=[np.float32(l).tobytes().hex() for l in losses],
                weights=[w.tobytes().hex() for w in m.get_weights()],
                ops=sorted({n.op for n in nodes} & POOL_OPS), grappler=grappler.stats(),
                xla_fused=keras_fusion.stats()["fused"] - xla_before)


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = dict(stock=train())
    tf_relupool.enable_recompute()
    out["switch"] = train()
    tf_relupool.disable_recompute()
    out["xla_stock"] = train(jit_compile=True)
    tf_relupool.enable_recompute(activations=True)
    out["xla_switch"] = train(jit_compile=True)
    tf_relupool.disable_recompute()
out["layer_module"] = type(K.layers.MaxPooling2D()).__module__
out["import_warnings"] = [str(w.message) for w in at_import]
out["warnings"] = [str(w.message) for w in caught]
print("RESULT " + json.dumps(out))
"""

SWITCH_SCRIPT = """
import json, os, warnings
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import tensorflow as tf
    import tf_relupool
    tf_relupool.enable_recompute()
    tf_relupool.disable_recompute()
    tf_relupool.enable_recompute("input")
print("RESULT " + json.dumps(dict(layer_module=tf.keras.layers.Dense.__module__,
                                  warnings=[str(w.message) for w in caught])))
"""


def run(script, env):
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("TF_USE_LEGACY_KERAS", "TF_RELUPOOL_RECOMPUTE")}
    full_env.update(env)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=full_env, timeout=600, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ")[-1])


def legacy_warnings(messages):
    return [m for m in messages if "TF_USE_LEGACY_KERAS" in m]


def test_tf_keras_fit_fused_by_grappler_bitwise_and_one_warning():
    r = run(TRAIN_SCRIPT, LEGACY)
    assert r["layer_module"].startswith("tf_keras."), r["layer_module"]  # tf.keras is Keras 2
    assert not legacy_warnings(r["import_warnings"])  # importing changes nothing

    # Without XLA (tf.keras' default): the Grappler pass fused the pair and its gradient ...
    stock, switch = r["stock"], r["switch"]
    assert {"MaxPool", "MaxPoolGrad"} <= set(stock["ops"]), stock["ops"]
    assert not [op for op in stock["ops"] if op.startswith("ReluMaxPool")], stock["ops"]
    assert {"ReluMaxPoolWithWindowArgmax", "ReluMaxPoolGradFromWindowArgmax"} <= set(
        switch["ops"]), switch["ops"]
    assert not {"MaxPool", "MaxPoolGrad"} & set(switch["ops"]), switch["ops"]
    assert switch["grappler"]["fused_with_grad"] >= 1, switch["grappler"]
    assert switch["grappler"]["errors"] == 0, switch["grappler"]
    # ... with stock's losses and weights, bit for bit
    assert switch["losses"] == stock["losses"]
    assert switch["weights"] == stock["weights"]

    # Under XLA (jit_compile=True) nothing reaches either route: stock's ops and bits
    xla = r["xla_switch"]
    assert xla["xla_fused"] == 0 and xla["grappler"]["fused_with_grad"] == 0, xla
    assert xla["losses"] == r["xla_stock"]["losses"]
    assert xla["weights"] == r["xla_stock"]["weights"]

    # One warning for the process (enable_recompute was called twice), saying what works
    warned = legacy_warnings(r["warnings"])
    assert len(warned) == 1, r["warnings"]
    for words in ("Grappler", "jit_compile=True", "activations=True", "docs/keras.md"):
        assert words in warned[0], warned[0]


@pytest.mark.parametrize("env,expected", [
    pytest.param({}, 0, id="keras3"),
    pytest.param(LEGACY, 1, id="legacy"),
    pytest.param(dict(LEGACY, TF_RELUPOOL_RECOMPUTE="1"), 1, id="legacy_switch_from_env"),
])
def test_warning_only_where_tf_keras_is_keras2(env, expected):
    r = run(SWITCH_SCRIPT, env)
    assert r["layer_module"].startswith("tf_keras.") == bool(expected), r["layer_module"]
    assert len(legacy_warnings(r["warnings"])) == expected, r["warnings"]
