"""rewrite_model: a copy of a Keras model with ReLU + MaxPooling2D pairs fused into ReluMaxPool2D.

Fusable, when the ReLU's output has no consumer but the MaxPooling2D (and is no model output):
  - Conv*/Dense/... with activation="relu" -> MaxPooling2D: the layer gets activation="linear",
    the pool becomes ReluMaxPool2D with the same arguments;
  - ReLU() (default arguments) or Activation("relu") -> MaxPooling2D: the ReLU layer is dropped,
    the pool becomes ReluMaxPool2D;
  - either of these with a ZeroPadding2D between the ReLU and the MaxPooling2D (the ResNet and
    DenseNet stems), whose output feeds only the pool: relu(pad0(z)) == pad0(relu(z)) element by
    element, so the padding moves before the ReLU and the pool becomes ReluMaxPool2D over the
    padded z.
Everything else is copied as it is (weights included); patterns that look like a candidate but
cannot be fused (other activations, 1-D/3-D pooling, a ReLU with several consumers, a layer with
a ReLU activation called at several places, different dtype policies) get one INFO line on the
"tf_relupool" logger. Nested Sequential/Functional models are rewritten recursively; a ReLU at
the end of a nested model is not fused with a pool in the outer model.

Reads Keras 3's Functional graph (its nodes, their arguments, a tensor's producer) through
tf_relupool/_compat.py, which holds those private Keras names.
"""
import logging
import random

import keras

from tf_relupool import _compat, _state
from tf_relupool.layers import ReluMaxPool2D

logger = logging.getLogger("tf_relupool")

_OTHER_POOLS = (keras.layers.MaxPooling1D, keras.layers.MaxPooling3D,
                keras.layers.GlobalMaxPooling1D, keras.layers.GlobalMaxPooling2D,
                keras.layers.GlobalMaxPooling3D)


def _activation_name(layer):
    """'relu' for a plain ReLU, another name for other activations, None for no activation."""
    if isinstance(layer, keras.layers.ReLU):
        cfg = layer.get_config()
        plain = (cfg.get("max_value") is None and not cfg.get("negative_slope")
                 and not cfg.get("threshold"))
        return "relu" if plain else "ReLU(" + ", ".join(
            f"{k}={cfg.get(k)}" for k in ("max_value", "negative_slope", "threshold")) + ")"
    if isinstance(layer, (keras.layers.LeakyReLU, keras.layers.ELU, keras.layers.PReLU,
                          keras.layers.Softmax)):
        return type(layer).__name__
    if isinstance(layer, keras.layers.Activation) or hasattr(layer, "activation"):
        act = getattr(layer, "activation", None)
        if act is None or not callable(act):
            return None
        try:
            name = keras.activations.serialize(act)
        except Exception:  # a custom activation Keras cannot name
            name = getattr(act, "__name__", repr(act))
        if isinstance(name, dict):
            name = name.get("config", name.get("class_name"))
        name = str(name)
        return None if name == "linear" else name
    return None


def _kind(layer):
    """'drop' (ReLU/Activation layer), 'linearize' (layer with activation="relu"), or None."""
    if isinstance(layer, (keras.layers.ReLU, keras.layers.Activation)):
        return "drop"
    if isinstance(layer, keras.Model) or "activation" not in layer.get_config():
        return None
    return "linearize"


def _clone(layer, overrides=None):
    config_ = layer.get_config()
    config_.update(overrides or {})
    return layer.__class__.from_config(config_)


def _fused_pool(pool, keep):
    config_ = pool.get_config()
    return ReluMaxPool2D(pool_size=config_["pool_size"], strides=config_["strides"],
                         padding=config_["padding"], data_format=config_["data_format"],
                         keep=keep, name=config_["name"], dtype=config_.get("dtype"),
                         trainable=config_.get("trainable", True))


