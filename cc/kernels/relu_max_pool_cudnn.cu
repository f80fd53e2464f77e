// The cuDNN path (the seed's implementation): ReLU into a temporary buffer, then
// cudnnPoolingForward / cudnnPoolingBackward in CUDNN_POOLING_MAX_DETERMINISTIC mode, then the
// ReluGrad mask. Framework-free; see relu_max_pool_gpu.h for what it matches.
//
// cuDNN is opened with dlopen on first use instead of being linked: a library linked against
// libcudnn.so.9 would fail to load on machines without cuDNN (CPU-only CI), and TensorFlow itself
// dlopens the cuDNN of its pip dependencies, which this then finds already loaded.
#include <cudnn.h>
#include <dlfcn.h>

#include <climits>
#include <cstdint>
#include <mutex>
#include <string>

#include "relu_max_pool_gpu.h"

namespace tf_relupool {
namespace {

// The cuDNN entry points this path uses.
struct CudnnApi {
  decltype(&cudnnCreate) Create = nullptr;
  decltype(&cudnnDestroy) Destroy = nullptr;
  decltype(&cudnnSetStream) SetStream = nullptr;
  decltype(&cudnnGetErrorString) GetErrorString = nullptr;
  decltype(&cudnnCreateTensorDescriptor) CreateTensorDescriptor = nullptr;
  decltype(&cudnnSetTensor4dDescriptor) SetTensor4dDescriptor = nullptr;
  decltype(&cudnnDestroyTensorDescriptor) DestroyTensorDescriptor = nullptr;
  decltype(&cudnnCreatePoolingDescriptor) CreatePoolingDescriptor = nullptr;
  decltype(&cudnnSetPooling2dDescriptor) SetPooling2dDescriptor = nullptr;
  decltype(&cudnnDestroyPoolingDescriptor) DestroyPoolingDescriptor = nullptr;
  decltype(&cudnnPoolingForward) PoolingForward = nullptr;
  decltype(&cudnnPoolingBackward) PoolingBackward = nullptr;
  std::string error;  // why loading failed, "" when loaded
};

const CudnnApi& Api() {
  static CudnnApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* libs[] = {"libcudnn.so.9", "libcudnn_ops.so.9", "libcudnn_graph.so.9", "libcudnn.so"};
    void* handles[4] = {};
    for (int i = 0; i < 4; ++i) handles[i] = dlopen(libs[i], RTLD_NOW | RTLD_GLOBAL);
    if (handles[0] == nullptr && handles[3] == nullptr) {
      const char* e = dlerror();
      api.error = std::string("cuDNN could not be loaded (dlopen libcudnn.so.9: ") +
                  (e ? e : "unknown error") + "); install cuDNN 9 or use implementation='fused'";
      return;
    }
    auto sym = [&](const char* name) -> void* {
      for (void* h : handles) {
        if (h == nullptr) continue;
        if (void* s = dlsym(h, name)) return s;
      }
      if (api.error.empty()) api.error = std::string("cuDNN has no symbol ") + name;
      return nullptr;
    };
#define TFRP_CUDNN_SYM(field, name) api.field = reinterpret_cast<decltype(api.field)>(sym(#name))
    TFRP_CUDNN_SYM(Create, cudnnCreate);
    TFRP_CUDNN_SYM(Destroy, cudnnDestroy);
    TFRP_CUDNN_SYM(SetStream, cudnnSetStream);
    TFRP_CUDNN_SYM(GetErrorString, cudnnGetErrorString);
    TFRP_CUDNN_SYM(CreateTensorDescriptor, cudnnCreateTensorDescriptor);
    TFRP_CUDNN_SYM(SetTensor4dDescriptor, cudnnSetTensor4dDescriptor);
    TFRP_CUDNN_SYM(DestroyTensorDescriptor, cudnnDestroyTensorDescriptor);
    TFRP_CUDNN_SYM(CreatePoolingDescriptor, cudnnCreatePoolingDescriptor);
    TFRP_CUDNN_SYM(SetPooling2dDescriptor, cudnnSetPooling2dDescriptor);
    TFRP_CUDNN_SYM(DestroyPoolingDescriptor, cudnnDestroyPoolingDescriptor);
    TFRP_CUDNN_SYM(PoolingForward, cudnnPoolingForward);
    TFRP_CUDNN_SYM(PoolingBackward, cudnnPoolingBackward);
#undef TFRP_CUDNN_SYM
  });
  return api;
}

