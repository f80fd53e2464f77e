"""The fused ReLU + max pool inside XLA: stock TensorFlow ops under a custom gradient.

XLA-compiled functions (`tf.function(jit_compile=True)`, and Keras 3's default compile on a GPU)
never run the op library's kernels (they have no XLA kernel) nor reach Grappler. Inside them
`relu_max_pool2d`, `ReluMaxPool2D` and the switch's trace-time fusion (tf_relupool/keras_fusion.py)
build the fused op out of stock ops that XLA compiles for any backend:

- forward: y is stock's own `MaxPool(Relu(z))` (the same HLO, so the same max on every XLA
  backend), and one scan over the window positions of z (strided slices of the padded input,
  which XLA fuses into one loop; the same selection as over relu(z), `_forward`) gives a one-byte
  code per pooled element: the selected window position, or `NO_GRADIENT` where the selected
  value is not > 0 (stock's ReluGrad zeroes it there);
- backward (`tf.custom_gradient`): dz from the codes and dy alone, built at z's shape (gathers of
  dy and the codes up to the input positions compared with constant offsets), one term per block
  of window offsets, summed in output order for overlapping windows.

Between forward and backward only the codes are kept (1 byte per pooled element), neither z nor
relu(z). Stock under XLA keeps relu(z) (or z) for `MaxPoolGrad` and `ReluGrad`.

The definition (docs/xla.md, "Exact semantics under XLA"): each window selects its first
in-bounds position in row-major order, and a later in-bounds one takes over whenever
`!(selected >= current)` (the `Ge` select rule tf2xla gives XLA's SelectAndScatter: the first
maximum; a NaN takes over and is taken over); dy goes there when relu(z) there is > 0, added per
input element in output order from +0. That is stock under XLA bit for bit for VALID windows
(and in the GPU trainings of docs/xla.md); XLA's CPU backend orders SAME-padded windows
otherwise, which matters only for tied positive maxima and NaN.

The same form serves relu6 and leaky ReLU in place of the ReLU (MONOTONE below) and 1-D and
3-D pools (the switch's fusion of MaxPooling1D and MaxPooling3D: the scan and the gathers run
over every spatial dimension).

Windows of more than `MAX_WINDOW_POSITIONS` positions (clipped to the input), and inputs whose
spatial dimensions are unknown at trace time, run the stock ops inside XLA (exact), with one
WARNING per reason and Keras model (or traced function) on the `tf_relupool` logger.
"""
import collections
import itertools
import logging
import threading
import weakref

import numpy as np
import tensorflow as tf

from tf_relupool import _compat, _geometry, gradient_sources

logger = logging.getLogger("tf_relupool")

#: Largest window the XLA form unrolls, in positions of the window clipped to the input
#: (`window_positions`: a 9x9 SAME window over a 4x4 input scans 7x7); larger ones run stock's
#: ops inside XLA. 254 is what one-byte codes hold beside NO_GRADIENT and _NEVER; the scan is
#: unrolled, so windows near it trace and compile slower than stock's pool (docs/xla.md).
MAX_WINDOW_POSITIONS = 254
#: The code of a pooled element that routes no gradient (its selected ReLU'd value is not > 0).
NO_GRADIENT = 255
_NEVER = 254  # a code no window produces (codes < MAX_WINDOW_POSITIONS)


Monotone = collections.namedtuple("Monotone", "op grad condition not_fused")

_NOT_BITWISE = ("not fused: its gradient multiplies dz by a function of its output, and where "
                "BatchNormalization's gradient sums that dz, XLA's fusion picks the order of the "
                "sums: a Conv2D -> BatchNormalization -> {} -> MaxPooling2D step differed from "
                "stock's in the last bits on the CPU (docs/xla.md)")

