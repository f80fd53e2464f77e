"""cc/grappler/fold_transposes.cc: fused ops between the layout optimizer's Transposes take their
NCHW form (first and second order, bitwise), and with the layout optimizer off the ResNet50 stem
pool stays NHWC on a GPU.

Each case runs in a fresh subprocess (tests/grappler_cases.py).
"""
import pytest

from grappler_cases import GPU, applications_case, require_optimizer, run_case

optimizer_available = pytest.fixture(scope="module", autouse=True)(require_optimizer)


@pytest.mark.parametrize("keep", ["argmax", "input"])
def test_fused_ops_between_transposes_take_their_nchw_form(keep):
    # The graph the layout optimizer makes on a GPU of a model built with tf_relupool's layers:
    # NCHW tensors, the NHWC fused ops between Transposes. Written by hand here (the CPU has no
    # layout optimizer at work); the pass must leave no Transpose next to a fused op, also with
    # the switch off (the first fused op registers the pass).
    r = run_case(f"""
        def make_fn(ksize, strides, padding, dtype):
            # No Cast next to the Transposes: TF's arithmetic optimizer would swap them.
            scale = tf.constant(np.linspace(-1.5, 1.5, 5).reshape(1, 5, 1, 1), dtype)
            def step(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = tf_relupool.relu_max_pool2d(tf.transpose(x * scale, [0, 2, 3, 1]), ksize,
                                                    strides, padding, keep={keep!r})
                    y = tf.transpose(y, [0, 3, 1, 2])
                    loss = tf.reduce_sum(y * y)
                return loss, tape.gradient(loss, x)
            return step

        def next_to_fused(nodes):
            # ops feeding each fused op, or reading its output 0
            by_name = {{n.name: n for n in nodes}}
            near = []
            for n in nodes:
                if not n.op.startswith("ReluMaxPool"):
                    continue
                near += [by_name[i.split(":")[0]].op for i in n.input if not i.startswith("^")]
                near += [m.op for m in nodes if n.name in m.input or n.name + ":0" in m.input]
            return near, sorted({{n.attr["data_format"].s.decode() for n in nodes
                                  if n.op.startswith("ReluMaxPool")}})

        results = []
        explicit = [[0, 0], [1, 0], [0, 2], [0, 0]]  # NHWC pairs: permuted with the format
        for ksize, strides, padding, dtype, batch in [(2, 2, "VALID", "float32", 3),
                                                      (3, 2, "SAME", "bfloat16", None),
                                                      (3, 1, "SAME", "float16", 3),
                                                      (2, 3, "VALID", "float64", None),
                                                      (3, 2, explicit, "float32", None)]:
            sig = [tf.TensorSpec([batch, 5, 9, 7], dtype)]
            x = tf.cast(tf.random.stateless_normal([3, 5, 9, 7], seed=[ksize, strides]), dtype)
            # Baseline: plugin optimizers off (RewriterConfig.use_plugin_optimizers). Then the
            # pass, with the switch off: the layout part runs wherever fused ops are.
            tf.config.optimizer.set_experimental_options({{"use_plugin_optimizers": False}})
            off, off_nodes = ran_nodes(tf.function(make_fn(ksize, strides, padding, dtype),
                                                  input_signature=sig), x)
            tf.config.optimizer.set_experimental_options({{"use_plugin_optimizers": True}})
            grappler.reset_stats()
            on, on_nodes = ran_nodes(tf.function(make_fn(ksize, strides, padding, dtype),
                                                input_signature=sig), x)
            st = grappler.stats()
            results.append(dict(
                same=all(bits_equal(a.numpy(), b.numpy()) for a, b in zip(off, on)),
                off=next_to_fused(off_nodes), on=next_to_fused(on_nodes),
                transposes=[sum(n.op == "Transpose" for n in off_nodes),
                            sum(n.op == "Transpose" for n in on_nodes)],
                nchw_ops=st["nchw_ops"], errors=st["errors"],
                registered=grappler.registered_device_types(),
                switch=tf_relupool.recompute_mode()))
        print(json.dumps(results))
    """)
    for case in r:
        assert case["same"], case
        assert "Transpose" in case["off"][0] and case["off"][1] == ["NHWC"], case
        assert "Transpose" not in case["on"][0] and case["on"][1] == ["NCHW"], case
        assert case["transposes"] == [4, 0] and case["nchw_ops"] == 2 and case["errors"] == 0, case
        assert case["registered"] == ["CPU", "GPU"] and case["switch"] is None, case


def test_second_order_graph_between_transposes_is_bitwise_equal():
    # A gradient penalty (second order) through the NHWC fused op between Transposes: the
    # gradient-of-gradient op reads the codes too, so it switches to NCHW with the forward.
    r = run_case("""
        scale = tf.constant(np.linspace(-1.5, 1.5, 6).reshape(1, 6, 1, 1), tf.float32)
        def make():
            def step(x):
                with tf.GradientTape() as outer:
                    outer.watch(x)
                    with tf.GradientTape() as inner:
                        inner.watch(x)
                        y = tf_relupool.relu_max_pool2d(tf.transpose(x * scale, [0, 2, 3, 1]),
                                                        3, 2, "SAME")
                        y = tf.transpose(y, [0, 3, 1, 2])
                        loss = tf.reduce_sum(y * y)
                    g = inner.gradient(loss, x)
                    penalty = tf.reduce_sum(g * g * scale)
                return loss, g, outer.gradient(penalty, x)
            return step
        x = tf.random.stateless_normal([2, 6, 9, 8], seed=[3, 4])
        tf.config.optimizer.set_experimental_options({"use_plugin_optimizers": False})
        off, off_ops = ran_ops(tf.function(make()), x)
        tf.config.optimizer.set_experimental_options({"use_plugin_optimizers": True})
        grappler.reset_stats()
        on, on_ops = ran_ops(tf.function(make()), x)
        st = grappler.stats()
        print(json.dumps(dict(same=all(bits_equal(a.numpy(), b.numpy()) for a, b in zip(off, on)),
                              off_ops=off_ops, on_ops=on_ops, stats=st)))
    """)
    assert "ReluMaxPoolGradGradFromWindowArgmax" in r["on_ops"], r["on_ops"]
    assert r["stats"]["nchw_ops"] >= 3 and r["stats"]["errors"] == 0, r["stats"]
    assert r["same"]


@pytest.mark.skipif(not GPU, reason="no GPU visible to TensorFlow")
def test_resnet50_on_the_gpu_is_bitwise_with_nhwc_pooling():
    """With TensorFlow's layout optimizer off the stem pool stays NHWC, where stock's GPU gradient
    adds overlapping windows in output order like the fused op: bitwise (H200, measured)."""
    r = applications_case("ResNet50", 32, setup='tf.config.optimizer.set_experimental_options('
                                               '{"layout_optimizer": False})')
    assert r["stats"]["fused_with_grad"] == 1 and r["stats"]["errors"] == 0, r["stats"]
    assert r["same_y"] and r["same_grad"], r["grad_rel"]
    assert "MaxPoolGrad" in r["off_ops"] and "ReluMaxPoolGradFromWindowArgmax" in r["on_ops"]
