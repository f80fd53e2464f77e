"""What measuring a training step needs, shared by `python -m tf_relupool.measure` and the
benchmark scripts (benchmarks/harness.py and examples/devices.py re-export it). No TensorFlow
import at module level, and no import of tf_relupool: the benchmarks load this file without the
package's __init__ (which imports TensorFlow), so that their drivers never start TensorFlow.

- Devices (what examples/devices.py documents): DEVICE_CHOICES, DeviceError, Device,
  prepare_environment, cpu_description, setup, StepMemory: which device a step runs on,
  TensorFlow configured before it starts, and one step's peak above resident on its allocator.
- measure_steps / step_figures: timed steps between StepMemory's begin and end, and the
  figures a worker reports from them (first step, steady median, allocator peak).
- start_tensorflow: a worker's TensorFlow, configured, or DEVICE_ERROR and exit status 3.
- print_result / leave / read_result / run_worker: the worker protocol. A worker prints its
  answer as one line `RESULT <json>` on stdout, or `DEVICE_ERROR <message>` (exit status 3) when
  the device asked for cannot be used; the driver reads the last such line.
- bracket_and_bisect / largest_fitting / search_start: the largest batch for which a monotone
  `fits(batch)` holds, from a guess, with as few trials as bracketing and bisection need.
- classify_error / OOM_HINTS: "oom" for ResourceExhaustedError and for the cuDNN/cuBLAS errors
  that are out-of-memory in disguise.
- trial_env / run_fresh: one fresh process per trial (a memory_limit must be set before
  TensorFlow starts, and an OOM can leave a process unusable), its status read from its exit.
- library_built: when the op library was built.
- xla_allocations / xla_temp_bytes / conv_scratch: what an XLA executable allocates, read from an
  `--xla_dump_to` directory's files (benchmarks/xla_buffers.py prints them; the tests read the
  preallocated temp buffer).
"""
import datetime
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time

MIB = 2.0 ** 20
DEVICE_CHOICES = ("auto", "cpu", "gpu")
# Messages of errors that are out-of-memory in disguise (cuDNN or cuBLAS failing to allocate).
OOM_HINTS = ("out of memory", "oom when allocating", "resource exhausted", "resourceexhausted",
             "failed to get convolution algorithm", "cudnn_status_alloc_failed",
             "cudnn_status_not_initialized", "cublas_status_alloc_failed",
             "failed to allocate", "dnn library initialization failed",
             "dst tensor is not initialized", "failed copying input tensor")
RESULT = "RESULT "
DEVICE_ERROR = "DEVICE_ERROR "


# ---------------------------------------------------------------------------------------------
# Devices: which one a step runs on, and how much memory it takes there.
# ---------------------------------------------------------------------------------------------
class DeviceError(RuntimeError):
    """The requested device cannot be used (for example --device gpu with no GPU visible)."""


class Device:
    """The device measured: kind ("cpu"/"gpu"), allocator name ("CPU:0"/"GPU:0"), description."""

    def __init__(self, kind, description, memory_limit_mib=None, grappler=None):
        self.kind = kind
        self.name = "GPU:0" if kind == "gpu" else "CPU:0"
        self.description = description
        self.memory_limit_mib = memory_limit_mib
        self.grappler = grappler or {}

    def label(self):
        """One line saying what is measured, e.g. "GPU:0 (NVIDIA H200, compute capability 9.0)"."""
        return f"{self.name} ({self.description})"

    def as_dict(self):
        return {"kind": self.kind, "name": self.name, "description": self.description,
                "memory_limit_mib": self.memory_limit_mib, "grappler": self.grappler}


def prepare_environment(memory_limit_mib=None, cudnn_workspace_mib=None, cudnn_autotune=None):
    """Sets what TensorFlow reads when it starts. Call before TensorFlow is imported.

    - TF_CPU_ALLOCATOR_USE_BFC=true (unless already set): allocator statistics on the CPU.
    - With a GPU memory limit: TF_FORCE_GPU_ALLOW_GROWTH removed (growth and a fixed limit are
      alternatives; with the variable set the limit is not what the process gets).
    - TF_CUDNN_WORKSPACE_LIMIT_IN_MB when given (0: cuDNN algorithms without workspace).
    - TF_CUDNN_USE_AUTOTUNE=0 when cudnn_autotune is False (cuDNN's heuristic choice: no timing
      of candidate algorithms, and none of the scratch buffers it needs, in the first step).
    """
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if memory_limit_mib:
        os.environ.pop("TF_FORCE_GPU_ALLOW_GROWTH", None)
    if cudnn_workspace_mib is not None:
        os.environ["TF_CUDNN_WORKSPACE_LIMIT_IN_MB"] = str(int(cudnn_workspace_mib))
    if cudnn_autotune is False:
        os.environ["TF_CUDNN_USE_AUTOTUNE"] = "0"
    return os.environ