#: The non-decreasing activations f the XLA form could fuse with a max pool besides ReLU:
#: max_pool(f(z)) selects where f(z) is the window's first maximum, and dz is f's stock gradient
#: at the selected positions. `grad(g, y, op)` is TensorFlow's registered gradient of `op`
#: written from its output y (for LeakyRelu, whose registered gradient reads its input x, y > 0
#: exactly where x > 0 when alpha >= 0), so that the backward reads the one-byte codes and the
#: pooled output (which the next layer keeps anyway). `condition(op)`: whether this op is
#: non-decreasing. Rows with `not_fused` (why) run stock's ops; the pattern table's "monotone"
#: role (tf_relupool/patterns.py) holds the other rows' op types.
MONOTONE = {
    "Relu6": Monotone("Relu6", lambda g, y, op: tf.raw_ops.Relu6Grad(gradients=g, features=y),
                      None, None),
    "LeakyRelu": Monotone("LeakyRelu", lambda g, y, op: tf.raw_ops.LeakyReluGrad(
        gradients=g, features=y, alpha=op.get_attr("alpha")),
        lambda op: op.get_attr("alpha") >= 0, None),
    "Elu": Monotone("Elu", lambda g, y, op: tf.raw_ops.EluGrad(gradients=g, outputs=y), None,
                    _NOT_BITWISE.format("ELU")),
    "Selu": Monotone("Selu", lambda g, y, op: tf.raw_ops.SeluGrad(gradients=g, outputs=y), None,
                     _NOT_BITWISE.format("SELU")),
    "Sigmoid": Monotone("Sigmoid", lambda g, y, op: tf.raw_ops.SigmoidGrad(y=y, dy=g), None,
                        _NOT_BITWISE.format("sigmoid")),
    "Tanh": Monotone("Tanh", lambda g, y, op: tf.raw_ops.TanhGrad(y=y, dy=g), None,
                     _NOT_BITWISE.format("tanh")),
}


#: Ops making a fused pool's z (through casts) whose gradient sums dz over the batch and the
#: spatial positions: a bias, BatchNormalization's shift and scale (an elementwise op with a
#: broadcast per-channel operand), TensorFlow's fused BatchNormalization. After the fused form
#: XLA's AVX-512 CPU code orders those sums otherwise than after stock's (a conv bias's and
#: BatchNormalization's gradients, and through them the kernel's, differ in the last bits;
#: docs/xla.md), so with the switch's `exact` (the default) such a pool takes stock's route
#: there (`reordered_sum_reason`).
SUMMING_PRODUCERS = {
    "BiasAdd": "a bias",
    "FusedBatchNorm": "a BatchNormalization",
    "FusedBatchNormV2": "a BatchNormalization",
    "FusedBatchNormV3": "a BatchNormalization",
}
_BROADCASTING = ("AddV2", "Add", "Sub", "Mul")  # summing where an operand is broadcast
_PASS_THROUGH = ("Cast", "Identity")


def summing_producer(z):
    """What makes `z` (through casts) when its gradient sums dz (SUMMING_PRODUCERS, or an
    elementwise op broadcasting a smaller operand that is not a constant: a bias,
    BatchNormalization's shift), else None."""
    t = z
    for _ in range(4):
        op = getattr(t, "op", None)
        if op is None:
            return None
        if op.type in _PASS_THROUGH and op.inputs:
            t = op.inputs[0]
            continue
        if op.type in SUMMING_PRODUCERS:
            return SUMMING_PRODUCERS[op.type]
        if op.type in _BROADCASTING and t.shape.is_fully_defined() and any(
                i.op.type != "Const" and (not i.shape.is_fully_defined()
                                          or i.shape.num_elements() < t.shape.num_elements())
                for i in op.inputs):
            return "a bias or a BatchNormalization (a per-channel add or multiply)"
        return None
    return None


def compiled_for_cpu(tensor):
    """Whether the XLA function being traced computes `tensor` on a CPU: the op's device when
    placed (tf.device), else the default device (a GPU where one is visible)."""
    device = (getattr(getattr(tensor, "op", None), "device", "") or "").upper()
    if "GPU" in device:
        return False
    return "CPU" in device or not tf.config.list_logical_devices("GPU")


