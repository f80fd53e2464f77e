"""The install without a C++ compiler (setup.py: CXX not found, or TF_RELUPOOL_BUILD=0): the
pure-Python package, whose XLA routes work (the switch under XLA, the activation recomputation)
and whose op-library routes raise OpLibraryError (docs/install.md, "Without a compiler").

The package is installed from a copy of the source tree into a temporary folder with CXX naming
no file, and runs from there (PYTHONPATH) in subprocesses beside this venv's TensorFlow.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def pure(tmp_path_factory):
    """The folder the pure-Python package is installed into."""
    base = tmp_path_factory.mktemp("no_compiler")
    src, target = base / "src", base / "site"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", ".tfgpu", "build", "dist", "benchmarks", "examples", "gpu_check",
        "third_party", "tests", "*.egg-info", "__pycache__", "*.so", "_build_info.py"))
    env = dict(os.environ, CXX=str(base / "no-such-compiler"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
         "--no-cache-dir", "--target", str(target), str(src)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (target / "tf_relupool" / "__init__.py").is_file()
    assert not list((target / "tf_relupool").glob("*.so")), "a library was built or copied"
    return target


def _env(target):
    """The pure package first on the path; of PYTHONPATH's entries (TensorFlow may come from
    there, as on the GPU machine) those that hold no other tf_relupool."""
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not os.path.exists(os.path.join(p, "tf_relupool"))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(target)] + keep),
                TF_CPP_MIN_LOG_LEVEL="2", TF_RELUPOOL_AUTOTUNE_CACHE="0")


CHECK = r"""
import json, os, sys
import numpy as np
import tensorflow as tf
import keras
import tf_relupool
from tf_relupool import grappler, segments

tf.config.set_visible_devices([], "GPU")
out = {"file": tf_relupool.__file__}

def model():
    keras.utils.set_random_seed(1)
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inp)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(4, 3, padding="same")(x)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    x = keras.layers.Conv2D(4, 1)(x)
    return keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(x)))

x = np.random.default_rng(0).standard_normal((4, 8, 8, 3)).astype("float32")
y = np.random.default_rng(1).standard_normal((4, 2)).astype("float32")

def train(on):
    if on:
        tf_relupool.enable_recompute(activations=True)
    else:
        tf_relupool.disable_recompute()
    m = model()
    m.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=True)
    losses = [float(m.train_on_batch(x, y)) for _ in range(2)]
    return losses, [w.numpy().tobytes().hex() for w in m.weights], m

stock = train(False)
before = segments.stats()["recomputed"]
product = train(True)
out["bitwise"] = stock[:2] == product[:2]
out["recomputed"] = segments.stats()["recomputed"] - before
report = tf_relupool.fusion_report(product[2], batch_size=4)
out["xla_fused"] = len(report.fused("xla"))
out["grappler_available"] = report.available("grappler")
out["report_head"] = str(report).splitlines()[0]

def error(fn):
    try:
        fn()
    except tf_relupool.OpLibraryError as e:
        return "OpLibraryError: " + str(e)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None

out["layer"] = error(lambda: tf_relupool.ReluMaxPool2D()(tf.ones((1, 4, 4, 1))))
out["op"] = error(lambda: tf_relupool.relu_max_pool2d(tf.ones((1, 4, 4, 1)), 2, 2, "VALID"))
out["grappler"] = error(grappler.register)
out["saved_model"] = error(lambda: tf_relupool.load_saved_model(os.getcwd()))
print("RESULT " + json.dumps(out))
"""


def test_xla_routes_work_and_library_routes_raise(pure):
    proc = subprocess.run([sys.executable, "-c", CHECK], env=_env(pure), capture_output=True,
                          text=True, timeout=600, cwd=HERE)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["file"].startswith(str(pure))
    # the XLA routes: the pool fused, the BN + ReLU recomputed, stock's bits
    assert out["bitwise"]
    assert out["recomputed"] >= 1
    assert out["xla_fused"] == 1
    # the routes that need the op library: OpLibraryError, naming what is missing and the command
    assert not out["grappler_available"]
    assert "grappler: unavailable" in out["report_head"]
    for route in ("layer", "op", "grappler", "saved_model"):
        assert out[route] and "OpLibraryError" in out[route], (route, out[route])
        assert "installed without it" in out[route] and "pip install" in out[route], out[route]


@pytest.mark.slow
def test_xla_tests_pass_from_the_pure_package(pure):
    """(`make test-slow`: it reruns two modules.) The XLA tests (the pool fusion's XLA form, the
    activation recomputation) run against the pure package, but for the comparisons with the op library's kernels and the keras.applications
    trainings (test_segments.py runs those with the full package), with 5 examples per property
    test and without the cases that repeat a route the others cover (the two largest clipped
    windows; the Keras CNN under mixed_bfloat16, whose float32 run stays), which the full package
    runs: 139 s instead of 248 on a 2-core VM. On the CPU also where a GPU is visible: what this
    checks (nothing on those routes needs the op library) does not depend on the device, the GPU
    suite runs the same tests on the GPU with the full package, and run one at a time beside it
    they took that suite past its time limit (an H100, 2026-12-06)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_xla.py",
         "test_segments.py", "-k", "not application and not matches_the_kernels and not "
         "(large_windows and (225 or 240)) and not (keras_cnn_under_xla and mixed_bfloat16)"],
        env=dict(_env(pure), TF_RELUPOOL_EXAMPLES="5", CUDA_VISIBLE_DEVICES="-1"),
        capture_output=True, text=True, timeout=1500, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-1000:]
