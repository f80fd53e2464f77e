"""Builds tf_relupool's op library against the TensorFlow installed in the target environment.

`pip install .` compiles cc/ with g++ using TensorFlow's own flags (tf.sysconfig). TensorFlow is
found in the environment pip installs into, also from inside pip's isolated build environment
(a subprocess with pip's path overrides removed), so the library always matches the TensorFlow
it will be loaded into. The TensorFlow version is recorded in tf_relupool/_build_info.py and
checked when the library loads.
"""
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

_TF_QUERY = (
    "import json, tensorflow as tf; print(json.dumps({'version': tf.__version__, "
    "'cflags': tf.sysconfig.get_compile_flags(), 'lflags': tf.sysconfig.get_link_flags()}))"
)


def tensorflow_build_flags():
    """TensorFlow's version and flags, from the environment being installed into."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    proc = subprocess.run([sys.executable, "-c", _TF_QUERY], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(
            "tf_relupool: TensorFlow must be installed before building the op library "
            f"(`{sys.executable} -m pip install tensorflow`).\n{proc.stderr[-2000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
        cflags = ["-O3", "-fPIC", "-Wall", "-Wno-sign-compare", "-Wno-deprecated-declarations",
                  f"-I{ROOT}"] + tf["cflags"] + extra

        def compile_one(src):
            obj = obj_dir / (src.replace("/", "_") + ".o")
            cmd = [cxx, *cflags, "-c", str(ROOT / src), "-o", str(obj)]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            return str(obj)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            objs = list(pool.map(compile_one, CPU_SOURCES))
        link = [cxx, "-shared", *objs, "-o", str(out), *tf["lflags"], *extra]
        print(" ".join(link), flush=True)
        subprocess.run(link, check=True)
        info = out.parent / "_build_info.py"
        info.write_text(
            '"""Written by setup.py when the op library was built."""\n'
            f"TF_VERSION = {tf['version']!r}\n"
        )


setup(
    name="tf_relupool",
    version="0.1.0",
    description="Fused ReLU + max pooling for TensorFlow: exact, faster, and lighter on memory.",
    packages=["tf_relupool"],
    python_requires=">=3.9",
    install_requires=["tensorflow>=2.16", "numpy"],
    ext_modules=[Extension("tf_relupool._relu_max_pool_ops", sources=CPU_SOURCES)],
    cmdclass={"build_ext": BuildOpLibrary},
    zip_safe=False,
)
