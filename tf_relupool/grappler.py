"""The recompute switch inside Grappler: enable_recompute() fuses stock code.

The op library also holds a Grappler graph optimizer (cc/grappler/: plugin.cc and its passes),
registered with TensorFlow through its pluggable graph optimizer C API (`TF_InitGraph`, loaded by
`load_pluggable_device_library`). TensorFlow then runs it on every graph it optimizes, after its
own passes: every `tf.function`, Keras' train/predict functions. While the switch is on it
rewrites `max_pool2d(relu(z))` (and its gradient `ReluGrad(MaxPoolGrad(...))`) into the fused ops,
so stock code (`tf.nn.relu` + `tf.nn.max_pool2d`, Keras `Conv2D(activation="relu")` +
`MaxPooling2D`, `MaxPoolV2`, a ZeroPadding2D between the ReLU and the pool as in the ResNet50
stem) gets the fused ops without a change. `_clib.rewrite_serialized_graph` runs the same code on a
GraphDef outside Grappler (what `tf_relupool.rewrite_graph` uses). Whatever the switch, it also
gives fused ops their NCHW form where TensorFlow's layout optimizer (on a GPU) left them in NHWC
between Transposes.

When: the optimizer is registered the first time the switch is turned on or a fused op is built
(so a process that does neither pays nothing); it reads the switch each time TensorFlow optimizes a graph,
which happens when a traced function is first run (instantiated), not at every step. As with
layers, set the switch before the function's first call (before `fit`).

`TF_RELUPOOL_GRAPPLER=0` in the environment keeps the optimizer unregistered (the switch then
affects only tf_relupool's own layers, as before). cc/grappler/README.md has the details.

This module registers the optimizer and passes it the switch; the calls into the library's C API
are tf_relupool/_clib.py's; what a call really ran (RunMetadata) is tf_relupool/run_metadata.py's.
"""
import logging
import os
import threading

from tf_relupool import _clib, _loader
# What the optimizer reports, read through the C API: its counters (stats), its own view of the
# switch (mode), the device types it runs for, its log switch.
from tf_relupool._clib import (  # noqa: F401
    STAT_NAMES, GrapplerUnavailable, mode, registered_device_types, reset_stats, set_verbose,
    stats)
from tf_relupool._state import MODE_CODES

ENV_VAR = "TF_RELUPOOL_GRAPPLER"
DEVICE_TYPES = ("CPU", "GPU")

logger = logging.getLogger("tf_relupool")
_lock = threading.RLock()
_registered = False
_failure = None        # why registration failed, once it has


def _disabled_by_environment():
    return os.environ.get(ENV_VAR, "").strip().lower() in ("0", "off", "false", "no")


def _alias(path, i):
    """The i-th distinct spelling of `path` (same file). TF_LoadPluggableDeviceLibrary caches
    by file name and calls TF_InitGraph once per new name; dlopen returns the same handle."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, *(["."] * i), base)


def register(device_types=DEVICE_TYPES):
    """Registers the graph optimizer with TensorFlow for `device_types` (once per process).

    Raises:
      GrapplerUnavailable: the library holds no optimizer, or loading it failed.
    """
    global _registered, _failure
    with _lock:
        if _registered:
            return
        if _failure is not None:
            raise GrapplerUnavailable(_failure)
        try:
            from tf_relupool import _compat
            path = _clib.library_path()
            for i, device_type in enumerate(device_types):
                _clib.set_next_device_type(device_type)
                _compat.tf_load_pluggable_device_library(_alias(path, i))
        except (OSError, RuntimeError, AttributeError, _loader.OpLibraryError) as e:
            _failure = f"tf_relupool's graph optimizer could not be registered: {e}"
            raise GrapplerUnavailable(_failure) from e
        _registered = True
        logger.info("tf_relupool: graph optimizer registered for %s", registered_device_types())


def ensure_registered():
    """Registers the optimizer (once), whatever the switch: called when a graph first gets a
    fused op, so that TensorFlow's layout optimizer never leaves the fused ops between
    Transposes (the pass gives them their NCHW form; it fuses stock ops only while the switch
    is on). Never raises; TF_RELUPOOL_GRAPPLER=0 keeps it unregistered."""
    if _registered or _failure is not None:
        return
    with _lock:
        if not _registered and _failure is None:
            _try_register("the fused ops may run between TensorFlow's layout transposes on a GPU")


def set_mode(mode):
    """Tells the optimizer the switch's value (None, "argmax", "input"); registers it on first
    use. Called by tf_relupool.config whenever the switch changes. Never raises: a failure
    leaves the switch fusing stock ops inside XLA-compiled functions only (and tf_relupool's
    layers where the op library loads), with one warning."""
    if mode not in MODE_CODES:
        raise ValueError(f"mode must be one of {tuple(MODE_CODES)}, got {mode!r}")
    with _lock:
        if mode is not None and not _registered and not _try_register(
                "the switch fuses stock ReLU + max pool inside XLA-compiled functions only (that "
                "needs no library)"):
            return
        _clib.set_mode(mode)


def _try_register(consequence):
    """register() unless TF_RELUPOOL_GRAPPLER=0; whether it is registered. A failure is logged
    once (a WARNING with `consequence`), never raised."""
    if _disabled_by_environment():
        return False
    try:
        register()
    except GrapplerUnavailable as e:
        if _failure_warned():
            logger.warning("%s; %s", e, consequence)
        return False
    return True


_warned = []


def _failure_warned():
    """True the first time only."""
    if _warned:
        return False
    _warned.append(True)
    return True
