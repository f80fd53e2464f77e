"""Which gradients of a small Conv2D -> [BatchNormalization] -> ReLU -> [ZeroPadding2D(1)] ->
3x3/2 max pool -> Dense model differ in their bits between stock and `enable_recompute()` under
jit_compile=True, on the device TensorFlow picks (the CPU, or GPU:0 with XLA's deterministic
mode: run with XLA_FLAGS=--xla_gpu_deterministic_ops=true TF_CUDNN_DETERMINISTIC=1).

    python tests/conv_bn_pool_bits.py [--batches 3,8]

Prints one row per (pad, conv bias, BN, batch): the number of differing elements per weight
(conv kernel, [conv bias], [gamma, beta], dense kernel, dense bias). One process; each model is
traced once by stock and once under the switch, from the same weights and input. The switch
runs with exact=False, so that the pool is fused on every CPU (with exact=True XLA's AVX-512
code gives such a pool stock's route: tf_relupool.xla.reordered_sum_reason).
"""
import argparse
import itertools

import numpy as np


def gradients(tf, keras, tf_relupool, batch, pad, bias, bn, exact=False):
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=bias,
                            kernel_initializer=keras.initializers.RandomNormal(seed=1),
                            bias_initializer=keras.initializers.RandomNormal(seed=3))(inputs)
    if bn:
        x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    if pad:
        x = keras.layers.ZeroPadding2D(1)(x)
    x = keras.layers.MaxPooling2D(3, 2)(x)
    outputs = keras.layers.Dense(2, kernel_initializer=keras.initializers.RandomNormal(seed=2))(
        keras.layers.Flatten()(x))
    model = keras.Model(inputs, outputs)
    data = tf.constant(np.random.default_rng(0).normal(size=(batch, 8, 8, 3)).astype("float32"))

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)
    stock = tf.function(step, jit_compile=True)(data)
    with tf_relupool.recompute(exact=exact):
        switch = tf.function(step, jit_compile=True)(data)
    return [int(np.sum(a.numpy().view(np.uint32) != b.numpy().view(np.uint32)))
            for a, b in zip(stock, switch)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="3,8", help="comma-separated batch sizes (default 3,8)")
    args = p.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
        if min(batches) <= 0:
            raise ValueError
    except ValueError:
        p.error(f"argument --batches: expected positive integers, got {args.batches!r}")
    import tensorflow as tf
    import keras
    import tf_relupool
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {device}")
    print("| pad | conv bias | BN | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|---|---|" + "---|" * len(batches))
    for pad, bias, bn in itertools.product((False, True), repeat=3):
        counts = [gradients(tf, keras, tf_relupool, b, pad, bias, bn) for b in batches]
        yes = lambda v: "yes" if v else "no"  # noqa: E731
        print(f"| {yes(pad)} | {yes(bias)} | {yes(bn)} | "
              + " | ".join(", ".join(map(str, c)) for c in counts) + " |", flush=True)


if __name__ == "__main__":
    main()
