"""What the benchmark scripts share: the largest-batch search, telling out-of-memory from other
failures, fresh worker processes, and where a report's commit comes from. No TensorFlow import:
the drivers never start TensorFlow themselves, their worker processes do.

- largest_fitting / search_start: the largest batch (a multiple of a granularity) for which a
  monotone `fits(batch)` holds, from a guess, with as few trials as bracketing and bisection need.
- classify_error / OOM_HINTS: "oom" for ResourceExhaustedError and for the cuDNN/cuBLAS errors
  that are out-of-memory in disguise.
- trial_env / run_fresh: one fresh process per trial (a memory_limit must be set before
  TensorFlow starts, and an OOM can leave a process unusable), its status read from its exit.
- git_head: the commit a report was measured at.
"""
import os
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 2.0 ** 20
# Messages of errors that are out-of-memory in disguise (cuDNN or cuBLAS failing to allocate).
OOM_HINTS = ("out of memory", "oom when allocating", "resource exhausted", "resourceexhausted",
             "failed to get convolution algorithm", "cudnn_status_alloc_failed",
             "cudnn_status_not_initialized", "cublas_status_alloc_failed",
             "failed to allocate", "dnn library initialization failed",
             "dst tensor is not initialized", "failed copying input tensor")


def round_down(value, granularity):
    return (int(value) // granularity) * granularity


def largest_fitting(fits, start, granularity=64, step=None, highest=1 << 16):
    """The largest multiple of `granularity` b <= `highest` with fits(b), assuming that fits is
    monotone (True up to some batch, False above); 0 when even `granularity` does not fit.

    Starts at `start` (rounded down to the granularity), moves up while fits() holds (or down
    while it does not, never below half the batch that failed) by `step` (default: `start`,
    i.e. doubling, or halving), doubling the step each time, until the answer is bracketed;
    then bisects the bracket down to one granularity.
    fits() is called at most once per batch size. Returns (batch, {batch: fits(batch)})."""
    g = int(granularity)
    if g <= 0:
        raise ValueError(f"granularity must be > 0, got {granularity}")
    highest = max(g, round_down(highest, g))
    seen = {}

    def check(b):
        if b not in seen:
            seen[b] = bool(fits(b))
        return seen[b]

    b = min(highest, max(g, round_down(start, g)))
    step = max(g, round_down(step if step else b, g))
    if check(b):
        lo, hi = b, None
        while hi is None:
            if lo == highest:
                return lo, seen
            b = min(highest, lo + step)
            step *= 2
            if check(b):
                lo = b
            else:
                hi = b
    else:
        lo, hi = None, b
        while lo is None:
            if hi == g:
                return 0, seen
            # Down by the step, but never below half of the failing batch: from a guess
            # without a measurement (step = start) this halves.
            b = max(g, hi - step, round_down(hi // 2, g))
            step *= 2
            if check(b):
                lo = b
            else:
                hi = b
    while hi - lo > g:
        mid = lo + ((hi - lo) // (2 * g)) * g
        if check(mid):
            lo = mid
        else:
            hi = mid
    return lo, seen


def search_start(peaks, limit_mib, granularity, fallback):
    """(start, step) for largest_fitting from measured peaks {batch: peak bytes}: the batch whose
    peak, scaled linearly from the largest measured batch, is 90% of the limit; an eighth of it as
    the first step. `fallback` (and doubling) when nothing was measured."""
    if not peaks:
        return fallback, fallback
    batch = max(peaks)
    per_sample = peaks[batch] / batch
    if per_sample <= 0:
        return fallback, fallback
    start = max(granularity, round_down(0.9 * limit_mib * MIB / per_sample, granularity))
    return start, max(granularity, round_down(start / 8, granularity))


def classify_error(exc_type, message):
    """'oom' for out-of-memory errors (also cuDNN/cuBLAS allocation failures), else 'error'."""
    text = f"{exc_type} {message}".lower()
    if exc_type == "ResourceExhaustedError" or any(h in text for h in OOM_HINTS):
        return "oom"
    return "error"


def tail(text, n=3000):
    return text[-n:] if text else ""


def trial_env(base=None):
    """The environment of a process that sets a GPU memory_limit: no TF_FORCE_GPU_ALLOW_GROWTH
    (growth and a fixed limit are alternatives), TensorFlow's INFO/WARNING lines off (an OOM
    dumps the allocator's state at WARNING)."""
    env = dict(os.environ if base is None else base)
    env.pop("TF_FORCE_GPU_ALLOW_GROWTH", None)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def run_fresh(cmd, timeout, env=None, cwd=None):
    """Runs one trial process: {"status": "fits"|"oom"|"crash"|"timeout", "seconds",
    "message" (the last line of stderr when it failed), "stdout"}."""
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=trial_env() if env is None else env, cwd=cwd)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": round(time.time() - start, 1),
                "message": f"no answer within {timeout} s", "stdout": ""}
    out = {"seconds": round(time.time() - start, 1), "stdout": proc.stdout}
    if proc.returncode == 0:
        out["status"] = "fits"
    else:
        err = tail(proc.stderr, 4000)
        last = [l for l in err.splitlines() if l.strip()][-1:] or [""]
        out["status"] = "oom" if classify_error("", err) == "oom" else "crash"
        out["message"] = f"exit status {proc.returncode}: {last[0][:300]}"
    return out


def git_head():
    """The short commit of the checkout the benchmarks run from, or None outside git."""
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
