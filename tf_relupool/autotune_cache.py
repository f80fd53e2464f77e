"""XLA's persistent autotune results, which `enable_recompute()` turns on (docs/memory.md,
"The largest batch at Keras' default compile").

At Keras' default compile on a GPU, XLA autotunes every convolution and matrix product of a
training step the first time it compiles the step, with buffers taken from TensorFlow's
allocator. Under a tight memory budget that autotuning can decide the largest batch, and it
makes the first step slow (docs/memory.md gives the figures). A process that finds the results
of an earlier compile of the same step in XLA's persistent cache does not autotune it again.

`install()` points XLA at a cache directory through `XLA_FLAGS`, once per process, before
TensorFlow initializes its GPU (XLA reads the flags then). It leaves XLA's flags alone when:

- `TF_RELUPOOL_AUTOTUNE_CACHE` is `0`, `off` or `false` (any other value names the directory;
  default: `$XDG_CACHE_HOME/tf_relupool/xla-autotune/tf-<version>`, or `~/.cache/...`);
- `XLA_FLAGS` already names an autotune cache (the user's choice stands);
- TensorFlow has already initialized its context (too late for XLA to read them; with a GPU
  visible, a WARNING says so and what to do).

Results are per GPU model and XLA version (one directory per TensorFlow version; XLA keys
entries by the device). The cache is not free in step time: every XLA compile of the process
reads and writes it (docs/memory.md: what it costs, and when to turn it off). No TensorFlow
import here: the harness installs it in a worker before TensorFlow starts.
"""
import logging
import os
import sys

ENV_VAR = "TF_RELUPOOL_AUTOTUNE_CACHE"
_OFF = ("0", "off", "false", "no")
# XLA's flags for its persistent autotune results, by the TensorFlow versions that have them:
# the per-fusion cache exists in 2.20 and 2.21, the new autotuner's in 2.21 (an unknown flag in
# XLA_FLAGS aborts the process, so a flag is set only where the version has it).
_FLAGS = (("xla_gpu_per_fusion_autotune_cache_dir", (2, 20)),
          ("xla_gpu_experimental_autotuner_cache_dir", (2, 21)))

logger = logging.getLogger("tf_relupool")
_state = {"state": "not installed", "directory": None, "flags": []}


def _tf_version():
    """((major, minor), version text) of the installed TensorFlow, without importing it (None if
    unknown)."""
    tf = sys.modules.get("tensorflow")
    text = getattr(tf, "__version__", None)
    if text is None:
        try:
            from importlib import metadata
            for dist in ("tensorflow", "tensorflow-cpu", "tf-nightly"):
                try:
                    text = metadata.version(dist)
                    break
                except metadata.PackageNotFoundError:
                    continue
        except ImportError:  # pragma: no cover - Python < 3.8
            return None
    try:
        return tuple(int(p) for p in text.split(".")[:2]), text
    except (AttributeError, ValueError):
        return None


def default_directory(version_text):
    """Where the results go by default: one directory per TensorFlow version."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "tf_relupool", "xla-autotune", f"tf-{version_text}")


def flags(version, directory):
    """The XLA flags that point `version`'s autotuners at `directory`."""
    return [f"--{name}={directory}" for name, since in _FLAGS if version >= since]


def _context_initialized():
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return False
    from tf_relupool import _compat
    return _compat.tf_context_initialized()


def _gpu_visible():
    try:
        import tensorflow as tf
        return bool(tf.config.list_physical_devices("GPU"))
    except Exception:  # noqa: BLE001
        return False


def install(directory=None):
    """Points XLA's autotuners at a persistent cache (module doc), once per process. Returns
    state(). `directory` overrides the environment's and the default."""
    if _state["state"] != "not installed":
        return state()
    setting = os.environ.get(ENV_VAR)
    if directory is None and setting is not None and setting.strip().lower() in _OFF + ("",):
        return _set("off")
    current = os.environ.get("XLA_FLAGS", "")
    if any(name in current for name, _ in _FLAGS):
        return _set("user's XLA_FLAGS")
    found = _tf_version()
    if found is None:
        return _set("unknown TensorFlow version")
    version, text = found
    names = flags(version, "")
    if not names:
        return _set(f"TensorFlow {text} has no persistent autotune cache")
    if _context_initialized():
        if _gpu_visible():
            logger.warning(
                "tf_relupool: enable_recompute() was called after TensorFlow initialized its "
                "GPU, so XLA's persistent autotune results are not used in this process; under a "
                "tight memory budget the first step's autotuning can then decide the largest "
                "batch (docs/memory.md). Call enable_recompute() before building the model, or "
                "set XLA_FLAGS=--xla_gpu_per_fusion_autotune_cache_dir=DIR yourself.")
        return _set("too late: TensorFlow already initialized")
    directory = directory or setting or default_directory(text)
    if any(c.isspace() for c in directory):  # XLA_FLAGS is split at whitespace
        logger.warning("tf_relupool: the XLA autotune cache %r contains whitespace, which "
                       "XLA_FLAGS cannot carry; set %s to another directory", directory, ENV_VAR)
        return _set("directory with whitespace")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        logger.warning("tf_relupool: cannot create the XLA autotune cache %s (%s); XLA "
                       "autotunes as usual", directory, e)
        return _set(f"cannot create {directory}")
    new = flags(version, directory)
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [current.strip()] + new))
    return _set("installed", directory, new)


def _set(what, directory=None, new=()):
    _state.update(state=what, directory=directory, flags=list(new))
    return state()


def state():
    """{"state": "installed" or why not, "directory", "flags"}: what install() did."""
    return dict(_state)
