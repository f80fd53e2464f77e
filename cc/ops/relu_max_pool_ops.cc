// Op registrations and shape functions.
#include "cc/ops/pool_attrs.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_relupool {
namespace {

using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

// Pooled shape of a 4-D input shape handle (unknown dimensions stay unknown).
absl::Status PooledShapeOf(InferenceContext* c, const PoolAttrs& attrs, ShapeHandle input,
                           ShapeHandle* out) {
  TF_RETURN_IF_ERROR(c->WithRank(input, 4, &input));
  const bool nhwc = attrs.format == DataFormat::kNHWC;
  const int h = nhwc ? 1 : 2, w = nhwc ? 2 : 3;
  const bool explicit_pads = attrs.padding == Padding::kExplicit;
  auto pooled = [&](int d) -> DimensionHandle {
    const DimensionHandle in = c->Dim(input, d);
    if (!c->ValueKnown(in)) return c->UnknownDim();
    return c->MakeDim(PooledSize(c->Value(in), attrs.ksize[d], attrs.strides[d], attrs.padding,
                                 explicit_pads ? attrs.explicit_paddings[2 * d] : 0,
                                 explicit_pads ? attrs.explicit_paddings[2 * d + 1] : 0));
  };
  std::vector<DimensionHandle> dims = {c->Dim(input, 0), c->Dim(input, 1), c->Dim(input, 2),
                                       c->Dim(input, 3)};
  dims[h] = pooled(h);
  dims[w] = pooled(w);
  *out = c->MakeShape(dims);
  return absl::OkStatus();
}

absl::Status ForwardShape(InferenceContext* c) {
  PoolAttrs attrs;
  TF_RETURN_IF_ERROR(ReadPoolAttrs(c, &attrs));
  ShapeHandle out;
  TF_RETURN_IF_ERROR(PooledShapeOf(c, attrs, c->input(0), &out));
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, out);
  return absl::OkStatus();
}

// input_grad has the input's shape; grad must have the pooled shape.
absl::Status GradShape(InferenceContext* c) {
  PoolAttrs attrs;
  TF_RETURN_IF_ERROR(ReadPoolAttrs(c, &attrs));
  ShapeHandle pooled, grad;
  TF_RETURN_IF_ERROR(PooledShapeOf(c, attrs, c->input(0), &pooled));
  TF_RETURN_IF_ERROR(c->Merge(c->input(1), pooled, &grad));
  c->set_output(0, c->input(0));
  return absl::OkStatus();
}

absl::Status GradFromArgmaxShape(InferenceContext* c) {
  PoolAttrs attrs;
  TF_RETURN_IF_ERROR(ReadPoolAttrs(c, &attrs));
  ShapeHandle input, pooled, merged;
  TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(0, &input));
  TF_RETURN_IF_ERROR(c->WithRank(input, 4, &input));
  TF_RETURN_IF_ERROR(PooledShapeOf(c, attrs, input, &pooled));
  TF_RETURN_IF_ERROR(c->Merge(c->input(1), pooled, &merged));
  TF_RETURN_IF_ERROR(c->Merge(c->input(2), merged, &merged));
  c->set_output(0, input);
  return absl::OkStatus();
}

// ReluMaxPoolGradGradFromWindowArgmax: grad has the input's shape; the output and window_argmax
// have the pooled shape.
absl::Status GradGradFromArgmaxShape(InferenceContext* c) {
  PoolAttrs attrs;
  TF_RETURN_IF_ERROR(ReadPoolAttrs(c, &attrs));
  ShapeHandle pooled;
  TF_RETURN_IF_ERROR(PooledShapeOf(c, attrs, c->input(0), &pooled));
  TF_RETURN_IF_ERROR(c->Merge(c->input(1), pooled, &pooled));
  c->set_output(0, pooled);
  return absl::OkStatus();
}

}  // namespace

