"""tf_relupool/_compat.py: every private Keras/TensorFlow name in one module, each found in the
Keras and TensorFlow under test (a version that moves one fails here, naming it)."""
import ast
import pathlib

import keras
import tensorflow as tf

import tf_relupool
from tf_relupool import _compat

_PRIVATE = ("keras.src", "tensorflow.python", "tensorflow.compiler", "tensorflow.core")


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def _reaches_keras_src(tree):
    """`keras.src.<...>` in code (an attribute, not a comment or docstring)."""
    return any(isinstance(node, ast.Attribute) and node.attr == "src"
               and isinstance(node.value, ast.Name) and node.value.id == "keras"
               for node in ast.walk(tree))


def test_no_module_but_compat_reaches_a_private_name():
    package = pathlib.Path(tf_relupool.__file__).parent
    found = []
    for path in sorted(package.glob("*.py")):
        if path.name == "_compat.py":
            continue
        tree = ast.parse(path.read_text())
        found += [(path.name, m) for m in _imports(tree) if m.startswith(_PRIVATE)]
        if _reaches_keras_src(tree):
            found.append((path.name, "keras.src"))
    assert not found, found
    assert _reaches_keras_src(ast.parse("import keras\nkeras.src.backend.x()"))


def test_every_name_is_found_in_this_keras_and_tensorflow():
    backend = _compat.keras_tf_backend()
    assert set(backend) == {"nn", "numpy"} and hasattr(backend["nn"], "max_pool")
    assert "ReLU" in _compat.keras_activation_classes()
    assert _compat.keras_data_format(None) in ("channels_last", "channels_first")
    assert _compat.keras_pooling_output_shape((1, 4, 4, 1), (2, 2), (2, 2), "valid",
                                              "channels_last") == (1, 2, 2, 1)
    assert _compat.keras_standardize_tuple(2, 2, "pool_size") == (2, 2)
    assert _compat.tf_eager_context() is not None
    assert _compat.tf_xla_optimization_barrier() is not None

    seen = {}

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen["path"] = _compat.keras_layer_path()
            seen["entry"] = _compat.keras_entry_layer()
            seen["xla"] = _compat.tf_in_xla_context()
            seen["outer"] = _compat.tf_outermost_function_graph()
            return x
    inp = keras.Input((2,))
    model = keras.Model(inp, Probe(name="probe_layer")(inp), name="probe_model")
    tf.function(model, jit_compile=True).get_concrete_function(tf.TensorSpec([1, 2]))
    assert seen["path"].endswith("probe_layer"), seen
    assert seen["entry"] is model and seen["xla"] is True
    assert seen["outer"] is not None
    assert _compat.tf_in_xla_context() is False  # eager, outside any function