std::string CudnnText(cudnnStatus_t s, const char* what) {
  const CudnnApi& api = Api();
  return std::string(what) + " failed: " +
         (api.GetErrorString ? api.GetErrorString(s) : "cuDNN status " + std::to_string(int(s)));
}
std::string CudaText(cudaError_t e, const char* what) {
  return std::string(what) + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

template <typename T>
struct CudnnType;
template <>
struct CudnnType<float> {
  static constexpr cudnnDataType_t kType = CUDNN_DATA_FLOAT;
  using Scale = float;
};
template <>
struct CudnnType<double> {
  static constexpr cudnnDataType_t kType = CUDNN_DATA_DOUBLE;
  using Scale = double;
};
template <>
struct CudnnType<Half> {
  static constexpr cudnnDataType_t kType = CUDNN_DATA_HALF;
  using Scale = float;
};
template <>
struct CudnnType<BFloat16> {
  static constexpr cudnnDataType_t kType = CUDNN_DATA_BFLOAT16;
  using Scale = float;
};

constexpr int kThreads = 256;
inline unsigned Blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < (int64_t{1} << 30) ? b : (int64_t{1} << 30));
}

// relu(z) as the CPU kernels define it (std::max(v, 0)): negative gives +0, -0 and NaN stay.
template <typename T>
__global__ void ReluKernel(const T* __restrict__ z, T* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const T v = z[i];
    const auto a = ValueTraits<T>::ToAcc(v);
    out[i] = a < decltype(a)(0) ? ValueTraits<T>::FromAcc(decltype(a)(0)) : v;
  }
}

// Stock ReluGrad: g * (relu(z) > 0 ? 1 : 0), in T's arithmetic (MaskAcc in
// relu_max_pool_cpu_element.h).
template <typename T>
__global__ void ReluGradKernel(T* __restrict__ g, const T* __restrict__ features, int64_t n) {
  using A = typename ValueTraits<T>::Acc;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const bool keep = ValueTraits<T>::ToAcc(features[i]) > A(0);
    g[i] = ValueTraits<T>::FromAcc(ValueTraits<T>::ToAcc(g[i]) * (keep ? A(1) : A(0)));
  }
}

int64_t RoundUp(int64_t v) { return (v + 255) / 256 * 256; }

// Descriptors for one call, destroyed on scope exit.
struct Descriptors {
  cudnnTensorDescriptor_t in = nullptr, out = nullptr;
  cudnnPoolingDescriptor_t pool = nullptr;
  ~Descriptors() {
    const CudnnApi& api = Api();
    if (in) api.DestroyTensorDescriptor(in);
    if (out) api.DestroyTensorDescriptor(out);
    if (pool) api.DestroyPoolingDescriptor(pool);
  }
};

