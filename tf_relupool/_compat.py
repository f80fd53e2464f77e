"""Every private Keras and TensorFlow name tf_relupool reads, in one place.

Tested with TensorFlow 2.20 and 2.21 and Keras 3.10 to 3.15 (`setup.py`'s range; make
test-compat). Each helper imports its name when called and, where a version moved it, degrades
as its doc says (an empty answer, or None), so that the caller can fall back to stock's ops and
the install probes (tf_relupool/_hooks.py) can warn.

| name | used by | for |
|---|---|---|
| keras.src.backend.common.name_scope.current_path | report rows | the user's layer names |
| keras.src.backend.common.global_state (current_call_ctx) | xla | the model a warning names |
| keras.src.backend.tensorflow.nn, .numpy | keras_fusion, segments | the functions wrapped |
| Functional `_nodes_by_depth`, `_inputs_struct`, `_outputs_struct` | rewrite_model | the graph copied |
| Sequential `_layers` | rewrite_model | its layers, InputLayer included |
| KerasTensor `_keras_history`, Operation `_inbound_nodes` | rewrite_model | a tensor's producer |
| tensor `_keras_logits` | segments | sigmoid's mark of its logits, for the losses |
| keras.src.activations.activations (ReLU, Mish) | segments | their static_call, wrapped |
| keras.src.backend.standardize_data_format | keras_fusion | Keras' pool's data format |
| keras.src.ops.operation_utils.compute_pooling_output_shape | layers | the layer's shape |
| keras.src.utils.argument_validation.standardize_tuple | layers | pool_size/strides checks |
| tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext | xla | inside XLA? |
| tensorflow.python.framework.func_graph.FuncGraph | xla | the outermost traced function |
| tensorflow.python.eager.context (its `_initialized`) | run_metadata, autotune_cache | run metadata; GPU started? |
| tensorflow.python.framework.load_library.load_pluggable_device_library | grappler | the pass |
| tensorflow.python.framework.op_callbacks | report | each traced op's Keras layer |
| tensorflow.compiler.tf2xla.ops.gen_xla_ops.xla_optimization_barrier | segments | the barrier |
"""


def keras_layer_path():
    """The Keras layers being called now, outermost first, as the user named them
    ("model/block_1_expand_relu"); "" outside a layer call or where Keras moved it."""
    try:
        from keras.src.backend.common.name_scope import current_path
        return current_path()
    except Exception:  # noqa: BLE001 - a description only
        return ""


def keras_entry_layer():
    """The outermost Keras layer (model) being called now, or None."""
    try:
        from keras.src.backend.common import global_state
        return getattr(global_state.get_global_attribute("current_call_ctx"), "entry_layer",
                       None)
    except Exception:  # noqa: BLE001 - a description only
        return None


def keras_tf_backend():
    """{"nn": keras.src.backend.tensorflow.nn, "numpy": its numpy module} while Keras 3 runs on
    its TensorFlow backend, else {} (another backend, no Keras 3, or moved)."""
    try:
        import keras
        if keras.backend.backend() != "tensorflow":
            return {}
        from keras.src.backend.tensorflow import nn, numpy
    except ImportError:
        return {}
    return {"nn": nn, "numpy": numpy}


def keras_activation_classes():
    """{"ReLU": ..., "Mish": ...}: keras.src.activations.activations' classes whose static_call
    the activation functions call (a name this Keras lacks is left out), else {}."""
    try:
        from keras.src.activations import activations
    except ImportError:
        return {}
    return {name: getattr(activations, name) for name in ("ReLU", "Mish")
            if hasattr(activations, name)}


def keras_data_format(data_format):
    """Keras' standardize_data_format ("channels_last" / "channels_first")."""
    import keras
    return keras.src.backend.standardize_data_format(data_format)


def keras_pooling_output_shape(*args, **kwargs):
    from keras.src.ops.operation_utils import compute_pooling_output_shape
    return compute_pooling_output_shape(*args, **kwargs)


def keras_standardize_tuple(value, n, name):
    from keras.src.utils.argument_validation import standardize_tuple
    return standardize_tuple(value, n, name)


