"""The global recompute switch: API, context manager, environment variable, effect on layers."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_relupool
from tf_relupool import _clib, _state, config, grappler
from conftest import forward_and_input_grad, xla_hlo


pytestmark = pytest.mark.usefixtures("switch_off")  # conftest's


def traced_op_types(layer, shape=(2, 6, 6, 3)):
    fn = tf.function(lambda x: layer(x)).get_concrete_function(tf.TensorSpec(shape))
    return {op.type for op in fn.graph.get_operations()}


def test_default_is_off(tmp_path):
    """In a fresh process with TF_RELUPOOL_RECOMPUTE unset (here the switch_off fixture has just
    switched it off, so the module's state says nothing about the default)."""
    code = ("import tf_relupool as t; from tf_relupool import keras_fusion as k;"
            "print('MODE', t.recompute_mode(), t.recompute_enabled(), k.installed())")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_RELUPOOL_RECOMPUTE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("MODE")[-1].split() == ["None", "False", "False"], out.stdout


def test_enable_default_is_lowest_memory_argmax():
    tf_relupool.enable_recompute()
    assert tf_relupool.recompute_mode() == "argmax"
    assert tf_relupool.recompute_enabled() is True
    tf_relupool.enable_recompute("input")
    assert tf_relupool.recompute_mode() == "input"
    tf_relupool.disable_recompute()
    assert tf_relupool.recompute_mode() is None


@pytest.mark.parametrize("bad", ["Argmax", "z", "", 1, None])
def test_enable_rejects_bad_keep(bad):
    with pytest.raises(ValueError, match="keep"):
        tf_relupool.enable_recompute(bad)
    assert tf_relupool.recompute_mode() is None


def test_exact_argument_environment_default_and_restore(monkeypatch):
    """`exact`: a bool, or None for TF_RELUPOOL_EXACT's value (unset: True); other values raise
    ValueError naming the argument or the variable; recompute() restores it."""
    monkeypatch.delenv("TF_RELUPOOL_EXACT", raising=False)
    tf_relupool.enable_recompute()
    assert _state.exact() is True
    for value, expected in (("0", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv("TF_RELUPOOL_EXACT", value)
        tf_relupool.enable_recompute()
        assert _state.exact() is expected, value
    monkeypatch.setenv("TF_RELUPOOL_EXACT", "maybe")
    with pytest.raises(ValueError, match="TF_RELUPOOL_EXACT"):
        tf_relupool.enable_recompute()
    tf_relupool.enable_recompute(exact=False)  # the argument wins over the environment
    assert _state.exact() is False
    with tf_relupool.recompute(exact=True):
        assert _state.exact() is True
    assert _state.exact() is False
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match="`exact`"):
            tf_relupool.enable_recompute(exact=bad)


def test_memory_budget_argument():
    """`memory_budget`: a number in [0, 1] (ValueError naming it otherwise); below 1 it turns
    the activation part on; recompute() restores it, and needs the switch on below 1."""
    assert _state.memory_budget() == 1
    tf_relupool.enable_recompute(memory_budget=0.25)
    assert _state.memory_budget() == 0.25 and _state.activations() is True
    with tf_relupool.recompute(memory_budget=0):
        assert _state.memory_budget() == 0
    assert _state.memory_budget() == 0.25
    tf_relupool.enable_recompute()
    assert _state.memory_budget() == 1 and _state.activations() is False
    for bad in (-0.1, 1.5, "0", True, float("nan"), None):
        with pytest.raises(ValueError, match="`memory_budget`"):
            tf_relupool.enable_recompute(memory_budget=bad)
    with pytest.raises(ValueError, match="needs the switch on"):
        with tf_relupool.recompute(None, memory_budget=0):
            pass
    tf_relupool.disable_recompute()
    assert _state.memory_budget() == 1


def test_context_manager_sets_and_restores_even_on_error():
    with tf_relupool.recompute() as mode:
        assert mode == "argmax" and tf_relupool.recompute_mode() == "argmax"
        with tf_relupool.recompute("input"):
            assert tf_relupool.recompute_mode() == "input"
            with tf_relupool.recompute(None):  # temporarily off
                assert tf_relupool.recompute_mode() is None
            assert tf_relupool.recompute_mode() == "input"
        assert tf_relupool.recompute_mode() == "argmax"
    assert tf_relupool.recompute_mode() is None
    tf_relupool.enable_recompute("input")
    with pytest.raises(KeyError):
        with tf_relupool.recompute(False):
            assert not tf_relupool.recompute_enabled()
            raise KeyError("boom")
    assert tf_relupool.recompute_mode() == "input"
    with pytest.raises(ValueError, match="keep"):
        with tf_relupool.recompute("both"):
            pass


@pytest.mark.parametrize("value,mode", [
    ("0", None), ("off", None), ("OFF", None), ("false", None), ("", None),
    ("1", "argmax"), ("on", "argmax"), ("argmax", "argmax"), (" Argmax ", "argmax"),
    ("input", "input"), ("INPUT", "input")])
def test_parse_env_value(value, mode):
    assert config.parse_env_value(value) == mode


def test_parse_env_value_rejects_unknown():
    with pytest.raises(ValueError, match="TF_RELUPOOL_RECOMPUTE"):
        config.parse_env_value("fast")


def test_environment_read_at_import_in_fresh_process(tmp_path):
    code = ("import warnings, tf_relupool as t; warnings.simplefilter('error');"
            "print('MODE', t.recompute_mode())")
    results = {}
    for value in ("input", "1", "off"):
        env = dict(os.environ, TF_RELUPOOL_RECOMPUTE=value, TF_CPP_MIN_LOG_LEVEL="3")
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        results[value] = out.stdout.split("MODE")[-1].strip()
    assert results == {"input": "input", "1": "argmax", "off": "None"}


def test_bad_environment_value_warns_and_stays_off(monkeypatch):
    monkeypatch.setenv("TF_RELUPOOL_RECOMPUTE", "maybe")
    with pytest.warns(RuntimeWarning, match="TF_RELUPOOL_RECOMPUTE"):
        config._init_from_environment()
    assert tf_relupool.recompute_mode() is None
    monkeypatch.setenv("TF_RELUPOOL_RECOMPUTE", "input")
    config._init_from_environment()
    assert tf_relupool.recompute_mode() == "input"


def test_layer_follows_switch_at_trace_time():
    layer = tf_relupool.ReluMaxPool2D()
    stock = traced_op_types(layer)
    assert {"Relu", "MaxPool"} <= stock and not any("ReluMaxPool" in t for t in stock)
    z = tf.random.stateless_normal((2, 6, 6, 3), seed=[3, 4])
    xla_hlo(forward_and_input_grad(layer), z)   # XLA compiles it (stock ops)
    with tf_relupool.recompute():
        assert "ReluMaxPoolWithWindowArgmax" in traced_op_types(layer)
        xla_hlo(forward_and_input_grad(layer), z)   # the XLA form (tests/test_xla.py)
    with tf_relupool.recompute("input"):
        ops = traced_op_types(layer)
        assert "ReluMaxPool" in ops and "MaxPool" not in ops
    # an explicit keep ignores the switch
    forced = tf_relupool.ReluMaxPool2D(keep="input")
    assert "ReluMaxPool" in traced_op_types(forced)
    tf_relupool.enable_recompute()
    assert "ReluMaxPool" in traced_op_types(forced)


def test_switch_values_are_identical_numerically():
    x = tf.random.stateless_normal([2, 7, 7, 3], seed=[1, 2])
    layer = tf_relupool.ReluMaxPool2D(3, 2, "same")
    outs = []
    for mode in (None, "argmax", "input"):
        with tf_relupool.recompute(mode):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.function(layer)(x)
            outs.append((y.numpy(), tape.gradient(y, x, output_gradients=y + 1).numpy()))
    for y, dx in outs[1:]:
        np.testing.assert_array_equal(y, outs[0][0])
        np.testing.assert_array_equal(dx, outs[0][1])


def test_switch_is_seen_by_other_threads():
    import threading
    seen = []
    with tf_relupool.recompute("input"):
        t = threading.Thread(target=lambda: seen.append(tf_relupool.recompute_mode()))
        t.start()
        t.join()
    assert seen == ["input"]


def test_trace_time_routes_read_the_switch_from_state():
    """_state is the switch's one store: under XLA the trace-time routes (keras_fusion,
    segments) act on its value when traced, and the switch turning on or off installs or removes
    their hooks; the hooks keep no copy of it (installed while the switch is off, they act on
    nothing)."""
    from tf_relupool import keras_fusion, segments
    seen = []

    @tf.function(jit_compile=True)
    def probe(x):
        seen.append((keras_fusion._active(), segments._active()))
        return x
    for keep, activations in ((None, False), ("argmax", False), ("input", True)):
        with tf_relupool.recompute(keep, activations=activations):
            assert (_state.mode(), _state.activations()) == (keep, activations)
            assert segments.installed() is activations
            probe.get_concrete_function(tf.TensorSpec([1 + len(seen)]))
    assert seen == [(False, False), (True, False), (True, True)]
    assert not segments.installed()
    segments.set_enabled(True)  # the hooks alone, the switch off
    try:
        assert segments.installed()
        probe.get_concrete_function(tf.TensorSpec([9]))
        assert seen[-1] == (False, False)
    finally:
        segments.set_enabled(False)
    assert not segments.installed()


def test_python_copies_of_state_h_enums():
    """_state.MODE_CODES is cc/grappler/state.h's `enum Mode`, which the C API takes, and
    _clib.STAT_NAMES has one name per entry of its `enum Stat`, in order."""
    header = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "cc", "grappler", "state.h")
    if not os.path.exists(header):
        pytest.skip("no source tree beside the tests")
    with open(header) as f:
        text = re.sub(r"//[^\n]*", "", f.read())
    mode = re.search(r"enum Mode : int \{([^}]*)\}", text).group(1)
    codes = {name.strip(): int(value) for name, value in
             (item.split("=") for item in mode.split(","))}
    assert codes == {"kOff": _state.MODE_CODES[None], "kArgmax": _state.MODE_CODES["argmax"],
                     "kInput": _state.MODE_CODES["input"]}
    assert set(_state.MODE_CODES) == {None, *_state.KEEP_CHOICES}
    stats = [item.split("=")[0].strip() for item in
             re.search(r"enum Stat : int \{([^}]*)\}", text).group(1).split(",")]
    assert stats[0] == "kCalls" and stats[-1] == "kNumStats"
    assert len(stats) - 1 == len(_clib.STAT_NAMES)
    # the same words (Python's "calls_switch_off" is kCallsOff)
    assert [s.lower() for s in stats[:-1]] == [
        "k" + n.replace("_switch_off", "_off").replace("_", "") for n in _clib.STAT_NAMES]


def test_legacy_tf_keras_warns_once_per_process(monkeypatch):
    """Where tf.keras is Keras 2 (TF_USE_LEGACY_KERAS, tf_keras: tests/test_legacy_keras.py runs
    it for real), turning the switch on warns once what works there; never with it unset."""
    monkeypatch.setattr(config, "_legacy_warned", [])
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "0")
    assert not config.legacy_tf_keras()
    monkeypatch.setattr(config, "legacy_tf_keras", lambda: True)
    with pytest.warns(RuntimeWarning, match="TF_USE_LEGACY_KERAS") as record:
        tf_relupool.enable_recompute()
        tf_relupool.disable_recompute()  # off: no warning
        with tf_relupool.recompute("input", activations=True):
            pass
    warned = [w for w in record if str(w.message) == config.LEGACY_KERAS_WARNING]
    assert len(warned) == 1
    assert warned[0].filename == __file__  # points at the caller of enable_recompute()
