"""tf_relupool/bn_relu.py: the switch's BatchNorm + ReLU recomputation under XLA (bn_relu=True).

Reference: the same Keras model trained by stock Keras under tf.function(jit_compile=True) on
the CPU, from the same weights and data. "Bitwise": both steps' losses, every gradient of both
steps and every variable after two SGD steps (BN's moving statistics included) have the same
bytes. The memory checks read XLA's preallocated temp buffer from a dump of the step's buffer
assignment (one subprocess per model: XLA reads its flags once per process).
"""
import inspect
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

import tf_relupool
from tf_relupool import _example_models, _versions, gradient_sources, keras_fusion, segments
from conftest import (assert_bitwise_equal, global_policy, optimized_hlo_shape, sgd_step,
                      xla_temp_and_digest)

LR = 0.01


pytestmark = pytest.mark.usefixtures("switch_off")  # conftest's


def _data(model, batch, seed=0, classes=10):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch,) + tuple(model.input.shape[1:])).astype("float32")
    return tf.constant(x), tf.constant(rng.integers(0, classes, (batch,)).astype("int32"))


def _train(model, x, y, init, steps=2, from_logits=True):
    """[(loss, grads)] of `steps` SGD steps in one jit-compiled function from the weights
    `init`, and every weight after them."""
    model.set_weights(init)
    step = sgd_step(model, LR, from_logits)
    out = [step(x, y) for _ in range(steps)]
    return out, [w.numpy() for w in model.weights]


def _assert_same_training(got, ref, model):
    (steps, weights), (ref_steps, ref_weights) = got, ref
    for s, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(steps, ref_steps)):
        assert_bitwise_equal(loss, ref_loss, f"step {s} loss")
        for g, r, v in zip(grads, ref_grads, model.trainable_variables):
            assert g is not None
            assert_bitwise_equal(g, r, f"step {s} gradient of {v.path}")
    for w, r, v in zip(weights, ref_weights, model.weights):
        assert_bitwise_equal(w, r, f"{v.path} after {len(steps)} steps")


# What a model whose BN -> ReLU feeds a max pool is compared with: stock on TensorFlow 2.21; the
# switch alone on 2.20, whose CPU XLA sums BN's gamma/beta gradients below the pool switch's
# stem in another order than stock's (docs/xla.md, "What XLA fuses into dz's reduction").
_POOL_SWITCH_REFERENCE = None if _versions.minor(tf.__version__) >= (2, 21) else "argmax"


def _stock_and_product(model, batch, from_logits=True, reference=None):
    """Trains `model` as stock (or under `recompute(reference)`) and under
    enable_recompute(bn_relu=True); asserts bitwise equality; returns the change of
    segments.stats() and keras_fusion.stats() in the product."""
    init = model.get_weights()
    x, y = _data(model, batch)
    with tf_relupool.recompute(reference):
        ref = _train(model, x, y, init, from_logits=from_logits)
    before, fused = segments.stats(), keras_fusion.stats()["fused"]
    with tf_relupool.recompute(bn_relu=True):
        got = _train(model, x, y, init, from_logits=from_logits)
    after = segments.stats()
    _assert_same_training(got, ref, model)
    delta = {k: after[k] - before[k] for k in ("segments", "convs", "recomputed", "stock")}
    delta["fused"] = keras_fusion.stats()["fused"] - fused
    return delta


# ---- models -------------------------------------------------------------------------------

def _conv_bn_relu_conv(relu="activation", data_format="channels_last", size=12):
    keras.utils.set_random_seed(3)
    shape = (size, size, 4) if data_format == "channels_last" else (4, size, size)
    axis = -1 if data_format == "channels_last" else 1
    x = inputs = keras.Input(shape)
    x = layers.Conv2D(8, 3, padding="same", use_bias=False, data_format=data_format)(x)
    x = layers.BatchNormalization(axis=axis)(x)
    x = layers.Activation("relu")(x) if relu == "activation" else layers.ReLU()(x)
    x = layers.Conv2D(8, 3, padding="same", data_format=data_format)(x)
    x = layers.GlobalAveragePooling2D(data_format=data_format)(x)
    return keras.Model(inputs, layers.Dense(10)(x))


