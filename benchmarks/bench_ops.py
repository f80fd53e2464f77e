"""Times the fused ops against stock TensorFlow, side by side in one run.

CPU (the default), two tables, each time also as a multiple of one read+write copy of z
(`z * 1`, eager), "(x copy)":
1. Against stock, NHWC: forward (stock relu + max_pool2d vs the fused op, keep="input" and
   keep="argmax") and forward+backward (stock gradient vs the fused gradient in both backward
   modes), each in two execution modes: `function` (tf.function, as Keras trains) and `eager`.
   With oneDNN on, stock runs oneDNN's kernels in both; with TF_ENABLE_ONEDNN_OPTS=0 its plain
   Eigen kernels. `--onednn both` (the default) runs the whole table once per setting, each in a
   fresh process (the variable is read when TensorFlow starts).
2. The fused ops alone, NHWC and NCHW, one eager call each: ReluMaxPoolWithWindowArgmax and
   ReluMaxPoolGradFromWindowArgmax (what training with keep="argmax" runs), ReluMaxPool and
   ReluMaxPoolGrad (keep="input"), next to their memory floor: the bytes each must read and
   write (z, y, the 1-byte codes, dy, dz) in copies of z.
Variants are interleaved round by round (machine noise hits all alike) and medians reported.
The header names the CPU, the instruction-set path of tf_relupool's CPU kernels
(TF_RELUPOOL_CPU_ISA, `--cpu-isa`) and the intra-op thread count (`--threads`).

    python benchmarks/bench_ops.py            # both tables, oneDNN on and off
    python benchmarks/bench_ops.py --quick    # one small shape, few rounds, table 1 only
    python benchmarks/bench_ops.py --device gpu   # on a GPU: NHWC and NCHW, tf.function

On the GPU every variant is called `--iters` times back to back and the devices are synchronised
before and after (`tf.test.experimental.sync_devices`), so a time is the device time per call
including any host round trip an op forces.
"""
import argparse
import ctypes
import datetime
import functools
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from harness import devices  # noqa: E402  (tf_relupool/_harness.py: the CPU's description)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_relupool  # noqa: E402

# The last: small planes (7 output columns in NCHW, fewer than a vector of AVX2 or AVX-512).
FULL_SHAPES = [(256, 32, 32, 64), (64, 56, 56, 64), (64, 112, 112, 64), (256, 14, 14, 128)]
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
    """time_ops of each fn(z, dy), in a tf.function (mode "function") or eagerly."""
    # The copy baseline always runs eagerly: Grappler would fold `z * 1` away inside a function.
    compiled = {name: tf.function(fn) if mode == "function" and name != "copy" else fn
                for name, fn in fns.items()}
    return time_ops({name: functools.partial(fn, z, dy) for name, fn in compiled.items()},
                    rounds, warmup)


def report_row(shape, dtype, mode, t, forward=("fwd fused",)):
    """One row of a stock-vs-fused table: times in ms, fused ones also in copies of z and as a
    speedup over stock; `forward`: the fused forward variants shown."""
    c = t["copy"]
    digits = 3 if c < 1 else 2
    f = lambda v: f"{v:.{digits}f}"  # noqa: E731
    cells = [f"{'x'.join(map(str, shape))}", dtype.name, mode, f(c), f(t["fwd stock"])]
    for name in forward:
        cells += [f"{f(t[name])} ({t[name] / c:.2f})", f"**{t['fwd stock'] / t[name]:.2f}x**"]
    cells.append(f(t["fwd+bwd stock"]))
    for keep in ("input", "argmax"):
        fused = t[f"fwd+bwd fused keep={keep}"]
        cells += [f"{f(fused)} ({fused / c:.2f})", f"**{t['fwd+bwd stock'] / fused:.2f}x**"]
    print("| " + " | ".join(cells) + " |", flush=True)


def cpu_isa():
    """The instruction-set path tf_relupool's CPU kernels run (cc/kernels/relu_max_pool_cpu.cc)."""
    tf_relupool.load_library()
    lib = ctypes.CDLL(tf_relupool._loader.library_path())
    if not hasattr(lib, "tf_relupool_cpu_isa"):
        return "baseline (a library without run-time dispatch)"
    lib.tf_relupool_cpu_isa.restype = ctypes.c_char_p
    return lib.tf_relupool_cpu_isa().decode()


def op_variants(z, dy, data_format):
    """The four fused ops, one raw call each, on z (and dy); 2x2 windows, stride 2, VALID."""
    lib = tf_relupool.load_library()
    four = [1, 2, 2, 1] if data_format == "NHWC" else [1, 1, 2, 2]
    attrs = dict(ksize=four, strides=four, padding="VALID", data_format=data_format)
    _, codes = lib.relu_max_pool_with_window_argmax(z, Targmax=tf.uint8, **attrs)
    shape = tf.shape(z)
    return {
        "copy": lambda: z * 1,
        "fwd argmax": lambda: lib.relu_max_pool_with_window_argmax(z, Targmax=tf.uint8, **attrs),
        "bwd argmax": lambda: lib.relu_max_pool_grad_from_window_argmax(
            shape, dy, codes, validate_window_argmax=False, **attrs),
        "fwd input": lambda: lib.relu_max_pool(z, **attrs),
        "bwd input": lambda: lib.relu_max_pool_grad(z, dy, **attrs),
    }


def op_floors(dtype):
    """Bytes each op must move (read + write), in copies of z (a copy reads and writes z once):
    2x2 windows, so y and dy hold a quarter of z's elements, the codes one byte each."""
    n = dtype.size
    codes = 1 / 4 / n  # one byte per pooled element, relative to z's bytes
    return {"fwd argmax": (1 + 1 / 4 + codes) / 2, "bwd argmax": (1 / 4 + codes + 1) / 2,
            "fwd input": (1 + 1 / 4) / 2, "bwd input": (1 + 1 / 4 + 1) / 2}