def cpu_description():
    """The CPU's model name (from /proc/cpuinfo where there is one) and core count."""
    import platform
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def _gpu_description(tf, gpu):
    try:
        details = tf.config.experimental.get_device_details(gpu)
    except Exception:  # noqa: BLE001 - a description only
        details = {}
    text = details.get("device_name", gpu.name)
    cc = details.get("compute_capability")
    if cc:
        text += f", compute capability {cc[0]}.{cc[1]}"
    return text


def setup(device="auto", memory_limit_mib=None, layout_optimizer=None, remapper=None,
          inter_op_threads=None, deterministic=False):
    """Imports TensorFlow and configures it; returns (tf, Device).

    device: "auto" (the first GPU when TensorFlow sees one, else the CPU), "gpu" (DeviceError
    when there is none) or "cpu" (GPUs hidden from TensorFlow). Only the first GPU is used.
    memory_limit_mib: GPU only, the logical device's memory_limit (TensorFlow must not have
    initialised the GPU yet). layout_optimizer, remapper: None leaves Grappler's default
    (on), False turns that optimizer off. inter_op_threads: None/0 keeps TensorFlow's default.
    """
    if device not in DEVICE_CHOICES:
        raise DeviceError(f"unknown device {device!r} (choose from {', '.join(DEVICE_CHOICES)})")
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    if device == "gpu" and not gpus:
        raise DeviceError("no GPU visible to TensorFlow (tf.config.list_physical_devices('GPU') "
                          "is empty); use --device cpu or auto")
    kind = "gpu" if gpus and device != "cpu" else "cpu"
    if kind == "gpu":
        tf.config.set_visible_devices(gpus[:1], "GPU")
        if memory_limit_mib:
            tf.config.set_logical_device_configuration(
                gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=int(memory_limit_mib))])
        description = _gpu_description(tf, gpus[0])
    else:
        if gpus:
            tf.config.set_visible_devices([], "GPU")
        description = cpu_description()
    options = {}
    if layout_optimizer is not None:
        options["layout_optimizer"] = bool(layout_optimizer)
    if remapper is not None:
        options["remapping"] = bool(remapper)
    if options:
        tf.config.optimizer.set_experimental_options(options)
    if inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    grappler = {"layout_optimizer": "off" if layout_optimizer is False else "on",
                "remapper": "off" if remapper is False else "on"}
    return tf, Device(kind, description, memory_limit_mib if kind == "gpu" else None, grappler)


class StepMemory:
    """Peak bytes one step allocates on a device, above what was resident before it.

        meter = StepMemory(tf, dev)
        meter.begin(); run_the_step(); peak = meter.end()

    `available` is False (and `reason` says why) when the allocator keeps no statistics, e.g. a
    CPU run started without TF_CPU_ALLOCATOR_USE_BFC=true; then end() returns None.
    """

    def __init__(self, tf, dev):
        self.tf, self.name = tf, dev.name
        self.reason = None
        try:
            tf.config.experimental.get_memory_info(self.name)
            self.available = True
        except ValueError as e:
            self.available = False
            self.reason = str(e).strip().splitlines()[0] if str(e).strip() else "no statistics"
        self.before = 0

    def begin(self):
        if self.available:
            self.tf.config.experimental.reset_memory_stats(self.name)
            self.before = self.tf.config.experimental.get_memory_info(self.name)["current"]

    def end(self):
        """The step's peak above resident (bytes); call after the step has finished."""
        if not self.available:
            return None
        return self.tf.config.experimental.get_memory_info(self.name)["peak"] - self.before

    def total_peak(self):
        """The allocator's peak bytes in use since begin(), resident bytes included."""
        if not self.available:
            return None
        return self.tf.config.experimental.get_memory_info(self.name)["peak"]