def _residual(shortcut, size=10):
    """conv -> BN -> ReLU -> conv -> BN, Add with a projection (conv -> BN) or identity
    shortcut, ReLU, conv."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((size, size, 8))
    a = layers.ReLU()(layers.BatchNormalization()(
        layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)))
    y = layers.BatchNormalization()(layers.Conv2D(8, 3, padding="same", use_bias=False)(a))
    if shortcut == "projection":
        s = layers.BatchNormalization()(layers.Conv2D(8, 1, use_bias=False)(inputs))
    else:
        s = a
    x = layers.ReLU()(layers.Add()([y, s]))
    x = layers.Conv2D(8, 3, padding="same")(x)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10)(x))


# ---- (a), (b): small models ---------------------------------------------------------------

@pytest.mark.parametrize("relu,data_format", [("activation", "channels_last"),
                                              ("layer", "channels_last"),
                                              ("layer", "channels_first")])
def test_conv_bn_relu_conv_bitwise_and_recomputed(relu, data_format):
    delta = _stock_and_product(_conv_bn_relu_conv(relu, data_format), 4)
    assert delta == dict(segments=1, convs=1, recomputed=1, stock=0, fused=0)


@pytest.mark.parametrize("bn_kwargs", [dict(center=False), dict(scale=False),
                                       dict(momentum=0.9, epsilon=1e-5)])
def test_bn_options_bitwise_and_recomputed(bn_kwargs):
    delta = _stock_and_product(_block(bn_kwargs), 4)
    assert delta == dict(segments=1, convs=1, recomputed=1, stock=0, fused=0)


@pytest.mark.parametrize("shortcut", ["projection", "identity"])
def test_bn_add_relu_bitwise_and_recomputed(shortcut):
    delta = _stock_and_product(_residual(shortcut), 4)
    # relu(bn(conv)) and relu(bn(conv) + shortcut); the identity shortcut is the first ReLU's
    # output, kept as a tensor by the second segment
    assert delta == dict(segments=2, convs=2, recomputed=2, stock=0, fused=0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("model", ["activation", "projection", "identity"])
def test_mixed_precision_bitwise_and_recomputed(policy, model):
    """Under a mixed policy Keras' BN normalizes in float32 between two casts; the recomputation
    starts from stock's float32 cast of the input (where the gradient is summed as stock sums
    it) and repeats the cast back."""
    with global_policy(policy):
        built = _conv_bn_relu_conv("activation") if model == "activation" else _residual(model)
        bns = [l for l in built.layers if isinstance(l, layers.BatchNormalization)]
        assert bns and all(l.compute_dtype == policy[len("mixed_"):] for l in bns)
        delta = _stock_and_product(built, 4)
    n = 1 if model == "activation" else 2
    assert delta == dict(segments=n, convs=n, recomputed=n, stock=0, fused=0)


def test_keras_fit_bitwise():
    """model.fit with jit_compile=True: the weights after two epochs are stock's."""
    x, y = _data(_conv_bn_relu_conv(), 16)

    def fit(**switch):
        model = _conv_bn_relu_conv()
        model.compile(keras.optimizers.SGD(0.05),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=True)
        with tf_relupool.recompute(**switch):
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()
    ref = fit(keep=None)
    before = segments.stats()["recomputed"]
    got = fit(bn_relu=True)
    assert segments.stats()["recomputed"] > before
    for g, r in zip(got, ref):
        assert_bitwise_equal(g, r)


# ---- (c), (d): the examples' ResNet-style CNN and keras.applications' ResNet50 -------------

def test_example_resnet_bitwise_and_stem_stays_with_the_pool_fusion():
    """Seven BN + ReLU segments; the stem's ReLU feeds the max pool: the pool fusion takes it
    (its G never gets a gradient), the six others recompute. Bitwise with stock on TensorFlow
    2.21; on 2.20 with the switch alone, because there the pool switch's stem (conv -> BN ->
    ReLU -> max pool) is not bitwise with stock under the CPU's XLA (the stem conv's kernel
    gradient, 1054 of 1728 elements, last bits, measured 2026-12-04; docs/xla.md)."""
    keras.utils.set_random_seed(5)
    delta = _stock_and_product(_example_models.resnet(input_shape=(16, 16, 3)), 4,
                               reference=_POOL_SWITCH_REFERENCE)
    assert delta == dict(segments=7, convs=7, recomputed=6, stock=0, fused=1)


