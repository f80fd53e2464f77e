"""GPU facts for the Grappler pass (run on the GPU machine): registration, what the pass sees
after the layout optimizer, and whether XLA-compiled functions reach it.

    python benchmarks/grappler_gpu.py
"""
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

import tf_relupool  # noqa: E402
from tf_relupool import grappler  # noqa: E402


def ops_of(fn, *args):
    ctx = context.context()
    ctx.enable_graph_collection()
    try:
        out = fn(*args)
        meta = ctx.export_run_metadata()
    finally:
        ctx.disable_graph_collection()
    ops = {}
    for fg in meta.function_graphs:
        for g in fg.partition_graphs:
            for n in g.node:
                if "Pool" in n.op or "Relu" in n.op or "Transpose" in n.op or "Conv" in n.op:
                    key = f"{n.op}@{n.device.rsplit('device:', 1)[-1]}"
                    if n.op in ("MaxPool", "ReluMaxPool", "ReluMaxPoolWithWindowArgmax"):
                        key += "/" + n.attr["data_format"].s.decode()
                    ops[key] = ops.get(key, 0) + 1
    return out, ops


def main():
    print("GPUs:", tf.config.list_physical_devices("GPU"))
    tf_relupool.enable_recompute()
    print("registered:", grappler.registered_device_types())
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(0, 0.2, [3, 3, 8, 16]).astype(np.float32))
    x = tf.constant(rng.normal(0, 1, [16, 32, 32, 8]).astype(np.float32))

    def step(x):
        with tf.GradientTape() as tape:
            y = tf.nn.max_pool2d(tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME")), 2, 2, "VALID")
            loss = tf.reduce_sum(y * y)
        return loss, tape.gradient(loss, w)

    for jit in (False, True):
        grappler.reset_stats()
        try:
            (loss, g), ops = ops_of(tf.function(step, jit_compile=jit), x)
            res = dict(loss=float(loss), ops=ops)
        except Exception as e:  # noqa: BLE001
            res = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        st = grappler.stats()
        print(f"tf.function(jit_compile={jit}):", json.dumps(res),
              {k: st[k] for k in ("calls", "fused_with_grad", "errors", "last_skip")})

    import keras
    for jit in (False, "auto", True):
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((32, 32, 3)),
                              keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
                              keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                              keras.layers.Dense(10)])
        m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit)
        grappler.reset_stats()
        try:
            h = m.fit(tf.random.normal([32, 32, 32, 3]), tf.zeros([32], tf.int32), epochs=1,
                      batch_size=16, verbose=0)
            res = dict(loss=float(h.history["loss"][0]))
        except Exception as e:  # noqa: BLE001
            res = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        st = grappler.stats()
        print(f"keras fit jit_compile={jit!r}:", json.dumps(res),
              {k: st[k] for k in ("calls", "fused_with_grad", "fused_conv_relu", "errors",
                                  "last_skip")})


if __name__ == "__main__":
    main()
