"""ReluMaxPool2D: equal to ReLU + MaxPooling2D, shapes, config, saving, dtypes, XLA, bad args."""
import logging
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tf_relupool
from tf_relupool import ReluMaxPool2D
from conftest import examples, forward_and_input_grad, global_policy, xla_hlo

L = keras.layers


pytestmark = pytest.mark.usefixtures("switch_off")  # conftest's


def stock(x, pool_size, strides, padding, data_format):
    return L.MaxPooling2D(pool_size, strides, padding, data_format)(L.ReLU()(x))


def forward_and_grad(fn, x):
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    dy = tf.cast(tf.reshape(tf.range(tf.size(y)) % 7 - 3, tf.shape(y)), y.dtype)
    return y.numpy(), tape.gradient(y, x, output_gradients=dy).numpy()


@settings(max_examples=examples(30), deadline=None)
@given(pool=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       strides=st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 3))),
       padding=st.sampled_from(["valid", "same"]),
       data_format=st.sampled_from(["channels_last", "channels_first"]),
       keep=st.sampled_from([None, "argmax", "input"]),
       rows=st.integers(3, 7), cols=st.integers(3, 7), seed=st.integers(0, 2**16))
def test_matches_stock_layers_forward_and_gradient(pool, strides, padding, data_format, keep,
                                                   rows, cols, seed):
    shape = (2, rows, cols, 3) if data_format == "channels_last" else (2, 3, rows, cols)
    # Integers in a small range: ties and non-positive windows are frequent.
    x = np.random.default_rng(seed).integers(-3, 4, size=shape).astype("float32")
    layer = ReluMaxPool2D(pool, strides, padding, data_format, keep=keep)
    y, dx = forward_and_grad(tf.function(layer), x)
    y_ref, dx_ref = forward_and_grad(lambda t: stock(t, pool, strides, padding, data_format), x)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dx, dx_ref)
    assert tuple(y.shape) == layer.compute_output_shape(shape)
    assert tuple(y.shape) == L.MaxPooling2D(pool, strides, padding,
                                            data_format).compute_output_shape(shape)


@pytest.mark.parametrize("padding,expected", [("valid", (None, 3, 2, 5)), ("same", (None, 4, 3, 5))])
def test_compute_output_shape_formulas_and_symbolic(padding, expected):
    layer = ReluMaxPool2D(pool_size=(2, 3), strides=2, padding=padding)
    assert layer.compute_output_shape((None, 7, 6, 5)) == expected
    assert layer.compute_output_shape((None, None, 6, 5))[1] is None
    assert tuple(layer(keras.Input((7, 6, 5))).shape) == expected
    first = ReluMaxPool2D(pool_size=(2, 3), strides=2, padding=padding,
                          data_format="channels_first")
    assert first.compute_output_shape((None, 5, 7, 6)) == (None, 5) + expected[1:3]


def test_defaults_mirror_max_pooling2d():
    layer, ref = ReluMaxPool2D(), L.MaxPooling2D()
    for key in ("pool_size", "strides", "padding", "data_format"):
        assert getattr(layer, key) == getattr(ref, key), key
    assert layer.keep is None
    assert ReluMaxPool2D(3).strides == (3, 3)
    assert ReluMaxPool2D(padding="SAME").padding == "same"


def test_get_config_mirrors_constructor():
    layer = ReluMaxPool2D((3, 2), (1, 2), "same", "channels_first", keep="input", name="rmp")
    config = layer.get_config()
    assert {k: config[k] for k in ("pool_size", "strides", "padding", "data_format", "keep",
                                   "name")} == {
        "pool_size": (3, 2), "strides": (1, 2), "padding": "same",
        "data_format": "channels_first", "keep": "input", "name": "rmp"}
    clone = ReluMaxPool2D.from_config(config)
    assert clone.get_config() == config
    assert keras.saving.get_registered_name(ReluMaxPool2D) == "tf_relupool>ReluMaxPool2D"