@pytest.mark.slow  # ResNet50's stem under XLA stays in make test: test_xla's stem test
def test_resnet50_bitwise_with_stock():
    """keras.applications.ResNet50 (weights=None) at 32x32, batch 2: 49 BN + ReLU segments, 48
    recomputing (the stem's ReLU stays with the pool fusion, through its ZeroPadding2D), 50
    convolutions of a segment's output, bitwise with stock under the CPU's XLA on TensorFlow
    2.21 (the stem's BatchNormalization sums dz as stock's does: docs/xla.md, "What XLA fuses
    with a sum of dz"), with the switch alone on 2.20 (its XLA orders the stem's sums
    otherwise)."""
    keras.utils.set_random_seed(6)
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3))
    delta = _stock_and_product(model, 2, from_logits=False, reference=_POOL_SWITCH_REFERENCE)
    assert delta == dict(segments=49, convs=50, recomputed=48, stock=0, fused=1)


# ---- gradients with respect to tensors the rewrite skips ----------------------------------

def _exposed(which):
    """A model that also outputs an inner tensor: the BN output y ("bn"), the Add's output
    ("add"), or the ReLU output ("relu", what the tape sees under the rewrite too)."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((8, 8, 4))
    y = layers.BatchNormalization()(layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs))
    s = layers.BatchNormalization()(layers.Conv2D(8, 1, use_bias=False)(inputs))
    u = layers.Add()([y, s])
    a = layers.ReLU()(u)
    x = layers.GlobalAveragePooling2D()(layers.Conv2D(8, 3, padding="same")(a))
    return keras.Model(inputs, [{"bn": y, "add": u, "relu": a}[which], layers.Dense(3)(x)])


def _grads_wrt_inner(model, x, symbolic=False):
    def fn(x):
        if symbolic:  # no tape: tf.gradients
            inner, logits = model(x, training=True)
            return tf.gradients(tf.reduce_sum(logits[:, 1]), [inner] + model.trainable_variables)
        with tf.GradientTape() as tape:
            inner, logits = model(x, training=True)
            score = tf.reduce_sum(logits[:, 1])
        return tape.gradient(score, [inner] + model.trainable_variables)
    return fn


@pytest.mark.parametrize("which,symbolic", [("bn", False), ("add", False), ("relu", False),
                                            ("bn", True)])
def test_gradient_with_respect_to_a_skipped_tensor_is_stock(which, symbolic):
    """Grad-CAM style `tape.gradient(score, [inner] + weights)`: stock's bits, never None. For
    the BN output and the Add's output (which the rewrite skips) G takes stock's route; the ReLU
    output is G's output, what the tape sees, so the recomputation stays."""
    model = _exposed(which)
    init = model.get_weights()
    x, _ = _data(model, 3)
    ref = tf.function(_grads_wrt_inner(model, x, symbolic), jit_compile=True)(x)
    model.set_weights(init)
    before, routes = segments.stats(), gradient_sources.stats()
    with tf_relupool.recompute(bn_relu=True):
        got = tf.function(_grads_wrt_inner(model, x, symbolic), jit_compile=True)(x)
    after, now = segments.stats(), gradient_sources.stats()
    assert after["segments"] == before["segments"] + 1
    if which == "relu":
        assert after["recomputed"] == before["recomputed"] + 1
    else:
        assert after["stock"] == before["stock"] + 1
        assert after["recomputed"] == before["recomputed"]
        route = gradient_sources.UNKNOWN if symbolic else gradient_sources.SOURCE
        assert now[route] > routes[route]
    assert got[0] is not None
    for g, r in zip(got, ref):
        assert_bitwise_equal(g, r)


def _jacobians(model):
    def jacobians(x):
        with tf.GradientTape(persistent=True) as tape:
            inner, logits = model(x, training=True)
            score = logits[:, 1]
        return (tape.jacobian(score, inner), tape.batch_jacobian(logits, inner),
                tape.jacobian(score, model.trainable_variables[0]))
    return jacobians


