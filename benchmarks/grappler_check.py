"""Stock code under enable_recompute(): does TensorFlow's own Grappler run fuse it? (CPU)

Runs one raw tf.function training step (conv -> tf.nn.relu -> tf.nn.max_pool2d, twice, then a
dense head; GradientTape; SGD update) with the switch off and on, from the same weights and
data, and prints:
  - the op types of the graph TensorFlow actually ran (tf_relupool.run_metadata.executed_ops: the
    partition graphs of RunMetadata, from context.enable_graph_collection()),
  - the pass's own counters (tf_relupool.grappler.stats()),
  - whether loss, gradients and updated weights are bitwise equal,
  - peak allocator bytes of one step (BFC allocator on the CPU), and the step time.

    TF_CPU_ALLOCATOR_USE_BFC=true python benchmarks/grappler_check.py [--keep argmax|input]
        [--model raw|keras] [--batch 64] [--device CPU|GPU] [--deterministic] [--no-layout]
"""
import argparse
import time

from harness import devices  # tf_relupool/_harness.py: the step memory meter (no TensorFlow)

devices.prepare_environment()  # TF_CPU_ALLOCATOR_USE_BFC=true unless set: CPU allocator stats

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_relupool  # noqa: E402
from tf_relupool import grappler, run_metadata  # noqa: E402

FUSED_OPS = {"ReluMaxPool", "ReluMaxPoolGrad", "ReluMaxPoolWithWindowArgmax",
             "ReluMaxPoolGradFromWindowArgmax"}
STOCK_OPS = {"Relu", "ReluGrad", "MaxPool", "MaxPoolGrad"}


def raw_model(batch, seed=0, api_keep=None):
    rng = np.random.default_rng(seed)
    shapes = [[3, 3, 3, 32], [3, 3, 32, 64], [8 * 8 * 64, 10]]
    weights = [tf.Variable(rng.normal(0, 0.2, s).astype(np.float32)) for s in shapes]
    x = tf.constant(rng.normal(0, 1, [batch, 64, 64, 3]).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, [batch]).astype(np.int32))

    def pool(z, k):
        if api_keep is None:
            return tf.nn.max_pool2d(tf.nn.relu(z), k, k, "VALID")
        return tf_relupool.relu_max_pool2d(z, k, k, "VALID", keep=api_keep)

    def step(x, y):
        w1, w2, wd = weights
        with tf.GradientTape() as tape:
            h = pool(tf.nn.conv2d(x, w1, 1, "SAME"), 2)
            h = pool(tf.nn.conv2d(h, w2, 1, "SAME"), 4)
            logits = tf.reshape(h, [tf.shape(h)[0], -1]) @ wd
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        grads = tape.gradient(loss, weights)
        for w, g in zip(weights, grads):
            w.assign_sub(0.01 * g)
        return loss, grads

    return weights, step, (x, y)


def keras_model(batch, seed=0):
    import keras
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((64, 64, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(4),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(0, 1, [batch, 64, 64, 3]).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, [batch]).astype(np.int32))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    weights = model.trainable_variables

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, weights)
        for w, g in zip(weights, grads):
            w.assign_sub(0.01 * g)
        return loss, grads

    return weights, step, (x, y)


def run(keep, model, batch, repeats, device="CPU"):
    mem = f"{device}:0"
    meter = devices.StepMemory(tf, devices.Device(device.lower(), device))
    results = {}
    for label, mode in (("switch off", None), (f"switch on ({keep})", keep)):
        with tf.device(mem):
            if model == "keras":
                weights, step, args = keras_model(batch)
            else:  # "api": tf_relupool.relu_max_pool2d called explicitly, the switch-on run
                api_keep = keep if model == "api" and mode is not None else None
                weights, step, args = raw_model(batch, api_keep=api_keep)
        if model == "api":  # the explicit API, no Grappler rewrite: the pass's baseline
            mode = None
        if mode is None:
            tf_relupool.disable_recompute()
        else:
            tf_relupool.enable_recompute(keep)
        grappler.reset_stats()
        fn = tf.function(step)
        initial = [w.numpy() for w in weights]
        # First call: trace, optimize (the pass), run. What the executor ran: after Grappler
        # and the later passes, e.g. oneDNN's rewrite of _FusedConv2D to _MklNativeFusedConv2D.
        _, types = run_metadata.executed_ops(fn, *args)
        st = grappler.stats()
        for w, w0 in zip(weights, initial):  # same start for the measured step
            w.assign(w0)
        meter.begin()
        loss, grads = fn(*args)
        peak = meter.end()
        values = [loss.numpy()] + [g.numpy() for g in grads] + [w.numpy() for w in weights]
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn(*args)[0].numpy()
            times.append(time.perf_counter() - t)
        results[label] = dict(types=types, stats=st, peak=peak, values=values,
                              ms=1000 * float(np.median(times)))
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", default="argmax", choices=["argmax", "input"])
    p.add_argument("--model", default="raw", choices=["raw", "keras", "api"],
                   help="api: the raw model with tf_relupool.relu_max_pool2d written in it "
                        "(switch off) against stock: what the ops give without the pass")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="CPU", choices=["CPU", "GPU"])
    p.add_argument("--deterministic", action="store_true",
                   help="tf.config.experimental.enable_op_determinism() (GPU convolutions)")
    p.add_argument("--no-layout", action="store_true", help="Grappler's layout optimizer off")
    a = p.parse_args()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if a.no_layout:
        tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
    if a.deterministic:
        tf.config.experimental.enable_op_determinism()
    res = run(a.keep, a.model, a.batch, a.repeats, a.device)
    (off_label, off), (on_label, on) = res.items()
    for label, r in res.items():
        seen = {k: v for k, v in sorted(r["types"].items()) if k in FUSED_OPS | STOCK_OPS
                or "Fused" in k or "Pool" in k}
        s = r["stats"]
        print(f"{label}: ran {seen}")
        print(f"  pass: calls={s['calls']} rewritten={s['graphs_rewritten']} "
              f"fused_with_grad={s['fused_with_grad']} fused_conv_relu={s['fused_conv_relu']} "
              f"not_fused={s['not_fused']} errors={s['errors']} "
              f"time={s['nanos'] / 1e6:.2f} ms bytes_in={s['bytes_in']} {s['last_skip']}")
        print(f"  peak step memory {r['peak'] / 2**20:.1f} MiB, step {r['ms']:.1f} ms")
    same = all(np.array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))
               for x, y in zip(off["values"], on["values"]))
    print(f"loss, gradients, updated weights bitwise equal: {same}")
    print(f"peak ratio on/off: {on['peak'] / off['peak']:.3f}")


if __name__ == "__main__":
    main()
