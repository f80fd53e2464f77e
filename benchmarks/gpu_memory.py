"""GPU memory report: stock vs fused ReLU + max pool in Keras training, on the GPU's allocator.

For each model of tf_relupool/_example_models.py and each variant

  stock         the model as written: Conv2D(activation="relu") + MaxPooling2D;
  fused argmax  tf_relupool.rewrite_model(model, keep="argmax"): 1-byte argmax codes kept;
  fused input   tf_relupool.rewrite_model(model, keep="input"): the pre-ReLU input kept;
  switch        the stock model under tf_relupool.enable_recompute() alone: the Grappler pass
                fuses the graph TensorFlow optimizes (keep="argmax"; turned on around this
                variant's steps only, so the other variants' functions stay stock);

and the variants users compare with at Keras' default compile (XLA whenever a GPU is visible):

  default         the stock model, compile() without jit_compile (what users run);
  default-switch  the same under enable_recompute() alone (the trace-time fusion inside XLA);
  default-layer   rewrite_model(model, keep="argmax") at the default compile;
  default-remat   the stock model built under keras.RematScope(mode="activations");

trained with Keras (compile(SGD, jit_compile=False) for the first four, the default compile for
the others; train_on_batch on synthetic data; --policy mixed_bfloat16 for mixed precision), it
measures, under each Grappler configuration asked for (XLA-compiled steps skip Grappler):

- peak: the bytes the GPU allocator (TensorFlow's BFC allocator on GPU:0) holds at the peak of
  one training step above what was resident before it: reset_memory_stats("GPU:0"), one step,
  get_memory_info("GPU:0")["peak"] - current before the step; the median of --reps steps after
  two warm-up steps (the first one traces, optimises the graph and autotunes cuDNN);
- step time: the median over --rounds steps, variants interleaved round by round, in the same
  process (one process per model and Grappler configuration, run one after another, so nothing
  else of this report uses the GPU meanwhile);
- largest batch: the largest multiple of --granularity that trains two steps in a fresh process
  whose GPU has memory_limit=--memory-limit MiB (a logical device, set before TensorFlow
  initialises the GPU, TF_FORCE_GPU_ALLOW_GROWTH removed); a batch that does not fit fails
  with ResourceExhaustedError. Search: from a guess (the measured peak scaled to the limit, or
  --search-start), steps up (or down) with a doubling step until the answer is bracketed, then
  bisects. Searches run --jobs at a time (each process gets its own limit; no timing is taken).

Grappler configurations (--grappler, --search-grappler): "default" (TensorFlow's defaults), or
"+"-joined changes: layout-off (tf.config.optimizer.set_experimental_options(
{"layout_optimizer": False})), remapper-off ({"remapping": False}), workspace-0
(TF_CUDNN_WORKSPACE_LIMIT_IN_MB=0: cuDNN algorithms without workspace), autotune-off
(TF_CUDNN_USE_AUTOTUNE=0: cuDNN's heuristic algorithm, no autotuning in the first step).

On a machine without a GPU, --device cpu runs the same measurements on the CPU's BFC allocator
(TF_CPU_ALLOCATOR_USE_BFC=true); the CPU has no memory_limit, so there a trial fits when the
allocator's peak (resident bytes included) stays under the limit. That mode exists to test this
script; benchmarks/memory_report.py is the CPU report.

Writes a Markdown table (--out FILE.md, or DIR/gpu_memory.md) and the raw numbers beside it
(.json), and prints the table.

    python benchmarks/gpu_memory.py --quick --out /tmp/gpu_memory.md    # meant for ~5 min on an H200
    python benchmarks/memory_report.py --device gpu --quick --out /tmp/gpu_memory.md  # the same
    python benchmarks/gpu_memory.py --models vgg --grappler default,layout-off,layout-off+workspace-0 \\
        --search-grappler default,layout-off --batch-sizes 256,1024
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# harness.py is beside this script. build_model, synthetic_batch and _step are also
# xla_bitwise.py's, as gpu_memory's.
from harness import (MIB, MODELS, ROOT, VARIANT_LABELS, VARIANTS, ReportError,  # noqa: E402
                     build_model, classify_error, git_head, largest_fitting, leave,
                     library_built, print_result, read_result, round_down, run_fresh, run_worker,
                     search_start, start_tensorflow, synthetic_batch, tail, train_step as _step)
from harness import devices  # noqa: E402  (tf_relupool/_harness.py; no TensorFlow import)

CONFIG_ITEMS = ("layout-off", "remapper-off", "workspace-0", "autotune-off")


# ---------------------------------------------------------------------------------------------
# Configurations and the search (no TensorFlow).
# ---------------------------------------------------------------------------------------------
def parse_config(name):
    """A Grappler configuration name -> {"layout_optimizer", "remapper", "cudnn_workspace_mib",
    "cudnn_autotune"}.

    "default" is TensorFlow's defaults; otherwise "+"-joined items of CONFIG_ITEMS.
    ValueError for anything else."""
    settings = {"layout_optimizer": None, "remapper": None, "cudnn_workspace_mib": None,
                "cudnn_autotune": None}
    if name == "default":
        return settings
    items = name.split("+")
    for item in items:
        if item not in CONFIG_ITEMS:
            raise ValueError(f"unknown Grappler configuration {name!r}: use default or "
                             f"'+'-joined items of {', '.join(CONFIG_ITEMS)}")
    if len(set(items)) != len(items):
        raise ValueError(f"Grappler configuration {name!r} repeats an item")
    if "layout-off" in items:
        settings["layout_optimizer"] = False
    if "remapper-off" in items:
        settings["remapper"] = False
    if "workspace-0" in items:
        settings["cudnn_workspace_mib"] = 0
    if "autotune-off" in items:
        settings["cudnn_autotune"] = False
    return settings


# ---------------------------------------------------------------------------------------------
# Worker side: one TensorFlow process, configured before TensorFlow starts.
# ---------------------------------------------------------------------------------------------
def _start(args, memory_limit_mib=None):
    """This worker's TensorFlow: --device, the Grappler configuration args.config, and for a
    largest-batch trial the GPU's memory_limit."""
    return start_tensorflow(args.device, memory_limit_mib=memory_limit_mib,
                            inter_op_threads=args.inter_op_threads, **parse_config(args.config))


