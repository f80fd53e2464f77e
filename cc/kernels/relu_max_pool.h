// Fused ReLU + 2-D max pooling: geometry, validation and the CPU kernels' entry points.
//
// Framework-free on purpose (plain pointers and sizes): the TensorFlow OpKernels, the shape
// functions, the CUDA kernels and the TensorFlow-free GPU harness all include this header, so
// every path validates and computes geometry through the same code.
//
// Semantics (bit for bit those of stock TensorFlow CPU for max_pool2d(relu(z)) and its gradient):
//  - relu(v) = v < 0 ? +0 : v (std::max(v, 0)): -0 and NaN are kept. Stock Relu does exactly this
//    for half/bfloat16; for float/double its vectorised path turns -0 into +0, so the only bits
//    stock itself does not define are the sign of a zero output whose window starts with -0.
//  - forward: every window starts from ValueTraits<T>::Lowest() (the lowest finite value, for
//    every T) and takes r when `max < r`, scanning rows then columns; so NaN is skipped and an
//    all-NaN window yields that start value. (Stock gives -Inf there for half/bfloat16 on some
//    machines: see numeric.h.)
//  - gradient: the window's first in-bounds position is its argmax to begin with, later positions
//    take over on `best < r`; dy is added (in output order, from +0) at the argmax; finally the sum
//    is multiplied by (relu(z) > 0 ? 1 : 0), so dy routed to a non-positive or NaN z yields +-0
//    (or NaN if the sum is Inf/NaN), exactly like ReluGrad(MaxPoolGrad(...)).
//  - One consequence: the argmax is either a position with z > 0 or the window's first in-bounds
//    position. The compact "window argmax" code therefore stores the position when it holds a
//    positive value and a sentinel otherwise; the sentinel routes dy to the first in-bounds
//    position and multiplies it by zero, which reproduces the stock gradient exactly.
#ifndef TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_H_
#define TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <string>

#include "numeric.h"

namespace tf_relupool {

enum class DataFormat : int { kNHWC = 0, kNCHW = 1 };
enum class Padding : int { kValid = 0, kSame = 1, kExplicit = 2 };

// Geometry of one pooling call. Filled only by ComputePoolParams; passed to kernels by value.
//
// Internally every layout is an (images x rows x cols x lanes) array: NHWC has images = batch and
// lanes = channels; NCHW has images = batch * channels and lanes = 1 (each channel plane is an
// image of one lane). Window argmax codes share the output's layout.
struct PoolParams {
  DataFormat format;
  int64_t batch, in_rows, in_cols, channels;
  int64_t window_rows, window_cols, stride_rows, stride_cols;
  int64_t out_rows, out_cols;
  int64_t pad_top, pad_left;  // padding before the first row / column (SAME, EXPLICIT)
  int64_t images, lanes;
  // Codes index the window clipped to the input, row-major with this row pitch.
  int64_t code_pitch;       // min(window_cols, in_cols)
  int64_t code_positions;   // min(window_rows, in_rows) * code_pitch

