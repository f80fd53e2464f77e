"""The global recompute switch: whether ReluMaxPool2D layers run the fused op, and how.

The switch holds one of three values: ``None`` (off: ``ReluMaxPool2D(keep=None)`` runs the stock
ops ``relu`` + ``max_pool``, numerically identical), ``"argmax"`` (the fused op whose backward
keeps one byte per pooled element: the lowest memory) or ``"input"`` (the fused op whose backward
keeps the pre-ReLU input and recomputes the argmax from it: SystemML's
``sysml.gpu.recompute.activations``).

The default is off unless the environment variable ``TF_RELUPOOL_RECOMPUTE`` says otherwise when
tf_relupool is imported ("0"/"off"/"false"/"no"/"" -> off; "1"/"on"/"true"/"yes"/"argmax" ->
"argmax"; "input" -> "input"). Off is the default because a library should not change what a
user's model computes behind their back: with the switch off, nothing tf_relupool provides
changes a model's graph, and turning it on is one visible line.

While the switch is on, stock ``relu`` + ``max_pool`` (and their gradients) are fused too:
by tf_relupool's graph optimizer inside Grappler (tf_relupool/grappler.py) in every graph
TensorFlow optimizes, and, inside XLA-compiled functions (which never reach Grappler: Keras'
default compile on a GPU, ``jit_compile=True``), where Keras' ``MaxPooling2D`` /
``keras.ops.max_pool`` or TensorFlow's ``tf.nn.max_pool2d`` / ``tf.nn.max_pool`` is traced
over a ``Relu`` (or a zero ``Pad`` of one; tf_relupool/keras_fusion.py, docs/xla.md lists what
is not covered there: ``tf.raw_ops``, ``tf.compat.v1.nn.max_pool``, a ``max_pool2d`` imported
by name before the switch turned on). Stock Keras models and ``tf.function`` code need no other
change.

The switch is read when a layer's ``call`` is traced (when Keras builds its train/predict
function), and by the graph optimizer when TensorFlow optimizes a function (its first call), not
at every step: enabling or disabling it acts on later traces only. Change it before
``compile``/``fit``, or re-trace: ``model.compile(...)`` again (new train/predict functions), or
a new ``tf.function`` object for your own functions.
The switch's value lives in tf_relupool/_state.py alone (a leaf module: layers, rewrite_graph,
rewrite_model, keras_fusion and segments read it there when traced); this module writes it and
then tells the routes that it changed (`_notify_routes`).
The switch is process-global (not per thread) so that replica threads of a
``tf.distribute`` strategy see the same value as the thread that set it.
"""
import contextlib
import importlib.util
import logging
import os
import sys
import threading
import warnings

from tf_relupool import _state, autotune_cache, grappler, keras_fusion, segments
from tf_relupool._state import KEEP_ARGMAX, KEEP_INPUT

ENV_VAR = "TF_RELUPOOL_RECOMPUTE"
EXACT_ENV_VAR = "TF_RELUPOOL_EXACT"  # the default of `exact` ("0": False)
LEGACY_KERAS_VAR = "TF_USE_LEGACY_KERAS"  # TensorFlow's: tf.keras is then tf_keras (Keras 2)
_OFF_WORDS = ("0", "off", "false", "no", "none", "")
_ARGMAX_WORDS = ("1", "on", "true", "yes", KEEP_ARGMAX)

logger = logging.getLogger("tf_relupool")
_lock = threading.Lock()  # held while the mode changes and the routes are told


def parse_env_value(value):
    """Maps a TF_RELUPOOL_RECOMPUTE value to None, "argmax" or "input"; ValueError if unknown."""
    word = value.strip().lower()
    if word in _OFF_WORDS:
        return None
    if word in _ARGMAX_WORDS:
        return KEEP_ARGMAX
    if word == KEEP_INPUT:
        return KEEP_INPUT
    raise ValueError(
        f"{ENV_VAR}={value!r} is not understood; use one of '0'/'off', '1'/'argmax', 'input'")


