"""GPU facts for the Grappler pass (run on the GPU machine): registration, what the pass sees
after the layout optimizer, whether XLA-compiled functions reach it, and for the Keras models of
tf_relupool/_example_models.py (fp32 and mixed_bfloat16): the executed graph's fused ops and
formats, the
Transposes next to them, and whether training equals stock's bit for bit.

    python benchmarks/grappler_gpu.py
"""
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_relupool  # noqa: E402
from tf_relupool import grappler, run_metadata  # noqa: E402

import harness  # noqa: E402  (beside this script: the models and variants of gpu_memory.py)


def ops_of(fn, *args):
    """fn's result and the pooling, ReLU, Transpose and convolution ops TensorFlow executed
    for it: {op@device (/data_format): count}."""
    out, nodes = run_metadata.executed_nodes(fn, *args)
    ops = {}
    for n in nodes:
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


# ---- Keras models of tf_relupool/_example_models.py on the GPU: what the executed graph holds ----
def _graph_facts(nodes):
    """Fused ops (op/format), stock pooling left, Transposes next to a fused op."""
    by_name = {n.name: n for n in nodes}
    readers = {}  # node name -> the nodes reading its output 0
    for n in nodes:
        for i in n.input:
            if not i.startswith("^") and (":" not in i or i.endswith(":0")):
                readers.setdefault(i.split(":")[0], []).append(n)
    facts = {"fused": {}, "stock_pools": 0, "transposes": 0, "transposes_next_to_pools": 0}
    for n in nodes:
        if n.op == "Transpose":
            facts["transposes"] += 1
        stock = "MaxPool" in n.op and not n.op.startswith("ReluMaxPool")  # _Mkl* names too
        facts["stock_pools"] += stock
        if not (stock or n.op.startswith("ReluMaxPool")):
            continue
        if not stock:
            key = f"{n.op}/{n.attr['data_format'].s.decode()}"
            facts["fused"][key] = facts["fused"].get(key, 0) + 1
        # Transposes feeding a pooling op (fused or stock) or reading its output 0.
        near = [by_name[i.split(":")[0]] for i in n.input
                if not i.startswith("^") and i.split(":")[0] in by_name]
        near += readers.get(n.name, [])
        facts["transposes_next_to_pools"] += sum(m.op == "Transpose" for m in near)
    return facts


def models_section(model_names=("simple", "vgg"), policies=("float32", "mixed_bfloat16"),
                   batch=64, steps=3):
    """Each model trained `steps` SGD steps from the same weights: stock (switch off), stock
    under enable_recompute() (the pass), and rewrite_model (the explicit API), default Grappler,
    with op determinism (stock GPU training is not bitwise reproducible without it). Prints the
    executed graph's facts and whether the losses and weights equal stock's bitwise."""
    import hashlib
    tf.config.experimental.enable_op_determinism()
    import keras
    x, y = harness.synthetic_batch(tf, batch, seeds=([0, 1], [2, 3]))
    for policy in policies:
        keras.mixed_precision.set_global_policy(policy)
        for name in model_names:
            runs = {}
            # The model of each: harness's (gpu_memory.py's) stock, switch and fused argmax.
            for variant, built in (("stock", "stock"), ("switch", "switch"),
                                   ("explicit", "argmax")):
                m = harness.build_model(tf, name, built)
                if variant == "switch":
                    tf_relupool.enable_recompute("argmax")
                else:
                    tf_relupool.disable_recompute()
                grappler.reset_stats()
                first, nodes = run_metadata.executed_nodes(m.train_on_batch, x, y)
                losses = [float(first)]
                losses += [float(m.train_on_batch(x, y)) for _ in range(steps - 1)]
                tf_relupool.disable_recompute()
                digest = hashlib.sha256(b"".join(w.tobytes() for w in m.get_weights()))
                st = grappler.stats()
                runs[variant] = dict(losses=losses, weights=digest.hexdigest()[:16],
                                     graph=_graph_facts(nodes),
                                     stats={k: st[k] for k in ("fused_with_grad",
                                                                "fused_conv_relu", "nchw_ops",
                                                                "transposes_removed", "errors")})
            for variant in ("switch", "explicit"):
                r = runs[variant]
                r["bitwise_vs_stock"] = (r["losses"] == runs["stock"]["losses"] and
                                         r["weights"] == runs["stock"]["weights"])
            print(f"models {name} {policy}:", json.dumps(runs))
    keras.mixed_precision.set_global_policy("float32")


if __name__ == "__main__":
    main()
    models_section()