  int64_t in_elements() const { return images * in_rows * in_cols * lanes; }
  int64_t out_elements() const { return images * out_rows * out_cols * lanes; }
  // True when no input position lies in two windows: the backward then writes each window's
  // region on its own, with no accumulation.
  bool windows_disjoint() const { return stride_rows >= window_rows && stride_cols >= window_cols; }
};

// The window of output position (out_row, out_col), clipped to the input: rows
// [row_begin, row_end) and columns [col_begin, col_end). Never empty when the input is not.
struct ClippedWindow {
  int64_t row_begin, row_end, col_begin, col_end;
};
TFRP_HD ClippedWindow WindowOf(const PoolParams& p, int64_t out_row, int64_t out_col) {
  const int64_t rs = out_row * p.stride_rows - p.pad_top;
  const int64_t cs = out_col * p.stride_cols - p.pad_left;
  ClippedWindow w;
  w.row_begin = rs > 0 ? rs : 0;
  w.row_end = rs + p.window_rows < p.in_rows ? rs + p.window_rows : p.in_rows;
  w.col_begin = cs > 0 ? cs : 0;
  w.col_end = cs + p.window_cols < p.in_cols ? cs + p.window_cols : p.in_cols;
  return w;
}
// Output indices [*begin, *end) along one dimension whose windows contain input index `in`.
TFRP_HD void OutputsCovering(int64_t in, int64_t pad, int64_t window, int64_t stride,
                             int64_t out_size, int64_t* begin, int64_t* end) {
  const int64_t hi = (in + pad) / stride + 1;  // first output whose window starts after `in`
  const int64_t lo_num = in + pad - window + 1;
  const int64_t lo = lo_num <= 0 ? 0 : (lo_num + stride - 1) / stride;
  *begin = lo;
  *end = hi < out_size ? hi : out_size;
}

// Checks ksize / strides (4 entries each, in data_format order, batch and channel entries 1,
// spatial entries >= 1). Returns "" when valid, otherwise a message naming the attribute.
std::string CheckPoolAttrs(const int64_t* ksize, int ksize_len, const int64_t* strides,
                           int strides_len, DataFormat format);

// Checks the explicit_paddings attribute against padding. With padding EXPLICIT: 8 entries
// (before, after) per dimension in data_format order, zero on the batch and channel dimensions,
// and, as TensorFlow's MaxPool requires, each spatial one >= 0 and smaller than the window along
// it (so that every window holds an input position); otherwise it must be empty. ksize: 4
// valid entries (CheckPoolAttrs). Returns "" when valid, otherwise a message naming the attribute.
std::string CheckExplicitPaddings(Padding padding, const int64_t* paddings, int paddings_len,
                                  const int64_t* ksize, DataFormat format);

// Output size along one spatial dimension, TensorFlow's formula: VALID gives
// max(0, (in - window + stride) / stride), SAME gives ceil(in / stride), EXPLICIT (with
// pad_before + pad_after added to the input) max(0, (in + pads - window + stride) / stride).
// Returns -1 for an unknown input size (in < 0).
int64_t PooledSize(int64_t in, int64_t window, int64_t stride, Padding padding,
                   int64_t pad_before = 0, int64_t pad_after = 0);

// Validates attributes and a 4-D input shape (data_format order) and fills *params.
// explicit_paddings (8 entries, see CheckExplicitPaddings) is read for padding EXPLICIT only.
// Returns "" when valid, otherwise a message naming the offending argument.
std::string ComputePoolParams(const int64_t* input_dims, int input_rank, const int64_t* ksize,
                              int ksize_len, const int64_t* strides, int strides_len,
                              Padding padding, DataFormat format, PoolParams* params,
                              const int64_t* explicit_paddings = nullptr,
                              int explicit_paddings_len = 0);

// Window argmax codes: C is uint8_t, uint16_t or int32_t; its largest value is the sentinel
// ("window max <= 0 or NaN first: dy goes to the first in-bounds position, times zero").
template <typename C>
constexpr C ArgmaxSentinel() {
  return std::numeric_limits<C>::max();
}
// Returns "" when C can encode every position of this geometry's windows.
template <typename C>
std::string CheckArgmaxType(const PoolParams& p, const char* type_name) {
  if (p.code_positions >= static_cast<int64_t>(ArgmaxSentinel<C>())) {
    return std::string("window_argmax type ") + type_name + " cannot encode windows of " +
           std::to_string(p.code_positions) + " positions (at most " +
           std::to_string(static_cast<int64_t>(ArgmaxSentinel<C>()) - 1) + "); use a wider type";
  }
  return "";
}

// Runs fn(begin, end) over disjoint sub-ranges covering [0, total), possibly concurrently.
// cost_per_unit is a rough cycle count per unit, a hint for how finely to split.
class ParallelRunner {
 public:
  virtual ~ParallelRunner() = default;
  virtual void For(int64_t total, int64_t cost_per_unit,
                   const std::function<void(int64_t, int64_t)>& fn) const = 0;
};
// Runs everything on the calling thread.
class SerialRunner : public ParallelRunner {
 public:
  void For(int64_t total, int64_t, const std::function<void(int64_t, int64_t)>& fn) const override {
    if (total > 0) fn(0, total);
  }
};

// Instruction sets the CPU kernels are compiled for (relu_max_pool_cpu_kernels.cc, chosen in
// relu_max_pool_cpu.cc). Every path gives bitwise identical results; they differ only in speed.
enum class CpuIsa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };
// "baseline", "avx2", "avx512".
const char* CpuIsaName(CpuIsa isa);
// Whether this build has the path and this CPU (and OS) can run it. Baseline is always true.
bool CpuIsaSupported(CpuIsa isa);
// The path the kernels use now. Chosen on first use: the best supported one, or the one named by
// the environment variable TF_RELUPOOL_CPU_ISA (baseline, avx2, avx512; auto or empty for the
// best); a name this CPU cannot run, or an unknown name, logs one line to stderr and falls back
// to the best supported path (never an illegal instruction).
CpuIsa ActiveCpuIsa();
// Switches the path for later calls (tests, benchmarks). Returns "" on success, or a message if
// the path is not supported here (then nothing changes). Calls already running are unaffected.
std::string SetCpuIsa(CpuIsa isa);

// CPU kernels. Every result is independent of how the runner splits the work.
// y = max_pool(relu(z)).
template <typename T>
void ReluMaxPoolForwardCpu(const PoolParams& p, const T* z, T* y, const ParallelRunner& runner);

// y as above, plus one code per pooled element.
template <typename T, typename C>
void ReluMaxPoolForwardWithArgmaxCpu(const PoolParams& p, const T* z, T* y, C* argmax,
                                     const ParallelRunner& runner);

// dz from z and dy. When windows overlap it needs a workspace of
// BackwardFromInputWorkspaceBytes(p) bytes (window argmax codes); otherwise workspace may be null.
int64_t BackwardFromInputWorkspaceBytes(const PoolParams& p);
template <typename T>
void ReluMaxPoolBackwardFromInputCpu(const PoolParams& p, const T* z, const T* dy, T* dz,
                                     void* workspace, const ParallelRunner& runner);

// Returns the flat index of the first code that does not name an in-bounds position of its
// window (and is not the sentinel), or -1 when all codes are valid.
template <typename C>
int64_t FindInvalidArgmaxCpu(const PoolParams& p, const C* argmax, const ParallelRunner& runner);

// dz from dy and validated codes alone.
template <typename T, typename C>
void ReluMaxPoolBackwardFromArgmaxCpu(const PoolParams& p, const T* dy, const C* argmax, T* dz,
                                      const ParallelRunner& runner);

// Second order: the gradient of the backward with respect to its dy, for an incoming gradient
// ddz of the input's shape: ddy[o] = ddz[argmax(o)] * (code(o) is a position ? 1 : 0), where a
// sentinel code means the window's first in-bounds position (times zero). This is stock's
// MaxPoolGradGrad(relu(z), y, ReluGrad(ddz, relu(z))) for every window without NaN; see
// docs/semantics.md, "Higher-order gradients", for windows holding NaN. Codes must be validated first.
template <typename T, typename C>
void ReluMaxPoolGradGradFromArgmaxCpu(const PoolParams& p, const T* ddz, const C* argmax, T* ddy,
                                      const ParallelRunner& runner);

}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_H_
