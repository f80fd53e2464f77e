"""No public call of tf_relupool draws from, or advances, a global random state.

A user seeds an experiment (`keras.utils.set_random_seed`) and then turns the switch on, builds,
rewrites or reports on a model: the initial weights, the Dropout masks and every later draw must
be those of the same program without tf_relupool. Each case resets every global random state,
makes the call, and compares the next draw of each generator (Python's `random`, NumPy's,
Keras' global SeedGenerator, TensorFlow's op-seed sequence and its global tf.random.Generator)
with the draw of a reset without the call. The switch's install probes run once per process;
the fixture clears what they remember so that each case runs them.
"""
import random

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_relupool
from tf_relupool import keras_fusion, segments

pytestmark = pytest.mark.usefixtures("switch_off")


def _reset():
    keras.utils.set_random_seed(0)
    tf.random.set_global_generator(tf.random.Generator.from_seed(0))


def _draws():
    return {
        "Python's random": random.random(),
        "NumPy's global RandomState": float(np.random.random()),
        "Keras' global SeedGenerator": float(keras.random.uniform(())),
        "TensorFlow's op seeds (tf.random.set_seed)": float(tf.random.uniform(())),
        "TensorFlow's global tf.random.Generator": float(
            tf.random.get_global_generator().uniform(())),
    }


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch):
    for module in (keras_fusion, segments):
        monkeypatch.setattr(module._hooks, "_probed", set())


def _cnn():
    return keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(4, 1, use_bias=False),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.Dropout(0.5),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ])


def _first_gradient(model):
    """A jit-compiled gradient of `model` (training=True would draw Dropout's mask: inference
    mode, so that the only possible draw is tf_relupool's deferred probe, which runs at the
    first gradient after the switch turns on)."""
    x = tf.ones((2, 8, 8, 3))

    @tf.function(jit_compile=True)
    def grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=False))
        return tape.gradient(loss, model.trainable_variables)
    grads()


def _switch_then_gradient(**kw):
    def call(model):
        tf_relupool.enable_recompute(**kw)
        _first_gradient(model)
    return call


CALLS = {
    "enable_recompute()": _switch_then_gradient(),
    "enable_recompute(keep='input')": _switch_then_gradient(keep="input"),
    "enable_recompute(activations=True)": _switch_then_gradient(activations=True),
    "enable_recompute(bn_relu=True)": _switch_then_gradient(bn_relu=True),
    "enable_recompute(exact=False)": _switch_then_gradient(exact=False),
    "enable_recompute(memory_budget=0)": _switch_then_gradient(memory_budget=0),
    "recompute(activations=True)": lambda model: _in_context(model),
    "disable_recompute()": lambda model: (tf_relupool.enable_recompute(activations=True),
                                          tf_relupool.disable_recompute()),
    "fusion_report(model)": lambda model: str(tf_relupool.fusion_report(model, batch_size=2)),
    "fusion_report(model, activations)": lambda model: (
        tf_relupool.enable_recompute(activations=True),
        str(tf_relupool.fusion_report(model, batch_size=2))),
    "rewrite_model(model)": lambda model: tf_relupool.rewrite_model(model),
    "ReluMaxPool2D()": lambda model: tf_relupool.ReluMaxPool2D()(tf.ones((1, 4, 4, 2))),
}


def _in_context(model):
    with tf_relupool.recompute(activations=True):
        _first_gradient(model)


@pytest.mark.parametrize("name", list(CALLS))
def test_public_call_leaves_every_global_random_state(name):
    model = _cnn()
    _first_gradient(model)  # the model's own traces before the reference draw
    _reset()
    expected = _draws()
    _reset()
    CALLS[name](model)
    got = _draws()
    moved = [k for k in expected if got[k] != expected[k]]
    assert not moved, f"{name} moved: {moved}"


def test_seeded_model_after_the_switch_has_the_seeded_weights():
    """The issue's program: seed, switch (as the quick start orders it, before the model), build."""
    def weights(switch):
        keras.utils.set_random_seed(0)
        if switch:
            tf_relupool.enable_recompute(activations=True)
        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3)])
        return model.weights[0].numpy()
    on = weights(True)
    tf_relupool.disable_recompute()
    np.testing.assert_array_equal(on, weights(False))


def test_rewritten_copy_draws_the_originals_dropout_masks():
    """rewrite_model's copy carries each SeedGenerator's state: in training, its Dropout draws
    the masks the original would draw (its outputs are the original's, bit for bit)."""
    model = _cnn()
    copy = tf_relupool.rewrite_model(model)
    x = tf.random.stateless_uniform((2, 8, 8, 3), seed=[3, 4])
    np.testing.assert_array_equal(copy(x, training=True).numpy(), model(x, training=True).numpy())