def _library():
    info = {}
    try:
        import tf_relupool
        import tf_relupool._build_info as b
        info = {"with_cuda": bool(getattr(b, "WITH_CUDA", False)),
                "cuda_version": getattr(b, "CUDA_VERSION", None),
                "path": os.path.dirname(tf_relupool.__file__)}
        built = library_built()
        if built:
            info["built"] = built
        from tensorflow.python.framework import kernels
        tf_relupool.load_library()
        info["kernel_devices"] = sorted({k.device_type for k in kernels.get_registered_kernels_for_op(
            "ReluMaxPoolWithWindowArgmax").kernel})
    except Exception as e:  # noqa: BLE001 - a description only
        info["error"] = f"{type(e).__name__}: {e}"
    return info


def worker_measure(args):
    """Peaks at each batch size and interleaved step times, all variants, one model/config."""
    tf, dev = _start(args)
    meter = devices.StepMemory(tf, dev)
    if not meter.available:
        raise ReportError(f"no allocator statistics on {dev.name}: {meter.reason}")
    import keras
    built = {v: build_model(tf, args.model, v, policy=args.policy) for v in args.variants}
    jit = {v: bool(m.jit_compile) for v, m in built.items()}
    peaks = {v: {} for v in args.variants}
    warmed = set()
    first = next(iter(built.values()))
    for batch in args.batch_sizes:
        x, y = synthetic_batch(tf, batch, model=first)
        for v, model in built.items():
            for _ in range(2):
                _step(model, x, y, v)
            values = []
            for _ in range(args.reps):
                meter.begin()
                _step(model, x, y, v)
                values.append(meter.end())
            peaks[v][str(batch)] = sorted(values)
        warmed.add(batch)
        del x, y
    times = {v: [] for v in args.variants}
    if args.rounds:
        x, y = synthetic_batch(tf, args.time_batch, model=first)
        if args.time_batch not in warmed:
            for v, model in built.items():
                for _ in range(2):
                    _step(model, x, y, v)
        for _ in range(args.rounds):
            for v, model in built.items():  # interleaved: drifts hit every variant alike
                start = time.perf_counter()
                _step(model, x, y, v)
                times[v].append(time.perf_counter() - start)
    print_result({
        "device": dev.as_dict(), "peaks": peaks, "times": times, "jit_compile": jit,
        "resident_bytes": tf.config.experimental.get_memory_info(dev.name)["current"],
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                     "python": platform.python_version()},
        "library": _library()})


