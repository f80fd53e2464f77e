"""What the Grappler pass costs per graph: its own time and the graph bytes TensorFlow serialized
for it, for Keras train functions of keras.applications models (CPU, small inputs).

    python benchmarks/grappler_cost.py [--offline N] [VGG16 ResNet50 DenseNet121 MobileNetV2 ...]

In TensorFlow: one `train_on_batch` (trace + Grappler + one step) with the switch off, then with
it on; the pass's own counters (`grappler.stats()`: calls, nanoseconds, of them parsing).
TensorFlow serializes the graph before calling the pass and parses its answer (only when it
rewrote something): about the cost of the pass's own parse + serialize, so the total cost is
roughly twice `pass ms`. Grappler calls plugin optimizers twice per graph (two iterations).

--offline N: also the pass alone over the same training graph, N times, outside TensorFlow's
pipeline (the graph Grappler produced with the switch off, i.e. what the pass is handed, through
`tf_relupool_rewrite_graph`: parse + match + rewrite + serialize): median and min ms per graph.
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

import tf_relupool  # noqa: E402
from tf_relupool import _clib, grappler  # noqa: E402


def build(name, size):
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3),
                                              classes=10, classifier_activation=None)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model, tf.random.normal([2, size, size, 3]), tf.zeros([2], tf.int32)


def first_step_seconds(name, size, switch):
    if switch:
        tf_relupool.enable_recompute()
    else:
        tf_relupool.disable_recompute()
    model, x, y = build(name, size)
    grappler.reset_stats()
    t = time.perf_counter()
    model.train_on_batch(x, y)  # trace + optimize + run once
    return time.perf_counter() - t, grappler.stats()


def optimized_train_graph(name, size):
    """The train function's graph after Grappler with the switch off (what the pass is given)."""
    tf_relupool.disable_recompute()
    model, x, y = build(name, size)
    ctx = context.context()
    ctx.enable_graph_collection()
    model.train_on_batch(x, y)
    meta = ctx.export_run_metadata()
    ctx.disable_graph_collection()
    graphs = [g.post_optimization_graph for g in meta.function_graphs]
    return max(graphs, key=lambda g: len(g.node)).SerializeToString()


def offline(name, size, repeat):
    data = optimized_train_graph(name, size)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fused, _, _ = _clib.rewrite_serialized_graph(data, "argmax")
        times.append(time.perf_counter() - t)
    print(f"{name} offline: {len(data) / 1e3:.0f} kB graph, fused {fused}: "
          f"median {statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms per "
          f"graph ({repeat} runs)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["VGG16", "ResNet50", "MobileNetV2"])
    parser.add_argument("--offline", type=int, default=0, metavar="N")
    parser.add_argument("--size", type=int, default=32)
    args = parser.parse_args()
    tf_relupool.enable_recompute()  # register once, before any measurement
    for name in args.models:
        size = max(args.size, 75) if name == "InceptionV3" else args.size
        off_s, _ = first_step_seconds(name, size, False)
        on_s, st = first_step_seconds(name, size, True)
        calls = max(st["calls"], 1)
        print(f"{name}: pass {st['nanos'] / 1e6:.1f} ms in {st['calls']} calls "
              f"({st['nanos'] / 1e6 / calls:.2f} ms/call, parse "
              f"{st['parse_nanos'] / 1e6 / calls:.2f}), {st['bytes_in'] / calls / 1e3:.0f} kB "
              f"graph/call, fused {st['fused_with_grad']}+{st['fused_forward_only']} "
              f"({st['fused_through_pad']} through a Pad), "
              f"not fused {st['not_fused']} ({st['last_skip'][:90]}); "
              f"first train_on_batch {off_s:.2f} s off / {on_s:.2f} s on")
        if args.offline:
            offline(name, size, args.offline)


if __name__ == "__main__":
    main()
