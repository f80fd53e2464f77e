"""Prototype and benchmark of the BN + ReLU recomputation: relu(bn(z)) recomputed in the
backward pass under XLA.

The prototypes are not the product feature (tf_relupool/bn_relu.py, whose `product` variants
run here). A training step (tf.function(jit_compile=True), plain SGD) for
  tiny      conv -> BN -> ReLU -> conv -> BN -> ReLU -> GAP -> dense (the HLO investigation)
  resnet    tf_relupool/_example_models.py's ResNet-style CNN
  resnet50  keras.applications.ResNet50(weights=None)
run in one fresh subprocess per variant:
  stock           the Keras model called as written
  proto           the model run by a graph walker that replaces each BN(training) [-> Add] ->
                  ReLU whose output only feeds convs (and ops that keep no input: Add, global
                  average pool) by one tf.custom_gradient over BN's normalization, the Add, the
                  ReLU and the convolutions that read the ReLU; its backward recomputes
                  relu(bn(z)) from z (the BN input, kept for BN's own gradient) and BN's
                  per-channel scale/shift, behind an XLA optimization barrier that also holds the
                  incoming gradients (so the recomputation can neither be merged with the forward
                  one nor be scheduled before the backward reaches it). BN's batch statistics
                  and moving-statistics updates are stock's ops outside the custom gradient.
  proto-nobarrier the same without the barrier
  proto-select    the CPU's stand-in for the barrier (XLA's CPU pipeline removes opt-barriers
                  right after its first CSE): z and kept shortcuts pass select(p, x, 0), p = an
                  incoming gradient's first element is finite; exact, and it orders the
                  recomputation after the incoming gradient. proto-selectall: every input
                  (BN's scale/shift vectors, the kernels too), as the GPU's barrier holds them.
  proto-add       tf.recompute_grad's own dependency (x + where(e == e, 0, nan)) on every
                  input; proto-addbig on z and kept shortcuts only
  split           trace-time friendly form: one custom gradient G for normalize [+ add] + ReLU
                  and one per consuming conv, C; G's backward recomputes the ReLU output for
                  ReluGrad, each C's for its kernel gradient (split-select, split-selectall:
                  the CPU stand-ins)
  recompute_grad  the proto's segments under tf.recompute_grad (TensorFlow's own)
  remat           the model built inside keras.RematScope(mode="activations")
  switch          stock under tf_relupool.enable_recompute(); "X+switch": variant X under it
  product         stock under tf_relupool.enable_recompute(bn_relu=True): the shipped module
                  (tf_relupool/bn_relu.py) with the pool switch, its barrier chosen as shipped
                  (XLA's where a GPU is visible, else the select); product-xla, product-select:
                  that barrier forced (TF_RELUPOOL_BN_RELU_BARRIER)

Prints per variant: peak bytes above resident during a steady step (allocator stats of the
device; on the CPU with TF_CPU_ALLOCATOR_USE_BFC=true, set here), XLA's preallocated temp
buffer of the step's executable (from an --xla_dump_to buffer assignment), median step time,
and whether losses, gradients (of both steps) and all variables after 2 steps from identical
weights and data are bitwise equal to stock's. With --hlo, op counts of the step's HLO
(before and after XLA's optimizations).

  python benchmarks/bn_relu_prototype.py --device cpu --model resnet --batch 32 --steps 5
  python benchmarks/bn_relu_prototype.py --device gpu --model resnet50 --batch 32 --steps 8 --parallel \
      --variants stock,proto,proto-nobarrier,split,remat,recompute_grad --out r50.json
  python benchmarks/bn_relu_prototype.py --device gpu --model resnet --batch 1024 --steps 10 --parallel \
      --variants stock,switch,proto+switch,split+switch,proto,remat --out resnet.json
(--parallel: the first variant compiles alone, the others then all at once; each times its
steps alone. docs/bn_relu_recompute.md has the findings.)
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("stock", "proto", "proto-select", "proto-nobarrier", "split", "split-select",
            "recompute_grad", "remat", "switch", "proto+switch", "proto-select+switch", "product")
PRODUCT_BARRIERS = {"product": None, "product-xla": "xla", "product-select": "select"}
LR = 0.01


# ----------------------------------------------------------------------------- models

def build_model(name, size, remat=False):
    import keras
    from keras import layers

    def make():
        if name == "resnet":
            from tf_relupool import _example_models as models
            return models.resnet(input_shape=(size, size, 3))
        if name == "resnet50":
            return keras.applications.ResNet50(weights=None, input_shape=(size, size, 3))
        if name == "tiny":
            x = inp = keras.Input((size, size, 8))
            x = layers.Conv2D(16, 3, padding="same", use_bias=False, name="conv1")(x)
            x = layers.BatchNormalization(name="bn1")(x)
            x = layers.Activation("relu", name="relu1")(x)
            x = layers.Conv2D(16, 3, padding="same", use_bias=False, name="conv2")(x)
            x = layers.BatchNormalization(name="bn2")(x)
            x = layers.Activation("relu", name="relu2")(x)
            x = layers.GlobalAveragePooling2D()(x)
            return keras.Model(inp, layers.Dense(10, name="logits")(x))
        raise ValueError(name)

    if remat:
        with keras.RematScope(mode="activations"):
            return make()
    return make()


def input_channels(name):
    return 8 if name == "tiny" else 3


# ----------------------------------------------------------------------------- graph walker

def _is_functional(op):
    import keras
    return isinstance(op, keras.Model) and (hasattr(op, "_nodes_by_depth")
                                            or isinstance(op, keras.Sequential))


def flatten(model):
    """[(layer, keras node, input gids, output gids)] of `model` with nested models inlined,
    in an order where producers come first; and the model's output gids."""
    import keras
    nodes = []
    counter = [0]

    def new():
        counter[0] += 1
        return counter[0]

    def walk(m, in_gids):
        fn = m._functional if isinstance(m, keras.Sequential) else m
        tid = {id(x): g for x, g in zip(fn.inputs, in_gids)}
        for depth in sorted(fn._nodes_by_depth, reverse=True):
            for node in fn._nodes_by_depth[depth]:
                if not node.operation or node.is_input:
                    continue
                ins = [tid[id(x)] for x in node.input_tensors]
                op = node.operation
                if _is_functional(op):
                    outs = walk(op, ins)
                else:
                    outs = [new() for _ in node.outputs]
                    nodes.append((op, node, ins, outs))
                for x, g in zip(node.outputs, outs):
                    tid[id(x)] = g
        return [tid[id(x)] for x in fn.outputs]

    inputs = [new() for _ in model.inputs]
    outputs = walk(model, inputs)
    return nodes, inputs, outputs


