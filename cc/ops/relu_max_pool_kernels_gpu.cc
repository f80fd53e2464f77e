// GPU OpKernels: validate (the same ComputePoolParams as the CPU kernels), allocate, fill params,
// call the framework-free launchers of cc/kernels/relu_max_pool_gpu.h. No math here.
//
// Compiled into the op library only when setup.py finds nvcc (it then defines TF_RELUPOOL_CUDA);
// otherwise this file is empty and the library holds the CPU kernels alone.
//
// How the library reaches the CUDA runtime: the CUDA code is built by nvcc 13 and linked with the
// STATIC CUDA 13 runtime (libcudart_static.a), whose symbols are hidden in the library
// (-Wl,--exclude-libs,ALL; see setup.py). libtensorflow_framework.so.2 exports stand-ins for
// cudaLaunchKernel, __cudaRegisterFatBinary and friends that forward to TensorFlow's CUDA 12.5
// runtime; a dynamically linked -lcudart would bind to those, registering CUDA 13 fat binaries with
// a CUDA 12 runtime, which is not a supported pairing. With its own hidden static runtime the
// library is self-contained: it launches on TensorFlow's stream (a CUstream of the device's
// primary context, which TensorFlow and the CUDA runtime both use), needs no CUDA 12 toolkit, and
// needs a driver that supports CUDA 13 (>= 580). On an older driver every GPU op fails with the
// CUDA error text ("CUDA driver version is insufficient..."), never silently; the CPU kernels
// are unaffected, and a machine without a GPU loads the library normally.
//
// cuDNN (implementation='cudnn') is opened with dlopen at first use (relu_max_pool_cudnn.cu): it
// finds the libcudnn.so.9 that TensorFlow has already loaded. The handle is cached per device and
// bound to TensorFlow's stream (cudnnSetStream) on every call, under a per-device mutex.
#ifdef TF_RELUPOOL_CUDA

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cc/kernels/relu_max_pool.h"
#include "cc/kernels/relu_max_pool_gpu.h"
#include "cc/ops/pool_attrs.h"
#include "cc/ops/pool_op_base.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/env.h"
#include "tensorflow/core/platform/threadpool.h"
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"

namespace tf_relupool {
namespace {

using tensorflow::DEVICE_GPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

absl::Status CudaStatus(cudaError_t e, const char* op) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(op) + ": CUDA error " + cudaGetErrorName(e) + ": " +
                             cudaGetErrorString(e));
}
absl::Status CudnnStatus(const std::string& err, const char* op) {
  if (err.empty()) return absl::OkStatus();
  return absl::InternalError(std::string(op) + " (implementation='cudnn'): " + err);
}

// TensorFlow's CUDA stream for this op, with the CUDA runtime's current device set to the
// stream's device (the same primary context TensorFlow uses).
absl::Status GpuStream(OpKernelContext* ctx, cudaStream_t* stream, int* device) {
  auto* dc = ctx->op_device_context();
  stream_executor::Stream* s = dc != nullptr ? dc->stream() : nullptr;
  if (s == nullptr) return absl::InternalError("no GPU stream for this op");
  *stream = static_cast<cudaStream_t>(s->platform_specific_handle().stream);
  *device = s->parent()->device_ordinal();
  return CudaStatus(cudaSetDevice(*device), "cudaSetDevice");
}

// One cuDNN handle per device, created on first use; calls on a device are serialised because
// the handle's stream binding is shared state.
struct CudnnSlot {
  std::mutex mu;
  cudnnHandle_t handle = nullptr;
};
CudnnSlot* CudnnFor(int device) {
  static std::mutex mu;
  static auto* slots = new std::map<int, std::unique_ptr<CudnnSlot>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = (*slots)[device];
  if (!slot) slot.reset(new CudnnSlot);
  return slot.get();
}
absl::Status LockedCudnn(int device, std::unique_lock<std::mutex>* lock, cudnnHandle_t* handle) {
  CudnnSlot* slot = CudnnFor(device);
  *lock = std::unique_lock<std::mutex>(slot->mu);
  if (slot->handle == nullptr) {
    const std::string err = CudnnCreateHandle(&slot->handle);
    if (!err.empty()) {
      slot->handle = nullptr;
      return absl::InternalError("cuDNN handle (implementation='cudnn'): " + err);
    }
  }
  *handle = slot->handle;
  return absl::OkStatus();
}

// Adds the choice of implementation to the shared checks.
class GpuPoolOpBase : public PoolOpBase {
 public:
  explicit GpuPoolOpBase(OpKernelConstruction* ctx) : PoolOpBase(ctx) {
    std::string impl = "fused";
    if (ctx->HasAttr("implementation")) OP_REQUIRES_OK(ctx, ctx->GetAttr("implementation", &impl));
    use_cudnn_ = impl == "cudnn";
  }

