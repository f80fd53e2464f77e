"""Tied maxima in max-pool windows under XLA: where stock routes their gradient, and how often a
real model's pool ties.

(a) The minimal case on the visible device (the first GPU, else the CPU): relu -> 3x3 stride-2
    SAME max pool over a 4x4 input of 0.01 whose top-left 3x3 window ties at 0.3 on (1, 2) and
    (2, 1); dz for dy = 1 from stock eager, stock under XLA, stock under XLA with VALID windows
    over the padded input, and the switch (Keras layers under XLA with tf_relupool.recompute()).
    Then, for a few windows, strides, sizes and paddings, every pair of tied positions in every
    window: how many pairs each of stock eager, stock XLA and the switch routes otherwise than to
    the pair's row-major first position.
(b) keras-io GoogleNet's stem: Conv2D(64, 7, strides=2, padding="same", activation="relu") ->
    MaxPooling2D(3, 2, padding="same") on 224x224x3 inputs, then a small head (global average
    pool, Dense(10)). Random normal data (or --data blocks), RMSprop, a few steps at Keras'
    float32 policy. Each step counts, on the stem's relu output as XLA computes it, the windows
    of the stem pool whose maximum is positive and held by two or more positions; compares dz of
    the stem pool for dy = 1 (stock XLA and stock eager against the switch), and the step's
    gradients (stock XLA against the switch, from the same weights). Two copies of the model
    then train N steps each, one with stock's XLA step and one with the switch's, and the script
    prints how many weight arrays differ. --sample-batches counts ties (and compares the stem
    pool's dz where a batch ties) over more random batches at the initial weights.

XLA_FLAGS gets --xla_gpu_deterministic_ops=true and TF_CUDNN_DETERMINISTIC defaults to 1, as in
`make gpu-test`; step 1 also compiles stock's step a second time, as a control (its gradients
must equal the first compilation's). On the GPU: STEPS=ties scripts/tf_gpu.sh.
The figures of 2026-12-05: benchmarks/results/xla_ties_cpu_2026-12-05.txt.

    python benchmarks/xla_ties.py --sample-batches 300   # both parts, on the visible device
    python benchmarks/xla_ties.py --data-seed 1040       # a batch with a tie XLA routes otherwise
    python benchmarks/xla_ties.py --data blocks          # flat image regions
    python benchmarks/xla_ties.py --minimal-only         # (a) alone
"""
import argparse
import os
import subprocess
import sys
import time

