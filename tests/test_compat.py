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


def _private_attributes(tree):
    """(line, base, name) of each private attribute a module reads or writes in code (`x._name`,
    or getattr/hasattr/setattr with "_name"), leaving out dunders and the package's own: an
    attribute of `self` that the module itself assigns or defines, the marks tf_relupool sets on
    its wrappers (`_tf_relupool_*`) and os._exit."""
    own = {node.name for node in ast.walk(tree)
           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
            and node.value.id == "self"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base, name = ast.unparse(node.value), node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            base, name = ast.unparse(node.args[0]), node.args[1].value
        else:
            continue
        if not name.startswith("_") or name.startswith("__") or \
                name.startswith("_tf_relupool_") or (base, name) == ("os", "_exit") or \
                (base == "self" and name in own):
            continue
        yield node.lineno, base, name


def test_no_module_but_compat_reads_a_private_attribute():
    """Keras' and TensorFlow's private attributes (`model._layers`, `t._keras_history`,
    `context()._initialized`) are read in _compat.py only."""
    package = pathlib.Path(tf_relupool.__file__).parent
    found = [(path.name,) + hit for path in sorted(package.glob("*.py"))
             if path.name != "_compat.py"
             for hit in _private_attributes(ast.parse(path.read_text()))]
    assert not found, found
    sample = ("class A:\n    def __init__(self):\n        self._mine = 1\n"
              "    def f(self, model, t):\n        return (self._mine, self._theirs, model._layers,"
              " getattr(t, '_keras_history'), f._tf_relupool_wraps)\n")
    assert [(b, n) for _, b, n in _private_attributes(ast.parse(sample))] == [
        ("self", "_theirs"), ("model", "_layers"), ("t", "_keras_history")]


def test_functional_and_sequential_parts_are_found_in_this_keras():
    inp = keras.Input((4,), name="x")
    hidden = keras.layers.Dense(3, activation="relu", name="dense")(inp)
    out = keras.layers.Dense(2, name="head")(hidden)
    model = keras.Model({"x": inp}, [out])
    nodes, inputs, outputs = _compat.keras_functional_parts(model)
    assert [n.operation.name for n in nodes if not n.is_input] == ["dense", "head"]
    assert nodes[0].is_input and inputs == {"x": inp} and outputs == [out]
    op, node = _compat.keras_producer(hidden)
    assert op.name == "dense" and node in nodes and node.outputs == [hidden]
    assert node.input_tensors == [inp]
    layer, _ = _compat.keras_producer(inp)
    assert isinstance(layer, keras.layers.InputLayer)
    assert _compat.keras_producer(tf.constant(1.0)) == (None, None)

    class Subclassed(keras.Model):
        def call(self, x):
            return x
    assert _compat.keras_functional_parts(Subclassed()) is None

    seq = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
    layers = _compat.keras_sequential_layers(seq)
    assert isinstance(layers[0], keras.layers.InputLayer) and layers[1].name == "d"


def test_sigmoid_logits_mark_is_the_one_keras_reads():
    seen = {}

    @tf.function
    def f(x):
        theirs = keras.activations.sigmoid(x)  # Keras' own mark, under the name _compat writes
        seen["theirs"] = getattr(theirs, "_keras_logits", None) is x
        ours = tf.sigmoid(x)
        _compat.keras_mark_logits(ours, x)
        seen["ours"] = getattr(ours, "_keras_logits", None) is x
        y = tf.ones_like(x)
        # binary cross-entropy of a marked output reads the logits: the same as from_logits
        seen["loss"] = (keras.losses.binary_crossentropy(y, ours),
                        keras.losses.binary_crossentropy(y, x, from_logits=True))
        return seen["loss"]
    marked, from_logits = f(tf.constant([[-40.0, 0.5, 40.0]]))
    assert seen["theirs"] and seen["ours"]
    assert marked.numpy().tolist() == from_logits.numpy().tolist()


def test_context_initialized_once_tensorflow_ran():
    tf.constant(1.0) + 1.0  # initializes the eager context
    assert _compat.tf_context_initialized() is True


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
