"""How does stock MaxPoolGrad on the GPU add up the gradients of overlapping windows, per data
format? 3x3/2 VALID on a 5x5 plane: x[2,2] is the max of all four windows; dy = (a,b,c,d).
Prints which summation orders of (a,b,c,d) agree with each device/format over random trials,
and where a tied window sends its gradient."""
import itertools, json, os, sys
if "det" in sys.argv:
    import tensorflow as tf; tf.config.experimental.enable_op_determinism()
import numpy as np
import tensorflow as tf
rng = np.random.default_rng(0)
f32 = np.float32
def orders():
    names = "abcd"
    out = {}
    for p in itertools.permutations(range(4)):
        out["seq " + "".join(names[i] for i in p)] = lambda v, p=p: f32(f32(f32(f32(0) + v[p[0]]) + v[p[1]]) + v[p[2]]) + v[p[3]]
    out["tree (a+b)+(c+d)"] = lambda v: f32(v[0] + v[1]) + f32(v[2] + v[3])
    out["tree (a+c)+(b+d)"] = lambda v: f32(v[0] + v[2]) + f32(v[1] + v[3])
    out["tree (a+d)+(b+c)"] = lambda v: f32(v[0] + v[3]) + f32(v[1] + v[2])
    return out
O = orders()
def grad(dev, fmt, x, dy):
    with tf.device(dev):
        xx, yy = tf.constant(x), tf.constant(dy)
        if fmt == "NCHW":
            xx, yy = tf.transpose(xx, [0, 3, 1, 2]), tf.transpose(yy, [0, 3, 1, 2])
        k, s = ([1, 1, 3, 3], [1, 1, 2, 2]) if fmt == "NCHW" else ([1, 3, 3, 1], [1, 2, 2, 1])
        y = tf.raw_ops.MaxPool(input=xx, ksize=k, strides=s, padding="VALID", data_format=fmt)
        g = tf.raw_ops.MaxPoolGrad(orig_input=xx, orig_output=y, grad=yy, ksize=k, strides=s,
                                   padding="VALID", data_format=fmt)
        if fmt == "NCHW":
            g = tf.transpose(g, [0, 2, 3, 1])
    return g.numpy()
def fused_grad(dev, fmt, x, dy, keep):
    import tf_relupool
    with tf.device(dev):
        xx, yy = tf.constant(x), tf.constant(dy)
        if fmt == "NCHW":
            xx, yy = tf.transpose(xx, [0, 3, 1, 2]), tf.transpose(yy, [0, 3, 1, 2])
        with tf.GradientTape() as tape:
            tape.watch(xx)
            y = tf_relupool.relu_max_pool2d(xx, 3, 2, "VALID", data_format=fmt, keep=keep)
        g = tape.gradient(y, xx, output_gradients=yy)
        if fmt == "NCHW":
            g = tf.transpose(g, [0, 2, 3, 1])
    return g.numpy()
cfgs = [("/CPU:0", "NHWC")]
cfgs += [("/CPU:0", "NCHW")]
if tf.config.list_physical_devices("GPU"):
    cfgs += [("/GPU:0", "NHWC"), ("/GPU:0", "NCHW")]
res = {}
def variants():
    for dev, fmt in cfgs:
        yield dev, fmt, "stock", grad
        for keep in ("argmax", "input"):
            yield dev, fmt, "fused " + keep, lambda d, f, x, dy, keep=keep: fused_grad(d, f, x, dy, keep)
for dev, fmt, what, grad in variants():
    agree = set(O)
    for t in range(200):
        x = rng.uniform(0, 1, (1, 5, 5, 1)).astype(f32); x[0, 2, 2, 0] = 10
        v = (rng.choice([-1, 1], 4) * 10.0 ** rng.uniform(-3, 8, 4)).astype(f32)
        g = grad(dev, fmt, x, v.reshape(1, 2, 2, 1))[0, 2, 2, 0]
        agree = {k for k in agree if O[k](v).tobytes() == f32(g).tobytes()}
    # ties: all 9 values of each window equal
    x = np.ones((1, 5, 5, 1), f32)
    g = grad(dev, fmt, x, np.array([1, 10, 100, 1000], f32).reshape(1, 2, 2, 1))[0, :, :, 0]
    res[f"{dev} {fmt} {what}"] = dict(orders=sorted(agree), ties=g.tolist())
for k, v in res.items():
    print(k, v["orders"], "ties", [[int(t) for t in row[:3]] for row in v["ties"][:3]])
