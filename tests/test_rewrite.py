"""rewrite_model (Keras models) and rewrite_graph / rewrite_function (GraphDefs)."""
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tf_relupool
from tf_relupool import ReluMaxPool2D

from conftest import assert_bitwise_equal, examples, forward_and_input_grad, global_policy
from grappler_cases import PAD_STEP

L = keras.layers
X = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype("float32")


pytestmark = pytest.mark.usefixtures("switch_off")  # conftest's


def kinds(model):
    return [type(layer).__name__ for layer in model.layers]


def assert_same_outputs(a, b, x=X):
    for u, v in zip(keras.tree.flatten(a(x)), keras.tree.flatten(b(x))):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def assert_weights_copied(old, new):
    ow, nw = old.get_weights(), new.get_weights()
    assert len(ow) == len(nw) > 0
    for u, v in zip(ow, nw):
        np.testing.assert_array_equal(u, v)
    assert not any(a is b for a in old.weights for b in new.weights)  # copied, not shared


# -- rewrite_model ------------------------------------------------------------------------------

@pytest.mark.parametrize("keep", [None, "argmax", "input"])
def test_sequential_all_three_relu_forms(keep, caplog):
    model = keras.Sequential([
        keras.Input((16, 16, 3)),
        L.Conv2D(4, 3, activation="relu"), L.MaxPooling2D(),
        L.Conv2D(4, 3, padding="same"), L.ReLU(), L.MaxPooling2D(padding="same"),
        L.Dense(5, activation="relu"), L.MaxPooling2D(1),
        L.Activation("relu"), L.MaxPooling2D(1, name="last_pool"),
        L.Flatten(), L.Dense(3)], name="seq")
    with caplog.at_level(logging.INFO, logger="tf_relupool"):
        new = tf_relupool.rewrite_model(model, keep=keep)
    assert isinstance(new, keras.Sequential) and new.name == "seq"
    assert kinds(new) == ["Conv2D", "ReluMaxPool2D", "Conv2D", "ReluMaxPool2D", "Dense",
                          "ReluMaxPool2D", "ReluMaxPool2D", "Flatten", "Dense"]
    assert new.layers[0].get_config()["activation"] == "linear"
    assert new.layers[4].get_config()["activation"] == "linear"
    assert model.layers[0].get_config()["activation"] == "relu"  # original untouched
    assert all(l.keep == keep for l in new.layers if isinstance(l, ReluMaxPool2D))
    assert new.get_layer("last_pool").pool_size == (1, 1)
    assert_weights_copied(model, new)
    assert_same_outputs(model, new)
    with tf_relupool.recompute():
        assert_same_outputs(model, new)
    assert "4 ReLU + MaxPooling2D pair(s) fused" in caplog.text


def test_functional_branches_and_unfusable_patterns_are_logged(caplog):
    inp = keras.Input((16, 16, 3))
    a = L.Conv2D(4, 3, padding="same")(inp)
    r = L.ReLU(name="relu_branch")(a)                        # feeds two layers: not fused
    s = L.Add()([L.MaxPooling2D(name="pool_branch")(r), L.Conv2D(4, 1, strides=2)(r)])
    c = L.Conv2D(4, 3, activation="relu", name="conv_fused")(s)
    p = L.MaxPooling2D(name="pool_fused")(c)
    e = L.Conv2D(4, 1, activation="elu", name="conv_elu")(p)
    q = L.MaxPooling2D(1, name="pool_elu")(e)                # other activation
    capped = L.MaxPooling2D(1)(L.ReLU(max_value=6.0, name="relu6")(q))
    g = L.GlobalMaxPooling2D()(L.ReLU(name="relu_global")(capped))  # not 2-D pooling
    out_relu = L.Conv2D(2, 1, activation="relu", name="conv_out")(capped)
    model = keras.Model(inp, [L.Flatten()(L.MaxPooling2D(1)(out_relu)), g, out_relu])
    with caplog.at_level(logging.INFO, logger="tf_relupool"):
        new = tf_relupool.rewrite_model(model)
    types = {l.name: type(l).__name__ for l in new.layers}
    assert types["pool_branch"] == "MaxPooling2D" and types["relu_branch"] == "ReLU"
    assert types["pool_fused"] == "ReluMaxPool2D"
    assert new.get_layer("conv_fused").get_config()["activation"] == "linear"
    assert types["pool_elu"] == "MaxPooling2D"
    assert "relu6" in types and "relu_global" in types
    assert new.get_layer("conv_out").get_config()["activation"] == "relu"  # also a model output
    assert sum(t == "ReluMaxPool2D" for t in types.values()) == 1
    assert_same_outputs(model, new)
    log = caplog.text
    assert "has 2 consumers" in log
    assert "activation elu is not ReLU" in log
    assert "ReLU(max_value=6.0" in log
    assert "only 2-D max pooling" in log
    assert "conv_out -> " in log and "not fused" in log


