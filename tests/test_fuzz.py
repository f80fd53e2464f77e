"""Fuzzing: thousands of random calls (valid and invalid) of every op and the Python API, in
worker processes whose exit status is checked, plus regression tests for what fuzzing found.

The driver is tests/fuzz_ops.py (`make fuzz` runs 10,000+ calls with a chosen seed)."""
import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_ops  # noqa: E402

CALLS = int(os.environ.get("TF_RELUPOOL_FUZZ_CALLS", "3000"))


@pytest.mark.parametrize("seed", [20261130])
def test_fuzzed_calls_never_crash_and_only_raise_named_errors(seed):
    summary = fuzz_ops.run_batches(CALLS, seed, batch=(CALLS + 1) // 2, jobs=2)
    text = fuzz_ops.report(summary, seed, 0)
    print(text)
    assert not summary["crashes"], text
    assert not summary["unexpected"], text
    assert summary["calls"] == CALLS
    counts = summary["counts"]
    # Both sides were exercised: plenty of successful (and sanity-checked) calls and of refusals.
    assert counts["ok"] > CALLS // 4 and counts["InvalidArgumentError"] > CALLS // 20, text
    assert counts["ValueError"] > CALLS // 50, text


def test_fuzz_driver_reports_a_crashing_worker(tmp_path):
    """A worker killed by a signal is counted as a crash with the call to replay."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nkill -SEGV $$\n")
    fake.chmod(0o755)
    summary = fuzz_ops.run_batches(3, seed=1, batch=3, python=str(fake))
    assert summary["counts"]["crash"] >= 1
    assert "died (signal" in summary["crashes"][0]  # 11, or 6 when ASan intercepts it


def _run_isolated(code, tmp_path):
    """Runs `code` in a fresh interpreter (a crash there must not take pytest down)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)


def test_regression_huge_input_shape_is_an_error_not_a_crash(tmp_path):
    # input_shape with INT64_MAX rows overflowed the pooled-size arithmetic (signed overflow),
    # gave a negative dimension and TensorFlow aborted the process with a CHECK failure, both in
    # the kernel (eager) and in the shape function (graph).
    proc = _run_isolated("""
        import tensorflow as tf, tf_relupool
        lib = tf_relupool.load_library()
        attrs = dict(ksize=[1, 2, 1, 1], strides=[1, 2, 1, 1])
        for padding in ("SAME", "VALID"):
            for shape in ([1, 2**63 - 1, 1, 1], [2**62, 1, 1, 1], [1, 1, 2**63 - 1, 1]):
                args = (tf.constant(shape, tf.int64), tf.zeros([1, 1, 1, 1]),
                        tf.zeros([1, 1, 1, 1], tf.uint8))
                try:
                    lib.relu_max_pool_grad_from_window_argmax(*args, padding=padding, **attrs)
                    raise SystemExit("no error for " + str(shape))
                except tf.errors.InvalidArgumentError as e:
                    assert "grad must have the pooled output's shape" in str(e), e
                try:
                    tf.function(lambda: lib.relu_max_pool_grad_from_window_argmax(
                        *args, padding=padding, **attrs)).get_concrete_function()
                    raise SystemExit("no graph error for " + str(shape))
                except ValueError as e:
                    assert "Dimension" in str(e), e
        print("done")
    """, tmp_path)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]


def test_regression_python_api_accepts_input_of_unknown_rank():
    # argmax_dtype_for iterated over the shape: "Cannot iterate over a shape with unknown rank".
    import tf_relupool

    @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
    def f(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            y = tf_relupool.relu_max_pool2d(z, 2, 2, "VALID")
        return y, tape.gradient(y, z)

    y, dz = f(tf.reshape(tf.range(16.0), [1, 4, 4, 1]))
    assert y.numpy().ravel().tolist() == [5, 7, 13, 15]
    assert dz.numpy().sum() == 4


def test_regression_python_api_rejects_huge_windows_with_value_error():
    # ksize / strides above 2**31 - 1 reached the op and came back as InvalidArgumentError.
    import tf_relupool
    for kwargs, name in ((dict(ksize=2**31), "ksize"), (dict(strides=[1, 2**40]), "strides")):
        args = dict(dict(ksize=2, strides=2), **kwargs)
        with pytest.raises(ValueError, match=name):
            tf_relupool.relu_max_pool2d(tf.zeros([1, 4, 4, 1]), padding="VALID", **args)
