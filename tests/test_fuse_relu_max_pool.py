"""cc/grappler/fuse_relu_max_pool.cc: the fusion patterns inside Grappler, each fused bitwise like
the switch off (keep "argmax" and "input"), and the candidates it must leave alone (other
consumers, a split over devices, refusals with their one log line).

Each case runs in a fresh subprocess (tests/grappler_cases.py); test_patterns.py covers every
pattern of the table with every op of its roles.
"""
import glob
import textwrap

import pytest

from grappler_cases import FUSED, GPU, PAD_STEP, STOCK, require_optimizer, run_case

optimizer_available = pytest.fixture(scope="module", autouse=True)(require_optimizer)


@pytest.mark.parametrize("keep", ["argmax", "input"])
def test_stock_train_step_is_fused_and_bitwise_equal(keep):
    r = run_case(f"""
        w, x = make()
        off, off_ops = ran_ops(tf.function(train_step_fn(w)), x)
        tf_relupool.enable_recompute({keep!r})
        on, on_ops = ran_ops(tf.function(train_step_fn(w)), x)
        same = all(np.array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32))
                   for a, b in zip(off, on))
        print(json.dumps(dict(off_ops=off_ops, on_ops=on_ops, same=same,
                              stats=grappler.stats(), types=grappler.registered_device_types())))
    """)
    fwd, bwd = (("ReluMaxPoolWithWindowArgmax", "ReluMaxPoolGradFromWindowArgmax")
                if keep == "argmax" else ("ReluMaxPool", "ReluMaxPoolGrad"))
    assert {"Relu", "MaxPool", "MaxPoolGrad", "ReluGrad"} <= set(r["off_ops"])
    assert fwd in r["on_ops"] and bwd in r["on_ops"], r["on_ops"]
    assert not {"Relu", "MaxPool", "MaxPoolGrad", "ReluGrad"} & set(r["on_ops"]), r["on_ops"]
    assert r["same"]
    assert r["stats"]["fused_with_grad"] == 1 and r["stats"]["errors"] == 0, r["stats"]
    assert r["types"] == ["CPU", "GPU"]


def test_relu_with_other_consumers_is_left_alone_and_forward_only_is_fused():
    r = run_case("""
        tf_relupool.enable_recompute()
        x = tf.random.normal([2, 8, 8, 4])
        @tf.function
        def two_uses(x):
            r = tf.nn.relu(x)
            return tf.nn.max_pool2d(r, 2, 2, "VALID"), r
        @tf.function
        def forward(x):
            return tf.nn.max_pool2d(tf.nn.relu(x * 2.0), 2, 2, "VALID")
        (a, r), ops_two = ran_ops(two_uses, x)
        y, ops_fwd = ran_ops(forward, x)
        expect = tf.nn.max_pool2d(tf.nn.relu(x * 2.0), 2, 2, "VALID")
        print(json.dumps(dict(ops_two=ops_two, ops_fwd=ops_fwd, stats=grappler.stats(),
                              same=bool(np.array_equal(y.numpy(), expect.numpy())))))
    """)
    assert "MaxPool" in r["ops_two"] and "Relu" in r["ops_two"]
    assert "ReluMaxPool" in r["ops_fwd"] and "MaxPool" not in r["ops_fwd"]
    assert r["same"]
    # On the CPU the pass meets the pair and says why it left it; on a GPU the layout optimizer
    # has already put a Transpose between them (NCHW pooling), so it is no candidate at all.
    if not glob.glob("/dev/nvidia[0-9]*"):
        assert "other consumers" in r["stats"]["last_skip"]


