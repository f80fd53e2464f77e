"""The switch's state, a leaf module (no TensorFlow, no other tf_relupool module): what `keep`
may be and its one validation, the switch's mode, and the codes of cc/grappler/state.h's `Mode`
enum that the graph optimizer's C API takes.

The one store of the switch's value (the mode, its activation part and its `exact` part). tf_relupool.config
writes it under its lock, then tells each route that it changed: the trace-time routes
(keras_fusion, segments) install or remove their hooks, which read the value here when traced;
the Grappler pass gets the mode copied into the op library (grappler.set_mode), as C++ cannot
read it here. The other modules (layers, rewrite_graph, rewrite_model) read it here too.
"""

#: What the fused op's backward pass keeps from the forward pass.
KEEP_ARGMAX = "argmax"  # one code per pooled element (1 byte for windows of < 255 positions)
KEEP_INPUT = "input"    # the pre-ReLU input z, from which the backward recomputes the argmax
KEEP_CHOICES = (KEEP_ARGMAX, KEEP_INPUT)

#: cc/grappler/state.h's `enum Mode` (kOff, kArgmax, kInput) by the switch's value;
#: tests/test_config.py checks it against the header.
MODE_CODES = {None: 0, KEEP_ARGMAX: 1, KEEP_INPUT: 2}

_mode = None  # None (off), KEEP_ARGMAX or KEEP_INPUT; written by config under its lock
_activations = False  # enable_recompute(activations=True), only with the mode on (segments.py)
_exact = True  # enable_recompute(exact=False): keep the fusion where XLA orders sums otherwise
_memory_budget = 1.0  # enable_recompute(memory_budget=b): below 1 convolutions are recomputed too


def check_keep(keep, allow_none=False, allow_bool=False):
    """`keep` normalized: "argmax" or "input", or None where `allow_none`; with `allow_bool` (the
    switch's arguments) True means "argmax" and False None. Otherwise ValueError naming the
    argument and showing the value received."""
    received = keep
    if allow_bool and isinstance(keep, bool):
        keep = KEEP_ARGMAX if keep else None
    if keep is None and allow_none:
        return None
    if isinstance(keep, str) and keep in KEEP_CHOICES:
        return keep
    allowed = KEEP_CHOICES + ((None,) if allow_none else ()) + (
        ((True, False) if allow_none else (True,)) if allow_bool else ())
    raise ValueError(f"The `keep` argument must be one of {allowed}. Received: keep={received!r}")


def mode():
    """The switch's value: None (off), "argmax" or "input"."""
    return _mode


def set_mode(keep):
    """Sets the switch's value (already checked; config holds the lock, then tells the routes)."""
    global _mode
    _mode = keep


def activations():
    """Whether the switch also recomputes activations under XLA (only while it is on)."""
    return _activations


def set_activations(on):
    """Sets the activation part of the switch (config holds the lock, then tells the routes)."""
    global _activations
    _activations = bool(on)


def exact():
    """Whether the switch gives up a fusion where XLA is known to order a sum after it otherwise
    than stock's (enable_recompute(exact=True), the default; keras_fusion reads it)."""
    return _exact


def set_exact(on):
    """Sets the `exact` part of the switch (config holds the lock)."""
    global _exact
    _exact = bool(on)


def memory_budget():
    """The share (0 to 1) of the recomputable blocks' kept bytes that may stay kept: 1 (the
    default) recomputes no convolution (conv_recompute.py)."""
    return _memory_budget


def set_memory_budget(b):
    """Sets the memory budget (checked; config holds the lock)."""
    global _memory_budget
    _memory_budget = float(b)