# A GPU's XLA is deterministic only with this flag, and two compilations of a step pick the same
# cuDNN algorithms only with cuDNN's deterministic ones (Makefile's gpu-test); no effect on a CPU.
if "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_deterministic_ops=true").strip()
os.environ.setdefault("TF_CUDNN_DETERMINISTIC", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_relupool  # noqa: E402
from tf_relupool import _harness, keras_fusion  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def describe():
    gpus = tf.config.list_physical_devices("GPU")
    device = ("GPU: " + _harness._gpu_description(tf, gpus[0]) if gpus
              else "CPU: " + _harness.cpu_description())
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    lines = [f"device: {device}",
             f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
             f"tf_relupool {getattr(tf_relupool, '__version__', '?')}, "
             f"commit {commit or 'unknown'}",
             f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')} "
             f"TF_CUDNN_DETERMINISTIC={os.environ['TF_CUDNN_DETERMINISTIC']} "
             f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', '(default)')}"]
    if gpus:
        lines.append("TF32: " + ("on" if tf.config.experimental.tensor_float_32_execution_enabled()
                                 else "off"))
    return "\n".join(lines)


def input_gradient(fn, z, dy, jit):
    def run(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            y = fn(z)
        return tape.gradient(y, z, output_gradients=dy)
    return (tf.function(run, jit_compile=True) if jit else run)(z)


def switch_gradient(fn, z, dy):
    before = keras_fusion.stats()["fused"]
    with tf_relupool.recompute():
        dz = input_gradient(fn, z, dy, jit=True)
    if keras_fusion.stats()["fused"] != before + 1:
        raise SystemExit("the switch did not fuse the Keras layers")
    return dz


# ---- (a) the minimal case --------------------------------------------------------------------
def minimal_case():
    z = np.full((1, 4, 4, 1), 0.01, np.float32)
    z[0, :3, :3, 0] = [[.2, .2, .2], [.1, .2, .3], [.26, .3, .07]]
    z, dy = tf.constant(z), tf.ones([1, 2, 2, 1])
    relu, pool = keras.layers.ReLU(), keras.layers.MaxPooling2D(3, 2, "same")

    def stock(t):
        return pool(relu(t))

    def stock_valid(t):  # SAME's padding (bottom/right 1) spelled out, then VALID windows
        return tf.nn.max_pool2d(tf.pad(tf.nn.relu(t), [[0, 0], [0, 1], [0, 1], [0, 0]]),
                                3, 2, "VALID")

    results = {"stock eager": input_gradient(stock, z, dy, jit=False),
               "stock XLA": input_gradient(stock, z, dy, jit=True),
               "stock XLA, VALID over the padded input": input_gradient(stock_valid, z, dy, True),
               "switch (Keras layers, XLA)": switch_gradient(stock, z, dy)}
    print("(a) minimal case: relu -> MaxPooling2D(3, 2, 'same') over 4x4, dy = 1; window (0, 0) "
          "ties at 0.3 on (1, 2) and (2, 1)")
    for name, dz in results.items():
        d = dz.numpy()[0, :, :, 0]
        print(f"  {name}: dz[1, 2] = {d[1, 2]:g}, dz[2, 1] = {d[2, 1]:g}, dz[2, 2] = {d[2, 2]:g}"
              f"; rows {d.tolist()}")
    ref = results["stock eager"].numpy()
    for name, dz in results.items():
        if name != "stock eager":
            print(f"  {name} vs stock eager: "
                  + ("EQUAL" if np.array_equal(dz.numpy(), ref) else "DIFFERENT"))
    print("  every tied pair of in-bounds positions in every window: pairs routed otherwise than "
          "to the row-major first (which pairs: window offsets (row, column), first row-major):")
    for k, s, h, w, padding in ((3, 2, 4, 4, "SAME"), (3, 2, 5, 4, "SAME"), (3, 2, 4, 5, "SAME"),
                                (2, 1, 3, 3, "SAME"), (2, 2, 4, 5, "SAME"), (3, 2, 7, 7, "SAME"),
                                (3, 1, 5, 5, "SAME"), (3, 2, 8, 8, "VALID")):
        pair_sweep(k, s, h, w, padding)


def pair_sweep(k, s, h, w, padding):
    """Every window of a k x k stride-s max pool over h x w, with every pair of its in-bounds
    positions tied at 5 (the rest 0.01), dy = 1 at that window alone: the pairs whose dz does not
    go to the pair's row-major first position, for stock eager, stock XLA and the switch."""
    def dims(n):
        out = -(-n // s) if padding == "SAME" else (n - k) // s + 1
        total = max((out - 1) * s + k - n, 0) if padding == "SAME" else 0
        return out, total // 2, total - total // 2
    (oh, th, bh), (ow, tw, bw) = dims(h), dims(w)
    cases = []
    for oi in range(oh):
        for oj in range(ow):
            r0, c0 = oi * s - th, oj * s - tw
            cells = [(r, c) for r in range(k) for c in range(k)
                     if 0 <= r0 + r < h and 0 <= c0 + c < w]
            cases += [(oi, oj, r0, c0, p, q) for i, p in enumerate(cells) for q in cells[i + 1:]]
    z = np.full((len(cases), h, w, 1), 0.01, np.float32)
    dy = np.zeros((len(cases), oh, ow, 1), np.float32)
    for b, (oi, oj, r0, c0, p, q) in enumerate(cases):
        z[b, r0 + p[0], c0 + p[1], 0] = z[b, r0 + q[0], c0 + q[1], 0] = 5
        dy[b, oi, oj, 0] = 1
    z, dy = tf.constant(z), tf.constant(dy)
    relu, pool = keras.layers.ReLU(), keras.layers.MaxPooling2D(k, s, padding.lower())

    def stock(t):
        return pool(relu(t))

    results = {"stock eager": input_gradient(stock, z, dy, jit=False),
               "stock XLA": input_gradient(stock, z, dy, jit=True),
               "switch": switch_gradient(stock, z, dy)}
    print(f"  {k}x{k}/{s} {padding} over {h}x{w} (padding rows ({th}, {bh}), columns "
          f"({tw}, {bw})), {len(cases)} tied pairs:", end="")
    for name, dz in results.items():
        g = dz.numpy()[:, :, :, 0]
        other = [(p, q) for b, (oi, oj, r0, c0, p, q) in enumerate(cases)
                 if g[b, r0 + p[0], c0 + p[1]] != 1]
        print(f" {name} {len(other)} not row-major"
              + (f" {sorted(set(other))[:6]}" if other else "")
              + ("," if name != "switch" else ""), end="")
    print()


# ---- (b) the GoogleNet stem ------------------------------------------------------------------
def stem_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((224, 224, 3))
    x = keras.layers.Conv2D(64, 7, strides=2, padding="same", activation="relu",
                            name="stem_conv")(inputs)
    x = keras.layers.MaxPooling2D(3, 2, padding="same", name="stem_pool")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(x))


def tied_windows(a, k=3, s=2):
    """Per window of a k x k stride-s SAME max pool over `a` (NHWC): True where the maximum is
    positive and held by two or more positions. Returns (tied mask, pooled maxima)."""
    m = tf.nn.max_pool2d(a, k, s, "SAME")
    h, w = a.shape[1], a.shape[2]
    oh, ow = m.shape[1], m.shape[2]
    ph, pw = max((oh - 1) * s + k - h, 0), max((ow - 1) * s + k - w, 0)
    ap = tf.pad(a, [[0, 0], [ph // 2, ph - ph // 2], [pw // 2, pw - pw // 2], [0, 0]],
                constant_values=-1.0)  # relu(z) >= 0 (NaN-free here): padding never holds a max
    count = tf.zeros(m.shape, tf.int32)
    for di in range(k):
        for dj in range(k):
            shifted = ap[:, di:di + s * (oh - 1) + 1:s, dj:dj + s * (ow - 1) + 1:s, :]
            count += tf.cast(shifted == m, tf.int32)
    return (m > 0) & (count >= 2), m


def make_functions(model):
    stem = model.get_layer("stem_conv")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=True)
    def stem_z(x):  # the stem conv's pre-activation, as the Keras layer computes it, and its output
        z = stem.convolution_op(x, stem.kernel) + tf.reshape(stem.bias, [1, 1, 1, -1])
        return z, stem(x)

    def grads(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    stock = tf.function(grads, jit_compile=True)
    switch = tf.function(grads, jit_compile=True)
    return stem_z, stock, switch


def trace_switch(fn, *args):
    with tf_relupool.recompute():
        return fn.get_concrete_function(*args)


def differing(a, b):
    a, b = np.asarray(a), np.asarray(b)
    bad = a != b
    return int(bad.sum()), (float(np.abs(a - b).max()) if bad.any() else 0.0)


def pool_gradients(dy_shape):
    """Stock eager's, stock XLA's and the switch's (Keras layers under XLA) dz of relu -> the stem
    pool, each a function of z (dy = 1)."""
    relu, pool = keras.layers.ReLU(), keras.layers.MaxPooling2D(3, 2, "same")
    dy = tf.ones(dy_shape)

    def run(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            y = pool(relu(z))
        return tape.gradient(y, z, output_gradients=dy)

    stock_xla, switch = tf.function(run, jit_compile=True), tf.function(run, jit_compile=True)
    return run, stock_xla, switch


def stem(args):
    def batch(seed):
        if args.data == "blocks":  # flat regions: square blocks of one colour (uint8 / 255)
            n = -(-224 // args.block)
            u8 = tf.random.stateless_uniform((args.batch, n, n, 3), [seed, 0], 0, 256, tf.int32)
            x = tf.repeat(tf.repeat(tf.cast(u8, tf.float32) / 255.0, args.block, axis=1),
                          args.block, axis=2)[:, :224, :224]
        else:
            x = tf.random.stateless_normal((args.batch, 224, 224, 3), seed=[seed, 0])
        y = tf.random.stateless_uniform((args.batch,), [seed, 1], 0, 10, tf.int32)
        return x, y

    model, model_switch = stem_model(args.seed), stem_model(args.seed)
    model_switch.set_weights(model.get_weights())
    opt, opt_switch = keras.optimizers.RMSprop(), keras.optimizers.RMSprop()
    stem_z, stock_step, switch_step = make_functions(model)
    _, _, switch_step_s = make_functions(model_switch)
    x0, y0 = batch(0)
    z0 = stem_z(x0)[0]
    dz_eager, dz_xla, dz_switch = pool_gradients((args.batch, 56, 56, 64))
    before = keras_fusion.stats()["fused"]
    for fn, arg in ((switch_step, (x0, y0)), (switch_step_s, (x0, y0)), (dz_switch, (z0,))):
        trace_switch(fn, *arg)  # traced with the switch on; each runs as traced
    if keras_fusion.stats()["fused"] != before + 3:
        raise SystemExit("the switch did not fuse the stem")

    def count(x, always_dz=True):
        """Tied windows, their first few (window, max, tied positions), and how many elements of
        the pool's dz (dy = 1) differ: stock XLA vs the switch, stock eager vs the switch."""
        z, out = stem_z(x)
        a = tf.nn.relu(z)
        tied, m = tied_windows(a)
        where = np.argwhere(tied.numpy())
        shown = []
        an, mn = a.numpy(), m.numpy()
        for b, i, j, c in where[:args.show]:
            rows = slice(2 * i, 2 * i + 3)
            cols = slice(2 * j, 2 * j + 3)
            at = np.argwhere(an[b, rows, cols, c] == mn[b, i, j, c]) + [2 * i, 2 * j]
            shown.append(f"window (batch {b}, row {i}, col {j}, channel {c}): max "
                         f"{mn[b, i, j, c]:.8g} at {[tuple(int(v) for v in p) for p in at]}")
        same_forward = np.array_equal(an, out.numpy())
        if not len(where) and not always_dz:  # no tie (and no NaN): every route is the same
            return 0, shown, 0, 0, same_forward
        s = dz_switch(z).numpy()
        return (len(where), shown, differing(dz_xla(z).numpy(), s)[0],
                differing(dz_eager(z).numpy(), s)[0], same_forward)

    data = ("random normal" if args.data == "normal" else
            f"{args.block}x{args.block}-pixel blocks of one random uint8 / 255 colour")
    print(f"\n(b) keras-io GoogleNet stem: Conv2D(64, 7, strides=2, 'same', relu) -> "
          f"MaxPooling2D(3, 2, 'same') -> GlobalAveragePooling2D -> Dense(10); 224x224x3 {data}, "
          f"batch {args.batch}, RMSprop, jit_compile=True, float32; weights seed {args.seed}, "
          f"step k's batch seed {args.data_seed} + k - 1")
    t0 = time.time()
    for step in range(args.steps):
        x, y = batch(args.data_seed + step)
        n, shown, d_xla, d_eager, same_forward = count(x)
        loss, g = stock_step(x, y)
        loss_s, g_s = switch_step(x, y)  # the switch, from the same weights
        diff = [(v.path, *differing(p, q)) for v, p, q in zip(model.trainable_variables, g, g_s)]
        if step == 0:  # the control: stock's step compiled again
            g_2 = make_functions(model)[1](x, y)[1]
            same = sum(np.array_equal(p.numpy(), q.numpy()) for p, q in zip(g, g_2))
            control = f"stock XLA compiled twice: {same} of {len(g)} gradient arrays equal"
        print(f"step {step + 1}: stem pool windows {args.batch * 56 * 56 * 64:,}, tied positive "
              f"maxima {n} (stem forward as the model's: "
              f"{'same bits' if same_forward else 'DIFFERENT'})"
              + (f"; {control}" if step == 0 else ""))
        for line in shown:
            print("    " + line)
        print(f"  stem pool dz (dy = 1), elements that differ: stock XLA vs switch {d_xla}, "
              f"stock eager vs switch {d_eager}")
        print(f"  gradients from the same weights, stock XLA vs switch: loss "
              f"{'equal' if loss.numpy() == loss_s.numpy() else 'DIFFERENT'}; "
              + "; ".join(f"{p}: {k} differ" + (f" (max |diff| {d:.3g}, of values up to "
                                                  f"{np.abs(np.asarray(gv)).max():.3g})"
                                                  if k else "")
                          for (p, k, d), gv in zip(diff, g)))
        opt.apply_gradients(zip(g, model.trainable_variables))
        _, g_w = switch_step_s(x, y)  # the switch's own copy of the model
        opt_switch.apply_gradients(zip(g_w, model_switch.trainable_variables))
    if args.steps:
        k = sum(not np.array_equal(p.numpy(), q.numpy())
                for p, q in zip(model.weights, model_switch.weights))
        print(f"after {args.steps} steps: {k} of {len(model.weights)} weight arrays differ between "
              f"stock XLA's training and the switch's ({time.time() - t0:.0f} s)")

    if args.sample_batches:
        t0 = time.time()
        stem_model_0 = stem_model(args.seed)  # the initial weights again
        model.get_layer("stem_conv").set_weights(stem_model_0.get_layer("stem_conv").get_weights())
        ties, moved, eager_bad = [], [], 0
        for i in range(args.sample_batches):
            n, shown, d_xla, d_eager, _ = count(batch(1000 + i)[0], always_dz=False)
            ties.append(n)
            eager_bad += d_eager
            if d_xla:
                moved.append(f"seed {1000 + i}: {n} tied, {d_xla} dz elements differ")
        windows = args.batch * 56 * 56 * 64
        print(f"initial weights, {args.sample_batches} more batches of {args.batch} (seeds 1000, "
              f"1001, ...): tied positive maxima per batch {ties}")
        print(f"  {sum(ties)} in {windows * len(ties):,} windows (mean {np.mean(ties):.3g} per "
              f"{windows:,}); batches with a tie: {sum(t > 0 for t in ties)}; batches where stock "
              f"XLA's dz differs from the switch's: {len(moved)} {moved}; stock eager vs switch: "
              f"{eager_bad} dz elements differ (dz compared where a batch ties; "
              f"{time.time() - t0:.0f} s)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", choices=["normal", "blocks"], default="normal",
                   help="normal: N(0, 1) pixels; blocks: --block-pixel squares of one colour, "
                        "random uint8 / 255 (flat regions)")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--data-seed", type=int, default=0,
                   help="step k trains on the batch of seed data-seed + k - 1; --sample-batches "
                        "counts the batches of seeds 1000, 1001, ...")
    p.add_argument("--sample-batches", type=int, default=0,
                   help="count ties over this many more batches at the initial weights")
    p.add_argument("--show", type=int, default=5, help="tied windows printed per step")
    p.add_argument("--minimal-only", action="store_true")
    a = p.parse_args()
    print(describe())
    minimal_case()
    if not a.minimal_only:
        stem(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
