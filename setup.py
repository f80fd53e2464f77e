"""Builds tf_relupool's op library against the TensorFlow installed in the target environment.

`pip install .` compiles cc/ with g++ using TensorFlow's own flags (tf.sysconfig). TensorFlow is
found in the environment pip installs into, also from inside pip's isolated build environment
(a subprocess with pip's path overrides removed), so the library always matches the TensorFlow
it will be loaded into. The TensorFlow version is recorded in tf_relupool/_build_info.py and
checked when the library loads.

GPU kernels: when nvcc is found (CUDA_HOME/CUDA_PATH, PATH, /usr/local/cuda) and TF_RELUPOOL_CUDA
is not 0, the CUDA sources (cc/kernels/*.cu) are compiled with nvcc and the GPU OpKernels
(cc/ops/relu_max_pool_kernels_gpu.cc, -DTF_RELUPOOL_CUDA) with g++, into the same library; without
nvcc the library holds the CPU kernels alone. _build_info.WITH_CUDA records which.

CUDA runtime decision: the library links the STATIC CUDA runtime of the nvcc that built it
(libcudart_static.a, CUDA 13 here) and hides its symbols (-Wl,--exclude-libs,ALL). Reason:
libtensorflow_framework.so.2 exports stand-ins for cudaLaunchKernel, __cudaRegisterFatBinary, ...
that forward to TensorFlow's own CUDA 12.5 runtime; a dynamic -lcudart would bind to them and hand
CUDA 13 fat binaries to a CUDA 12 runtime. The static, hidden runtime makes the library
self-contained (no CUDA 12 toolkit needed, kernels launched on TensorFlow's stream of the same
primary context); the price is a driver that supports the nvcc's CUDA version (>= 580 for CUDA
13). On an older driver the GPU ops fail with the CUDA error text; CPU kernels are unaffected and
the library loads on machines without a GPU or driver. cuDNN is not linked: the cuDNN path dlopens
libcudnn.so.9 on first use (TensorFlow has normally loaded it already).

Without a C++ compiler (CXX, default g++, not found) or with TF_RELUPOOL_BUILD=0, the op library
is not built: the pure-Python package is installed, whose XLA routes (the switch at Keras'
default compile on a GPU, `jit_compile=True`, the activation recomputation) need no library;
every route that does raises tf_relupool.OpLibraryError with the command that builds it.

With the library built, install_requires pins the TensorFlow minor version it was compiled
against (a binary wheel, `make wheel`, loads into that TensorFlow only).
"""
import functools
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
LIB_NAME = "_relu_max_pool_ops.so"
CPU_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cc").rglob("*.cc"))
# The CPU kernels' source, compiled once per instruction set with that set's define
# (cc/kernels/relu_max_pool_cpu_isa.h; BUILD and the Makefile pass the same); the objects'
# names end in the set's. relu_max_pool_cpu.cc chooses between them at run time.
CPU_KERNELS = "cc/kernels/relu_max_pool_cpu_kernels.cc"
CPU_ISA_DEFINES = {"baseline": [], "avx2": ["-DTFRP_CPU_ISA_AVX2"],
                   "avx512": ["-DTFRP_CPU_ISA_AVX512"]}
CUDA_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cc").rglob("*.cu"))
GPU_OPKERNELS = "cc/ops/relu_max_pool_kernels_gpu.cc"  # empty unless TF_RELUPOOL_CUDA is defined
CUDA_ARCHS = ("80", "90")


