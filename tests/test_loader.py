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
