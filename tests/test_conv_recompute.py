"""enable_recompute(memory_budget=b): convolutions recomputed in the backward pass under XLA
(tf_relupool/conv_recompute.py), and the op replay it builds on (tf_relupool/replay.py)."""
import numpy as np
import pytest
import tensorflow as tf

import keras
import tf_relupool
from tf_relupool import replay, segments
from conftest import assert_bitwise_equal, xla_temp_and_digest

pytestmark = pytest.mark.usefixtures("switch_off")  # conftest's


def _block_model(bias, act, batch_norm_read_elsewhere=False):
    """conv -> BN -> act -> depthwise -> BN -> ReLU -> 1x1 conv -> BN -> ReLU -> pool -> Dense
    (MobileNet's shape), seeded initializers."""
    from keras import layers
    init = dict(kernel_initializer=keras.initializers.RandomNormal(seed=1))
    inputs = keras.Input((12, 12, 3))
    x = layers.Conv2D(8, 3, padding="same", use_bias=bias, **init)(inputs)
    y = layers.BatchNormalization()(x)
    x = layers.Activation(act)(y) if isinstance(act, str) else act(y)
    x = layers.DepthwiseConv2D(3, padding="same", use_bias=False,
                               depthwise_initializer=keras.initializers.RandomNormal(seed=2))(x)
    x = layers.BatchNormalization()(x)
    x = layers.ReLU()(x)
    x = layers.Conv2D(6, 1, use_bias=bias, **init)(x)
    x = layers.BatchNormalization()(x)
    x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling2D()(x)
    if batch_norm_read_elsewhere:  # the first BN's output also read by the head
        x = layers.Concatenate()([x, layers.GlobalAveragePooling2D()(y)])
    return keras.Model(inputs, layers.Dense(3, **init)(x))


def _gradients(model, budget):
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 12, 12, 3)).astype("float32"))

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return [loss] + tape.gradient(loss, model.trainable_variables)
    if budget is None:
        return tf.function(step, jit_compile=True)()
    with tf_relupool.recompute(memory_budget=budget):
        return tf.function(step, jit_compile=True)()


@pytest.mark.parametrize("bias,act", [(False, "relu"), (True, "relu"),
                                      (False, keras.layers.ReLU(6.)), (True, "hard_sigmoid")])
def test_blocks_recompute_their_convolution_with_stocks_bits(bias, act):
    """Budget 0: each conv -> BN -> activation is a block whose convolution the backward
    recomputes (its bias, where it has one, replayed with BN), and the loss and every gradient
    are stock's bit for bit (fails where BN's gradient reads a recomputed z beside the
    forward's, or sums it in another order)."""
    model = _block_model(bias, act)
    stock = _gradients(model, None)
    before = segments.stats()
    ours = _gradients(model, 0)
    after = segments.stats()
    blocks = sum(v - before["by_activation"].get(k, 0) for k, v in after["by_activation"].items()
                 if k.startswith("conv+bn+"))
    assert blocks == 3
    assert after["recomputed"] - before["recomputed"] == 3
    assert after["stock"] == before["stock"]
    for a, b in zip(stock, ours):
        assert_bitwise_equal(a, b)