def enable_recompute(keep=KEEP_ARGMAX, activations=False, bn_relu=None, exact=None,
                     memory_budget=1):
    """Turns the switch on: `ReluMaxPool2D(keep=None)` layers run the fused op, and stock
    relu + max_pool pairs are fused in functions traced afterwards: inside XLA-compiled ones
    (Keras' default compile on a GPU) where Keras' max pooling is traced (docs/xla.md), in
    others by the graph pass inside Grappler (docs/grappler.md).

    Args:
      keep: what the fused op's backward keeps. "argmax" (default, the lowest memory): one code
        per pooled element (1 byte for windows of fewer than 255 positions), neither the input
        nor its ReLU. "input": the pre-ReLU input, from which the backward recomputes the argmax
        (SystemML's recomputation of activations).
      activations: also recompute, in the backward pass and inside XLA-compiled functions
        only, the activations after Keras' BatchNormalization (training), after an `Add` of one,
        and an SE gate's multiply, instead of keeping their outputs for the next convolution or
        Dense layer: ReLU in every form (relu6, leaky), ELU, SELU, swish, GELU, hard sigmoid,
        hard swish, sigmoid, tanh, softplus, mish (tf_relupool/segment_table.py). Stock's bits,
        less memory, some elementwise work more (tf_relupool/segments.py,
        docs/activations.md). Turn it on whenever the batch does not fit.
      bn_relu: the name `activations` had when only BN + ReLU was covered; either turns it on.
      exact: True (the default, unless TF_RELUPOOL_EXACT=0 in the environment): where XLA is known to compile a sum after a fused pool in another
        order than stock's, that pool runs stock's ops (no saving there, stock's bits). Today
        one case: XLA's CPU code at AVX-512 sums the gradient of a conv bias or a
        BatchNormalization before a ReLU + max pool (or a zero pad then a max pool) otherwise;
        on a GPU and at AVX2 nothing changes. `fusion_report` names each such pool. False keeps
        the saving there, and those gradients may then differ from stock's in the last bits
        (docs/xla.md, "Exact semantics under XLA").
      memory_budget: a number in [0, 1]: under XLA, the share of the bytes that the
        recomputable convolution blocks' outputs (a convolution's output, which its
        BatchNormalization reads, and the activation after it) keep for the backward pass that
        may stay kept. 1 (the default) recomputes no convolution; below 1 `activations` is on
        too and the backward recomputes chosen convolutions from their kept inputs, cheapest
        FLOPs per byte first (tf_relupool/recompute_plan.py; 0: every block it covers,
        tf_relupool/conv_recompute.py, docs/activations.md). Stock's bits.

    On a GPU it also points XLA at a persistent autotune cache, so that a later run at the same
    batch does not autotune again: under a tight memory budget the first step's autotuning
    decides the largest batch (tf_relupool/autotune_cache.py, docs/memory.md). Call it before
    building the model (XLA reads its flags when TensorFlow starts its GPU); set
    TF_RELUPOOL_AUTOTUNE_CACHE=0 to leave XLA's flags alone.

    Takes effect for functions traced afterwards (compile/fit a model after calling it; a model
    compiled before needs `model.compile(...)` again, a `tf.function` traced before a new
    `tf.function` object). Under XLA, warns if Keras' or TensorFlow's max pooling does not
    reach tf_relupool's wrappers (a probe traces a tiny ReLU + max pool; docs/xla.md). Where
    tf.keras is Keras 2 (TF_USE_LEGACY_KERAS with tf-keras), warns once per process that only
    the Grappler route sees tf.keras models (docs/keras.md).

    Raises:
      ValueError: `keep` is not "argmax" or "input", `activations` (`bn_relu`) or `exact` is
        not a bool, or `memory_budget` is not a number in [0, 1].
    """
    budget = check_memory_budget(memory_budget)
    _set(_state.check_keep(keep, allow_bool=True),
         _check_activations(activations, bn_relu) or budget < 1, _check_exact(exact), budget)


