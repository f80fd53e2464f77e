"""Loads the compiled op library once and explains every way that can fail.

`import tf_relupool` calls load_library() (so that graphs and SavedModels naming the ops load),
but a failure there is deferred: the OpLibraryError is raised at the first use of an op.
"""
import os
import struct
import threading

import tensorflow as tf

LIBRARY_FILE = "_relu_max_pool_ops.so"
REBUILD_COMMAND = "pip install --no-build-isolation --force-reinstall --no-deps <path to tf_relupool source>"

_lock = threading.Lock()
_module = None


class OpLibraryError(RuntimeError):
    """The op library is missing, unreadable, or built for another TensorFlow."""


def library_path():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_FILE)


def _built_tf_version():
    try:
        from tf_relupool import _build_info  # written by setup.py next to the library
    except ImportError:
        return None
    return _build_info.TF_VERSION


def _elf_problem(path):
    """Why `path` is not a complete 64-bit little-endian ELF file, or None.

    dlopen maps segments without checking that the file holds them, and a process that touches
    a page past the end of a truncated file dies of SIGBUS before any error can be raised; so
    the program and section header tables and every segment must lie inside the file.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = f.read(64)
        if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            return "it is not a 64-bit little-endian ELF shared library"
        phoff, shoff = struct.unpack_from("<QQ", header, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", header, 54)
        if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
            return f"it is truncated ({size} bytes)"
        f.seek(phoff)
        for _ in range(phnum):
            entry = f.read(phentsize)
            (offset,) = struct.unpack_from("<Q", entry, 8)   # p_offset
            (filesz,) = struct.unpack_from("<Q", entry, 32)  # p_filesz
            if offset + filesz > size:
                return f"it is truncated ({size} bytes, a segment ends at byte {offset + filesz})"
    return None


def load_library():
    """Returns the loaded op module, loading it on first use."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            _module = _load(library_path())
    return _module


def _load(path):
    built = _built_tf_version()
    running = tf.__version__
    if not os.path.exists(path):
        raise OpLibraryError(
            f"tf_relupool's op library {path} does not exist: the package was installed "
            "without it (no C++ compiler at install time, TF_RELUPOOL_BUILD=0, or a source "
            "tree never built), so only its XLA routes work (Keras' default compile on a GPU, "
            f"jit_compile=True). Build it for TensorFlow {running} (a C++ compiler needed) "
            f"with: {REBUILD_COMMAND}")
    if not os.access(path, os.R_OK):
        raise OpLibraryError(
            f"tf_relupool's op library {path} is not readable by this user; fix its permissions "
            f"or reinstall with: {REBUILD_COMMAND}")
    if built is not None and built != running:
        raise OpLibraryError(
            f"tf_relupool's op library was built against TensorFlow {built}, but TensorFlow "
            f"{running} is running. Rebuild it with: {REBUILD_COMMAND}")
    problem = _elf_problem(path)
    if problem is not None:
        raise OpLibraryError(
            f"tf_relupool's op library {path} failed to load: {problem}. Rebuild it with: "
            f"{REBUILD_COMMAND}")
    try:
        return tf.load_op_library(path)
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError, OSError) as e:
        raise OpLibraryError(
            f"tf_relupool's op library {path} (built against TensorFlow {built or 'unknown'}) "
            f"failed to load into TensorFlow {running}: {e}. Rebuild it with: "
            f"{REBUILD_COMMAND}") from e
