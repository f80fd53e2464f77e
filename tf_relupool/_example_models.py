"""Three CIFAR-10 models written as a Keras user writes them: stock layers only. The example
(examples/cifar10.py, examples/distributed.py) and the benchmarks (benchmarks/harness.py) train
them; they live in the package so that both import them as a module.

Nothing here uses tf_relupool. `tf_relupool.enable_recompute()` alone fuses every
`Conv2D(activation="relu") -> MaxPooling2D` (and `ReLU() -> MaxPooling2D`) pair of these models
when Keras traces them; `tf_relupool.rewrite_model(model)` turns each pair into one
`ReluMaxPool2D` layer instead.

Each model is a Functional model made of named blocks (`block1`, `block2`, ... as nested
`keras.Sequential` models), so that the memory report can wrap each conv block in
`tf.recompute_grad` (TensorFlow's own answer) without a second model definition.
"""
import keras
from keras import layers

MODELS = ("simple", "vgg", "resnet")
INPUT_SHAPE = (32, 32, 3)
NUM_CLASSES = 10


def _head(x, num_classes):
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(256, activation="relu", name="fc1")(x)
    return layers.Dense(num_classes, name="logits")(x)


def _conv_pool_blocks(name, conv_names, input_shape, num_classes, filters):
    """Blocks of 3x3 convs (ReLU), one per name in conv_names ("{}" is the block's number), then
    a 2x2 max pool; the dense head."""
    inputs = keras.Input(input_shape, name="image")
    x = inputs
    for i, f in enumerate(filters, 1):
        convs = [layers.Conv2D(f, 3, padding="same", activation="relu", name=c.format(i))
                 for c in conv_names]
        block = keras.Sequential(convs + [layers.MaxPooling2D(2, name=f"pool{i}")],
                                 name=f"block{i}")
        x = block(x)
    return keras.Model(inputs, _head(x, num_classes), name=name)


def simple_cnn(input_shape=INPUT_SHAPE, num_classes=NUM_CLASSES, filters=(64, 128, 256, 256)):
    """One 3x3 conv (ReLU) per block, then a 2x2 max pool: the classic Keras CIFAR shape."""
    return _conv_pool_blocks("simple_cnn", ("conv{}",), input_shape, num_classes, filters)


def vgg(input_shape=INPUT_SHAPE, num_classes=NUM_CLASSES, filters=(64, 128, 256, 256)):
    """Two 3x3 convs (ReLU) per block, then a 2x2 max pool: VGG-style."""
    return _conv_pool_blocks("vgg", ("conv{}a", "conv{}b"), input_shape, num_classes, filters)


def _residual_block(filters, stride, name, in_filters):
    """A basic residual block (two 3x3 conv-BN, projection shortcut when the shape changes)."""
    inputs = keras.Input((None, None, in_filters), name=f"{name}_in")
    y = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                      name=f"{name}_conv1")(inputs)
    y = layers.BatchNormalization(name=f"{name}_bn1")(y)
    y = layers.ReLU(name=f"{name}_relu1")(y)
    y = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv2")(y)
    y = layers.BatchNormalization(name=f"{name}_bn2")(y)
    shortcut = inputs
    if stride != 1 or in_filters != filters:
        shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False,
                                 name=f"{name}_proj")(inputs)
        shortcut = layers.BatchNormalization(name=f"{name}_proj_bn")(shortcut)
    y = layers.Add(name=f"{name}_add")([y, shortcut])
    y = layers.ReLU(name=f"{name}_relu2")(y)
    return keras.Model(inputs, y, name=name)


def resnet(input_shape=INPUT_SHAPE, num_classes=NUM_CLASSES, stem_filters=64,
           stages=((64, 1), (128, 2), (256, 2))):
    """ResNet-style: conv-BN-ReLU stem, 3x3 stride-2 SAME max pool, then residual blocks."""
    inputs = keras.Input(input_shape, name="image")
    stem = keras.Sequential([
        layers.Conv2D(stem_filters, 3, padding="same", use_bias=False, name="stem_conv"),
        layers.BatchNormalization(name="stem_bn"),
        layers.ReLU(name="stem_relu"),
        layers.MaxPooling2D(3, strides=2, padding="same", name="stem_pool"),
    ], name="block1")
    x = stem(inputs)
    in_filters = stem_filters
    for i, (f, stride) in enumerate(stages, 2):
        x = _residual_block(f, stride, f"block{i}", in_filters)(x)
        in_filters = f
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    outputs = layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="resnet")


def build(name, input_shape=INPUT_SHAPE, num_classes=NUM_CLASSES):
    """The model called `name` ("simple", "vgg" or "resnet"); ValueError for other names."""
    builders = {"simple": simple_cnn, "vgg": vgg, "resnet": resnet}
    if name not in builders:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return builders[name](input_shape, num_classes)


def blocks(model):
    """The model's top-level layers in call order (blocks and head), for per-block wrappers."""
    return [l for l in model.layers if not isinstance(l, keras.layers.InputLayer)]