def measure_steps(meter, step, n, errors=()):
    """Runs step() n times, each between meter.begin() and meter.end() (a StepMemory):
    ([(seconds, peak above resident, allocator peak)] of the steps that finished, the exception
    of type `errors` that stopped them, or None)."""
    steps = []
    try:
        for _ in range(n):
            meter.begin()
            start = time.perf_counter()
            step()
            steps.append((time.perf_counter() - start, meter.end(), meter.total_peak()))
    except errors as e:
        return steps, e
    return steps, None


def median_of(runs, key):
    """The median of `key` over the trial results in `runs` that fit and have it (fresh processes
    of one variant), or None."""
    values = [r[key] for r in runs if r.get("status") == "fits" and r.get(key) is not None]
    return statistics.median(values) if values else None


def step_figures(steps, available=True):
    """A worker's figures from measure_steps' steps: the first step's time and peak above
    resident, the allocator's peak over all steps, and the steady steps' median peak (the steps
    after the first) and median time (from the third, the second can still settle). Peaks are
    None when the allocator keeps no statistics (`available` False)."""
    out = {}
    if steps:
        out["first_step_seconds"] = steps[0][0]
        out["first_peak_bytes"] = steps[0][1]
        out["total_peak_bytes"] = max(s[2] for s in steps) if available else None
        later = steps[1:]
        if later:
            out["steady_peak_bytes"] = (statistics.median(s[1] for s in later) if available
                                        else None)
            timed = later[1:] or later
            out["step_seconds"] = statistics.median(s[0] for s in timed)
            out["step_seconds_all"] = [s[0] for s in timed]
    return out


# ---------------------------------------------------------------------------------------------
# Worker processes.
# ---------------------------------------------------------------------------------------------
def start_tensorflow(device, memory_limit_mib=None, layout_optimizer=None, remapper=None,
                     cudnn_workspace_mib=None, cudnn_autotune=None, inter_op_threads=None):
    """Imports and configures TensorFlow in a worker (prepare_environment, then setup):
    (tf, Device). When `device` cannot be used the worker prints DEVICE_ERROR and exits with
    status 3 (read_result raises the error in the driver)."""
    prepare_environment(memory_limit_mib=memory_limit_mib, cudnn_workspace_mib=cudnn_workspace_mib,
                        cudnn_autotune=cudnn_autotune)
    try:
        return setup(device, memory_limit_mib=memory_limit_mib, layout_optimizer=layout_optimizer,
                     remapper=remapper, inter_op_threads=inter_op_threads)
    except DeviceError as e:
        print(f"{DEVICE_ERROR}{e}", flush=True)
        sys.exit(3)


def print_result(value):
    """A worker's answer: one line on stdout, RESULT and `value` as JSON."""
    print(RESULT + json.dumps(value), flush=True)


