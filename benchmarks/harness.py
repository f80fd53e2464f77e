"""What the benchmark scripts share: the Keras models and variants they train, the worker
processes that train them, the largest-batch search, telling out-of-memory from other failures,
and where a report's commit and op library come from. No TensorFlow import: the drivers never
start TensorFlow themselves, their worker processes do.

- MODELS / VARIANTS / VARIANT_LABELS, build_model, synthetic_batch, train_step: the models of
  examples/models.py and keras.applications, stock or fused, compiled for SGD training, and one
  training step of a variant (the switch on during a switched variant's steps only).
- start_tensorflow: a worker's TensorFlow, configured before it starts (examples/devices.py).
- print_result / read_result / run_worker: the worker protocol. A worker prints its answer as one
  line `RESULT <json>` on stdout, or `DEVICE_ERROR <message>` (exit status 3) when the device
  asked for cannot be used; the driver reads the last such line.
- probe_device / detect_device: the device TensorFlow would measure here, asked in a subprocess
  (`python harness.py DEVICE` is that subprocess).
- bracket_and_bisect / largest_fitting / search_start: the largest batch for which a monotone
  `fits(batch)` holds, from a guess, with as few trials as bracketing and bisection need.
- classify_error / OOM_HINTS: "oom" for ResourceExhaustedError and for the cuDNN/cuBLAS errors
  that are out-of-memory in disguise.
- trial_env / run_fresh: one fresh process per trial (a memory_limit must be set before
  TensorFlow starts, and an OOM can leave a process unusable), its status read from its exit.
- git_head / library_built: the commit a report was measured at, when the op library was built.

Importing this module puts examples/ on sys.path (devices.py, models.py).
"""
import contextlib
import datetime
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import devices  # noqa: E402  (examples/devices.py; no TensorFlow import)

MIB = 2.0 ** 20
# Messages of errors that are out-of-memory in disguise (cuDNN or cuBLAS failing to allocate).
OOM_HINTS = ("out of memory", "oom when allocating", "resource exhausted", "resourceexhausted",
             "failed to get convolution algorithm", "cudnn_status_alloc_failed",
             "cudnn_status_not_initialized", "cublas_status_alloc_failed",
             "failed to allocate", "dnn library initialization failed",
             "dst tensor is not initialized", "failed copying input tensor")
RESULT = "RESULT "
DEVICE_ERROR = "DEVICE_ERROR "

# examples/models.py's CIFAR-10 models (32x32x3, 10 classes), then keras.applications models
# at 224x224x3 with 1000 classes (weights=None), as users train them.
MODELS = ("simple", "vgg", "resnet", "vgg16", "resnet50")
APPLICATIONS = {"vgg16": "VGG16", "resnet50": "ResNet50"}
# Each variant: the model (stock, or rewrite_model(keep=...)), the switch during its steps, how
# it is compiled (jit_compile=False, or Keras' default "auto": XLA whenever a GPU is visible),
# and whether its layers are built under keras.RematScope(mode="activations").
VARIANTS = {
    "stock": {"keep": None, "switch": None, "jit": False},
    "argmax": {"keep": "argmax", "switch": None, "jit": False},
    "input": {"keep": "input", "switch": None, "jit": False},
    "switch": {"keep": None, "switch": "argmax", "jit": False},
    "default": {"keep": None, "switch": None, "jit": "auto"},
    "default-switch": {"keep": None, "switch": "argmax", "jit": "auto"},
    "default-layer": {"keep": "argmax", "switch": None, "jit": "auto"},
    "default-remat": {"keep": None, "switch": None, "jit": "auto", "remat": True},
}
VARIANT_LABELS = {"stock": "stock", "argmax": "fused argmax", "input": "fused input",
                  "switch": "stock + enable_recompute()",
                  "default": "stock, Keras default compile",
                  "default-switch": "stock + enable_recompute(), Keras default compile",
                  "default-layer": "rewrite_model (ReluMaxPool2D), Keras default compile",
                  "default-remat": "keras.RematScope(activations), Keras default compile"}
SWITCHED = {v: spec["switch"] for v, spec in VARIANTS.items() if spec["switch"]}


class ReportError(RuntimeError):
    """A worker failed in a way that makes the report meaningless (message for the user)."""


# ---------------------------------------------------------------------------------------------
# The models (worker side: TensorFlow is imported by the caller).
# ---------------------------------------------------------------------------------------------
def build_model(tf, model_name, variant, seed=0, policy=None):
    """The Keras model `model_name` for `variant` (VARIANTS), compiled for training with SGD;
    same initial weights for every variant. `policy`: a Keras dtype policy ("mixed_bfloat16").
    tf_relupool is imported only for a fused variant."""
    import keras

    keras.utils.set_random_seed(seed)
    if policy:
        keras.config.set_dtype_policy(policy)
    spec = VARIANTS[variant]
    scope = keras.RematScope(mode="activations") if spec.get("remat") else contextlib.nullcontext()
    with scope:
        if model_name in APPLICATIONS:
            model = getattr(keras.applications, APPLICATIONS[model_name])(
                weights=None, input_shape=(224, 224, 3), classes=1000)
        else:
            import models
            model = models.build(model_name)
    if spec["keep"] is not None:
        import tf_relupool
        model = tf_relupool.rewrite_model(model, keep=spec["keep"])  # fused, whatever the switch
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=spec["jit"])
    return model