def reordered_sum_reason(z):
    """Why a pool fused over `z` would not give stock's bits in this process, or None: XLA
    compiles it for an AVX-512 CPU and z's producer sums its gradient (SUMMING_PRODUCERS)."""
    from tf_relupool import _cpuinfo
    what = summing_producer(z)
    if what is None or not compiled_for_cpu(z) or not _cpuinfo.xla_avx512():
        return None
    return (f"a pool whose input comes from {what}, whose gradient XLA's AVX-512 CPU code sums "
            "in another order after the fused pool than after stock's (the last bits of that "
            "gradient and the kernel's would differ); enable_recompute(exact=False) keeps the "
            "saving (docs/xla.md)")


def monotone(op):
    """The MONOTONE row of `op`, a traced activation op, where it is fused (no `not_fused`, its
    condition holds), else None."""
    row = MONOTONE.get(getattr(op, "type", None))
    if row is None or row.not_fused or (row.condition is not None and not row.condition(op)):
        return None
    return row


def in_xla_context():
    """True while tracing inside an XLA-compiled function (`tf.function(jit_compile=True)`).

    Uses a private TensorFlow name (_compat.tf_in_xla_context): if TensorFlow moves it, this
    answers False (and the op library's ops are emitted, which XLA then reports as
    unregistered)."""
    if tf.executing_eagerly():
        return False
    return _compat.tf_in_xla_context()


def pool_geometry(input_hw, ksize, strides, padding, explicit_paddings, data_format):
    """Per spatial dimension (input size, window, stride, pad before, pad after, output size).

    `ksize`/`strides` are 4-entry (5-entry for a 3-D pool) lists in `data_format`, `padding`
    "VALID"/"SAME"/"EXPLICIT" (2-D only).
    Output sizes as MaxPool computes them; ValueError where no window fits."""
    dims = []
    for axis, size in zip(_geometry.spatial_axes(data_format), input_hw):
        k, s = int(ksize[axis]), int(strides[axis])
        before = after = 0
        if padding == "EXPLICIT":
            before, after = (int(v) for v in explicit_paddings[2 * axis:2 * axis + 2])
        out = _geometry.pooled_size(size, k, s, padding, before, after)
        if padding == "SAME":
            total = max((out - 1) * s + k - size, 0)
            before, after = total // 2, total - total // 2
        if out < 1:
            raise ValueError(
                f"ksize {list(ksize)} with padding {padding!r} does not fit the input: "
                f"spatial size {size} gives output size {out} (it would be negative or zero)")
        dims.append((size, k, s, before, after, out))
    return dims


def window_range(dim):
    """(first, last): the window offsets along one dimension (of `pool_geometry`) that can hold
    an input element in some window; the others hold padding in every window."""
    size, k, s, before, _, out = dim
    return max(0, before - (out - 1) * s), min(k - 1, size - 1 + before)


def window_positions(dims):
    """The positions of a window clipped to the input: those the XLA form scans and codes."""
    return int(np.prod([last - first + 1 for first, last in map(window_range, dims)]))


#: Why the XLA form falls back to the stock ops: the keys of unsupported_reason's first field.
UNKNOWN_SIZE, LARGE_WINDOW, REORDERED_SUM = "unknown_size", "large_window", "reordered_sum"


def unsupported_reason(input_shape, ksize, strides, padding, explicit_paddings, data_format):
    """(kind, text): why the XLA form cannot run these arguments (kind UNKNOWN_SIZE or
    LARGE_WINDOW), or None where it can."""
    shape = tf.TensorShape(input_shape)
    if shape.rank != len(data_format) or None in _geometry.spatial(shape, data_format):
        what = "height and width" if len(data_format) == 4 else "depth, height and width"
        return UNKNOWN_SIZE, f"an input whose {what} are unknown at trace time ({shape})"
    dims = pool_geometry(_geometry.spatial(shape, data_format), ksize, strides, padding,
                         explicit_paddings, data_format)
    positions = window_positions(dims)
    if positions > MAX_WINDOW_POSITIONS:
        window = "x".join(str(int(v)) for v in _geometry.spatial(ksize, data_format))
        return LARGE_WINDOW, (f"a {window} window with {positions} positions over the input "
                              f"(the XLA form unrolls at most {MAX_WINDOW_POSITIONS})")
    return None