template <typename T>
std::string MakeDescriptors(const PoolParams& p, Descriptors* d) {
  const CudnnApi& api = Api();
  const cudnnTensorFormat_t fmt =
      p.format == DataFormat::kNHWC ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  cudnnStatus_t s;
  if ((s = api.CreateTensorDescriptor(&d->in)) != CUDNN_STATUS_SUCCESS) return CudnnText(s, "cudnnCreateTensorDescriptor");
  if ((s = api.CreateTensorDescriptor(&d->out)) != CUDNN_STATUS_SUCCESS) return CudnnText(s, "cudnnCreateTensorDescriptor");
  if ((s = api.CreatePoolingDescriptor(&d->pool)) != CUDNN_STATUS_SUCCESS) return CudnnText(s, "cudnnCreatePoolingDescriptor");
  s = api.SetTensor4dDescriptor(d->in, fmt, CudnnType<T>::kType, int(p.batch), int(p.channels),
                                int(p.in_rows), int(p.in_cols));
  if (s != CUDNN_STATUS_SUCCESS) return CudnnText(s, "cudnnSetTensor4dDescriptor(input)");
  s = api.SetTensor4dDescriptor(d->out, fmt, CudnnType<T>::kType, int(p.batch), int(p.channels),
                                int(p.out_rows), int(p.out_cols));
  if (s != CUDNN_STATUS_SUCCESS) return CudnnText(s, "cudnnSetTensor4dDescriptor(output)");
  // NOT_PROPAGATE_NAN, like TensorFlow's default (TF_ENABLE_MAXPOOL_NANPROP unset).
  s = api.SetPooling2dDescriptor(d->pool, CUDNN_POOLING_MAX_DETERMINISTIC, CUDNN_NOT_PROPAGATE_NAN,
                                 int(p.window_rows), int(p.window_cols), int(p.pad_top),
                                 int(p.pad_left), int(p.stride_rows), int(p.stride_cols));
  if (s != CUDNN_STATUS_SUCCESS) return CudnnText(s, "cudnnSetPooling2dDescriptor");
  return "";
}

std::string Begin(cudnnHandle_t handle, cudaStream_t stream, const PoolParams& p) {
  const CudnnApi& api = Api();
  if (!api.error.empty()) return api.error;
  std::string why = CudnnPathUnsupportedReason(p);
  if (!why.empty()) return why;
  cudaGetLastError();
  const cudnnStatus_t s = api.SetStream(handle, stream);
  return s == CUDNN_STATUS_SUCCESS ? "" : CudnnText(s, "cudnnSetStream");
}

}  // namespace

std::string CudnnPathUnsupportedReason(const PoolParams& p) {
  const int64_t dims[] = {p.batch, p.channels, p.in_rows, p.in_cols, p.window_rows,
                          p.window_cols, p.stride_rows, p.stride_cols};
  for (int64_t d : dims) {
    if (d > INT_MAX) return "the cuDNN path needs every dimension to fit in int";
  }
  // cuDNN pads both sides by the same amount and computes 1 + (in + 2 pad - window) / stride
  // outputs; TensorFlow's SAME padding may put one more element after the data.
  const int64_t rows = 1 + (p.in_rows + 2 * p.pad_top - p.window_rows) / p.stride_rows;
  const int64_t cols = 1 + (p.in_cols + 2 * p.pad_left - p.window_cols) / p.stride_cols;
  if (p.in_rows + 2 * p.pad_top < p.window_rows || p.in_cols + 2 * p.pad_left < p.window_cols ||
      rows != p.out_rows || cols != p.out_cols) {
    return "cuDNN's symmetric padding cannot express this geometry (TensorFlow's SAME padding "
           "puts the odd element after the data, or a window is larger than the padded input)";
  }
  return "";
}

int64_t CudnnForwardTempBytes(const PoolParams& p, int64_t element_size) {
  return RoundUp(p.in_elements() * element_size);
}
int64_t CudnnBackwardTempBytes(const PoolParams& p, int64_t element_size) {
  return RoundUp(p.in_elements() * element_size) + RoundUp(p.out_elements() * element_size);
}

std::string CudnnCreateHandle(cudnnHandle_t* handle) {
  const CudnnApi& api = Api();
  if (!api.error.empty()) return api.error;
  const cudnnStatus_t s = api.Create(handle);
  return s == CUDNN_STATUS_SUCCESS ? "" : CudnnText(s, "cudnnCreate");
}
std::string CudnnDestroyHandle(cudnnHandle_t handle) {
  const CudnnApi& api = Api();
  if (!api.error.empty()) return api.error;
  const cudnnStatus_t s = api.Destroy(handle);
  return s == CUDNN_STATUS_SUCCESS ? "" : CudnnText(s, "cudnnDestroy");
}

