"""Convolutions recomputed in the backward pass under XLA: `enable_recompute(memory_budget=b)`.

A *block* is a convolution's output z (or z plus a bias) read by a training BatchNormalization
alone, whose output is read by one activation of segment_table.ACTIVATIONS (and on stock's
route by other ops too): conv -> BN -> activation, the unit of MobileNet's and EfficientNet's
blocks and of ResNet's bottlenecks' first two convolutions; or conv -> BN -> Add of a shortcut
that is no BN output -> activation (ResNet's identity block), whose recomputation recomputes the
shortcut from its own source too and gives it the Add's gradient.
Stock keeps z (BN's gradient reads it) and the activation's output a (the next convolution's
kernel gradient reads it); `activations=True` (segments.py) gives a back; a block gives z back
too, recomputing it from the convolution's input x, which its own kernel gradient keeps anyway.

The mechanism is segments.py's: the block is one of its segments (a G) whose input u is z.
Its forward is stock's: the activation's stock call on BN's own output, a side input of G, so
that on stock's route the activation's gradient goes to stock's BN ops and is summed there with
any other reader's, as stock sums it. Its recomputation (the segment's `again`) is BN's traced
ops replayed on a recomputed z (replay.py: stock's op types, attributes and order; the moving
statistics stay the forward's, updated once by stock's call), then the activation; BN's
per-channel inputs (gamma, beta, a bias) are the segment's extra inputs, so their gradients are
its own. Its source is a `Choice`: z recomputed by the convolution's stock call on x
(recursively: x may be another segment's output, so that a chain of blocks is recomputed from
the first block's input), or z itself where the plan keeps it. The next convolution (a C of
segments.py) recomputes the activation the same way.

What to recompute is recompute_plan's decision, made once per traced graph when the first block
gradient is traced (every block is known then): candidates are each block's a (elementwise, its
bytes) and z (the convolution's FLOPs, its bytes), within `memory_budget` of their bytes.

Exactness: the backward of a block reads one recomputed z for BN's and the activation's
gradients together, in the order stock's tape sums them (replay.py), so XLA fuses them as it
does stock's (a recomputed z read by BN's gradient beside the forward's z read by the
activation's gave other bits on the CPU's AVX-512 code).
"""
import collections
import math
import weakref

from tf_relupool import _state, recompute_plan, replay, segments

Conv = collections.namedtuple("Conv", "x kernels call kind")
Conv.__doc__ = """A traced convolution output: its input x, its kernels (tensors), `call(x,
kernels)` (the stock call again) and its COSTS kind."""


def register(entry, output, x, kernels, call, kind):
    """Records a convolution's output (segments' consumer hook, under a budget below 1); `kind`
    is its CONSUMERS row's `recompute`, the COSTS row of its recomputation."""
    if getattr(output, "shape", None) is not None:
        entry["conv"][output.name] = Conv(x, list(kernels), call, kind)


def _flops(conv, z):
    shape = conv.kernels[0].shape
    kernel_elements = math.prod(int(d) for d in shape[:-2])
    if conv.kind == "depthwise_conv":
        return recompute_plan.flops("depthwise_conv", z.shape.num_elements(),
                                    kernel_elements=kernel_elements)
    return recompute_plan.flops("conv", z.shape.num_elements(), kernel_elements=kernel_elements,
                                in_channels=int(shape[-2]))