@pytest.mark.parametrize("kwargs,argument", [
    ({"pool_size": 0}, "pool_size"), ({"pool_size": (2, 2, 2)}, "pool_size"),
    ({"pool_size": "2"}, "pool_size"), ({"pool_size": 2.0}, "pool_size"),
    ({"pool_size": True}, "pool_size"),
    ({"strides": 0}, "strides"), ({"strides": (1, -1)}, "strides"), ({"strides": [2]}, "strides"),
    ({"padding": "full"}, "padding"), ({"padding": None}, "padding"),
    ({"data_format": "NHWC"}, "data_format"), ({"data_format": 1}, "data_format"),
    ({"keep": "relu"}, "keep"), ({"keep": True}, "keep"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`") as info:
        ReluMaxPool2D(**kwargs)
    assert repr(list(kwargs.values())[0]) in str(info.value)


def test_bad_input_rank_raises():
    with pytest.raises(ValueError):
        ReluMaxPool2D()(keras.Input((4, 4)))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("keep", [None, "argmax", "input"])
def test_mixed_precision_matches_stock(policy, keep):
    x = np.random.default_rng(3).normal(size=(2, 6, 6, 4)).astype("float32")
    layer = ReluMaxPool2D(keep=keep, dtype=policy)
    relu, pool = L.ReLU(dtype=policy), L.MaxPooling2D(dtype=policy)
    compute = "float16" if policy == "mixed_float16" else "bfloat16"
    assert layer.compute_dtype == compute
    y, dx = forward_and_grad(layer, x)
    y_ref, dx_ref = forward_and_grad(lambda t: pool(relu(t)), x)
    assert y.dtype == y_ref.dtype and str(tf.as_dtype(y.dtype).name) == compute
    np.testing.assert_array_equal(np.asarray(y, "float32"), np.asarray(y_ref, "float32"))
    np.testing.assert_array_equal(dx, dx_ref)
    # Inside a mixed-precision model the output dtype is the policy's compute dtype.
    with global_policy(policy):
        model = keras.Sequential([keras.Input((6, 6, 4)), L.Conv2D(4, 1), ReluMaxPool2D(keep=keep),
                                  L.Flatten(), L.Dense(2, dtype="float32")])
        out = model(x)
        assert model.layers[1].compute_dtype == compute and out.dtype == "float32"
        assert np.all(np.isfinite(out))


def small_model(keep):
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((12, 12, 3)), L.Conv2D(4, 3), ReluMaxPool2D(keep=keep),
                             L.Flatten(), L.Dense(3)])


@pytest.mark.parametrize("keep", [None, "argmax", "input"])
def test_keras_file_save_and_load_identical_predictions(tmp_path, keep):
    model = small_model(keep)
    x = np.random.default_rng(0).normal(size=(4, 12, 12, 3)).astype("float32")
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.layers[1], ReluMaxPool2D) and loaded.layers[1].keep == keep
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


@pytest.mark.parametrize("switch", [None, "argmax", "input"])
def test_xla_compiles_the_layer_in_every_mode(switch):
    """The layer has an XLA form (tf_relupool/xla.py), so its `supports_jit` (Keras keeps XLA on
    with it) holds: XLA compiles the layer, forward and gradient, and a model's training step
    with it, for every keep and switch state (the op library's ops would not compile)."""
    z = tf.random.stateless_normal([2, 9, 9, 4], seed=[1, 2])
    with tf_relupool.recompute(switch):
        for keep in (None, "argmax", "input"):
            layer = ReluMaxPool2D(3, 2, "same", keep=keep)
            assert layer.supports_jit
            assert "reduce-window" in xla_hlo(forward_and_input_grad(layer), z), keep
        model = small_model(None)
        x = tf.ones((4, 12, 12, 3))

        def train_step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x, training=True))
            return tape.gradient(loss, model.trainable_variables)
        xla_hlo(train_step, x)


@pytest.mark.parametrize("keep", ["argmax", "input"])
def test_tf_function_jit_compile_runs_the_xla_form_and_matches(keep):
    layer = ReluMaxPool2D(3, 2, "same", keep=keep)
    x = tf.random.stateless_normal([2, 9, 9, 4], seed=[4, 5])
    y, dx = forward_and_grad(tf.function(layer, jit_compile=True), x)
    y_ref, dx_ref = forward_and_grad(tf.function(lambda t: stock(t, 3, 2, "same", None),
                                                 jit_compile=True), x)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dx, dx_ref)


@pytest.mark.parametrize("switch", [None, "argmax"])
def test_fit_with_jit_compile_true_keeps_xla_and_trains_as_stock(switch):
    """fit under jit_compile=True: the layer's model trains, bit for bit as the same model with
    stock ReLU + MaxPooling2D layers from the same weights under XLA."""
    x = np.random.default_rng(1).normal(size=(8, 12, 12, 3)).astype("float32")
    y = np.random.default_rng(2).normal(size=(8, 3)).astype("float32")
    keras.utils.set_random_seed(7)
    stock_model = keras.Sequential([keras.Input((12, 12, 3)), L.Conv2D(4, 3), L.ReLU(),
                                    L.MaxPooling2D(), L.Flatten(), L.Dense(3)])
    with tf_relupool.recompute(switch):
        model = small_model(None)
        stock_model.set_weights(model.get_weights())
        before = [w.numpy().copy() for w in model.trainable_weights]
        histories = []
        for m in (model, stock_model):
            m.compile(optimizer="sgd", loss="mse", jit_compile=True)
            assert m.jit_compile
            histories.append(m.fit(x, y, batch_size=4, epochs=1, shuffle=False,
                                   verbose=0).history["loss"])
    assert np.isfinite(histories[0][0]) and histories[0] == histories[1], histories
    assert any(not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights))
    for w, w_stock in zip(model.get_weights(), stock_model.get_weights()):
        assert w.tobytes() == w_stock.tobytes()


def test_fit_jit_auto_without_gpu_runs_the_fused_op():
    """Keras' "auto" is no XLA on a machine without a GPU: there the op library's kernels run."""
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("auto compiles with XLA where a GPU is visible (tests/test_xla.py)")
    with tf_relupool.recompute():
        model = small_model(None)
        model.compile(optimizer="sgd", loss="mse", jit_compile="auto")
        assert not model.jit_compile
        model.fit(np.ones((4, 12, 12, 3), "float32"), np.ones((4, 3), "float32"), verbose=0)
        types = {op.type for op in tf.function(model).get_concrete_function(
            tf.TensorSpec((4, 12, 12, 3))).graph.get_operations()}
        assert "ReluMaxPoolWithWindowArgmax" in types and "MaxPool" not in types