def worker_trial(args):
    """Does `args.trial_batch` train (two steps) under memory_limit=args.memory_limit MiB?"""
    tf, dev = _start(args, memory_limit_mib=args.memory_limit)
    meter = devices.StepMemory(tf, dev)
    result = {"batch": args.trial_batch, "device": dev.name, "status": "fits"}
    try:
        model = build_model(tf, args.model, args.variant, policy=args.policy)
        x, y = synthetic_batch(tf, args.trial_batch, model=model)
        step_peaks, total_peaks = [], []
        for _ in range(args.trial_steps):
            meter.begin()
            _step(model, x, y, args.variant)
            step_peaks.append(meter.end())
            total_peaks.append(meter.total_peak())
        if meter.available:
            result["step_peak_bytes"] = max(step_peaks)
            result["total_peak_bytes"] = max(total_peaks)
        if dev.kind == "cpu":  # no memory_limit on the CPU: compare the allocator's peak
            if not meter.available:
                raise ReportError(f"no allocator statistics on {dev.name}: {meter.reason}")
            if max(total_peaks) > args.memory_limit * MIB:
                result["status"] = "oom"
                result["message"] = (f"allocator peak {max(total_peaks) / MIB:.1f} MiB > limit "
                                     f"{args.memory_limit} MiB (CPU: compared, not enforced)")
    except tf.errors.OpError as e:
        message = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        result["status"] = classify_error(type(e).__name__, message)
        result["message"] = f"{type(e).__name__}: {message}"
    print_result(result)


# ---------------------------------------------------------------------------------------------
# Driver side.
# ---------------------------------------------------------------------------------------------
def _worker_cmd(kind, args, model, config, extra=()):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--device", args.device,
           "--models", model, "--grappler", config, "--variants", ",".join(args.variants),
           "--batch-sizes", ",".join(map(str, args.batch_sizes)),
           "--time-batch", str(args.time_batch), "--reps", str(args.reps),
           "--rounds", str(args.rounds), "--inter-op-threads", str(args.inter_op_threads),
           "--memory-limit", str(args.memory_limit)] + (
               ["--policy", args.policy] if args.policy else [])
    return cmd + list(extra)


def run_measure(args, model, config):
    result, proc = run_worker(_worker_cmd("measure", args, model, config), args.worker_timeout)
    if result is None:
        raise ReportError(f"the measuring process for {model} ({config}) failed with exit "
                          f"status {proc.returncode}:\n{tail(proc.stderr)}")
    return result


def run_trial(args, model, config, variant, batch):
    """One fresh process: {"status": "fits"|"oom"|"error"|"crash"|"timeout", ...}."""
    r = run_fresh(_worker_cmd("trial", args, model, config,
                              ["--variant", variant, "--trial-batch", str(batch),
                               "--trial-steps", str(args.trial_steps)]), args.trial_timeout)
    result = read_result(r["stdout"])  # devices.DeviceError when the worker said DEVICE_ERROR
    if r["status"] != "fits":  # the process failed: its exit says how
        result = {"batch": batch, "status": r["status"], "message": r["message"]}
    elif result is None:
        result = {"batch": batch, "status": "crash", "message": "exit status 0 without an answer"}
    result["seconds"] = r["seconds"]
    return result


def search_largest(args, model, config, variant, peaks=None, log=print, name="gpu_memory.py"):
    """Largest batch (multiple of --granularity) that trains under --memory-limit."""
    if peaks:
        start, step = search_start(peaks, args.memory_limit, args.granularity, args.search_start)
    else:
        start, step = args.search_start, args.search_start
    trials = []

    def fits(batch):
        r = run_trial(args, model, config, variant, batch)
        trials.append(r)
        log(f"{name}: {model}, {config}, {VARIANT_LABELS[variant]}: batch {batch}: "
            f"{r['status']}" + (f" ({r['message']})" if r.get("message") and r["status"] != "oom"
                                else "") + f", {r['seconds']:.0f} s")
        if len(trials) == 1 and r["status"] in ("error", "crash", "timeout"):
            raise ReportError(f"{model}, {config}, {VARIANT_LABELS[variant]}: the first trial "
                              f"(batch {batch}) failed for another reason than memory: "
                              f"{r.get('message')}")
        return r["status"] == "fits"

    best, _ = largest_fitting(fits, start, args.granularity, step, args.highest)
    return {"batch": best, "capped": best >= max(args.granularity,
                                                 round_down(args.highest, args.granularity)),
            "trials": trials}