 protected:
  // cuDNN only where it can express the geometry; elsewhere the fused kernels (same results).
  bool UseCudnn(const PoolParams& p) const { return use_cudnn_ && CudnnPathUnsupportedReason(p).empty(); }

  bool use_cudnn_ = false;
};

template <typename T>
class ReluMaxPoolGpuOp : public GpuPoolOpBase {
 public:
  using GpuPoolOpBase::GpuPoolOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    PoolParams p;
    OP_REQUIRES_OK(ctx, Params(input.shape(), nullptr, &p));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, PooledShape(p), &output));
    if (output->NumElements() == 0) return;
    cudaStream_t stream;
    int device;
    OP_REQUIRES_OK(ctx, GpuStream(ctx, &stream, &device));
    if (UseCudnn(p)) {
      Tensor temp;
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_UINT8,
                                             TensorShape({CudnnForwardTempBytes(p, sizeof(T))}), &temp));
      std::unique_lock<std::mutex> lock;
      cudnnHandle_t handle;
      OP_REQUIRES_OK(ctx, LockedCudnn(device, &lock, &handle));
      OP_REQUIRES_OK(ctx, CudnnStatus(ReluMaxPoolForwardCudnn(handle, stream, p, In<T>(input),
                                                              Out<T>(output), temp.flat<uint8_t>().data()),
                                      "ReluMaxPool"));
      return;
    }
    OP_REQUIRES_OK(ctx, CudaStatus(ReluMaxPoolForwardGpu(p, In<T>(input), Out<T>(output), stream),
                                   "ReluMaxPool"));
  }
};

template <typename T, typename C>
class ReluMaxPoolWithWindowArgmaxGpuOp : public GpuPoolOpBase {
 public:
  using GpuPoolOpBase::GpuPoolOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    PoolParams p;
    OP_REQUIRES_OK(ctx, Params(input.shape(), nullptr, &p));
    OP_REQUIRES_OK(ctx, ArgmaxTypeFits<C>(p));
    Tensor *output = nullptr, *argmax = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, PooledShape(p), &output));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, PooledShape(p), &argmax));
    if (output->NumElements() == 0) return;
    cudaStream_t stream;
    int device;
    OP_REQUIRES_OK(ctx, GpuStream(ctx, &stream, &device));
    // cuDNN has no window-argmax output: this op always runs the fused kernel.
    OP_REQUIRES_OK(ctx, CudaStatus(ReluMaxPoolForwardWithArgmaxGpu(p, In<T>(input), Out<T>(output),
                                                                   argmax->flat<C>().data(), stream),
                                   "ReluMaxPoolWithWindowArgmax"));
  }
};

template <typename T>
class ReluMaxPoolGradGpuOp : public GpuPoolOpBase {
 public:
  using GpuPoolOpBase::GpuPoolOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    const Tensor& grad = ctx->input(1);
    PoolParams p;
    OP_REQUIRES_OK(ctx, Params(input.shape(), &grad, &p));
    Tensor* input_grad = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, input.shape(), &input_grad));
    if (input_grad->NumElements() == 0) return;
    cudaStream_t stream;
    int device;
    OP_REQUIRES_OK(ctx, GpuStream(ctx, &stream, &device));
    if (UseCudnn(p) && p.out_elements() > 0) {
      Tensor temp;
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_UINT8,
                                             TensorShape({CudnnBackwardTempBytes(p, sizeof(T))}), &temp));
      std::unique_lock<std::mutex> lock;
      cudnnHandle_t handle;
      OP_REQUIRES_OK(ctx, LockedCudnn(device, &lock, &handle));
      OP_REQUIRES_OK(ctx, CudnnStatus(ReluMaxPoolBackwardCudnn(handle, stream, p, In<T>(input), In<T>(grad),
                                                               Out<T>(input_grad), temp.flat<uint8_t>().data()),
                                      "ReluMaxPoolGrad"));
      return;
    }
    Tensor workspace;
    const int64_t ws_bytes = BackwardFromInputWorkspaceBytes(p);
    if (ws_bytes > 0) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_UINT8, TensorShape({ws_bytes}), &workspace));
    }
    OP_REQUIRES_OK(ctx, CudaStatus(ReluMaxPoolBackwardFromInputGpu(
                                       p, In<T>(input), In<T>(grad), Out<T>(input_grad),
                                       ws_bytes > 0 ? workspace.flat<uint8_t>().data() : nullptr, stream),
                                   "ReluMaxPoolGrad"));
  }
};