def test_pattern_split_over_devices_is_left_as_placed():
    """A ReLU on one device feeding a pool on another (model parallelism, a strategy's placement):
    the fused op would run on one of them, so the pass leaves the pair as placed, says why in
    one line, and the values are stock's."""
    r = run_case("""
        tf.config.set_visible_devices([], "GPU")  # two CPU devices; no GPU takes the gradient
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        tf_relupool.enable_recompute()
        x = tf.random.normal([2, 8, 8, 4])
        @tf.function
        def split(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                with tf.device("/cpu:0"):
                    r = tf.nn.relu(x)
                with tf.device("/cpu:1"):
                    y = tf.nn.max_pool2d(r, 2, 2, "VALID")
                loss = tf.reduce_sum(y * y)
            return y, tape.gradient(loss, x)
        grappler.reset_stats()
        (y, dx), ops = ran_ops(split, x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y_ref = tf.nn.max_pool2d(tf.nn.relu(x), 2, 2, "VALID")
            loss = tf.reduce_sum(y_ref * y_ref)
        dx_ref = tape.gradient(loss, x)
        print(json.dumps(dict(ops=ops, stats=grappler.stats(),
                              same=bits_equal(y, y_ref) and bits_equal(dx, dx_ref))))
    """)
    assert {"Relu", "MaxPool", "MaxPoolGrad"} <= set(r["ops"]), r["ops"]
    assert not any(op.startswith("ReluMaxPool") for op in r["ops"]), r["ops"]
    assert r["same"]
    assert r["stats"]["errors"] == 0 and r["stats"]["not_fused"] >= 1, r["stats"]
    assert "on different devices" in r["stats"]["last_skip"], r["stats"]["last_skip"]


def test_keras_conv_relu_after_remapper_is_fused():
    r = run_case("""
        import keras
        tf_relupool.enable_recompute()
        m = small_cnn(2)
        # jit_compile=False: Keras' default "auto" compiles with XLA where a GPU is visible, and
        # XLA clusters never reach Grappler (cc/grappler/README.md).
        m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
        h = m.fit(tf.random.normal([8, 16, 16, 3]), tf.zeros([8], tf.int32), epochs=1,
                  verbose=0, batch_size=8)
        print(json.dumps(dict(stats=grappler.stats(), loss=float(h.history["loss"][0]))))
    """)
    assert r["stats"]["fused_with_grad"] >= 1 and r["stats"]["fused_conv_relu"] >= 1, r["stats"]
    assert r["stats"]["errors"] == 0


@pytest.mark.parametrize("keep", ["argmax", "input"])
def test_maxpool_v2_and_relu_pad_maxpool_are_fused_and_bitwise_equal(keep):
    """MaxPoolV2 (window from constant inputs) and Relu -> Pad -> MaxPool (ResNet/DenseNet
    stems): values and gradients (weights and input) bitwise equal to the switch off."""
    r = run_case(PAD_STEP + textwrap.dedent(f"""
        w, x = make()
        x = tf.constant(np.random.default_rng(1).normal(0, 1, [2, 11, 13, 3]).astype(np.float32))
        cases = dict(
            v2=dict(v2=True, pad=False, ksize=3, strides=2, padding="SAME"),
            pad_stem=dict(),                                           # ResNet50's pool1
            pad_asym_same=dict(pads=((0, 0), (0, 2), (1, 0), (0, 0)), ksize=2, strides=1,
                               padding="SAME"),                        # overlapping windows
            pad_channels_batch=dict(pads=((1, 0), (1, 1), (2, 2), (0, 3))),
            pad_positive_value=dict(pad_value=0.5, ksize=2, strides=2),
            pad_maxpool_v2=dict(v2=True, ksize=3, strides=2, padding="VALID"),
            pad_fused_conv=dict(bias=tf.constant(np.linspace(-0.5, 0.5, 8), tf.float32)),
            explicit=dict(pad=False, ksize=3, strides=2,
                          padding=[[0, 0], [1, 0], [0, 2], [0, 0]]),  # MaxPool's own padding
        )
        out = {{}}
        for name, kw in cases.items():
            same, off_ops, on_ops, st = off_then_on(pad_step(w, **kw), [x], {keep!r})
            out[name] = dict(same=same, off_ops=off_ops, on_ops=on_ops, stats=st)
        print(json.dumps(out))
    """))
    fwd, bwd = FUSED[keep]
    for name, c in r.items():
        assert c["same"], name
        assert {fwd, bwd} <= set(c["on_ops"]) and not STOCK & set(c["on_ops"]), (name, c["on_ops"])
        st = c["stats"]
        assert st["fused_with_grad"] == 1 and st["errors"] == 0, (name, st)
        assert st["not_fused"] == 0 or GPU, (name, st)
        assert st["fused_maxpool_v2"] == (1 if name.endswith("v2") else 0), (name, st)
        assert st["fused_through_pad"] == (1 if "pad" in name else 0), (name, st)
        assert st["fused_conv_relu"] == (1 if name == "pad_fused_conv" else 0), (name, st)
    assert "MaxPoolV2" in r["v2"]["off_ops"] and "Pad" in r["pad_stem"]["off_ops"]
    assert "PadV2" in r["pad_positive_value"]["on_ops"]