def _is_relu(op):
    import keras
    from keras import layers
    if isinstance(op, layers.ReLU):
        return (op.negative_slope == 0 and op.max_value is None and op.threshold == 0)
    if isinstance(op, layers.Activation):
        return op.activation is keras.activations.relu
    return False


def _plain_bn(op):
    from keras import layers
    return (isinstance(op, layers.BatchNormalization) and not op.renorm
            and not op.synchronized and op.scale and op.center and op.trainable)


def find_patterns(nodes):
    """{relu node index: pattern} for each BN [-> Add] -> ReLU whose output feeds only 2-D
    convs and ops that keep none of their inputs for the backward."""
    from keras import layers
    producer, consumers = {}, {}
    for i, (_, _, ins, outs) in enumerate(nodes):
        for g in outs:
            producer[g] = i
        for g in ins:
            consumers.setdefault(g, []).append(i)
    safe = (layers.Add, layers.GlobalAveragePooling2D)
    patterns = {}
    for r, (op, _, ins, outs) in enumerate(nodes):
        if not _is_relu(op) or len(ins) != 1:
            continue
        u = ins[0]
        if consumers.get(u) != [r] or u not in producer:
            continue
        p = producer[u]
        pop = nodes[p][0]
        parts = []
        if _plain_bn(pop):
            parts = [("bn", p)]
            add = None
        elif isinstance(pop, layers.Add) and len(nodes[p][2]) == 2:
            add = p
            for g in nodes[p][2]:
                q = producer.get(g)
                if q is not None and _plain_bn(nodes[q][0]) and consumers.get(g) == [p]:
                    parts.append(("bn", q))
                else:
                    parts.append(("keep", g))
            if not any(k == "bn" for k, _ in parts):
                continue
        else:
            continue
        a = outs[0]
        convs, others, ok = [], False, True
        for c in consumers.get(a, []):
            cop = nodes[c][0]
            if isinstance(cop, layers.Conv2D) and nodes[c][2] == [a]:
                convs.append(c)
            elif isinstance(cop, safe):
                others = True
            else:
                ok = False
        if ok and convs:
            patterns[r] = dict(parts=parts, add=add, convs=convs, others=others)
    return patterns


