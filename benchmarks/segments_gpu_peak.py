"""One keras.applications model's steady training peak and step time at Keras' default compile,
in this process: stock, enable_recompute() or enable_recompute(activations=True). A study tool
for the activation recomputation (XLA_FLAGS=--xla_dump_to=... beside it gives the buffer
assignment whose "Live ranges at ... (peak)" says what is held at the peak).

    python benchmarks/segments_gpu_peak.py MobileNetV2 --variant act --batch 32
"""
import argparse
import json
import statistics
import time

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--variant", choices=["stock", "switch", "act"], default="stock")
p.add_argument("--batch", type=int, default=32)
p.add_argument("--size", type=int, default=224)
p.add_argument("--steps", type=int, default=8)
args = p.parse_args()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_relupool  # noqa: E402
from tf_relupool import segments  # noqa: E402

if args.variant != "stock":
    tf_relupool.enable_recompute(activations=args.variant == "act")
keras.utils.set_random_seed(0)
model = getattr(keras.applications, args.model)(weights=None, input_shape=(args.size,) * 2 + (3,),
                                                classes=1000)
model.compile(optimizer=keras.optimizers.SGD(0.01),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = tf.random.stateless_uniform((args.batch, args.size, args.size, 3), seed=[0, 1])
y = tf.random.stateless_uniform((args.batch,), seed=[1, 1], minval=0, maxval=1000,
                                dtype=tf.int32)
dev = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
resident = tf.config.experimental.get_memory_info(dev)["current"]
t0 = time.time()
model.train_on_batch(x, y)
first = time.time() - t0
peaks, times = [], []
for _ in range(args.steps):
    tf.config.experimental.reset_memory_stats(dev)
    t0 = time.time()
    float(model.train_on_batch(x, y))
    times.append(time.time() - t0)
    peaks.append(tf.config.experimental.get_memory_info(dev)["peak"] - resident)
print("RESULT " + json.dumps(dict(
    model=args.model, variant=args.variant, batch=args.batch, first_s=round(first, 1),
    steady_peak_mib=round(statistics.median(peaks) / 2 ** 20, 1),
    step_ms=round(1000 * statistics.median(times), 2), stats=segments.stats())))
