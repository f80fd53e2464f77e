"""Keras 3 layer: ReLU followed by 2-D max pooling, on the fused op when recompute is on."""
import keras

from tf_relupool import _compat, _geometry, _state
from tf_relupool.ops import relu_max_pool2d

_PADDINGS = ("valid", "same")
_DATA_FORMATS = ("channels_last", "channels_first")


def _pair(value, name):
    """An int or 2 ints, each >= 1 -> tuple of 2 ints; ValueError naming `name` otherwise.

    Keras' `standardize_tuple` (as MaxPooling2D) checks the count and the values; ints only are
    let through to it (it would take floats, strings of digits and bools)."""
    if _geometry.is_int(value):
        value = int(value)
    elif isinstance(value, (tuple, list)) and all(_geometry.is_int(v) for v in value):
        value = type(value)(int(v) for v in value)
    else:
        raise ValueError(f"The `{name}` argument must be an int or a tuple of 2 ints. "
                         f"Received: {name}={value!r}")
    return _compat.keras_standardize_tuple(value, 2, name)


@keras.saving.register_keras_serializable(package="tf_relupool")
class ReluMaxPool2D(keras.layers.Layer):
    """ReLU followed by max pooling for 2-D spatial data: `MaxPooling2D()(ReLU()(x))`.

    With the fused op (see `keep`) the forward pass reads `x` once and the backward keeps
    neither `x` nor `relu(x)` (keep="argmax") or only `x` (keep="input"); values and gradients
    are bitwise identical to the stock layers either way.

    The output shape is, per spatial dimension of size `n`, with `p = pool_size` and
    `s = strides`:
      - `padding="valid"`: `floor((n - p) / s) + 1`
      - `padding="same"`:  `floor((n - 1) / s) + 1`

    Which ops run:
      - `keep="argmax"` or `keep="input"`: the fused op, whatever the global switch says.
      - `keep=None` (default): follow the global switch (`tf_relupool.enable_recompute()`,
        `recompute()`, `TF_RELUPOOL_RECOMPUTE`) at trace time; when it is off, the stock ops
        `relu` + `max_pool` run (numerically identical to `ReLU` + `MaxPooling2D`).
      - Inside XLA (`tf.function(jit_compile=True)`, and Keras' `compile()` default on a GPU):
        the fused op built from stock ops that XLA compiles (tf_relupool/xla.py), with the stock
        layers' bits under XLA as docs/xla.md defines them, keeping one byte per pooled element
        for the backward (for either `keep`). `supports_jit` is True: Keras keeps XLA on.
      - Other Keras backends than TensorFlow: always the stock ops.

    Args:
      pool_size: int or tuple of 2 ints, the window size (rows, cols). Default (2, 2).
      strides: int, tuple of 2 ints, or None. None (default) means `pool_size`.
      padding: "valid" (default) or "same", case-insensitive.
      data_format: "channels_last", "channels_first", or None (default) for
        `keras.config.image_data_format()`.
      keep: None (default: follow the global switch), "argmax" or "input" (force the fused op
        with that backward).
      name: layer name. Other keyword arguments (dtype, trainable) go to `keras.layers.Layer`.

    Input shape:
      4-D tensor `(batch, rows, cols, channels)` for channels_last, or
      `(batch, channels, rows, cols)` for channels_first.

    Output shape:
      4-D tensor `(batch, pooled_rows, pooled_cols, channels)` for channels_last, or
      `(batch, channels, pooled_rows, pooled_cols)` for channels_first.

    Examples:

    >>> x = np.array([[-1., 2., -3.], [4., -5., 6.], [-7., 8., -9.]]).reshape(1, 3, 3, 1)
    >>> ReluMaxPool2D(pool_size=2, strides=1, keep="argmax")(x)[0, :, :, 0]
    [[4., 6.], [8., 8.]]
    >>> ReluMaxPool2D(pool_size=2, padding="same").compute_output_shape((8, 7, 5, 3))
    (8, 4, 3, 3)

    Use it in place of a `ReLU` (or a Conv2D's `activation="relu"`) followed by `MaxPooling2D`:

    >>> model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3),
    ...                           ReluMaxPool2D(), keras.layers.Flatten(), keras.layers.Dense(10)])
    """

    def __init__(self, pool_size=(2, 2), strides=None, padding="valid", data_format=None,
                 keep=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.pool_size = _pair(pool_size, "pool_size")
        self.strides = self.pool_size if strides is None else _pair(strides, "strides")
        if not isinstance(padding, str) or padding.lower() not in _PADDINGS:
            raise ValueError(f"The `padding` argument must be one of {_PADDINGS}. "
                             f"Received: padding={padding!r}")
        self.padding = padding.lower()
        if data_format is None:
            data_format = keras.config.image_data_format()
        if not isinstance(data_format, str) or data_format.lower() not in _DATA_FORMATS:
            raise ValueError(f"The `data_format` argument must be one of {_DATA_FORMATS} or "
                             f"None. Received: data_format={data_format!r}")
        self.data_format = data_format.lower()
        self.keep = _state.check_keep(keep, allow_none=True)
        self.input_spec = keras.layers.InputSpec(ndim=4)
        self.built = True

    def resolved_keep(self):
        """The backward mode a call traced now would use: "argmax", "input" or None (stock)."""
        if keras.backend.backend() != "tensorflow":
            return None
        return self.keep if self.keep is not None else _state.mode()

    def call(self, inputs):
        keep = self.resolved_keep()
        if keep is None:
            return keras.ops.max_pool(keras.ops.relu(inputs), pool_size=self.pool_size,
                                      strides=self.strides, padding=self.padding,
                                      data_format=self.data_format)
        return relu_max_pool2d(
            inputs, ksize=list(self.pool_size), strides=list(self.strides),
            padding=self.padding.upper(),
            data_format="NHWC" if self.data_format == "channels_last" else "NCHW", keep=keep)

    def compute_output_shape(self, input_shape):
        input_shape = tuple(input_shape)
        if len(input_shape) != 4:
            raise ValueError(f"ReluMaxPool2D expects 4-D input, got shape {input_shape}")
        return _compat.keras_pooling_output_shape(input_shape, self.pool_size, self.strides,
                                                  self.padding, self.data_format)

    def get_config(self):
        config_ = super().get_config()
        config_.update({
            "pool_size": self.pool_size,
            "strides": self.strides,
            "padding": self.padding,
            "data_format": self.data_format,
            "keep": self.keep,
        })
        return config_
