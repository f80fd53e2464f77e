"""The switch's pool fusion under XLA beyond ReLU (tf_relupool/xla.py's MONOTONE, the pattern
table's "monotone_max_pool"): relu6 and leaky ReLU before a max pool, and 1-D max pools. Bitwise
with stock under XLA, ties and saturated windows included. Swish and GELU, not monotone, never
fuse; nor do ELU, SELU, sigmoid and tanh (monotone, but not bitwise after BatchNormalization),
each with its reason."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tf_relupool
from tf_relupool import keras_fusion, xla

from conftest import (assert_bitwise_equal, examples, forward_tensors_the_backward_reads,
                      xla_train_step, xla_value_and_grad)

pytestmark = pytest.mark.usefixtures("switch_off")  # conftest's

#: one builder per MONOTONE row: a test per activation, and a new row without one fails below
ACTIVATIONS = {
    "Relu6": tf.nn.relu6,
    "LeakyRelu": lambda t: tf.nn.leaky_relu(t, alpha=0.2),
    "Elu": tf.nn.elu,
    "Selu": tf.nn.selu,
    "Sigmoid": tf.math.sigmoid,
    "Tanh": tf.math.tanh,
}
DTYPES = (tf.float32, tf.float16, tf.bfloat16, tf.float64)


FUSED = sorted(op for op, row in xla.MONOTONE.items() if not row.not_fused)


def test_every_monotone_row_has_a_builder_here():
    assert set(ACTIVATIONS) == set(xla.MONOTONE)
    assert FUSED == ["LeakyRelu", "Relu6"]


def _fused_count():
    return keras_fusion.stats()["fused_monotone"]


def _ties(rng, shape, dtype, scale):
    """Values on a grid of `scale`: ties everywhere; with scale 10, sigmoid, tanh, relu6 and
    SELU's negative side saturate to equal values too."""
    return tf.constant(rng.integers(-4, 5, size=shape) * scale, dtype)


@settings(max_examples=examples(30), deadline=None)
@given(act=st.sampled_from(FUSED), n=st.integers(1, 2), h=st.integers(2, 9),
       w=st.integers(2, 9), c=st.integers(1, 3),
       k=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       s=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       padding=st.sampled_from(["VALID", "SAME"]), data_format=st.sampled_from(["NHWC", "NCHW"]),
       dtype=st.sampled_from(DTYPES), scale=st.sampled_from([0.5, 10.0]),
       seed=st.integers(0, 2**31 - 1))
def test_monotone_activation_and_pool_bitwise_as_stock(act, n, h, w, c, k, s, padding,
                                                       data_format, dtype, scale, seed):
    """tf.nn.max_pool2d(f(z)) inside XLA, the switch on: fused, forward and dz bit for bit as
    stock XLA's for VALID windows; for SAME windows as stock XLA's VALID pool over f(z) padded
    with -inf, the row-major first maximum (stock's eager kernels' and 2.20's XLA's; 2.21's XLA
    orders some SAME windows' ties otherwise: docs/xla.md)."""
    if padding == "VALID" and (k[0] > h or k[1] > w):
        return
    if data_format == "NCHW" and dtype == tf.bfloat16:
        return  # no CPU kernel for some of the ops stock builds
    rng = np.random.default_rng(seed)
    shape = (n, h, w, c) if data_format == "NHWC" else (n, c, h, w)
    f = ACTIVATIONS[act]
    window = [1, *k, 1] if data_format == "NHWC" else [1, 1, *k]
    strides = [1, *s, 1] if data_format == "NHWC" else [1, 1, *s]
    z = _ties(rng, shape, dtype, scale)

    def pool(t):
        return tf.nn.max_pool2d(f(t), window, strides, padding, data_format=data_format)
    axes = (1, 2) if data_format == "NHWC" else (2, 3)
    dims = xla.pool_geometry([shape[i] for i in axes], window, strides, padding, [], data_format)
    y_shape = list(shape)
    for axis, d in zip(axes, dims):
        y_shape[axis] = d[-1]
    dy = _ties(rng, y_shape, dtype, 0.25) * tf.constant(-1.0, dtype)   # -0s in dy too
    tf_relupool.disable_recompute()
    if padding == "VALID":
        ref = xla_value_and_grad(pool, z, dy)
    else:
        pads = [[0, 0]] * 4
        for axis, d in zip(axes, dims):
            pads[axis] = [d[3], d[4]]

        def valid_over_padded(t):
            a = tf.pad(f(t), pads, constant_values=tf.constant(-np.inf, dtype))
            return tf.nn.max_pool2d(a, window, strides, "VALID", data_format=data_format)
        ref = xla_value_and_grad(valid_over_padded, z, dy)
    before = _fused_count()
    with tf_relupool.recompute():
        got = xla_value_and_grad(pool, z, dy)
    assert _fused_count() == before + 1
    where = f"{act} {shape} k={k} s={s} {padding} {data_format} {dtype.name} scale={scale}"
    assert_bitwise_equal(got[0], ref[0], f"forward {where}")
    assert_bitwise_equal(got[1], ref[1], f"dz {where}")