def _residual_model():
    """A stem conv -> BN -> ReLU, then two bottlenecks (1x1 -> 3x3 -> 1x1 convolutions, each
    with BN, the last one's BN added to the identity shortcut before the ReLU: ResNet's identity
    block), seeded initializers."""
    from keras import layers
    init = dict(kernel_initializer=keras.initializers.RandomNormal(seed=1))
    inputs = keras.Input((10, 10, 3))
    x = layers.ReLU()(layers.BatchNormalization()(
        layers.Conv2D(8, 3, padding="same", **init)(inputs)))
    for _ in range(2):
        y = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(4, 1, **init)(x)))
        y = layers.ReLU()(layers.BatchNormalization()(
            layers.Conv2D(4, 3, padding="same", **init)(y)))
        y = layers.BatchNormalization()(layers.Conv2D(8, 1, **init)(y))
        x = layers.ReLU()(layers.Add()([y, x]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(3, **init)(x))


def test_identity_blocks_recompute_through_the_add_with_stocks_bits():
    """Budget 0 on ResNet's identity blocks: the third convolution's BN, the Add of the
    shortcut and the ReLU are a block too (the shortcut recomputed from its own segment), so
    all seven convolutions are recomputed, and the loss and every gradient are stock's (fails
    where the shortcut's gradient is lost or summed in another order)."""
    model = _residual_model()
    x = tf.constant(np.random.default_rng(1).normal(size=(3, 10, 10, 3)).astype("float32"))

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return [loss] + tape.gradient(loss, model.trainable_variables)
    stock = tf.function(step, jit_compile=True)()
    before = segments.stats()
    with tf_relupool.recompute(memory_budget=0):
        ours = tf.function(step, jit_compile=True)()
    after = segments.stats()
    assert after["by_activation"].get("conv+bn+relu", 0) - before["by_activation"].get(
        "conv+bn+relu", 0) == 7
    assert after["recomputed"] - before["recomputed"] == 7
    for a, b in zip(stock, ours):
        assert_bitwise_equal(a, b)


def test_a_bn_output_read_elsewhere_takes_stocks_route():
    """A block whose BN output also feeds another layer is not recomputed (its gradient would
    then be summed from two routes): stock's route, its reason counted, stock's bits."""
    model = _block_model(False, "relu", batch_norm_read_elsewhere=True)
    stock = _gradients(model, None)
    before = segments.stats()
    ours = _gradients(model, 0)
    reasons = segments.stats()["stock_reasons"]
    key = "the BatchNormalization output also feeds other ops"
    assert reasons.get(key, 0) == before["stock_reasons"].get(key, 0) + 1
    for a, b in zip(stock, ours):
        assert_bitwise_equal(a, b)


@pytest.mark.first_pass_only  # AVX2 siblings: the block and pool cases (test-slow runs it there)
def test_mobilenetv2_budgets_are_stocks_bits_and_monotone(tmp_path):
    """keras.applications MobileNetV2 (64x64, batch 4, two SGD steps): every budget trains to
    stock's digest, and XLA's temp buffer never grows as the budget falls: 0.25 at most
    activations=True's (0.5 recomputes the activations alone, the cheapest half of the blocks'
    bytes), 0 below both (fails where a recomputed convolution is merged back into the forward,
    or a block sums a gradient in another order)."""
    digests, temps = xla_temp_and_digest("MobileNetV2", 64, 4, "stock,product,budget25,budget0",
                                         tmp_path, head="logits")
    assert digests["budget0"] == digests["budget25"] == digests["product"] == digests["stock"]
    assert temps["budget0"] <= temps["budget25"] <= temps["product"] < temps["stock"], temps
    assert temps["budget0"] < temps["product"], temps


@pytest.mark.parametrize("act", ["relu", keras.layers.ReLU(6.)])
def test_a_pool_after_a_block_is_fused_on_bns_output(act):
    """conv -> BN -> ReLU (relu6) -> max pool under budget 0: the pool fusion takes the ReLU and
    the pool on BN's output, as it does without a budget (fails where the block's output hides
    the ReLU from the fusion, which then keeps the activation for MaxPoolGrad), with the bits of
    the switch alone (the fusion's bits against stock's are test_xla's)."""
    from keras import layers
    from tf_relupool import keras_fusion
    init = dict(kernel_initializer=keras.initializers.RandomNormal(seed=1))
    inputs = keras.Input((12, 12, 3))
    x = layers.Conv2D(8, 3, padding="same", use_bias=False, **init)(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.Activation(act)(x) if isinstance(act, str) else act(x)
    x = layers.MaxPooling2D(2)(x)
    x = layers.Conv2D(4, 3, padding="same", **init)(x)
    model = keras.Model(inputs, layers.Dense(3, **init)(layers.GlobalAveragePooling2D()(x)))
    alone = _gradients(model, 1)  # the switch alone: the pool fusion on BN's output
    before = keras_fusion.stats()["fused"]
    ours = _gradients(model, 0)
    assert keras_fusion.stats()["fused"] == before + 1
    for a, b in zip(alone, ours):
        assert_bitwise_equal(a, b)


def test_replay_between_and_apply_give_the_traced_values():
    """replay.between lists the ops from a tensor to another (not those around it), and
    replay.apply of them to the same input gives the traced value; a path that goes around the
    source past the limit gives None."""
    @tf.function
    def f(z):
        w = tf.constant([2.0, 3.0])
        side = tf.reduce_sum(w)
        y = tf.nn.relu(z * w + side) - tf.stop_gradient(tf.reduce_mean(z))
        ops = replay.between(z, y)
        assert {op.type for op in ops} >= {"Mul", "AddV2", "Relu", "Mean", "StopGradient",
                                            "Sub"}, [op.type for op in ops]
        assert all(op.type != "Sum" for op in ops)  # side does not depend on z
        assert replay.outside_inputs(ops, z)[0].op.type == "Sum"
        again = replay.apply(ops, {z.name: z})[y.name]
        assert replay.between(z, y, limit=2) is None
        return y, again
    y, again = f(tf.constant([[1.0, -4.0], [0.5, 2.0]]))
    assert_bitwise_equal(y, again)


def test_fusion_report_lists_the_plan_per_block():
    """fusion_report(model, memory_budget=b): each block's row names its activation layer and
    its convolution's choice, z's bytes and FLOPs; 0 recomputes all three convolutions, 1 lists
    no block, and a bad budget is a ValueError naming the argument."""
    model = _block_model(False, "relu")
    at0 = tf_relupool.fusion_report(model, batch_size=4, routes="xla", memory_budget=0)
    blocks = [g for g in at0.segments if g["convolution"]]
    assert len(blocks) == 3 and all(g["convolution"]["recomputed"] for g in blocks)
    names = {layer.name for layer in model.layers}
    assert all(g["where"].split("/")[-1] in names for g in blocks), [g["where"] for g in blocks]
    first = blocks[0]["convolution"]  # 4 x 12 x 12 x 8 fp32; 3x3x3 kernel, 2 FLOPs a MAC
    assert first["bytes"] == 4 * 12 * 12 * 8 * 4 and first["flops"] == 2 * 4 * 12 * 12 * 8 * 27
    assert blocks[0]["bytes_saved"] == 2 * first["bytes"]  # the activation and z
    assert "recomputed: " in str(at0)
    at1 = tf_relupool.fusion_report(model, batch_size=4, routes="xla", memory_budget=1)
    assert at1.segments and not any(g["convolution"] for g in at1.segments)
    for bad in (2, -1, "0"):
        with pytest.raises(ValueError, match="memory_budget"):
            tf_relupool.fusion_report(model, routes="xla", memory_budget=bad)


def test_every_recomputable_consumer_names_a_cost_row():
    """segment_table.CONSUMERS' `recompute` is a recompute_plan.COSTS row or None, and the
    rows a block may start from today are the convolutions and depthwise convolutions."""
    from tf_relupool import recompute_plan, segment_table
    kinds = {row.name: row.recompute for row in segment_table.CONSUMERS}
    assert all(k is None or k in recompute_plan.COSTS for k in kinds.values()), kinds
    assert {n for n, k in kinds.items() if k} == {"conv", "depthwise_conv"}