def leave():
    """Ends a worker whose answer is printed, without TensorFlow's teardown (after an
    out-of-memory error on a GPU it can take long, and nothing is left to clean up)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def read_result(stdout):
    """A worker's answer from its stdout: the value of its last RESULT line, None when it printed
    none; DeviceError when its last word was DEVICE_ERROR instead."""
    lines = [l for l in stdout.splitlines() if l.startswith((RESULT, DEVICE_ERROR))]
    if not lines:
        return None
    if lines[-1].startswith(DEVICE_ERROR):
        raise DeviceError(lines[-1][len(DEVICE_ERROR):])
    return json.loads(lines[-1][len(RESULT):])


def run_worker(cmd, timeout=None):
    """Runs a worker process to its end: (its answer, or None when it exited with an error status
    or printed none; the CompletedProcess, for the caller's message). subprocess.TimeoutExpired
    after `timeout` seconds; DeviceError as read_result raises it."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    answer = read_result(proc.stdout)
    return (answer if proc.returncode == 0 else None), proc


# ---------------------------------------------------------------------------------------------
# The largest-batch search.
# ---------------------------------------------------------------------------------------------
def round_down(value, granularity):
    return (int(value) // granularity) * granularity


def bracket_and_bisect(fits, start, up, down, middle, narrow):
    """The largest batch b with fits(b), assuming that fits is monotone (True up to some batch,
    False above), by a search policy: from `start`, up(lo) (while fits holds) or down(hi) (while
    it does not) names the next batch to try until the answer is bracketed, then middle(lo, hi)
    splits the bracket until narrow(lo, hi). up() returning None: lo is the answer; down()
    returning None: nothing fits (0). fits() is called at most once per batch size.
    Returns (batch, {batch: fits(batch)})."""
    seen = {}

    def check(b):
        if b not in seen:
            seen[b] = bool(fits(b))
        return seen[b]

    lo, hi = (start, None) if check(start) else (None, start)
    while lo is None or hi is None:  # up while everything tried fits, else down
        b = up(lo) if hi is None else down(hi)
        if b is None:
            return (lo if hi is None else 0), seen
        if check(b):
            lo = b
        else:
            hi = b
    while not narrow(lo, hi):
        mid = middle(lo, hi)
        if check(mid):
            lo = mid
        else:
            hi = mid
    return lo, seen


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
    start = min(highest, max(g, round_down(start, g)))
    step = max(g, round_down(step if step else start, g))

    def up(lo):
        nonlocal step
        if lo == highest:
            return None
        b, step = min(highest, lo + step), step * 2
        return b

    def down(hi):
        nonlocal step
        if hi == g:
            return None
        # Down by the step, but never below half of the failing batch: from a guess
        # without a measurement (step = start) this halves.
        b, step = max(g, hi - step, round_down(hi // 2, g)), step * 2
        return b

    return bracket_and_bisect(fits, start, up, down,
                              middle=lambda lo, hi: lo + ((hi - lo) // (2 * g)) * g,
                              narrow=lambda lo, hi: hi - lo <= g)


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


# ---------------------------------------------------------------------------------------------
# Trials: out-of-memory errors, fresh processes; where the op library comes from.
# ---------------------------------------------------------------------------------------------
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


def library_built():
    """When the op library the workers load (tf_relupool's _relu_max_pool_ops.so) was built,
    "YYYY-MM-DD HH:MM", found without importing it; None when there is none."""
    spec = importlib.util.find_spec("tf_relupool")
    if spec and spec.origin:
        so = os.path.join(os.path.dirname(spec.origin), "_relu_max_pool_ops.so")
        if os.path.exists(so):
            return f"{datetime.datetime.fromtimestamp(os.path.getmtime(so)):%Y-%m-%d %H:%M}"
    return None


# ---------------------------------------------------------------------------------------------
# What an XLA executable allocates: its `--xla_dump_to` files.
# ---------------------------------------------------------------------------------------------
_ALLOC = re.compile(r"^allocation (\d+): size (\d+), (.*?):?\s*$")
_CONV = re.compile(r"^\s*(\S+) = \((.*?)\) custom-call\(.*custom_call_target=\"(__cudnn\$conv[^\"]*)\"")
_U8 = re.compile(r"u8\[(\d+)\]")


def _matches(path, pattern):
    """The matches of `pattern` at the start of each line of the text file `path`."""
    with open(path) as f:
        return [m for m in map(pattern.match, f) if m]


def xla_allocations(path):
    """[(index, size, kind text)] of a *buffer-assignment.txt file; the preallocated temp buffer
    (one contiguous allocation per run) has "preallocated-temp" in its kind."""
    return [(int(m.group(1)), int(m.group(2)), m.group(3)) for m in _matches(path, _ALLOC)]


def xla_temp_bytes(dump, name_contains=""):
    """The largest preallocated temp buffer of the modules dumped under `dump` (an
    `--xla_dump_to` folder) whose buffer-assignment file's name contains `name_contains`, or None
    where there is none (no such folder, no XLA module)."""
    if not dump or not os.path.isdir(dump):
        return None
    sizes = [size for name in os.listdir(dump)
             if name_contains in name and name.endswith("buffer-assignment.txt")
             for _, size, kind in xla_allocations(os.path.join(dump, name))
             if "preallocated-temp" in kind]
    return max(sizes) if sizes else None


def conv_scratch(path):
    """[(instruction, target, scratch bytes)] of the cuDNN convolutions of an HLO text file: the
    u8[N] element of a `__cudnn$conv...` custom call's result tuple, which the autotuner sized
    and which lives inside the temp buffer."""
    out = []
    for m in _matches(path, _CONV):
        sizes = _U8.findall(m.group(2))
        out.append((m.group(1), m.group(3), int(sizes[-1]) if sizes else 0))
    return out