template <typename T>
std::string ReluMaxPoolForwardCudnn(cudnnHandle_t handle, cudaStream_t stream, const PoolParams& p,
                                    const T* z, T* y, void* temp) {
  if (p.out_elements() == 0) return "";
  std::string err = Begin(handle, stream, p);
  if (!err.empty()) return err;
  const int64_t n = p.in_elements();
  T* x = static_cast<T*>(temp);
  ReluKernel<T><<<Blocks(n), kThreads, 0, stream>>>(z, x, n);
  cudaError_t ce = cudaGetLastError();
  if (ce != cudaSuccess) return CudaText(ce, "ReLU kernel launch");
  Descriptors d;
  if (!(err = MakeDescriptors<T>(p, &d)).empty()) return err;
  const typename CudnnType<T>::Scale one = 1, zero = 0;
  const cudnnStatus_t s = Api().PoolingForward(handle, d.pool, &one, d.in, x, &zero, d.out, y);
  return s == CUDNN_STATUS_SUCCESS ? "" : CudnnText(s, "cudnnPoolingForward");
}

template <typename T>
std::string ReluMaxPoolBackwardCudnn(cudnnHandle_t handle, cudaStream_t stream,
                                     const PoolParams& p, const T* z, const T* dy, T* dz,
                                     void* temp) {
  const int64_t n = p.in_elements();
  if (n == 0) return "";
  if (p.out_elements() == 0) {
    const cudaError_t ce = cudaMemsetAsync(dz, 0, n * sizeof(T), stream);
    return ce == cudaSuccess ? "" : CudaText(ce, "cudaMemsetAsync");
  }
  std::string err = Begin(handle, stream, p);
  if (!err.empty()) return err;
  T* x = static_cast<T*>(temp);
  T* y = reinterpret_cast<T*>(static_cast<char*>(temp) + RoundUp(n * int64_t(sizeof(T))));
  ReluKernel<T><<<Blocks(n), kThreads, 0, stream>>>(z, x, n);
  cudaError_t ce = cudaGetLastError();
  if (ce != cudaSuccess) return CudaText(ce, "ReLU kernel launch");
  Descriptors d;
  if (!(err = MakeDescriptors<T>(p, &d)).empty()) return err;
  const typename CudnnType<T>::Scale one = 1, zero = 0;
  const CudnnApi& api = Api();
  cudnnStatus_t s = api.PoolingForward(handle, d.pool, &one, d.in, x, &zero, d.out, y);
  if (s != CUDNN_STATUS_SUCCESS) return CudnnText(s, "cudnnPoolingForward");
  s = api.PoolingBackward(handle, d.pool, &one, d.out, y, d.out, dy, d.in, x, &zero, d.in, dz);
  if (s != CUDNN_STATUS_SUCCESS) return CudnnText(s, "cudnnPoolingBackward");
  ReluGradKernel<T><<<Blocks(n), kThreads, 0, stream>>>(dz, x, n);
  ce = cudaGetLastError();
  return ce == cudaSuccess ? "" : CudaText(ce, "ReluGrad kernel launch");
}

#define TFRP_CUDNN_INSTANTIATE(T)                                                            \
  template std::string ReluMaxPoolForwardCudnn<T>(cudnnHandle_t, cudaStream_t,               \
                                                  const PoolParams&, const T*, T*, void*);   \
  template std::string ReluMaxPoolBackwardCudnn<T>(cudnnHandle_t, cudaStream_t,              \
                                                   const PoolParams&, const T*, const T*, T*, \
                                                   void*);
TFRP_CUDNN_INSTANTIATE(float)
TFRP_CUDNN_INSTANTIATE(double)
TFRP_CUDNN_INSTANTIATE(Half)
TFRP_CUDNN_INSTANTIATE(BFloat16)

}  // namespace tf_relupool
