"""What this process's CPU can run: /proc/cpuinfo's feature flags (Linux), and whether XLA's CPU
compiler emits AVX-512 code here. No TensorFlow."""
import os
import platform
import re

XLA_FLAGS_VAR = "XLA_FLAGS"
#: --xla_cpu_max_isa values below AVX-512 (XLA's names)
_BELOW_AVX512 = ("SSE4_2", "AVX", "AVX2")


def flags():
    """The CPU's feature flags (/proc/cpuinfo on x86-64 Linux), or None where there are none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def xla_avx512():
    """Whether XLA's CPU compiler emits AVX-512 code in this process: an x86-64 CPU with AVX-512
    (assumed where its flags cannot be read), unless XLA_FLAGS' --xla_cpu_max_isa caps it at
    AVX2 or below."""
    capped = re.findall(r"--xla_cpu_max_isa=(\S+)", os.environ.get(XLA_FLAGS_VAR, ""))
    if capped and capped[-1].upper() in _BELOW_AVX512:
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    found = flags()
    return found is None or "avx512f" in found