@pytest.mark.parametrize("act", FUSED)
def test_backward_reads_the_codes_and_the_pooled_output_only(act):
    """Between forward and backward: the uint8 codes and the pool's output (which the next layer
    keeps anyway), no tensor of z's size (stock keeps f(z), and for LeakyRelu z)."""
    shape = [2, 8, 8, 3]
    f = ACTIVATIONS[act]
    with tf_relupool.recompute():
        found = forward_tensors_the_backward_reads(
            lambda z: tf.nn.max_pool2d(f(z), 2, 2, "VALID"), shape)
    shapes = {(t.dtype, tuple(t.shape)) for t in found}
    assert (tf.uint8, (2, 4, 4, 3)) in shapes, shapes
    assert all(tuple(t.shape) != tuple(shape) for t in found
               if t.dtype == tf.float32 and t.op.type != "Placeholder"), shapes


@pytest.mark.parametrize("make,word", [
    (lambda: keras.layers.Activation("swish"), "non-decreasing"),
    (lambda: keras.layers.Activation("gelu"), "non-decreasing"),
    (lambda: keras.layers.Activation("softplus"), "non-decreasing"),
    (lambda: keras.layers.ReLU(max_value=4.0), "non-decreasing"),
    (lambda: keras.layers.LeakyReLU(-0.1), "non-decreasing"),
    (lambda: keras.layers.Activation("tanh"), "BatchNormalization"),
    (lambda: keras.layers.Activation("sigmoid"), "BatchNormalization"),
    (lambda: keras.layers.ELU(), "BatchNormalization"),
    (lambda: keras.layers.Activation("selu"), "BatchNormalization"),
    (lambda: keras.layers.Activation("hard_sigmoid"), "RealDiv")],
    ids=["swish", "gelu", "softplus", "relu_max4", "leaky_negative", "tanh", "sigmoid", "elu",
         "selu", "hard_sigmoid"])
def test_other_activations_do_not_fuse_and_say_why(make, word):
    """swish and GELU are not monotone; softplus and ReLU(max_value=4.) are, but their stock
    gradient reads what the pooled output does not give; leaky ReLU with a negative slope is not
    monotone; tanh, sigmoid, ELU and SELU are not bitwise after BatchNormalization (xla.MONOTONE);
    hard sigmoid is Keras' relu6(x + 3) / 6, whose last op (a division) is no MONOTONE row.
    Each runs stock's pool, with its reason in fusion_report."""
    try:
        layer = make()
    except ValueError:   # a Keras that rejects a negative slope: nothing to fuse
        pytest.skip("this Keras rejects the argument")
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(3, 3, padding="same", name="c")(inp)
    x = keras.layers.MaxPooling2D(2, name="pool")(layer(x))
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(x)))
    before = keras_fusion.stats()["fused"]
    report = tf_relupool.fusion_report(model, batch_size=2, routes="xla")
    assert keras_fusion.stats()["fused"] == before
    (pair,) = [p for p in report.pairs if p["route"] == "xla"]
    assert pair["where"] == "pool" and not pair["fused"]
    assert word in pair["reason"], pair


def _bitwise_steps(build, x, labels, expect_fused):
    """The convolution before the pool has no bias: the sum of dz that a bias gradient is adds in
    the order XLA fuses it, stock's own bits included (docs/xla.md, "What XLA fuses into dz's
    reduction"; tests/test_xla.py::test_bias_gradient_order_follows_xla_fusion)."""
    keras.utils.set_random_seed(0)
    model = build()
    tf_relupool.disable_recompute()
    ref = xla_train_step(model, x, labels)[1]
    before = keras_fusion.stats()["fused"]
    with tf_relupool.recompute():
        got = xla_train_step(model, x, labels)[1]
    assert keras_fusion.stats()["fused"] - before == expect_fused
    assert_bitwise_equal(got[0], ref[0], "loss")
    for v, a, b in zip(model.trainable_variables, got[1], ref[1]):
        assert_bitwise_equal(a, b, v.path)


