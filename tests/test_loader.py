"""Loading the op library: missing, unreadable, corrupt or built for another TensorFlow."""
import os
import shutil

import pytest
import tensorflow as tf

from tf_relupool import _loader
from tf_relupool._loader import OpLibraryError


def test_library_is_loaded_once():
    assert _loader.load_library() is _loader.load_library()


def test_missing_library_names_the_path_and_the_rebuild_command(tmp_path):
    path = str(tmp_path / "missing.so")
    with pytest.raises(OpLibraryError, match="does not exist") as e:
        _loader._load(path)
    assert path in str(e.value) and "pip install" in str(e.value) and tf.__version__ in str(e.value)


def test_library_built_for_another_tensorflow_names_both_versions(monkeypatch):
    monkeypatch.setattr(_loader, "_built_tf_version", lambda: "2.0.0")
    with pytest.raises(OpLibraryError) as e:
        _loader._load(_loader.library_path())
    msg = str(e.value)
    assert "2.0.0" in msg and tf.__version__ in msg and "pip install" in msg


def test_corrupt_library_is_a_clear_error(tmp_path):
    path = tmp_path / "corrupt.so"
    path.write_bytes(b"\x7fELF this is not a shared object")
    with pytest.raises(OpLibraryError, match="failed to load") as e:
        _loader._load(str(path))
    assert "pip install" in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_library_is_a_clear_error(tmp_path):
    path = tmp_path / "lib.so"
    shutil.copy(_loader.library_path(), path)
    path.chmod(0)
    with pytest.raises(OpLibraryError, match="not readable"):
        _loader._load(str(path))


# ---- End to end, in a fresh interpreter with a broken copy of the installed package ----
# `import tf_relupool` must still work (the ops register at import, but a failure is deferred);
# the first use of an op raises OpLibraryError naming the cause and the fix.
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import tf_relupool  # noqa: E402

FIRST_USE = textwrap.dedent("""
    import tensorflow as tf
    import tf_relupool
    print("package:", tf_relupool.__file__)
    try:
        tf_relupool.relu_max_pool2d(tf.ones([1, 2, 2, 1]), 2, 2, "VALID")
    except tf_relupool.OpLibraryError as e:
        print("OpLibraryError:", e)
    else:
        print("NO ERROR")
""")


def _broken_copy(tmp_path, breakage):
    """A copy of the installed package in tmp_path/site, with `breakage(package_dir)` applied."""
    src = os.path.dirname(os.path.abspath(tf_relupool.__file__))
    dst = tmp_path / "site" / "tf_relupool"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    breakage(dst)
    return dst


def src_package_dir():
    """The directory of the tf_relupool under test (its parent must not shadow the copy)."""
    return os.path.dirname(os.path.abspath(tf_relupool.__file__))


def _first_use(tmp_path, pkg, user=None):
    # The broken copy first; then whatever PYTHONPATH held (where TensorFlow lives when it is not
    # in the interpreter's own site-packages, e.g. the GPU machine's unpacked bundle).
    path = os.pathsep.join([str(pkg.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and os.path.abspath(p) != os.path.dirname(src_package_dir())])
    env = dict(os.environ, PYTHONPATH=path, HOME=str(tmp_path),
               MPLCONFIGDIR=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="3")
    cmd = [sys.executable, "-c", FIRST_USE]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] + cmd
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"package: {pkg}" in proc.stdout, proc.stdout  # the broken copy, not the install
    out = proc.stdout.strip().splitlines()[-1]
    assert out.startswith("OpLibraryError:"), proc.stdout + proc.stderr[-3000:]
    return out


def test_first_use_without_library_file(tmp_path):
    pkg = _broken_copy(tmp_path, lambda d: (d / _loader.LIBRARY_FILE).unlink())
    msg = _first_use(tmp_path, pkg)
    assert str(pkg / _loader.LIBRARY_FILE) in msg and "does not exist" in msg
    assert "pip install" in msg and tf.__version__ in msg


def test_first_use_of_library_built_for_another_tensorflow(tmp_path):
    pkg = _broken_copy(tmp_path, lambda d: (d / "_build_info.py").write_text("TF_VERSION = '2.0.0'\n"))
    msg = _first_use(tmp_path, pkg)
    assert "built against TensorFlow 2.0.0" in msg and tf.__version__ in msg and "Rebuild" in msg


def test_first_use_of_truncated_library(tmp_path):
    def truncate(d):
        lib = d / _loader.LIBRARY_FILE
        lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])
    pkg = _broken_copy(tmp_path, truncate)
    msg = _first_use(tmp_path, pkg)
    assert "failed to load" in msg and "Rebuild" in msg and str(pkg / _loader.LIBRARY_FILE) in msg


def test_first_use_of_an_empty_library_file(tmp_path):
    pkg = _broken_copy(tmp_path, lambda d: (d / _loader.LIBRARY_FILE).write_bytes(b""))
    msg = _first_use(tmp_path, pkg)
    assert "failed to load" in msg and "Rebuild" in msg


def test_unreadable_library_with_os_access_mocked(monkeypatch):
    # Runs as any user (root reads everything): os.access says the file is not readable.
    real_access = os.access
    monkeypatch.setattr(_loader.os, "access", lambda p, mode, *a, **k:
                        False if p == _loader.library_path() and mode == os.R_OK
                        else real_access(p, mode, *a, **k))
    with pytest.raises(OpLibraryError, match="not readable by this user") as e:
        _loader._load(_loader.library_path())
    assert "permissions" in str(e.value) and "pip install" in str(e.value)


def _can_run_as_nobody():
    return (os.geteuid() == 0 and shutil.which("setpriv") is not None
            and subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                sys.executable, "-c", "import numpy"],
                               capture_output=True, timeout=300).returncode == 0)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run a subprocess as user nobody")
def test_unreadable_library_as_user_nobody(tmp_path):
    # A real permission failure: the library file is mode 000 and the process runs as nobody
    # (uid 65534) through setpriv, since root can read any file.
    if not _can_run_as_nobody():
        pytest.skip("user nobody cannot run this Python/TensorFlow")
    import tempfile
    base = tempfile.mkdtemp(prefix="tfrp_nobody_", dir="/tmp")  # pytest's tmp_path is root-only
    try:
        work = __import__("pathlib").Path(base)
        pkg = _broken_copy(work, lambda d: (d / _loader.LIBRARY_FILE).chmod(0))
        for p in [work, work / "site", pkg]:
            p.chmod(0o755)
        msg = _first_use(work, pkg, user=65534)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert "is not readable by this user" in msg and "permissions" in msg
