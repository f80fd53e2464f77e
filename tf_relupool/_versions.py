"""The TensorFlow versions tf_relupool is tested with (docs/install.md, "TensorFlow versions").

One source for setup.py's `install_requires` (read there with `exec`, no import of the package)
and for the warning at import (tf_relupool/__init__.py). No TensorFlow import here.
"""
#: Oldest and newest TensorFlow minor versions built and tested.
OLDEST_TESTED = (2, 20)
NEWEST_TESTED = (2, 21)


def minor(version):
    """'2.20.0' / '2.21.0rc1' -> (2, 20); None for a string without two leading numbers."""
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or "x")
    except (IndexError, ValueError):
        return None


def untested_message(version):
    """A warning text when TensorFlow `version` lies outside the tested range, else None."""
    found = minor(version)
    if found is None or OLDEST_TESTED <= found <= NEWEST_TESTED:
        return None
    low, high = (".".join(map(str, v)) for v in (OLDEST_TESTED, NEWEST_TESTED))
    return (f"tf_relupool is tested with TensorFlow {low} to {high}; this is TensorFlow "
            f"{version}, which is untested: it may work, or fail in ways the tests would catch")
