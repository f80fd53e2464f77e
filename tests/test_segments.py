"""tf_relupool/segments.py and segment_table.py: every activation, consumer and extender of the
tables, recomputed under XLA on the CPU and bitwise with stock.

Reference: the same Keras model trained by stock Keras under tf.function(jit_compile=True), from
the same weights and data (test_bn_relu's `_stock_and_product`: both steps' losses, every
gradient and every weight after two SGD steps, bit for bit). A recomputed activation whose
bits differed from the forward's would show in the next convolution's kernel gradient, which C
computes from the recomputation. The memory checks read XLA's preallocated temp buffer from a
dump of the step's buffer assignment, one subprocess per variant (XLA reads its flags once per
process; Dropout's seeds then match too).
"""
import keras
import pytest
from keras import layers

import tf_relupool
from tf_relupool import segment_table, segments
from conftest import global_policy, xla_temp_and_digest
from test_bn_relu import _stock_and_product

pytestmark = pytest.mark.usefixtures("switch_off")


# Every row of segment_table.ACTIVATIONS, in its Keras forms: (table name, layer factory).
ACTIVATION_CASES = {
    "relu": [lambda: layers.ReLU(), lambda: layers.Activation("relu"),
             lambda: layers.Lambda(lambda x: keras.ops.relu(x))],
    "relu(max_value)": [lambda: layers.ReLU(max_value=4.0)],
    "relu(negative_slope, threshold)": [lambda: layers.ReLU(negative_slope=0.1),
                                        lambda: layers.ReLU(threshold=0.5)],
    "relu6": [lambda: layers.ReLU(6.0), lambda: layers.Activation("relu6")],
    "leaky_relu": [lambda: layers.LeakyReLU(0.2), lambda: layers.Activation("leaky_relu")],
    "elu": [lambda: layers.ELU(), lambda: layers.Activation("elu")],
    "selu": [lambda: layers.Activation("selu")],
    "silu": [lambda: layers.Activation("swish"), lambda: layers.Activation("silu"),
             lambda: layers.Lambda(lambda x: keras.activations.silu(x))],
    "gelu": [lambda: layers.Activation("gelu"),
             lambda: layers.Lambda(lambda x: keras.activations.gelu(x, approximate=False))],
    "hard_sigmoid": [lambda: layers.Activation("hard_sigmoid")],
    "hard_silu": [lambda: layers.Activation("hard_swish"), lambda: layers.Activation("hard_silu"),
                  # Keras 2's MobileNetV3: x * ReLU(6.)(x + 3.) * (1. / 6.) (COMPOSITES), and / 6.
                  lambda: lambda x: layers.Multiply()([x, layers.ReLU(6.0)(x + 3.0) * (1 / 6)]),
                  lambda: lambda x: layers.Multiply()([layers.ReLU(6.0)(x + 3.0) / 6.0, x])],
    "sigmoid": [lambda: layers.Activation("sigmoid")],
    "tanh": [lambda: layers.Activation("tanh")],
    "softplus": [lambda: layers.Activation("softplus")],
    "mish": [lambda: layers.Activation("mish")],
}
# A row's first form in both CPU passes; its other forms (other Keras spellings of the same
# activation, the same XLA computation) in the first only.
_CASES = [pytest.param(name, i, marks=[pytest.mark.first_pass_only] if i else [])
          for name, forms in ACTIVATION_CASES.items() for i in range(len(forms))]


def test_every_table_row_has_a_case():
    """Adding an activation to the table without a case here fails."""
    names = {row.name for row in segment_table.ACTIVATIONS}
    assert names <= set(ACTIVATION_CASES), names - set(ACTIVATION_CASES)


def _block(act, consumer="conv", data_format="channels_last", dtype=None, size=10):
    """conv -> BN -> act -> consumer -> GAP -> Dense."""
    keras.utils.set_random_seed(3)
    shape = (size, size, 4) if data_format == "channels_last" else (4, size, size)
    x = inputs = keras.Input(shape)
    x = layers.Conv2D(8, 3, padding="same", use_bias=False, data_format=data_format,
                      dtype=dtype)(x)
    x = layers.BatchNormalization(axis=-1 if data_format == "channels_last" else 1,
                                  dtype=dtype)(x)
    x = act()(x)
    x = {"conv": lambda: layers.Conv2D(8, 3, padding="same", data_format=data_format,
                                       dtype=dtype),
         "depthwise": lambda: layers.DepthwiseConv2D(3, padding="same", dtype=dtype),
         "separable": lambda: layers.SeparableConv2D(8, 3, padding="same", dtype=dtype),
         "transpose": lambda: layers.Conv2DTranspose(8, 3, strides=2, padding="same",
                                                     dtype=dtype),
         "dense": lambda: layers.Dense(8, dtype=dtype)}[consumer]()(x)
    x = layers.GlobalAveragePooling2D(data_format=data_format, dtype=dtype)(x)
    return keras.Model(inputs, layers.Dense(10, dtype="float32")(x))


