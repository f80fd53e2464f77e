"""Tensors past 2**31 elements (bfloat16, 4.3 GB): forward and both backward modes on CPU.

Slow and memory-hungry (peak about 11 GB), so marked slow: `make test-slow` runs it, `make test`
skips it. Correctness is checked against stock TensorFlow on row slices (including the slice that
contains flat element 2**31 and the last rows of the tensor), and the two backward modes and the
two forward ops are compared in full through checksums (the tensors are too big to keep two).
"""
import os
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
import tensorflow as tf

import tf_relupool
from conftest import assert_bitwise_equal

pytestmark = pytest.mark.slow

N, H, W, C = 2, 8192, 16400, 8  # 2,149,580,800 elements > 2**31; element 2**31 is in image 1
NEEDED_GB = 12


def _available_gb():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def _structured_input():
    """z[n, h, w, c] = ((13 n + 31 h + 17 w + 7 c) mod 23) - 11: exact in bfloat16, full of ties
    and of windows with no positive value. Built as a gather of 23 precomputed rows, so the only
    big allocation is z itself. A read off by 2**32 elements (int32 wrap-around) would land 512
    columns away, where the values differ (512 mod 23 != 0)."""
    w = np.arange(W)[:, None]
    c = np.arange(C)[None, :]
    table = np.stack([((j + 17 * w + 7 * c) % 23) - 11 for j in range(23)])  # [23, W, C]
    n = np.arange(N)[:, None]
    h = np.arange(H)[None, :]
    rows = ((13 * n + 31 * h) % 23).reshape(-1)  # residue of each (image, row)
    z = tf.gather(tf.constant(table, tf.bfloat16), tf.constant(rows, tf.int32))
    return tf.reshape(z, [N, H, W, C])


def _checksum(t):
    """CRC of t's bits, computed in row chunks (t.numpy() of the whole could copy 4 GB)."""
    crc = 0
    for n in range(t.shape[0]):
        for r in range(0, t.shape[1], 256):
            a = t[n, r:r + 256].numpy()
            crc = zlib.crc32(memoryview(np.ascontiguousarray(a).view(np.uint8).reshape(-1)), crc)
    return crc


def _stock_slice(z_slice, dy_slice, ksize, strides, padding):
    with tf.GradientTape() as tape:
        tape.watch(z_slice)
        y = tf.nn.max_pool2d(tf.nn.relu(z_slice), ksize, strides, padding)
    return y, tape.gradient(y, z_slice, output_gradients=dy_slice)


# (image, first row, last row + 1) of the input slices checked against stock; rows are even
# (the windows' stride) so that a slice's windows are windows of the whole tensor. Flat element
# 2**31 lies in image 1, row 8176.
SLICES = [(0, 0, 32), (0, H - 32, H), (1, 0, 32), (1, 8160, H)]


@pytest.mark.parametrize("k", [2, 3], ids=["2x2-disjoint", "3x3-overlapping"])
def test_bfloat16_past_2_pow_31_elements(k):
    # Each case in a fresh process, so that its 12 GB are surely given back before the next.
    if _available_gb() < NEEDED_GB:
        pytest.skip(f"needs {NEEDED_GB} GB of available memory, {_available_gb():.1f} GB free")
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", f"import test_huge; test_huge.check({k})"],
                          cwd=here, capture_output=True, text=True, timeout=1800)
    print(proc.stdout[-2000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def check(k):
    lib = tf_relupool.load_library()
    assert N * H * W * C > 2**31
    assert (N * H * W * C - 2**31) // (W * C) < H and 2**31 // (H * W * C) == 1
    s = 2
    attrs = dict(ksize=[1, k, k, 1], strides=[1, s, s, 1], padding="SAME")
    t0 = time.time()
    z = _structured_input()
    out_h, out_w = -(-H // s), -(-W // s)
    rng = np.random.default_rng(0)
    # dy: small integers (exact sums in bfloat16), varying along every dimension.
    base = tf.constant(rng.integers(-3, 4, size=[N, 64, out_w, C]), tf.bfloat16)
    dy = tf.tile(base, [1, out_h // 64, 1, 1])
    t_setup = time.time() - t0

    t0 = time.time()
    y = lib.relu_max_pool(z, **attrs)
    t_fwd = time.time() - t0
    y_sum = _checksum(y)
    y_slices = {sl: y[sl[0]:sl[0] + 1, sl[1] // s:-(-sl[2] // s)].numpy() for sl in SLICES}
    del y
    t0 = time.time()
    y2, codes = lib.relu_max_pool_with_window_argmax(z, Targmax=tf.uint8, **attrs)
    t_fwd_argmax = time.time() - t0
    assert _checksum(y2) == y_sum, "ReluMaxPool and ReluMaxPoolWithWindowArgmax differ"
    del y2

    t0 = time.time()
    dz = lib.relu_max_pool_grad(z, dy, **attrs)
    t_grad_input = time.time() - t0
    dz_sum = _checksum(dz)
    dz_slices = {sl: dz[sl[0]:sl[0] + 1, sl[1]:sl[2]].numpy() for sl in SLICES}
    del dz
    t0 = time.time()
    dz2 = lib.relu_max_pool_grad_from_window_argmax(tf.shape(z, out_type=tf.int64), dy, codes,
                                                    **attrs)
    t_grad_argmax = time.time() - t0
    assert _checksum(dz2) == dz_sum, "the two backward modes differ"
    del dz2, codes

    for sl in SLICES:
        img, r0, r1 = sl
        ys, dzs = _stock_slice(z[img:img + 1, r0:r1], dy[img:img + 1, r0 // s:-(-r1 // s)],
                               attrs["ksize"], attrs["strides"], "SAME")
        # Windows of the slice that are windows of the whole tensor (not cut by the slice's end),
        # and input rows whose every covering window lies in the slice.
        ny = ys.shape[1] if r1 == H else (r1 - r0 - k) // s + 1
        lo = 0 if r0 == 0 else k - 1
        hi = (r1 - r0) if r1 == H else (r1 - r0) - (k - 1)
        assert_bitwise_equal(y_slices[sl][:, :ny], ys.numpy()[:, :ny], f"forward rows {sl}")
        assert_bitwise_equal(dz_slices[sl][:, lo:hi], dzs.numpy()[:, lo:hi], f"gradient rows {sl}")
    print(f"\n{k}x{k}: setup {t_setup:.1f} s, forward {t_fwd:.1f} s, forward+argmax "
          f"{t_fwd_argmax:.1f} s, grad from input {t_grad_input:.1f} s, grad from argmax "
          f"{t_grad_argmax:.1f} s", flush=True)