def block(entry, u, stock_activation, name, plain, plain_hold):
    """The output of a block's segment for the activation `stock_activation` (stock's call) of
    u, or None where u is not a block's. u is a registered BN output, or the Add of one and a
    same-shaped shortcut that is no BN output (ResNet's identity block: conv -> BN -> Add ->
    activation); BN's input must be a registered convolution output (or its bias add) and BN's
    ops replayable. `plain` is the segments.Source of u and `plain_hold` the activation's hold:
    where the plan keeps z, the block recomputes u from them, as `activations=True`'s segment
    does."""
    import tensorflow as tf
    bn_out, shortcut = _bn_and_shortcut(entry, u)
    z = None if bn_out is None else _conv_output(entry, entry["bn_in"].get(bn_out.name))
    conv = None if z is None else entry["conv"].get(z.name)
    if conv is None or not z.shape.is_fully_defined() or z.dtype != u.dtype:
        return None
    ops = replay.between(z, u, stops=() if shortcut is None else (shortcut,))
    if not ops or any(op.type.startswith("Assign") or op.op_def.is_stateful for op in ops):
        return None
    free = [t for t in replay.outside_inputs(ops, z)
            if shortcut is None or t.name != shortcut.name]
    if any(t.shape.num_elements() is None or t.shape.num_elements() >= z.shape.num_elements()
           for t in free):
        return None  # only per-channel tensors (gamma, beta, a bias) besides z and the shortcut

    def op(v, *extra_and_side):
        """The forward: stock's activation of u itself (G's first side input), so that on
        stock's route u's gradient goes to stock's BN ops (and Add), summed there with any
        other reader's as stock sums it."""
        return stock_activation(extra_and_side[len(free)])

    source = Choice(z, conv, u, plain, shortcut)
    seg = Block(name, source, op, extra=free, side=[u] + ([shortcut] if shortcut is not None
                                                           else []),
                hold=plain_hold, activation=stock_activation)
    seg.replayed, seg.free = ops, free
    # the roots a recomputed convolution (and shortcut) starts from: held by every backward
    # that reads them where the plan recomputes the convolution, else XLA merges the
    # recomputation with the forward's (and keeps z); an eager tensor the traced function
    # captures (a constant input) is no graph's
    for t in source.recompute_roots():
        if tf.is_symbolic_tensor(t):
            entry["held_roots"].setdefault(t.name, []).append(seg)
    seg.bn_ops = {o.name for o in ops}
    seg.bn_output = u
    seg.checked_outputs = [u] + ([bn_out] if bn_out is not u else [])
    out = segments.segment_output(seg, z)
    seg.ops |= seg.bn_ops
    return out


def _bn_and_shortcut(entry, u):
    """(BN output, None) where u is a registered BN output; (BN output, shortcut) where u is
    the Add of one and a same-shaped, same-typed tensor that is no BN output; else (None,
    None)."""
    if u.name in entry["bn_in"]:
        return u, None
    op = u.op
    if op.type not in ("AddV2", "Add") or len(op.inputs) != 2:
        return None, None
    a, b = op.inputs
    for bn, other in ((a, b), (b, a)):
        if (bn.name in entry["bn_in"] and other.name not in entry["bn"]
                and other.name not in entry["bn_in"] and bn.shape == u.shape
                and other.shape == u.shape and other.dtype == u.dtype):
            return bn, other
    return None, None


_BIAS_ADDS = ("BiasAdd", "AddV2", "Add")


def _conv_output(entry, t):
    """The registered convolution output that `t` (BN's input) is, or is a bias add of (Keras'
    Conv2D(use_bias=True): the add is replayed with BN's ops, the bias one of their per-channel
    inputs), else None."""
    if t is None or t.name in entry["conv"]:
        return t
    op = t.op
    if op.type in _BIAS_ADDS and len(op.inputs) == 2:
        c, bias = op.inputs
        if (c.name in entry["conv"] and c.shape == t.shape and bias.shape.num_elements()
                is not None and bias.shape.num_elements() < t.shape.num_elements()):
            return c
    return None


def _source_of(t):
    """The Source that gives t: its segment's where t is one's output, else t itself."""
    seg = segments.segment_of(t)
    return seg.as_source() if seg is not None else segments.Source([t], lambda ts: ts[0], ())


