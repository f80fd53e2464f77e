"""Python API of the fused ReLU + max-pool ops, and their registered gradients."""
import tensorflow as tf

from tf_relupool._loader import load_library
from tf_relupool import _geometry, _state, grappler, xla
# What the backward pass keeps from the forward pass (defined in _state, which validates it).
from tf_relupool._state import KEEP_ARGMAX, KEEP_CHOICES, KEEP_INPUT  # noqa: F401

#: GPU kernels: the fused single-pass CUDA kernels, or the seed's ReLU buffer + cuDNN pooling.
IMPLEMENTATION_CHOICES = ("fused", "cudnn")

SUPPORTED_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_ARGMAX_DTYPES = ((tf.uint8, 255), (tf.uint16, 65535), (tf.int32, 2**31 - 1))


def _padding_attrs(padding, ksize, data_format):
    """padding in tf.nn.max_pool2d's forms -> (padding attr, explicit_paddings attr).

    "VALID" / "SAME", or explicit padding: 4 (before, after) pairs in data_format order, zero on
    the batch and channel dimensions, each spatial one smaller than the window along it (as
    MaxPool requires)."""
    if isinstance(padding, str):
        if padding.upper() not in ("VALID", "SAME"):
            raise ValueError(f"padding must be 'VALID', 'SAME' or a list of 4 (before, after) "
                             f"pairs, got {padding!r}")
        return padding.upper(), []
    is_int = _geometry.is_int
    if (not isinstance(padding, (list, tuple)) or len(padding) != 4 or
            not all(isinstance(p, (list, tuple)) and len(p) == 2 and all(map(is_int, p))
                    for p in padding)):
        raise ValueError(f"padding must be 'VALID', 'SAME' or a list of 4 (before, after) pairs "
                         f"of ints, got {padding!r}")
    pairs = [[int(a), int(b)] for a, b in padding]
    outer = (0, 3) if data_format == "NHWC" else (0, 1)
    if any(pairs[d] != [0, 0] for d in outer):
        raise ValueError(f"padding must be [0, 0] on the batch and channel dimensions, "
                         f"got {padding!r}")
    for d in range(4):
        if d not in outer and any(v < 0 or v >= ksize[d] for v in pairs[d]):
            raise ValueError(f"padding {pairs[d]} of dimension {d} must be >= 0 and smaller than "
                             f"the window size {ksize[d]} along it, got {padding!r}")
    return "EXPLICIT", [v for pair in pairs for v in pair]


def _check_args(input, ksize, strides, padding, data_format, keep, implementation="fused"):
    if not isinstance(data_format, str) or data_format.upper() not in ("NHWC", "NCHW"):
        raise ValueError(f"data_format must be 'NHWC' or 'NCHW', got {data_format!r}")
    data_format = data_format.upper()
    _state.check_keep(keep)
    if implementation not in IMPLEMENTATION_CHOICES:
        raise ValueError(f"implementation must be one of {IMPLEMENTATION_CHOICES}, "
                         f"got {implementation!r}")
    ksize = _geometry.normalize_window(ksize, "ksize", data_format)
    strides = _geometry.normalize_window(strides, "strides", data_format)
    padding, explicit_paddings = _padding_attrs(padding, ksize, data_format)
    if input.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"input dtype must be one of {[d.name for d in SUPPORTED_DTYPES]}, "
                         f"got {input.dtype.name}")
    if input.shape.rank is not None and input.shape.rank != 4:
        raise ValueError(f"input must be 4-D ({data_format}), got shape {input.shape}")
    return ksize, strides, padding, explicit_paddings, data_format


def argmax_dtype_for(input_shape, ksize, data_format="NHWC"):
    """The narrowest code type for windows of `ksize` (4 entries) over `input_shape`."""
    rows, cols = _geometry.spatial_axes(data_format)
    shape = tf.TensorShape(input_shape)
    dims = shape.as_list() if shape.rank is not None else [None] * 4  # unknown rank: ksize alone
    h = ksize[rows] if dims[rows] is None else min(ksize[rows], dims[rows])
    w = ksize[cols] if dims[cols] is None else min(ksize[cols], dims[cols])
    for dtype, sentinel in _ARGMAX_DTYPES:
        if h * w < sentinel:
            return dtype
    raise ValueError(f"ksize {ksize} gives windows of {h * w} positions, too many to encode")


