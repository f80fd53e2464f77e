"""The one hook layer: how the switch's routes put wrappers on Keras' and TensorFlow's functions.

A `Hooks` is one route's set of wrappers (keras_fusion's pools, segments' activations and
consumers, gradient_sources' tape method). `install(targets)` replaces each `owner.name` by
`factory(original)`; `remove()` puts each original back where the wrapper is still in place (a
wrapper someone installed over ours since stays, and keeps calling ours); `probe(...)` traces
small functions inside `tf.function(jit_compile=True)` (tracing only) and warns, naming each
path, where a call did not reach its wrapper: Keras or TensorFlow moved the function. The
private names the targets live under are tf_relupool/_compat.py's.
"""
import logging
import threading

logger = logging.getLogger("tf_relupool")


class Hooks:
    """A set of wrappers installed and removed together, thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._patches = []   # [(owner, name, original, wrapper)]
        self._probed = set()  # keys whose probe found every path reached

    def install(self, targets):
        """Installs `factory(original)` over `owner.name` for each (owner, name, factory) of
        `targets` whose owner has the name, unless installed already. Returns whether it
        installed now."""
        with self._lock:
            if self._patches:
                return False
            for owner, name, factory in targets:
                original = owner.__dict__.get(name)
                if original is None:
                    continue
                wrapper = factory(original)
                self._patches.append((owner, name, original, wrapper))
                setattr(owner, name, wrapper)
            return bool(self._patches)

    def remove(self):
        """Puts back each original whose wrapper is still in place."""
        with self._lock:
            while self._patches:
                owner, name, original, wrapper = self._patches.pop()
                if owner.__dict__.get(name) is wrapper:
                    setattr(owner, name, original)

    def installed(self):
        return bool(self._patches)

    def original(self, owner, name):
        """The function `owner.name` held before install(), or None."""
        for o, n, original, _ in self._patches:
            if o is owner and n == name:
                return original
        return None

    def probe(self, key, paths, what):
        """Traces each path's function at its TensorSpec inside tf.function(jit_compile=True)
        (no compilation; paths sharing a function trace it once) and warns once, naming the
        paths whose `reached()` is then False or whose trace failed. `paths`: {name: (fn, spec,
        reached)}; a `key` that passed is not probed again. `what`: what the warning says runs
        stock's ops instead."""
        import tensorflow as tf
        if key in self._probed:
            return
        missing, errors = [], {}  # errors: {id(fn): the trace's exception, or None}
        for name, (fn, spec, reached) in paths.items():
            if id(fn) not in errors:
                try:
                    tf.function(fn, jit_compile=True, autograph=False).get_concrete_function(spec)
                    errors[id(fn)] = None
                except Exception as e:  # noqa: BLE001 - a probe must not break enable_recompute()
                    errors[id(fn)] = e
            if errors[id(fn)] is not None:
                missing.append(f"{name} (the probe failed: {errors[id(fn)]})")
            elif not reached():
                missing.append(name)
        if missing:
            logger.warning(
                "tf_relupool: enable_recompute(): %s did not reach tf_relupool's hooks when traced "
                "inside tf.function(jit_compile=True); %s (no saving, stock's results). Keras or "
                "TensorFlow may have moved the function tf_relupool wraps.",
                "; ".join(missing), what)
        else:
            self._probed.add(key)