_ADVICE = {
    UNKNOWN_SIZE: "trace it with a fixed height and width to fuse it (data of one size: "
                  "a dataset whose element_spec has them, a tf.function input_signature "
                  "with them, keras.Input((32, 32, 3)))",
    LARGE_WINDOW: "larger windows are not unrolled",
    REORDERED_SUM: "stock's bits kept",
}
_warned = {kind: weakref.WeakSet() for kind in _ADVICE}
_warned_lock = threading.Lock()


def _owner():
    """(words, object): the Keras model being called (its outermost layer), else the outermost
    traced function's graph."""
    layer = _compat.keras_entry_layer()
    if layer is not None:
        return f"model {getattr(layer, 'name', '?')!r}", layer
    graph = _compat.tf_outermost_function_graph()
    return f"function {graph.name!r}", graph


def warn_fallback(kind, text):
    """Logs that a ReLU + max pool runs stock's ops inside XLA (no memory saving): one WARNING
    per reason and Keras model (outside a Keras model: per reason and outermost traced function),
    an INFO line for the others."""
    where, owner = _owner()
    with _warned_lock:
        try:
            first = owner not in _warned[kind]
            if first:
                _warned[kind].add(owner)
        except TypeError:  # not weak-referenceable: warn every time
            first = True
    (logger.warning if first else logger.info)(
        "tf_relupool: ReLU + max pool in %s runs stock's ops inside XLA (no memory saving) for "
        "%s; %s", where, text, _ADVICE[kind])


def _strided(x, axes, starts, stops, steps):
    """x[..., start:stop:step, ...] on the given axes (other axes whole, any size)."""
    index = [slice(None)] * x.shape.rank
    for axis, a, b, s in zip(axes, starts, stops, steps):
        index[axis] = slice(a, b, s)
    return x[tuple(index)]


def _broadcast_shape(sizes, data_format):
    """(1, *sizes, 1) channels last, (1, 1, *sizes) channels first: a constant over the spatial
    dimensions, broadcast over batch and channels."""
    sizes = tuple(sizes)
    return (1,) + sizes + (1,) if _geometry.spatial_axes(data_format)[0] == 1 else (1, 1) + sizes


def _in_bounds(dims, offsets, data_format):
    """For the window offset `offsets` (one per spatial dimension): a constant bool tensor over
    the pooled positions, broadcast in `data_format`, of the windows where that offset lies
    inside the input (not in SAME/EXPLICIT padding), or None where it does in every window."""
    masks = []
    for (size, _, s, before, _, out), off in zip(dims, offsets):
        pos = np.arange(out) * s + off - before
        masks.append((pos >= 0) & (pos < size))
    if all(m.all() for m in masks):
        return None
    grid = masks[0]
    for m in masks[1:]:
        grid = grid[..., None] & m
    return tf.constant(grid.reshape(_broadcast_shape(grid.shape, data_format)))


def _code_strides(ranges):
    """Row-major strides of the scanned window positions (`ranges`: (first, last) per dim)."""
    counts = [last - first + 1 for first, last in ranges]
    return [int(np.prod(counts[d + 1:])) for d in range(len(counts))]


