// CPU OpKernels: validate, allocate, call the framework-free kernels. No math here.
#include <string>

#include "cc/kernels/relu_max_pool.h"
#include "cc/ops/pool_attrs.h"
#include "cc/ops/pool_op_base.h"
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
    OP_REQUIRES_OK(ctx, ArgmaxTypeFits<C>(p));
    Tensor *output = nullptr, *argmax = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, PooledShape(p), &output));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, PooledShape(p), &argmax));
    if (output->NumElements() == 0) return;
    ReluMaxPoolForwardWithArgmaxCpu(p, In<T>(input), Out<T>(output), argmax->flat<C>().data(),
                                    IntraOpRunner(ctx));
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
    TensorShape input_shape;
    PoolParams p;
    OP_REQUIRES_OK(ctx, (CompactGradParams<S, C>(ctx, &input_shape, &p)));
    const Tensor& grad = ctx->input(1);
    const Tensor& argmax = ctx->input(2);
    Tensor* input_grad = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, input_shape, &input_grad));
    if (input_grad->NumElements() == 0) return;
    const IntraOpRunner runner(ctx);
    const C* codes = argmax.flat<C>().data();
    const int64_t bad = FindInvalidArgmaxCpu(p, codes, runner);
    if (bad >= 0) return ctx->SetStatus(InvalidArgmaxError(bad, codes[bad]));
    ReluMaxPoolBackwardFromArgmaxCpu(p, In<T>(grad), codes, Out<T>(input_grad), runner);
  }
};

template <typename T, typename C>
class ReluMaxPoolGradGradFromWindowArgmaxOp : public PoolOpBase {
 public:
  using PoolOpBase::PoolOpBase;
  void Compute(OpKernelContext* ctx) override {
    PoolParams p;
    OP_REQUIRES_OK(ctx, GradGradParams<C>(ctx, &p));
    const Tensor& grad = ctx->input(0);
    const Tensor& argmax = ctx->input(1);
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, PooledShape(p), &output));
    if (output->NumElements() == 0) return;
    const IntraOpRunner runner(ctx);
    const C* codes = argmax.flat<C>().data();
    const int64_t bad = FindInvalidArgmaxCpu(p, codes, runner);
    if (bad >= 0) return ctx->SetStatus(InvalidArgmaxError(bad, codes[bad]));
    ReluMaxPoolGradGradFromArgmaxCpu(p, In<T>(grad), codes, Out<T>(output), runner);
  }
};

// The gradient reading the codes, for each type of its input_shape (Tshape).
#define REGISTER_GRAD_FROM_ARGMAX_CPU(T, C, S)                                             \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPoolGradFromWindowArgmax")                          \
                              .Device(DEVICE_CPU)                                          \
                              .TypeConstraint<T>("T")                                      \
                              .TypeConstraint<C>("Targmax")                                \
                              .TypeConstraint<S>("Tshape"),                                \
                          ReluMaxPoolGradFromWindowArgmaxOp<T, C, S>);

#define REGISTER_ARGMAX_CPU(T, C)                                                          \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPoolWithWindowArgmax")                              \
                              .Device(DEVICE_CPU)                                          \
                              .TypeConstraint<T>("T")                                      \
                              .TypeConstraint<C>("Targmax"),                               \
                          ReluMaxPoolWithWindowArgmaxOp<T, C>);                            \
  REGISTER_GRAD_FROM_ARGMAX_CPU(T, C, int32_t)                                             \
  REGISTER_GRAD_FROM_ARGMAX_CPU(T, C, int64_t)                                             \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPoolGradGradFromWindowArgmax")                      \
                              .Device(DEVICE_CPU)                                          \
                              .TypeConstraint<T>("T")                                      \
                              .TypeConstraint<C>("Targmax"),                               \
                          ReluMaxPoolGradGradFromWindowArgmaxOp<T, C>);

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