def synthetic_batch(tf, batch, seed=0, model=None, seeds=None):
    """Images in [0, 1) and labels in [0, classes), created on the default device (GPU:0 if
    any), shaped for `model` (CIFAR-10's 32x32x3 and 10 classes without one). `seeds`: the
    stateless seeds of the images and of the labels (default [seed, batch], [seed + 1, batch])."""
    shape = tuple(model.input_shape[1:]) if model is not None else (32, 32, 3)
    classes = int(model.output_shape[-1]) if model is not None else 10
    x_seed, y_seed = seeds or ([seed, batch], [seed + 1, batch])
    x = tf.random.stateless_uniform((batch,) + shape, seed=x_seed)
    y = tf.random.stateless_uniform((batch,), seed=y_seed, minval=0, maxval=classes,
                                    dtype=tf.int32)
    return x, y


def train_step(model, x, y, variant="stock"):
    """One training step; waits for it (numpy conversion). The switch is on during the steps of
    a SWITCHED variant only: the Grappler pass reads it when TensorFlow optimizes a function
    (its first call), so the other variants' functions stay stock."""
    keep = SWITCHED.get(variant)
    if keep is None:
        return float(model.train_on_batch(x, y))
    import tf_relupool
    with tf_relupool.recompute(keep):
        return float(model.train_on_batch(x, y))


# ---------------------------------------------------------------------------------------------
# Worker processes.
# ---------------------------------------------------------------------------------------------
def start_tensorflow(device, memory_limit_mib=None, layout_optimizer=None, remapper=None,
                     cudnn_workspace_mib=None, cudnn_autotune=None, inter_op_threads=None):
    """Imports and configures TensorFlow in a worker (devices.prepare_environment, then
    devices.setup): (tf, devices.Device). When `device` cannot be used the worker prints
    DEVICE_ERROR and exits with status 3 (read_result raises the error in the driver)."""
    devices.prepare_environment(memory_limit_mib=memory_limit_mib,
                                cudnn_workspace_mib=cudnn_workspace_mib,
                                cudnn_autotune=cudnn_autotune)
    try:
        return devices.setup(device, memory_limit_mib=memory_limit_mib,
                             layout_optimizer=layout_optimizer, remapper=remapper,
                             inter_op_threads=inter_op_threads)
    except devices.DeviceError as e:
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
    none; devices.DeviceError when its last word was DEVICE_ERROR instead."""
    lines = [l for l in stdout.splitlines() if l.startswith((RESULT, DEVICE_ERROR))]
    if not lines:
        return None
    if lines[-1].startswith(DEVICE_ERROR):
        raise devices.DeviceError(lines[-1][len(DEVICE_ERROR):])
    return json.loads(lines[-1][len(RESULT):])


def run_worker(cmd, timeout=None):
    """Runs a worker process to its end: (its answer, or None when it exited with an error status
    or printed none; the CompletedProcess, for the caller's message). subprocess.TimeoutExpired
    after `timeout` seconds; devices.DeviceError as read_result raises it."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    answer = read_result(proc.stdout)
    return (answer if proc.returncode == 0 else None), proc


def probe_device(device="auto", timeout=300):
    """The device a worker measures here ({"kind", "name", "description", ...}), by asking
    TensorFlow in a subprocess (so that this process never initialises TensorFlow)."""
    result, proc = run_worker([sys.executable, os.path.abspath(__file__), device], timeout)
    if result is None:
        raise ReportError(f"the device probe failed (exit {proc.returncode}): "
                          f"{tail(proc.stderr, 2000)}")
    return result


def detect_device():
    """"gpu" when TensorFlow sees a GPU here, else "cpu". Without NVIDIA device files TensorFlow
    cannot see one, and TensorFlow is not started at all."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return "cpu"
    return probe_device("auto")["kind"]


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
# Trials: out-of-memory errors, fresh processes; where a report comes from.
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


def git_head():
    """The short commit of the checkout the benchmarks run from, or None outside git."""
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def library_built():
    """When the op library the workers load (tf_relupool's _relu_max_pool_ops.so) was built,
    "YYYY-MM-DD HH:MM", found without importing it; None when there is none."""
    spec = importlib.util.find_spec("tf_relupool")
    if spec and spec.origin:
        so = os.path.join(os.path.dirname(spec.origin), "_relu_max_pool_ops.so")
        if os.path.exists(so):
            return f"{datetime.datetime.fromtimestamp(os.path.getmtime(so)):%Y-%m-%d %H:%M}"
    return None


if __name__ == "__main__":  # probe_device's subprocess: python harness.py auto|cpu|gpu
    _, dev = start_tensorflow(sys.argv[1])
    print_result(dev.as_dict())
    leave()