@pytest.mark.parametrize("name,form", _CASES)
def test_activation_is_recomputed_and_bitwise(name, form):
    before = segments.stats()["by_activation"].get(name, 0)
    delta = _stock_and_product(_block(ACTIVATION_CASES[name][form]), 4)
    assert delta == dict(segments=1, convs=1, recomputed=1, stock=0, fused=0)
    assert segments.stats()["by_activation"].get(name, 0) == before + 1


@pytest.mark.parametrize("consumer", ["depthwise", "separable", "transpose", "dense"])
@pytest.mark.parametrize("act", ["relu6", "silu"])
def test_every_consumer(consumer, act):
    """Each consumer of the table recomputes its segment for its kernel's gradient."""
    delta = _stock_and_product(_block(ACTIVATION_CASES[act][0], consumer), 4)
    assert delta == dict(segments=1, convs=1, recomputed=1, stock=0, fused=0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("act,form", [("relu6", 0), ("silu", 0), ("gelu", 0), ("hard_silu", 2)])
def test_mixed_precision(policy, act, form):
    with global_policy(policy):
        delta = _stock_and_product(_block(ACTIVATION_CASES[act][form]), 4)
    assert delta == dict(segments=1, convs=1, recomputed=1, stock=0, fused=0)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_composite_whose_h_feeds_another_op_takes_stock_route(policy):
    """Keras 2's hard swish x * h(x) where h(x) = ReLU(6)(x + 3) / 6 is also read elsewhere: the
    segment takes stock's route (stock sums that other path's gradient into h), bitwise."""
    def act():
        def apply(x):
            h = layers.ReLU(6.0)(x + 3.0) / 6.0
            return layers.Add()([layers.Multiply()([x, h]), h])
        return apply
    with global_policy(policy):
        delta = _stock_and_product(_block(act), 4)
    assert delta == dict(segments=1, convs=0, recomputed=0, stock=1, fused=0)


def test_channels_first():
    delta = _stock_and_product(_block(ACTIVATION_CASES["silu"][0],
                                      data_format="channels_first"), 4)
    assert delta == dict(segments=1, convs=1, recomputed=1, stock=0, fused=0)


def _mbconv(act="swish", se=True, pad=False):
    """EfficientNet's MBConv (expand, depthwise, squeeze-and-excitation, project) or, without
    SE and with ReLU(6.), MobileNetV2's inverted residual; `pad`: the stride-2 form with
    ZeroPadding2D before the depthwise conv."""
    keras.utils.set_random_seed(5)
    make = (lambda: layers.ReLU(6.0)) if act == "relu6" else (lambda: layers.Activation(act))
    x = inputs = keras.Input((12, 12, 8))
    x = make()(layers.BatchNormalization()(layers.Conv2D(16, 1, use_bias=False)(x)))
    if pad:
        x = layers.ZeroPadding2D(((0, 1), (0, 1)))(x)
    x = layers.DepthwiseConv2D(3, strides=2 if pad else 1, padding="valid" if pad else "same",
                               use_bias=False)(x)
    x = make()(layers.BatchNormalization()(x))
    if se:
        s = layers.Reshape((1, 1, 16))(layers.GlobalAveragePooling2D()(x))
        s = layers.Conv2D(4, 1, activation=act)(s)
        s = layers.Conv2D(16, 1, activation="sigmoid")(s)
        x = layers.multiply([x, s])
    x = layers.BatchNormalization()(layers.Conv2D(8, 1, use_bias=False)(x))
    if not pad:
        x = layers.Add()([x, inputs])
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10)(x))


@pytest.mark.parametrize("act,se,pad,segs", [("swish", True, False, 3), ("swish", False, True, 3),
                                             ("relu6", False, False, 2),
                                             ("relu6", False, True, 3)])
def test_extenders_gate_and_zero_pad(act, se, pad, segs):
    """The SE multiply and a zero pad continue a segment: x is recomputed for the gate's
    gradient and the projection's kernel gradient, the pad's output for the depthwise kernel's."""
    delta = _stock_and_product(_mbconv(act, se, pad), 4)
    assert delta == dict(segments=segs, convs=2, recomputed=segs, stock=0, fused=0)


def test_activation_of_an_activation():
    """A segment's output into another activation (ReLU after ReLU): one chain, each G stock's
    gradient at its own input."""
    keras.utils.set_random_seed(6)
    inputs = keras.Input((8, 8, 4))
    x = layers.BatchNormalization()(layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs))
    x = layers.Activation("tanh")(layers.ReLU(6.0)(x))
    x = layers.GlobalAveragePooling2D()(layers.Conv2D(8, 3, padding="same")(x))
    model = keras.Model(inputs, layers.Dense(10)(x))
    delta = _stock_and_product(model, 4)
    assert delta == dict(segments=2, convs=1, recomputed=2, stock=0, fused=0)


