"""tf_relupool/_versions.py: the tested TensorFlow range, the import-time warning outside it."""
import subprocess
import sys

import tensorflow as tf

from tf_relupool import _versions


def test_minor_parses_release_and_candidate_versions():
    assert _versions.minor("2.20.0") == (2, 20)
    assert _versions.minor("2.21.0rc1") == (2, 21)
    assert _versions.minor("nightly") is None


def test_message_only_outside_the_tested_range():
    low, high = _versions.OLDEST_TESTED, _versions.NEWEST_TESTED
    assert _versions.untested_message(f"{low[0]}.{low[1]}.0") is None
    assert _versions.untested_message(f"{high[0]}.{high[1]}.3") is None
    newer = _versions.untested_message(f"{high[0]}.{high[1] + 1}.0")
    older = _versions.untested_message(f"{low[0]}.{low[1] - 1}.1")
    for text, version in ((newer, f"{high[0]}.{high[1] + 1}.0"), (older, f"{low[0]}.{low[1] - 1}.1")):
        assert text is not None and version in text
        assert f"{low[0]}.{low[1]}" in text and f"{high[0]}.{high[1]}" in text


def _import_warnings(setup, version):
    """The warnings `import tf_relupool` gives, in a fresh process after `setup`, that name
    `version`."""
    code = (setup + "\nimport warnings\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); import tf_relupool\n"
            f"print([str(x.message) for x in w if {version!r} in str(x.message)])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_this_tensorflow_is_in_range_and_import_warns_outside_it():
    assert _versions.untested_message(tf.__version__) is None
    out = _import_warnings("import tensorflow as tf; tf.__version__ = '2.99.0'", "2.99.0")
    assert "untested" in out and "2.99.0" in out


def test_version_and_requirements_have_one_source():
    """setup.py's version and install_requires and tf_relupool.__version__ all come from
    _versions.py; the Keras running here lies in the declared range."""
    import keras
    import tf_relupool
    assert tf_relupool.__version__ == _versions.VERSION
    requires = _versions.requirements()
    assert f"tensorflow>={'.'.join(map(str, _versions.OLDEST_TESTED))}" in requires
    low, high = _versions.KERAS_MIN, _versions.KERAS_MAX_TESTED
    assert f"keras>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}" in requires
    assert low <= _versions.minor(keras.__version__) <= high


def test_keras_outside_its_range_warns_at_import():
    """Keras' tested range has the same warning as TensorFlow's, at import, read from the
    installed distribution's metadata (Keras itself is not imported for it)."""
    low, high = _versions.KERAS_MIN, _versions.KERAS_MAX_TESTED
    assert _versions.keras_untested_message(f"{low[0]}.{low[1]}.0") is None
    assert _versions.keras_untested_message(f"{high[0]}.{high[1]}.9") is None
    text = _versions.keras_untested_message(f"{high[0]}.{high[1] + 1}.0")
    assert text and "Keras" in text and f"{high[0]}.{high[1] + 1}.0" in text
    assert _versions.keras_untested_message("2.15.0") is not None
    assert _versions.keras_untested_message("") is None  # no Keras installed
    out = _import_warnings("import importlib.metadata as m\nreal = m.version\n"
                           "m.version = lambda name: '3.99.0' if name == 'keras' else real(name)",
                           "Keras 3.99.0")
    assert "untested" in out and "3.99.0" in out
