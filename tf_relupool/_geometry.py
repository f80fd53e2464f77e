"""Pooling geometry shared by ops, layers, xla and keras_fusion: which axes of a 4-D (2-D pool) or 5-D (3-D pool) tensor
are spatial, the op's 4-entry window attributes, and the length of a pooled dimension (as
MaxPool computes it). No TensorFlow import. The layer's output shape is Keras' own
`compute_pooling_output_shape`, which computes the same lengths."""

import numpy as np

#: The data formats of the op ("NHWC", "NCHW") and of Keras ("channels_last", "channels_first")
#: whose channels come last.
_CHANNELS_LAST = ("NHWC", "NDHWC", "channels_last")


def spatial_axes(data_format):
    """The spatial axes of a tensor in `data_format`: (rows, cols) for "NHWC" or "NCHW" (or
    Keras' "channels_last" or "channels_first"), (depth, rows, cols) for "NDHWC" or "NCDHW"."""
    n = 3 if data_format in ("NDHWC", "NCDHW") else 2
    first = 1 if data_format in _CHANNELS_LAST else 2
    return tuple(range(first, first + n))


def spatial(values, data_format):
    """The spatial entries of a shape or attribute in `data_format` (spatial_axes)."""
    return tuple(values[a] for a in spatial_axes(data_format))


def window_attr(rows, cols, data_format):
    """The op's 4-entry ksize/strides attribute for a (rows, cols) window or stride: 1 on the
    batch and channel dimensions."""
    return [1, rows, cols, 1] if data_format in _CHANNELS_LAST else [1, 1, rows, cols]


def pooled_size(size, window, stride, padding, before=0, after=0):
    """Output length along one spatial dimension of `size` (None stays None), as MaxPool and
    MaxPooling2D compute it: "SAME" (either case) ceil(size / stride), otherwise (VALID, or
    EXPLICIT with `before`/`after`) floor((size + before + after - window) / stride) + 1."""
    if size is None:
        return None
    if padding.upper() == "SAME":
        return -(-size // stride)
    return (size + before + after - window) // stride + 1


def is_int(value):
    """An int (Python's or NumPy's), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def normalize_window(value, name, data_format):
    """ksize/strides in tf.nn.max_pool2d's forms (int, 1, 2 or 4 entries) -> 4-entry list."""
    if is_int(value):
        hw = [int(value)] * 2
    elif isinstance(value, (list, tuple)) and all(is_int(v) for v in value):
        value = [int(v) for v in value]
        if len(value) == 1:
            hw = value * 2
        elif len(value) == 2:
            hw = value
        elif len(value) == 4:
            hw = list(spatial(value, data_format))
            if window_attr(*hw, data_format) != value:
                raise ValueError(f"{name} must be 1 on the batch and channel dimensions, got {value}")
        else:
            raise ValueError(f"{name} must be an int or a list of 1, 2 or 4 ints, got {value}")
    else:
        raise ValueError(f"{name} must be an int or a list of 1, 2 or 4 ints, got {value!r}")
    if any(v < 1 for v in hw):
        raise ValueError(f"{name} must be >= 1 in every spatial dimension, got {value}")
    if any(v > 2**31 - 1 for v in hw):
        raise ValueError(f"{name} must be at most 2**31 - 1 in every spatial dimension, got {value}")
    return window_attr(*hw, data_format)
