"""Times the fused ops against stock TensorFlow, side by side in one run.

For each shape and dtype: forward (stock relu + max_pool2d vs the fused op), and forward+backward
(stock gradient vs the fused gradient in both backward modes), each in two execution modes:
`function` (tf.function, as Keras trains; stock TF then runs its oneDNN kernels) and `eager`
(stock runs its Eigen kernels). Variants are interleaved round by round and the median is
reported, with each time also as a multiple of one read+write copy of z (`z * 1`). Prints a
Markdown table.

    python benchmarks/bench_ops.py            # full table
    python benchmarks/bench_ops.py --quick    # one small shape, few rounds (make demo)
    python benchmarks/bench_ops.py --device gpu   # on a GPU: NHWC and NCHW, tf.function

On the GPU every variant is called `--iters` times back to back and the devices are synchronised
before and after (`tf.test.experimental.sync_devices`), so a time is the device time per call
including any host round trip an op forces.
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
GPU_SHAPES = [(128, 112, 112, 64), (512, 32, 32, 64)]  # NHWC; NCHW is the same data transposed


def variants(ksize, strides, padding, data_format="NHWC"):
    def stock_fwd(z):
        return tf.nn.max_pool2d(tf.nn.relu(z), ksize, strides, padding, data_format=data_format)

    def fused_fwd(keep):
        return lambda z: tf_relupool.relu_max_pool2d(z, ksize, strides, padding, data_format,
                                                     keep=keep)

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


def time_variants_gpu(fns, zs, dys, rounds, iters, warmup=2):
    """Per variant and round: `iters` calls between two device synchronisations. Each call runs
    the variant on len(zs) independent inputs inside one tf.function, so the per-call dispatch
    cost of tf.function (~0.1 ms, as large as the ops at small shapes) is shared among them; the
    time reported is per pooling op."""
    sync = tf.test.experimental.sync_devices

    def batched(fn):
        return lambda zs, dys: [fn(z, dy) for z, dy in zip(zs, dys)]

    compiled = {name: tf.function(batched(fn)) if name != "copy" else batched(fn)
                for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for fn in compiled.values():
        for _ in range(warmup):
            fn(zs, dys)
    sync()
    for _ in range(rounds):
        for name, fn in compiled.items():
            sync()
            start = time.perf_counter()
            for _ in range(iters):
                fn(zs, dys)
            sync()
            times[name].append((time.perf_counter() - start) / (iters * len(zs)))
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


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
    digits = 3 if c < 1 else 2
    f = lambda v: f"{v:.{digits}f}"  # noqa: E731
    cells = [f"{'x'.join(map(str, shape))}", dtype.name, mode, f(c), f(t['fwd stock']),
             f"{f(t['fwd fused'])} ({t['fwd fused'] / c:.2f})",
             f"**{t['fwd stock'] / t['fwd fused']:.2f}x**", f(t['fwd+bwd stock'])]
    for keep in ("input", "argmax"):
        fused = t[f"fwd+bwd fused keep={keep}"]
        cells += [f"{f(fused)} ({fused / c:.2f})", f"**{t['fwd+bwd stock'] / fused:.2f}x**"]
    print("| " + " | ".join(cells) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, few rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--modes", default=None, help="function,eager (default: both; quick: function)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--iters", type=int, default=10, help="GPU: calls per timed round")
    parser.add_argument("--inputs", type=int, default=4,
                        help="GPU: independent inputs per call (shares tf.function's dispatch)")
    args = parser.parse_args()
    if args.device == "gpu":
        return main_gpu(args)
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


def main_gpu(args):
    if not tf.config.list_physical_devices("GPU"):
        raise SystemExit("--device gpu: TensorFlow sees no GPU")
    rounds = args.rounds or 11
    dtypes = [tf.as_dtype(d) for d in args.dtypes.split(",")]
    name = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
    print(f"# fused ReLU+max-pool vs stock TensorFlow {tf.__version__} on "
          f"{name.get('device_name', 'GPU')}, 2x2 stride 2 VALID, tf.function")
    print(f"# {datetime.date.today()}, median of {rounds} interleaved rounds of {args.iters} calls "
          f"x {args.inputs} inputs, ms per pooling op; (x copy) = multiple of one z * 1")
    print()
    print("| shape NHWC | dtype | format | copy z | fwd stock | fwd fused (x copy) | fwd speedup | "
          "fwd+bwd stock | fwd+bwd fused, keep=input (x copy) | speedup | "
          "fwd+bwd fused, keep=argmax (x copy) | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    with tf.device("/GPU:0"):
        for shape in GPU_SHAPES:
            for dtype in dtypes:
                out_shape = (shape[0], shape[1] // 2, shape[2] // 2, shape[3])
                z_nhwc = [tf.random.normal(shape, seed=i, dtype=tf.float32) for i in range(args.inputs)]
                dy_nhwc = [tf.random.normal(out_shape, seed=i, dtype=tf.float32)
                           for i in range(args.inputs)]
                for fmt in ("NHWC", "NCHW"):
                    perm = [0, 3, 1, 2] if fmt == "NCHW" else [0, 1, 2, 3]
                    zs = [tf.cast(tf.transpose(z, perm), dtype) for z in z_nhwc]
                    dys = [tf.cast(tf.transpose(d, perm), dtype) for d in dy_nhwc]
                    t = time_variants_gpu(variants(2, 2, "VALID", fmt), zs, dys, rounds, args.iters)
                    report_row(shape, dtype, fmt, t)
                    del zs, dys


if __name__ == "__main__":
    main()
