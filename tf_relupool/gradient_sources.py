"""Which tensors the gradient being computed is taken with respect to (its sources).

The switch's trace-time fusion under XLA (keras_fusion.py) replaces `max_pool(relu(z))` by the
fused XLA form over z, whose gradient goes straight to z. That is stock's gradient for z and for
everything upstream of it, but not for the tensors the fusion skips: the ReLU's output `a` (and
the output of a zero Pad between it and the pool). A gradient taken with respect to one of those
(Grad-CAM: `tape.gradient(score, conv_relu_out)`) must receive the pool's branch too. A
`tf.custom_gradient` function is not told the sources of the gradient it is part of, so while
the switch is on `tf.GradientTape.gradient` is wrapped (jacobian and batch_jacobian call it) and
records each call's sources, per thread, in a stack; the fused op's gradient function asks
`route(skipped)`:

- "fused": the current call's sources are known and none of them is a skipped tensor: the fused
  backward (one-byte codes, the memory saving);
- "source": a skipped tensor is a source: stock's gradient of the pool into its input, from
  where the tape continues through stock's Relu (and Pad) into z exactly as stock does;
- "unknown": the gradient function runs outside any recorded call (`tf.gradients`, a tape
  method the wrapper does not see, the wrapper removed meanwhile): stock's route as for
  "source" (correctness first), counted in `stats()`.

Tensors are compared by graph and name, not by Python identity. The wrapper is installed while
a route that asks route() requires it (`require`: keras_fusion's pool fusion, segments'
recomputation) and removed when none does (unless something else has wrapped the method since,
which then stays: tf_relupool/_hooks.py).
"""
import collections
import threading

from tf_relupool._hooks import Hooks

_lock = threading.Lock()
_local = threading.local()
_hooks = Hooks()  # tf.GradientTape.gradient while a route requires it
_users = set()  # the routes that require the wrapper now
_stats = collections.Counter()

FUSED, SOURCE, UNKNOWN = "fused", "source", "unknown"


def _tape_class():
    import tensorflow as tf
    return tf.GradientTape


def _key(t):
    graph = getattr(t, "graph", None)
    name = getattr(t, "name", None)
    return None if graph is None or name is None else (id(graph), name)  # eager: no graph


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


_pending = []  # functions to run once, at the next gradient call (keras_fusion's probe)


def before_next_gradient(fn):
    """Runs `fn()` once, at the start of the next tf.GradientTape.gradient call through the
    wrapper (never raising into it)."""
    _pending.append(fn)


def _run_pending():
    while _pending:
        fn = _pending.pop()
        try:
            fn()
        except Exception:  # noqa: BLE001 - a probe must not break the user's gradient
            import logging
            logging.getLogger("tf_relupool").warning(
                "tf_relupool: a deferred check failed", exc_info=True)


def _wrap(original):
    """tf.GradientTape.gradient (`original`), recording its sources for route()."""
    def gradient(self, target, sources, *args, **kwargs):
        import tensorflow as tf
        if _pending:
            _run_pending()
        keys = frozenset(_key(s) for s in tf.nest.flatten(sources)
                         if isinstance(s, tf.Tensor) and _key(s) is not None)
        stack = _stack()
        stack.append(keys)
        try:
            return original(self, target, sources, *args, **kwargs)
        finally:
            stack.pop()
    gradient.__wrapped__ = original
    gradient.__doc__ = original.__doc__
    gradient._tf_relupool_sources = True
    return gradient


def require(user, on):
    """`user` (a route's name) requires the wrapper around tf.GradientTape.gradient (on) or no
    longer does (off): it is installed while some route requires it. Removing it restores the
    method it wrapped; if something else has wrapped the method since, that stays (and keeps
    calling the wrapper, which only records)."""
    with _lock:
        (_users.add if on else _users.discard)(user)
        if _users:
            _hooks.install([(_tape_class(), "gradient", _wrap)])
        else:
            _hooks.remove()


def installed():
    """Whether tf.GradientTape.gradient is the wrapper now."""
    return getattr(_tape_class().__dict__.get("gradient"), "_tf_relupool_sources", False)


def route(skipped):
    """FUSED, SOURCE or UNKNOWN (module doc) for a fused op that skipped the tensors `skipped`,
    asked from its gradient function; counted in stats()."""
    stack = _stack()
    if not stack:
        answer = UNKNOWN
    else:
        keys = {_key(t) for t in skipped}
        answer = SOURCE if keys & stack[-1] else FUSED
    _stats[answer] += 1
    return answer


def stats():
    """How often each route was taken since import: {"fused": n, "source": m, "unknown": k}."""
    return {r: _stats[r] for r in (FUSED, SOURCE, UNKNOWN)}