def test_relu_pad_maxpool_unknown_batch_forward_only_and_refusals():
    r = run_case(PAD_STEP + textwrap.dedent("""
        w, x = make()
        out = {}
        # Unknown batch: the Pad's gradient reads Shape(Relu) at run time (rewired to z).
        same, off_ops, on_ops, st = off_then_on(
            pad_step(w), [x], signature=[tf.TensorSpec([None, 12, 12, 3])])
        out["unknown_batch"] = dict(same=same, off_ops=off_ops, on_ops=on_ops, stats=st)
        # Forward only: Pad(z) -> ReluMaxPool.
        def forward():
            return lambda x: tf.nn.max_pool2d(
                tf.pad(tf.nn.relu(x * 2.0), [[0, 0], [1, 1], [1, 1], [0, 0]]), 3, 2, "VALID")
        same, _, on_ops, st = off_then_on(forward, [x])
        out["forward"] = dict(same=same, on_ops=on_ops, stats=st)
        # Left alone: a negative pad value, a Pad with another consumer, a MaxPoolV2 window that
        # is no constant.
        def negative():
            return pad_step(w, pad_value=-1.0)()
        def pad_used_twice():
            def f(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    p = tf.pad(tf.nn.relu(x), [[0, 0], [1, 1], [1, 1], [0, 0]])
                    loss = tf.reduce_sum(tf.nn.max_pool2d(p, 3, 2, "VALID")) + tf.reduce_sum(p)
                return loss, tape.gradient(loss, x)
            return f
        def window_argument():
            return lambda x, k: tf.raw_ops.MaxPoolV2(input=tf.nn.relu(x), ksize=k,
                                                      strides=[1, 2, 2, 1], padding="VALID")
        for name, make_fn, args in (("negative", negative, [x]),
                                    ("pad_used_twice", pad_used_twice, [x]),
                                    ("window_argument", window_argument,
                                     [x, tf.constant([1, 2, 2, 1])])):
            same, _, on_ops, st = off_then_on(make_fn, args)
            out[name] = dict(same=same, on_ops=on_ops, stats=st)
        print(json.dumps(out))
    """))
    # On a GPU the forward-only graph has no convolution: TF's layout optimizer turns the pool
    # alone to NCHW, with a Transpose between it and the Pad (no candidate; cc/grappler/README.md).
    for name in ("unknown_batch",) + (() if GPU else ("forward",)):
        c = r[name]
        assert c["same"] and c["stats"]["fused_through_pad"] == 1, (name, c)
        assert not STOCK & set(c["on_ops"]), (name, c["on_ops"])
    assert "Shape" in r["unknown_batch"]["off_ops"]  # Shape(Relu), for the Pad's gradient
    assert "ReluMaxPool" in r["forward"]["on_ops"] or GPU
    assert r["forward"]["same"]
    for name, why in (("negative", "negative or NaN"), ("pad_used_twice", "Pad has other consumers"),
                      ("window_argument", "ksize is not a constant")):
        c = r[name]
        assert c["same"], name
        if not GPU:  # on a GPU the layout optimizer's Transposes make them no candidate at all
            assert c["stats"]["not_fused"] >= 1, (name, c)
            assert why in c["stats"]["last_skip"], (name, c["stats"]["last_skip"])
        assert not {"ReluMaxPool", "ReluMaxPoolWithWindowArgmax"} & set(c["on_ops"]), name
