"""What the activation recomputation covers, as data (tf_relupool/segments.py is the mechanism).

A *segment* is a chain of elementwise ops and per-channel broadcasts that starts at tensors kept
anyway (a BatchNormalization's input with its per-channel `inv`/`shift`, an `Add`'s kept
shortcut, an SE gate) and whose output is recomputed in the backward pass instead of being kept.
Three tables say what it is made of; adding a case is a row here and its test in
tests/test_segments.py.

- ACTIVATIONS: the elementwise functions a segment applies, one row per Keras entry point (its
  TensorFlow backend's `nn` function, or an activation class's `static_call`; every Keras form
  reaches one: the layer, the activation string and the function). `monotone`: non-decreasing,
  so that max(f(z)) = f(max(z)) (a max pool after it could pool first). `hold`: the backward's
  recomputation of the activation's input runs behind the barrier, so that XLA cannot merge it
  with the forward's copy; needed where the activation's gradient reads a value XLA would
  otherwise keep from the forward (a sigmoid or tanh inside it, which XLA does not duplicate
  into two fusions), and left off for the ReLU family, whose gradient XLA fuses from the BN
  input by itself (a barrier there changed that fusion and the bits). `reads_input`: stock's
  gradient reads the activation's input, so that input is kept anyway and a segment can start
  at it whatever made it (PRODUCERS' identity: ConvNeXt's Dense -> GELU -> Dense, a
  Conv2D(activation="swish")), keeping it alone instead of it and the output.
- COMPOSITES: activations written from separate ops as x * h(x) (Keras 2's hard swish), one
  row per chain of ops from x to h(x).
- PRODUCERS: what a segment starts from.
- CONSUMERS: the Keras backend functions whose gradient would keep a segment's output: their
  backward recomputes it from the segment's kept inputs. Ops whose gradient reads none of their
  inputs (KEEP_NOTHING) need no hook. `recompute`: the recompute_plan.COSTS row of
  recomputing the function's output where `memory_budget` below 1 may recompute it
  (conv_recompute's blocks), None where it may not (yet).
"""
import collections

Activation = collections.namedtuple("Activation", "name owner attr monotone hold reads_input")
Consumer = collections.namedtuple("Consumer", "name owner attr layers recompute")
Producer = collections.namedtuple("Producer", "name how")

#: owner: "nn" is keras.src.backend.tensorflow.nn, "numpy" its numpy module; "ReLU" and "Mish"
#: are the classes of keras.src.activations.activations (their static_call). Rows whose attribute
#: a Keras version lacks are skipped there.
ACTIVATIONS = (
    # ReLU(max_value, negative_slope, threshold), keras.activations.relu(x, ...), "relu"
    Activation("relu", "ReLU", "static_call", True, True, False),
    Activation("relu", "nn", "relu", True, True, False),            # keras.ops.relu
    Activation("relu6", "nn", "relu6", True, True, False),          # ReLU(6.), "relu6"
    Activation("leaky_relu", "nn", "leaky_relu", True, True, True),  # LeakyReLU, "leaky_relu"
    Activation("elu", "nn", "elu", True, False, False),               # ELU, "elu"
    Activation("selu", "nn", "selu", True, False, False),             # "selu"
    Activation("silu", "nn", "silu", False, False, True),             # "silu", "swish"
    Activation("gelu", "nn", "gelu", False, False, True),  # "gelu", exact and approximate
    Activation("hard_sigmoid", "nn", "hard_sigmoid", True, True, False),  # "hard_sigmoid"
    Activation("hard_silu", "nn", "hard_silu", False, True, True),  # "hard_silu", "hard_swish"
    Activation("sigmoid", "nn", "sigmoid", True, False, False),       # "sigmoid"
    Activation("tanh", "numpy", "tanh", True, False, False),          # "tanh", keras.ops.tanh
    Activation("tanh", "nn", "tanh", True, False, False),
    Activation("softplus", "nn", "softplus", True, False, True),      # "softplus"
    Activation("mish", "Mish", "static_call", False, False, True),    # "mish"
)

PRODUCERS = (
    Producer("batch_norm", "BatchNormalization (training): y = z * inv + shift, registered from "
             "stock's traced ops; under mixed precision y = cast(z32 * inv + shift)"),
    Producer("add", "an Add of a registered BN output and a tensor of the same shape (a kept "
             "shortcut, or a second BN output: a projection shortcut)"),
    Producer("segment", "another segment's output (an activation of an activation)"),
    Producer("identity", "any other full-size input of an activation whose gradient reads its "
             "input (ACTIVATIONS' reads_input): the input is kept anyway, the output recomputed "
             "from it"),
    Producer("gate", "a segment's output times a per-channel gate (squeeze-and-excitation: "
             "x * gate, the gate of shape [N, 1, 1, C]); the gate is kept, x recomputed"),
)

#: owner "nn": keras.src.backend.tensorflow.nn; "numpy": keras.src.backend.tensorflow.numpy.
#: The segment's output is the function's first argument.
CONSUMERS = (
    Consumer("conv", "nn", "conv", "Conv1D, Conv2D, Conv3D", "conv"),
    Consumer("depthwise_conv", "nn", "depthwise_conv", "DepthwiseConv1D, DepthwiseConv2D",
             "depthwise_conv"),
    Consumer("separable_conv", "nn", "separable_conv", "SeparableConv1D, SeparableConv2D", None),
    Consumer("conv_transpose", "nn", "conv_transpose", "Conv1DTranspose, Conv2DTranspose, "
             "Conv3DTranspose", None),
    Consumer("matmul", "numpy", "matmul", "Dense (ConvNeXt's MLP), EinsumDense excluded", None),
)

Extender = collections.namedtuple("Extender", "name owner attr layers")

#: ops that continue a segment: their output is the segment's too, recomputed with it
EXTENDERS = (
    Extender("gate", "numpy", "multiply", "Multiply, ops.multiply: x * gate (PRODUCERS' gate)"),
    Extender("zero_pad", "numpy", "pad", "ZeroPadding1D/2D/3D, ops.pad with zeros "
             "(before a strided depthwise conv: MobileNet's, EfficientNet's); not after a plain "
             "ReLU, where ReLU -> pad -> max pool is the pool fusion's pattern"),
)

Composite = collections.namedtuple("Composite", "name chain")

#: activations written from separate ops as x * h(x), h an elementwise chain of scalar-constant
#: steps: `chain` is h's op types from x on. The product becomes one segment of the activation
#: (its G replays stock's ops: the same op types, constants and operand order).
COMPOSITES = (
    # MobileNetV3's hard swish in Keras 2's form: x * ReLU(6.)(x + 3.) * (1. / 6.), or / 6.
    Composite("hard_silu", ("AddV2", "Relu6", "Mul")),
    Composite("hard_silu", ("AddV2", "Relu6", "RealDiv")),
)

#: op types whose gradient reads none of their inputs' values: a segment output they read is not
#: kept for them (Add: a residual sum; Mean: global average pooling)
KEEP_NOTHING = frozenset({"AddV2", "Add", "Mean", "Shape", "ShapeN", "Size", "Rank"})