def test_knowledge_distillation_teacher_bitwise():
    """keras-io's knowledge-distillation teacher (Conv2D -> LeakyReLU(0.2) -> MaxPooling2D(2, 1,
    "same") -> Conv2D), channels scaled down, its first conv without bias: fused, loss and every gradient as stock's."""
    def build():
        inp = keras.Input((12, 12, 1))
        x = keras.layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(inp)
        x = keras.layers.LeakyReLU(negative_slope=0.2)(x)
        x = keras.layers.MaxPooling2D((2, 2), strides=(1, 1), padding="same")(x)
        x = keras.layers.Conv2D(16, 3, strides=2, padding="same")(x)
        return keras.Model(inp, keras.layers.Dense(10)(keras.layers.Flatten()(x)))
    x = tf.random.stateless_normal([4, 12, 12, 1], seed=[5, 6])
    _bitwise_steps(build, x, tf.constant([1, 2, 3, 4]), expect_fused=1)


@pytest.mark.parametrize("data_format", ["channels_last", "channels_first"])
@pytest.mark.parametrize("activation", ["relu", "relu6"])
def test_max_pooling_1d_bitwise(activation, data_format):
    """Conv1D(activation) -> MaxPooling1D, as in keras-io's 1-D examples: channels_last fused
    (the 2-D form over a height of 1, as stock runs it), channels_first not
    (keras_fusion._CHANNELS_FIRST); loss and gradients as stock's. On a GPU, channels_last is
    where XLA would fuse the convolution with a ReLU that is its only reader into one cuDNN call,
    with other bits for z (xla._forward)."""
    def build():
        inp = keras.Input((20, 3) if data_format == "channels_last" else (3, 20))
        x = keras.layers.Conv1D(4, 3, padding="same", activation=activation, use_bias=False,
                                data_format=data_format)(inp)
        x = keras.layers.MaxPooling1D(3, strides=2, padding="same", data_format=data_format)(x)
        x = keras.layers.Conv1D(4, 3, data_format=data_format)(x)
        return keras.Model(inp, keras.layers.Dense(5)(keras.layers.Flatten()(x)))
    shape = [3, 20, 3] if data_format == "channels_last" else [3, 3, 20]
    x = tf.round(tf.random.stateless_normal(shape, seed=[7, 8]) * 2) / 2
    _bitwise_steps(build, x, tf.constant([0, 1, 4]),
                   expect_fused=int(data_format == "channels_last"))


def test_channels_first_1d_pool_says_why():
    keras.utils.set_random_seed(0)
    inp = keras.Input((3, 20))
    x = keras.layers.Conv1D(4, 3, padding="same", activation="relu",
                            data_format="channels_first")(inp)
    x = keras.layers.MaxPooling1D(2, data_format="channels_first", name="pool")(x)
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(x)))
    report = tf_relupool.fusion_report(model, batch_size=2, routes="xla")
    (pair,) = [p for p in report.pairs if p["route"] == "xla"]
    assert not pair["fused"] and "channels_first 1-D pool" in pair["reason"], pair


@pytest.mark.parametrize("activations", [False, True])
@pytest.mark.parametrize("activation", ["relu6", "leaky_relu"])
def test_after_batch_norm(activation, activations):
    """Conv2D -> BatchNormalization -> activation -> MaxPooling2D: fused, bitwise; with
    activations=True the activation is a segment's, and the pool still fuses (reading the
    segment's stock op)."""
    def build():
        inp = keras.Input((8, 8, 2))
        x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inp)
        x = keras.layers.Activation(activation)(keras.layers.BatchNormalization()(x))
        x = keras.layers.MaxPooling2D(2)(x)
        x = keras.layers.Conv2D(4, 3)(x)
        return keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(x)))
    x = tf.random.stateless_normal([2, 8, 8, 2], seed=[9, 10])
    keras.utils.set_random_seed(0)
    model = build()
    tf_relupool.disable_recompute()
    ref = xla_train_step(model, x, tf.constant([0, 2]))[1]
    before = _fused_count()
    with tf_relupool.recompute(activations=activations):
        got = xla_train_step(model, x, tf.constant([0, 2]))[1]
    assert _fused_count() == before + 1
    assert_bitwise_equal(got[0], ref[0], "loss")
    for v, a, b in zip(model.trainable_variables, got[1], ref[1]):
        assert_bitwise_equal(a, b, v.path)


