"""tf_relupool.fusion_report (tf_relupool/report.py): each ReLU + max pool of a Keras model's
training step, fused or why not, on the XLA and Grappler routes, and the bytes each fusion
saves per step."""
import re

import keras
import pytest
import tensorflow as tf

import tf_relupool
from tf_relupool import report as report_module


def _model(dtype="float32"):
    """Three pools: after a ReLU, after a BatchNormalization (no ReLU), after a ReLU."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((32, 32, 3), dtype=dtype)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(inp)
    x = keras.layers.MaxPooling2D(2, name="p1")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", name="c2")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.MaxPooling2D(2, name="p2")(x)
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="c3")(x)
    x = keras.layers.MaxPooling2D(2, strides=1, padding="same", name="p3")(x)
    out = keras.layers.Dense(10)(keras.layers.Flatten()(x))
    return keras.Model(inp, out)


@pytest.mark.parametrize("route", ["xla", "grappler"])
def test_each_pair_fused_or_why_not_and_bytes_saved(route):
    report = tf_relupool.fusion_report(_model(), batch_size=16, routes=route)
    pairs = report.pairs
    assert [p["route"] for p in pairs] == [route] * 3
    assert [p["fused"] for p in pairs] == [True, False, True]
    assert all(p["where"] for p in pairs)
    # the BatchNormalization's pool: no ReLU in front, said so, naming the user's layer
    assert "not a ReLU" in pairs[1]["reason"] and pairs[1]["bytes_saved"] is None
    assert pairs[1]["reason"].startswith(
        "the pool's input comes from layer 'bn' (BatchNormalization"), pairs[1]["reason"]
    # p1: 16x32x32x8 fp32 ReLU output kept by stock, against 16x16x16x8 one-byte codes;
    # p3 (3x3... here 2x2 stride 1 SAME over 8x8x4): 16x8x8x4 floats against as many codes
    assert pairs[0]["bytes_saved"] == 16 * 32 * 32 * 8 * 4 - 16 * 16 * 16 * 8
    assert pairs[2]["bytes_saved"] == 16 * 8 * 8 * 4 * 4 - 16 * 8 * 8 * 4
    assert report.bytes_saved(route) == pairs[0]["bytes_saved"] + pairs[2]["bytes_saved"]
    assert "| no |" in str(report) and f"{route}: 2 of 3 ReLU + max-pool pair(s) fused" in str(
        report)
    # the user's layer names on both routes (TensorFlow's re-traced scope adds "_1")
    assert [p["where"] for p in pairs] == ["p1", "p2", "p3"], pairs


def test_both_routes_agree_and_the_switch_is_left_as_it_was():
    tf_relupool.disable_recompute()
    report = tf_relupool.fusion_report(_model(), batch_size=4)
    xla = [(p["fused"], p["bytes_saved"]) for p in report.pairs if p["route"] == "xla"]
    grappler = [(p["fused"], p["bytes_saved"]) for p in report.pairs if p["route"] == "grappler"]
    assert xla == grappler and len(xla) == 3
    assert tf_relupool.recompute_mode() is None


def test_a_relu_feeding_a_pool_and_another_branch():
    """The XLA route fuses it (the ReLU stays for the other consumer); whatever the Grappler
    pass decides, an unfused pair carries a reason and a fused one its bytes."""
    inp = keras.Input((8, 8, 2))
    a = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inp)
    p = keras.layers.Flatten()(keras.layers.MaxPooling2D(2)(a))
    g = keras.layers.GlobalAveragePooling2D()(a)
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Concatenate()([p, g])))
    report = tf_relupool.fusion_report(model, batch_size=2)
    assert [p["fused"] for p in report.pairs if p["route"] == "xla"] == [True]
    layers = {layer.name for layer in model.layers}
    for pair in report.pairs:
        assert (pair["bytes_saved"] or 0) > 0 if pair["fused"] else pair["reason"]
        if not pair["fused"]:  # the pass's log line, its op names made the model's layer names
            quoted = re.findall(r"'([^']+)'", pair["reason"])
            assert quoted and set(quoted) <= layers, pair["reason"]


@pytest.mark.parametrize("kwargs, word", [({"batch_size": 0}, "batch_size"),
                                          ({"batch_size": 2.5}, "batch_size"),
                                          ({"routes": ("xla", "gpu")}, "routes"),
                                          ({"keep": "codes"}, "keep")])
def test_bad_arguments_are_named(kwargs, word):
    with pytest.raises(ValueError, match=word):
        tf_relupool.fusion_report(_model(), **kwargs)


def test_unknown_input_size_is_an_error():
    inp = keras.Input((None, None, 3))
    out = keras.layers.MaxPooling2D(2)(keras.layers.ReLU()(inp))
    with pytest.raises(ValueError, match="unknown dimensions"):
        tf_relupool.fusion_report(keras.Model(inp, out))


def test_no_pool_still_says_zero_pairs():
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inp)
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(x)))
    text = str(tf_relupool.fusion_report(model, batch_size=2))
    assert "xla: 0 of 0 ReLU + max-pool pair(s) fused" in text
    assert "grappler: 0 of 0 ReLU + max-pool pair(s) fused" in text


def test_activation_segments_listed_with_their_route_and_bytes():
    """activations=True: each segment of the XLA trace, named by the user's layer, recomputed or
    why not; a recomputed one's output bytes."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="c1")(inp)
    x = keras.layers.ReLU(6.0, name="act1")(keras.layers.BatchNormalization(name="bn1")(x))
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="c2")(x)
    a = keras.layers.Activation("swish", name="act2")(
        keras.layers.BatchNormalization(name="bn2")(x))
    x = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling2D()(a),
                                    keras.layers.Flatten()(a)])  # a Flatten keeps act2's output
    model = keras.Model(inp, keras.layers.Dense(3)(x))
    report = tf_relupool.fusion_report(model, batch_size=2, routes="xla", activations=True)
    rows = {g["where"]: g for g in report.segments}
    assert set(rows) == {"act1", "act2"}, rows
    assert rows["act1"]["what"] == "relu6" and rows["act1"]["recomputed"]
    assert rows["act1"]["bytes_saved"] == 2 * 8 * 8 * 4 * 4
    assert rows["act2"]["what"] == "silu" and not rows["act2"]["recomputed"]
    assert "feeds" in rows["act2"]["reason"] and rows["act2"]["bytes_saved"] is None
    assert "1 of 2 segment(s) recomputed" in str(report)
    with pytest.raises(ValueError, match="activations"):
        tf_relupool.fusion_report(model, routes="grappler", activations=True)


