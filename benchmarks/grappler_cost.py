"""What the Grappler pass costs per graph: its own time and the graph bytes TensorFlow serialized
for it, for Keras train functions of keras.applications models (CPU, small inputs).

    python benchmarks/grappler_cost.py [VGG16 ResNet50 MobileNetV2 ...]

TensorFlow serializes the graph before calling the pass and parses its answer (only when it
rewrote something): about the cost of the pass's own parse + serialize, so the total cost is
roughly twice `pass ms`. Grappler calls plugin optimizers twice per graph (two iterations).
"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_relupool  # noqa: E402
from tf_relupool import grappler  # noqa: E402


def first_step_seconds(name, size, switch):
    if switch:
        tf_relupool.enable_recompute()
    else:
        tf_relupool.disable_recompute()
    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3),
                                              classes=10)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = tf.random.normal([2, size, size, 3])
    y = tf.zeros([2], tf.int32)
    grappler.reset_stats()
    t = time.perf_counter()
    model.train_on_batch(x, y)  # trace + optimize + run once
    return time.perf_counter() - t, grappler.stats()


def main():
    names = sys.argv[1:] or ["VGG16", "ResNet50", "MobileNetV2"]
    tf_relupool.enable_recompute()  # register once, before any measurement
    for name in names:
        size = 32 if name != "MobileNetV2" else 32
        off_s, _ = first_step_seconds(name, size, False)
        on_s, st = first_step_seconds(name, size, True)
        calls = max(st["calls"], 1)
        print(f"{name}: pass {st['nanos'] / 1e6:.1f} ms in {st['calls']} calls "
              f"({st['nanos'] / 1e6 / calls:.2f} ms/call, parse {st['parse_nanos'] / 1e6 / calls:.2f}), {st['bytes_in'] / calls / 1e3:.0f} kB "
              f"graph/call, fused {st['fused_with_grad']}+{st['fused_forward_only']}, "
              f"not fused {st['not_fused']} ({st['last_skip'][:90]}); "
              f"first train_on_batch {off_s:.2f} s off / {on_s:.2f} s on")


if __name__ == "__main__":
    main()