def _median(values):
    return statistics.median(values) if values else None


def _peak_of(measured, variant, batch):
    values = measured["peaks"].get(variant, {}).get(str(batch))
    return _median(values)


def render(report, brief=False):
    """The Markdown report from the JSON-able dict main() builds (brief: without the paragraph
    on the method, for the terminal)."""
    a = report["args"]
    meta = report["meta"]
    dev = meta["device"]
    versions = meta.get("versions", {})
    lib = meta.get("library", {})
    limit = a["memory_limit"]
    search_on = a["search"]
    lines = [f"# Training-step memory on {dev['name']}: stock vs fused ReLU + max pool", "",
             f"{meta['date']}; measured on **{dev['name']} ({dev['description']})**; "
             f"TensorFlow {versions.get('tensorflow', '?')}, Keras {versions.get('keras', '?')}, "
             f"Python {versions.get('python', '?')}; op library "
             f"{'with' if lib.get('with_cuda') else 'without'} CUDA kernels, built "
             f"{lib.get('built', '?')}; checkout {meta.get('git_head') or '?'}."]
    if dev["kind"] == "gpu" and "GPU" not in lib.get("kernel_devices", ["GPU"]):
        lines += ["", f"**Warning: the op library has no GPU kernels (registered for "
                      f"{', '.join(lib['kernel_devices']) or 'nothing'}): the fused ops ran on "
                      "the CPU, with copies; the fused rows do not measure the GPU kernels.**"]
    ref = "default" if "default" in a["variants"] else "stock"
    method = ("Keras training: `compile(SGD(0.01), SparseCategoricalCrossentropy, "
              "jit_compile=...)`: False for stock, fused argmax/input and stock + "
              "enable_recompute(), none for the Keras default compile rows (XLA whenever a GPU "
              "is visible), `train_on_batch` on synthetic images (32x32x3 for the CIFAR-10 "
              "models, 224x224x3 and 1000 classes for keras.applications), dtype policy "
              f"{a.get('policy') or 'float32'}; "
              f"inter-op parallelism {a['inter_op_threads'] or 'default'}. "
              f"Peak: bytes the {dev['name']} allocator holds at the peak of one step above what "
              f"was resident before it, median of {a['reps']} steps after 2 warm-up steps. "
              + (f"Step time: median of {a['rounds']} steps at batch {a['time_batch']}, "
                 "variants interleaved. " if a["rounds"] else "Step time: not measured. ")
              + f"Ratios are against {VARIANT_LABELS[ref]} in the same Grappler "
              "configuration (XLA-compiled functions do not run Grappler).")
    if search_on:
        how = ("a fresh process whose GPU has `memory_limit` set to that" if dev["kind"] == "gpu"
               else "a fresh process whose CPU allocator peak (resident included) stays under "
                    "that; the CPU has no memory_limit, so this is compared, not enforced")
        method += (f" Largest batch: the largest multiple of {a['granularity']} that trains "
                   f"{a['trial_steps']} steps under {limit} MiB ({how}).")
    if not brief:
        lines += ["", method]
    lines.append("")
    header = ["model", "Grappler", "variant"] + [f"peak @{b} (MiB)" for b in a["batch_sizes"]]
    if a["rounds"]:
        header += [f"step ms @{a['time_batch']}", f"speed vs {ref}"]
    if search_on:
        header += [f"largest batch under {limit} MiB", f"vs {ref}"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []
    configs = a["grappler"] + [c for c in (a["search_grappler"] if search_on else [])
                               if c not in a["grappler"]]
    variants = a["variants"] + [v for v in (a["search_variants"] if search_on else [])
                                if v not in a["variants"]]
    for model in a["models"]:
        for config in configs:
            measured = report["measured"].get(model, {}).get(config) or {"peaks": {}, "times": {}}
            largest = report["largest"].get(model, {}).get(config, {})
            for variant in variants:
                row = [model, config, VARIANT_LABELS[variant]]
                for b in a["batch_sizes"]:
                    p, ps = _peak_of(measured, variant, b), _peak_of(measured, ref, b)
                    cell = f"{p / MIB:.1f}" if p is not None else "n/a"
                    if variant != ref and p is not None and ps:
                        cell += f" ({p / ps:.2f}x)"
                    row.append(cell)
                if a["rounds"]:
                    t = _median(measured["times"].get(variant, []))
                    ts = _median(measured["times"].get(ref, []))
                    row.append(f"{t * 1e3:.1f}" if t else "n/a")
                    row.append(f"{ts / t:.2f}x" if t and ts else "n/a")
                if search_on:
                    r, rs = largest.get(variant), largest.get(ref)
                    if r is None:
                        row += ["-", "-"]
                    else:
                        row.append(f"{r['batch']}" + ("+" if r.get("capped") else ""))
                        row.append(f"{r['batch'] / rs['batch']:.2f}x" if rs and rs["batch"]
                                   else "n/a")
                        odd = [t for t in r["trials"] if t["status"] not in ("fits", "oom")]
                        if odd:
                            notes.append(f"{model}, {config}, {VARIANT_LABELS[variant]}: " +
                                         "; ".join(f"batch {t['batch']} {t['status']} "
                                                   f"({t.get('message', '')})" for t in odd))
                lines.append("| " + " | ".join(row) + " |")
    spreads = [(max(v) - min(v)) / statistics.median(v)
               for per_model in report["measured"].values() for m in per_model.values()
               for per_variant in m["peaks"].values() for v in per_variant.values()
               if v and statistics.median(v)]
    lines.append("")
    if spreads:
        lines.append(f"Peak spread between the measured steps (max - min) / median: at most "
                     f"{max(spreads):.1%}.")
    if any(r.get("capped") for per_model in report["largest"].values()
           for per_config in per_model.values() for r in per_config.values()):
        lines.append(f"`+`: the search stopped at --highest {a['highest']}.")
    if notes:
        lines.append("Trials that failed for another reason than memory (counted as not "
                     "fitting): " + " | ".join(notes))
    if not brief:
        lines.append("Grappler: default = TensorFlow's defaults; layout-off = "
                     "`set_experimental_options({\"layout_optimizer\": False})`; remapper-off = "
                     "`{\"remapping\": False}`; workspace-0 = `TF_CUDNN_WORKSPACE_LIMIT_IN_MB=0`; "
                     "autotune-off = `TF_CUDNN_USE_AUTOTUNE=0`.")
    return "\n".join(lines) + "\n"


def output_paths(out, default_dir):
    """(markdown, json) paths: --out FILE.md, or --out DIR (DIR/gpu_memory.md)."""
    out = out or default_dir
    if out.endswith(".md"):
        return out, out[:-3] + ".json"
    return os.path.join(out, "gpu_memory.md"), os.path.join(out, "gpu_memory.json")


def _csv(kind, choices=None, convert=str):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind}")
        try:
            values = [convert(t) for t in items]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{kind}: {e}")
        if choices is not None:
            bad = [v for v in values if v not in choices]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown {kind} {', '.join(map(str, bad))} (choose from {', '.join(choices)})")
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{kind} listed twice: {text}")
        return values
    return parse


