"""The recompute switch inside Grappler: enable_recompute() fuses stock code.

The op library also holds a Grappler graph optimizer (cc/grappler/: plugin.cc and its passes),
registered with TensorFlow through its pluggable graph optimizer C API (`TF_InitGraph`, loaded by
`load_pluggable_device_library`). TensorFlow then runs it on every graph it optimizes, after its
own passes: every `tf.function`, Keras' train/predict functions. While the switch is on it
rewrites `max_pool2d(relu(z))` (and its gradient `ReluGrad(MaxPoolGrad(...))`) into the fused ops,
so stock code (`tf.nn.relu` + `tf.nn.max_pool2d`, Keras `Conv2D(activation="relu")` +
`MaxPooling2D`, `MaxPoolV2`, a ZeroPadding2D between the ReLU and the pool as in the ResNet50
stem) gets the fused ops without a change. `rewrite_serialized_graph` runs the same code on a
GraphDef outside Grappler (what `tf_relupool.rewrite_graph` uses). Whatever the switch, it also
gives fused ops their NCHW form where TensorFlow's layout optimizer (on a GPU) left them in NHWC
between Transposes.

When: the optimizer is registered the first time the switch is turned on or a fused op is built
(so a process that does neither pays nothing); it reads the switch each time TensorFlow optimizes a graph,
which happens when a traced function is first run (instantiated), not at every step. As with
layers, set the switch before the function's first call (before `fit`).

`TF_RELUPOOL_GRAPPLER=0` in the environment keeps the optimizer unregistered (the switch then
affects only tf_relupool's own layers, as before). cc/grappler/README.md has the details.
"""
import ctypes
import logging
import os
import threading

from tf_relupool import _loader
from tf_relupool._state import MODE_CODES

ENV_VAR = "TF_RELUPOOL_GRAPPLER"
LIBRARY_ENV_VAR = "TF_RELUPOOL_GRAPPLER_LIBRARY"  # another library holding the optimizer
DEVICE_TYPES = ("CPU", "GPU")
STAT_NAMES = ("calls", "calls_switch_off", "graphs_rewritten", "fused_with_grad",
              "fused_forward_only", "fused_conv_relu", "not_fused", "errors", "nanos", "bytes_in",
              "parse_nanos", "fused_through_pad", "fused_maxpool_v2", "nchw_ops",
              "transposes_removed")

logger = logging.getLogger("tf_relupool")
_lock = threading.RLock()
_lib = None            # ctypes handle on the library holding the optimizer
_registered = False
_failure = None        # why registration failed, once it has


class GrapplerUnavailable(RuntimeError):
    """The graph optimizer could not be registered (see the message)."""


def library_path():
    return os.environ.get(LIBRARY_ENV_VAR) or _loader.library_path()


def _disabled_by_environment():
    return os.environ.get(ENV_VAR, "").strip().lower() in ("0", "off", "false", "no")


def _c_library():
    """ctypes handle on the optimizer's library (the op library, loaded by TensorFlow first)."""
    global _lib
    if _lib is None:
        path = library_path()
        if path == _loader.library_path():
            # TensorFlow must dlopen it first (tf.load_op_library records the ops a library
            # registers while it loads it); ctypes then gets the same handle.
            _loader.load_library()
        lib = ctypes.CDLL(path)
        if not hasattr(lib, "TF_InitGraph"):
            raise GrapplerUnavailable(
                f"{path} holds no graph optimizer (built without cc/grappler/): rebuild it")
        lib.tf_relupool_grappler_stats.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        lib.tf_relupool_grappler_text.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.tf_relupool_grappler_registered.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.tf_relupool_grappler_patterns.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.tf_relupool_grappler_set_next_device_type.argtypes = [ctypes.c_char_p]
        lib.tf_relupool_rewrite_graph.argtypes = [
            ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_void_p)]
        lib.tf_relupool_rewrite_graph.restype = ctypes.c_int
        lib.tf_relupool_free.argtypes = [ctypes.c_void_p]
        _lib = lib
    return _lib