def test_activation_in_no_segment_listed_with_why():
    """An activation of the table that starts no segment is listed with why (a ReLU reading a
    conv's biased output, a ReLU6 reading an Add of a constant); the composite hard swish
    x * ReLU(6)(x + 3) / 6 (Keras 2's MobileNetV3 form) is one segment, named by its Multiply."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="c1")(inp)
    x = keras.layers.BatchNormalization(name="bn")(
        keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="c2")(x))
    h = keras.layers.ReLU(6.0, name="hard")(x + 3.0) * (1.0 / 6.0)
    x = keras.layers.Conv2D(4, 3, name="c3")(keras.layers.Multiply(name="swish")([x, h]))
    x = keras.layers.ReLU(6.0, name="shifted")(x + 1.0)
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(x)))
    report = tf_relupool.fusion_report(model, batch_size=2, routes="xla", activations=True)
    rows = {g["where"]: g for g in report.segments}
    assert set(rows) == {"c1", "swish", "shifted"}, rows
    assert rows["swish"]["what"] == "hard_silu" and rows["swish"]["recomputed"]
    # named by what the user wrote: c1's own bias, the model's operation `x + 1.` (an Add)
    adds = {op.name for op in model.operations if type(op).__name__ == "Add"}
    for where, what, producer in (
            ("c1", "relu", r"its input \(BiasAdd inside the same layer"),
            ("shifted", "relu6", r"from operation '(\w+)' \(Add, its op AddV2\)")):
        assert rows[where]["what"] == what and not rows[where]["segment"]
        assert not rows[where]["recomputed"], rows[where]
        found = re.search(producer, rows[where]["reason"])
        assert found and (not found.groups() or found.group(1) in adds), rows[where]["reason"]
    assert "1 of 1 segment(s) recomputed" in str(report)
    assert "2 activation(s) in no segment" in str(report)


# keras-io's examples, built as they build them (automatic layer names, whose global counter
# differs from one model to the next: each row is compared with the model's own names), at small
# input sizes.

def _mnist_convnet():
    """keras-io mnist_convnet."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(10, activation="softmax")])


def _distillation_teacher():
    """keras-io knowledge_distillation's teacher, its channels scaled down."""
    return keras.Sequential([
        keras.Input((12, 12, 1)),
        keras.layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
        keras.layers.LeakyReLU(negative_slope=0.2),
        keras.layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
        keras.layers.Conv2D(32, (3, 3), strides=(2, 2), padding="same"),
        keras.layers.Flatten(),
        keras.layers.Dense(10)], name="teacher")


