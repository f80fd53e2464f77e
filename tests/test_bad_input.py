"""Every invalid input is a clear error naming the argument: ValueError from the Python API,
InvalidArgumentError (or the graph-construction ValueError) from the raw ops."""
import numpy as np
import pytest
import tensorflow as tf

import tf_relupool

Z = tf.zeros([1, 4, 4, 2])
ATTRS = dict(ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="VALID")


# ---- Python API: ValueError naming the argument ----

@pytest.mark.parametrize("kwargs, name", [
    (dict(input=tf.zeros([4, 4, 2])), "input"),
    (dict(ksize=[2, 2, 2]), "ksize"),
    (dict(ksize=0), "ksize"),
    (dict(ksize=[1, -1]), "ksize"),
    (dict(ksize=[2, 2, 2, 1]), "ksize"),
    (dict(ksize=[1, 2, 2, 2]), "ksize"),
    (dict(ksize="2"), "ksize"),
    (dict(strides=[1, 1, 1]), "strides"),
    (dict(strides=0), "strides"),
    (dict(strides=[3, 1, 1, 1]), "strides"),
    (dict(padding="FULL"), "padding"),
    (dict(padding=[[1, 0], [1, 1], [1, 1], [0, 0]]), "padding"),   # the batch padded
    (dict(padding=[[0, 0], [0, 0], [0, 0], [0, 1]]), "padding"),   # the channels padded
    (dict(padding=[[0, 0], [2, 0], [0, 0], [0, 0]]), "padding"),   # not below the window (2)
    (dict(padding=[[0, 0], [0, -1], [0, 0], [0, 0]]), "padding"),
    (dict(padding=[[0, 0], [1], [0, 0], [0, 0]]), "padding"),
    (dict(padding=[[0, 0], [1, 1], [1, 1]]), "padding"),
    (dict(padding=[[0, 0], [0.5, 0], [0, 0], [0, 0]]), "padding"),
    (dict(data_format="NCDHW"), "data_format"),
    (dict(input=tf.zeros([1, 4, 4, 2], tf.int32)), "dtype"),
    (dict(keep="relu"), "keep"),
    (dict(implementation="cublas"), "implementation"),
])
def test_python_api_raises_value_error_naming_the_argument(kwargs, name):
    args = dict(input=Z, ksize=2, strides=2, padding="VALID")
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        tf_relupool.relu_max_pool2d(**args)


# ---- Raw ops: InvalidArgumentError naming the argument ----

def _raises(match, fn, *args, **kwargs):
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize("attrs, name", [
    (dict(ksize=[1, 2, 2]), "ksize must have 4 elements"),
    (dict(ksize=[1, 0, 2, 1]), r"ksize\[1\] must be >= 1"),
    (dict(ksize=[2, 2, 2, 1]), "ksize must be 1 on the batch and channel"),
    (dict(ksize=[1, 2, 2, 2]), "ksize must be 1 on the batch and channel"),
    (dict(strides=[1, 2, 2, 1, 1]), "strides must have 4 elements"),
    (dict(strides=[1, -2, 2, 1]), r"strides\[1\] must be >= 1"),
    (dict(strides=[1, 2, 2, 3]), "strides must be 1 on the batch and channel"),
    (dict(ksize=[1, 2**40, 2, 1]), r"ksize\[1\] = 1099511627776 is too large"),
    (dict(strides=[1, 2, 2**35, 1]), r"strides\[2\] = 34359738368 is too large"),
    (dict(padding="FULL"), "padding"),
    (dict(padding="EXPLICIT"), "explicit_paddings must have 8 elements"),
    (dict(padding="EXPLICIT", explicit_paddings=[0, 0, 1, 1, 1, 1, 0, 0, 0]),
     "explicit_paddings must have 8 elements"),
    (dict(padding="EXPLICIT", explicit_paddings=[0, 1, 0, 0, 0, 0, 0, 0]),
     r"explicit_paddings\[1\] = 1: the batch and channel dimensions cannot be padded"),
    (dict(padding="EXPLICIT", explicit_paddings=[0, 0, 0, 2, 0, 0, 0, 0]),
     r"explicit_paddings\[3\] = 2 must be smaller than the window size 2"),
    (dict(padding="EXPLICIT", explicit_paddings=[0, 0, 0, 0, -1, 0, 0, 0]),
     r"explicit_paddings\[4\] = -1 must be >= 0"),
    (dict(padding="VALID", explicit_paddings=[0, 0, 1, 1, 1, 1, 0, 0]),
     "explicit_paddings must be empty unless padding is EXPLICIT"),
])
def test_raw_ops_reject_bad_attributes(lib, attrs, name):
    a = dict(ATTRS, **attrs)
    _raises(name, lib.relu_max_pool, Z, **a)
    _raises(name, lib.relu_max_pool_with_window_argmax, Z, **a)
    _raises(name, lib.relu_max_pool_grad, Z, tf.zeros([1, 2, 2, 2]), **a)
    _raises(name, lib.relu_max_pool_grad_from_window_argmax, [1, 4, 4, 2], tf.zeros([1, 2, 2, 2]),
            tf.zeros([1, 2, 2, 2], tf.uint8), **a)