def test_nested_models_are_rewritten_recursively():
    inner_seq = keras.Sequential([L.Conv2D(4, 3, activation="relu"), L.MaxPooling2D()],
                                 name="inner_seq")
    i = keras.Input((7, 7, 4))
    inner_fn = keras.Model(i, L.MaxPooling2D(padding="same")(L.Activation("relu")(i)),
                           name="inner_fn")
    inp = keras.Input((16, 16, 3))
    x = inner_fn(inner_seq(inp))
    model = keras.Model(inp, L.Dense(2)(L.Flatten()(x)))
    new = tf_relupool.rewrite_model(model, keep="argmax")
    assert kinds(new.get_layer("inner_seq")) == ["Conv2D", "ReluMaxPool2D"]
    assert kinds(new.get_layer("inner_fn")) == ["InputLayer", "ReluMaxPool2D"]
    assert new.get_layer("inner_seq") is not inner_seq
    assert_weights_copied(model, new)
    assert_same_outputs(model, new)


@pytest.mark.parametrize("data_format,policy", [("channels_first", "float32"),
                                                ("channels_last", "mixed_bfloat16")])
def test_resnet_stem_channels_first_and_mixed_precision(data_format, policy):
    with global_policy(policy):
        keras.utils.set_random_seed(5)
        inp = keras.Input((16, 16, 3))
        # The convolution stays channels_last: without oneDNN (TF_ENABLE_ONEDNN_OPTS=0, or CPUs
        # without AVX-512) stock TF has no NCHW Conv2D on the CPU. A Permute makes the rest of
        # the stem channels_first, so both models run on every CPU.
        x = L.Conv2D(4, 3, padding="same", use_bias=False)(inp)
        stem = ["Conv2D"]
        if data_format == "channels_first":
            x = L.Permute((3, 1, 2))(x)
            stem.append("Permute")
        x = L.BatchNormalization(axis=-1 if data_format == "channels_last" else 1)(x)
        x = L.ReLU()(x)
        x = L.MaxPooling2D(3, 2, padding="same", data_format=data_format, name="pool")(x)
        model = keras.Model(inp, L.Dense(2, dtype="float32")(L.Flatten()(x)))
        new = tf_relupool.rewrite_model(model, keep="argmax")
        assert kinds(new) == ["InputLayer", *stem, "BatchNormalization", "ReluMaxPool2D",
                              "Flatten", "Dense"]
        fused = new.get_layer("pool")
        assert isinstance(fused, ReluMaxPool2D) and fused.data_format == data_format
        assert fused.compute_dtype == model.get_layer("pool").compute_dtype
        assert_same_outputs(model, new)
        assert_weights_copied(model, new)


def test_shared_layer_is_not_linearized(caplog):
    conv = L.Conv2D(3, 1, activation="relu", name="shared_conv")
    inp = keras.Input((8, 8, 3))
    model = keras.Model(inp, L.Add()([L.MaxPooling2D()(conv(inp)),
                                       L.MaxPooling2D()(conv(L.Identity()(inp)))]))
    with caplog.at_level(logging.INFO, logger="tf_relupool"):
        new = tf_relupool.rewrite_model(model)
    assert "called at 2 places" in caplog.text
    assert "ReluMaxPool2D" not in kinds(new)
    assert_same_outputs(model, new, X[:, :8, :8])


