"""The largest batch that trains on a GPU of a given size, at Keras' default compile.

A user who runs out of GPU memory asks one question: how large a batch now trains? This command
answers it for stock Keras and for `tf_relupool.enable_recompute()`, as users run them:
`model.compile(optimizer, loss)` with nothing else (XLA whenever a GPU is visible), and
`jit_compile=False` beside them for reference.

For each model and variant (benchmarks/harness.py's VARIANTS; by default `default` = stock at
Keras' default compile, `default-switch` = the same under enable_recompute(), `stock` =
jit_compile=False), it measures

- without a limit (growth allocator, one fresh process per variant, variants run one after
  another, --repeat times in turn): the first step's peak above resident (it traces, compiles and
  autotunes), the steady step's peak (median of --reps steps), the steady step time (median of
  --rounds steps) and the first step's wall time;
- under `--memory-limit` MiB: the largest multiple of the model's granularity that trains
  --trial-steps steps in a fresh process whose GPU is a logical device with that memory_limit
  (TensorFlow's default BFC allocator, which holds the limit; TF_FORCE_GPU_ALLOW_GROWTH removed).
  Trials of all searches run --jobs at a time; each search is a k-ary one: every round tries
  --width batches spread over the open bracket, in parallel, and keeps the largest that fits
  below the smallest that does not.

A trial of a switched variant runs --runs processes in turn (default 2), sharing the XLA
autotune cache that enable_recompute() sets, empty before the first: the answer for a user who
runs the script again at that batch; each run's status is in the report.

A GPU is made smaller in one of two ways: a logical device's memory_limit (default; BFC holds
it), or, with the lever free4g / free2g, physically (occupy_gpu: all free memory but that much
is taken through the CUDA driver before TensorFlow starts; such trials must run alone, --jobs 1),
which also binds cuda_malloc_async (lever async) and cuDNN's and XLA's own allocations.

A variant may carry a lever after "+": an environment setting of its processes (LEVERS), e.g.
`default-switch+autotune0` is the switch with `XLA_FLAGS=--xla_gpu_autotune_level=0`. Levers are
for studies; what enable_recompute() itself sets is part of the `default-switch` variant.

    python benchmarks/largest_batch.py --models vgg16,simple,vgg --jobs 12 \\
        --out benchmarks/results/largest_batch_h200.md
    python benchmarks/largest_batch.py --models vgg16 --variants default-switch+autotune0 \\
        --no-measure --log-dir /tmp/trial-logs

On a machine without a GPU, --device cpu runs the same protocol on the CPU's BFC allocator (no
limit is enforced there; a trial fits when the allocator's peak stays under the limit): that mode
exists to test this script.
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from harness import (MIB, MODELS, VARIANT_LABELS, VARIANTS, ReportError, build_model,  # noqa: E402
                     classify_error, git_head, leave, library_built, measure_steps,
                     print_result, read_result, run_worker, start_tensorflow, step_figures,
                     synthetic_batch, tail, train_step, trial_env)
from harness import devices  # noqa: E402  (tf_relupool/_harness.py; no TensorFlow import)

# Study levers: environment settings of a variant's processes (set before TensorFlow starts).
LEVERS = {
    "autotune0": {"XLA_FLAGS": "--xla_gpu_autotune_level=0"},
    "autotune1": {"XLA_FLAGS": "--xla_gpu_autotune_level=1"},
    # XLA's scheduler and rematerialization budget: a percentage of the physical memory (141 GB
    # on an H200; 3% is about 4 GiB, what a 4 GiB GPU's 95% default gives it).
    "slop3": {"XLA_FLAGS": "--xla_gpu_memory_limit_slop_factor=3"},
    "slop2": {"XLA_FLAGS": "--xla_gpu_memory_limit_slop_factor=2"},
    "nolhs": {"XLA_FLAGS": "--xla_gpu_enable_analytical_sol_latency_estimator=false"},
    # XLA's temp buffer in several heaps of about this size instead of one block (fragmentation).
    "heap256": {"XLA_FLAGS": "--xla_multiheap_size_constraint_per_heap=268435456"},
    "heap512": {"XLA_FLAGS": "--xla_multiheap_size_constraint_per_heap=536870912"},
    "heap1g": {"XLA_FLAGS": "--xla_multiheap_size_constraint_per_heap=1073741824"},
    # The BFC allocator fails at once instead of waiting up to 10 s for memory to be freed
    # (GPUOptions.experimental.disallow_retry_on_allocation_failure, set by the worker).
    "noretry": {"TFRP_NO_ALLOC_RETRY": "1"},
    "notriton": {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"},
    "determinism": {"TF_DETERMINISTIC_OPS": "1"},
    # XLA's persistent autotune results (the directory must exist): a run that finds them does
    # not autotune.
    "atcache": {"XLA_FLAGS": "--xla_gpu_experimental_autotuner_cache_dir=/tmp/tfrp_autotune "
                             "--xla_gpu_per_fusion_autotune_cache_dir=/tmp/tfrp_autotune"},
    # The switch's cache one flag at a time (XLA_FLAGS naming one, enable_recompute() adds
    # neither), or neither (its off switch): which flag costs step time.
    "atfusion": {"XLA_FLAGS": "--xla_gpu_per_fusion_autotune_cache_dir=/tmp/tfrp_at_fusion"},
    "atautotuner": {"XLA_FLAGS": "--xla_gpu_experimental_autotuner_cache_dir=/tmp/tfrp_at_tuner"},
    "atoff": {"TF_RELUPOOL_AUTOTUNE_CACHE": "0"},
    "async": {"TF_GPU_ALLOCATOR": "cuda_malloc_async"},
    # A physically smaller GPU (occupy_gpu): 4400 / 2300 MiB free, so that BFC's pool is about
    # 4 / 2 GiB after TensorFlow's reserve; trials with it must run alone on the GPU.
    "free4g": {"TFRP_GPU_FREE_MIB": "4400"},
    "free2g": {"TFRP_GPU_FREE_MIB": "2300"},
}
# Per model: (memory limit MiB, granularity, lowest, highest batch tried).
SEARCH = {"simple": (2048, 256, 256, 8192), "vgg": (2048, 128, 128, 4096),
          "resnet": (2048, 128, 128, 4096), "vgg16": (4096, 8, 8, 96),
          "resnet50": (4096, 8, 8, 128), "mobilenetv2": (4096, 8, 8, 256),
          "efficientnetb0": (4096, 8, 8, 256)}
# Batch of the unlimited measurement per model (as docs/xla.md's tables).
MEASURE_BATCH = {"simple": 1024, "vgg": 1024, "resnet": 1024, "vgg16": 32, "resnet50": 32,
                 "mobilenetv2": 32, "efficientnetb0": 32}
_OOM_BYTES = re.compile(r"(?:allocate|allocating)\s+([0-9.]+)\s*([KMG]i?B|B|bytes)", re.I)


def parse_variant(token):
    """"variant[+lever...]" -> (variant, [levers]); ValueError naming what is unknown."""
    base, *levers = token.split("+")
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {base!r} (choose from {', '.join(VARIANTS)})")
    bad = [lv for lv in levers if lv not in LEVERS]
    if bad:
        raise ValueError(f"unknown lever {', '.join(bad)} (choose from {', '.join(LEVERS)})")
    return base, levers


def lever_env(levers, base=None):
    """The environment of a worker with `levers` (XLA_FLAGS joined, others set)."""
    env = dict(os.environ if base is None else base)
    flags = [env["XLA_FLAGS"]] if env.get("XLA_FLAGS") else []
    for lv in levers:
        for key, value in LEVERS[lv].items():
            if key == "XLA_FLAGS":
                flags.append(value)
            else:
                env[key] = value
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def variant_label(token):
    base, levers = parse_variant(token)
    label = VARIANT_LABELS[base]
    return label + "".join(f" + {' '.join(f'{k}={v}' for k, v in LEVERS[lv].items())}"
                           for lv in levers)


def oom_bytes(message):
    """The size an out-of-memory message says could not be allocated, in bytes (None if none)."""
    m = _OOM_BYTES.search(message or "")
    if not m:
        return None
    unit = m.group(2).lower()
    scale = {"b": 1, "bytes": 1, "kib": 2 ** 10, "kb": 2 ** 10, "mib": 2 ** 20, "mb": 2 ** 20,
             "gib": 2 ** 30, "gb": 2 ** 30}[unit]
    return int(float(m.group(1)) * scale)


# ---------------------------------------------------------------------------------------------
# Worker: one process, one model and variant, one batch; with or without a memory limit.
# ---------------------------------------------------------------------------------------------
def occupy_gpu(free_mib):
    """Makes the GPU physically smaller for this process: allocates, through the CUDA driver and
    before TensorFlow starts, all of the device's free memory but `free_mib` MiB. Unlike a
    logical device's memory_limit, this binds every allocator (BFC, cuda_malloc_async, cuDNN's
    and XLA's own), as a smaller GPU would. Other processes on the GPU must not grow meanwhile.
    Returns (free MiB before, ballast MiB)."""
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()

    def check(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUDA driver error {rc}")
    check(cuda.cuInit(0), "cuInit")
    check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
    ballast = int(free.value - free_mib * MIB)
    if ballast <= 0:
        raise RuntimeError(f"only {free.value // MIB} MiB free, less than the {free_mib} asked")
    ptr = ctypes.c_uint64()
    check(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(ballast)), "cuMemAlloc")
    return int(free.value // MIB), int(ballast // MIB)


def _disallow_allocation_retry():
    """The lever noretry: TensorFlow's GPU allocator gives up at once when a request does not
    fit, instead of waiting up to 10 s for other work to free memory. TensorFlow has no public
    setter for GPUOptions.experimental.disallow_retry_on_allocation_failure; a study lever sets
    it where the eager context builds its GPU options."""
    from tensorflow.python.eager import context
    build = context.Context._compute_gpu_options

    def compute(self):
        options = build(self)
        options.experimental.disallow_retry_on_allocation_failure = True
        return options
    context.Context._compute_gpu_options = compute


def worker(args):
    base, _ = parse_variant(args.variant)
    free = int(os.environ.get("TFRP_GPU_FREE_MIB") or 0)
    if free:  # a physically smaller GPU instead of a logical device's limit
        os.environ.pop("TF_FORCE_GPU_ALLOW_GROWTH", None)
        ballast = occupy_gpu(free)
    limit = (args.limit or None) if not free else None
    cache = None
    if VARIANTS[base]["switch"]:  # what enable_recompute() sets, before TensorFlow's GPU starts
        devices.prepare_environment(memory_limit_mib=limit)
        from tf_relupool import autotune_cache
        cache = autotune_cache.install(args.autotune_cache)
    if os.environ.get("TFRP_NO_ALLOC_RETRY"):
        _disallow_allocation_retry()
    tf, dev = start_tensorflow(args.device, memory_limit_mib=limit,
                               inter_op_threads=args.inter_op_threads)
    meter = devices.StepMemory(tf, dev)
    result = {"batch": args.batch, "status": "fits", "device": dev.as_dict()}
    if free:
        result["gpu_free_mib"] = {"before": ballast[0], "ballast": ballast[1], "left": free}
    if cache is not None:
        result["autotune_cache"] = cache
    steps = []  # (seconds, peak above resident, allocator peak)
    try:
        model = build_model(tf, args.model, base)
        x, y = synthetic_batch(tf, args.batch, model=model)
        result["jit_compile"] = str(model.jit_compile)
        steps, error = measure_steps(meter, lambda: train_step(model, x, y, base), args.steps,
                                     tf.errors.OpError)
        if error is not None:
            raise error
    except tf.errors.OpError as e:
        message = str(e).strip().splitlines()[0][:400] if str(e).strip() else ""
        result["status"] = classify_error(type(e).__name__, message)
        result["message"] = f"{type(e).__name__}: {message}"
        result["failed_bytes"] = oom_bytes(message)
        result["failed_step"] = len(steps) + 1
    result["resident_bytes"] = (tf.config.experimental.get_memory_info(dev.name)["current"]
                                if meter.available else None)
    result.update(step_figures(steps, meter.available))
    if dev.kind == "cpu" and args.limit and result["status"] == "fits":
        peak = result.get("total_peak_bytes") or 0
        if peak > args.limit * MIB:  # the CPU has no memory_limit: compared, not enforced
            result["status"] = "oom"
            result["message"] = f"allocator peak {peak / MIB:.1f} MiB > {args.limit} MiB (CPU)"
    if base in ("default-switch",) or VARIANTS[base]["switch"]:
        try:
            from tf_relupool import keras_fusion
            result["fusion"] = keras_fusion.stats()
            if VARIANTS[base].get("bn_relu") or VARIANTS[base].get("activations"):
                from tf_relupool import segments
                result["bn_relu"] = segments.stats()
        except Exception as e:  # noqa: BLE001 - a description only
            result["fusion"] = {"error": str(e)}
    print_result(result)


# ---------------------------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------------------------
def _worker_cmd(args, model, token, batch, limit, steps):
    return [sys.executable, os.path.abspath(__file__), "--worker", "--device", args.device,
            "--models", model, "--variant", token, "--batch", str(batch),
            "--limit", str(limit or 0), "--steps", str(steps),
            "--inter-op-threads", str(args.inter_op_threads)]


def run_one(args, model, token, batch, limit, steps, timeout, log_name=None, runs=None):
    """A trial: --runs fresh worker processes in turn, as a user who runs the same script again.
    Under the switch they share one XLA autotune cache (the switch's own, docs/memory.md), empty
    before the first run, so a later run reuses what the first one autotuned. Its result is the
    last run's, with every run's status, first-step time and failed allocation in "runs"."""
    base, _ = parse_variant(token)
    cache = tempfile.mkdtemp(prefix="tfrp-autotune-") if VARIANTS[base]["switch"] else None
    runs = max(1, runs or args.runs) if cache else 1
    try:
        history = []
        for i in range(runs):
            name = log_name and (log_name if i == runs - 1 else f"{log_name}_run{i + 1}")
            r = _run_process(args, model, token, batch, limit, steps, timeout, name, cache)
            history.append({k: r.get(k) for k in ("status", "first_step_seconds", "seconds",
                                                  "failed_bytes")})
        if runs > 1:
            r["runs"] = history
        return r
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)


def _run_process(args, model, token, batch, limit, steps, timeout, log_name, cache):
    """One fresh worker process: its RESULT (status fits/oom/error), or a status of
    crash/timeout with the stderr's last line."""
    _, levers = parse_variant(token)
    env = trial_env(lever_env(levers)) if limit else lever_env(levers)
    if args.log_dir and log_name:
        env["TF_CPP_MIN_LOG_LEVEL"] = "0"  # the BFC allocator's dump at an out-of-memory error
    if getattr(args, "dump_dir", None) and log_name:
        env["XLA_FLAGS"] = " ".join(filter(None, [
            env.get("XLA_FLAGS"), f"--xla_dump_to={os.path.join(args.dump_dir, log_name)}",
            "--xla_dump_hlo_as_text", "--xla_dump_hlo_module_re=.*one_step_on.*"]))
    start = time.time()
    try:
        cmd = _worker_cmd(args, model, token, batch, limit, steps)
        if cache:
            cmd += ["--autotune-cache", cache]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        if args.log_dir and log_name:
            _save_log(args, log_name, e.stderr)
        return {"batch": batch, "status": "timeout", "seconds": round(time.time() - start, 1),
                "message": f"no answer within {timeout} s"}
    if args.log_dir and log_name:
        _save_log(args, log_name, proc.stderr)
    try:
        result = read_result(proc.stdout)
    except devices.DeviceError as e:
        raise ReportError(f"device: {e}")
    if result is None or proc.returncode != 0:
        err = tail(proc.stderr, 4000)
        last = ([l for l in err.splitlines() if l.strip()][-1:] or [""])[0][:300]
        status = "oom" if classify_error("", err) == "oom" else "crash"
        result = {"batch": batch, "status": status,
                  "message": f"exit status {proc.returncode}: {last}"}
    result["seconds"] = round(time.time() - start, 1)
    return result


def _save_log(args, name, text):
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    os.makedirs(args.log_dir, exist_ok=True)
    with open(os.path.join(args.log_dir, name + ".log"), "w") as f:
        f.write(text or "")


def kary_candidates(lo, hi, g, width):
    """Up to `width` multiples of g strictly between lo and hi, spread evenly."""
    slots = (hi - lo) // g - 1
    if slots <= 0:
        return []
    n = min(width, slots)
    picks = sorted({lo + g * max(1, min(slots, round((i + 1) * (slots + 1) / (n + 1))))
                    for i in range(n)})
    return [b for b in picks if lo < b < hi]


def update_bracket(lo, hi, results):
    """The new (lo, hi) from {batch: fits}: the largest fitting batch below the smallest failing
    one (a fit above a failure is not monotone: the failure wins, the fit is noted)."""
    fails = [b for b, ok in results.items() if not ok and b < hi]
    hi = min(fails + [hi])
    fits = [b for b, ok in results.items() if ok and b < hi]
    lo = max(fits + [lo])
    return lo, hi


class Search:
    """One k-ary largest-batch search for (model, variant) under a limit."""

    def __init__(self, model, token, limit, g, lowest, highest):
        self.model, self.token, self.limit, self.g = model, token, limit, g
        self.lo, self.hi = lowest - g, highest + g  # lo: fits (0: nothing yet), hi: fails
        self.trials = []

    def candidates(self, width):
        if self.hi - self.lo <= self.g:
            return []
        return kary_candidates(self.lo, self.hi, self.g, width)

    def record(self, results):
        self.trials.extend(results)
        self.lo, self.hi = update_bracket(self.lo, self.hi,
                                          {r["batch"]: r["status"] == "fits" for r in results})

    def answer(self):
        return max(self.lo, 0)


def main(argv=None):
    args = parse_args(argv)
    if args.render:  # a report again from its raw numbers
        with open(args.render) as f:
            print(render(json.load(f)))
        return 0
    if args.worker:
        worker(args)
        leave()
    t0 = time.time()
    lock = threading.Lock()

    def log(text):
        with lock:
            print(f"largest_batch.py [{time.time() - t0:5.0f} s] {text}", flush=True)

    report = {"args": {k: v for k, v in vars(args).items() if k not in ("worker",)},
              "measured": {}, "largest": {}, "meta": {}}
    try:
        if args.measure:
            for model in args.models:
                batch = args.measure_batch.get(model, MEASURE_BATCH[model])
                for rep in range(args.repeat):
                    for token in args.variants:
                        # one run (a first run, empty cache): its first step autotunes
                        r = run_one(args, model, token, batch, 0, 2 + max(args.rounds, args.reps),
                                    args.trial_timeout * 2, runs=1)
                        report["measured"].setdefault(model, {}).setdefault(token, []).append(r)
                        if not report["meta"] and "device" in r:
                            report["meta"]["device"] = r["device"]
                        log(f"{model} b{batch} {token}: {_measure_line(r)}")
        if args.trials:
            report["trials"] = run_trials(args, log)
        elif args.search:
            searches = []
            for model in args.models:
                limit, g, lowest, highest = SEARCH[model]
                limit = args.memory_limit.get(model, limit)
                for token in args.search_variants:
                    searches.append(Search(model, token, limit, g, lowest, highest))
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs)
            for round_no in range(1, args.max_rounds + 1):
                work = [(s, b) for s in searches for b in s.candidates(args.width)]
                if not work:
                    break
                log(f"round {round_no}: {len(work)} trials, {args.jobs} at a time")
                futures = {pool.submit(run_one, args, s.model, s.token, b, s.limit,
                                       args.trial_steps, args.trial_timeout,
                                       f"{s.model}_{s.token}_{b}"): (s, b) for s, b in work}
                done = {}
                for f in concurrent.futures.as_completed(futures):
                    s, b = futures[f]
                    r = f.result()
                    done.setdefault(id(s), (s, []))[1].append(r)
                    log(f"{s.model} {s.token} b{b} under {s.limit} MiB: {r['status']} "
                        f"({r['seconds']:.0f} s{_trial_detail(r)})")
                for s, results in done.values():
                    s.record(results)
            pool.shutdown()
            for s in searches:
                report["largest"].setdefault(s.model, {})[s.token] = {
                    "batch": s.answer(), "limit_mib": s.limit, "granularity": s.g,
                    "open": s.hi - s.lo > s.g, "trials": s.trials}
    except ReportError as e:
        print(f"largest_batch.py: error: {e}", file=sys.stderr)
        return 1
    if "device" not in report["meta"] and getattr(args, "seen_device", None):
        report["meta"]["device"] = args.seen_device
    report["meta"].update({"date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
                           "git_head": git_head(), "host": platform.node(),
                           "library_built": library_built(), "seconds": round(time.time() - t0)})
    md = render(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(md)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(report, f, indent=1)
    print()
    print(md)
    return 0


def run_trials(args, log):
    """--trials: every MODEL:VARIANT:BATCH under its model's limit, --jobs at a time."""
    work = []
    for item in filter(None, (t.strip() for t in args.trials.split(","))):
        model, token, batch = item.split(":")
        parse_variant(token)
        work.append((model, token, int(batch), args.memory_limit.get(model, SEARCH[model][0])))
    out = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_one, args, m, t, b, lim, args.trial_steps, args.trial_timeout,
                               f"{m}_{t}_{b}"): (m, t, b, lim) for m, t, b, lim in work}
        for f in concurrent.futures.as_completed(futures):
            m, t, b, lim = futures[f]
            r = f.result()
            r.update({"model": m, "variant": t, "limit_mib": lim})
            out.append(r)
            log(f"{m} {t} b{b} under {lim} MiB: {r['status']} ({r['seconds']:.0f} s"
                f"{_trial_detail(r)})")
            if "device" in r:
                args.seen_device = r["device"]
    return sorted(out, key=lambda r: (r["model"], r["variant"], r["batch"]))


