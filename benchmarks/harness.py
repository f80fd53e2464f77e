"""What the benchmark scripts share: the Keras models and variants they train, the worker
processes that train them, the largest-batch search, telling out-of-memory from other failures,
and where a report's commit and op library come from. No TensorFlow import: the drivers never
start TensorFlow themselves, their worker processes do.

Defined here:
- MODELS / VARIANTS / VARIANT_LABELS, build_model, synthetic_batch, train_step: the models of
  tf_relupool/_example_models.py and keras.applications, stock or fused, compiled for SGD
  training, and one training step of a variant (the switch on during a switched variant's steps
  only).
- probe_device / detect_device: the device TensorFlow would measure here, asked in a subprocess
  (`python harness.py DEVICE` is that subprocess).
- git_head: the commit a report was measured at.

Re-exported from the package's tf_relupool/_harness.py (one copy, which `python -m
tf_relupool.measure` uses where the package is installed; its docstring has the details), loaded
without tf_relupool's __init__ (load_harness):
- start_tensorflow: a worker's TensorFlow, configured before it starts.
- print_result / leave / read_result / run_worker: the worker protocol (`RESULT <json>` or
  `DEVICE_ERROR <message>` with exit status 3, the last such line read by the driver).
- bracket_and_bisect / largest_fitting / search_start / round_down: the largest-batch search.
- classify_error / OOM_HINTS: "oom" for out-of-memory errors, also in disguise.
- trial_env / run_fresh / tail: one fresh process per trial, its status read from its exit.
- library_built: when the op library was built.
- measure_steps / step_figures: timed steps under a StepMemory, and a worker's figures of them.
- xla_allocations / conv_scratch: what an XLA executable allocates, from its dump's files.

- devices: that module itself, under the name the scripts use for its device part
  (DEVICE_CHOICES, DeviceError, Device, prepare_environment, setup, StepMemory,
  cpu_description), as examples/devices.py re-exports it.
"""
import contextlib
import glob
import importlib
import importlib.util
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def load_harness():
    """tf_relupool._harness, without importing the package (its __init__ imports TensorFlow):
    the package's own module once tf_relupool is imported, else the file of the tf_relupool that
    Python would import (installed, or on PYTHONPATH), else this checkout's."""
    name = "tf_relupool._harness"
    if name in sys.modules:
        return sys.modules[name]
    if "tf_relupool" in sys.modules:
        return importlib.import_module(name)
    spec = importlib.util.find_spec("tf_relupool")
    where = list(spec.submodule_search_locations or []) if spec else []
    paths = [os.path.join(d, "_harness.py") for d in where + [os.path.join(ROOT, "tf_relupool")]]
    path = next(p for p in paths if os.path.exists(p))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The worker protocol, the search, trials and the devices live in the package
# (tf_relupool/_harness.py), where `python -m tf_relupool.measure` uses them; loaded without
# tf_relupool's __init__, so that no TensorFlow starts here.
_h = devices = load_harness()
MIB, OOM_HINTS, RESULT, DEVICE_ERROR = _h.MIB, _h.OOM_HINTS, _h.RESULT, _h.DEVICE_ERROR
start_tensorflow, print_result, leave = _h.start_tensorflow, _h.print_result, _h.leave
read_result, run_worker = _h.read_result, _h.run_worker
round_down, bracket_and_bisect, largest_fitting = _h.round_down, _h.bracket_and_bisect, \
    _h.largest_fitting
search_start, classify_error, tail = _h.search_start, _h.classify_error, _h.tail
trial_env, run_fresh, library_built = _h.trial_env, _h.run_fresh, _h.library_built
measure_steps, step_figures = _h.measure_steps, _h.step_figures
xla_allocations, conv_scratch = _h.xla_allocations, _h.conv_scratch

# tf_relupool/_example_models.py's CIFAR-10 models (32x32x3, 10 classes), then
# keras.applications models at 224x224x3 with 1000 classes (weights=None), as users train them.
MODELS = ("simple", "vgg", "resnet", "vgg16", "resnet50", "mobilenetv2", "efficientnetb0")
APPLICATIONS = {"vgg16": "VGG16", "resnet50": "ResNet50", "mobilenetv2": "MobileNetV2",
                "efficientnetb0": "EfficientNetB0"}
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
    "default-switch-bn": {"keep": None, "switch": "argmax", "jit": "auto", "bn_relu": True},
    "default-switch-act": {"keep": None, "switch": "argmax", "jit": "auto", "activations": True},
    "default-switch-b50": {"keep": None, "switch": "argmax", "jit": "auto", "memory_budget": 0.5},
    "default-switch-b25": {"keep": None, "switch": "argmax", "jit": "auto",
                           "memory_budget": 0.25},
    "default-switch-b0": {"keep": None, "switch": "argmax", "jit": "auto", "memory_budget": 0},
}
VARIANT_LABELS = {"stock": "stock", "argmax": "fused argmax", "input": "fused input",
                  "switch": "stock + enable_recompute()",
                  "default": "stock, Keras default compile",
                  "default-switch": "stock + enable_recompute(), Keras default compile",
                  "default-layer": "rewrite_model (ReluMaxPool2D), Keras default compile",
                  "default-remat": "keras.RematScope(activations), Keras default compile",
                  "default-switch-bn": "stock + enable_recompute(bn_relu=True), Keras default "
                                       "compile",
                  "default-switch-act": "stock + enable_recompute(activations=True), Keras "
                                        "default compile",
                  "default-switch-b50": "stock + enable_recompute(memory_budget=0.5), Keras "
                                        "default compile",
                  "default-switch-b25": "stock + enable_recompute(memory_budget=0.25), Keras "
                                        "default compile",
                  "default-switch-b0": "stock + enable_recompute(memory_budget=0), Keras "
                                       "default compile"}
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
            from tf_relupool import _example_models as models
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
    spec = VARIANTS[variant]
    with tf_relupool.recompute(keep, activations=spec.get("activations", False),
                               bn_relu=spec.get("bn_relu", False),
                               memory_budget=spec.get("memory_budget", 1)):
        return float(model.train_on_batch(x, y))


# ---------------------------------------------------------------------------------------------
# The device probe.
# ---------------------------------------------------------------------------------------------
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
# Where a report comes from.
# ---------------------------------------------------------------------------------------------
def git_head():
    """The short commit of the checkout the benchmarks run from, or None outside git."""
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":  # probe_device's subprocess: python harness.py auto|cpu|gpu
    _, dev = start_tensorflow(sys.argv[1])
    print_result(dev.as_dict())
    leave()