def bn_scale_shift(layer, z):
    """Keras BatchNormalization.call (training, no mask/renorm) and tf.nn.batch_normalization,
    op for op, stopped before `x * inv + shift`: returns (inv, shift) after the moving
    statistics were assigned as stock assigns them."""
    import tensorflow as tf
    from keras import ops
    from keras.src import backend
    dtype = backend.result_type(z.dtype, "float32")
    z = ops.cast(z, dtype)
    moving_mean = ops.cast(layer.moving_mean, dtype)
    moving_variance = ops.cast(layer.moving_variance, dtype)
    gamma = ops.cast(layer.gamma, dtype)
    beta = ops.cast(layer.beta, dtype)
    mean, variance = layer._moments(z, None)
    layer.moving_mean.assign(moving_mean * layer.momentum + mean * (1.0 - layer.momentum))
    layer.moving_variance.assign(
        moving_variance * layer.momentum + variance * (1.0 - layer.momentum))
    axis = layer.axis
    if axis != -1:
        shape = [1] * len(z.shape)
        shape[axis] = mean.shape[0]
        mean = tf.reshape(mean, shape)
        variance = tf.reshape(variance, shape)
        beta = tf.reshape(beta, shape)
        gamma = tf.reshape(gamma, shape)
    with tf.name_scope("batchnorm"):
        inv = tf.math.rsqrt(variance + layer.epsilon)
        inv *= gamma
        shift = beta - mean * inv
    return inv, shift