// Where verdicts on window-argmax codes run (a host function may not call CUDA, so it hands the
// verdict over): a small pool of the library's own, instead of a new thread per verdict.
tensorflow::thread::ThreadPool* VerdictThreads() {
  static auto* pool = new tensorflow::thread::ThreadPool(tensorflow::Env::Default(),
                                                         "tf_relupool_argmax_verdict", 2);
  return pool;
}

// Ops that read window-argmax codes. Their kernels check every code as they read it and leave
// the smallest invalid flat index in device memory. With validate_window_argmax, that index is
// copied to pinned host memory on the op's stream and a host function queued behind the copy
// hands the verdict to a CPU thread, which sets the error (if any) and calls `done`: no thread
// ever waits for the GPU (CUDA forbids CUDA calls inside host functions, hence the hand-off).
// Without it the op is done as soon as its kernel is queued.
class ArgmaxReadingGpuOp : public PoolChecks<tensorflow::AsyncOpKernel> {
 public:
  using PoolChecks<tensorflow::AsyncOpKernel>::PoolChecks;

  // Without a report to wait for, the executor treats the op as a plain synchronous kernel (its
  // Compute runs ComputeAsync, which calls `done` before returning): the asynchronous path's
  // bookkeeping costs host time per op for nothing.
  tensorflow::AsyncOpKernel* AsAsync() override { return validate_window_argmax_ ? this : nullptr; }

 protected:
  // Allocates output 0 of `shape` and, unless it is empty, launch(output, first_bad, stream)
  // queues the kernel; first_bad is null when nothing is to be reported.
  template <typename C, typename Launch>
  void LaunchAndReport(OpKernelContext* ctx, const TensorShape& shape, const Tensor& codes,
                       const char* op, Launch launch, DoneCallback done) {
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, shape, &output), done);
    if (output->NumElements() == 0) return done();
    cudaStream_t stream;
    int device;
    OP_REQUIRES_OK_ASYNC(ctx, GpuStream(ctx, &stream, &device), done);
    if (!validate_window_argmax_) {
      OP_REQUIRES_OK_ASYNC(ctx, CudaStatus(launch(output, nullptr, stream), op), done);
      return done();
    }
    Tensor bad_dev, bad_host;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_temp(tensorflow::DT_UINT64, TensorShape({1}), &bad_dev),
                         done);
    tensorflow::AllocatorAttributes pinned;
    pinned.set_on_host(true);
    pinned.set_gpu_compatible(true);
    OP_REQUIRES_OK_ASYNC(
        ctx, ctx->allocate_temp(tensorflow::DT_UINT64, TensorShape({1}), &bad_host, pinned), done);
    auto* bad = reinterpret_cast<unsigned long long*>(bad_dev.flat<tensorflow::uint64>().data());
    auto* bad_h = reinterpret_cast<unsigned long long*>(bad_host.flat<tensorflow::uint64>().data());
    OP_REQUIRES_OK_ASYNC(ctx, CudaStatus(launch(output, bad, stream), op), done);
    OP_REQUIRES_OK_ASYNC(ctx, CudaStatus(cudaMemcpyAsync(bad_h, bad, sizeof(*bad_h),
                                                         cudaMemcpyDeviceToHost, stream), op),
                         done);
    // Tensors held until the verdict: the device buffers stay valid for the copy and the error
    // message's read of the offending code.
    struct Verdict {
      OpKernelContext* ctx;
      Tensor codes, bad_dev, bad_host;
      int device;
      const char* op;
      DoneCallback done;
    };
    auto* verdict = new Verdict{ctx, codes, bad_dev, bad_host, device, op, std::move(done)};
    const cudaError_t err = cudaLaunchHostFunc(
        stream,
        [](void* arg) {
          VerdictThreads()->Schedule([v = static_cast<Verdict*>(arg)] {
            const unsigned long long index =
                *reinterpret_cast<const unsigned long long*>(v->bad_host.tensor_data().data());
            if (index != ~0ull) {
              C code = 0;
              const cudaError_t e =
                  cudaSetDevice(v->device) != cudaSuccess
                      ? cudaGetLastError()
                      : cudaMemcpy(&code, v->codes.template flat<C>().data() + index, sizeof(C),
                                   cudaMemcpyDeviceToHost);
              v->ctx->SetStatus(e == cudaSuccess ? InvalidArgmaxError(static_cast<int64_t>(index), code)
                                                 : CudaStatus(e, v->op));
            }
            DoneCallback d = std::move(v->done);
            delete v;
            d();
          });
        },
        verdict);
    if (err != cudaSuccess) {
      DoneCallback d = std::move(verdict->done);
      delete verdict;
      ctx->SetStatus(CudaStatus(err, op));
      d();
    }
  }
};