def _alias(path, i):
    """The i-th distinct spelling of `path` (same file). TF_LoadPluggableDeviceLibrary caches
    by file name and calls TF_InitGraph once per new name; dlopen returns the same handle."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, *(["."] * i), base)


def register(device_types=DEVICE_TYPES):
    """Registers the graph optimizer with TensorFlow for `device_types` (once per process).

    Raises:
      GrapplerUnavailable: the library holds no optimizer, or loading it failed.
    """
    global _registered, _failure
    with _lock:
        if _registered:
            return
        if _failure is not None:
            raise GrapplerUnavailable(_failure)
        try:
            from tensorflow.python.framework import load_library as tf_load_library
            lib = _c_library()
            path = library_path()
            for i, device_type in enumerate(device_types):
                lib.tf_relupool_grappler_set_next_device_type(device_type.encode())
                tf_load_library.load_pluggable_device_library(_alias(path, i))
        except (OSError, RuntimeError, AttributeError, _loader.OpLibraryError) as e:
            _failure = f"tf_relupool's graph optimizer could not be registered: {e}"
            raise GrapplerUnavailable(_failure) from e
        _registered = True
        logger.info("tf_relupool: graph optimizer registered for %s", registered_device_types())


def registered_device_types():
    """Device types the optimizer runs for, e.g. ["CPU", "GPU"] ([] before registration)."""
    if _lib is None:
        return []
    buf = ctypes.create_string_buffer(256)
    _lib.tf_relupool_grappler_registered(buf, len(buf))
    return [t for t in buf.value.decode().split(",") if t]


def ensure_registered():
    """Registers the optimizer (once), whatever the switch: called when a graph first gets a
    fused op, so that TensorFlow's layout optimizer never leaves the fused ops between
    Transposes (the pass gives them their NCHW form; it fuses stock ops only while the switch
    is on). Never raises; TF_RELUPOOL_GRAPPLER=0 keeps it unregistered."""
    if _registered or _failure is not None:
        return
    with _lock:
        if not _registered and _failure is None:
            _try_register("the fused ops may run between TensorFlow's layout transposes on a GPU")


def set_mode(mode):
    """Tells the optimizer the switch's value (None, "argmax", "input"); registers it on first
    use. Called by tf_relupool.config whenever the switch changes. Never raises: a failure
    leaves the switch fusing stock ops inside XLA-compiled functions only (and tf_relupool's
    layers where the op library loads), with one warning."""
    if mode not in MODE_CODES:
        raise ValueError(f"mode must be one of {tuple(MODE_CODES)}, got {mode!r}")
    with _lock:
        if mode is not None and not _registered and not _try_register(
                "the switch fuses stock ReLU + max pool inside XLA-compiled functions only (that "
                "needs no library)"):
            return
        if _lib is not None:
            _lib.tf_relupool_grappler_set_mode(MODE_CODES[mode])


def _try_register(consequence):
    """register() unless TF_RELUPOOL_GRAPPLER=0; whether it is registered. A failure is logged
    once (a WARNING with `consequence`), never raised."""
    if _disabled_by_environment():
        return False
    try:
        register()
    except GrapplerUnavailable as e:
        if _failure_warned():
            logger.warning("%s; %s", e, consequence)
        return False
    return True


_warned = []


def _failure_warned():
    """True the first time only."""
    if _warned:
        return False
    _warned.append(True)
    return True


def mode():
    """The optimizer's own view of the switch (None, "argmax", "input")."""
    if _lib is None:
        return None
    code = _lib.tf_relupool_grappler_mode()
    return {v: k for k, v in MODE_CODES.items()}[code]


def set_verbose(verbose=True):
    """Logs each fusion and each refusal through TensorFlow's log (INFO level)."""
    _c_library().tf_relupool_grappler_set_verbose(1 if verbose else 0)


def stats():
    """The optimizer's counters since the last reset_stats(), plus its last texts.

    calls: graphs TensorFlow passed to it (two per graph: Grappler's two iterations);
    calls_switch_off: of these, with the switch off (then only fused ops already in the graph
    get their layout pass);
    graphs_rewritten; fused_with_grad / fused_forward_only: fusions applied; fused_conv_relu:
    fusions on a remapper _FusedConv2D(..., Relu) (the convolution keeps its ReLU); nchw_ops:
    fused ops switched to NCHW between the layout optimizer's transposes, transposes_removed:
    the Transposes this removed; not_fused: ReLU + MaxPool pairs left in
    place (last_skip says why); fused_through_pad: of the fusions, Relu -> Pad -> MaxPool;
    fused_maxpool_v2: of the fusions, on MaxPoolV2; errors: unexpected errors, the graph was
    left unchanged (last_error); nanos: time spent in the pass, parse_nanos of it parsing the GraphDef;
    bytes_in: serialized graph bytes received (only counted past the switch-off check).
    """
    if _lib is None:
        return dict.fromkeys(STAT_NAMES, 0) | {"last_error": "", "last_skip": ""}
    values = (ctypes.c_int64 * len(STAT_NAMES))()
    _lib.tf_relupool_grappler_stats(values, len(STAT_NAMES))
    out = dict(zip(STAT_NAMES, values))
    for which, key in ((0, "last_error"), (1, "last_skip")):
        buf = ctypes.create_string_buffer(2048)
        _lib.tf_relupool_grappler_text(which, buf, len(buf))
        out[key] = buf.value.decode(errors="replace")
    return out