class Walker:
    """Runs a Keras model node by node (training=True), with the prototype's segments."""

    def __init__(self, model, mode):
        self.model, self.mode = model, mode
        self.nodes, self.inputs, self.outputs = flatten(model)
        self.patterns = find_patterns(self.nodes) if mode != "plain" else {}
        self.skip = set()
        for r, p in self.patterns.items():
            self.skip.update(q for k, q in p["parts"] if k == "bn")
            if p["add"] is not None:
                self.skip.add(p["add"])

    def summary(self):
        return dict(segments=len(self.patterns),
                    convs=sum(len(p["convs"]) for p in self.patterns.values()),
                    with_add=sum(p["add"] is not None for p in self.patterns.values()),
                    kept_shortcuts=sum(k == "keep" for p in self.patterns.values()
                                       for k, _ in p["parts"]))

    def _call(self, op, node, vals):
        tensors = {id(x): vals[g] for x, g in zip(node.input_tensors, self._ins)}
        args, kwargs = node.arguments.fill_in(tensors)
        if getattr(op, "_call_has_training_arg", False):
            kwargs["training"] = True
        return op(*args, **kwargs)

    def _segment(self, r, vals, conv_pre):
        import tensorflow as tf
        p = self.patterns[r]
        relu = self.nodes[r][0]
        flat, layout = [], []
        for kind, q in p["parts"]:
            if kind == "bn":
                bn = self.nodes[q][0]
                z = vals[self.nodes[q][2][0]]
                inv, shift = bn_scale_shift(bn, z)
                layout.append(("bn", len(flat)))
                flat += [z, inv, shift]
            else:
                layout.append(("keep", len(flat)))
                flat.append(vals[q])
        convs = [self.nodes[c][0] for c in p["convs"]]
        k0 = len(flat)
        flat += [tf.convert_to_tensor(c.kernel) for c in convs]
        add = self.nodes[p["add"]][0] if p["add"] is not None else None
        others = p["others"]

        def compute(ts):
            terms = []
            for kind, i in layout:
                terms.append(ts[i] * ts[i + 1] + ts[i + 2] if kind == "bn" else ts[i])
            u = add._merge_function(terms) if add is not None else terms[0]
            a = relu.call(u)
            outs = [c.convolution_op(a, ts[k0 + j]) for j, c in enumerate(convs)]
            return outs + ([a] if others else [])

        big = {i for _, i in layout}  # z of each BN, kept shortcuts
        barrier = {"proto": "xla", "proto-select": "select", "split": "xla",
                   "split-select": "select", "proto-add": "add",
                   "proto-addbig": "add-big", "proto-selectall": "select-all",
                   "split-selectall": "select-all"}.get(self.mode)

        def hold(ts, dys):
            """ts and dys behind the barrier: the recomputation from ts can neither be merged
            with the forward's nor run before the incoming gradients dys exist."""
            live = [i for i, d in enumerate(dys) if d is not None]
            if barrier == "select-all":  # every input behind the select, kernels included
                pred = tf.math.is_finite(tf.reshape(dys[live[0]], [-1])[0])
                return [tf.where(pred, t, tf.zeros_like(t)) for t in ts], dys
            if barrier == "select":
                # The CPU's stand-in: XLA's CPU pipeline drops opt-barriers right after its
                # first CSE, before fusion and scheduling. select(p, x, 0) with p read from an
                # incoming gradient (true unless it is inf/NaN) is x, but neither CSE nor the
                # scheduler can move it before the backward.
                pred = tf.math.is_finite(tf.reshape(dys[live[0]], [-1])[0])
                return [tf.where(pred, t, tf.zeros_like(t)) if i in big else t
                        for i, t in enumerate(ts)], dys
            if barrier in ("add", "add-big"):
                # tf.recompute_grad's own dependency (graph mode): x + where(e == e, 0, nan), e
                # an element of the first incoming gradient; "add" on every input as it does,
                # "add-big" on z and the kept shortcuts only. +0.0 turns -0 into +0.
                e = tf.reduce_max(tf.reshape(dys[live[0]], [-1])[:1])
                eb = tf.cast(e, tf.bool)
                dep = tf.where(eb == eb, 0., float("nan"))
                return [t + tf.cast(dep, t.dtype) if (barrier == "add" or i in big) else t
                        for i, t in enumerate(ts)], dys
            if barrier == "xla":
                from tensorflow.compiler.tf2xla.ops import gen_xla_ops
                held = gen_xla_ops.xla_optimization_barrier(list(ts) + [dys[i] for i in live])
                dys = list(dys)
                for j, i in enumerate(live):
                    dys[i] = held[len(ts) + j]
                return list(held[:len(ts)]), dys
            return list(ts), dys

        if self.mode.startswith("split"):
            # Trace-time friendly form: the ReLU's output `a` is one custom gradient G over
            # (normalize, add, relu) and each conv reading `a` another, C; neither keeps `a`:
            # G's backward recomputes it for ReluGrad, C's for the kernel's gradient. The tape
            # sums the convs' input gradients at `a` as stock's does.
            rec = flat[:k0]

            def compute_a(ts):
                terms = [ts[i] * ts[i + 1] + ts[i + 2] if kind == "bn" else ts[i]
                         for kind, i in layout]
                u = add._merge_function(terms) if add is not None else terms[0]
                return relu.call(u)

            @tf.custom_gradient
            def g_relu(*ts):
                ts = list(ts)

                def grad(da):
                    xs, (da,) = hold(ts, [da])
                    with tf.GradientTape() as tape:
                        tape.watch(xs)
                        a2 = compute_a(xs)
                    return tape.gradient(a2, xs, output_gradients=da)

                return compute_a(ts), grad

            a = g_relu(*rec)

            def conv_of(c):
                @tf.custom_gradient
                def c_conv(a, k, *ts):
                    ts = list(ts)

                    def grad(dy):
                        xs, (dy,) = hold(ts + [k], [dy])
                        with tf.GradientTape() as tape:
                            a2 = compute_a(xs[:-1])
                            tape.watch([a2, xs[-1]])
                            y2 = c.convolution_op(a2, xs[-1])
                        da, dk = tape.gradient(y2, [a2, xs[-1]], output_gradients=dy)
                        return [da, dk] + [None] * len(ts)

                    return c.convolution_op(a, k), grad

                return c_conv

            outs = [conv_of(c)(a, flat[k0 + j], *rec) for j, c in enumerate(convs)]
            outs += [a] if others else []
        elif self.mode == "recompute_grad":
            outs = tf.recompute_grad(lambda *ts: compute(list(ts)))(*flat)
        else:

            @tf.custom_gradient
            def segment(*ts):
                ts = list(ts)

                def grad(*dys):
                    live = [i for i, d in enumerate(dys) if d is not None]
                    xs, dys = hold(ts, list(dys))
                    with tf.GradientTape() as tape:
                        tape.watch(xs)
                        ys = compute(xs)
                    return tape.gradient([ys[i] for i in live], xs,
                                         output_gradients=[dys[i] for i in live])

                return compute(ts), grad

            outs = segment(*flat)
        outs = list(outs)
        for j, c in enumerate(p["convs"]):
            conv_pre[c] = outs[j]
        if others:
            vals[self.nodes[r][3][0]] = outs[len(convs)]

    def __call__(self, x):
        from keras import ops
        vals = {self.inputs[0]: x}
        conv_pre = {}
        for i, (op, node, ins, outs) in enumerate(self.nodes):
            if i in self.skip:
                continue
            if i in self.patterns:
                self._segment(i, vals, conv_pre)
                continue
            if i in conv_pre:  # Keras BaseConv.call after convolution_op
                y = conv_pre[i]
                if op.use_bias:
                    y = ops.add(y, ops.reshape(op.bias, (1,) * (op.rank + 1) + (op.filters,)))
                if op.activation is not None:
                    y = op.activation(y)
                vals[outs[0]] = y
                continue
            self._ins = ins
            res = self._call(op, node, vals)
            res = res if isinstance(res, (list, tuple)) else [res]
            for g, t in zip(outs, res):
                vals[g] = t
        return vals[self.outputs[0]]