def find_nvcc():
    """nvcc's path, or None when CUDA kernels are off (TF_RELUPOOL_CUDA=0) or no nvcc is found.

    Only an nvcc inside a CUDA toolkit counts (<bin>/../include/cuda_runtime_api.h and
    <bin>/../lib64/libcudart_static.a beside it): a wrapper script elsewhere on PATH is skipped in
    favour of the next candidate."""
    if os.environ.get("TF_RELUPOOL_CUDA", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    candidates = [os.path.join(os.environ[v], "bin", "nvcc")
                  for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if not (c and os.path.isfile(c) and os.access(c, os.X_OK)):
            continue
        c = os.path.realpath(c)
        home = Path(c).parent.parent
        if (home / "include" / "cuda_runtime_api.h").is_file() and \
                (home / "lib64" / "libcudart_static.a").is_file():
            return c
    return None

BUILD_ENV_VAR = "TF_RELUPOOL_BUILD"


def why_not_built():
    """Why the op library is not built here (TF_RELUPOOL_BUILD=0, no C++ compiler), or None."""
    if os.environ.get(BUILD_ENV_VAR, "").strip().lower() in ("0", "false", "no", "off"):
        return f"{BUILD_ENV_VAR}=0"
    cxx = os.environ.get("CXX", "g++")
    if not cxx.strip() or not shutil.which(cxx.split()[0]):
        return f"no C++ compiler (CXX={cxx!r} not found)"
    return None


_TF_QUERY = (
    "import json, tensorflow as tf; print(json.dumps({'version': tf.__version__, "
    "'cflags': tf.sysconfig.get_compile_flags(), 'lflags': tf.sysconfig.get_link_flags()}))"
)


@functools.lru_cache(maxsize=None)
def _query_tensorflow():
    """(TensorFlow's version and flags, or None; the query's stderr), from the environment being
    installed into; asked once per process (the requirements and build_ext both need it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    proc = subprocess.run([sys.executable, "-c", _TF_QUERY], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return None, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


def tensorflow_build_flags():
    """TensorFlow's version and flags; exits with how to install it where there is none."""
    tf, stderr = _query_tensorflow()
    if tf is None:
        sys.exit(
            "tf_relupool: TensorFlow must be installed before building the op library "
            f"(`{sys.executable} -m pip install tensorflow`).\n{stderr[-2000:]}"
        )
    return tf


class BuildOpLibrary(build_ext):
    """Compiles the op library with TensorFlow's flags instead of Python's extension flags."""

    def get_ext_filename(self, ext_name):
        return os.path.join(*ext_name.split(".")[:-1], LIB_NAME)

    def build_extension(self, ext):
        tf = tensorflow_build_flags()
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        obj_dir = Path(self.build_temp) / "objs"
        obj_dir.mkdir(parents=True, exist_ok=True)
        cxx = os.environ.get("CXX", "g++")
        extra = os.environ.get("TF_RELUPOOL_CXXFLAGS", "").split()
        # -ffp-contract=off: the CPU kernels are compiled for several instruction sets and
        # dispatched at run time (CPU_ISA_DEFINES); every path must give the same
        # bits, so no a * b + c may become an FMA on the paths that have one.
        cflags = ["-O3", "-fPIC", "-ffp-contract=off", "-Wall", "-Wno-sign-compare",
                  "-Wno-deprecated-declarations", f"-I{ROOT}"] + tf["cflags"] + extra

        nvcc = find_nvcc()
        cuda_home = Path(nvcc).parent.parent if nvcc else None
        abi = [f for f in tf["cflags"] if f.startswith("-D_GLIBCXX_USE_CXX11_ABI")]
        tf_include = next(f[2:] for f in tf["cflags"] if f.startswith("-I"))
        gpu_cflags = []
        if nvcc:
            # TensorFlow's headers include third_party/gpus/cuda/include/..., which would pull its
            # CUDA 12.5 headers into this CUDA build: point that path at nvcc's own headers.
            shim = (Path(self.build_temp) / "cuda_include_shim").resolve()
            shim_link = shim / "third_party" / "gpus" / "cuda" / "include"
            shim_link.parent.mkdir(parents=True, exist_ok=True)
            if shim_link.is_symlink() or shim_link.exists():
                shim_link.unlink()
            shim_link.symlink_to(cuda_home / "include", target_is_directory=True)
            gpu_cflags = [f"-I{shim}", f"-I{cuda_home / 'include'}", "-DTF_RELUPOOL_CUDA=1",
                          "-DGOOGLE_CUDA=1"]

        def compile_one(src, isa=None):
            obj = obj_dir / (src.replace("/", "_") + (f".{isa}" if isa else "") + ".o")
            if src.endswith(".cu"):
                cmd = [nvcc, "-O3", "--std=c++17", "-Xcompiler", "-fPIC", *abi, f"-I{ROOT}",
                       # cuDNN's headers as shipped in the TensorFlow wheel (types only: dlopen'd).
                       f"-I{tf_include}/third_party/gpus/cudnn/include",
                       *[f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS],
                       f"-gencode=arch=compute_{CUDA_ARCHS[-1]},code=compute_{CUDA_ARCHS[-1]}",
                       "-c", str(ROOT / src), "-o", str(obj)]
            else:
                flags = cflags[:2] + gpu_cflags + cflags[2:] if src == GPU_OPKERNELS else cflags
                flags = flags + CPU_ISA_DEFINES[isa] if isa else flags
                cmd = [cxx, *flags, "-c", str(ROOT / src), "-o", str(obj)]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            return str(obj)

        units = [(src, isa) for src in CPU_SOURCES + (CUDA_SOURCES if nvcc else [])
                 for isa in (CPU_ISA_DEFINES if src == CPU_KERNELS else [None])]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            objs = list(pool.map(lambda unit: compile_one(*unit), units))
        cuda_link = []
        if nvcc:
            cuda_link = [f"-L{cuda_home / 'lib64'}", "-l:libcudart_static.a", "-ldl", "-lrt",
                         "-lpthread", "-Wl,--exclude-libs,ALL"]
        # The static runtime must come before TensorFlow's library: the linker would otherwise
        # resolve __cudaRegisterFatBinary & co. to TensorFlow's CUDA 12 stand-ins.
        link = [cxx, "-shared", *objs, "-o", str(out), *cuda_link, *tf["lflags"], *extra]
        print(" ".join(link), flush=True)
        subprocess.run(link, check=True)
        cuda_version = None
        if nvcc:
            proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
            cuda_version = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else "unknown"
        info = out.parent / "_build_info.py"
        info.write_text(
            '"""Written by setup.py when the op library was built."""\n'
            f"TF_VERSION = {tf['version']!r}\n"
            f"WITH_CUDA = {bool(nvcc)!r}  # GPU kernels (fused + cuDNN path) compiled in\n"
            f"CUDA_VERSION = {cuda_version!r}  # nvcc that built them; static runtime\n"
            f"CUDA_ARCHS = {list(CUDA_ARCHS) if nvcc else []!r}\n"
        )


# The metadata is pyproject.toml's [project] table; the version and install_requires (its
# `dynamic` fields) come from tf_relupool/_versions.py, read without importing the package.
_VERSIONS = {}
exec((Path(__file__).resolve().parent / "tf_relupool" / "_versions.py").read_text(), _VERSIONS)

_NOT_BUILT = why_not_built()
_REQUIREMENTS = _VERSIONS["requirements"]()
if _NOT_BUILT:
    print(f"tf_relupool: {_NOT_BUILT}: installing the pure-Python package without the op library "
          "(the XLA routes work; the op and layer outside XLA, the Grappler pass and SavedModels "
          "holding fused ops raise tf_relupool.OpLibraryError). docs/install.md.",
          file=sys.stderr, flush=True)
else:
    # The library loads into the TensorFlow it was compiled against only: pin its minor version
    # (without a TensorFlow here, as for an sdist, the range stays; building the library then
    # stops with tensorflow_build_flags' message).
    _tf = _query_tensorflow()[0]
    if _tf:
        _REQUIREMENTS = [f"tensorflow=={_VERSIONS['minor_pin'](_tf['version'])}"] + [
            r for r in _REQUIREMENTS if not r.startswith("tensorflow")]

setup(
    version=_VERSIONS["VERSION"],
    install_requires=_REQUIREMENTS,
    ext_modules=[] if _NOT_BUILT else [
        Extension("tf_relupool._relu_max_pool_ops", sources=CPU_SOURCES)],
    cmdclass={} if _NOT_BUILT else {"build_ext": BuildOpLibrary},
)
