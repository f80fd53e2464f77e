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
| keras.src.activations.activations (ReLU, Mish) | segments | their static_call, wrapped |
| keras.src.backend.standardize_data_format | keras_fusion | Keras' pool's data format |
| keras.src.ops.operation_utils.compute_pooling_output_shape | layers | the layer's shape |
| keras.src.utils.argument_validation.standardize_tuple | layers | pool_size/strides checks |
| tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext | xla | inside XLA? |
| tensorflow.python.framework.func_graph.FuncGraph | xla | the outermost traced function |
| tensorflow.python.eager.context | run_metadata, autotune_cache | run metadata; GPU started? |
| tensorflow.python.framework.load_library.load_pluggable_device_library | grappler | the pass |
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
    """TensorFlow's eager context object (run metadata collection, its `_initialized`)."""
    from tensorflow.python.eager import context
    return context.context()


def tf_load_pluggable_device_library(path):
    from tensorflow.python.framework import load_library
    return load_library.load_pluggable_device_library(path)


def tf_xla_optimization_barrier():
    """TensorFlow's XlaOptimizationBarrier op function, or None where its library is absent (the
    trimmed GPU bundle without _xla_ops.so)."""
    try:
        from tensorflow.compiler.tf2xla.ops import gen_xla_ops
        return gen_xla_ops.xla_optimization_barrier
    except (ImportError, AttributeError):
        return None
