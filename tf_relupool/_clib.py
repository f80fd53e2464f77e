"""The op library's C API through ctypes: the `extern "C"` functions of cc/grappler/plugin.cc.

Nothing but the calls: the switch's mode code, the graph optimizer's counters and texts, the
pattern table's text, and the pass run over a serialized GraphDef outside Grappler. Who calls
what: tf_relupool.grappler registers the optimizer with TensorFlow and passes it the switch;
tf_relupool.patterns reads the table (the XLA route never does: it holds its part in Python);
tf_relupool.rewrite_graph and report run the offline rewrite.

The handle is opened on first use. The op library is loaded into TensorFlow first
(tf.load_op_library records the ops a library registers while it loads it); ctypes then gets
the same handle. Functions that only read (stats, mode, registered_device_types) never open it:
before then there is nothing to read.
"""
import ctypes
import os

from tf_relupool import _loader
from tf_relupool._state import MODE_CODES

LIBRARY_ENV_VAR = "TF_RELUPOOL_GRAPPLER_LIBRARY"  # another library holding the optimizer
#: cc/grappler/state.h's `enum Stat`, in order (tests/test_config.py checks it against the header).
STAT_NAMES = ("calls", "calls_switch_off", "graphs_rewritten", "fused_with_grad",
              "fused_forward_only", "fused_conv_relu", "not_fused", "errors", "nanos", "bytes_in",
              "parse_nanos", "fused_through_pad", "fused_maxpool_v2", "nchw_ops",
              "transposes_removed")

_lib = None  # the ctypes handle, once opened


class GrapplerUnavailable(_loader.OpLibraryError):
    """The graph optimizer could not be registered (see the message): an OpLibraryError, as
    every route that needs the op library raises one."""


def library_path():
    return os.environ.get(LIBRARY_ENV_VAR) or _loader.library_path()


def loaded():
    """Whether the handle is open (the optimizer's state can only be read from then on)."""
    return _lib is not None


def handle():
    """ctypes handle on the optimizer's library (the op library, loaded by TensorFlow first).

    Raises:
      GrapplerUnavailable: the library holds no graph optimizer.
      OSError, tf_relupool.OpLibraryError: it does not load.
    """
    global _lib
    if _lib is None:
        path = library_path()
        if path == _loader.library_path():
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


def set_next_device_type(device_type):
    """The device type ("CPU", "GPU") the next TF_InitGraph call registers the optimizer for."""
    handle().tf_relupool_grappler_set_next_device_type(device_type.encode())


def registered_device_types():
    """Device types the optimizer runs for, e.g. ["CPU", "GPU"] ([] before registration)."""
    if _lib is None:
        return []
    buf = ctypes.create_string_buffer(256)
    _lib.tf_relupool_grappler_registered(buf, len(buf))
    return [t for t in buf.value.decode().split(",") if t]


def set_mode(mode):
    """Passes the switch (None, "argmax", "input") to the optimizer, once the handle is open."""
    if _lib is not None:
        _lib.tf_relupool_grappler_set_mode(MODE_CODES[mode])


def mode():
    """The optimizer's own view of the switch (None, "argmax", "input")."""
    if _lib is None:
        return None
    code = _lib.tf_relupool_grappler_mode()
    return {v: k for k, v in MODE_CODES.items()}[code]


def set_verbose(verbose=True):
    """Logs each fusion and each refusal through TensorFlow's log (INFO level)."""
    handle().tf_relupool_grappler_set_verbose(1 if verbose else 0)


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


def reset_stats():
    if _lib is not None:
        _lib.tf_relupool_grappler_reset_stats()


def pattern_table_text():
    """cc/grappler/patterns.h's table as the library holds it (tf_relupool.patterns parses it)."""
    lib = handle()
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
    lib = handle()
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
