"""cc/grappler/patterns.h and tf_relupool/patterns.py: the one pattern table both fusers read.

Every pattern of the table, built from stock ops with every op type of its roles, is fused by
each fuser the table names for it, bitwise like stock: the Grappler pass (a training step, or the
forward for forward-only patterns, in a fresh process) and the trace-time fusion under XLA
(keras_fusion, Keras' max_pool inside a jit-compiled function). A pattern or op added to the
table without a builder here, or without a fuser that handles it, fails these tests.
"""
import itertools
import os
import logging
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_relupool
from tf_relupool import keras_fusion, patterns

from grappler_cases import require_optimizer, run_case

# How each op type of the table is built from stock ops, applied to h (a 4-D NHWC float tensor);
# shared by both fusers' cases (the Grappler case runs the same text in its subprocess).
BUILDERS = """
def build(op, h, w):
    if op == "Relu":
        return tf.nn.relu(h)
    if op == "Relu6":
        return tf.nn.relu6(h)
    if op == "LeakyRelu":
        return tf.nn.leaky_relu(h, alpha=0.2)
    if op == "Pad":
        return tf.pad(h, [[0, 0], [1, 1], [1, 1], [0, 0]])
    if op == "PadV2":
        return tf.raw_ops.PadV2(input=h, paddings=[[0, 0], [1, 0], [0, 1], [0, 0]],
                                constant_values=tf.constant(0.0, h.dtype))
    if op == "MaxPool":
        return tf.nn.max_pool2d(h, 3, 2, "VALID")
    if op == "MaxPoolV2":
        return tf.raw_ops.MaxPoolV2(input=h, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1],
                                    padding="SAME")
    if op == "_FusedConv2D":   # conv + bias + relu: TF's remapper makes it one _FusedConv2D
        return tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, w, 1, "SAME"), tf.ones([4]) * 0.1))
    if op == "Conv2D":
        return tf.nn.conv2d(h, w, 1, "SAME")
    raise KeyError(op)
"""
exec(BUILDERS)  # defines build() here too  # noqa: S102


def _cases(fuser):
    """(pattern name, chain, ops: one op type per role, gradient) for every combination."""
    out = []
    for p in patterns.for_fuser(fuser):
        roles = p.chain[1:] if fuser == "trace" else p.chain   # trace: Keras' max_pool is the pool
        for ops in itertools.product(*(sorted(patterns.role_ops(r)) for r in roles)):
            out.append((p.name, roles, ops, p.gradient))
    return out


def test_table_from_the_library_is_well_formed():
    roles, table = patterns.table()
    assert {"pool", "relu", "pad"} <= set(roles)
    assert all(r.ops for r in roles.values())
    names = [p.name for p in table]
    assert len(names) == len(set(names))
    for p in table:
        assert p.fusers and set(p.chain) <= set(roles), p
    # the trace-time fuser's patterns start at Keras' max_pool and end at a ReLU or a
    # non-decreasing activation (keras_fusion)
    for p in patterns.for_fuser("trace"):
        assert p.chain[0] == "pool" and p.chain[-1] in ("relu", "monotone"), p


def test_table_parser_rejects_malformed_lines():
    ok = "role\tpool\tMaxPool\t\nrole\trelu\tRelu\t\npattern\tp\tpool(relu(z))\tgrappler\tgradient\t\n"
    roles, table = patterns.parse_table(ok)
    assert table[0].chain == ("pool", "relu") and table[0].gradient
    for bad in ("pattern\tp\tpool(relu(z))\tgrappler\tgradient\t\n",          # unknown roles
                ok.replace("pool(relu(z))", "pool(relu(z)"),                 # unbalanced
                ok.replace("grappler\t", "xla\t"),                            # unknown fuser
                ok.replace("gradient\t", "both\t"),
                "node\tx\n"):
        with pytest.raises(ValueError):
            patterns.parse_table(bad)
    assert patterns.parse_chain("pool(pad(relu(z)))") == ("pool", "pad", "relu")
    with pytest.raises(ValueError):
        patterns.for_fuser("xla")


@pytest.mark.parametrize("keep", ["argmax", "input"])
def test_grappler_fuses_every_pattern_of_the_table(keep):
    require_optimizer()
    cases = _cases("grappler")
    assert cases
    r = run_case(BUILDERS + textwrap.dedent(f"""
        out = {{}}
        for name, roles, ops, gradient in {cases!r}:
            def make():
                rng = np.random.default_rng(1)
                w0 = tf.constant(rng.normal(0, 0.3, [3, 3, 3, 4]), tf.float32)
                w = tf.constant(rng.normal(0, 0.3, [3, 3, 4, 4]), tf.float32)
                def chain(x):
                    # a convolution first, as in a model: on a GPU the layout optimizer then
                    # runs the whole chain in NCHW (without one it leaves the ReLU in NHWC and
                    # the pool in NCHW, with a Transpose between: no pattern)
                    h = build("Conv2D", x, w0)
                    for op in reversed(ops):
                        h = build(op, h, w)
                    return h
                if not gradient:
                    return chain
                def step(x):
                    with tf.GradientTape() as tape:
                        tape.watch(x)
                        loss = tf.reduce_sum(chain(x) ** 2)
                    return loss, tape.gradient(loss, x)
                return step
            x = tf.constant(np.random.default_rng(2).normal(size=[2, 9, 9, 3]), tf.float32)
            same, off_ops, on_ops, st = off_then_on(make, (x,), {keep!r})
            out[name + ":" + ",".join(ops)] = dict(same=same, off=off_ops, on=on_ops, stats=st)
        print(json.dumps(out))
    """))
    fwd, bwd = {"argmax": ("ReluMaxPoolWithWindowArgmax", "ReluMaxPoolGradFromWindowArgmax"),
                "input": ("ReluMaxPool", "ReluMaxPoolGrad")}[keep]
    for name, roles, ops, gradient in cases:
        c = r[name + ":" + ",".join(ops)]
        where = (name, ops, c["on"], c["stats"])
        assert c["same"], where
        pool = [op for role, op in zip(roles, ops) if role == "pool"][0]
        assert pool in c["off"] and pool not in c["on"], where
        if gradient:
            assert bwd in c["on"] and c["stats"]["fused_with_grad"] == 1, where
            assert fwd in c["on"], where
        else:
            assert c["stats"]["fused_forward_only"] == 1, where
            assert "ReluMaxPool" in c["on"], where
        assert c["stats"]["errors"] == 0, where