def test_explicit_padding_of_an_empty_input_that_leaves_padding_only_windows(lib):
    """Stock MaxPool fills windows made of padding alone with the lowest value; the fused ops
    refuse them (InvalidArgumentError), and accept the same padding when the input has rows."""
    a = dict(ksize=[1, 2, 2, 1], strides=[1, 1, 1, 1], padding="EXPLICIT",
             explicit_paddings=[0, 0, 1, 1, 0, 0, 0, 0])
    _raises("input has no rows but explicit_paddings make windows of padding only",
            lib.relu_max_pool, tf.zeros([1, 0, 4, 2]), **a)
    assert lib.relu_max_pool(tf.zeros([1, 1, 4, 2]), **a).shape == [1, 2, 3, 2]
    assert lib.relu_max_pool(tf.zeros([0, 0, 4, 2]), **a).shape == [0, 1, 3, 2]  # no windows


def test_raw_ops_reject_wrong_rank(lib):
    _raises("input must be 4-D", lib.relu_max_pool, tf.zeros([4, 4, 2]), **ATTRS)
    _raises("input_shape must be a 1-D tensor of 4 elements", lib.relu_max_pool_grad_from_window_argmax, [4, 4, 2], tf.zeros([1, 2, 2, 2]),
            tf.zeros([1, 2, 2, 2], tf.uint8), **ATTRS)


def test_raw_ops_reject_unsupported_dtype(lib):
    _raises(r"attr 'T' of int32 is not in the list of allowed values: "
            r"half, bfloat16, float, double", lib.relu_max_pool, tf.zeros([1, 4, 4, 2], tf.int32),
            **ATTRS)


def test_grad_rejects_grad_of_wrong_shape(lib):
    _raises("grad must have the pooled output's shape", lib.relu_max_pool_grad, Z,
            tf.zeros([1, 3, 2, 2]), **ATTRS)
    _raises("grad must have the pooled output's shape", lib.relu_max_pool_grad_from_window_argmax,
            [1, 4, 4, 2], tf.zeros([1, 2, 2, 3]), tf.zeros([1, 2, 2, 3], tf.uint8), **ATTRS)


def test_compact_grad_rejects_argmax_of_wrong_shape(lib):
    _raises("window_argmax must have grad's shape", lib.relu_max_pool_grad_from_window_argmax,
            [1, 4, 4, 2], tf.zeros([1, 2, 2, 2]), tf.zeros([1, 2, 1, 2], tf.uint8), **ATTRS)