def _forward(x, pool_args, dims, data_format, relu):
    """(y, codes): the pooled max of r and XLA's selection as a uint8 code per output.

    x is z with `relu` (r = relu(z)), else f(z) for a MONOTONE f (r = x). y is stock's own
    `MaxPool(r)` (the same HLO, so the same max semantics on every XLA backend: XLA's CPU
    ReduceWindow skips NaNs); the codes come from a scan over x with SelectAndScatter's
    comparison, for a ReLU NO_GRADIENT where the selected value is not > 0. For a ReLU the scan
    over z gives the codes a scan over relu(z) would: once a positive value is selected, relu
    changes no comparison, and before it, every position is non-positive or NaN in both and ends
    as NO_GRADIENT in both. Reading z keeps it with a reader besides the ReLU, as stock's ReluGrad
    does: XLA's GPU compiler fuses a convolution whose only reader is a ReLU into one cuDNN call
    (conv-bias-activation), whose algorithm can give z other bits than stock's plain convolution
    (Conv1D -> MaxPooling1D on a GPU, docs/xla.md). XLA fuses the pool and the scan into loops
    over z: r is not kept."""
    axes = _geometry.spatial_axes(data_format)
    y = _stock_max_pool(tf.nn.relu(x) if relu else x, *pool_args)
    if any(d[3] or d[4] for d in dims):
        paddings = [[0, 0]] * x.shape.rank
        for axis, d in zip(axes, dims):
            paddings[axis] = [d[3], d[4]]
        x = tf.pad(x, paddings)  # padded positions are never selected (_in_bounds)
    # Only the offsets that can hold an input element (window_range); the others are padding in
    # every window, never selected. Codes number the scanned positions in row-major order.
    ranges = [window_range(d) for d in dims]
    code_strides = _code_strides(ranges)
    sel = code = first_pad = None
    for offsets in itertools.product(*(range(first, last + 1) for first, last in ranges)):
        cur = _strided(x, axes, offsets,
                       [o + (d[5] - 1) * d[2] + 1 for o, d in zip(offsets, dims)],
                       [d[2] for d in dims])
        in_bounds = _in_bounds(dims, offsets, data_format)
        t = tf.constant(sum((o - rg[0]) * cs for o, rg, cs in zip(offsets, ranges,
                                                                   code_strides)), tf.uint8)
        if sel is None:
            # The first position: selected unless it is padding.
            sel, code = cur, tf.zeros_like(cur, dtype=tf.uint8)
            first_pad = None if in_bounds is None else tf.logical_not(in_bounds)
            continue
        # SelectAndScatter(select=Ge): a later in-bounds position takes over when
        # !(selected >= current); while nothing in-bounds is selected yet, any in-bounds one.
        take = tf.logical_not(sel >= cur)
        if first_pad is not None:
            take = take | first_pad
        if in_bounds is not None:
            take = take & in_bounds
        sel = tf.where(take, cur, sel)
        code = tf.where(take, t, code)
        if first_pad is not None:  # an in-bounds position seen: no longer before the first
            first_pad = None if in_bounds is None else first_pad & tf.logical_not(in_bounds)
    if relu:
        code = tf.where(sel > tf.zeros([], x.dtype), code, tf.constant(NO_GRADIENT, tf.uint8))
    return y, code


def _block_index(size, before, k, s, out, q):
    """For the input positions 0..size-1 along one axis and the offset block q: the window index
    (clipped into range), the offset in the window and whether that offset exists (numpy)."""
    padded = np.arange(size) + before
    window = padded // s - q
    offset = padded % s + q * s
    valid = (window >= 0) & (window < out) & (offset < k)
    return np.clip(window, 0, out - 1).astype(np.int32), offset, valid


def _gather_up(t, windows, axes):
    """t gathered along each spatial axis to the input positions' windows."""
    for axis, w in zip(axes, windows):
        t = tf.gather(t, w, axis=axis)
    return t


