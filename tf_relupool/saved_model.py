"""Loading SavedModels that contain tf_relupool's ops.

A SavedModel stores op *names*; TensorFlow can only load it in a process where those ops are
registered, i.e. after `import tf_relupool` (which loads the op library). In a process that never
imports tf_relupool, nothing of tf_relupool runs, so TensorFlow's own error is all that can be
raised there: "Op type not registered 'ReluMaxPoolWithWindowArgmax' ...". `load_saved_model`
registers the ops first, and turns that error into one that names the fix if an op is still
missing (for example because the op library failed to load).
"""
import re

import tensorflow as tf

from tf_relupool._loader import OpLibraryError, load_library

# Every op of cc/ops/relu_max_pool_ops.cc: a function that differentiates twice through
# keep="argmax" holds the second-order one (tests/test_saved_model.py).
OP_NAMES = ("ReluMaxPool", "ReluMaxPoolGrad", "ReluMaxPoolWithWindowArgmax",
            "ReluMaxPoolGradFromWindowArgmax", "ReluMaxPoolGradGradFromWindowArgmax")
_NOT_REGISTERED = re.compile(r"Op type not registered '([^']+)'")


def missing_op_message(error):
    """If `error` is TensorFlow's "Op type not registered" for one of our ops, a message saying
    to import tf_relupool; else None."""
    match = _NOT_REGISTERED.search(str(error))
    if match is None or match.group(1) not in OP_NAMES:
        return None
    return (f"This SavedModel uses tf_relupool's op {match.group(1)!r}: `import tf_relupool` "
            "(or call tf_relupool.load_library()) before loading it, or load it with "
            f"tf_relupool.load_saved_model(). TensorFlow said: {error}")


def load_saved_model(export_dir, tags=None, options=None):
    """`tf.saved_model.load` after registering tf_relupool's ops.

    Args: as for `tf.saved_model.load`.

    Returns:
      The loaded object; its functions run the fused ops (with their registered gradients).

    Raises:
      OpLibraryError: the op library cannot be loaded, or the SavedModel still names one of
        tf_relupool's ops that is not registered; the message says what to do.
    """
    load_library()
    try:
        return tf.saved_model.load(export_dir, tags=tags, options=options)
    except (RuntimeError, tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
        message = missing_op_message(e)
        if message is None:
            raise
        raise OpLibraryError(message) from e