# ----------------------------------------------------------------------------- worker

def worker(args):
    import tensorflow as tf
    import keras
    if args.device == "cpu":
        tf.config.set_visible_devices([], "GPU")
    dev = "GPU:0" if args.device == "gpu" else "CPU:0"
    data = np.load(args.init)
    variant = args.variant
    if variant in PRODUCT_BARRIERS:
        import tf_relupool
        from tf_relupool import bn_relu
        if PRODUCT_BARRIERS[variant]:
            os.environ[bn_relu.BARRIER_ENV_VAR] = PRODUCT_BARRIERS[variant]
        tf_relupool.enable_recompute(bn_relu=True)
        variant = "stock"
    elif variant.endswith("+switch"):
        import tf_relupool
        tf_relupool.enable_recompute()
        variant = variant[:-len("+switch")]
    elif variant == "switch":
        import tf_relupool
        tf_relupool.enable_recompute()
        variant = "stock"
    keras.mixed_precision.set_global_policy(args.policy)
    model = build_model(args.model, args.size, remat=variant == "remat")
    model.set_weights([data[f"w{i}"] for i in range(len(model.weights))])
    x = tf.constant(data["x"])
    y = tf.constant(data["y"])
    walker = None
    if variant.startswith(("proto", "split")) or variant == "recompute_grad":
        walker = Walker(model, variant)
        forward = walker
    else:
        forward = lambda t: model(t, training=True)
    tvars = model.trainable_variables
    gvars = [tf.Variable(tf.zeros_like(v), trainable=False) for v in tvars]
    from_logits = args.model != "resnet50"

    @tf.function(jit_compile=True)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            out = forward(x)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, out, from_logits=from_logits))
        grads = tape.gradient(loss, tvars)
        for v, g, gv in zip(tvars, grads, gvars):
            gv.assign(g)
            v.assign_sub(LR * g)
        return loss

    res = dict(variant=args.variant, losses=[], times=[], peaks=[])
    if walker is not None:
        res["walker"] = walker.summary()
    product = args.variant in PRODUCT_BARRIERS
    snaps = {}
    t0 = time.time()
    for s in range(max(args.steps, 3)):
        if s == 2 and args.gate:  # --parallel: compiled; time the steps alone
            open(args.gate + ".ready", "w").close()
            while not os.path.exists(args.gate + ".go"):
                time.sleep(0.05)
        if s >= 2:
            try:
                tf.config.experimental.reset_memory_stats(dev)
                before = tf.config.experimental.get_memory_info(dev)["current"]
            except Exception:  # no allocator statistics on this device
                before = None
        start = time.perf_counter()
        loss = train_step(x, y).numpy()
        dt = time.perf_counter() - start
        if s == 0:
            res["first_step_s"] = time.time() - t0
        if s < 2:
            res["losses"].append(float(loss).hex())
            for i, g in enumerate(gvars):
                snaps[f"g{s}_{i}"] = g.numpy()
            if s == 1:
                for i, v in enumerate(model.weights):
                    snaps[f"v{i}"] = v.numpy()
        else:
            res["times"].append(dt)
            if before is not None:
                res["peaks"].append(tf.config.experimental.get_memory_info(dev)["peak"] - before)
    np.savez(args.snap, **snaps)
    if product:
        from tf_relupool import bn_relu
        res["product"] = dict(bn_relu.stats(), barrier=bn_relu.barrier_kind())
    if args.hlo:
        counts = {}
        for stage in ("hlo", "optimized_hlo"):
            text = train_step.experimental_get_compiler_ir(x, y)(stage=stage)
            counts[stage] = {k: len(re.findall(pat, text)) for k, pat in _HLO_COUNTS.items()}
        res["hlo"] = counts
    with open(args.result, "w") as f:
        json.dump(res, f)