def test_fusion_report_names_the_activation():
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(3, 3, padding="same", name="c")(inp)
    x = keras.layers.MaxPooling2D(2, name="pool")(keras.layers.LeakyReLU(0.1)(x))
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(x)))
    report = tf_relupool.fusion_report(model, batch_size=2, routes="xla")
    (pair,) = report.pairs
    assert pair["where"] == "pool" and pair["fused"] and pair["activation"] == "LeakyRelu"
    # 2x8x8x3 floats the pool's gradient no longer keeps, against 2x4x4x3 one-byte codes
    assert pair["bytes_saved"] == 2 * 8 * 8 * 3 * 4 - 2 * 4 * 4 * 3
    assert "| pool | yes (LeakyRelu) |" in str(report)


@settings(max_examples=examples(25), deadline=None)
@given(act=st.sampled_from(["Relu"] + FUSED), n=st.integers(1, 2), d=st.integers(2, 6),
       h=st.integers(2, 6), w=st.integers(2, 6), c=st.integers(1, 2),
       k=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
       s=st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 2)),
       padding=st.sampled_from(["valid", "same"]),
       dtype=st.sampled_from([tf.float32, tf.float16, tf.bfloat16]),  # MaxPool3D's dtypes
       seed=st.integers(0, 2**31 - 1))
def test_3d_pool_bitwise_as_stock(act, n, d, h, w, c, k, s, padding, dtype, seed):
    """keras.ops.max_pool over a 5-D input (MaxPooling3D's call) after a ReLU, relu6 or leaky
    ReLU, data full of ties, inside XLA: fused, forward and dz bit for bit as stock XLA's for
    VALID windows, and for SAME windows as stock XLA's VALID pool over f(z) padded with -inf
    (the row-major first maximum)."""
    if padding == "valid" and (k[0] > d or k[1] > h or k[2] > w):
        return
    rng = np.random.default_rng(seed)
    f = tf.nn.relu if act == "Relu" else ACTIVATIONS[act]
    z = _ties(rng, (n, d, h, w, c), dtype, 0.5)

    def pool(t):
        return keras.ops.max_pool(f(t), k, s, padding)
    dims = xla.pool_geometry((d, h, w), [1, *k, 1], [1, *s, 1], padding.upper(), [], "NDHWC")
    dy = _ties(rng, (n, *(x[-1] for x in dims), c), dtype, 0.25) * tf.constant(-1.0, dtype)
    tf_relupool.disable_recompute()
    if padding == "valid":
        ref = xla_value_and_grad(pool, z, dy)
    else:
        pads = [[0, 0]] + [[x[3], x[4]] for x in dims] + [[0, 0]]

        def valid_over_padded(t):
            a = tf.pad(f(t), pads, constant_values=tf.constant(-np.inf, dtype))
            return keras.ops.max_pool(a, k, s, "valid")
        ref = xla_value_and_grad(valid_over_padded, z, dy)
    before = keras_fusion.stats()["fused"]
    with tf_relupool.recompute():
        got = xla_value_and_grad(pool, z, dy)
    assert keras_fusion.stats()["fused"] == before + 1
    where = f"{act} {z.shape} k={k} s={s} {padding} {dtype.name}"
    assert_bitwise_equal(got[0], ref[0], f"forward {where}")
    assert_bitwise_equal(got[1], ref[1], f"dz {where}")


def test_3d_image_classification_bitwise():
    """keras-io's 3D_image_classification blocks (Conv3D(relu) -> MaxPool3D(2) ->
    BatchNormalization), scaled down, first convolution without bias: both pools fused, loss and
    every gradient as stock's."""
    def build():
        inp = keras.Input((8, 8, 8, 1))
        x = keras.layers.Conv3D(4, 3, activation="relu", use_bias=False)(inp)
        x = keras.layers.MaxPool3D(2)(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Conv3D(4, 2, activation="relu")(x)
        x = keras.layers.MaxPool3D(2, padding="same")(x)
        return keras.Model(inp, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling3D()(x)))
    x = tf.random.stateless_normal([2, 8, 8, 8, 1], seed=[11, 12])
    _bitwise_steps(build, x, tf.constant([0, 1]), expect_fused=2)