def _mib(v):
    return f"{v / MIB:.0f}" if isinstance(v, (int, float)) else "n/a"


def _measure_line(r):
    if r["status"] != "fits":
        return f"{r['status']} ({r.get('message', '')})"
    return (f"first step {_mib(r.get('first_peak_bytes'))} MiB in "
            f"{r.get('first_step_seconds', 0):.0f} s, steady {_mib(r.get('steady_peak_bytes'))} "
            f"MiB, {1e3 * r.get('step_seconds', 0):.1f} ms/step, {r.get('fusion', '')}")


def _trial_detail(r):
    if r["status"] == "fits":
        return (f", first step {r.get('first_step_seconds', 0):.0f} s, total peak "
                f"{_mib(r.get('total_peak_bytes'))} MiB")
    if r.get("failed_bytes"):
        return f", step {r.get('failed_step')}: could not allocate {_mib(r['failed_bytes'])} MiB"
    return f", {r.get('message', '')[:160]}"


def _status_cell(r):
    """A trial's status; with several runs, the earlier runs' too ("fits (run 1: oom 3154 MiB,
    first step 139 s)")."""
    earlier = (r.get("runs") or [])[:-1]
    if not earlier:
        return r["status"]
    return r["status"] + " (" + "; ".join(
        f"run {i + 1}: {h['status']}" + (f" {_mib(h['failed_bytes'])} MiB" if h.get("failed_bytes")
                                          else "")
        + (f", first step {h['first_step_seconds']:.0f} s" if h.get("first_step_seconds") else "")
        for i, h in enumerate(earlier)) + ")"