template <typename T, typename C, typename S>
class ReluMaxPoolGradFromWindowArgmaxGpuOp : public ArgmaxReadingGpuOp {
 public:
  using ArgmaxReadingGpuOp::ArgmaxReadingGpuOp;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    TensorShape input_shape;  // input_shape is in host memory
    PoolParams p;
    OP_REQUIRES_OK_ASYNC(ctx, (CompactGradParams<S, C>(ctx, &input_shape, &p)), done);
    const Tensor& grad = ctx->input(1);
    const Tensor& argmax = ctx->input(2);
    LaunchAndReport<C>(
        ctx, input_shape, argmax, "ReluMaxPoolGradFromWindowArgmax",
        [&](Tensor* input_grad, unsigned long long* bad, cudaStream_t stream) {
          return ReluMaxPoolBackwardFromArgmaxGpu(p, In<T>(grad), argmax.flat<C>().data(),
                                                  Out<T>(input_grad), bad, stream);
        },
        std::move(done));
  }
};

template <typename T, typename C>
class ReluMaxPoolGradGradFromWindowArgmaxGpuOp : public ArgmaxReadingGpuOp {
 public:
  using ArgmaxReadingGpuOp::ArgmaxReadingGpuOp;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    PoolParams p;
    OP_REQUIRES_OK_ASYNC(ctx, GradGradParams<C>(ctx, &p), done);
    const Tensor& grad = ctx->input(0);
    const Tensor& argmax = ctx->input(1);
    LaunchAndReport<C>(
        ctx, PooledShape(p), argmax, "ReluMaxPoolGradGradFromWindowArgmax",
        [&](Tensor* output, unsigned long long* bad, cudaStream_t stream) {
          return ReluMaxPoolGradGradFromArgmaxGpu(p, In<T>(grad), argmax.flat<C>().data(),
                                                  Out<T>(output), bad, stream);
        },
        std::move(done));
  }
};

// The gradient reading the codes, for each type of its input_shape (Tshape).
#define REGISTER_GRAD_FROM_ARGMAX_GPU(T, C, S)                                          \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPoolGradFromWindowArgmax")                       \
                              .Device(DEVICE_GPU)                                       \
                              .HostMemory("input_shape")                                \
                              .TypeConstraint<T>("T")                                   \
                              .TypeConstraint<C>("Targmax")                             \
                              .TypeConstraint<S>("Tshape"),                             \
                          ReluMaxPoolGradFromWindowArgmaxGpuOp<T, C, S>);

// Targmax uint8 and uint16 only: TensorFlow keeps int32 tensors of GPU kernels in host memory,
// so int32 codes (windows of 65535 positions or more) run on the CPU kernels.
#define REGISTER_ARGMAX_GPU(T, C)                                                       \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPoolWithWindowArgmax")                           \
                              .Device(DEVICE_GPU)                                       \
                              .TypeConstraint<T>("T")                                   \
                              .TypeConstraint<C>("Targmax"),                            \
                          ReluMaxPoolWithWindowArgmaxGpuOp<T, C>);                      \
  REGISTER_GRAD_FROM_ARGMAX_GPU(T, C, int32_t)                                          \
  REGISTER_GRAD_FROM_ARGMAX_GPU(T, C, int64_t)                                          \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPoolGradGradFromWindowArgmax")                   \
                              .Device(DEVICE_GPU)                                       \
                              .TypeConstraint<T>("T")                                   \
                              .TypeConstraint<C>("Targmax"),                            \
                          ReluMaxPoolGradGradFromWindowArgmaxGpuOp<T, C>);

#define REGISTER_GPU(T)                                                                        \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPool").Device(DEVICE_GPU).TypeConstraint<T>("T"),       \
                          ReluMaxPoolGpuOp<T>);                                                \
  REGISTER_KERNEL_BUILDER(Name("ReluMaxPoolGrad").Device(DEVICE_GPU).TypeConstraint<T>("T"),   \
                          ReluMaxPoolGradGpuOp<T>);                                            \
  REGISTER_ARGMAX_GPU(T, uint8_t)                                                              \
  REGISTER_ARGMAX_GPU(T, uint16_t)

REGISTER_GPU(Eigen::half)
REGISTER_GPU(Eigen::bfloat16)
REGISTER_GPU(float)
REGISTER_GPU(double)

}  // namespace
}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CUDA
