"""The switch's XLA autotune cache (tf_relupool/autotune_cache.py): which flags, when it leaves
XLA_FLAGS alone, and that the TensorFlow installed here accepts the flags it sets."""
import os
import subprocess
import sys

import pytest

from tf_relupool import autotune_cache

PER_FUSION = "--xla_gpu_per_fusion_autotune_cache_dir="
AUTOTUNER = "--xla_gpu_experimental_autotuner_cache_dir="


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """install() as in a process whose TensorFlow has not started yet."""
    monkeypatch.setattr(autotune_cache, "_state", {"state": "not installed", "directory": None,
                                                   "flags": []})
    monkeypatch.setattr(autotune_cache, "_context_initialized", lambda: False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(autotune_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4")
    return tmp_path


def test_flags_follow_the_tensorflow_version():
    assert autotune_cache.flags((2, 20), "/c") == [PER_FUSION + "/c"]
    assert autotune_cache.flags((2, 21), "/c") == [PER_FUSION + "/c", AUTOTUNER + "/c"]
    assert autotune_cache.flags((2, 19), "/c") == []


def test_install_appends_to_xla_flags_once_per_tensorflow_version(fresh):
    version, text = autotune_cache._tf_version()
    state = autotune_cache.install()
    directory = os.path.join(str(fresh), "tf_relupool", "xla-autotune", f"tf-{text}")
    assert state["state"] == "installed" and state["directory"] == directory
    assert os.path.isdir(directory)
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[0] == "--xla_gpu_autotune_level=4"  # the user's flags stay, first
    assert flags[1:] == autotune_cache.flags(version, directory)
    assert autotune_cache.install() == state  # once: a second call changes nothing
    assert os.environ["XLA_FLAGS"].split() == flags


@pytest.mark.parametrize("value", ["0", "off", "False", ""])
def test_the_environment_turns_it_off(fresh, monkeypatch, value):
    monkeypatch.setenv(autotune_cache.ENV_VAR, value)
    assert autotune_cache.install()["state"] == "off"
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=4"


def test_the_environment_names_the_directory(fresh, monkeypatch):
    where = str(fresh / "mine")
    monkeypatch.setenv(autotune_cache.ENV_VAR, where)
    assert autotune_cache.install()["directory"] == where
    assert PER_FUSION + where in os.environ["XLA_FLAGS"].split()


def test_the_users_own_cache_flag_stands(fresh, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", PER_FUSION + "/theirs")
    assert autotune_cache.install()["state"] == "user's XLA_FLAGS"
    assert os.environ["XLA_FLAGS"] == PER_FUSION + "/theirs"


def test_a_directory_with_whitespace_is_refused_with_a_warning(fresh, monkeypatch, caplog):
    monkeypatch.setenv(autotune_cache.ENV_VAR, str(fresh / "with space"))
    with caplog.at_level("WARNING", logger="tf_relupool"):
        assert autotune_cache.install()["state"] == "directory with whitespace"
    assert "whitespace" in caplog.text
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=4"


def test_too_late_once_tensorflow_started(fresh, monkeypatch):
    monkeypatch.setattr(autotune_cache, "_context_initialized", lambda: True)
    assert autotune_cache.install()["state"].startswith("too late")
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=4"


def _run(code, tmp_path, **env):
    full = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", XDG_CACHE_HOME=str(tmp_path), **env)
    for name in ("XLA_FLAGS", "TF_RELUPOOL_RECOMPUTE", autotune_cache.ENV_VAR):
        if name not in env:
            full.pop(name, None)
    out = subprocess.run([sys.executable, "-c", code], env=full, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_enable_recompute_sets_flags_that_this_tensorflow_accepts(tmp_path):
    """Before TensorFlow starts, enable_recompute() installs the cache; XLA then compiles with
    the flags (an unknown flag would abort the process); the switch off installs nothing."""
    code = ("import os, tensorflow as tf, tf_relupool\n"
            "from tf_relupool import autotune_cache as a\n"
            "with tf_relupool.recompute(None):\n"
            "    print('OFF', a.state()['state'])\n"
            "tf_relupool.enable_recompute()\n"
            "print('ON', a.state()['state'], os.environ.get('XLA_FLAGS'))\n"
            "f = tf.function(lambda x: tf.nn.max_pool2d(tf.nn.relu(x), 2, 2, 'VALID'),"
            " jit_compile=True)\n"
            "print('SUM', float(tf.reduce_sum(f(tf.ones([1, 4, 4, 1])))))\n")
    out = _run(code, tmp_path)
    assert "OFF not installed" in out
    on = out.split("ON ")[1].splitlines()[0]
    assert on.startswith("installed ") and PER_FUSION in on, out
    assert "SUM 4.0" in out


def test_enable_recompute_after_tensorflow_started_leaves_xla_flags(tmp_path):
    code = ("import os, tensorflow as tf, tf_relupool\n"
            "from tf_relupool import autotune_cache as a\n"
            "tf.constant(1.0) + 1.0\n"
            "tf_relupool.enable_recompute()\n"
            "print('ON', a.state()['state'], repr(os.environ.get('XLA_FLAGS')))\n")
    out = _run(code, tmp_path)
    assert "ON too late" in out and out.rstrip().endswith("None"), out
