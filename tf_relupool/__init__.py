"""tf_relupool: fused ReLU + max pooling for TensorFlow, exact and lighter on memory."""
import warnings as _warnings

import tensorflow as _tf

from tf_relupool import _versions

# A TensorFlow outside the tested range: a warning naming both versions, not a failure.
# The same for Keras 3, whose version is read without importing it.
for _message in (_versions.untested_message(_tf.__version__),
                 _versions.keras_untested_message(_versions.installed_keras() or "")):
    if _message:
        _warnings.warn(_message, RuntimeWarning, stacklevel=2)
from tf_relupool._loader import OpLibraryError, load_library
from tf_relupool.ops import KEEP_ARGMAX, KEEP_INPUT, relu_max_pool2d
from tf_relupool.config import (disable_recompute, enable_recompute, recompute,
                                recompute_enabled, recompute_mode)
from tf_relupool.layers import ReluMaxPool2D
from tf_relupool import keras_fusion, xla  # noqa: F401  (the switch and the fused op under XLA)
from tf_relupool.rewrite_graph import rewrite_function, rewrite_graph
from tf_relupool.rewrite_model import rewrite_model
from tf_relupool.saved_model import load_saved_model
from tf_relupool.report import FusionReport, fusion_report


__all__ = ["KEEP_ARGMAX", "KEEP_INPUT", "OpLibraryError", "load_library", "relu_max_pool2d",
           "ReluMaxPool2D", "disable_recompute", "enable_recompute", "recompute",
           "recompute_enabled", "recompute_mode", "rewrite_function", "rewrite_graph",
           "rewrite_model", "load_saved_model", "fusion_report", "FusionReport"]
__version__ = _versions.VERSION

# Register the ops at import, so that GraphDefs and SavedModels naming them load after
# `import tf_relupool`. A library that cannot load does not break the import: the same
# OpLibraryError, with its explanation, is raised at the first use of an op.
try:
    load_library()
except OpLibraryError:
    pass