def time_ops(fns, rounds, warmup=2):
    """Median ms of each call fns[name]() after `warmup` calls (trace, warm caches), over
    `rounds` rounds in which every variant runs once: machine noise hits all alike."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            # CPU ops run synchronously: the call returns when the result is computed. (No
            # .numpy(): copying a 64 MiB result out would cost more than the ops themselves.)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def report_ops_row(shape, dtype, data_format, t):
    c = t["copy"]
    digits = 3 if c < 1 else 2
    floors = op_floors(dtype)
    cells = [f"{'x'.join(map(str, shape))}", dtype.name, data_format, f"{c:.{digits}f}"]
    for name in ("fwd argmax", "bwd argmax", "fwd input", "bwd input"):
        cells.append(f"{t[name]:.{digits}f} (**{t[name] / c:.2f}** / {floors[name]:.2f})")
    print("| " + " | ".join(cells) + " |", flush=True)


def run_child(onednn):
    """Runs this script again with TF_ENABLE_ONEDNN_OPTS set (read when TensorFlow starts)."""
    argv = [a for a in sys.argv[1:]]
    if "--onednn" in argv:
        i = argv.index("--onednn")
        del argv[i:i + 2]
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1" if onednn == "on" else "0")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--onednn", onednn],
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(proc.returncode)


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
    parser.add_argument("--onednn", choices=("both", "on", "off", "env"), default=None,
                        help="CPU: stock with oneDNN on, off, both (a fresh process each; the "
                             "default, except --quick: env), or as TF_ENABLE_ONEDNN_OPTS says")
    parser.add_argument("--tables", default=None,
                        help="CPU: stock,ops (default: both; quick: stock)")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU: TensorFlow intra-op threads (default: TensorFlow's choice)")
    parser.add_argument("--cpu-isa", default=None,
                        help="CPU: tf_relupool's kernel path (baseline, avx2, avx512; "
                             "default: TF_RELUPOOL_CPU_ISA, else the best this CPU runs)")
    parser.add_argument("--shapes", default=None, help="CPU: NxHxWxC,... (NHWC)")
    args = parser.parse_args()
    if args.device == "gpu":
        return main_gpu(args)
    onednn = args.onednn or ("env" if args.quick else "both")
    if onednn == "both":
        run_child("on")
        print()
        run_child("off")
        return
    if onednn in ("on", "off") and \
            os.environ.get("TF_ENABLE_ONEDNN_OPTS") != ("1" if onednn == "on" else "0"):
        return run_child(onednn)  # TensorFlow has started: set the variable in a fresh process
    if args.cpu_isa:
        os.environ["TF_RELUPOOL_CPU_ISA"] = args.cpu_isa  # read at the first kernel call
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rounds = args.rounds or (5 if args.quick else 15)
    dtypes = [tf.as_dtype(d) for d in args.dtypes.split(",")]
    modes = (args.modes or ("function" if args.quick else "function,eager")).split(",")
    tables = (args.tables or ("stock" if args.quick else "stock,ops")).split(",")
    onednn_env = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    onednn_text = ("oneDNN " + ("off" if onednn_env in ("0", "false") else "on") +
                   f" (TF_ENABLE_ONEDNN_OPTS={onednn_env if onednn_env is not None else 'unset'})")
    threads = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()
    print(f"# fused ReLU+max-pool vs stock TensorFlow {tf.__version__} on the CPU, 2x2 stride 2 VALID")
    print(f"# {datetime.date.today()}, {devices.cpu_description()}, {onednn_text}, "
          f"tf_relupool CPU path {cpu_isa()}, {threads} intra-op threads, median of {rounds} "
          f"interleaved rounds, times in ms, (x copy) = time / time of z * 1")
    rng = np.random.default_rng(0)
    data = {}
    for shape in shapes:
        for dtype in dtypes:
            out_shape = (shape[0], shape[1] // 2, shape[2] // 2, shape[3])
            data[shape, dtype] = (tf.constant(rng.normal(size=shape), dtype),
                                  tf.constant(rng.normal(size=out_shape), dtype))
    if "stock" in tables:
        print()
        print("| shape NHWC | dtype | mode | copy z | fwd stock | fwd fused, keep=input (x copy) | "
              "speedup | fwd fused, keep=argmax (x copy) | speedup | fwd+bwd stock | "
              "fwd+bwd fused, keep=input (x copy) | speedup | fwd+bwd fused, keep=argmax (x copy) "
              "| speedup |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for shape in shapes:
            for dtype in dtypes:
                z, dy = data[shape, dtype]
                for mode in modes:
                    report_row(shape, dtype, mode,
                               time_variants(variants(2, 2, "VALID"), z, dy, rounds, mode),
                               forward=("fwd fused", "fwd fused+argmax"))
    if "ops" in tables:
        print()
        print("The fused ops alone (eager): time in ms (**x copy** / floor: the bytes the op must "
              "read and write, in copies)")
        print()
        print("| shape NHWC | dtype | format | copy z | ReluMaxPoolWithWindowArgmax | "
              "ReluMaxPoolGradFromWindowArgmax | ReluMaxPool | ReluMaxPoolGrad |")
        print("|---|---|---|---|---|---|---|---|")
        for shape in shapes:
            for dtype in dtypes:
                z, dy = data[shape, dtype]
                for data_format in ("NHWC", "NCHW"):
                    if data_format == "NCHW":
                        z, dy = tf.transpose(z, [0, 3, 1, 2]), tf.transpose(dy, [0, 3, 1, 2])
                    report_ops_row(shape, dtype, data_format,
                                   time_ops(op_variants(z, dy, data_format), rounds))


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