_HLO_COUNTS = {
    "maximum": r"= f32\[[^\]]*\]\{?[^ ]* maximum\(",
    "convolution": r" convolution\(",
    "opt-barrier": r" opt-barrier\(",
    "fusion": r" fusion\(",
    "instructions": r"\n\s+\S+ = ",
}


# ----------------------------------------------------------------------------- driver

def temp_bytes(dump_dir):
    """XLA's preallocated temp buffer of the train step's executable (largest if several)."""
    sys.path.insert(0, HERE)
    import xla_buffers
    best = 0
    for ba in glob.glob(os.path.join(dump_dir, "*train_step*buffer-assignment.txt")):
        for _, size, kind in xla_buffers.allocations(ba):
            if "preallocated-temp" in kind:
                best = max(best, size)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--model", choices=("tiny", "resnet", "resnet50"), default="resnet")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=None,
                   help="image size (default 16 tiny, 32 resnet, 224 resnet50)")
    p.add_argument("--steps", type=int, default=5, help="steps per variant (>= 3)")
    p.add_argument("--policy", default="float32",
                   choices=("float32", "mixed_float16", "mixed_bfloat16"),
                   help="Keras' global dtype policy of the model (its weights stay float32)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--nondeterministic", action="store_true",
                   help="GPU: leave out XLA_FLAGS=--xla_gpu_deterministic_ops=true (bitwise "
                        "comparisons then mean little)")
    p.add_argument("--no-autotune-cache", action="store_true",
                   help="GPU: let every variant autotune its convolutions itself (by default "
                        "the first variant's XLA autotuning results are loaded by the others)")
    p.add_argument("--reference", default="stock",
                   help="the variant whose bits the others are compared with (default stock)")
    p.add_argument("--hlo", action="store_true", help="also count ops of the step's HLO")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--keep-dumps", default=None, help="keep XLA dumps under this directory")
    p.add_argument("--parallel", action="store_true",
                   help="start every variant's process at once (compiles overlap), then let "
                        "each run its timed steps alone, one after the other")
    p.add_argument("--gate", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", dest="variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--init", default=None, help=argparse.SUPPRESS)
    p.add_argument("--snap", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.size is None:
        args.size = {"tiny": 16, "resnet": 32, "resnet50": 224}[args.model]
    if args.variant:
        return worker(args)

    tmp = tempfile.mkdtemp(prefix="bn_relu_")
    init = os.path.join(tmp, "init.npz")
    code = (
        "import sys, numpy as np, keras; sys.path.insert(0, %r); import bn_relu_prototype as b;"
        "keras.utils.set_random_seed(0); m = b.build_model(%r, %d);"
        "rng = np.random.default_rng(0);"
        "x = rng.standard_normal((%d, %d, %d, %d)).astype('float32');"
        "y = rng.integers(0, 10, (%d,)).astype('int32');"
        "np.savez(%r, x=x, y=y, **{'w%%d' %% i: w for i, w in enumerate(m.get_weights())})"
        % (HERE, args.model, args.size, args.batch, args.size, args.size,
           input_channels(args.model), args.batch, init))
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    else:  # several processes share the GPU under --parallel
        env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    subprocess.run([sys.executable, "-c", code], check=True, env=env,
                   stderr=subprocess.DEVNULL)
    results = {}
    variants = args.variants.split(",")
    procs = {}

    autotune = os.path.join(tmp, "autotune.textproto")
    cache = args.device == "gpu" and not args.no_autotune_cache

    def start(v, first=False):
        dump = os.path.join(args.keep_dumps or tmp, f"dump_{args.model}_{v}")
        e = dict(env)
        flags = [f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text",
                 "--xla_dump_hlo_module_re=.*train_step.*"]
        if cache and first:
            flags.append(f"--xla_gpu_dump_autotune_results_to={autotune}")
        elif cache and os.path.exists(autotune):
            flags.append(f"--xla_gpu_load_autotune_results_from={autotune}")
        if args.device == "gpu" and not args.nondeterministic:
            flags.append("--xla_gpu_deterministic_ops=true")
        e["XLA_FLAGS"] = " ".join([e.get("XLA_FLAGS", "")] + flags).strip()
        e["TF_CPP_MIN_LOG_LEVEL"] = "2"
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", v, "--device", args.device,
               "--model", args.model, "--size", str(args.size), "--batch", str(args.batch),
               "--steps", str(args.steps), "--init", init, "--policy", args.policy,
               "--snap", os.path.join(tmp, f"{v}.npz"),
               "--result", os.path.join(tmp, f"{v}.json")] + (["--hlo"] if args.hlo else [])
        if args.parallel:
            cmd += ["--gate", os.path.join(tmp, f"gate_{v}")]
        log = open(os.path.join(tmp, f"{v}.log"), "w")
        procs[v] = (subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT), dump,
                    time.time())

    def ready(v):
        while (procs[v][0].poll() is None
               and not os.path.exists(os.path.join(tmp, f"gate_{v}.ready"))):
            time.sleep(0.05)

    if args.parallel:
        # The first variant compiles alone (on the GPU it writes XLA's autotuning results,
        # which the others then load: the same convolution algorithms in every variant).
        start(variants[0], first=True)
        ready(variants[0])
        for v in variants[1:]:
            start(v)
        for v in variants:  # every process compiled (or ended) before any is timed
            while (procs[v][0].poll() is None
                   and not os.path.exists(os.path.join(tmp, f"gate_{v}.ready"))):
                time.sleep(0.05)
    for v in variants:
        if not args.parallel:
            start(v, first=v == variants[0])
        proc, dump, t = procs[v]
        if args.parallel:
            gate = os.path.join(tmp, f"gate_{v}")
            while proc.poll() is None and not os.path.exists(gate + ".ready"):
                time.sleep(0.05)
            open(gate + ".go", "w").close()
        proc.wait()
        if proc.returncode:
            with open(os.path.join(tmp, f"{v}.log")) as f:
                err = f.read()[-3000:]
            print(f"{v}: FAILED\n{err}", flush=True)
            results[v] = dict(variant=v, failed=err)
            continue
        with open(os.path.join(tmp, f"{v}.json")) as f:
            r = json.load(f)
        r["temp_bytes"] = temp_bytes(dump)
        r["wall_s"] = time.time() - t
        results[v] = r
        _compare(results, tmp, v, args.reference)
        _print(args, r)
    if args.out:
        meta = dict(device=args.device, model=args.model, batch=args.batch, size=args.size,
                    policy=args.policy, steps=args.steps, parallel=args.parallel,
                    deterministic=args.device == "gpu" and not args.nondeterministic,
                    xla_flags=os.environ.get("XLA_FLAGS", ""))
        try:
            import tensorflow as tf  # noqa: only for the version
            meta["tensorflow"] = tf.__version__
        except Exception:
            pass
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    return 0


