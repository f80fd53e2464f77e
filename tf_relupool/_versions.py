"""tf_relupool's own version and the TensorFlow and Keras versions it is tested with
(docs/install.md, "TensorFlow versions").

One source for setup.py's `version` and `install_requires` (read there with `exec`, no import of
the package), for `tf_relupool.__version__` and for the warning at import (tf_relupool/__init__.py).
No TensorFlow import here.
"""
#: The package's version (setup.py's metadata and tf_relupool.__version__).
VERSION = "0.1.0"

#: Oldest and newest TensorFlow minor versions built and tested.
OLDEST_TESTED = (2, 20)
NEWEST_TESTED = (2, 21)

#: Oldest Keras 3 minor version required, and the newest tested (install_requires: the range).
KERAS_MIN = (3, 10)
KERAS_MAX_TESTED = (3, 15)


def requirements():
    """setup.py's install_requires: TensorFlow from the oldest tested minor version on, Keras in
    its tested range (up to the last patch release of KERAS_MAX_TESTED), NumPy."""
    keras_below = (KERAS_MAX_TESTED[0], KERAS_MAX_TESTED[1] + 1)
    return [f"tensorflow>={_dotted(OLDEST_TESTED)}",
            f"keras>={_dotted(KERAS_MIN)},<{_dotted(keras_below)}", "numpy"]


def minor_pin(version):
    """'2.21.0' -> '2.21.*': the TensorFlow a built op library loads into (setup.py pins it)."""
    found = minor(version)
    if found is None:
        raise ValueError(f"not a TensorFlow version: {version!r}")
    return _dotted(found) + ".*"


def _dotted(version):
    """(3, 10) -> '3.10'."""
    return ".".join(map(str, version))


def minor(version):
    """'2.20.0' / '2.21.0rc1' -> (2, 20); None for a string without two leading numbers."""
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or "x")
    except (IndexError, ValueError):
        return None


def untested_message(version, name="TensorFlow", oldest=OLDEST_TESTED, newest=NEWEST_TESTED):
    """A warning text when `name` (TensorFlow by default) `version` lies outside the tested
    range [oldest, newest], else None."""
    found = minor(version)
    if found is None or oldest <= found <= newest:
        return None
    low, high = _dotted(oldest), _dotted(newest)
    return (f"tf_relupool is tested with {name} {low} to {high}; this is {name} "
            f"{version}, which is untested: it may work, or fail in ways the tests would catch")


def keras_untested_message(version):
    """The same warning for a Keras `version` outside [KERAS_MIN, KERAS_MAX_TESTED] (the switch
    under XLA wraps a function of Keras' TensorFlow backend, docs/xla.md)."""
    return untested_message(version, "Keras", KERAS_MIN, KERAS_MAX_TESTED)


def installed_keras():
    """The installed Keras' version string, read without importing Keras; None without one."""
    try:
        from importlib import metadata
        return metadata.version("keras")
    except Exception:  # noqa: BLE001 - no Keras, or no metadata: nothing to warn about
        return None