# -- finding: which producer -> (pad ->) pool chains are fused ------------------------------------
def _fusable(producer, pool, n_consumers, n_calls, where, pad=None, pad_consumers=1):
    """True if producer -> pool (or producer -> pad -> pool, pad a ZeroPadding2D) can be fused;
    logs why not for candidates."""
    act = _activation_name(producer)
    path = f"{producer.name} -> " + (f"{pad.name} -> " if pad is not None else "") + pool.name
    if isinstance(pool, _OTHER_POOLS):
        if act == "relu":
            logger.info("rewrite_model: %s not fused: only 2-D max pooling has a fused op", path)
        return False
    if not isinstance(pool, keras.layers.MaxPooling2D) or isinstance(pool, ReluMaxPool2D):
        return False
    if act is None:
        return False
    if act != "relu":
        logger.info("rewrite_model: %s not fused: activation %s is not ReLU", path, act)
        return False
    if _kind(producer) is None:
        return False
    if n_consumers != 1:
        logger.info("rewrite_model: %s not fused: the ReLU output has %d consumers%s",
                    path, n_consumers, where)
        return False
    if pad_consumers != 1:
        logger.info("rewrite_model: %s not fused: the padding's output has %d consumers (or "
                    "is a model output)", path, pad_consumers)
        return False
    if n_calls != 1 and _kind(producer) == "linearize":
        logger.info("rewrite_model: %s not fused: %s is called at %d places",
                    path, producer.name, n_calls)
        return False
    dtypes = {producer.compute_dtype, pool.compute_dtype} | (
        {pad.compute_dtype} if pad is not None else set())
    if len(dtypes) != 1:
        logger.info("rewrite_model: %s not fused: compute dtypes differ (%s)",
                    path, ", ".join(sorted(dtypes)))
        return False
    logger.info("rewrite_model: fused %s into ReluMaxPool2D", path)
    return True


def _find_sequential(layers):
    """A Sequential's layers in steps: (layer, None, None) copied, or (producer, pad or None,
    pool) fused."""
    steps = []
    i = 0
    while i < len(layers):
        layer = layers[i]
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        pad = None
        if isinstance(nxt, keras.layers.ZeroPadding2D) and i + 2 < len(layers):
            pad, nxt = nxt, layers[i + 2]
        if nxt is not None and not isinstance(layer, keras.layers.InputLayer) and \
                _fusable(layer, nxt, 1, 1, "", pad=pad):
            steps.append((layer, pad, nxt))
            i += 3 if pad is not None else 2
        else:
            steps.append((layer, None, None))
            i += 1
    return steps


class _FunctionalGraph:
    """A Functional model's nodes in call order, and the fusable chains among them."""

    def __init__(self, nodes, outputs):
        self.nodes = nodes
        self.node_ids = {id(n) for n in self.nodes}
        self.consumers = {}  # id(tensor) -> its consumers, a model output counting as one
        for n in self.nodes:
            for t in n.input_tensors:
                self.consumers[id(t)] = self.consumers.get(id(t), 0) + 1
        for t in keras.tree.flatten(outputs):
            self.consumers[id(t)] = self.consumers.get(id(t), 0) + 1
        self.calls = {}  # id(layer) -> the nodes that call it
        for n in self.nodes:
            if n.operation is not None:
                self.calls[id(n.operation)] = self.calls.get(id(n.operation), 0) + 1

    def single_producer(self, t):
        """The layer and node of this model that made `t` from one input into one output, or
        (None, None)."""
        op, producer = _compat.keras_producer(t)
        if producer is None or id(producer) not in self.node_ids or producer.is_input or \
                len(producer.input_tensors) != 1 or len(producer.outputs) != 1:
            return None, None
        return op, producer

    def find(self):
        """{id(pool node): producer node} and {id(producer node): its _kind} of the fusions."""
        fused_pools, fused_producers = {}, {}
        for n in self.nodes:
            if n.operation is None or n.is_input or len(n.input_tensors) != 1:
                continue
            t = n.input_tensors[0]
            op, producer = self.single_producer(t)
            if producer is None:
                continue
            pad, pad_consumers = None, 1
            if isinstance(op, keras.layers.ZeroPadding2D):  # ReLU -> ZeroPadding2D -> pool
                pad, pad_consumers = op, self.consumers.get(id(t), 0)
                t = producer.input_tensors[0]
                op, producer = self.single_producer(t)
                if producer is None:
                    continue
            n_consumers = self.consumers.get(id(t), 0)
            where = "" if n_consumers == 1 else " (it feeds several layers or is a model output)"
            if _fusable(op, n.operation, n_consumers, self.calls[id(op)], where, pad=pad,
                        pad_consumers=pad_consumers):
                fused_pools[id(n)] = producer
                fused_producers[id(producer)] = _kind(op)
        return fused_pools, fused_producers