def test_already_fused_and_plain_models_unchanged():
    model = keras.Sequential([keras.Input((8, 8, 3)), L.Conv2D(2, 1), ReluMaxPool2D(keep="input"),
                              L.MaxPooling2D(), L.Flatten()])
    new = tf_relupool.rewrite_model(model)
    assert kinds(new) == kinds(model)
    assert_same_outputs(model, new, X[:, :8, :8])


def test_compiled_model_copy_is_compiled_and_trains_as_stock():
    """The copy keeps the compile and, from the same weights, trains bit for bit as the stock
    model (losses and weights)."""
    model = keras.Sequential([keras.Input((8, 8, 3)), L.Conv2D(2, 3, activation="relu"),
                              L.MaxPooling2D(), L.Flatten(), L.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    new = tf_relupool.rewrite_model(model, keep="argmax")
    assert new.compiled
    assert any(isinstance(layer, ReluMaxPool2D) for layer in new.layers)
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(8, 8, 8, 3)).astype("float32"), rng.normal(size=(8, 1))
    losses = [m.fit(x, y, batch_size=4, shuffle=False, verbose=0).history["loss"]
              for m in (new, model)]
    assert losses[0] == losses[1], losses
    for w, w_stock in zip(new.get_weights(), model.get_weights()):
        assert w.tobytes() == w_stock.tobytes()


def test_rewrite_model_bad_arguments():
    with pytest.raises(ValueError, match="keep"):
        tf_relupool.rewrite_model(keras.Sequential([L.Dense(1)]), keep="both")
    with pytest.raises(ValueError, match="Keras model"):
        tf_relupool.rewrite_model(L.Dense(1))

    class Sub(keras.Model):
        def call(self, x):
            return x
    with pytest.raises(ValueError, match="subclassed"):
        tf_relupool.rewrite_model(Sub())


# -- rewrite_graph ------------------------------------------------------------------------------

W = tf.Variable(tf.random.stateless_normal([3, 3, 3, 4], seed=[0, 1]))


def graph_ops(graph_def):
    return [n.op for n in graph_def.node]


def conv_pool_step(ksize, strides, padding, data_format="NHWC", extra_consumer=False,
                   pool_in_nhwc=False):
    """A training step: NHWC conv, ReLU and max pooling in data_format, loss and its gradient.

    With pool_in_nhwc, NCHW pooling runs as stock NHWC pooling between transposes, which give
    the same values: the reference for NCHW, since without oneDNN (TF_ENABLE_ONEDNN_OPTS=0, or
    CPUs without AVX-512) stock TF has no NCHW MaxPool on the CPU. The convolution is NHWC in
    every variant, so the compared graphs compute it identically.
    """
    def pool(r):
        if data_format == "NCHW" and pool_in_nhwc:
            y = tf.nn.max_pool2d(tf.transpose(r, [0, 2, 3, 1]), ksize, strides, padding)
            return tf.transpose(y, [0, 3, 1, 2])
        return tf.nn.max_pool2d(r, ksize, strides, padding, data_format=data_format)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            z = tf.nn.conv2d(x, W, 1, "SAME")
            if data_format == "NCHW":
                z = tf.transpose(z, [0, 3, 1, 2])
            r = tf.nn.relu(z)
            y = pool(r)
            loss = tf.reduce_sum(y * y)
            if extra_consumer:
                loss += tf.reduce_sum(r)
        # dz: the pool backward's own output (the fused gradient op's, once rewritten), besides
        # the loss and dW, a reduction over it that could hide a wrong element or a zero's sign
        dw, dz = tape.gradient(loss, [W, z])
        return loss, dw, dz
    return step.get_concrete_function(tf.TensorSpec([2, 9, 9, 3]))


@settings(max_examples=examples(12), deadline=None)
@given(ksize=st.integers(1, 3), strides=st.integers(1, 3),
       padding=st.sampled_from(["VALID", "SAME"]), data_format=st.sampled_from(["NHWC", "NCHW"]),
       keep=st.sampled_from(["argmax", "input"]))
def test_rewrite_function_with_gradient_is_bitwise_equal(ksize, strides, padding, data_format,
                                                          keep):
    # On the CPU also where a GPU is visible: both graphs hold a stock convolution whose GPU bits
    # depend on the layout and algorithm Grappler and cuDNN pick per graph (docs/gpu.md).
    with tf.device("/CPU:0"):
        _rewrite_function_with_gradient_is_bitwise_equal(ksize, strides, padding, data_format,
                                                         keep)


def _rewrite_function_with_gradient_is_bitwise_equal(ksize, strides, padding, data_format, keep):
    cf = conv_pool_step(ksize, strides, padding, data_format)
    fused = tf_relupool.rewrite_function(cf, keep=keep)
    gd = fused.graph.as_graph_def()
    ops = graph_ops(gd)
    formats = {n.attr["data_format"].s.decode() for n in gd.node if n.op.startswith("ReluMaxPool")}
    assert formats == {data_format}
    assert "Relu" not in ops and "MaxPool" not in ops
    assert "MaxPoolGrad" not in ops and "ReluGrad" not in ops
    if keep == "argmax":
        assert {"ReluMaxPoolWithWindowArgmax", "ReluMaxPoolGradFromWindowArgmax"} <= set(ops)
    else:
        assert {"ReluMaxPool", "ReluMaxPoolGrad"} <= set(ops)
    # The fused graph has no stock NCHW op left; the stock reference pools in NHWC.
    reference = conv_pool_step(ksize, strides, padding, data_format, pool_in_nhwc=True)
    x = tf.random.stateless_normal([2, 9, 9, 3], seed=[ksize, strides])
    for what, got, want in zip(("loss", "dW", "dz"), fused(x), reference(x)):
        assert_bitwise_equal(got, want, what)


def test_keep_input_gradient_stride1_same_in_graph():
    """Regression: the grad op once reused dy's buffer for dz when their shapes matched (stride 1
    SAME), and with overlapping windows read dy values it had already overwritten."""
    cf = conv_pool_step(2, 1, "SAME")
    x = tf.random.stateless_normal([2, 9, 9, 3], seed=[2, 1])
    for what, got, want in zip(("loss", "dW", "dz"),
                               tf_relupool.rewrite_function(cf, keep="input")(x), cf(x)):
        assert_bitwise_equal(got, want, what)


def test_rewrite_graph_forward_only_and_input_untouched():
    @tf.function
    def f(x):
        return tf.nn.max_pool2d(tf.nn.relu(x * 2.0), 2, 2, "VALID") + 1.0
    cf = f.get_concrete_function(tf.TensorSpec([1, 4, 4, 2]))
    gd = cf.graph.as_graph_def()
    before = gd.SerializeToString()
    new = tf_relupool.rewrite_graph(gd, keep="input")
    assert gd.SerializeToString() == before
    assert "ReluMaxPool" in graph_ops(new) and "Relu" not in graph_ops(new)
    x = tf.random.stateless_normal([1, 4, 4, 2], seed=[3, 3])
    np.testing.assert_array_equal(tf_relupool.rewrite_function(cf)(x).numpy(), cf(x).numpy())


def test_relu_with_other_consumers_left_in_place(caplog):
    cf = conv_pool_step(2, 2, "VALID", extra_consumer=True)
    with caplog.at_level(logging.INFO, logger="tf_relupool"):
        new = tf_relupool.rewrite_graph(cf.graph.as_graph_def())
    assert graph_ops(new) == graph_ops(cf.graph.as_graph_def())
    assert "MaxPool2d' after Relu 'Relu' not fused" in caplog.text

    @tf.function
    def f(x):
        r = tf.nn.relu(x)
        return tf.nn.max_pool2d(r, 2, 2, "VALID"), r
    gd = f.get_concrete_function(tf.TensorSpec([1, 4, 4, 1])).graph.as_graph_def()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tf_relupool"):
        assert graph_ops(tf_relupool.rewrite_graph(gd)) == graph_ops(gd)
    assert "the Relu has other consumers" in caplog.text


def test_device_fields_one_device_or_unnamed_fused_two_devices_left(caplog):
    """A node without a device goes where the placer puts it: a pair whose only named device is
    one device is fused; a Relu and a MaxPool named on two devices are left as they are."""
    gd = conv_pool_step(2, 2, "VALID").graph.as_graph_def()
    for n in gd.node:
        if n.op == "Relu":
            n.device = "/device:CPU:0"
    assert "ReluMaxPoolWithWindowArgmax" in graph_ops(tf_relupool.rewrite_graph(gd))
    for n in gd.node:
        if n.op == "MaxPool":
            n.device = "/device:CPU:1"
    with caplog.at_level(logging.INFO, logger="tf_relupool"):
        new = tf_relupool.rewrite_graph(gd)
    assert graph_ops(new) == graph_ops(gd)
    assert "on different devices ('/device:CPU:0', '/device:CPU:1')" in caplog.text


def test_keep_none_follows_switch_else_argmax():
    gd = conv_pool_step(2, 2, "VALID").graph.as_graph_def()
    assert "ReluMaxPoolWithWindowArgmax" in graph_ops(tf_relupool.rewrite_graph(gd))
    with tf_relupool.recompute("input"):
        assert "ReluMaxPoolGrad" in graph_ops(tf_relupool.rewrite_graph(gd))
    with pytest.raises(ValueError, match="keep"):
        tf_relupool.rewrite_graph(gd, keep="z")


def test_control_dependencies_move_to_replacements():
    @tf.function
    def f(x):
        r = tf.nn.relu(x)
        y = tf.nn.max_pool2d(r, 2, 2, "VALID")
        with tf.control_dependencies([r.op]):
            c = tf.identity(x)
        return y, c
    cf = f.get_concrete_function(tf.TensorSpec([1, 4, 4, 1]))
    new = tf_relupool.rewrite_graph(cf.graph.as_graph_def())
    names = {n.name for n in new.node}
    for n in new.node:
        for i in n.input:
            assert i.lstrip("^").split(":")[0] in names, (n.name, i)
    x = tf.random.stateless_normal([1, 4, 4, 1], seed=[5, 6])
    for got, want in zip(tf_relupool.rewrite_function(cf)(x), cf(x)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_keras_model_training_step_graph_rewrite():
    with tf.device("/CPU:0"):  # see test_rewrite_function_with_gradient_is_bitwise_equal
        _keras_model_training_step_graph_rewrite()


def _keras_model_training_step_graph_rewrite():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8, 8, 3)), L.Conv2D(4, 3, activation="relu"),
                              L.MaxPooling2D(), L.Flatten(), L.Dense(2)])

    @tf.function
    def grads(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    cf = grads.get_concrete_function(tf.TensorSpec([4, 8, 8, 3]))
    fused = tf_relupool.rewrite_function(cf)
    assert "ReluMaxPoolGradFromWindowArgmax" in graph_ops(fused.graph.as_graph_def())
    x = tf.random.stateless_normal([4, 8, 8, 3], seed=[1, 1])
    got, want = fused(x), cf(x)
    np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
    for g, w in zip(got[1], want[1]):
        np.testing.assert_array_equal(g.numpy(), w.numpy())


def test_rewrite_function_rejects_non_concrete():
    with pytest.raises(ValueError, match="concrete function"):
        tf_relupool.rewrite_function(lambda x: x)


# -- one implementation: rewrite_graph runs the Grappler pass --------------------------------

exec(PAD_STEP)  # pad_step(): the Grappler tests' conv -> ReLU -> [Pad] -> pool step  # noqa: S102


def pad_pool_step(ksize, strides, padding, pads, v2, pad_value=None):
    """A training step, conv -> ReLU -> Pad -> max pooling (MaxPool or MaxPoolV2), with the
    gradients of the weights and of the input: the Grappler tests' pad_step, as a concrete
    function for rewrite_function / rewrite_graph."""
    make = pad_step([W], pads=pads, ksize=ksize, strides=strides, padding=padding,  # noqa: F821
                    v2=v2, pad_value=pad_value)
    return tf.function(make()).get_concrete_function(tf.TensorSpec([2, 9, 9, 3]))


@settings(max_examples=examples(10), deadline=None)
@given(ksize=st.integers(1, 3), strides=st.integers(1, 3),
       padding=st.sampled_from(["VALID", "SAME"]),
       pads=st.lists(st.integers(0, 2), min_size=8, max_size=8),
       v2=st.booleans(), keep=st.sampled_from(["argmax", "input"]))
def test_rewrite_function_pad_and_maxpool_v2_bitwise_equal(ksize, strides, padding, pads, v2,
                                                            keep):
    with tf.device("/CPU:0"):  # see test_rewrite_function_with_gradient_is_bitwise_equal
        pads = [pads[0:2], pads[2:4], pads[4:6], pads[6:8]]
        cf = pad_pool_step(ksize, strides, padding, pads, v2)
        fused = tf_relupool.rewrite_function(cf, keep=keep)
        ops = graph_ops(fused.graph.as_graph_def())
        assert not {"Relu", "MaxPool", "MaxPoolV2", "MaxPoolGrad", "MaxPoolGradV2",
                    "ReluGrad"} & set(ops), ops
        assert "Pad" in ops
        x = tf.random.stateless_normal([2, 9, 9, 3], seed=[ksize, strides])
        for got, want in zip(tf.nest.flatten(fused(x)), tf.nest.flatten(cf(x))):
            assert_bitwise_equal(got, want)


def test_rewrite_graph_pad_refusals_are_logged(caplog):
    gd = pad_pool_step(2, 2, "VALID", [[0, 0], [1, 1], [1, 1], [0, 0]], False,
                       pad_value=-1.0).graph.as_graph_def()
    with caplog.at_level(logging.INFO, logger="tf_relupool"):
        assert graph_ops(tf_relupool.rewrite_graph(gd)) == graph_ops(gd)
    assert "and PadV2 'PadV2' not fused: the PadV2 pads with a negative or NaN value" in \
        caplog.text


def test_rewrite_graph_rejects_bytes_that_are_no_graph():
    from tf_relupool import _clib
    with pytest.raises(RuntimeError, match="could not parse"):
        _clib.rewrite_serialized_graph(b"\xff\xff\xff\xff not a GraphDef", "argmax")
    fused, data, lines = _clib.rewrite_serialized_graph(b"", "input")  # the empty graph
    assert (fused, data, lines) == (0, None, [])


def test_rewrite_graph_preserve_list_keeps_nodes():
    from tf_relupool import _clib
    gd = conv_pool_step(2, 2, "VALID").graph.as_graph_def()
    fused, data, lines = _clib.rewrite_serialized_graph(gd.SerializeToString(), "argmax",
                                                        preserve=["Relu"])
    assert fused == 0 and data is None
    assert any("the Relu must be preserved" in line for line in lines), lines


# -- rewrite_model: ZeroPadding2D between the ReLU and the pool ------------------------------

def test_zero_padding_stems_sequential_and_functional(caplog):
    seq = keras.Sequential([
        keras.Input((16, 16, 3)),
        L.Conv2D(4, 3, activation="relu"), L.ZeroPadding2D(1), L.MaxPooling2D(3, 2),
        L.Conv2D(4, 1), L.ReLU(), L.ZeroPadding2D(((0, 1), (1, 0))), L.MaxPooling2D(2, 1),
        L.Flatten(), L.Dense(2)], name="seq_pad")
    new = tf_relupool.rewrite_model(seq, keep="argmax")
    assert kinds(new) == ["Conv2D", "ZeroPadding2D", "ReluMaxPool2D", "Conv2D", "ZeroPadding2D",
                          "ReluMaxPool2D", "Flatten", "Dense"]
    assert new.layers[0].get_config()["activation"] == "linear"
    assert_same_outputs(seq, new)
    assert_weights_copied(seq, new)

    inp = keras.Input((16, 16, 3))
    x = L.BatchNormalization()(L.Conv2D(4, 3, use_bias=False)(inp))
    x = L.Activation("relu", name="stem_relu")(x)
    x = L.MaxPooling2D(3, 2, name="stem_pool")(L.ZeroPadding2D(1, name="stem_pad")(x))
    r = L.ReLU(name="relu2")(L.Conv2D(4, 1)(x))
    padded = L.ZeroPadding2D(1, name="pad_twice")(r)             # feeds two layers: not fused
    y = L.Add()([L.MaxPooling2D(3, 1, name="pool2")(padded), L.Conv2D(4, 3)(padded)])
    model = keras.Model(inp, L.Dense(2)(L.Flatten()(y)))
    with caplog.at_level(logging.INFO, logger="tf_relupool"):
        new = tf_relupool.rewrite_model(model)
    types = {l.name: type(l).__name__ for l in new.layers}
    assert types["stem_pool"] == "ReluMaxPool2D" and "stem_relu" not in types
    assert types["stem_pad"] == "ZeroPadding2D" and types["pool2"] == "MaxPooling2D"
    assert "relu2 -> pad_twice -> pool2 not fused: the padding's output has 2 consumers" in \
        caplog.text
    assert_same_outputs(model, new)
    with tf_relupool.recompute():
        assert_same_outputs(model, new)


@pytest.mark.slow
def test_rewrite_model_resnet50_stem_bitwise_with_gradients():
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    new = tf_relupool.rewrite_model(model)
    assert [l.name for l in new.layers if isinstance(l, ReluMaxPool2D)] == ["pool1_pool"]
    x = tf.random.stateless_normal([2, 32, 32, 3], seed=[1, 2])

    def run(m):
        step = forward_and_input_grad(lambda x: m(x, training=True),
                                      loss=lambda y: tf.reduce_sum(y * y))
        return tf.function(step, jit_compile=False)(x)
    want = run(model)
    with tf_relupool.recompute():
        got = run(new)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w.numpy())


