"""Runs two SGD steps of a model under tf.function(jit_compile=True) on the CPU, once per variant,
and prints `RESULT {json}`: each variant's digest of both steps' losses and gradients and of
every weight after them, segments.stats() ("stats") and keras_fusion.stats() ("pools"). A subprocess of the tests (conftest's
xla_temp_and_digest), so that XLA reads the dump flags the test sets.

    python xla_step_digest.py MODEL SIZE BATCH VARIANTS HEAD [DEVICE]

MODEL: an example model of tf_relupool._example_models ("resnet"), a keras.applications name, or
"ResNet50Stem" (resnet50_stem below);
VARIANTS: comma-separated stock (switch off), switch (enable_recompute()), product
(enable_recompute(activations=True)), budgetNN (enable_recompute(memory_budget=NN/100)); HEAD: "softmax" (1000 classes, probabilities) or
"logits" (10 classes; ResNet50Stem has logits only); DEVICE: "cpu" (default: the GPU hidden)
or "gpu" (the GPU runs of scripts/gpu_segments.sh and scripts/resnet50_stem_gpu.sh, in XLA's
deterministic mode). Each variant's step function is named
digest_step_<variant>.
"""
import hashlib
import json
import sys

import keras
import numpy as np
import tensorflow as tf

import tf_relupool
from tf_relupool import _example_models, keras_fusion, segments
from conftest import sgd_step  # tests/ is this script's directory


def resnet50_stem(size):
    """keras.applications ResNet50's stem as it builds it (conv1_pad, conv1_conv, conv1_bn,
    conv1_relu, pool1_pad, pool1_pool, the same layer names), then a 1x1 conv-BN-ReLU, a global
    average pool and 10 logits: the stem's gradients as the full model's take them (the
    stem's max pool is fused through its ZeroPadding2D, its dz summed by BatchNormalization)."""
    from keras import layers
    inputs = keras.Input((size, size, 3))
    x = layers.ZeroPadding2D(padding=((3, 3), (3, 3)), name="conv1_pad")(inputs)
    x = layers.Conv2D(64, 7, strides=2, name="conv1_conv")(x)
    x = layers.BatchNormalization(axis=3, epsilon=1.001e-5, name="conv1_bn")(x)
    x = layers.Activation("relu", name="conv1_relu")(x)
    x = layers.ZeroPadding2D(padding=((1, 1), (1, 1)), name="pool1_pad")(x)
    x = layers.MaxPooling2D(3, strides=2, name="pool1_pool")(x)
    x = layers.Conv2D(64, 1, name="head_conv")(x)
    x = layers.BatchNormalization(axis=3, epsilon=1.001e-5, name="head_bn")(x)
    x = layers.Activation("relu", name="head_relu")(x)
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    return keras.Model(inputs, layers.Dense(10, name="predictions")(x), name="resnet50_stem")


name, size, batch, variants, head = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                     sys.argv[4].split(","), sys.argv[5])
device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
if device == "cpu":
    tf.config.set_visible_devices([], "GPU")
elif not tf.config.list_physical_devices("GPU"):
    raise SystemExit("DEVICE gpu: no GPU visible")
keras.utils.set_random_seed(0)
logits = head == "logits" or hasattr(_example_models, name) or name == "ResNet50Stem"
if name == "ResNet50Stem":
    model = resnet50_stem(size)
elif hasattr(_example_models, name):
    model = getattr(_example_models, name)(input_shape=(size, size, 3))
elif head == "logits":
    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3),
                                              classes=10, classifier_activation=None)
else:
    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3))
init = model.get_weights()
rng = np.random.default_rng(0)
x = tf.constant(rng.standard_normal((batch, size, size, 3)).astype("float32"))
y = tf.constant(rng.integers(0, 10, (batch,)).astype("int32"))
result = {}
for variant in variants:
    if variant == "stock":
        tf_relupool.disable_recompute()
    elif variant.startswith("budget"):
        tf_relupool.enable_recompute(memory_budget=int(variant[len("budget"):]) / 100)
    else:
        tf_relupool.enable_recompute(activations=variant == "product")
    model.set_weights(init)
    step = sgd_step(model, 0.01, logits, name="digest_step_" + variant)
    digest = hashlib.sha256()
    for _ in range(2):
        loss, grads = step(x, y)
        for t in [loss] + list(grads):
            digest.update(t.numpy().tobytes())
    for w in model.weights:
        digest.update(w.numpy().tobytes())
    result[variant] = digest.hexdigest()
result["stats"] = segments.stats()
result["pools"] = keras_fusion.stats()
result["device"] = device
print("RESULT " + json.dumps(result))
