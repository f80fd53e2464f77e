"""Memory and speed report: stock vs tf.recompute_grad vs the fused ReLU + max-pool op.

For each model of tf_relupool/_example_models.py (simple CNN, VGG-style, ResNet-style) and each
variant

  stock           the model as written (Conv2D(relu) / ReLU + MaxPooling2D);
  recompute_grad  TensorFlow's own answer: each conv block wrapped in tf.recompute_grad;
  fused argmax    tf_relupool.rewrite_model + enable_recompute() (defaults: 1-byte argmax codes);
  fused input     the same with enable_recompute(keep="input") (the backward keeps z);

it measures, at several batch sizes, the peak memory of one training step (forward, backward,
SGD update) above what is resident before the step, from TensorFlow's BFC allocator statistics
(TF_CPU_ALLOCATOR_USE_BFC=true, inter-op parallelism 1; the median over a few steps after a
warm-up step; each variant in a process of its own), the median step time (a separate process
with TensorFlow's default threading, variants interleaved round by round), and the largest batch
whose peak fits under a memory cap (stock's peak at the reference batch, 128 by default), found
by bracketing and bisection on measured peaks: the batch before the first measured one over the
cap (peaks jump where a tensor outgrows a power of two, see last_fitting_batch).

Writes a Markdown report and a PNG plot (peak memory against batch size, one line per variant,
one panel per model) and prints the table.

    python benchmarks/memory_report.py                 # full report -> benchmarks/results/
    python benchmarks/memory_report.py --quick         # small version for `make demo`

The device: --device auto (default) measures the GPU when TensorFlow sees one, else the CPU;
--device cpu|gpu chooses. On the GPU the report is benchmarks/gpu_memory.py's (the GPU
allocator's peaks, Grappler configurations, largest batch under a GPU memory_limit; its options
apply, see `gpu_memory.py --help`):

    python benchmarks/memory_report.py --device gpu --quick --out build/gpu_memory.md
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # harness.py, and gpu_memory.py, the GPU report

from harness import (MIB, ROOT, ReportError, bracket_and_bisect, detect_device,  # noqa: E402
                     git_head, library_built, print_result, run_worker, tail)
from harness import devices  # noqa: E402  (tf_relupool/_harness.py; no TensorFlow import)

MODELS = ("simple", "vgg", "resnet")  # tf_relupool/_example_models.py
VARIANTS = ("stock", "recompute_grad", "fused argmax", "fused input")


# ---------------------------------------------------------------------------------------------
# Worker side: runs in a subprocess, TensorFlow configured before it starts.
# ---------------------------------------------------------------------------------------------
def _setup_tf(deterministic_memory):
    """TensorFlow on the CPU (the CPU report measures the CPU, GPU or not), with allocator
    statistics; (tf, devices.Device)."""
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # whatever the environment says
    devices.prepare_environment()
    tf, dev = devices.setup("cpu", inter_op_threads=1 if deterministic_memory else None)
    if deterministic_memory:
        intra = int(os.environ.get("MEMORY_REPORT_INTRA_OP", "0"))
        if intra:
            tf.config.threading.set_intra_op_parallelism_threads(intra)
    return tf, dev


def build_steps(tf, model_name, seed=0, variants=VARIANTS):
    """{variant: (train step tf.function, keep)} for one model's `variants`, all from the same
    weights (those `seed` gives)."""
    import keras
    from tf_relupool import _example_models as models
    import tf_relupool

    keras.utils.set_random_seed(seed)
    base = models.build(model_name)

    def make_step(model, forward=None):
        optimizer = keras.optimizers.SGD(0.01)
        forward = forward or (lambda x: model(x, training=True))

        @tf.function(input_signature=[tf.TensorSpec([None, 32, 32, 3], tf.float32),
                                      tf.TensorSpec([None], tf.int32)])
        def step(x, y):
            with tf.GradientTape() as tape:
                logits = forward(x)
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss
        return step

    def recompute_forward(model):
        def forward(x):
            for layer in models.blocks(model):
                if layer.name.startswith("block"):
                    x = tf.recompute_grad(lambda t, layer=layer: layer(t, training=True))(x)
                else:
                    x = layer(x, training=True)
            return x
        return forward

    steps = {}
    if "stock" in variants:
        steps["stock"] = (make_step(base), None)
    if "recompute_grad" in variants:
        steps["recompute_grad"] = (make_step(base, recompute_forward(base)), None)
    for variant, keep in (("fused argmax", "argmax"), ("fused input", "input")):
        if variant in variants:
            fused = tf_relupool.rewrite_model(base)  # layers follow the switch when traced
            steps[variant] = (make_step(fused), keep)
    return steps


def _batch(tf, n, seed=0):
    g = tf.random.Generator.from_seed(seed + n)
    return (g.uniform((n, 32, 32, 3)), g.uniform((n,), 0, 10, tf.int32))


def _run(tf, step, keep, x, y):
    import tf_relupool
    with tf_relupool.recompute(keep):  # the switch as enable_recompute(keep) sets it, at trace
        return float(step(x, y).numpy())


def measure_peak(tf, meter, step, keep, batch, reps):
    """The step's peak bytes above resident, for `reps` steps after a warm-up (a list).

    Even with inter- and intra-op parallelism 1 the peak varies from step to step here (by up
    to ~20% on a loaded machine): TensorFlow's executor decides which ready ops run inline and
    which go to the back of the queue from their measured run times, so the execution order,
    and with it the set of live tensors, depends on timing. Callers use the median."""
    x, y = _batch(tf, batch)
    _run(tf, step, keep, x, y)
    peaks = []
    for _ in range(reps):
        meter.begin()
        _run(tf, step, keep, x, y)
        peaks.append(meter.end())
    del x, y
    return sorted(peaks)


def largest_batch(peak_of, cap, guess, tolerance):
    """Largest batch b with peak_of(b) <= cap, by bracketing then bisection on measured peaks.

    Peaks grow about linearly with the batch size; the search trusts only measurements: up by
    a quarter, down by a fifth until the boundary is bracketed, then halving the bracket until it
    is narrower than `tolerance` (a fraction of the lower end)."""
    def down(hi):
        return int(hi * 0.8) or None  # None below batch 1: nothing fits

    largest, _ = bracket_and_bisect(lambda b: peak_of(b) <= cap, max(1, int(guess)),
                                    up=lambda lo: int(lo * 1.25) + 1, down=down,
                                    middle=lambda lo, hi: (lo + hi) // 2,
                                    narrow=lambda lo, hi: hi - lo <= max(1, int(lo * tolerance)))
    return largest


def last_fitting_batch(peaks, cap):
    """The largest measured batch whose peak fits under `cap` with no smaller measured batch
    over it ({batch: peak}; 0 when the smallest is over).

    Peaks are not monotonic in the batch size: the BFC allocator hands a request a whole free
    chunk when splitting it would leave less than the request (internal fragmentation), so a
    tensor that just outgrows a power of two can take up to twice its size (measured: the simple
    CNN's stock step 99.5 MiB at batch 128, 136.3 MiB at 130). A user raising the batch stops at
    the first one that does not fit; this is that batch's predecessor among the measured ones."""
    largest = 0
    for b in sorted(peaks):
        if peaks[b] > cap:
            break
        largest = b
    return largest


def worker_peaks(args):
    """One variant's peaks, in a process of its own: the allocator's free chunks, and with them
    its internal fragmentation, then depend on that variant's own steps only."""
    tf, dev = _setup_tf(deterministic_memory=True)
    meter = devices.StepMemory(tf, dev)
    step, keep = build_steps(tf, args.model, variants=[args.variant])[args.variant]
    cache = {}

    def peak_of(batch):
        if batch not in cache:
            cache[batch] = measure_peak(tf, meter, step, keep, batch, args.reps)
        return statistics.median(cache[batch])

    result = {"peaks": {b: peak_of(b) for b in args.batch_sizes}}
    cap = args.cap_bytes if args.cap_bytes is not None else peak_of(args.cap_batch)
    result["cap"] = cap
    if args.search:
        guess = args.cap_batch * cap / max(1, peak_of(args.cap_batch))
        # The search decides which batches to measure; the answer comes from all measurements.
        largest_batch(peak_of, cap, guess, args.tolerance)
    result["all_peaks"] = {b: statistics.median(p) for b, p in cache.items()}
    if args.search:
        result["largest"] = last_fitting_batch(result["all_peaks"], cap)
    result["spread"] = ([min(cache[args.cap_batch]), max(cache[args.cap_batch])]
                        if args.cap_batch in cache else None)
    print_result(result)


def peaks_of_model(model, args):
    """Every variant's peaks (each from its own worker), stock first: its peak at --cap-batch
    is the others' cap. The layout the report and the JSON use: {field: {variant: ...}}."""
    result = {"peaks": {}, "largest": {}, "all_peaks": {}, "spread": {}, "measured": {}}
    cap = None
    for variant in VARIANTS:
        r = _worker("peaks", model, args, variant=variant, cap_bytes=cap)
        cap = r["cap"] if cap is None else cap
        for field in ("peaks", "all_peaks", "spread", "largest"):
            if field in r:
                result[field][variant] = r[field]
        result["measured"][variant] = sorted(int(b) for b in r["all_peaks"])
    result["cap"] = cap
    return result


def worker_times(args):
    tf, _ = _setup_tf(deterministic_memory=False)
    steps = build_steps(tf, args.model)
    x, y = _batch(tf, args.time_batch)
    for step, keep in steps.values():
        for _ in range(2):  # trace, warm caches
            _run(tf, step, keep, x, y)
    times = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:  # interleaved: machine noise hits every variant alike
            step, keep = steps[variant]
            start = time.perf_counter()
            _run(tf, step, keep, x, y)
            times[variant].append(time.perf_counter() - start)
    print_result({v: statistics.median(t) for v, t in times.items()})


# ---------------------------------------------------------------------------------------------
# Driver side.
# ---------------------------------------------------------------------------------------------
def _worker(kind, model, args, variant=None, cap_bytes=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--models", model,
           "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--cap-batch",
           str(args.cap_batch), "--reps", str(args.reps), "--rounds", str(args.rounds),
           "--time-batch", str(args.time_batch), "--tolerance", str(args.tolerance)]
    if not args.search:
        cmd.append("--no-search")
    if variant is not None:
        cmd += ["--variant", variant]
    if cap_bytes is not None:
        cmd += ["--cap-bytes", str(cap_bytes)]
    result, proc = run_worker(cmd)
    if result is None:
        sys.stderr.write(tail(proc.stderr, 4000))
        raise SystemExit(f"memory_report: the {kind} worker for {model}"
                         f"{f' ({variant})' if variant else ''} failed "
                         f"(exit {proc.returncode})")
    return result


def _machine():
    return f"{devices.cpu_description()}, {platform.system()} {platform.release()}"


def _library_info():
    """Which op library the workers load: its file's modification time and the checkout's HEAD."""
    info = {}
    built, head = library_built(), git_head()
    if built:
        info["op_library_built"] = built
    if head:
        info["git_head"] = head
    return info


def _fmt_ratio(value, ref):
    return f"{value / ref:.2f}x" if ref else "n/a"


def render(results, args, versions, meta):
    lib = meta.get("library", {})
    lines = [f"# Peak training-step memory and step time: stock vs fused ReLU + max pool", "",
             f"{meta.get('date')}, {meta.get('machine')}; TensorFlow "
             f"{versions['tf']}, Keras {versions['keras']}, float32, SGD, measured on CPU:0 "
             f"(TensorFlow's CPU BFC allocator); op library built "
             f"{lib.get('op_library_built', '?')}, checkout {lib.get('git_head', '?')}.", "",
             "Peak: bytes allocated during one training step above what was resident before it "
             "(BFC allocator stats, inter-op parallelism 1, median over "
             f"{args.reps} steps after a warm-up, each variant in its own process; min-max in "
             f"brackets). Time: median of {args.rounds} interleaved steps at batch "
             f"{args.time_batch} with default threading, in a separate process. "
             f"Largest batch: the largest batch whose peak stays under stock's peak at batch "
             f"{args.cap_batch}, and every smaller measured batch's too (bracketing and "
             f"bisection on measured peaks, to within {args.tolerance:.0%}; peaks jump where "
             f"a tensor outgrows a power of two and the allocator hands it a chunk up to twice "
             f"its size).", ""]
    header = ["model", "variant"] + [f"peak @{b} (MiB)" for b in args.batch_sizes] + \
        [f"vs stock @{args.cap_batch}", f"step ms @{args.time_batch}", "speed vs stock"]
    if args.search:
        header += ["largest batch under cap", "vs stock"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for model, r in results.items():
        peaks, times = r["peaks"], r["times"]
        stock_ref = peaks["stock"][str(args.cap_batch)] if str(args.cap_batch) in peaks["stock"] \
            else r["cap"]
        for variant in VARIANTS:
            row = [model, variant]
            row += [f"{peaks[variant][str(b)] / MIB:.1f}" for b in args.batch_sizes]
            ref = r["all_peaks"][variant].get(str(args.cap_batch))
            spread = r["spread"][variant]
            if spread and str(args.cap_batch) in peaks[variant]:
                i = 2 + args.batch_sizes.index(args.cap_batch)
                row[i] += f" ({spread[0] / MIB:.0f}-{spread[1] / MIB:.0f})"
            row.append(_fmt_ratio(ref, stock_ref) if ref is not None else "n/a")
            row.append(f"{times[variant] * 1e3:.0f}")
            row.append(f"{times['stock'] / times[variant]:.2f}x")
            if args.search:
                lb, ls = r["largest"][variant], r["largest"]["stock"]
                row += [str(lb), f"{lb / ls:.2f}x" if ls else "n/a"]
            lines.append("| " + " | ".join(row) + " |")
    if args.search:
        lines += ["", "Memory caps (stock's peak at batch %d): " % args.cap_batch + ", ".join(
            f"{m} {r['cap'] / MIB:.1f} MiB" for m, r in results.items()) + "."]
    return "\n".join(lines) + "\n"


def plot(results, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (model, r) in zip(axes[0], results.items()):
        for variant in VARIANTS:
            pts = sorted((int(b), p / MIB) for b, p in r["all_peaks"][variant].items())
            ax.plot([b for b, _ in pts], [p for _, p in pts], marker="o", label=variant)
        if args.search:
            ax.axhline(r["cap"] / MIB, color="gray", linestyle="--", linewidth=1,
                       label=f"cap (stock @{args.cap_batch})")
        ax.set_title(model)
        ax.set_xlabel("batch size")
        ax.set_ylabel("peak training-step memory (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"fused ReLU + max pool, CPU, {datetime.date.today()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="With --device gpu (or auto on a machine where TensorFlow "
                                       "sees a GPU) benchmarks/gpu_memory.py's options apply "
                                       "instead: see gpu_memory.py --help.")
    p.add_argument("--device", choices=devices.DEVICE_CHOICES, default="auto",
                   help="auto (default): the GPU when TensorFlow sees one, else the CPU; the "
                        "GPU report is benchmarks/gpu_memory.py's")
    p.add_argument("--quick", action="store_true",
                   help="small version for `make demo`: fewer batch sizes, steps and rounds")
    p.add_argument("--models", default=None, help="comma-separated: simple,vgg,resnet")
    p.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes")
    p.add_argument("--cap-batch", type=int, default=128,
                   help="the memory cap is stock's peak at this batch size (default 128)")
    p.add_argument("--no-search", dest="search", action="store_false",
                   help="skip the largest-batch search")
    p.add_argument("--reps", type=int, default=None, help="measured steps per peak")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
    p.add_argument("--time-batch", type=int, default=128)
    p.add_argument("--tolerance", type=float, default=None,
                   help="bisection stops at this fraction of the batch size")
    p.add_argument("--out", default=None,
                   help="directory for memory_report.md/.png/.json (default benchmarks/results, "
                        "with --quick build/demo)")
    p.add_argument("--render-only", action="store_true",
                   help="re-render the table and plot from memory_report.json in --out")
    p.add_argument("--worker", choices=("peaks", "times"), help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS, default="stock", help=argparse.SUPPRESS)
    p.add_argument("--cap-bytes", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = (args.models or ("simple,vgg" if args.quick else ",".join(MODELS)))
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.models:
        if m not in MODELS:
            p.error(f"argument --models: unknown model {m!r} (choose from {', '.join(MODELS)})")
    try:
        args.batch_sizes = [int(b) for b in (args.batch_sizes or (
            "32,128" if args.quick else "32,64,128,256")).split(",")]
    except ValueError:
        p.error("argument --batch-sizes: expected comma-separated integers")
    if any(b <= 0 for b in args.batch_sizes) or args.cap_batch <= 0 or args.time_batch <= 0:
        p.error("argument --batch-sizes/--cap-batch/--time-batch: batch sizes must be > 0")
    args.out = args.out or (os.path.join(ROOT, "build", "demo") if args.quick
                            else os.path.join(HERE, "results"))
    args.reps = args.reps or (3 if args.quick else 5)
    args.rounds = args.rounds or (3 if args.quick else 9)
    args.tolerance = args.tolerance if args.tolerance is not None else (
        0.1 if args.quick else 0.02)
    return args


def _device(argv):
    """"cpu" or "gpu": --device, or for auto the device TensorFlow would use (asked only when
    the machine has NVIDIA device files). Exits with a one-line error when that fails."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", choices=devices.DEVICE_CHOICES, default="auto")
    pre.add_argument("--worker")
    known, _ = pre.parse_known_args(argv)
    if known.worker or known.device != "auto" or {"-h", "--help"} & set(argv):
        return known.device if known.device != "auto" else "cpu"
    try:
        return detect_device()
    except (ReportError, devices.DeviceError) as e:
        raise SystemExit(f"memory_report.py: error: cannot tell which device TensorFlow uses "
                         f"here (pass --device cpu or gpu): {e}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if _device(argv) == "gpu":
        import gpu_memory
        rest = [a for i, a in enumerate(argv) if a != "--device" and not a.startswith("--device=")
                and not (i > 0 and argv[i - 1] == "--device")]
        return gpu_memory.main(rest + ["--device", "gpu"], prog="memory_report.py")
    args = parse_args(argv)
    if args.worker:
        args.model = args.models[0]
        return worker_peaks(args) if args.worker == "peaks" else worker_times(args)
    print(f"memory_report: measuring CPU:0 ({_machine()}): TensorFlow's CPU BFC allocator "
          "(TF_CPU_ALLOCATOR_USE_BFC=true)", flush=True)
    from importlib import metadata
    versions = {"tf": metadata.version("tensorflow"), "keras": metadata.version("keras")}
    json_path = os.path.join(args.out, "memory_report.json")
    results = {}
    if args.render_only:
        with open(json_path) as f:
            results = json.load(f)
    for model in ([] if args.render_only else args.models):
        t0 = time.time()
        print(f"memory_report: {model}: peaks ...", flush=True)
        r = peaks_of_model(model, args)
        print(f"memory_report: {model}: step times ...", flush=True)
        r["times"] = _worker("times", model, args)
        results[model] = r
        print(f"memory_report: {model} done in {time.time() - t0:.0f} s", flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(json_path + ".partial", "w") as f:  # survives an interrupted run
            json.dump(results, f, indent=1)
    os.makedirs(args.out, exist_ok=True)
    if not args.render_only:
        results["_meta"] = {"library": _library_info(), "date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
                            "machine": _machine()}
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    meta = results.pop("_meta", {})
    md = render(results, args, versions, meta)
    md_path = os.path.join(args.out, "memory_report.md")
    png_path = os.path.join(args.out, "memory_report.png")
    plot(results, args, png_path)
    with open(md_path, "w") as f:
        f.write(md + f"\n![peak memory against batch size]({os.path.basename(png_path)})\n")
    print(md)
    print(f"memory_report: wrote {md_path} and {png_path}")


if __name__ == "__main__":
    sys.exit(main())