# -- rebuilding: the copy, with the fusions found ------------------------------------------------
class _Rewriter:
    """Builds a model's copy: layers copied once each (shared layers stay shared), weights
    carried over, nested models rewritten, the fusions that _find_sequential /
    _FunctionalGraph found applied."""

    def __init__(self, keep):
        self.keep = keep
        self.copies = {}     # id(old layer) -> new layer (shared layers stay shared)
        self.pairs = []      # (old layer, new layer) to copy weights into after building
        self.fused = 0

    def copy_layer(self, layer, overrides=None):
        key = (id(layer), bool(overrides))
        if key not in self.copies:
            if isinstance(layer, keras.Model):
                nested = _Rewriter(self.keep)  # builds and fills its own layers
                new = nested.rewrite(layer)
                self.fused += nested.fused
            else:
                try:
                    new = _clone(layer, overrides)
                except Exception as e:  # a custom layer without a usable get_config
                    raise ValueError(
                        f"rewrite_model cannot copy layer {layer.name!r} "
                        f"({type(layer).__name__}): {e}") from e
                self.pairs.append((layer, new))
            self.copies[key] = new
        return self.copies[key]

    def rewrite(self, model):
        if isinstance(model, keras.Sequential):
            return self._sequential(model)
        parts = _compat.keras_functional_parts(model)
        if parts is not None:
            return self._functional(model, *parts)
        raise ValueError(
            f"rewrite_model takes a Sequential or Functional Keras model; {model.name!r} is a "
            f"subclassed {type(model).__name__}. Use ReluMaxPool2D in its code instead, or "
            "tf_relupool.rewrite_graph on its traced graph.")

    def _sequential(self, model):
        new_layers = []
        for layer, pad, pool in _find_sequential(_compat.keras_sequential_layers(model)):
            if pool is None:
                new_layers.append(self.copy_layer(layer))
                continue
            self.fused += 1
            if _kind(layer) == "linearize":
                new_layers.append(self.copy_layer(layer, {"activation": "linear"}))
            if pad is not None:
                new_layers.append(self.copy_layer(pad))
            new_layers.append(_fused_pool(pool, self.keep))
        new = keras.Sequential(new_layers, name=model.name, trainable=model.trainable)
        if model.built and not new.built and model.inputs:
            new.build(model.inputs[0].shape)
        self._carry_weights()
        return new

    def _functional(self, model, nodes, inputs, outputs):
        graph = _FunctionalGraph(nodes, outputs)
        fused_pools, fused_producers = graph.find()
        self.fused += len(fused_pools)
        tensors = {}
        new_inputs = []
        for x in keras.tree.flatten(inputs):
            layer, _ = _compat.keras_producer(x)
            new_x = keras.layers.InputLayer.from_config(layer.get_config()).output
            tensors[id(x)] = new_x
            new_inputs.append(new_x)
        for n in graph.nodes:
            if n.operation is None or n.is_input:
                continue
            if any(id(t) not in tensors for t in n.input_tensors):
                continue
            args, kwargs = n.arguments.fill_in(tensors)
            kind = fused_producers.get(id(n))
            if kind == "drop":  # the fused pool applies this ReLU
                made = tensors[id(n.input_tensors[0])]
            elif kind == "linearize":
                made = self.copy_layer(n.operation, {"activation": "linear"})(*args, **kwargs)
            elif id(n) in fused_pools:
                made = _fused_pool(n.operation, self.keep)(*args, **kwargs)
            else:
                made = self.copy_layer(n.operation)(*args, **kwargs)
            for old, new in zip(n.outputs, keras.tree.flatten(made)):
                tensors[id(old)] = new
        new_outputs = [tensors[id(t)] for t in keras.tree.flatten(outputs)]
        new = keras.Model(
            inputs=keras.tree.pack_sequence_as(inputs, new_inputs),
            outputs=keras.tree.pack_sequence_as(outputs, new_outputs),
            name=model.name, trainable=model.trainable)
        self._carry_weights()
        return new

    def _carry_weights(self):
        """Each copy gets its original's state: the weights, and the random seeds' states (a
        Dropout's SeedGenerator: the copy draws the masks the original would draw next), which
        `layer.variables` holds beside the weights."""
        pairs, self.pairs = self.pairs, []
        for old, new in pairs:
            weights = old.get_weights()
            if weights:
                new.set_weights(weights)
            olds, news = _state_beside_weights(old), _state_beside_weights(new)
            if len(olds) == len(news):
                for o, n in zip(olds, news):
                    if o.shape == n.shape and o.dtype == n.dtype:
                        n.assign(o)