def test_jacobians_are_stock():
    """jacobian / batch_jacobian (pfor over the gradient) with respect to the BN output and a
    kernel: stock's bits (a gradient with respect to the BN output: stock's route)."""
    model = _exposed("bn")
    x, _ = _data(model, 2)
    jacobians = _jacobians(model)
    init = model.get_weights()
    ref = tf.function(jacobians, jit_compile=True)(x)
    model.set_weights(init)
    before = segments.stats()
    with tf_relupool.recompute(bn_relu=True):
        got = tf.function(jacobians, jit_compile=True)(x)
    assert segments.stats()["segments"] == before["segments"] + 1
    assert segments.stats()["recomputed"] == before["recomputed"]
    for g, r in zip(got, ref):
        assert_bitwise_equal(g, r)


@pytest.mark.parametrize("case", ["jacobians", "bn", "add", "bn_symbolic"])
def test_stock_route_compiles_to_stock_hlo(case):
    """Where a segment's gradient takes stock's route, the step XLA compiles is stock's,
    instruction for instruction after XLA's optimizations (names aside): so its bits are stock's
    on every CPU, not only where the tests run. (Once the segment's C recomputed beside G's stock
    route: bitwise here, 434 of 2048 jacobian elements off on an AVX2-only CPU.) On a GPU the
    same instructions, whose grouping into kernels can differ: XLA's sibling multi-output fusion
    put the two BNs' gradient reductions into other kernels (the gradient ops built in another
    order; H100, 2026-12-06), each reduction computed alike (the values: the test above)."""
    which = "bn" if case == "jacobians" else case.split("_")[0]
    model = _exposed(which)
    x, _ = _data(model, 2)
    fn = (_jacobians(model) if case == "jacobians"
          else _grads_wrt_inner(model, x, symbolic=case.endswith("symbolic")))
    kernels = not tf.config.list_physical_devices("GPU")
    ref = optimized_hlo_shape(fn, x, kernels=kernels)
    before = segments.stats()
    with tf_relupool.recompute(bn_relu=True):
        got = optimized_hlo_shape(fn, x, kernels=kernels)
    assert segments.stats()["stock"] > before["stock"]
    assert segments.stats()["recomputed"] == before["recomputed"]
    assert got == ref


def test_recomputed_route_changes_the_hlo():
    """The comparison above can fail, in both forms: where the segment recomputes, the compiled
    step is not stock's (the kernel gradient's copy of the ReLU output comes from z)."""
    model = _exposed("relu")
    x, _ = _data(model, 2)
    fn = _grads_wrt_inner(model, x)
    ref = [optimized_hlo_shape(fn, x, kernels=k) for k in (True, False)]
    with tf_relupool.recompute(bn_relu=True):
        got = [optimized_hlo_shape(fn, x, kernels=k) for k in (True, False)]
    assert got[0] != ref[0] and got[1] != ref[1]


# ---- what is not covered is not rewritten -------------------------------------------------

def _block(bn_kwargs=None, relu=None, after=None, dtype=None):
    keras.utils.set_random_seed(8)
    inputs = keras.Input((8, 8, 4))
    x = layers.Conv2D(8, 3, padding="same", use_bias=False, dtype=dtype)(inputs)
    x = layers.BatchNormalization(dtype=dtype, **(bn_kwargs or {}))(x)
    x = (relu or layers.ReLU)()(x)
    if after == "dense":  # Flatten + Dense keep the ReLU output for the kernel's gradient
        x = layers.Flatten()(x)
    elif after == "pool":
        x = layers.Flatten()(layers.MaxPooling2D(2)(x))
    else:
        x = layers.GlobalAveragePooling2D()(layers.Conv2D(8, 3, padding="same")(x))
    return keras.Model(inputs, layers.Dense(10, dtype=dtype)(x))


