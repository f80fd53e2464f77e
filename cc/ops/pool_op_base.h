// What the CPU and GPU OpKernels share: type mapping to the kernels' value types, and one base
// class holding every input check (attributes once, in the constructor; shapes, input_shape and
// window_argmax per call). Written once so the devices cannot drift apart.
#ifndef TF_RELUPOOL_CC_OPS_POOL_OP_BASE_H_
#define TF_RELUPOOL_CC_OPS_POOL_OP_BASE_H_

#include <string>
#include <vector>

#include "cc/kernels/relu_max_pool.h"
#include "cc/ops/pool_attrs.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"

namespace tf_relupool {

// TensorFlow's element types to the kernels' types of the same layout.
template <typename T>
struct KernelType {
  using type = T;
};
template <>
struct KernelType<Eigen::half> {
  using type = Half;
};
template <>
struct KernelType<Eigen::bfloat16> {
  using type = BFloat16;
};
template <typename T>
using K = typename KernelType<T>::type;

template <typename T>
const K<T>* In(const tensorflow::Tensor& t) {
  return reinterpret_cast<const K<T>*>(t.flat<T>().data());
}
template <typename T>
K<T>* Out(tensorflow::Tensor* t) {
  return reinterpret_cast<K<T>*>(t->flat<T>().data());
}

// The error for window_argmax[index] == code, a code outside its window.
template <typename C>
absl::Status InvalidArgmaxError(int64_t index, C code) {
  return absl::InvalidArgumentError(
      "window_argmax[" + std::to_string(index) + "] = " +
      std::to_string(static_cast<int64_t>(code)) +
      " is not a position inside its pooling window (nor the 'no gradient' code " +
      std::to_string(static_cast<int64_t>(ArgmaxSentinel<C>())) +
      "); window_argmax must come from ReluMaxPoolWithWindowArgmax with the same attributes");
}

// Kernel is tensorflow::OpKernel or tensorflow::AsyncOpKernel.
template <class Kernel>
class PoolChecks : public Kernel {
 public:
  explicit PoolChecks(tensorflow::OpKernelConstruction* ctx) : Kernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadPoolAttrs(ctx, &attrs_));
    if (ctx->HasAttr("validate_window_argmax")) {
      OP_REQUIRES_OK(ctx, ctx->GetAttr("validate_window_argmax", &validate_window_argmax_));
    }
  }

 protected:
  // Params for `input`, and checks that `grad` (if given) has the pooled shape.
  absl::Status Params(const tensorflow::TensorShape& input, const tensorflow::Tensor* grad,
                      PoolParams* p) const {
    TF_RETURN_IF_ERROR(MakePoolParams(attrs_, input, p));
    if (grad != nullptr && grad->shape() != PooledShape(*p)) {
      return absl::InvalidArgumentError("grad must have the pooled output's shape " +
                                        PooledShape(*p).DebugString() + " for input shape " +
                                        input.DebugString() + ", got " +
                                        grad->shape().DebugString());
    }
    return absl::OkStatus();
  }

  // Checks that codes of type C can name every position of this geometry's windows.
  template <typename C>
  static absl::Status ArgmaxTypeFits(const PoolParams& p) {
    const std::string err = CheckArgmaxType<C>(
        p, tensorflow::DataTypeString(tensorflow::DataTypeToEnum<C>::v()).c_str());
    return err.empty() ? absl::OkStatus() : absl::InvalidArgumentError(err);
  }

  // The inputs of ReluMaxPoolGradFromWindowArgmax (input_shape of type S, grad, window_argmax of
  // type C): checks them all and gives the input's shape and the geometry.
  template <typename S, typename C>
  absl::Status CompactGradParams(tensorflow::OpKernelContext* ctx,
                                 tensorflow::TensorShape* input_shape, PoolParams* p) const {
    const tensorflow::Tensor& shape_t = ctx->input(0);
    const tensorflow::Tensor& grad = ctx->input(1);
    const tensorflow::Tensor& argmax = ctx->input(2);
    if (shape_t.dims() != 1 || shape_t.NumElements() != 4) {
      return absl::InvalidArgumentError("input_shape must be a 1-D tensor of 4 elements, got shape " +
                                        shape_t.shape().DebugString());
    }
    const auto dims = shape_t.vec<S>();
    const std::vector<int64_t> dims64(dims.data(), dims.data() + 4);
    const absl::Status shape_ok = tensorflow::TensorShape::BuildTensorShape(dims64, input_shape);
    if (!shape_ok.ok()) {
      return absl::InvalidArgumentError("input_shape is not a valid shape: " +
                                        std::string(shape_ok.message()));
    }
    TF_RETURN_IF_ERROR(Params(*input_shape, &grad, p));
    if (argmax.shape() != grad.shape()) {
      return absl::InvalidArgumentError("window_argmax must have grad's shape " +
                                        grad.shape().DebugString() + ", got " +
                                        argmax.shape().DebugString());
    }
    return ArgmaxTypeFits<C>(*p);
  }

  // The inputs of ReluMaxPoolGradGradFromWindowArgmax (grad of the input's shape, window_argmax
  // of type C and the pooled shape): checks them and gives the geometry.
  template <typename C>
  absl::Status GradGradParams(tensorflow::OpKernelContext* ctx, PoolParams* p) const {
    const tensorflow::Tensor& grad = ctx->input(0);
    const tensorflow::Tensor& argmax = ctx->input(1);
    TF_RETURN_IF_ERROR(Params(grad.shape(), nullptr, p));
    if (argmax.shape() != PooledShape(*p)) {
      return absl::InvalidArgumentError("window_argmax must have the pooled shape " +
                                        PooledShape(*p).DebugString() + " for grad of shape " +
                                        grad.shape().DebugString() + ", got " +
                                        argmax.shape().DebugString());
    }
    return ArgmaxTypeFits<C>(*p);
  }

  PoolAttrs attrs_;
  // Whether the GPU kernels report invalid codes (see REGISTER_OP); the CPU kernels always do.
  bool validate_window_argmax_ = true;
};
using PoolOpBase = PoolChecks<tensorflow::OpKernel>;

}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_OPS_POOL_OP_BASE_H_
