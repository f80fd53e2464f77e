"""Private Keras names that more than one module reads, with the versions they were read in
(Keras 3.10-3.15 with TensorFlow 2.20-2.21). Each helper degrades to an empty answer where a
Keras version moved the name."""


def keras_layer_path():
    """The Keras layers being called now, outermost first, as the user named them
    ("model/block_1_expand_relu"), from Keras' name-scope stack
    (keras.src.backend.common.name_scope.current_path); "" outside a layer call or where Keras
    moved it."""
    try:
        from keras.src.backend.common.name_scope import current_path
        return current_path()
    except Exception:  # noqa: BLE001 - a description only
        return ""