def pattern_table_text():
    """cc/grappler/patterns.h's table as the library holds it (tf_relupool.patterns parses it)."""
    lib = _c_library()
    size = lib.tf_relupool_grappler_patterns(None, 0)
    buf = ctypes.create_string_buffer(size + 1)
    lib.tf_relupool_grappler_patterns(buf, len(buf))
    return buf.value.decode()


def rewrite_serialized_graph(graph_bytes, mode, preserve=()):
    """Runs the pass over a serialized GraphDef outside Grappler (the implementation of
    tf_relupool.rewrite_graph). Nodes without a device are taken as CPU nodes.

    Args:
      graph_bytes: a serialized `GraphDef`.
      mode: "argmax" or "input".
      preserve: names of nodes that must not be removed or replaced.

    Returns:
      (fusions, rewritten bytes or None when there were none, log lines).

    Raises:
      RuntimeError: the pass failed (e.g. bytes that are no GraphDef).
    """
    lib = _c_library()
    out, log = ctypes.c_void_p(), ctypes.c_void_p()
    out_size = ctypes.c_size_t()
    keep = "\n".join(preserve).encode() if preserve else None
    fused = lib.tf_relupool_rewrite_graph(graph_bytes, len(graph_bytes), MODE_CODES[mode], keep,
                                          ctypes.byref(out), ctypes.byref(out_size),
                                          ctypes.byref(log))
    try:
        text = ctypes.string_at(log.value).decode(errors="replace") if log.value else ""
        data = ctypes.string_at(out.value, out_size.value) if out.value else None
    finally:
        lib.tf_relupool_free(out)
        lib.tf_relupool_free(log)
    lines = [line for line in text.splitlines() if line]
    if fused < 0:
        raise RuntimeError("tf_relupool graph rewrite failed: " + "; ".join(lines))
    return fused, data, lines


def reset_stats():
    if _lib is not None:
        _lib.tf_relupool_grappler_reset_stats()


def _run_metadata(fn, args, kwargs):
    """Calls fn once with TensorFlow's run-metadata collection on: (result, RunMetadata)."""
    from tensorflow.python.eager import context  # noqa: PLC0415 - TensorFlow's own API
    ctx = context.context()
    ctx.enable_graph_collection()
    try:
        out = fn(*args, **kwargs)
        meta = ctx.export_run_metadata()
    finally:
        ctx.disable_graph_collection()
    return out, meta


def executed_nodes(fn, *args, **kwargs):
    """Calls `fn(*args, **kwargs)` once and returns (its result, the NodeDefs TensorFlow ran).

    The nodes are those of the partition graphs TensorFlow's executor ran for the call: after
    Grappler (this optimizer included) and TensorFlow's later passes (oneDNN's layout rewrite, the
    placement of a function on its device), across every function the call ran. This is how to
    check what a training step really executes, e.g. that a stock Keras model runs
    `ReluMaxPoolWithWindowArgmax` with the switch on. Only calls of graph functions
    (`tf.function`, Keras' train function) are recorded; eager ops are not. It uses TensorFlow's
    run-metadata collection (`context.enable_graph_collection`), which holds for this call only.
    """
    out, meta = _run_metadata(fn, args, kwargs)
    return out, [n for fg in meta.function_graphs for g in fg.partition_graphs for n in g.node]


def optimized_nodes(fn, *args, **kwargs):
    """Like executed_nodes, but the nodes of each function's graph as Grappler left it (this
    optimizer included), before TensorFlow's later passes: stock op names (MaxPool, not oneDNN's
    _MklNativeMaxPool), as the pass sees and writes them."""
    out, meta = _run_metadata(fn, args, kwargs)
    return out, [n for fg in meta.function_graphs for n in fg.post_optimization_graph.node]


def executed_ops(fn, *args, **kwargs):
    """Like executed_nodes, but the count of each op type: (result, {op type: count})."""
    out, nodes = executed_nodes(fn, *args, **kwargs)
    counts = {}
    for n in nodes:
        counts[n.op] = counts.get(n.op, 0) + 1
    return out, counts