def _cnn_3d():
    """keras-io 3D_image_classification's first block and head, its volume and widths scaled
    down."""
    inputs = keras.Input((10, 10, 6, 1))
    x = keras.layers.Conv3D(filters=8, kernel_size=3, activation="relu")(inputs)
    x = keras.layers.MaxPool3D(pool_size=2)(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.GlobalAveragePooling3D()(x)
    x = keras.layers.Dense(units=16, activation="relu")(x)
    x = keras.layers.Dropout(0.3)(x)
    outputs = keras.layers.Dense(units=1, activation="sigmoid")(x)
    return keras.Model(inputs, outputs, name="3dcnn")


def _pools(model, cls=keras.layers.MaxPooling2D):
    return [layer for layer in model.layers if isinstance(layer, cls)]


def _rows(report, route):
    return [p for p in report.pairs if p["route"] == route]


@pytest.mark.parametrize("build", [_mnist_convnet, _distillation_teacher])
def test_rows_name_the_models_own_pool_layers_on_both_routes(build):
    """Each route's rows name the pools as the model's path and the pool layers' own names, in
    order; a second model of the same kind (other automatic names) too."""
    for _ in range(2):
        model = build()
        report = tf_relupool.fusion_report(model, batch_size=2)
        expected = [f"{model.name}/{layer.name}" for layer in _pools(model)]
        for route in ("xla", "grappler"):
            assert [p["where"] for p in _rows(report, route)] == expected, (route, report)


def test_grappler_reason_names_the_layer_before_the_pool():
    """The teacher's LeakyReLU: the graph pass fuses ReLU only, and says so naming the layer."""
    model = _distillation_teacher()
    (leaky,) = [layer for layer in model.layers if isinstance(layer, keras.layers.LeakyReLU)]
    (pair,) = _rows(tf_relupool.fusion_report(model, batch_size=2, routes="grappler"),
                    "grappler")
    assert not pair["fused"]
    assert pair["reason"].startswith(
        f"the pool's input comes from layer {leaky.name!r} (LeakyReLU"), pair["reason"]


@pytest.mark.parametrize("build", [_mnist_convnet, _distillation_teacher, _cnn_3d])
def test_an_activation_the_pool_fusion_took_says_so(build):
    """mnist's and the 3-D CNN's Conv(activation="relu"), the teacher's LeakyReLU: each feeds a
    fused pool, and its row says that fusion took it, naming the pool's row (not "no gradient
    traced", nor "its input (from BiasAdd) is kept by nothing else")."""
    model = build()
    report = tf_relupool.fusion_report(model, batch_size=2, routes="xla", activations=True)
    pools = _pools(model, (keras.layers.MaxPooling2D, keras.layers.MaxPooling3D))
    before = [model.layers[model.layers.index(pool) - 1] for pool in pools]
    fused = {p["where"] for p in _rows(report, "xla") if p["fused"]}
    rows = {g["where"]: g for g in report.segments}
    for layer, pool in zip(before, pools):
        where = model.name + "/" + pool.name if isinstance(model, keras.Sequential) else pool.name
        assert where in fused, report
        row = rows[where.replace(pool.name, layer.name)]
        assert not row["recomputed"] and row["pool_fusion"] == where, row
        assert row["reason"].startswith(
            f"taken by the ReLU + max-pool fusion of {where!r}"), row["reason"]
    assert f"{len(pools)} taken by the ReLU + max-pool fusion" in str(report)


def test_activation_functions_named_by_their_operation():
    """`keras.activations.swish(x)` and `keras.ops.nn.relu(x)` called on a functional model's
    tensors: each row names the model's operation (`model.operations`), under the model's path,
    not the model alone."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inp)
    x = keras.activations.swish(keras.layers.BatchNormalization()(x))
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(x)
    x = keras.ops.nn.relu(keras.layers.BatchNormalization()(x))
    x = keras.layers.Conv2D(4, 3, padding="same")(x)
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(x)))
    functions = [op for op in model.operations if not isinstance(op, keras.layers.Layer)]
    assert [type(op).__name__ for op in functions] == ["Silu", "Relu"]
    report = tf_relupool.fusion_report(model, batch_size=2, routes="xla", activations=True)
    assert [(g["where"], g["what"]) for g in report.segments] == [
        (f"{model.name}/{functions[0].name}", "silu"),
        (f"{model.name}/{functions[1].name}", "relu")], report
    assert all(g["recomputed"] for g in report.segments), report
    # the functions' `call` is the model's own again
    assert all("call" not in vars(op) for op in functions)


def _xception_block():
    """image_classification_from_scratch's (Xception-like) block: ... SeparableConv2D ->
    BatchNormalization -> MaxPooling2D(3, strides=2, padding="same"), its widths scaled down."""
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, strides=2, padding="same")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.SeparableConv2D(8, 3, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def test_a_pool_after_batch_norm_names_the_layer_on_both_routes():
    model = _xception_block()
    bn = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    report = tf_relupool.fusion_report(model, batch_size=2)
    for route in ("xla", "grappler"):
        (pair,) = _rows(report, route)
        assert not pair["fused"] and pair["where"] == _pools(model)[0].name, pair
        assert pair["reason"].startswith(
            f"the pool's input comes from layer {bn[-1].name!r} (BatchNormalization"), pair


def test_a_segment_feeding_a_layer_names_that_layer():
    """ConvMixer's activation block (Activation("gelu") -> BatchNormalization) and a
    Dense(activation=gelu) -> Dropout (MobileViT's, EANet's MLP): each GELU's output is kept for
    the next layer's gradient, and the row names that layer, not its op (SquaredDifference,
    Mul)."""
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, kernel_size=2, strides=2)(inputs)
    x = keras.layers.Activation("gelu")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dense(8, activation=keras.activations.gelu)(x)
    x = keras.layers.Dropout(0.1)(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(x)))
    act, bn, dense, dropout = model.layers[2:6]
    assert (type(bn), type(dropout)) == (keras.layers.BatchNormalization, keras.layers.Dropout)
    report = tf_relupool.fusion_report(model, batch_size=2, routes="xla", activations=True)
    rows = {g["where"]: g for g in report.segments}
    assert rows[act.name]["reason"] == (
        f"the gelu output also feeds layer {bn.name!r} (BatchNormalization)"), rows
    assert rows[dense.name]["reason"] == (
        f"the gelu output also feeds layer {dropout.name!r} (Dropout)"), rows


def test_3d_pools_on_the_grappler_route_are_said_not_covered():
    """The 3-D CNN: the XLA route fuses its MaxPool3D; the Grappler route lists it as not
    covered there (not "0 of 0" pairs, which reads as no pool at all)."""
    model = _cnn_3d()
    (pool,) = _pools(model, keras.layers.MaxPooling3D)
    report = tf_relupool.fusion_report(model, batch_size=2)
    (xla,), (grappler,) = _rows(report, "xla"), _rows(report, "grappler")
    assert xla["fused"] and xla["where"] == pool.name
    assert not grappler["fused"] and grappler["where"] == pool.name and grappler["rank"] == 3
    assert grappler["reason"] == report_module.NOT_COVERED_3D
    text = str(report)
    assert "grappler: 0 of 1 ReLU + max-pool pair(s) fused" in text
    assert "grappler: 1 3-D max pool(s) not covered on this route" in text


def test_the_report_says_what_its_bytes_count():
    """The figure is the tensors stock keeps for the pool's gradient, less the codes: the report
    says so, and that XLA's allocation is not what it counts."""
    model = _mnist_convnet()
    report = tf_relupool.fusion_report(model, batch_size=2, routes="xla")
    first = _rows(report, "xla")[0]
    # mnist's first pool: the 2x26x26x32 fp32 ReLU output, against 2x13x13x32 one-byte codes
    assert first["bytes_saved"] == 2 * 26 * 26 * 32 * 4 - 2 * 13 * 13 * 32
    text = str(report)
    assert report_module.BYTES_NOTE in text
    for words in ("stock's graph keeps for the pool's gradient", "one byte per pooled element",
                  "not what XLA allocates"):
        assert words in report_module.BYTES_NOTE


def test_reports_of_one_model_on_two_threads_name_the_same_rows():
    """Each thread's trace maps its own ops (the op callbacks are per thread) and the model's
    operations are wrapped for one report at a time: both threads read the rows one thread
    reads, and the operations' `call` is their own afterwards."""
    import threading
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inp)
    x = keras.ops.nn.relu(keras.layers.BatchNormalization()(x))
    x = keras.layers.MaxPooling2D()(keras.layers.Conv2D(4, 3, padding="same")(x))
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(x)))

    def rows():
        report = tf_relupool.fusion_report(model, batch_size=2, activations=True)
        return [(p["route"], p["where"], p["fused"]) for p in report.pairs] + [
            (g["where"], g["what"], g["recomputed"]) for g in report.segments]
    alone = rows()
    got = [None, None]

    def run(i):
        got[i] = rows()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [alone, alone], got
    (relu,) = [op for op in model.operations if not isinstance(op, keras.layers.Layer)]
    assert (f"{model.name}/{relu.name}", "relu", True) in alone and "call" not in vars(relu)
