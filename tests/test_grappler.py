"""The graph optimizer inside Grappler: enable_recompute() fuses stock tf.function code.

Each test runs in a fresh subprocess: the optimizer is registered once per process and reads the
switch when TensorFlow optimizes a function (its first call), so every case needs its own
process state. Skipped when the installed op library holds no optimizer.
"""
import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent("""
    import json, os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import tf_relupool
    from tf_relupool import grappler
    tf.config.threading.set_inter_op_parallelism_threads(1)

    def train_step_fn(weights):
        def step(x):
            with tf.GradientTape() as tape:
                h = tf.nn.relu(tf.nn.conv2d(x, weights[0], 1, "SAME"))
                h = tf.nn.max_pool2d(h, 3, 2, "SAME")
                loss = tf.reduce_sum(h * h)
            return [loss] + tape.gradient(loss, weights)
        return step

    def make(seed=0):
        rng = np.random.default_rng(seed)
        w = [tf.Variable(rng.normal(0, 0.3, [3, 3, 3, 8]).astype(np.float32))]
        x = tf.constant(rng.normal(0, 1, [4, 12, 12, 3]).astype(np.float32))
        return w, x

    def ran_ops(fn, *args):
        from tensorflow.python.eager import context
        ctx = context.context()
        ctx.enable_graph_collection()
        out = fn(*args)
        meta = ctx.export_run_metadata()
        ctx.disable_graph_collection()
        ops = sorted({n.op for g in meta.function_graphs for n in g.post_optimization_graph.node})
        return out, ops
""")


def run_case(body, env=None):
    code = PRELUDE + textwrap.dedent(body)
    # `python -c` puts the working directory first on sys.path: run outside the source tree, whose
    # tf_relupool/ has no compiled library, so that the installed package is imported.
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def optimizer_available():
    probe = run_case("""
        import ctypes
        lib = ctypes.CDLL(tf_relupool._loader.library_path())
        print(json.dumps(hasattr(lib, "TF_InitGraph")))
    """)
    if not probe:
        pytest.skip("the installed op library was built without cc/grappler/")


@pytest.mark.parametrize("keep", ["argmax", "input"])
def test_stock_train_step_is_fused_and_bitwise_equal(keep):
    r = run_case(f"""
        w, x = make()
        off, off_ops = ran_ops(tf.function(train_step_fn(w)), x)
        tf_relupool.enable_recompute({keep!r})
        on, on_ops = ran_ops(tf.function(train_step_fn(w)), x)
        same = all(np.array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32))
                   for a, b in zip(off, on))
        print(json.dumps(dict(off_ops=off_ops, on_ops=on_ops, same=same,
                              stats=grappler.stats(), types=grappler.registered_device_types())))
    """)
    fwd, bwd = (("ReluMaxPoolWithWindowArgmax", "ReluMaxPoolGradFromWindowArgmax")
                if keep == "argmax" else ("ReluMaxPool", "ReluMaxPoolGrad"))
    assert {"Relu", "MaxPool", "MaxPoolGrad", "ReluGrad"} <= set(r["off_ops"])
    assert fwd in r["on_ops"] and bwd in r["on_ops"], r["on_ops"]
    assert not {"Relu", "MaxPool", "MaxPoolGrad", "ReluGrad"} & set(r["on_ops"]), r["on_ops"]
    assert r["same"]
    assert r["stats"]["fused_with_grad"] == 1 and r["stats"]["errors"] == 0, r["stats"]
    assert r["types"] == ["CPU", "GPU"]


def test_switch_off_changes_nothing_and_never_registers():
    r = run_case("""
        w, x = make()
        _, ops = ran_ops(tf.function(train_step_fn(w)), x)
        print(json.dumps(dict(ops=ops, types=grappler.registered_device_types())))
    """)
    assert "MaxPool" in r["ops"] and "ReluMaxPool" not in r["ops"]
    assert r["types"] == []  # never registered: no cost for processes that never turn it on


def test_switch_read_per_optimization_and_disable():
    r = run_case("""
        w, x = make()
        tf_relupool.enable_recompute()
        tf_relupool.disable_recompute()
        _, ops_off = ran_ops(tf.function(train_step_fn(w)), x)
        with tf_relupool.recompute("input"):
            _, ops_in = ran_ops(tf.function(train_step_fn(w)), x)
        print(json.dumps(dict(ops_off=ops_off, ops_in=ops_in, stats=grappler.stats())))
    """)
    assert "MaxPool" in r["ops_off"] and "ReluMaxPool" not in r["ops_off"]
    assert "ReluMaxPoolGrad" in r["ops_in"]
    assert r["stats"]["calls_switch_off"] > 0