def relu_max_pool2d(input, ksize, strides, padding, data_format="NHWC", name=None, keep=KEEP_ARGMAX,
                    implementation="fused"):
    """Computes `tf.nn.max_pool2d(tf.nn.relu(input), ksize, strides, padding, data_format)`.

    Forward values and gradients (of every order) are bitwise identical to the stock ops on CPU
    wherever stock is itself defined (docs/semantics.md), in one pass over `input` and
    with no ReLU activation kept for the backward pass.

    Inside XLA (`tf.function(jit_compile=True)`, Keras' default compile on a GPU) the op
    library's kernels cannot run; there the same function is built from stock ops that XLA
    compiles (tf_relupool/xla.py), with stock's bits under XLA as docs/xla.md defines them (tied
    maxima of SAME-padded windows: the first in row-major order, where XLA's CPU backend picks
    another), keeping one byte per pooled element whatever `keep` says; `implementation` is
    ignored.

    Args:
      input: 4-D tensor of float16, bfloat16, float32 or float64, in `data_format`.
      ksize: window size: an int, or a list of 1, 2 or 4 ints, as for `tf.nn.max_pool2d`.
      strides: stride: an int, or a list of 1, 2 or 4 ints.
      padding: "VALID", "SAME", or explicit padding as for `tf.nn.max_pool2d`: 4 (before, after)
        pairs in `data_format` order, [0, 0] on the batch and channel dimensions, each spatial
        one smaller than the window along it.
      data_format: "NHWC" or "NCHW".
      name: optional name for the operation.
      keep: what the backward pass keeps. "argmax" (default): one code per pooled element
        (1 byte for windows of fewer than 255 positions), neither z nor relu(z). "input": the
        input z, from which the backward recomputes the argmax (SystemML's recomputation).
      implementation: GPU kernels to run (the CPU kernels ignore it). "fused" (default): the
        single-pass CUDA kernels. "cudnn": the seed's path, ReLU into a temporary buffer then
        cuDNN pooling forward/backward (keep="input" only; the window-argmax ops are fused).

    Returns:
      The pooled tensor, of `input`'s dtype.

    Raises:
      ValueError: an argument is malformed; the message names it.
    """
    with tf.name_scope(name or "ReluMaxPool2d"):
        input = tf.convert_to_tensor(input, name="input")
        ksize, strides, padding, explicit_paddings, data_format = _check_args(
            input, ksize, strides, padding, data_format, keep, implementation)
        if xla.in_xla_context():
            return xla.relu_max_pool2d(input, ksize, strides, padding, explicit_paddings,
                                       data_format)
        attrs = dict(ksize=ksize, strides=strides, padding=padding,
                     explicit_paddings=explicit_paddings, data_format=data_format,
                     implementation=implementation)
        lib = load_library()
        grappler.ensure_registered()  # the fused ops' layout pass inside Grappler (GPU NCHW)
        if keep == KEEP_INPUT:
            return lib.relu_max_pool(input, **attrs)
        output, _ = lib.relu_max_pool_with_window_argmax(
            input, Targmax=argmax_dtype_for(input.shape, ksize, data_format), **attrs)
        return output


def _pool_attrs(op):
    return {k: op.get_attr(k)
            for k in ("ksize", "strides", "padding", "explicit_paddings", "data_format",
                      "implementation")}


@tf.RegisterGradient("ReluMaxPool")
def _relu_max_pool_grad(op, grad):
    return load_library().relu_max_pool_grad(op.inputs[0], grad, **_pool_attrs(op))


# Codes that come straight from ReluMaxPoolWithWindowArgmax are valid by construction: the
# gradient ops reading them skip the GPU's report of invalid codes (validate_window_argmax=False,
# no host round trip per op; the kernels still bounds-check every code). Codes passed on from a
# gradient op keep that op's setting.
def _validate_attr(op):
    return op.get_attr("validate_window_argmax")


@tf.RegisterGradient("ReluMaxPoolWithWindowArgmax")
def _relu_max_pool_with_window_argmax_grad(op, grad, unused_argmax_grad):
    return load_library().relu_max_pool_grad_from_window_argmax(
        tf.shape(op.inputs[0]), grad, op.outputs[1], validate_window_argmax=False,
        **_pool_attrs(op))


# Higher-order gradients. Stock's backward is ReluGrad(MaxPoolGrad(r, y, dy), r) with r = relu(z);
# its gradient with respect to dy is MaxPoolGradGrad(r, y, ReluGrad(ddz, r)) and with respect to r
# and y zeros. The fused backward ops are linear in dy with the same routing, so their gradient
# with respect to dy gathers ddz through the same window argmax, times the ReLU mask; with respect
# to z (a piecewise-constant dependence) it is zero. None instead of zeros for z: stock adds its
# zeros before ReluGrad, where they cannot change a bit; adding them to dz here could turn a -0
# into +0.
@tf.RegisterGradient("ReluMaxPoolGradFromWindowArgmax")
def _relu_max_pool_grad_from_window_argmax_grad(op, grad):
    grad_of_dy = load_library().relu_max_pool_grad_grad_from_window_argmax(
        grad, op.inputs[2], validate_window_argmax=_validate_attr(op), **_pool_attrs(op))
    return None, grad_of_dy, None


@tf.RegisterGradient("ReluMaxPoolGrad")
def _relu_max_pool_grad_grad(op, grad):
    lib = load_library()
    attrs = _pool_attrs(op)
    z = op.inputs[0]
    # The codes the first-order backward used, recomputed from z (only the argmax is needed).
    data_format = attrs["data_format"]
    data_format = data_format.decode() if isinstance(data_format, bytes) else data_format
    _, codes = lib.relu_max_pool_with_window_argmax(
        z, Targmax=argmax_dtype_for(z.shape, attrs["ksize"], data_format), **attrs)
    return None, lib.relu_max_pool_grad_grad_from_window_argmax(
        grad, codes, validate_window_argmax=False, **attrs)


@tf.RegisterGradient("ReluMaxPoolGradGradFromWindowArgmax")
def _relu_max_pool_grad_grad_from_window_argmax_grad(op, grad):
    # The op is linear in its `grad` input; its transpose is the first-order backward.
    grad_input = op.inputs[0]
    return load_library().relu_max_pool_grad_from_window_argmax(
        tf.shape(grad_input), grad, op.inputs[1], validate_window_argmax=_validate_attr(op),
        **_pool_attrs(op)), None