def test_output_read_elsewhere_takes_stocks_route():
    """An activation output that a Flatten + Dense also reads (its kernel gradient keeps it):
    stock's route, named in the stats."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((6, 6, 4))
    a = layers.Activation("swish")(layers.BatchNormalization()(
        layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)))
    x = layers.GlobalAveragePooling2D()(layers.Conv2D(8, 3, padding="same")(a))
    x = layers.Concatenate()([x, layers.Flatten()(a)])
    model = keras.Model(inputs, layers.Dense(10)(x))
    before = segments.stats()["stock_reasons"]
    delta = _stock_and_product(model, 4)
    assert delta == dict(segments=1, convs=1, recomputed=0, stock=1, fused=0)
    reasons = segments.stats()["stock_reasons"]
    assert any("silu output also feeds" in r and reasons[r] > before.get(r, 0) for r in reasons)


def _convnext_block():
    """ConvNeXt's block: depthwise 7x7 -> LayerNormalization -> Dense(4C) -> GELU -> Dense(C) ->
    residual Add: the GELU's input is a Dense output, no BatchNormalization."""
    keras.utils.set_random_seed(8)
    inputs = keras.Input((8, 8, 16))
    x = layers.LayerNormalization(epsilon=1e-6)(layers.DepthwiseConv2D(7, padding="same")(inputs))
    x = layers.Dense(16)(layers.Activation("gelu")(layers.Dense(64)(x)))
    x = layers.GlobalAveragePooling2D()(layers.Add()([inputs, x]))
    return keras.Model(inputs, layers.Dense(10)(x))


def _conv_activation(act):
    """Conv2D(activation=act) twice, then a Conv2D: the activations' inputs are conv outputs."""
    keras.utils.set_random_seed(9)
    inputs = keras.Input((8, 8, 4))
    x = layers.Conv2D(8, 3, padding="same", activation=act)(inputs)
    x = layers.Conv2D(8, 3, padding="same", activation=act)(x)
    x = layers.GlobalAveragePooling2D()(layers.Conv2D(8, 3, padding="same")(x))
    return keras.Model(inputs, layers.Dense(10)(x))


@pytest.mark.parametrize("build,segs", [
    (_convnext_block, 1),
    (lambda: _conv_activation("swish"), 2), (lambda: _conv_activation("gelu"), 2),
    (lambda: _conv_activation("leaky_relu"), 2), (lambda: _conv_activation("mish"), 2),
    (lambda: _conv_activation("relu"), 0), (lambda: _conv_activation("tanh"), 0)],
    ids=["convnext", "swish", "gelu", "leaky_relu", "mish", "relu", "tanh"])
def test_identity_producer(build, segs):
    """PRODUCERS' identity: an activation whose gradient reads its input (the table's
    reads_input) starts a segment at that input whatever made it (a Dense's, a conv's output),
    keeping it alone; ReLU and tanh, whose gradients read their output, do not."""
    delta = _stock_and_product(build(), 4)
    assert delta == dict(segments=segs, convs=segs, recomputed=segs, stock=0, fused=0)


def test_identity_producer_skips_per_channel_tensors():
    """An SE block's squeeze ([N, 1, 1, C]) into Conv2D(activation="swish"): nothing worth
    recomputing, no segment."""
    keras.utils.set_random_seed(10)
    inputs = keras.Input((6, 6, 8))
    s = layers.Reshape((1, 1, 8))(layers.GlobalAveragePooling2D()(inputs))
    s = layers.Conv2D(8, 1, activation="sigmoid")(layers.Conv2D(4, 1, activation="swish")(s))
    x = layers.GlobalAveragePooling2D()(layers.multiply([inputs, s]))
    delta = _stock_and_product(keras.Model(inputs, layers.Dense(10)(x)), 4)
    assert delta["segments"] == 0


# ---- the saving on keras.applications models: XLA's temp buffer, one process per variant ----

# MobileNetV2 and EfficientNetB0 take minutes each (`make test-slow`); MobileNetV3Small, which
# has a ReLU, SE gates, hard swish and a segment on stock's route, runs in `make test`'s first
# pass (the AVX2 pass: each activation row's first form above; test-slow's AVX2 pass runs it).
@pytest.mark.parametrize("name,size", [
    pytest.param("MobileNetV2", 64, marks=pytest.mark.slow),
    pytest.param("EfficientNetB0", 64, marks=pytest.mark.slow),
    pytest.param("MobileNetV3Small", 96, marks=pytest.mark.first_pass_only)])
def test_application_trains_bitwise_with_a_smaller_temp_buffer(name, size, tmp_path):
    """keras.applications' MobileNetV2 (ReLU(6.), zero pads), EfficientNetB0 (swish, SE gates,
    dropout) and MobileNetV3Small (ReLU into SE gates, hard swish) under jit_compile=True on the
    CPU: two SGD steps bitwise with stock, every segment recomputed, XLA's temp buffer
    smaller."""
    # one process per variant: Dropout's seeds are drawn as in a fresh process for both
    stock, stock_temp = xla_temp_and_digest(name, size, 4, "stock", tmp_path, head="logits")
    product, product_temp = xla_temp_and_digest(name, size, 4, "product", tmp_path,
                                                head="logits")
    assert product["product"] == stock["stock"]
    assert product["stats"]["recomputed"] > 0, product
    # MobileNetV3Small: one segment on stock's route, its reason in the stats
    assert product["stats"]["stock"] == (name == "MobileNetV3Small"), product
    assert product_temp["product"] < stock_temp["stock"], (product_temp, stock_temp)
