// CPU OpKernels: validate, allocate, call the framework-free kernels. No math here.
#include <string>

#include "cc/kernels/relu_max_pool.h"
#include "cc/ops/pool_attrs.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tf_relupool {
namespace {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

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
const K<T>* In(const Tensor& t) {
  return reinterpret_cast<const K<T>*>(t.flat<T>().data());
}
template <typename T>
K<T>* Out(Tensor* t) {
  return reinterpret_cast<K<T>*>(t->flat<T>().data());
}

// TensorFlow's intra-op thread pool.
class IntraOpRunner : public ParallelRunner {
 public:
  explicit IntraOpRunner(OpKernelContext* ctx)
      : pool_(ctx->device()->tensorflow_cpu_worker_threads()->workers) {}
  void For(int64_t total, int64_t cost_per_unit,
           const std::function<void(int64_t, int64_t)>& fn) const override {
    if (total > 0) pool_->ParallelFor(total, cost_per_unit, fn);
  }

 private:
  tensorflow::thread::ThreadPool* pool_;
};

std::string ShapeStr(const TensorShape& s) { return s.DebugString(); }

// Base: reads and checks the pooling attributes once, in the constructor.
class PoolOpBase : public OpKernel {
 public:
  explicit PoolOpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadPoolAttrs(ctx, &attrs_));
  }

 protected:
  // Params for `input`, and checks that `grad` (if given) has the pooled shape.
  absl::Status Params(const TensorShape& input, const Tensor* grad, PoolParams* p) const {
    TF_RETURN_IF_ERROR(MakePoolParams(attrs_, input, p));
    if (grad != nullptr && grad->shape() != PooledShape(*p)) {
      return absl::InvalidArgumentError("grad must have the pooled output's shape " +
                                        ShapeStr(PooledShape(*p)) + " for input shape " +
                                        ShapeStr(input) + ", got " + ShapeStr(grad->shape()));
    }
    return absl::OkStatus();
  }
  PoolAttrs attrs_;
};

template <typename T>
class ReluMaxPoolOp : public PoolOpBase {
 public:
  using PoolOpBase::PoolOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    PoolParams p;
    OP_REQUIRES_OK(ctx, Params(input.shape(), nullptr, &p));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, PooledShape(p), &output));
    if (output->NumElements() == 0) return;
    ReluMaxPoolForwardCpu(p, In<T>(input), Out<T>(output), IntraOpRunner(ctx));
  }
};

template <typename T, typename C>
class ReluMaxPoolWithWindowArgmaxOp : public PoolOpBase {
 public:
  using PoolOpBase::PoolOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    PoolParams p;
    OP_REQUIRES_OK(ctx, Params(input.shape(), nullptr, &p));
    OP_REQUIRES_OK(ctx, ArgmaxTypeFits(p));
    Tensor *output = nullptr, *argmax = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, PooledShape(p), &output));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, PooledShape(p), &argmax));
    if (output->NumElements() == 0) return;
    ReluMaxPoolForwardWithArgmaxCpu(p, In<T>(input), Out<T>(output), argmax->flat<C>().data(),
                                    IntraOpRunner(ctx));
  }

  static absl::Status ArgmaxTypeFits(const PoolParams& p) {
    const std::string err =
        CheckArgmaxType<C>(p, tensorflow::DataTypeString(tensorflow::DataTypeToEnum<C>::v()).c_str());
    return err.empty() ? absl::OkStatus() : absl::InvalidArgumentError(err);
  }
};

template <typename T>
class ReluMaxPoolGradOp : public PoolOpBase {
 public:
  using PoolOpBase::PoolOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    const Tensor& grad = ctx->input(1);
    PoolParams p;
    OP_REQUIRES_OK(ctx, Params(input.shape(), &grad, &p));
    Tensor* input_grad = nullptr;
    // A fresh buffer: the kernels read grad while writing input_grad, so the two must not alias
    // (they could when stride 1 SAME makes the shapes equal).
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, input.shape(), &input_grad));
    if (input_grad->NumElements() == 0) return;
    Tensor workspace;
    const int64_t ws_bytes = BackwardFromInputWorkspaceBytes(p);
    if (ws_bytes > 0) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_UINT8, TensorShape({ws_bytes}), &workspace));
    }
    ReluMaxPoolBackwardFromInputCpu(p, In<T>(input), In<T>(grad), Out<T>(input_grad),
                                    ws_bytes > 0 ? workspace.flat<uint8_t>().data() : nullptr,
                                    IntraOpRunner(ctx));
  }
};

