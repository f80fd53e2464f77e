"""Results do not depend on the number of intra-op threads (no atomics, no split-dependent order)."""
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import hashlib, sys
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[1]))
    import tf_relupool
    rng = np.random.default_rng(0)
    digest = hashlib.sha256()
    for shape, k, s, pad, fmt, dtype in [
            ([8, 32, 32, 16], 2, 2, "VALID", "NHWC", tf.float32),
            ([4, 33, 31, 8], 3, 2, "SAME", "NHWC", tf.float32),
            ([4, 8, 30, 29], 3, 1, "SAME", "NCHW", tf.bfloat16),
            ([6, 16, 16, 4], 2, 2, "SAME", "NCHW", tf.float16),
            ([2, 40, 40, 8], 5, 3, "VALID", "NHWC", tf.float64)]:
        z = tf.constant(rng.integers(-3, 4, size=shape) + rng.normal(size=shape), dtype)
        for keep in ("argmax", "input"):
            with tf.GradientTape() as tape:
                tape.watch(z)
                y = tf_relupool.relu_max_pool2d(z, k, s, pad, fmt, keep=keep)
            dy = tf.constant(rng.normal(size=y.shape), dtype)
            dz = tape.gradient(y, z, output_gradients=dy)
            digest.update(y.numpy().tobytes())
            digest.update(dz.numpy().tobytes())
    print(digest.hexdigest())
""")


def _digest(threads, cwd):
    # cwd away from the source tree, so the installed package (with its library) is imported.
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(threads)], capture_output=True,
                         text=True, check=True, cwd=cwd)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("threads", [2, 8])
def test_one_thread_and_many_threads_give_identical_bits(threads, tmp_path):
    assert _digest(1, tmp_path) == _digest(threads, tmp_path)