def disable_recompute():
    """Turns the switch off: `ReluMaxPool2D(keep=None)` layers run stock relu + max_pool, and
    activations are no longer recomputed (`activations`)."""
    _set(None)


def recompute_mode():
    """The switch's value: None (off), "argmax" or "input"."""
    return _state.mode()


def recompute_enabled():
    """Whether the switch is on (`recompute_mode()` is not None)."""
    return _state.mode() is not None


@contextlib.contextmanager
def recompute(keep=KEEP_ARGMAX, activations=False, bn_relu=None, exact=None, memory_budget=1):
    """Context manager: sets the switch for the duration of the block, then restores it.

    `keep` is "argmax" (default) or "input" to turn it on, None or False to turn it off
    temporarily; `activations` (`bn_relu`), `exact` and `memory_budget` as for
    `enable_recompute` (activations and a budget below 1 only with the switch on). Affects what
    is traced inside the block:

    >>> with tf_relupool.recompute():            # fused, keeping 1-byte argmax codes
    ...     model.compile(...); model.fit(...)
    >>> with tf_relupool.recompute(None):        # stock ops, even if enabled globally
    ...     ...

    Raises:
      ValueError: `keep` is not "argmax", "input", None or False; `activations` (`bn_relu`) or
        `exact` is not a bool, or `activations` True with the switch off.
    """
    keep = _state.check_keep(keep, allow_none=True, allow_bool=True)
    on = _check_activations(activations, bn_relu)
    if on and keep is None:
        name = "bn_relu" if bn_relu else "activations"
        raise ValueError(f"`{name}=True` needs the switch on; received keep=None")
    budget = check_memory_budget(memory_budget)
    if budget < 1 and keep is None:
        raise ValueError(f"`memory_budget={memory_budget!r}` needs the switch on; received "
                         "keep=None")
    previous = _set(keep, on or budget < 1, _check_exact(exact), budget)
    try:
        yield keep
    finally:
        _set(*previous)


def _check_activations(activations, bn_relu=None):
    """`activations or bn_relu`, each checked to be a bool (bn_relu: None when not given)."""
    for name, value in (("activations", activations), ("bn_relu", bn_relu)):
        if not isinstance(value, bool) and not (name == "bn_relu" and value is None):
            raise ValueError(f"The `{name}` argument must be True or False. Received: "
                             f"{name}={value!r}")
    return activations or bool(bn_relu)


def _check_exact(exact):
    """`exact` checked to be a bool; None: TF_RELUPOOL_EXACT's value ("0", "off", "false", "no":
    False; unset, "", "1", "on", "true", "yes": True)."""
    if exact is None:
        value = os.environ.get(EXACT_ENV_VAR, "")
        word = value.strip().lower()
        if word in ("", "1", "on", "true", "yes"):
            return True
        if word in ("0", "off", "false", "no"):
            return False
        raise ValueError(f"{EXACT_ENV_VAR}={value!r} is not understood; use '1' or '0'")
    if not isinstance(exact, bool):
        raise ValueError(f"The `exact` argument must be True or False. Received: exact={exact!r}")
    return exact


def check_memory_budget(b):
    """`b` as a float where it is a number in [0, 1] (not a bool), else ValueError naming
    `memory_budget`."""
    import numbers
    if isinstance(b, bool) or not isinstance(b, numbers.Real) or not 0 <= b <= 1:
        raise ValueError("The `memory_budget` argument must be a number in [0, 1]. Received: "
                         f"memory_budget={b!r}")
    return float(b)