template <typename T, typename C, typename S>
class ReluMaxPoolGradFromWindowArgmaxOp : public PoolOpBase {
 public:
  using PoolOpBase::PoolOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& shape_t = ctx->input(0);
    const Tensor& grad = ctx->input(1);
    const Tensor& argmax = ctx->input(2);
    OP_REQUIRES(ctx, shape_t.dims() == 1 && shape_t.NumElements() == 4,
                absl::InvalidArgumentError("input_shape must be a 1-D tensor of 4 elements, got shape " +
                                           ShapeStr(shape_t.shape())));
    TensorShape input_shape;
    const auto dims = shape_t.vec<S>();
    const std::vector<int64_t> dims64(dims.data(), dims.data() + 4);
    const absl::Status shape_ok = TensorShape::BuildTensorShape(dims64, &input_shape);
    OP_REQUIRES(ctx, shape_ok.ok(),
                absl::InvalidArgumentError("input_shape is not a valid shape: " +
                                           std::string(shape_ok.message())));
    PoolParams p;
    OP_REQUIRES_OK(ctx, Params(input_shape, &grad, &p));
    OP_REQUIRES(ctx, argmax.shape() == grad.shape(),
                absl::InvalidArgumentError("window_argmax must have grad's shape " +
                                           ShapeStr(grad.shape()) + ", got " + ShapeStr(argmax.shape())));
    OP_REQUIRES_OK(ctx, ReluMaxPoolWithWindowArgmaxOp<T, C>::ArgmaxTypeFits(p));
    Tensor* input_grad = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, input_shape, &input_grad));
    if (input_grad->NumElements() == 0) return;
    const IntraOpRunner runner(ctx);
    const C* codes = argmax.flat<C>().data();
    const int64_t bad = FindInvalidArgmaxCpu(p, codes, runner);
    OP_REQUIRES(ctx, bad < 0,
                absl::InvalidArgumentError(
                    "window_argmax[" + std::to_string(bad) + "] = " +
                    std::to_string(static_cast<int64_t>(bad >= 0 ? codes[bad] : 0)) +
                    " is not a position inside its pooling window (nor the 'no gradient' code " +
                    std::to_string(static_cast<int64_t>(ArgmaxSentinel<C>())) +
                    "); window_argmax must come from ReluMaxPoolWithWindowArgmax with the same attributes"));
    ReluMaxPoolBackwardFromArgmaxCpu(p, In<T>(grad), codes, Out<T>(input_grad), runner);
  }
};

#define REGISTER_ARGMAX_CPU(T, C)                                                         \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPoolWithWindowArgmax")                              \
                              .Device(DEVICE_CPU)                                          \
                              .TypeConstraint<T>("T")                                      \
                              .TypeConstraint<C>("Targmax"),                               \
                          ReluMaxPoolWithWindowArgmaxOp<T, C>);                            \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPoolGradFromWindowArgmax")                          \
                              .Device(DEVICE_CPU)                                          \
                              .TypeConstraint<T>("T")                                      \
                              .TypeConstraint<C>("Targmax")                                \
                              .TypeConstraint<int32_t>("Tshape"),                          \
                          ReluMaxPoolGradFromWindowArgmaxOp<T, C, int32_t>);               \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPoolGradFromWindowArgmax")                          \
                              .Device(DEVICE_CPU)                                          \
                              .TypeConstraint<T>("T")                                      \
                              .TypeConstraint<C>("Targmax")                                \
                              .TypeConstraint<int64_t>("Tshape"),                          \
                          ReluMaxPoolGradFromWindowArgmaxOp<T, C, int64_t>);

#define REGISTER_CPU(T)                                                                          \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPool").Device(DEVICE_CPU).TypeConstraint<T>("T"),         \
                          ReluMaxPoolOp<T>);                                                     \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPoolGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),     \
                          ReluMaxPoolGradOp<T>);                                                 \
  REGISTER_ARGMAX_CPU(T, uint8_t)                                                                \
  REGISTER_ARGMAX_CPU(T, uint16_t)                                                               \
  REGISTER_ARGMAX_CPU(T, int32_t)

REGISTER_CPU(Eigen::half)
REGISTER_CPU(Eigen::bfloat16)
REGISTER_CPU(float)
REGISTER_CPU(double)

}  // namespace
}  // namespace tf_relupool
