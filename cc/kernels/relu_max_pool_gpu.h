// CUDA kernels for fused ReLU + max pooling: launchers for the fused single-pass kernels and for
// the cuDNN path (the seed's: ReLU into a temporary buffer, then cuDNN pooling).
//
// Framework-free like the CPU kernels (raw device pointers, PoolParams, a cudaStream_t): the
// TensorFlow OpKernels (cc/ops/relu_max_pool_kernels_gpu.cc) and the TensorFlow-free harness
// (gpu_check/) compile and call exactly these functions.
//
// Results of the fused kernels are bitwise equal to the CPU kernels of relu_max_pool_cpu.cc on the
// same inputs (forward and codes always; gradients except for the payload and sign bits of NaN
// results, which follow the processor's NaN rules: x86 keeps an operand's payload, CUDA returns its
// canonical NaN). No floating-point atomics: where windows overlap, every input element gathers the
// gradients routed to it in output order, exactly like the CPU's GatherBackward.
//
// Every launcher returns the first CUDA error (launch errors included); all work is queued on
// `stream` only, except FindInvalidArgmaxGpu, which waits for its result.
#ifndef TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_GPU_H_
#define TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_GPU_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "relu_max_pool.h"

// cudnn.h is not included here, so that callers need no cuDNN headers.
struct cudnnContext;
typedef struct cudnnContext* cudnnHandle_t;

namespace tf_relupool {

// ---- Fused kernels (T: float, double, Half, BFloat16; C: uint8_t, uint16_t, int32_t) ----

// y = max_pool(relu(z)).
template <typename T>
cudaError_t ReluMaxPoolForwardGpu(const PoolParams& p, const T* z, T* y, cudaStream_t stream);

// y plus one window-argmax code per pooled element (the CPU's codes, bit for bit).
template <typename T, typename C>
cudaError_t ReluMaxPoolForwardWithArgmaxGpu(const PoolParams& p, const T* z, T* y, C* argmax,
                                            cudaStream_t stream);

// dz from z and dy. When windows overlap, `workspace` must hold BackwardFromInputWorkspaceBytes(p)
// bytes (codes of the narrowest type, as on the CPU); otherwise it may be null.
template <typename T>
cudaError_t ReluMaxPoolBackwardFromInputGpu(const PoolParams& p, const T* z, const T* dy, T* dz,
                                            void* workspace, cudaStream_t stream);

// dz from dy and codes. If first_bad is not null it must point to device memory; the kernel
// validates every code on the fly (the same rule as FindInvalidArgmaxCpu) and leaves there the
// smallest flat index of an invalid code, or ~0ull when all are valid (the launcher initialises
// it). Invalid codes never cause out-of-bounds accesses; dz is meaningless when one is found.
template <typename T, typename C>
cudaError_t ReluMaxPoolBackwardFromArgmaxGpu(const PoolParams& p, const T* dy, const C* argmax,
                                             T* dz, unsigned long long* first_bad,
                                             cudaStream_t stream);

// Second order (see ReluMaxPoolGradGradFromArgmaxCpu): ddy (pooled shape) from ddz (the input's
// shape) and codes, validated on the fly exactly like ReluMaxPoolBackwardFromArgmaxGpu (first_bad
// may be null; an invalid code is read as the sentinel, never out of bounds).
template <typename T, typename C>
cudaError_t ReluMaxPoolGradGradFromArgmaxGpu(const PoolParams& p, const T* ddz, const C* argmax,
                                             T* ddy, unsigned long long* first_bad,
                                             cudaStream_t stream);

// Stand-alone validation: the smallest flat index of an invalid code, or -1, in *result (host).
// `scratch` is 8 bytes of device memory. Waits for the stream.
template <typename C>
cudaError_t FindInvalidArgmaxGpu(const PoolParams& p, const C* argmax, void* scratch,
                                 int64_t* result, cudaStream_t stream);

// ---- cuDNN path (ReLU into a temporary buffer, then cuDNN pooling) ----
//
// cuDNN is loaded at run time (dlopen "libcudnn.so.9"), so the library loads and runs on machines
// without cuDNN; only these functions fail there, with a message saying so.
//
// What it matches, measured by gpu_check against the CPU kernels on an H200 with cuDNN 9.14
// (gpu_check/results/h200-2026-11-30.txt; 152 random geometries cuDNN can express, 4 dtypes):
//  - ordinary data (N(0,1), no -0/NaN/Inf): forward bitwise equal in every case; backward bitwise
//    equal whenever windows do not overlap, which gpu_check requires; with overlapping windows it
//    differed in 14 of 152 cases (the first reported was half), consistent with cuDNN summing the
//    gradients an element receives from several windows in another order than stock's row-major
//    one (not verified further). The fused kernels are exact there.
//  - small-integer data with -0 (ties, all-negative windows): forward differed in 51 of 152 cases.
//    Positive ties have identical bits, so these can only be signs of zero outputs (deduced, not
//    inspected): relu keeps -0 (std::max semantics, relu_max_pool.h) and cuDNN picks another zero
//    of the window than the first.
//  - NaN/Inf data: cuDNN's NaN rules (CUDNN_NOT_PROPAGATE_NAN) and its tie/NaN routing in the
//    backward differ from stock TensorFlow CPU; nearly every case differed.
// In short: 'cudnn' reproduces the stock result on ordinary data with non-overlapping windows;
// use the default fused kernels wherever bit-exactness matters.

// Returns "" when the cuDNN path can compute this geometry, else why not (TensorFlow's SAME
// padding puts the odd padding element after the data, which cuDNN's symmetric padding cannot
// express; dimensions must fit in int). Callers then use the fused kernels, which give the same
// results.
std::string CudnnPathUnsupportedReason(const PoolParams& p);

// Bytes of temporary device memory each call needs (relu(z); for the backward also y).
int64_t CudnnForwardTempBytes(const PoolParams& p, int64_t element_size);
int64_t CudnnBackwardTempBytes(const PoolParams& p, int64_t element_size);

// Loads cuDNN if needed and creates a handle. Returns "" or the error text.
std::string CudnnCreateHandle(cudnnHandle_t* handle);
std::string CudnnDestroyHandle(cudnnHandle_t handle);

// Both bind `handle` to `stream` (cudnnSetStream) first, and return "" or the CUDA/cuDNN error text.
// temp: CudnnForwardTempBytes / CudnnBackwardTempBytes bytes, 16-byte aligned.
template <typename T>
std::string ReluMaxPoolForwardCudnn(cudnnHandle_t handle, cudaStream_t stream, const PoolParams& p,
                                    const T* z, T* y, void* temp);
template <typename T>
std::string ReluMaxPoolBackwardCudnn(cudnnHandle_t handle, cudaStream_t stream,
                                     const PoolParams& p, const T* z, const T* dy, T* dz,
                                     void* temp);

}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_GPU_H_