def _backward(dy, code, dims, data_format, pooled=None):
    """dz from dy and the codes: each dy goes to its window's coded position, in stock's order.
    With `pooled` (the pool's output), (dz, values): values holds at each input position that a
    window selected that window's pooled value, the value of f(z) there, and 0 elsewhere.

    Every term is built at z's own shape (a gather of dy and the codes up to the input
    positions, compared with a constant of offsets), so that what XLA fuses into dz's consumers
    (the bias gradient's reduction, the convolution's backward) sees the same iteration as
    stock's ReluGrad output: a reshape from a window-blocked layout would let XLA reduce over
    more dimensions, in another order of additions."""
    axes = _geometry.spatial_axes(data_format)
    ranges = [window_range(d) for d in dims]
    code_strides = _code_strides(ranges)
    zero = tf.zeros([], dy.dtype)
    const_shape = _broadcast_shape([d[0] for d in dims], data_format)
    dz = values = None
    # Block q (one index per dimension) holds the offsets q_d*s_d <= i_d < (q_d+1)*s_d: in it
    # each input element belongs to one window at most. An element's windows in output order
    # are its blocks in decreasing row-major order, so the sum runs from the last block to the
    # first (as XLA's SelectAndScatter adds them), starting from that block's term.
    blocks = [reversed(range(-(-d[1] // d[2]))) for d in dims]
    for q in itertools.product(*blocks):
        windows, target, ok = [], None, None
        for (size, k, s, before, _, out), qd, (first, last), cs in zip(dims, q, ranges,
                                                                       code_strides):
            win, off, valid = _block_index(size, before, k, s, out, qd)
            # (offsets of in-bounds elements lie in window_range by its definition)
            valid &= (off >= first) & (off <= last)
            windows.append(win)
            code_d = (off - first) * cs   # this dimension's part of the row-major code
            ok = valid if ok is None else ok[..., None] & valid
            target = code_d if target is None else target[..., None] + code_d
        if not ok.any():
            continue
        targets = np.where(ok, target, _NEVER).astype(np.uint8)
        dy_up = _gather_up(dy, windows, axes)
        code_up = _gather_up(code, windows, axes)
        match = tf.equal(code_up, tf.constant(targets.reshape(const_shape)))
        term = tf.where(match, dy_up, zero)
        dz = term if dz is None else dz + term
        if pooled is not None:
            y_up = _gather_up(pooled, windows, axes)
            values = tf.where(match, y_up, zero if values is None else values)
    if dz is None:  # no input position is in any window (stride > window everywhere)
        dz = tf.zeros_like(_gather_up(dy, [np.zeros(d[0], np.int32) for d in dims], axes))
        values = dz
    dz = _positive_zeros(dz)
    return dz if pooled is None else (dz, values)


def pad_for_pool(z, paddings, value):
    """`tf.pad(z, paddings, constant_values=value)`, the padded z of a pool fused through a
    constant Pad of its ReLU (keras_fusion), whose gradient is the incoming gradient's slice at
    z's positions passed through `_positive_zeros` (a select; the values of stock's Pad gradient,
    the slice).

    So dz ends in a select at z's shape, as stock's does (its ReluGrad after the Pad's slice),
    not in a slice: XLA's CPU backend hands a large sum (BatchNormalization's beta gradient,
    BiasAddGrad) to YNNPACK, whose order of additions differs from its own loop's, unless the
    summed tensor is made by a slice (among a few other ops), so a dz ending in a slice was
    summed in another order than stock's (keras.applications ResNet50's stem, docs/xla.md)."""
    begin = [int(p[0]) for p in paddings]

    @tf.custom_gradient
    def pad(z):
        def grad(g):
            return _positive_zeros(tf.slice(g, begin, tf.shape(z)))  # z's batch may be unknown
        return tf.pad(z, paddings, constant_values=tf.constant(value, z.dtype)), grad

    return pad(z)


@tf.custom_gradient
def _positive_zeros(x):
    """x with -0 as +0 (SelectAndScatter adds each dy into its +0 init, so stock's dz has no -0;
    XLA simplifies an explicit `x + 0` away), and the identity's gradient."""
    zero = tf.zeros([], x.dtype)
    return tf.where(tf.equal(x, zero), zero, x), lambda g: g


def relu_max_pool2d(z, ksize, strides, padding, explicit_paddings, data_format, traced=None,
                    activation=None):
    """max_pool2d(relu(z)) for XLA, its gradient from one-byte codes (module docstring).

    Arguments in the op's normalized form (4-entry `ksize`/`strides` in `data_format`, padding
    "VALID"/"SAME"/"EXPLICIT" with 8 `explicit_paddings`; for a 3-D pool, the switch's fusion of
    MaxPooling3D, a 5-D z, 5-entry attributes, "NDHWC"/"NCDHW" and VALID/SAME). `traced`: the `TracedPool` this
    replaces, when the switch's trace-time fusion calls it. `activation` (with `traced`): (the
    MONOTONE row, the traced op) of a non-decreasing activation in place of the ReLU, z its
    input and the traced pool's input its output. Where the XLA form does not apply
    (`unsupported_reason`), returns the stock ops' result, which XLA compiles as it does stock's.
    """
    reason = unsupported_reason(z.shape, ksize, strides, padding, explicit_paddings, data_format)
    if reason is not None:
        warn_fallback(*reason)
        if traced is not None:
            return traced.stock_pool(traced.pool_input)
        return stock_relu_max_pool2d(z, ksize, strides, padding, explicit_paddings, data_format)
    dims = pool_geometry(_geometry.spatial(z.shape, data_format), ksize, strides, padding,
                         explicit_paddings, data_format)

    pool_args = (ksize, strides, padding, explicit_paddings, data_format)
    if traced is None:
        @tf.custom_gradient
        def fused(z):
            y, code = _forward(z, pool_args, dims, data_format, relu=True)

            def grad(dy):
                return _backward(dy, code, dims, data_format)
            return y, grad

        return fused(z)

    # In place of a traced stock pool (keras_fusion): the pool's input is a second, formal input
    # (XLA drops it where nothing reads it), so that the gradient can go the stock way through it
    # when one of the tensors the fusion skips is a source of the gradient (gradient_sources).
    @tf.custom_gradient
    def fused_in_place(z, pool_input):
        relu = activation is None
        y, code = _forward(z if relu else pool_input, pool_args, dims, data_format, relu=relu)

        def grad(dy):
            if gradient_sources.route(traced.skipped) != gradient_sources.FUSED:
                return None, traced.stock_gradient(pool_input, dy)
            if relu:
                return _backward(dy, code, dims, data_format), None
            # the pool's gradient, then f's stock gradient at every input position (as stock
            # computes them), reading f(z) from the pooled output where a window selected it
            g, values = _backward(dy, code, dims, data_format, pooled=y)
            row, op = activation
            return row.grad(g, values, op), None
        return y, grad

    return fused_in_place(z, traced.pool_input)


class TracedPool:
    """A stock max pool that the trace-time fusion replaces (keras_fusion.py).

    pool_input: the pool's input as traced (relu(z), or a zero Pad of it); skipped: the tensors
    between z and the pool (the Relu's output, the Pad's) whose gradient the fused backward
    skips; stock_pool: a function computing the stock pool of a tensor as the caller would have
    (Keras' transposes for channels_first included), whose own gradient is stock's."""

    def __init__(self, pool_input, skipped, stock_pool):
        self.pool_input = pool_input
        self.skipped = tuple(skipped)
        self.stock_pool = stock_pool

    def stock_gradient(self, pool_input, dy):
        """Stock's gradient of the pool into its input: its registered gradient (MaxPoolGrad, the
        same SelectAndScatter under XLA), through the stock pool recomputed on `pool_input`."""
        with tf.GradientTape() as tape:
            tape.watch(pool_input)
            y = self.stock_pool(pool_input)
        return tape.gradient(y, pool_input, output_gradients=dy)


def _stock_max_pool(r, ksize, strides, padding, explicit_paddings, data_format):
    """Stock's MaxPool (MaxPool3D for a 3-D pool); explicit padding, which XLA's MaxPool lacks,
    as a VALID pool over r padded with -inf (never a window's maximum)."""
    if padding == "EXPLICIT":
        pairs = [list(explicit_paddings[2 * d:2 * d + 2]) for d in range(4)]
        r = tf.pad(r, pairs, constant_values=tf.constant(-np.inf, r.dtype))
        padding = "VALID"
    # the op itself, not the `tf.nn` attribute the switch wraps (keras_fusion)
    op = tf.raw_ops.MaxPool3D if len(data_format) == 5 else tf.raw_ops.MaxPool
    return op(input=r, ksize=list(ksize), strides=list(strides), padding=padding,
              data_format=data_format)


def stock_relu_max_pool2d(z, ksize, strides, padding, explicit_paddings, data_format):
    """The stock ops: tf.nn.max_pool2d(tf.nn.relu(z)) with the op's attributes."""
    return _stock_max_pool(tf.nn.relu(z), ksize, strides, padding, explicit_paddings,
                             data_format)
