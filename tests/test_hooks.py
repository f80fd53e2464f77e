"""tf_relupool/_hooks.py: install, restore-if-ours and the install probe, on plain objects."""
import logging
import types

import tensorflow as tf

from tf_relupool._hooks import Hooks


def _owner():
    return types.SimpleNamespace(f=lambda x: x + 1, g=lambda x: x * 2)


def _wrap(original):
    def wrapper(x):
        return original(x) * 10
    return wrapper


def test_install_wraps_each_target_once_and_remove_restores():
    owner, hooks = _owner(), Hooks()
    f, g = owner.f, owner.g
    assert hooks.install([(owner, "f", _wrap), (owner, "g", _wrap), (owner, "missing", _wrap)])
    assert owner.f(1) == 20 and owner.g(1) == 20 and hooks.original(owner, "f") is f
    assert not hooks.install([(owner, "f", _wrap)])  # installed already: nothing doubled
    assert owner.f(1) == 20
    hooks.remove()
    assert owner.f is f and owner.g is g and not hooks.installed()
    assert hooks.original(owner, "f") is None


def test_remove_leaves_a_wrapper_installed_over_ours():
    owner, hooks = _owner(), Hooks()
    g = owner.g
    hooks.install([(owner, "f", _wrap), (owner, "g", _wrap)])
    theirs = _wrap(owner.f)
    owner.f = theirs
    hooks.remove()
    assert owner.f is theirs and owner.f(1) == 200   # theirs still calls ours
    assert owner.g is g


def test_probe_warns_naming_each_path_not_reached_and_passes_once(caplog):
    hooks, reached = Hooks(), set()

    def traced(x):
        reached.add("a")
        return x
    paths = {"path a": (traced, tf.TensorSpec([1]), lambda: "a" in reached),
             "path b": (lambda x: x, tf.TensorSpec([1]), lambda: "b" in reached),
             "path c": (lambda x: undefined_name, tf.TensorSpec([1]), lambda: True)}  # noqa: F821
    with caplog.at_level(logging.WARNING, logger="tf_relupool"):
        hooks.probe("k", paths, "stock's ops run there")
    (message,) = [r.getMessage() for r in caplog.records]
    assert "path b" in message and "path c (the probe failed" in message
    assert "path a" not in message and "stock's ops run there" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tf_relupool"):
        hooks.probe("k2", {"path a": paths["path a"]}, "x")
        hooks.probe("k2", {"path b": paths["path b"]}, "x")   # k2 passed: not probed again
    assert not caplog.records


def test_probe_traces_a_function_shared_by_paths_once():
    hooks, traces = Hooks(), []

    def traced(x):
        traces.append(1)
        return x
    spec = tf.TensorSpec([1])
    hooks.probe("k", {"a": (traced, spec, lambda: True), "b": (traced, spec, lambda: True)}, "x")
    assert len(traces) == 1 and "k" in hooks._probed