def _state_beside_weights(layer):
    """The layer's variables that are not weights (seed generators' states, metrics')."""
    weights = {id(w) for w in layer.weights}
    return [v for v in layer.variables if id(v) not in weights]


def rewrite_model(model, keep=None):
    """Returns a copy of `model` in which ReLU + MaxPooling2D pairs are fused into ReluMaxPool2D.

    Args:
      model: a Sequential or Functional Keras 3 model (nested models are rewritten too).
      keep: the `keep` of the new ReluMaxPool2D layers. None (default): they follow the global
        switch when traced, so with `tf_relupool.enable_recompute()` they run the fused op and
        with the switch off the stock ops (same numbers). "argmax" or "input": always fused,
        with that backward.

    Returns:
      A new, uncompiled model with the same inputs, outputs, names and weights (copied, not
      shared): outputs are identical to `model`'s. If `model` was compiled, the copy is compiled
      from `model.get_compile_config()` (a fresh optimizer: its state is not carried over).

    Raises:
      ValueError: `keep` is invalid, or `model` is subclassed (not Sequential/Functional).
    """
    keep = _state.check_keep(keep, allow_none=True)
    if not isinstance(model, keras.Model):
        legacy = type(model).__module__.startswith("tf_keras")
        raise ValueError(
            f"rewrite_model takes a Keras model (Keras 3), got {type(model).__module__}."
            f"{type(model).__name__}" + (
                " (tf.keras under TF_USE_LEGACY_KERAS is Keras 2; enable_recompute() fuses its "
                "ReLU + max pooling without XLA: docs/keras.md)" if legacy else ""))
    rewriter = _Rewriter(keep)
    # The copies' random initializers and SeedGenerators take their seeds from Python's `random`
    # when constructed (the copies' weights and seed states are then the originals'): the user's
    # random state is put back as it was
    python_random = random.getstate()
    try:
        new = rewriter.rewrite(model)
    finally:
        random.setstate(python_random)
    logger.info("rewrite_model: %s: %d ReLU + MaxPooling2D pair(s) fused (keep=%s, switch=%s)",
                model.name, rewriter.fused, keep, _state.mode())
    if getattr(model, "compiled", False):
        try:
            new.compile_from_config(model.get_compile_config())
        except Exception as e:  # custom losses/metrics that do not deserialize
            logger.info("rewrite_model: the copy is not compiled (%s); compile it yourself", e)
    return new