# -- the fused ops' NCHW form instead of transposes around them -------------------------------

def transposed_pool_step(ksize, strides, padding, keep, dtype, batch):
    """A training step that pools an NCHW tensor with the NHWC fused op between transposes: the
    graph TensorFlow's layout optimizer makes of a model built with tf_relupool's layers on a
    GPU (the NHWC convolution turned NCHW, the op it does not know wrapped in Transposes)."""
    scale = tf.constant(np.linspace(-1.5, 1.5, 5, dtype="float32").reshape(1, 5, 1, 1))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            z = tf.cast(x * scale, dtype)  # NCHW
            y = tf_relupool.relu_max_pool2d(tf.transpose(z, [0, 2, 3, 1]), ksize, strides,
                                            padding, keep=keep)
            y = tf.cast(tf.transpose(y, [0, 3, 1, 2]), "float32")
            loss = tf.reduce_sum(y * y * tf.reshape(tf.range(1.0, 6.0), [1, 5, 1, 1]))
        return loss, tape.gradient(loss, x)
    return step.get_concrete_function(tf.TensorSpec([batch, 5, 9, 7]))


def adjacent_ops(graph_def, node):
    """Ops of the nodes feeding `node` (data inputs) and of the nodes reading its output 0."""
    by_name = {n.name: n for n in graph_def.node}
    inputs = [by_name[i.split(":")[0]].op for i in node.input if not i.startswith("^")]
    readers = [n.op for n in graph_def.node if any(i in (node.name, node.name + ":0")
                                                   for i in n.input)]
    return inputs, readers