class Choice:
    """A block's Source (segments.Source's interface). Its roots: the convolution input's
    source's, the kernels, the shortcut's source's (a block ending in an Add) and u's own
    source's (`plain`: BN's input, inv and shift, a kept shortcut). value() recomputes z from
    the first two, shortcut_value() the shortcut from the third; the block reads the last where
    the plan keeps z."""

    def __init__(self, z, conv, u, plain, shortcut):
        self._input = _source_of(conv.x)
        self._shortcut = None if shortcut is None else _source_of(shortcut)
        self.z, self.conv, self.plain = z, conv, plain
        n, k = len(self._input.roots), len(conv.kernels)
        m = 0 if shortcut is None else len(self._shortcut.roots)
        self._slices = (slice(0, n), slice(n, n + k), slice(n + k, n + k + m))
        self.plain_roots = slice(n + k + m, n + k + m + len(plain.roots))
        self.roots = (self._input.roots + conv.kernels +
                      ([] if shortcut is None else self._shortcut.roots) + list(plain.roots))
        self.skipped = self._input.skipped + (
            () if shortcut is None else self._shortcut.skipped) + (u,)
        self.shortcut = self._input.shortcut
        self.segment = None  # set by Block
        self._cache = weakref.WeakKeyDictionary()  # graph -> recomputed z

    def recompute_roots(self):
        """The roots the convolution's and the shortcut's recomputations read."""
        x, _, s = self._slices
        return self.roots[x] + self.roots[s]

    def value(self, ts):
        """z recomputed from the roots `ts`, once per graph being built (the first backward to
        ask, the latest layer's, computes it from its held roots; the block's other readers
        share it, as stock's backward reads one z)."""
        x, k, _ = self._slices
        return _once(self._cache, lambda: self.conv.call(self._input.value(ts[x]), ts[k]))

    def shortcut_value(self, ts):
        """The shortcut recomputed (or read) from the roots `ts`; None without one."""
        return None if self._shortcut is None else self._shortcut.value(ts[self._slices[2]])


class Block(segments.Segment):
    """A block's segment: segments.Segment whose recomputation, where the plan recomputes the
    convolution, starts at the convolution's input (and the shortcut's) behind the barrier,
    and otherwise at u's own source, as `activations=True`'s segment of u does (its hold, its
    gradient to u)."""

    def __init__(self, name, source, op, extra, side, hold, activation):
        super().__init__(name, source, op, hold, extra=extra, side=side)
        source.segment = self
        self.activation = activation
        self.replayed, self.free = [], []
        self.bn_ops = set()
        self.bn_output = None
        self.checked_outputs = []
        self._cache = weakref.WeakKeyDictionary()  # graph -> recomputed output

    @property
    def default_relu(self):
        return self.name == "conv+bn+relu"

    @property
    def activation_input(self):
        """u (BN's output, or the Add's), which the activation reads in the forward (G's side
        input): a pool fusion after the block fuses the ReLU and the pool on it, as without a
        block."""
        return self.bn_output

    def recomputes_convolution(self):
        """Whether the plan of the block's graph recomputes its convolution."""
        return recomputes_conv(self)

    def held(self):
        return recomputes_conv(self) or super().held()

    def _recompute(self, z2, extra, s2):
        """The activation of BN's ops (and the Add) replayed on z2, the extra inputs and the
        shortcut s2."""
        subs = {self.source.z.name: z2}
        subs.update((t.name, e) for t, e in zip(self.free, extra))
        if s2 is not None:
            subs[self.side[1].name] = s2
        return self.activation(replay.apply(self.replayed, subs)[self.bn_output.name])

    def value(self, ts):
        """The block's output recomputed from the roots `ts`: from the recomputed z, once per
        graph being built, where the plan recomputes the convolution; else from u's source."""
        if not recomputes_conv(self):
            return self.activation(self.source.plain.value(ts[self.source.plain_roots]))
        n = len(self.source.roots)
        return _once(self._cache, lambda: self._recompute(
            self.source.value(ts[:n]), list(ts[n:]), self.source.shortcut_value(ts[:n])))

    def recomputed_gradients(self, roots, u_in, extra, n_side, da):
        """Where the plan recomputes z: z (and the shortcut) recomputed from the held roots,
        BN's ops (and the Add) replayed and differentiated with stock's gradient functions; the
        gradients go to z, the extra inputs and the shortcut (G's second side input). Else the
        gradient of the activation recomputed from u's source goes to u (the first side input),
        and stock's BN ops take it from there."""
        import tensorflow as tf
        if recomputes_conv(self):
            held = segments.hold(roots, [da], free=segments.small_roots(roots, u_in))[0]
            with tf.GradientTape() as tape:
                z2 = self.source.value(held)
                s2 = self.source.shortcut_value(held)
                watched = [z2] + list(extra) + ([s2] if s2 is not None else [])
                tape.watch(watched)
                a2 = self._recompute(z2, extra, s2)
            grads = tape.gradient(a2, watched, output_gradients=da)
            k = 1 + len(extra)
            return grads[:k] + [None] + grads[k:]
        plain = roots[self.source.plain_roots]
        if super().held():
            free = segments.small_roots(plain, self.bn_output)
            plain = segments.hold(plain, [da], free=free)[0]
        with tf.GradientTape() as tape:
            u2 = self.source.plain.value(plain)
            tape.watch(u2)
            a2 = self.activation(u2)
        du = tape.gradient(a2, u2, output_gradients=da)
        return [None] * (1 + len(extra)) + [du] + [None] * (n_side - 1)

    def stock_reason(self):
        """segments.Segment's reasons, after the block's own: its BN output read by another op
        (whose gradient, stock's, then reads z beside the block's)."""
        ours = self._ours()
        if any(op.name not in ours for t in self.checked_outputs for op in t.consumers()):
            return "the BatchNormalization output also feeds other ops"
        return super().stock_reason()

    def _chain_skipped(self):
        """None: the convolution input's chain is its own segment's (which says its own route;
        recomputing from its roots gives its values either way); the block's BN output is
        checked by stock_reason."""
        return ()

    def _other_consumers_of_u(self, entry):
        """z's readers besides BN's and the segments' own ops: a later block passes z to its
        G and C as a root (they return no gradient for it)."""
        return {op.name for op in self.u.consumers()} - self.ops - entry["ops"]

    def _ours(self):
        return segments.graph_entry(self.output)["ops"] | self.ops