@pytest.mark.parametrize("case", ["renorm", "synchronized", "bn_float16_relu_float32"])
def test_not_covered_is_not_rewritten(case):
    bn_kwargs, relu, dtype = {}, None, None
    if case in ("renorm", "synchronized"):
        if case not in inspect.signature(layers.BatchNormalization.__init__).parameters:
            pytest.skip(f"this Keras ({keras.__version__}) has no BatchNormalization({case}=...)")
        bn_kwargs = {case: True}
    elif case == "bn_float16_relu_float32":
        # the conv and BN under mixed_float16, the ReLU float32: Keras casts the BN's output up
        # before the ReLU, whose input is then no BN output
        dtype = "mixed_float16"
    delta = _stock_and_product(_block(bn_kwargs, relu, dtype=dtype), 4)
    assert delta == dict(segments=0, convs=0, recomputed=0, stock=0, fused=0)


def test_relu_output_kept_by_another_consumer_takes_stocks_route():
    """BN -> ReLU -> Flatten -> Dense: the Dense keeps the ReLU output anyway; G is traced but
    its gradient is stock's (no recomputation)."""
    delta = _stock_and_product(_block(after="dense"), 4)
    assert delta == dict(segments=1, convs=0, recomputed=0, stock=1, fused=0)


def test_bn_output_read_by_two_relus_takes_stocks_route():
    """One BN output, two ReLUs (each a segment): stock sums both ReLUs' gradients at the BN
    output before BN's backward, so both segments take stock's route."""
    keras.utils.set_random_seed(10)
    inputs = keras.Input((8, 8, 4))
    y = layers.BatchNormalization()(layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs))
    a, b = layers.ReLU()(y), layers.Activation("relu")(y)
    x = layers.Add()([layers.Conv2D(8, 3, padding="same")(a), layers.Conv2D(8, 1)(b)])
    model = keras.Model(inputs, layers.Dense(10)(layers.GlobalAveragePooling2D()(x)))
    delta = _stock_and_product(model, 4)
    assert delta == dict(segments=2, convs=2, recomputed=0, stock=2, fused=0)


def test_relu_that_feeds_a_max_pool_stays_with_the_pool_fusion():
    """Compared with stock on TensorFlow 2.21, with the switch alone on 2.20, where the pool
    switch's conv -> BN -> ReLU -> max pool is not bitwise with stock under the CPU's XLA (84 of
    the first conv kernel's 288 gradient elements, 2026-12-04; docs/xla.md)."""
    delta = _stock_and_product(_block(after="pool"), 4, reference=_POOL_SWITCH_REFERENCE)
    assert delta["fused"] == 1 and delta["recomputed"] == 0


def test_bn_with_a_mask_inference_and_no_xla_are_not_rewritten():
    keras.utils.set_random_seed(9)
    conv = layers.Conv2D(8, 3, padding="same", use_bias=False)
    bn, relu = layers.BatchNormalization(), layers.ReLU()
    x = tf.random.stateless_normal((2, 6, 6, 4), seed=[1, 2])
    mask = tf.constant(np.random.default_rng(0).random((2, 6, 6)) > 0.3)
    calls = {"mask": lambda x: relu(bn(conv(x), training=True, mask=mask)),
             "inference": lambda x: relu(bn(conv(x), training=False))}
    before = segments.stats()["segments"]
    with tf_relupool.recompute(bn_relu=True):
        for name, fn in calls.items():
            tf.function(fn, jit_compile=True).get_concrete_function(x)
            assert segments.stats()["segments"] == before, name
        tf.function(calls["inference"]).get_concrete_function(x)
        tf.function(lambda x: relu(bn(conv(x), training=True))).get_concrete_function(x)
        assert segments.stats()["segments"] == before, "without XLA"
        tf.function(lambda x: relu(bn(conv(x), training=True)),
                    jit_compile=True).get_concrete_function(x)
        assert segments.stats()["segments"] == before + 1, "the same under XLA"


# ---- the switch's contract ----------------------------------------------------------------

def _hooked():
    from keras.src.activations import activations
    from keras.src.backend.tensorflow import nn
    return (layers.BatchNormalization.call, activations.ReLU.__dict__["static_call"], nn.conv)


