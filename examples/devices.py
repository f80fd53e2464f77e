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

The code lives in tf_relupool/_harness.py (`python -m tf_relupool.measure` needs it where the
package is installed); this module re-exports it, loaded without tf_relupool's __init__ (which
imports TensorFlow). No TensorFlow import at module level.
"""

import importlib.util
import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_harness():
    """tf_relupool._harness, without importing the package (its __init__ imports TensorFlow):
    benchmarks/harness.py's load_harness, the one copy of that loader."""
    spec = importlib.util.spec_from_file_location(
        "_tf_relupool_benchmarks_harness", os.path.join(_ROOT, "benchmarks", "harness.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_harness()


_harness = load_harness()
DEVICE_CHOICES = _harness.DEVICE_CHOICES
MIB = _harness.MIB
DeviceError = _harness.DeviceError
Device = _harness.Device
prepare_environment = _harness.prepare_environment
cpu_description = _harness.cpu_description
setup = _harness.setup
StepMemory = _harness.StepMemory