def test_trace_time_fusion_fuses_every_trace_pattern_of_the_table():
    cases = _cases("trace")
    assert cases
    w = tf.zeros([3, 3, 3, 4])
    for name, roles, ops, gradient in cases:
        def make():
            @tf.function(jit_compile=True)
            def step(z):
                with tf.GradientTape() as tape:
                    tape.watch(z)
                    h = z
                    for op in reversed(ops):
                        h = build(op, h, w)
                    y = keras.ops.max_pool(h, 2, 2, "valid")
                    loss = tf.reduce_sum(y * y)
                return y, tape.gradient(loss, z)
            return step
        z = tf.random.stateless_normal([2, 8, 8, 4], seed=[3, 4])
        tf_relupool.disable_recompute()
        ref = make()(z)
        before = keras_fusion.stats()
        with tf_relupool.recompute():
            got = make()(z)
        after = keras_fusion.stats()
        assert after["fused"] == before["fused"] + 1, (name, ops)
        assert (after["fused_through_pad"] - before["fused_through_pad"]) == ("pad" in roles)
        for a, b in zip(got, ref):
            np.testing.assert_array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32),
                                          err_msg=f"{name} {ops}")


def test_trace_patterns_in_python_are_the_librarys():
    """The trace-time fuser's patterns and role ops held in Python (the XLA route needs no op
    library) are the library's table's, pattern for pattern."""
    ours = [(p.name, p.chain, p.gradient) for p in patterns.trace_patterns()]
    assert ours == [(p.name, p.chain, p.gradient) for p in patterns.for_fuser("trace")]
    for role in {r for p in patterns.trace_patterns() for r in p.chain}:
        assert patterns.trace_role_ops(role) == patterns.role_ops(role), role


def test_xla_route_needs_no_op_library(monkeypatch, caplog):
    """With the op library's table and loader failing, the switch still fuses Keras' pooling
    under XLA, bitwise, without trying to load the library (not once per traced pool either)."""
    from tf_relupool import _clib, _loader
    calls = []

    def broken(*args):
        calls.append(args)
        raise _loader.OpLibraryError("no library")
    monkeypatch.setattr(patterns, "table", broken)
    monkeypatch.setattr(_loader, "load_library", broken)
    monkeypatch.setattr(_clib, "handle", broken)

    def make():
        @tf.function(jit_compile=True)
        def step(z):
            with tf.GradientTape() as tape:
                tape.watch(z)
                y = keras.ops.max_pool(tf.nn.relu(z), 2, 2, "valid")
                y = keras.ops.max_pool(tf.nn.relu(y - 0.5), 2, 2, "valid")
            return y, tape.gradient(y, z, output_gradients=tf.ones_like(y))
        return step
    z = tf.random.stateless_normal([2, 8, 8, 4], seed=[5, 6])
    tf_relupool.disable_recompute()
    ref = make()(z)
    before = keras_fusion.stats()["fused"]
    with caplog.at_level(logging.WARNING, logger="tf_relupool"), tf_relupool.recompute():
        del calls[:]  # (the Grappler pass's registration may try it: not the XLA route)
        got = make()(z)
    assert keras_fusion.stats()["fused"] == before + 2
    assert calls == []
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32))


_WITHOUT_LIBRARY = r"""
import json, logging, sys
import numpy as np, tensorflow as tf, keras
import tf_relupool
from tf_relupool import keras_fusion
try:
    tf_relupool.load_library()
    loaded = True
except tf_relupool.OpLibraryError:
    loaded = False
model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, activation="relu"),
                          keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                          keras.layers.Dense(2)])
def run():
    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        return [loss] + tape.gradient(loss, model.trainable_variables)
    return [t.numpy().tobytes().hex() for t in step(tf.ones([2, 8, 8, 3]) * 0.3)]
ref = run()
tf_relupool.enable_recompute()
got = run()
print("RESULT " + json.dumps({"loaded": loaded, "same": got == ref,
                              "fused": keras_fusion.stats()["fused"]}))
"""


def test_switch_under_xla_without_the_op_library(tmp_path):
    """The package without its compiled library (a copy of the Python files): the switch still
    fuses a Keras model under XLA, bit for bit like stock."""
    import json
    import shutil
    import subprocess
    import sys
    source = os.path.dirname(tf_relupool.__file__)
    shutil.copytree(source, tmp_path / "tf_relupool", ignore=shutil.ignore_patterns(
        "*.so", "__pycache__"))
    # the copy first; the rest of PYTHONPATH stays (where TensorFlow itself may come from)
    path = [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_LIBRARY], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result == {"loaded": False, "same": True, "fused": 1}, result