def test_relu_with_other_consumers_is_left_alone_and_forward_only_is_fused():
    r = run_case("""
        tf_relupool.enable_recompute()
        x = tf.random.normal([2, 8, 8, 4])
        @tf.function
        def two_uses(x):
            r = tf.nn.relu(x)
            return tf.nn.max_pool2d(r, 2, 2, "VALID"), r
        @tf.function
        def forward(x):
            return tf.nn.max_pool2d(tf.nn.relu(x * 2.0), 2, 2, "VALID")
        (a, r), ops_two = ran_ops(two_uses, x)
        y, ops_fwd = ran_ops(forward, x)
        expect = tf.nn.max_pool2d(tf.nn.relu(x * 2.0), 2, 2, "VALID")
        print(json.dumps(dict(ops_two=ops_two, ops_fwd=ops_fwd, stats=grappler.stats(),
                              same=bool(np.array_equal(y.numpy(), expect.numpy())))))
    """)
    assert "MaxPool" in r["ops_two"] and "Relu" in r["ops_two"]
    assert "ReluMaxPool" in r["ops_fwd"] and "MaxPool" not in r["ops_fwd"]
    assert r["same"]
    # On the CPU the pass meets the pair and says why it left it; on a GPU the layout optimizer
    # has already put a Transpose between them (NCHW pooling), so it is no candidate at all.
    if not glob.glob("/dev/nvidia[0-9]*"):
        assert "other consumers" in r["stats"]["last_skip"]


def test_keras_conv_relu_after_remapper_is_fused():
    r = run_case("""
        import keras
        tf_relupool.enable_recompute()
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((16, 16, 3)),
                              keras.layers.Conv2D(4, 3, activation="relu", padding="same"),
                              keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                              keras.layers.Dense(2)])
        # jit_compile=False: Keras' default "auto" compiles with XLA where a GPU is visible, and
        # XLA clusters never reach Grappler (cc/grappler/README.md).
        m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
        h = m.fit(tf.random.normal([8, 16, 16, 3]), tf.zeros([8], tf.int32), epochs=1,
                  verbose=0, batch_size=8)
        print(json.dumps(dict(stats=grappler.stats(), loss=float(h.history["loss"][0]))))
    """)
    assert r["stats"]["fused_with_grad"] >= 1 and r["stats"]["fused_conv_relu"] >= 1, r["stats"]
    assert r["stats"]["errors"] == 0


def test_environment_opt_out():
    r = run_case("""
        tf_relupool.enable_recompute()
        w, x = make()
        _, ops = ran_ops(tf.function(train_step_fn(w)), x)
        print(json.dumps(dict(ops=ops, types=grappler.registered_device_types())))
    """, env={"TF_RELUPOOL_GRAPPLER": "0"})
    assert "MaxPool" in r["ops"] and r["types"] == []


def test_switch_from_environment_and_unknown_batch():
    r = run_case("""
        w, x = make()
        step = tf.function(train_step_fn(w),
                           input_signature=[tf.TensorSpec([None, 12, 12, 3], tf.float32)])
        out, ops = ran_ops(step, x)
        print(json.dumps(dict(ops=ops, mode=grappler.mode(), stats=grappler.stats())))
    """, env={"TF_RELUPOOL_RECOMPUTE": "argmax"})
    assert r["mode"] == "argmax"
    assert "ReluMaxPoolGradFromWindowArgmax" in r["ops"] and "Shape" in r["ops"], r["ops"]
    assert r["stats"]["fused_with_grad"] == 1


def test_error_inside_the_pass_leaves_the_function_working():
    r = run_case("""
        tf_relupool.enable_recompute()
        grappler._lib.tf_relupool_grappler_inject_fault(1)  # throw inside the pass
        w, x = make()
        out, ops = ran_ops(tf.function(train_step_fn(w)), x)
        print(json.dumps(dict(ops=ops, stats=grappler.stats())))
    """)
    assert "MaxPool" in r["ops"] and "ReluMaxPool" not in r["ops"]
    assert r["stats"]["errors"] >= 1 and "injected" in r["stats"]["last_error"]
