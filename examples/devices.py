"""Which device a training step runs on, and how much memory it takes there.

TensorFlow reads some of its memory settings once, when it starts, so a script uses this module
in two steps:

    env = devices.prepare_environment(memory_limit_mib=...)   # before `import tensorflow`
    tf, dev = devices.setup("auto", memory_limit_mib=..., layout_optimizer=False)

`dev.name` is then "GPU:0" when TensorFlow sees a GPU (and "cpu" was not asked for), else
"CPU:0", and `StepMemory(tf, dev)` measures one step's peak on that device's allocator:

- GPU: TensorFlow's GPU BFC allocator keeps the statistics itself.
- CPU: only with `TF_CPU_ALLOCATOR_USE_BFC=true` in the environment before TensorFlow starts
  (prepare_environment sets it); otherwise TensorFlow raises "Allocator stats not available".

A memory limit on the GPU (`tf.config.LogicalDeviceConfiguration(memory_limit=...)`) must be set
before TensorFlow initialises the GPU, and `TF_FORCE_GPU_ALLOW_GROWTH` must not be set in that
process (prepare_environment removes it). The CPU has no such limit: callers that need one compare
the measured peak with it (see benchmarks/gpu_memory.py).

No TensorFlow import at module level.
"""
import os

DEVICE_CHOICES = ("auto", "cpu", "gpu")
MIB = 2.0 ** 20


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