def _set(keep, activations=False, exact=True, memory_budget=1.0, at_import=False):
    """Sets the switch's value (checked), its activation, `exact` and memory-budget parts;
    returns the previous four."""
    with _lock:
        previous = (_state.mode(), _state.activations(), _state.exact(),
                    _state.memory_budget())
        _state.set_mode(keep)
        _state.set_activations(keep is not None and activations)
        _state.set_exact(exact)
        _state.set_memory_budget(memory_budget if keep is not None else 1.0)
        _notify_routes(at_import)
    if keep is not None:
        _warn_legacy_keras()  # outside the lock: a warnings filter may make it raise
    return previous


def legacy_tf_keras():
    """Whether tf.keras is Keras 2 in this process: TF_USE_LEGACY_KERAS has one of the values
    TensorFlow's tf.keras loader takes ("1", "true", "True") and tf_keras is installed (or
    imported)."""
    if os.environ.get(LEGACY_KERAS_VAR) not in ("1", "true", "True"):
        return False
    if "tf_keras" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("tf_keras") is not None
    except (ImportError, ValueError):
        return False


LEGACY_KERAS_WARNING = (
    "tf_relupool: TF_USE_LEGACY_KERAS is set, so tf.keras is Keras 2 (tf_keras). For tf.keras "
    "models enable_recompute() fuses ReLU + max pooling only in the graph pass inside Grappler, "
    "i.e. where TensorFlow runs the training step without XLA (tf.keras' default compile or "
    "jit_compile=False). It does not fuse them inside XLA (tf.keras compile(jit_compile=True): "
    "stock ops run there), activations=True recomputes nothing in tf.keras models, and "
    "ReluMaxPool2D / rewrite_model take Keras 3 models only. Models built with `import keras` "
    "(Keras 3) get every route as usual. See docs/keras.md, \"tf.keras (Keras 2, "
    "TF_USE_LEGACY_KERAS=1)\".")
_legacy_warned = []  # one entry once the warning has been given (once per process)


def _warn_legacy_keras():
    """Warns once per process, when the switch turns on while tf.keras is Keras 2 (tf_keras),
    what the switch does there and what not: the Keras 3 hooks (trace-time fusion under XLA,
    activations, the layer) never see a tf_keras model (docs/keras.md)."""
    if _legacy_warned or not legacy_tf_keras():
        return
    _legacy_warned.append(True)
    # stacklevel 4: the caller of enable_recompute() (-> _set -> here)
    warnings.warn(LEGACY_KERAS_WARNING, RuntimeWarning, stacklevel=4)


def _notify_routes(at_import=False):
    """Tells the routes, once per change, that the switch (already written to _state) changed:
    the trace-time fusion under XLA (tf_relupool/keras_fusion.py; `at_import`: its dispatch
    probe waits for the first gradient, as importing must not initialize TensorFlow's context)
    and the activation recomputation (segments.py) install or remove their hooks, which read
    _state when traced; the graph optimizer inside TensorFlow (tf_relupool/grappler.py) gets the
    mode copied into the op library, the one copy, as its C++ cannot read _state. Turning the
    switch on also points XLA at the switch's persistent autotune cache (autotune_cache.py)."""
    mode = _state.mode()
    if mode is not None:  # before the probe below may start TensorFlow's GPU
        autotune_cache.install()
    keras_fusion.set_enabled(mode is not None, probe_now=not at_import)
    segments.set_enabled(_state.activations())
    grappler.set_mode(mode)


def _init_from_environment():
    value = os.environ.get(ENV_VAR)
    if value is None:
        return
    try:
        mode = parse_env_value(value)
    except ValueError as e:
        # An import must not fail on a typo in the environment; say so loudly and stay off.
        warnings.warn(f"{e}; the recompute switch stays off", RuntimeWarning, stacklevel=2)
        mode = None
    if mode is None:
        _state.set_mode(None)
        return
    logger.info("recompute switch on from %s=%r: keep=%r", ENV_VAR, value, mode)
    try:
        exact = _check_exact(None)
    except ValueError as e:
        warnings.warn(f"{e}; exact stays True", RuntimeWarning, stacklevel=2)
        exact = True
    _set(mode, False, exact, at_import=True)  # memory budget 1


_init_from_environment()
