"""ResNet stem on the GPU, per data format: d/dz of max_pool(pad(relu(z)), 3, 2, VALID), stock
(Relu, Pad, MaxPool and their gradients) vs the fused op on pad(z). Prints differing entries."""
import json, os, sys
import numpy as np
import tensorflow as tf
import tf_relupool
if "det" in sys.argv:
    tf.config.experimental.enable_op_determinism()
rng = np.random.default_rng(0)
def run(dev, fmt, z, dy, fused, keep="argmax"):
    with tf.device(dev):
        z, dy = tf.constant(z), tf.constant(dy)
        pads = [[0, 0], [0, 0], [1, 1], [1, 1]] if fmt == "NCHW" else [[0, 0], [1, 1], [1, 1], [0, 0]]
        with tf.GradientTape() as tape:
            tape.watch(z)
            if fused:
                y = tf_relupool.relu_max_pool2d(tf.pad(z, pads), 3, 2, "VALID", data_format=fmt, keep=keep)
            else:
                y = tf.nn.max_pool2d(tf.pad(tf.nn.relu(z), pads), 3, 2, "VALID", data_format=fmt)
        return y.numpy(), tape.gradient(y, z, output_gradients=dy).numpy()
devs = ["/CPU:0"] + (["/GPU:0"] if tf.config.list_physical_devices("GPU") else [])
out = {}
for case in ("normal", "zeros", "ties"):
    zn = rng.normal(0, 1, (2, 16, 16, 64)).astype(np.float32)
    if case == "zeros":
        zn[rng.uniform(size=zn.shape) < 0.3] = 0.0
        zn[rng.uniform(size=zn.shape) < 0.1] = -0.0
    if case == "ties":
        zn = np.round(zn * 2) / 2
    dyn = (rng.choice([-1, 1], (2, 8, 8, 64)) * 10.0 ** rng.uniform(-2, 8, (2, 8, 8, 64))).astype(np.float32)
    for dev in devs:
        for fmt in (("NHWC", "NCHW") if "GPU" in dev else ("NHWC",)):
            z = zn if fmt == "NHWC" else zn.transpose(0, 3, 1, 2).copy()
            dy = dyn if fmt == "NHWC" else dyn.transpose(0, 3, 1, 2).copy()
            ys, gs = run(dev, fmt, z, dy, False)
            for keep in ("argmax", "input"):
                yf, gf = run(dev, fmt, z, dy, True, keep)
                bad = np.argwhere(gs.view(np.uint32) != gf.view(np.uint32))
                ex = [dict(at=b.tolist(), stock=float(gs[tuple(b)]), fused=float(gf[tuple(b)]),
                           z=float(z[tuple(b)])) for b in bad[:3]]
                out[f"{case} {dev} {fmt} {keep}"] = dict(
                    y_same=ys.tobytes() == yf.tobytes(), ndiff=len(bad),
                    nvalue=int(np.sum(gs != gf)), examples=ex)
for k, v in out.items():
    print(k, v)
