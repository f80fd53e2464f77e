"""What the Grappler tests share: each case runs in a fresh subprocess (the optimizer is registered
once per process and reads the switch when TensorFlow optimizes a function, its first call), with
PRELUDE's helpers: a small conv + ReLU + pool training step, bitwise comparison, the switch off
then on, the ops Grappler left (`tf_relupool.run_metadata.optimized_nodes`).

Imported by test_grappler.py (the plugin), test_fuse_relu_max_pool.py (the patterns),
test_fold_transposes.py (the layout pass) and test_patterns.py (the pattern table).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

# On a GPU TF's layout optimizer turns MaxPoolV2's window inputs and a Pad's paddings into
# DataFormatVecPermute nodes, constant-folded only in Grappler's second iteration: the pass
# refuses those candidates once ("not a constant", "not the Pad's gradient"), then fuses them.
GPU = bool(tf.config.list_physical_devices("GPU"))

PRELUDE = textwrap.dedent("""
    import json, os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # GPU only: cuDNN's heuristic algorithm choice instead of autotuning, which times candidates
    # per graph and may give the switched-off and switched-on graphs different (deterministic)
    # convolution algorithms, hence different last bits.
    os.environ.setdefault("TF_CUDNN_USE_AUTOTUNE", "0")
    import numpy as np
    import tensorflow as tf
    import tf_relupool
    from tf_relupool import _clib, grappler, run_metadata
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if tf.config.list_physical_devices("GPU"):
        # Stock GPU training is not bitwise reproducible from run to run (cuDNN autotuning,
        # atomics: benchmarks/mixed_precision_order.py, docs/gpu.md), so comparisons of the switch
        # off and on are only meaningful with op determinism.
        tf.config.experimental.enable_op_determinism()
        tf.random.set_seed(0)  # random ops require a seed under op determinism

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

    def small_cnn(classes):
        # Keras Conv2D(activation="relu") -> MaxPooling2D -> Dense on 16x16x3, seeded weights
        import keras
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((16, 16, 3)),
                                 keras.layers.Conv2D(4, 3, activation="relu", padding="same"),
                                 keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                                 keras.layers.Dense(classes)])

    def bits_equal(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()

    def off_then_on(make_fn, args, keep="argmax", signature=None):
        # The same stock function run with the switch off, then (a fresh tf.function) on:
        # (bitwise equal, ops that ran off, ops that ran on, stats of the switched-on run).
        tf_relupool.disable_recompute()
        off, off_ops = ran_ops(tf.function(make_fn(), input_signature=signature,
                                           jit_compile=False), *args)
        tf_relupool.enable_recompute(keep)
        grappler.reset_stats()
        on, on_ops = ran_ops(tf.function(make_fn(), input_signature=signature,
                                         jit_compile=False), *args)
        st = grappler.stats()
        tf_relupool.disable_recompute()
        same = all(bits_equal(a, b) for a, b in zip(tf.nest.flatten(off), tf.nest.flatten(on)))
        return same, off_ops, on_ops, st

    ran_nodes = run_metadata.optimized_nodes  # fn's outputs, the nodes of its graphs after Grappler

    def ran_ops(fn, *args):
        out, nodes = ran_nodes(fn, *args)
        return out, sorted({n.op for n in nodes})
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


def require_optimizer():
    """Skips the calling module when the installed op library holds no optimizer (each module:
    `optimizer_available = pytest.fixture(scope="module", autouse=True)(require_optimizer)`)."""
    probe = run_case("""
        import ctypes
        lib = ctypes.CDLL(tf_relupool._loader.library_path())
        print(json.dumps(hasattr(lib, "TF_InitGraph")))
    """)
    if not probe:
        pytest.skip("the installed op library was built without cc/grappler/")


STOCK = {"Relu", "MaxPool", "MaxPoolV2", "MaxPoolGrad", "MaxPoolGradV2", "ReluGrad"}
FUSED = {"argmax": ("ReluMaxPoolWithWindowArgmax", "ReluMaxPoolGradFromWindowArgmax"),
         "input": ("ReluMaxPool", "ReluMaxPoolGrad")}

PAD_STEP = textwrap.dedent("""
    def pad_step(w, pads=((0, 0), (1, 1), (1, 1), (0, 0)), ksize=3, strides=2, padding="VALID",
                 v2=False, pad_value=None, pad=True, bias=None):
        # relu -> [pad] -> max pool (MaxPool or MaxPoolV2), loss, gradients of weights and input;
        # with a bias, TF's remapper makes conv + bias + relu one _FusedConv2D(BiasAdd, Relu)
        def make():
            def step(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    h = tf.nn.conv2d(x, w[0], 1, "SAME")
                    h = tf.nn.relu(h if bias is None else tf.nn.bias_add(h, bias))
                    if pad:
                        h = tf.pad(h, pads) if pad_value is None else \\
                            tf.pad(h, pads, constant_values=pad_value)
                    if v2:
                        h = tf.raw_ops.MaxPoolV2(input=h, ksize=[1, ksize, ksize, 1],
                                                 strides=[1, strides, strides, 1], padding=padding)
                    else:
                        h = tf.nn.max_pool2d(h, ksize, strides, padding)
                    loss = tf.reduce_sum(h * h)
                return [loss] + tape.gradient(loss, w + [x])
            return step
        return make
""")


def applications_case(name, size, setup=""):
    """keras.applications `name` at `size`x`size` (weights=None, batch 2) in a plain tf.function,
    switch off then on: outputs, input gradients, ops that ran, the pass's stats."""
    return run_case(f"""
        {setup}
        import keras
        keras.utils.set_random_seed(0)
        model = keras.applications.{name}(weights=None, input_shape=({size}, {size}, 3),
                                         classes=10)
        x = tf.random.stateless_normal([2, {size}, {size}, 3], seed=[1, 2])
        def make():
            def step(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = model(x, training=True)
                    loss = tf.reduce_sum(y * y)
                return y, tape.gradient(loss, x)
            return step
        tf_relupool.disable_recompute()
        (y_off, g_off), off_ops = ran_ops(tf.function(make(), jit_compile=False), x)
        tf_relupool.enable_recompute()
        grappler.reset_stats()
        (y_on, g_on), on_ops = ran_ops(tf.function(make(), jit_compile=False), x)
        st = grappler.stats()
        g_off, g_on = g_off.numpy(), g_on.numpy()
        print(json.dumps(dict(same_y=bits_equal(y_off.numpy(), y_on.numpy()),
                              same_grad=bits_equal(g_off, g_on),
                              grad_rel=float(np.max(np.abs(g_on - g_off)) / np.max(np.abs(g_off))),
                              off_ops=off_ops, on_ops=on_ops, stats=st)))
    """)