def keras_functional_parts(model):
    """(nodes, inputs, outputs) of a Functional model: its nodes in call order (Keras'
    `_nodes_by_depth`, deepest first; Keras' Node objects, of which the caller reads `operation`,
    `input_tensors`, `outputs`, `is_input` and `arguments`), and its nested input and output
    structures (`_inputs_struct`, `_outputs_struct`, as keras.tree flattens and packs them).
    None for a model without them (subclassed, or a Keras that moved them: rewrite_model then
    refuses the model as it refuses a subclassed one)."""
    if not (hasattr(model, "_nodes_by_depth") and hasattr(model, "_outputs_struct")):
        return None
    by_depth = model._nodes_by_depth
    nodes = [n for depth in sorted(by_depth, reverse=True) for n in by_depth[depth]]
    return nodes, model._inputs_struct, model._outputs_struct


def keras_sequential_layers(model):
    """A Sequential model's layers in order, its InputLayer first where it has one (Keras'
    `_layers`); where Keras moved that name, `model.layers` (without the InputLayer: the copy
    is then built from the model's input shape)."""
    layers = getattr(model, "_layers", None)
    return list(model.layers if layers is None else layers)


def keras_producer(tensor):
    """(the operation (layer) that made KerasTensor `tensor`, the node of that call), from the
    tensor's `_keras_history` and the operation's `_inbound_nodes`; (None, None) for a tensor
    without that history (or where Keras moved the names: nothing is then fused)."""
    history = getattr(tensor, "_keras_history", None)
    if history is None:
        return None, None
    op, node_index, _ = history
    nodes = getattr(op, "_inbound_nodes", None)
    if op is None or nodes is None or len(nodes) <= node_index:
        return None, None
    return op, nodes[node_index]


def keras_mark_logits(output, logits):
    """Marks `output` (a sigmoid's) with its `logits` as Keras' own sigmoid does
    (`output._keras_logits`), where Keras' binary cross-entropy reads them instead of the
    probabilities; a tensor that takes no attribute stays unmarked (the loss then reads the
    probabilities, as for any other sigmoid)."""
    try:
        output._keras_logits = logits
    except AttributeError:
        pass


def tf_context_initialized():
    """Whether TensorFlow's eager context has initialized (its devices, a GPU's memory:
    `context()._initialized`); False where TensorFlow moved the name (the caller assumes it is
    not too late)."""
    try:
        return bool(getattr(tf_eager_context(), "_initialized", False))
    except Exception:  # noqa: BLE001 - a private attribute: assume it is not too late
        return False


def tf_in_xla_context():
    """Whether the graph being built is, or is inside, an XLA-compiled function; False where
    TensorFlow moved the name (the caller then emits stock's or the library's ops)."""
    try:
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util
        return bool(control_flow_util.GraphOrParentsInXlaContext(
            tf.compat.v1.get_default_graph()))
    except (ImportError, AttributeError):
        return False


def tf_outermost_function_graph():
    """The outermost traced function's graph around the graph being built."""
    import tensorflow as tf
    from tensorflow.python.framework import func_graph
    graph = tf.compat.v1.get_default_graph()
    while isinstance(getattr(graph, "outer_graph", None), func_graph.FuncGraph):
        graph = graph.outer_graph
    return graph


def tf_eager_context():
    """TensorFlow's eager context object (run metadata collection; tf_context_initialized)."""
    from tensorflow.python.eager import context
    return context.context()


def tf_load_pluggable_device_library(path):
    from tensorflow.python.framework import load_library
    return load_library.load_pluggable_device_library(path)


def tf_op_creation_callback(fn):
    """A context manager: while it is open, `fn(op)` is called on this thread for every op built
    into a graph (TensorFlow's op callbacks, as tf.debugging's dump uses them); the graph is left
    as built. Open it inside a traced function: opened eagerly, TensorFlow swaps its module-wide
    eager execute function. Where TensorFlow moved the name, nothing is called."""
    import contextlib

    @contextlib.contextmanager
    def block():
        try:
            from tensorflow.python.framework import op_callbacks
        except ImportError:
            yield
            return

        def callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
            if outputs and graph is not None and hasattr(outputs[0], "op"):
                fn(outputs[0].op)
            return None
        op_callbacks.add_op_callback(callback)
        try:
            yield
        finally:
            op_callbacks.remove_op_callback(callback)
    return block()


def tf_xla_optimization_barrier():
    """TensorFlow's XlaOptimizationBarrier op function, or None where its library is absent (the
    trimmed GPU bundle without _xla_ops.so)."""
    try:
        from tensorflow.compiler.tf2xla.ops import gen_xla_ops
        return gen_xla_ops.xla_optimization_barrier
    except (ImportError, AttributeError):
        return None