def _once(cache, compute):
    """compute() the first time in the graph being built, its result from `cache` after."""
    import tensorflow as tf
    graph = tf.compat.v1.get_default_graph()
    if graph not in cache:
        cache[graph] = compute()
    return cache[graph]


def recomputes_conv(seg):
    """Whether the plan of seg's graph recomputes its convolution (the block's z)."""
    if seg is None or not isinstance(seg, Block):
        return False
    entry = segments.graph_entry(seg.output)
    plan = entry.get("conv_plan")
    if plan is None:
        plan = entry["conv_plan"] = _plan(entry)
    return seg.output.name in plan


def convolution_row(seg):
    """For fusion_report: None where seg is no block, else {"recomputed": whether the plan
    recomputes its convolution, "bytes": z's bytes, "flops": the recomputation's FLOPs}."""
    if not isinstance(seg, Block) or seg.output is None:
        return None
    z = seg.source.z
    return {"recomputed": recomputes_conv(seg), "bytes": z.shape.num_elements() * z.dtype.size,
            "flops": _flops(seg.source.conv, z)}


def _plan(entry):
    """{block output names whose z is recomputed} under the budget, over every block of the
    graph: candidates a (elementwise) and z (the convolution) per block."""
    blocks = [s for s in entry["segments"].values() if isinstance(s, Block)]
    candidates = []
    for seg in blocks:
        z, a = seg.source.z, seg.output
        candidates.append(recompute_plan.Candidate(
            "a:" + a.name, a.shape.num_elements() * a.dtype.size,
            recompute_plan.flops("elementwise", a.shape.num_elements()), ()))
        candidates.append(recompute_plan.Candidate(
            "z:" + a.name, z.shape.num_elements() * z.dtype.size, _flops(seg.source.conv, z),
            ()))
    chosen = recompute_plan.plan(candidates, _state.memory_budget()).recompute
    return {c[2:] for c in chosen if c.startswith("z:")}