@settings(max_examples=examples(12), deadline=None)
@given(ksize=st.integers(1, 3), strides=st.integers(1, 3),
       padding=st.sampled_from(["VALID", "SAME"]), keep=st.sampled_from(["argmax", "input"]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16", "float64"]),
       batch=st.sampled_from([2, None]))
def test_fused_ops_between_transposes_take_their_nchw_form(ksize, strides, padding, keep, dtype,
                                                           batch):
    cf = transposed_pool_step(ksize, strides, padding, keep, dtype, batch)
    rewritten = tf_relupool.rewrite_function(cf, keep=keep)
    gd = rewritten.graph.as_graph_def()
    fused = [n for n in gd.node if n.op.startswith("ReluMaxPool")]
    assert len(fused) == 2 and {n.attr["data_format"].s for n in fused} == {b"NCHW"}
    forward = next(n for n in fused if n.op in ("ReluMaxPool", "ReluMaxPoolWithWindowArgmax"))
    inputs, readers = adjacent_ops(gd, forward)
    # The forward transposes carry constant perms: they go. (The gradient's carry
    # InvertPermutation(perm) before constant folding, so a transpose is added there; inside
    # Grappler, after constant folding, those go too: tests/test_grappler.py.)
    assert "Transpose" not in inputs and "Transpose" not in readers, (inputs, readers)
    x = tf.random.stateless_normal([2, 5, 9, 7], seed=[ksize, strides])
    for got, want in zip(rewritten(x), cf(x)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
