"""Runs tf_relupool's Python tests against the Bazel-built op library (the //:op_tests target).

The tests import `tf_relupool`. Here that is a package directory assembled under $TEST_TMPDIR
from this checkout's tf_relupool/*.py, the library Bazel built (//:_relu_max_pool_ops.so) and the
_build_info.py Bazel generated (//:build_info), placed first on PYTHONPATH; the installed package
and the source tree are never on the path. The test files given as arguments are copied beside
the helpers they import (HELPERS: tests/conftest.py, tests/grappler_cases.py) and run with
pytest under the Python whose TensorFlow the library was built against (Bazel's Python
toolchain, @local_config_tf//:py_toolchain).
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

LIBRARY = "_relu_max_pool_ops.so"
#: Modules the test files import from tests/ (BUILD's op_tests lists them in `data` too).
HELPERS = ["tests/conftest.py", "tests/grappler_cases.py"]


def main(test_files):
    runfiles = os.getcwd()  # Bazel starts a test in its runfiles tree, in the workspace directory
    work = os.path.join(os.environ.get("TEST_TMPDIR") or tempfile.mkdtemp(), "tf_relupool_bazel")
    shutil.rmtree(work, ignore_errors=True)
    pkg = os.path.join(work, "site", "tf_relupool")
    os.makedirs(pkg)
    for src in glob.glob(os.path.join(runfiles, "tf_relupool", "*.py")):
        if os.path.basename(src) != "_build_info.py":
            shutil.copy(src, pkg)
    library = os.path.join(runfiles, LIBRARY)
    shutil.copy(library, os.path.join(pkg, LIBRARY))
    shutil.copy(os.path.join(runfiles, "_bazel", "_build_info.py"), pkg)

    copied = []
    for rel in HELPERS + list(test_files):
        dst = os.path.join(work, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy(os.path.join(runfiles, rel), dst)
        if rel not in HELPERS:
            copied.append(rel)

    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(work, "site")
    env["TF_RELUPOOL_BAZEL_LIBRARY"] = os.path.realpath(library)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", work]
    if os.environ.get("XML_OUTPUT_FILE"):
        cmd.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
    cmd += copied
    print("running in", work, ":", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=work, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