def _compare(results, tmp, v, ref="stock"):
    r = results[v]
    if v == ref or ref not in results or "failed" in results[ref]:
        return
    a = np.load(os.path.join(tmp, f"{ref}.npz"))
    b = np.load(os.path.join(tmp, f"{v}.npz"))
    r["reference"] = ref
    r["losses_equal"] = r["losses"] == results[ref]["losses"]
    grads = [k for k in a.files if k.startswith("g")]
    wts = [k for k in a.files if k.startswith("v")]
    r["grads_differ"] = [k for k in grads if not np.array_equal(a[k], b[k])]
    r["weights_differ"] = [k for k in wts if not np.array_equal(a[k], b[k])]
    r["grads_equal"] = not r["grads_differ"]
    r["weights_equal"] = not r["weights_differ"]
    r["n_grads"], r["n_weights"] = len(grads), len(wts)


def _print(args, r):
    mib = 2.0 ** 20
    peak = f"{np.median(r['peaks']) / mib:.1f} MiB" if r["peaks"] else "n/a"
    line = (f"{args.model} b{args.batch} {r['variant']:16s} peak {peak:>12s}  "
            f"XLA temp {r['temp_bytes'] / mib:8.1f} MiB  step {np.median(r['times']) * 1e3:8.1f} ms"
            f"  first {r['first_step_s']:.1f} s")
    if "losses_equal" in r:
        line += (f"  bitwise vs {r['reference']}: loss {r['losses_equal']} grads {r['grads_equal']}"
                 f" ({len(r['grads_differ'])}/{r['n_grads']} differ) weights {r['weights_equal']}"
                 f" ({len(r['weights_differ'])}/{r['n_weights']} differ)")
    if "walker" in r:
        line += f"  {r['walker']}"
    if "product" in r:
        line += f"  {r['product']}"
    if "hlo" in r:
        line += f"\n    hlo {r['hlo']}"
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