def test_compact_grad_rejects_bad_input_shape(lib):
    _raises("input_shape must be a 1-D tensor of 4 elements",
            lib.relu_max_pool_grad_from_window_argmax, tf.constant([[1, 4], [4, 2]]),
            tf.zeros([1, 2, 2, 2]), tf.zeros([1, 2, 2, 2], tf.uint8), **ATTRS)
    # Eager execution reaches the kernel's own check of negative sizes.
    _raises("input_shape|negative|must be", lib.relu_max_pool_grad_from_window_argmax,
            tf.constant([1, -4, 4, 2]), tf.zeros([1, 2, 2, 2]), tf.zeros([1, 2, 2, 2], tf.uint8),
            **ATTRS)


@pytest.mark.parametrize("code", [4, 100, 254])
def test_compact_grad_rejects_codes_outside_the_window(lib, code):
    codes = np.zeros([1, 2, 2, 2], np.uint8)
    codes[0, 1, 0, 1] = code  # a 2x2 window has positions 0..3 (and 255, the sentinel)
    _raises(r"window_argmax\[5\] = %d is not a position inside its pooling window" % code,
            lib.relu_max_pool_grad_from_window_argmax, [1, 4, 4, 2], tf.ones([1, 2, 2, 2]),
            tf.constant(codes), **ATTRS)


def test_compact_grad_rejects_codes_in_the_clipped_part_of_a_same_window(lib):
    # 3x3 SAME windows over a 3x3 input with stride 2 (one row/column of padding before): the
    # window of output (1, 1) is clipped to input rows 1-2 and columns 1-2. Codes count positions
    # with a row pitch of 3, so code 2 names column 1 + 2 = 3, which lies in the padding.
    codes = tf.constant([0, 0, 0, 2], tf.uint8, shape=[1, 2, 2, 1])
    _raises(r"window_argmax\[3\] = 2", lib.relu_max_pool_grad_from_window_argmax, [1, 3, 3, 1],
            tf.ones([1, 2, 2, 1]), codes, ksize=[1, 3, 3, 1], strides=[1, 2, 2, 1], padding="SAME")
    # Code 4 (row 2, column 2) is inside and accepted.
    ok = tf.constant([0, 0, 0, 4], tf.uint8, shape=[1, 2, 2, 1])
    dz = lib.relu_max_pool_grad_from_window_argmax([1, 3, 3, 1], tf.ones([1, 2, 2, 1]), ok,
                                                   ksize=[1, 3, 3, 1], strides=[1, 2, 2, 1],
                                                   padding="SAME")
    assert dz.numpy()[0, 2, 2, 0] == 1


def test_compact_grad_rejects_negative_int32_codes(lib):
    codes = tf.constant([0, -1, 0, 0], tf.int32, shape=[1, 2, 2, 1])
    _raises(r"window_argmax\[1\] = -1", lib.relu_max_pool_grad_from_window_argmax, [1, 4, 4, 1],
            tf.ones([1, 2, 2, 1]), codes, **ATTRS)


def test_argmax_type_too_narrow_for_the_window(lib):
    z = tf.zeros([1, 16, 16, 1])
    big = dict(ksize=[1, 16, 16, 1], strides=[1, 16, 16, 1], padding="VALID")
    _raises("window_argmax type uint8 cannot encode windows of 256 positions",
            lib.relu_max_pool_with_window_argmax, z, Targmax=tf.uint8, **big)
    _raises("window_argmax type uint8 cannot encode windows of 256 positions",
            lib.relu_max_pool_grad_from_window_argmax, [1, 16, 16, 1], tf.zeros([1, 1, 1, 1]),
            tf.zeros([1, 1, 1, 1], tf.uint8), **big)
    # The Python API picks a type wide enough by itself.
    assert tf_relupool.relu_max_pool2d(z, 16, 16, "VALID").shape == [1, 1, 1, 1]


def test_graph_construction_reports_shape_errors_as_value_error(lib):
    @tf.function
    def f():
        return lib.relu_max_pool_grad(tf.zeros([1, 4, 4, 2]), tf.zeros([1, 3, 3, 2]), **ATTRS)

    with pytest.raises(ValueError, match="Dimension|incompatible|Shapes"):
        f.get_concrete_function()