def test_hooks_installed_only_with_bn_relu_and_removed_by_disable():
    original = _hooked()
    tf_relupool.enable_recompute()
    assert not segments.installed() and _hooked() == original
    tf_relupool.enable_recompute(bn_relu=True)
    assert segments.installed() and keras_fusion.installed()
    assert all(h is not o for h, o in zip(_hooked(), original))
    tf_relupool.disable_recompute()
    assert not segments.installed() and _hooked() == original
    with tf_relupool.recompute(bn_relu=True):
        assert segments.installed()
        with tf_relupool.recompute():
            assert not segments.installed()
        with tf_relupool.recompute(None):
            assert not segments.installed() and not keras_fusion.installed()
        assert segments.installed()
    assert _hooked() == original
    for bad in (dict(keep=None, bn_relu=True), dict(bn_relu="yes")):
        with pytest.raises(ValueError, match="bn_relu"):
            with tf_relupool.recompute(**bad):
                pass
    with pytest.raises(ValueError, match="bn_relu"):
        tf_relupool.enable_recompute(bn_relu=1)


# ---- the saving: XLA's temp buffer (one subprocess per model) ------------------------------

def _temp_sizes(model, size, batch, tmp_path):
    result, temps = xla_temp_and_digest(model, size, batch, "stock,switch,product", tmp_path)
    result["recomputed"] = result["stats"]["recomputed"]
    return result, temps


def test_example_resnet_temp_buffer_smaller_than_the_pool_switch_alone(tmp_path):
    """The examples' ResNet-style CNN, 32x32, batch 32 (benchmarks/results/bn_relu_record_2026-12-04.md: stock
    68.6 MiB, the switch 39.3, with bn_relu 36.0 on the 2-core Xeon): the same bits as stock,
    the temp buffer below the switch's alone. TensorFlow 2.20's CPU XLA: the switch's bits
    (its stem differs from stock's there, docs/xla.md) and no saving beyond the switch's (59.6 MiB
    both, stock 71.9; measured 2026-12-04, benchmarks/results/bn_relu_record_2026-12-04.md)."""
    result, temps = _temp_sizes("resnet", 32, 32, tmp_path)
    assert result["product"] == result["switch"]
    assert result["recomputed"] == 6
    assert temps["switch"] < temps["stock"], temps
    if _POOL_SWITCH_REFERENCE is None:  # TensorFlow 2.21
        assert result["switch"] == result["stock"]
        assert temps["product"] < temps["switch"], temps
    else:
        assert temps["product"] <= temps["switch"], temps


@pytest.mark.slow
def test_resnet50_temp_buffer_at_most_half_of_stocks(tmp_path):
    """keras.applications.ResNet50 at 64x64, batch 4: stock's bits for the switch alone and with
    activations=True (docs/xla.md), the temp buffer at most half of stock's (measured 25.1
    against 75.3 MiB). Slow: three compilations in a fresh process,
    about 55 s on the 2-core Xeon."""
    result, temps = _temp_sizes("ResNet50", 64, 4, tmp_path)
    assert result["product"] == result["switch"] == result["stock"]
    assert temps["product"] <= 0.5 * temps["stock"], temps


def test_enable_warns_where_keras_does_not_reach_the_hooks(monkeypatch, caplog):
    """The probe at install: silent where Keras reaches the hooks; a warning naming what was not
    reached where a hook is missing (here: only BatchNormalization's installed)."""
    from keras.src.backend.tensorflow import nn
    monkeypatch.setattr(segments._hooks, "_probed", set())
    with caplog.at_level(logging.WARNING, logger="tf_relupool"):
        tf_relupool.enable_recompute(bn_relu=True)
    assert not [r for r in caplog.records if "activations=True" in r.getMessage()]
    tf_relupool.disable_recompute()
    caplog.clear()
    monkeypatch.setattr(segments._hooks, "_probed", set())
    original = nn.conv
    monkeypatch.setattr(segments, "_targets",
                        lambda: [(layers.BatchNormalization, "call", segments._bn_call_wrapper)])
    with caplog.at_level(logging.WARNING, logger="tf_relupool"):
        tf_relupool.enable_recompute(bn_relu=True)
    assert nn.conv is original
    assert [r for r in caplog.records if "(no segment there)" in r.getMessage()]
