"""tf_relupool: fused ReLU + max pooling for TensorFlow, exact and lighter on memory."""
from tf_relupool._loader import OpLibraryError, load_library
from tf_relupool.ops import KEEP_ARGMAX, KEEP_INPUT, relu_max_pool2d

__all__ = ["KEEP_ARGMAX", "KEEP_INPUT", "OpLibraryError", "load_library", "relu_max_pool2d"]
__version__ = "0.1.0"
