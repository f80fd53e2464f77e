"""Concurrency: many Python threads running the ops at once on shared inputs get exactly the
results of a lone call (the kernels keep no state between calls and only read their inputs).

The C++ side is checked for data races by `make tsan` (tests/cc/kernels_test.cc under
ThreadSanitizer: split work over std::threads, and several threads calling the kernels at once)."""
import threading

import numpy as np
import pytest
import tensorflow as tf

import tf_relupool
from tf_relupool import _geometry
from conftest import assert_bitwise_equal

THREADS = 16
ROUNDS = 4

CASES = [
    # shape, ksize, strides, padding, format, dtype
    ([4, 33, 31, 8], 3, 2, "SAME", "NHWC", tf.float32),    # overlapping windows: gather path
    ([4, 32, 32, 16], 2, 2, "VALID", "NHWC", tf.bfloat16),  # disjoint windows
    ([2, 8, 30, 29], 3, 1, "SAME", "NCHW", tf.float16),
    ([2, 6, 20, 20], [4, 3], [3, 2], "VALID", "NCHW", tf.float64),
]


def _api_results(z, dy, k, s, pad, fmt):
    """The Python API's output and gradient in both backward modes."""
    out = []
    for keep in ("argmax", "input"):
        with tf.GradientTape() as tape:
            tape.watch(z)
            y = tf_relupool.relu_max_pool2d(z, k, s, pad, fmt, keep=keep)
        out += [y, tape.gradient(y, z, output_gradients=dy)]
    return out


def _all_results(lib, z, dy, k, s, pad, fmt):
    """Every op's output for one case: the Python API in both modes and the raw ops."""
    out = _api_results(z, dy, k, s, pad, fmt)
    k4 = _geometry.normalize_window(k, "ksize", fmt)
    s4 = _geometry.normalize_window(s, "strides", fmt)
    attrs = dict(ksize=k4, strides=s4, padding=pad, data_format=fmt)
    y, codes = lib.relu_max_pool_with_window_argmax(z, Targmax=tf.int32, **attrs)
    out += [lib.relu_max_pool(z, **attrs), y, codes, lib.relu_max_pool_grad(z, dy, **attrs),
            lib.relu_max_pool_grad_from_window_argmax(tf.shape(z), dy, codes, **attrs)]
    return [t.numpy() for t in out]


def _compare(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        if g.dtype.kind in "iu":
            np.testing.assert_array_equal(g, w, err_msg=f"{what}: output {i}")
        else:
            assert_bitwise_equal(g, w, f"{what}: output {i}")


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_many_threads_on_shared_inputs_give_identical_results(lib, graph):
    rng = np.random.default_rng(0)
    cases = []
    for shape, k, s, pad, fmt, dtype in CASES:
        z = tf.constant(rng.integers(-3, 4, size=shape) + rng.normal(size=shape) * 0.5, dtype)
        y_shape = tf_relupool.relu_max_pool2d(z, k, s, pad, fmt).shape
        dy = tf.constant(rng.normal(size=y_shape), dtype)
        fn = (lambda z, dy, a=(k, s, pad, fmt): _all_results(lib, z, dy, *a))
        if graph:
            run = tf.function(lambda z, dy, a=(k, s, pad, fmt): _api_results(z, dy, *a))
            fn = (lambda z, dy, run=run: [t.numpy() for t in run(z, dy)])
        cases.append((z, dy, fn, f"{shape} {k} {s} {pad} {fmt} {dtype.name}"))
    expected = [fn(z, dy) for z, dy, fn, _ in cases]  # one thread: the reference

    barrier = threading.Barrier(THREADS)
    errors = []

    def work(t):
        try:
            barrier.wait()
            for r in range(ROUNDS):
                for j in range(len(cases)):
                    i = (j + t + r) % len(cases)  # threads hit different ops at the same time
                    z, dy, fn, what = cases[i]
                    _compare(fn(z, dy), expected[i], f"thread {t} round {r} case {what}")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, (f"{len(errors)} thread(s) failed; first: "
                        f"{type(errors[0]).__name__}: {errors[0]}")


def test_first_load_from_many_threads_at_once(monkeypatch):
    """The library is loaded exactly once even when many threads ask for it at the same moment."""
    import time
    from tf_relupool import _loader
    real_load = _loader._load
    calls = []

    def slow_load(path):
        calls.append(path)
        time.sleep(0.2)  # widen the window in which a second loader could slip in
        return real_load(path)

    monkeypatch.setattr(_loader, "_module", None)  # as before the first use
    monkeypatch.setattr(_loader, "_load", slow_load)
    mods, barrier = [], threading.Barrier(THREADS)

    def f():
        barrier.wait()
        mods.append(_loader.load_library())

    threads = [threading.Thread(target=f) for _ in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(calls) == 1
    assert len(mods) == THREADS and all(m is mods[0] for m in mods)