def render(report):
    a, meta = report["args"], report["meta"]
    dev = meta.get("device") or {}
    lines = ["# Largest batch at Keras' default compile", "",
             f"{meta['date']}; {dev.get('name', '?')} ({dev.get('description', '?')}); checkout "
             f"{meta.get('git_head') or '?'}, op library built {meta.get('library_built') or '?'}"
             f"; {meta['seconds']} s.", "",
             "Keras training (`compile(SGD(0.01), SparseCategoricalCrossentropy)`, "
             "`train_on_batch`, synthetic data, fp32). Without a limit: first-step and steady "
             f"peaks above resident and the steady step time (median of {a['rounds']} steps "
             f"after 3), each variant in its own fresh process, variants in turn, {a['repeat']} "
             "process(es) each, medians. Largest batch: fresh processes whose GPU is a logical "
             "device with `memory_limit` (BFC allocator), "
             f"{a['trial_steps']} steps must train; trial limit {a['trial_timeout']} s.", ""]
    if report.get("trials"):
        lines += ["| model | variant | batch | limit MiB | status | first step s | total peak MiB "
                  "| steady peak MiB | failed allocation |", "|---|---|---|---|---|---|---|---|---|"]
        for r in report["trials"]:
            lines.append(f"| {r['model']} | {r['variant']} | {r['batch']} | {r['limit_mib']} | "
                         f"{_status_cell(r)} | {r.get('first_step_seconds') or 0:.0f} | "
                         f"{_mib(r.get('total_peak_bytes'))} | {_mib(r.get('steady_peak_bytes'))} | "
                         + (f"step {r.get('failed_step')}: {_mib(r['failed_bytes'])} MiB"
                            if r.get("failed_bytes") else (r.get("message") or "")[:100]) + " |")
        lines.append("")
    ref = a["variants"][0] if a["variants"] else None
    for model in a["models"]:
        measured = report["measured"].get(model, {})
        largest = report["largest"].get(model, {})
        tokens = list(dict.fromkeys(list(measured) + list(largest)))
        if not tokens:
            continue
        limit = next((v["limit_mib"] for v in largest.values()), None)
        header = ["variant", "first-step peak MiB", "steady peak MiB", "step ms",
                  f"speed vs {ref}", "first step s"]
        if largest:
            header += [f"largest batch under {limit} MiB", f"vs {ref}",
                       "slowest first step in trials (s)"]
        lines += [f"## {model}" + (f", batch {a['measure_batch'].get(model, MEASURE_BATCH[model])}"
                                    f" measured" if measured else ""), "",
                  "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        ref_t = devices.median_of(measured.get(ref, []), "step_seconds")
        ref_b = largest.get(ref, {}).get("batch")
        for token in tokens:
            runs = measured.get(token, [])
            t = devices.median_of(runs, "step_seconds")
            big = largest.get(token)
            first_slow = max((tr.get("first_step_seconds") or 0 for tr in big["trials"]
                              if tr["status"] == "fits"), default=None) if big else None
            cells = [variant_label(token), _mib(devices.median_of(runs, "first_peak_bytes")),
                     _mib(devices.median_of(runs, "steady_peak_bytes")),
                     f"{t * 1e3:.1f}" if t else "n/a",
                     f"{ref_t / t:.2f}x" if t and ref_t else "n/a",
                     f"{devices.median_of(runs, 'first_step_seconds'):.0f}"
                     if devices.median_of(runs, "first_step_seconds") else "n/a"]
            if largest:
                cells += [(f"{big['batch']}" + (" (open)" if big["open"] else "")) if big else "-",
                          f"{big['batch'] / ref_b:.2f}x" if big and ref_b else "n/a",
                          f"{first_slow:.0f}" if first_slow else "n/a"]
            lines.append("| " + " | ".join(cells) + " |")
        notes = []
        for token, big in largest.items():
            fails = sorted((tr for tr in big["trials"] if tr["status"] != "fits"),
                           key=lambda tr: tr["batch"])
            if fails:
                notes.append(f"- {token}: " + "; ".join(
                    f"{tr['batch']} {tr['status']}" + (
                        f" (step {tr.get('failed_step')}: {_mib(tr['failed_bytes'])} MiB)"
                        if tr.get("failed_bytes") else
                        (f" ({tr.get('message', '')[:120]})" if tr["status"] != "oom" else ""))
                    for tr in fails[:4]))
        if notes:
            lines += ["", "Smallest batches that did not fit:"] + notes
        lines.append("")
    return "\n".join(lines)


def _per_model(kind, convert=int):
    def parse(text):
        out = {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            model, _, value = item.partition("=")
            if model not in MODELS or not value:
                raise argparse.ArgumentTypeError(f"{kind}: expected MODEL=VALUE with a model of "
                                                 f"{', '.join(MODELS)}, got {item!r}")
            try:
                out[model] = convert(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{kind}: {value!r} is not a number")
        return out
    return parse


def _tokens(text):
    items = [t.strip() for t in text.split(",") if t.strip()]
    for t in items:
        try:
            parse_variant(t)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
    if not items:
        raise argparse.ArgumentTypeError("expected comma-separated variants")
    return items


def _models(text):
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [m for m in items if m not in MODELS]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown model(s) {bad} (choose from {', '.join(MODELS)})")
    return items


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", choices=devices.DEVICE_CHOICES, default="gpu")
    p.add_argument("--models", type=_models, default=["vgg16", "simple", "vgg"])
    p.add_argument("--variants", type=_tokens, default=["default", "default-switch", "stock"],
                   help="variants measured without a limit; the first is the reference "
                        "(default: default,default-switch,stock)")
    p.add_argument("--search-variants", type=_tokens, default=None,
                   help="variants searched under the limit (default: --variants)")
    p.add_argument("--memory-limit", type=_per_model("--memory-limit"), default={},
                   help="MODEL=MiB,... (defaults: vgg16 4096, resnet50 4096, others 2048)")
    p.add_argument("--measure-batch", type=_per_model("--measure-batch"), default={},
                   help="MODEL=BATCH,... of the unlimited measurement (defaults: 32 for the "
                        "224x224 models, 1024 for the CIFAR-10 ones)")
    p.add_argument("--no-measure", dest="measure", action="store_false")
    p.add_argument("--no-search", dest="search", action="store_false")
    p.add_argument("--repeat", type=int, default=1, help="processes per measured variant")
    p.add_argument("--reps", type=int, default=3, help="steady steps whose peak is taken")
    p.add_argument("--rounds", type=int, default=10, help="timed steady steps")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 4))
    p.add_argument("--width", type=int, default=3, help="batches each search tries per round")
    p.add_argument("--max-rounds", type=int, default=4)
    p.add_argument("--trial-steps", type=int, default=2)
    p.add_argument("--trial-timeout", type=int, default=240)
    p.add_argument("--runs", type=int, default=2,
                   help="processes per trial of a switched variant, in turn, sharing the "
                        "switch's XLA autotune cache (empty before the first): 2 answers for a "
                        "user who runs the script again; the last run decides")
    p.add_argument("--inter-op-threads", type=int, default=1)
    p.add_argument("--trials", default=None,
                   help="instead of searches: MODEL:VARIANT:BATCH,... trials run --jobs at a "
                        "time under each model's limit, printed as a table")
    p.add_argument("--dump-dir", default=None,
                   help="with --trials: XLA's dump of each trial's train step in DIR/<trial>")
    p.add_argument("--log-dir", default=None,
                   help="keep each trial's stderr here, with TensorFlow's log on (the BFC "
                        "allocator's dump at an out-of-memory error)")
    p.add_argument("--out", default=None, help="FILE.md (the raw numbers go beside it as .json)")
    p.add_argument("--render", default=None, metavar="FILE.json",
                   help="print the report of an earlier run from its raw numbers, and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--autotune-cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.search_variants is None:
        args.search_variants = list(args.variants)
    for name in ("repeat", "reps", "jobs", "width", "max_rounds", "trial_steps", "trial_timeout"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if args.worker:
        args.model = args.models[0]
    return args


if __name__ == "__main__":
    sys.exit(main())