// `padding` and `explicit_paddings` are MaxPool's: with 'EXPLICIT', explicit_paddings holds
// (before, after) for each dimension in data_format order, zero for batch and channels, each
// spatial one smaller than the window along it.
//
// `implementation` chooses the GPU kernels: 'fused' (default) runs the single-pass CUDA kernels;
// 'cudnn' runs ReLU into a temporary buffer, then cuDNN pooling (the seed's path), for ReluMaxPool
// and ReluMaxPoolGrad only; the window-argmax ops have no cuDNN equivalent and always run fused,
// as does any geometry cuDNN's symmetric padding cannot express. CPU kernels ignore it.
//
// `validate_window_argmax` (ops reading codes): every kernel bounds-checks every code, so an
// invalid code can never cause an out-of-bounds access. With true (default) an invalid code is
// reported as InvalidArgumentError; the GPU kernels do it without blocking any thread (the op
// completes when a host function queued behind the check has read the result). With false the
// GPU kernels skip that report and the op completes at once, reading an invalid code as 'no
// gradient': the registered gradients set it, because their codes come straight from
// ReluMaxPoolWithWindowArgmax, which writes only valid ones. The CPU kernels always report.
REGISTER_OP("ReluMaxPool")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("ksize: list(int)")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")
    .Attr("implementation: {'fused', 'cudnn'} = 'fused'")  // GPU only, see above
    .SetShapeFn(ForwardShape)
    .Doc(R"doc(output = max_pool(relu(input)), bitwise equal to MaxPool(Relu(input)).)doc");

REGISTER_OP("ReluMaxPoolGrad")
    .Input("input: T")
    .Input("grad: T")
    .Output("input_grad: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("ksize: list(int)")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")
    .Attr("implementation: {'fused', 'cudnn'} = 'fused'")  // GPU only, see above
    .SetShapeFn(GradShape)
    .Doc(R"doc(Gradient of ReluMaxPool with respect to its input, recomputed from the input:
bitwise equal to ReluGrad(MaxPoolGrad(relu(input), output, grad), relu(input)).)doc");

REGISTER_OP("ReluMaxPoolWithWindowArgmax")
    .Input("input: T")
    .Output("output: T")
    .Output("window_argmax: Targmax")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Targmax: {uint8, uint16, int32} = DT_UINT8")
    .Attr("ksize: list(int)")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")
    .Attr("implementation: {'fused', 'cudnn'} = 'fused'")  // GPU only, see above
    .SetShapeFn(ForwardShape)
    .Doc(R"doc(ReluMaxPool plus, per pooled element, the row-major position of the gradient
within its window clipped to the input (row pitch min(window cols, input cols)), or the largest
value of Targmax when the window's maximum is not positive.)doc");

REGISTER_OP("ReluMaxPoolGradFromWindowArgmax")
    .Input("input_shape: Tshape")
    .Input("grad: T")
    .Input("window_argmax: Targmax")
    .Output("input_grad: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Targmax: {uint8, uint16, int32} = DT_UINT8")
    .Attr("Tshape: {int32, int64} = DT_INT32")
    .Attr("ksize: list(int)")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")
    .Attr("implementation: {'fused', 'cudnn'} = 'fused'")  // GPU only, see above
    .Attr("validate_window_argmax: bool = true")          // GPU only, see above
    .SetShapeFn(GradFromArgmaxShape)
    .Doc(R"doc(Gradient of ReluMaxPoolWithWindowArgmax from grad and window_argmax alone.)doc");

// Second order, for both gradient ops: their gradient with respect to their `grad` input.
REGISTER_OP("ReluMaxPoolGradGradFromWindowArgmax")
    .Input("grad: T")
    .Input("window_argmax: Targmax")
    .Output("output: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Targmax: {uint8, uint16, int32} = DT_UINT8")
    .Attr("ksize: list(int)")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")
    .Attr("implementation: {'fused', 'cudnn'} = 'fused'")  // ignored: always the fused kernels
    .Attr("validate_window_argmax: bool = true")          // GPU only, see above
    .SetShapeFn(GradGradFromArgmaxShape)
    .Doc(R"doc(Gradient of ReluMaxPoolGradFromWindowArgmax (and of ReluMaxPoolGrad) with respect
to their pooled `grad` input: for a gradient `grad` of the input's shape, output[o] = grad[p] * m,
where p is the position window_argmax[o] names (m = 1) or, for the 'no gradient' code, the
window's first in-bounds position (m = 0). Bitwise equal to
MaxPoolGradGrad(relu(x), y, ReluGrad(grad, relu(x))) for windows without NaN.)doc");

}  // namespace tf_relupool