def _positive(text):
    value = int(text)
    if value <= 0:
        raise ValueError(f"must be > 0, got {value}")
    return value


def _config(text):
    parse_config(text)  # ValueError names the problem
    return text


def _positive_arg(text):
    try:
        return _positive(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def parse_args(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Quick (--quick) defaults: models simple,vgg; variants "
                                       "default,default-switch,default-remat,stock,argmax; peaks "
                                       "at batch 1024 with Grappler default and layout-off; step "
                                       "time at 1024; largest batch under 2048 MiB for default "
                                       "and default-switch with default Grappler. Without "
                                       "--quick: all eight variants; peaks at 256,1024 under "
                                       "default, layout-off, layout-off+remapper-off, "
                                       "layout-off+workspace-0; searches for all variants under "
                                       "default and layout-off.")
    p.add_argument("--device", choices=devices.DEVICE_CHOICES, default="gpu",
                   help="gpu (default); cpu runs the same measurements on the CPU allocator "
                        "(for tests); auto picks the GPU when TensorFlow sees one")
    p.add_argument("--quick", action="store_true", help="the ~5-minute version (see below)")
    p.add_argument("--models", type=_csv("models", MODELS), default=None,
                   help="comma-separated: simple,vgg,resnet,vgg16,resnet50 (default simple,vgg)")
    p.add_argument("--variants", type=_csv("variants", tuple(VARIANTS)), default=None,
                   help=f"comma-separated, of {','.join(VARIANTS)} (default all; quick: "
                        "default,default-switch,default-remat,stock,argmax); stock is added "
                        "as the reference when neither stock nor default is listed")
    p.add_argument("--batch-sizes", type=_csv("batch sizes", convert=_positive), default=None,
                   help="batch sizes of the peak measurement (quick: 1024; full: 256,1024)")
    p.add_argument("--time-batch", type=_positive_arg, default=1024,
                   help="batch size of the step-time measurement (default 1024)")
    p.add_argument("--grappler", type=_csv("Grappler configurations", convert=_config),
                   default=None, help="configurations for peaks and times: default, or "
                   "'+'-joined layout-off, remapper-off, workspace-0 (quick: default,layout-off)")
    p.add_argument("--search-grappler", type=_csv("Grappler configurations", convert=_config),
                   default=None, help="configurations for the largest-batch search "
                   "(default: those of default (quick) or default,layout-off (full) that "
                   "--grappler lists, else its first)")
    p.add_argument("--search-variants", type=_csv("variants", tuple(VARIANTS)), default=None,
                   help="variants searched (quick: default,default-switch; full: all measured)")
    p.add_argument("--memory-limit", type=_positive_arg, default=2048, metavar="MIB",
                   help="GPU memory_limit of the largest-batch trials, MiB (default 2048)")
    p.add_argument("--granularity", type=_positive_arg, default=64,
                   help="the largest batch is a multiple of this (default 64)")
    p.add_argument("--search-start", type=_positive_arg, default=1024,
                   help="first batch tried when no peak was measured for the variant (then "
                        "doubling; default 1024)")
    p.add_argument("--highest", type=_positive_arg, default=65536,
                   help="the search never tries batches above this (default 65536)")
    p.add_argument("--no-search", dest="search", action="store_false",
                   help="skip the largest-batch search")
    p.add_argument("--reps", type=_positive_arg, default=None,
                   help="measured steps per peak (quick 3, full 5)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed steps per variant (quick 10, full 20; 0: no timing)")
    p.add_argument("--trial-steps", type=_positive_arg, default=2,
                   help="training steps a largest-batch trial must survive (default 2)")
    p.add_argument("--jobs", type=_positive_arg, default=None,
                   help="searches run at once (default: GPU min(4, cores / 4), CPU 1)")
    p.add_argument("--inter-op-threads", type=int, default=1,
                   help="TensorFlow inter-op parallelism in every process (default 1: repeatable "
                        "peaks; 0: TensorFlow's default)")
    p.add_argument("--trial-timeout", type=_positive_arg, default=300,
                   help="seconds before a trial counts as failed (default 300)")
    p.add_argument("--worker-timeout", type=_positive_arg, default=1800,
                   help="seconds for one measuring process (default 1800)")
    p.add_argument("--policy", default=None, choices=("mixed_bfloat16", "mixed_float16"),
                   help="Keras dtype policy of every model (default: float32)")
    p.add_argument("--out", default=None,
                   help="FILE.md, or a directory for gpu_memory.md (default benchmarks/results, "
                        "with --quick build/demo); the raw numbers go beside it as .json")
    p.add_argument("--worker", choices=("measure", "trial"), help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--trial-batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    q = args.quick
    args.models = args.models or ["simple", "vgg"]
    args.variants = args.variants or (
        ["default", "default-switch", "default-remat", "stock", "argmax"] if q else list(VARIANTS))
    if "stock" not in args.variants and "default" not in args.variants:
        args.variants = ["stock"] + args.variants
    args.batch_sizes = args.batch_sizes or ([1024] if q else [256, 1024])
    args.grappler = args.grappler or (["default", "layout-off"] if q else [
        "default", "layout-off", "layout-off+remapper-off", "layout-off+workspace-0"])
    if args.search_grappler is None:  # the usual ones among those measured
        args.search_grappler = [c for c in (["default"] if q else ["default", "layout-off"])
                                if c in args.grappler] or args.grappler[:1]
    args.search_variants = args.search_variants or (["default", "default-switch"] if q else
                                                    list(args.variants))
    ref = "default" if "default" in args.variants else "stock"
    if ref not in args.search_variants:
        args.search_variants = [ref] + args.search_variants
    args.reps = args.reps or (3 if q else 5)
    args.rounds = args.rounds if args.rounds is not None else (10 if q else 20)
    if args.rounds < 0:
        p.error("argument --rounds: must be >= 0")
    if args.jobs is None:
        args.jobs = max(1, min(4, (os.cpu_count() or 1) // 4)) if args.device != "cpu" else 1
    args.config = args.grappler[0]
    args.model = args.models[0]
    if args.worker == "trial" and (args.variant is None or not args.trial_batch):
        p.error("--worker trial needs --variant and --trial-batch")
    return args


def main(argv=None, prog=None):
    args = parse_args(argv, prog)
    if args.worker:
        {"measure": worker_measure, "trial": worker_trial}[args.worker](args)
        leave()
    name = prog or "gpu_memory.py"
    md_path, json_path = output_paths(args.out, os.path.join(ROOT, "build", "demo") if args.quick
                                      else os.path.join(HERE, "results"))
    t0 = time.time()
    lock = threading.Lock()

    def log(text):
        with lock:
            print(text, flush=True)

    report = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "variant",
                                                                       "trial_batch", "out")},
              "measured": {}, "largest": {}, "meta": {}}
    try:
        # 1. Peaks and step times: one process per model and configuration, one at a time.
        for model in args.models:
            for config in args.grappler:
                t = time.time()
                log(f"{name}: {model}, Grappler {config}: peaks at batch "
                    f"{','.join(map(str, args.batch_sizes))} and step times ...")
                r = run_measure(args, model, config)
                if not report["meta"]:
                    report["meta"] = {"device": r["device"], "versions": r["versions"],
                                      "library": r["library"]}
                    log(f"{name}: measuring {r['device']['name']} ({r['device']['description']})")
                report["measured"].setdefault(model, {})[config] = r
                log(f"{name}: {model}, Grappler {config}: " + ", ".join(
                    f"{VARIANT_LABELS[v]} {_peak_of(r, v, args.batch_sizes[-1]) / MIB:.1f} MiB"
                    for v in args.variants) + f" at batch {args.batch_sizes[-1]} "
                    f"({time.time() - t:.0f} s)")
        # 2. Largest batch under the memory limit: fresh processes, --jobs searches at once.
        if args.search:
            jobs = [(m, c, v) for m in args.models for c in args.search_grappler
                    for v in args.search_variants]
            log(f"{name}: largest batch under {args.memory_limit} MiB: {len(jobs)} searches, "
                f"{args.jobs} at a time ...")

            def one(job):
                m, c, v = job
                measured = report["measured"].get(m, {}).get(c)
                peaks = {int(b): _median(p) for b, p in measured["peaks"][v].items()} \
                    if measured and v in measured["peaks"] else None
                return job, search_largest(args, m, c, v, peaks, log, name)

            found = {}
            with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
                futures = [pool.submit(one, job) for job in jobs]
                try:
                    for future in concurrent.futures.as_completed(futures):
                        (m, c, v), r = future.result()
                        found[(m, c, v)] = r
                        log(f"{name}: {m}, {c}, {VARIANT_LABELS[v]}: largest batch "
                            f"{r['batch']} ({len(r['trials'])} trials)")
                except BaseException:
                    for future in futures:  # searches not started yet: do not start them
                        future.cancel()
                    raise
            for m, c, v in jobs:  # in the order asked for
                report["largest"].setdefault(m, {}).setdefault(c, {})[v] = found[(m, c, v)]
    except devices.DeviceError as e:
        print(f"{name}: error: argument --device: {e}", file=sys.stderr)
        return 2
    except (ReportError, subprocess.TimeoutExpired) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 1
    report["meta"].update({"date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
                           "git_head": git_head(), "host": platform.node(),
                           "seconds": round(time.time() - t0)})
    md = render(report)
    os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
    with open(md_path, "w") as f:
        f.write(md)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    print()
    print(render(report, brief=True))
    print(f"{name}: wrote {md_path} and {json_path} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
