"""tf_relupool.fusion_report (tf_relupool/report.py): each ReLU + max pool of a Keras model's
training step, fused or why not, on the XLA and Grappler routes, and the bytes each fusion
saves per step."""
import keras
import pytest
import tensorflow as tf

import tf_relupool


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
    # the BatchNormalization's pool: no ReLU in front, said so
    assert "not a ReLU" in pairs[1]["reason"] and pairs[1]["bytes_saved"] is None
    if route == "xla":  # naming the user's layer the pool's input comes from
        assert pairs[1]["reason"].startswith("after layer 'bn': "), pairs[1]["reason"]
    # p1: 16x32x32x8 fp32 ReLU output kept by stock, against 16x16x16x8 one-byte codes;
    # p3 (3x3... here 2x2 stride 1 SAME over 8x8x4): 16x8x8x4 floats against as many codes
    assert pairs[0]["bytes_saved"] == 16 * 32 * 32 * 8 * 4 - 16 * 16 * 16 * 8
    assert pairs[2]["bytes_saved"] == 16 * 8 * 8 * 4 * 4 - 16 * 8 * 8 * 4
    assert report.bytes_saved(route) == pairs[0]["bytes_saved"] + pairs[2]["bytes_saved"]
    assert "| no |" in str(report) and f"{route}: 2 of 3 ReLU + max-pool pair(s) fused" in str(
        report)
    if route == "xla":  # the user's layer names (TensorFlow's re-traced scope adds "_1")
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
    for pair in report.pairs:
        assert (pair["bytes_saved"] or 0) > 0 if pair["fused"] else pair["reason"]


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
    for where, what, producer in (("c1", "relu", "BiasAdd"), ("shifted", "relu6", "AddV2")):
        assert rows[where]["what"] == what and not rows[where]["segment"]
        assert not rows[where]["recomputed"] and producer in rows[where]["reason"]
    assert "1 of 1 segment(s) recomputed" in str(report)
    assert "2 activation(s) in no segment" in str(report)
