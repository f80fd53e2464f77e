"""Times the fused ops against stock TensorFlow, side by side in one run.

For each shape and dtype: forward (stock relu + max_pool2d vs the fused op), and forward+backward
(stock gradient vs the fused gradient in both backward modes), each in two execution modes:
`function` (tf.function, as Keras trains; stock TF then runs its oneDNN kernels) and `eager`
(stock runs its Eigen kernels). Variants are interleaved round by round and the median is
reported, with each time also as a multiple of one read+write copy of z (`z * 1`). Prints a
Markdown table.

    python benchmarks/bench_ops.py            # full table
    python benchmarks/bench_ops.py --quick    # one small shape, few rounds (make demo)
"""
import argparse
import datetime
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import tf_relupool

FULL_SHAPES = [(256, 32, 32, 64), (64, 56, 56, 64), (64, 112, 112, 64)]
QUICK_SHAPES = [(128, 16, 16, 128)]


def variants(ksize, strides, padding):
    def stock_fwd(z):
        return tf.nn.max_pool2d(tf.nn.relu(z), ksize, strides, padding)

    def fused_fwd(keep):
        return lambda z: tf_relupool.relu_max_pool2d(z, ksize, strides, padding, keep=keep)

    def fwd_bwd(fwd):
        def step(z, dy):
            with tf.GradientTape() as tape:
                tape.watch(z)
                y = fwd(z)
            # Return y too: otherwise Grappler prunes a forward op the gradient does not read.
            return y, tape.gradient(y, z, output_gradients=dy)
        return step

    return {
        "copy": lambda z, dy: z * 1,
        "fwd stock": lambda z, dy: stock_fwd(z),
        "fwd fused": lambda z, dy: fused_fwd("input")(z),
        "fwd fused+argmax": lambda z, dy: fused_fwd("argmax")(z),
        "fwd+bwd stock": fwd_bwd(stock_fwd),
        "fwd+bwd fused keep=input": fwd_bwd(fused_fwd("input")),
        "fwd+bwd fused keep=argmax": fwd_bwd(fused_fwd("argmax")),
    }


def time_variants(fns, z, dy, rounds, mode, warmup=2):
    # The copy baseline always runs eagerly: Grappler would fold `z * 1` away inside a function.
    compiled = {name: tf.function(fn) if mode == "function" and name != "copy" else fn
                for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for name, fn in compiled.items():
        for _ in range(warmup):
            fn(z, dy)  # trace and warm caches
    for _ in range(rounds):
        for name, fn in compiled.items():  # interleaved: machine noise hits all variants alike
            # CPU ops run synchronously: the call returns when the result is computed. (No
            # .numpy(): copying a 64 MiB result out would cost more than the ops themselves.)
            start = time.perf_counter()
            fn(z, dy)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def report_row(shape, dtype, mode, t):
    c = t["copy"]
    cells = [f"{'x'.join(map(str, shape))}", dtype.name, mode, f"{c:.2f}", f"{t['fwd stock']:.2f}",
             f"{t['fwd fused']:.2f} ({t['fwd fused'] / c:.2f})",
             f"**{t['fwd stock'] / t['fwd fused']:.2f}x**", f"{t['fwd+bwd stock']:.2f}"]
    for keep in ("input", "argmax"):
        fused = t[f"fwd+bwd fused keep={keep}"]
        cells += [f"{fused:.2f} ({fused / c:.2f})", f"**{t['fwd+bwd stock'] / fused:.2f}x**"]
    print("| " + " | ".join(cells) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, few rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--modes", default=None, help="function,eager (default: both; quick: function)")
    args = parser.parse_args()
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    rounds = args.rounds or (5 if args.quick else 15)
    dtypes = [tf.as_dtype(d) for d in args.dtypes.split(",")]
    modes = (args.modes or ("function" if args.quick else "function,eager")).split(",")
    print(f"# fused ReLU+max-pool vs stock TensorFlow {tf.__version__}, 2x2 stride 2 VALID, NHWC")
    print(f"# {datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, median of {rounds} interleaved rounds, times in ms")
    print()
    print("| shape NHWC | dtype | mode | copy z | fwd stock | fwd fused (x copy) | fwd speedup | "
          "fwd+bwd stock | fwd+bwd fused, keep=input (x copy) | speedup | "
          "fwd+bwd fused, keep=argmax (x copy) | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for shape in shapes:
        for dtype in dtypes:
            z = tf.constant(rng.normal(size=shape), dtype)
            out_shape = (shape[0], shape[1] // 2, shape[2] // 2, shape[3])
            dy = tf.constant(rng.normal(size=out_shape), dtype)
            for mode in modes:
                report_row(shape, dtype, mode, time_variants(variants(2, 2, "VALID"), z, dy, rounds, mode))


if __name__ == "__main__":
    main()
