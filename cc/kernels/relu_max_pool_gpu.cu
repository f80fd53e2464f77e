// Fused CUDA kernels for ReLU + max pooling. Framework-free: see relu_max_pool_gpu.h.
//
// Two families:
//  - Fast2x2*: the common 2x2 window, stride 2, no padding, even input sizes. One thread owns V
//    pooled elements (V = 16 bytes / sizeof(T)) and their 2x2 windows: 16-byte loads and stores,
//    over lanes in NHWC and over columns in NCHW, coalesced across the warp, no temporary buffer.
//    Forward: read z once, write y (and codes). Backward: read z (or the codes) and dy once, write
//    each dz element exactly once.
//  - Generic*: any window, stride, padding and layout. The forward has one thread per pooled
//    element; the backward one thread per input element that gathers, in output (row-major window)
//    order, the gradients routed to it, like GatherBackward in relu_max_pool_cpu_kernels.cc. Where
//    windows overlap, the keep-z backward first writes the window codes into the caller's
//    workspace.
// Both reproduce the CPU code's comparisons and roundings step by step (see relu_max_pool.h).
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "relu_max_pool_gpu.h"

namespace tf_relupool {
namespace {

template <typename T>
using Acc = typename ValueTraits<T>::Acc;

// Conversions to and from the arithmetic type in device code: ValueTraits', except for half, where
// the hardware conversions give the same results (both round to nearest even; only NaN payloads
// may differ) in one instruction instead of numeric.h's portable bit manipulation.
template <typename T>
struct Dev {
  static __device__ __forceinline__ Acc<T> ToAcc(T v) { return ValueTraits<T>::ToAcc(v); }
  static __device__ __forceinline__ T FromAcc(Acc<T> v) { return ValueTraits<T>::FromAcc(v); }
};
template <>
struct Dev<Half> {
  static __device__ __forceinline__ float ToAcc(Half v) {
    __half_raw r;
    r.x = v.bits;
    return __half2float(__half(r));
  }
  static __device__ __forceinline__ Half FromAcc(float v) {
    const __half_raw r = __float2half_rn(v);
    return Half{r.x};
  }
};

// Code sentinels (relu_max_pool.h's ArgmaxSentinel, usable in device code).
template <typename C>
struct CodeTraits;
template <>
struct CodeTraits<uint8_t> {
  static constexpr uint8_t kSentinel = 0xffu;
};
template <>
struct CodeTraits<uint16_t> {
  static constexpr uint16_t kSentinel = 0xffffu;
};
template <>
struct CodeTraits<int32_t> {
  static constexpr int32_t kSentinel = 0x7fffffff;
};

// The window start value as a T (what an all-NaN window yields): ValueTraits<T>::Lowest(), which
// every T represents exactly.
template <typename T>
__device__ __forceinline__ T LowestT() {
  return Dev<T>::FromAcc(ValueTraits<T>::Lowest());
}
template <typename T>
__device__ __forceinline__ T ZeroT() {
  return T(0);
}
template <>
__device__ __forceinline__ Half ZeroT<Half>() {
  return Half{0};
}
template <>
__device__ __forceinline__ BFloat16 ZeroT<BFloat16>() {
  return BFloat16{0};
}

// Running window maximum: the CPU's `m < relu(v)` rule with relu(v) = v < 0 ? +0 : v (-0 and NaN
// kept), tracking the winner's bits so that no conversion back to T is needed (the max is always
// one of the relu'd inputs or the start value).
template <typename T>
struct MaxState {
  Acc<T> m;
  T bits;
  __device__ __forceinline__ void Init() {
    m = ValueTraits<T>::Lowest();
    bits = LowestT<T>();
  }
  // Returns whether v took over.
  __device__ __forceinline__ bool Take(T v) {
    const Acc<T> a = Dev<T>::ToAcc(v);
    const bool negative = a < Acc<T>(0);
    const Acc<T> r = negative ? Acc<T>(0) : a;
    const bool take = m < r;
    if (take) {
      m = r;
      bits = negative ? ZeroT<T>() : v;
    }
    return take;
  }
};

template <typename T>
__device__ __forceinline__ bool IsNan(T v) {
  const Acc<T> a = Dev<T>::ToAcc(v);
  return a != a;
}

// The CPU's AddAcc and MaskAcc.
template <typename T>
__device__ __forceinline__ T AddT(T a, T b) {
  return Dev<T>::FromAcc(Dev<T>::ToAcc(a) + Dev<T>::ToAcc(b));
}
template <typename T>
__device__ __forceinline__ T MaskT(T a, bool keep) {
  return Dev<T>::FromAcc(Dev<T>::ToAcc(a) * (keep ? Acc<T>(1) : Acc<T>(0)));
}
// (0 + dy) * mask, the value a disjoint window's gradient position gets.
template <typename T>
__device__ __forceinline__ T RoutedT(T dy, bool keep) {
  return MaskT(AddT(ZeroT<T>(), dy), keep);
}

// RoutedT for the fast path, on bits for the 16-bit types (the value is exact, so no rounding
// is involved): keep ? (0 + dy) * 1 : (0 + dy) * 0. Equal to RoutedT bit for bit except that a NaN
// result may carry another payload or sign (relu_max_pool_gpu.h).
__device__ __forceinline__ uint16_t Routed16(uint16_t u, bool keep, uint16_t inf_bits) {
  const uint16_t mag = u & 0x7fffu;
  if (keep) return mag == 0 ? uint16_t{0} : u;         // 0 + (-0) is +0
  if (mag >= inf_bits) return uint16_t{0x7fffu};        // Inf * 0, NaN * 0: NaN
  return mag == 0 ? uint16_t{0} : uint16_t(u & 0x8000u);  // +-0 with dy's sign (0 + -0 is +0)
}
template <typename T>
__device__ __forceinline__ T FastRouted(T dy, bool keep) {
  return RoutedT(dy, keep);
}
template <>
__device__ __forceinline__ Half FastRouted<Half>(Half dy, bool keep) {
  return Half{Routed16(dy.bits, keep, 0x7c00u)};
}
template <>
__device__ __forceinline__ BFloat16 FastRouted<BFloat16>(BFloat16 dy, bool keep) {
  return BFloat16{Routed16(dy.bits, keep, 0x7f80u)};
}

inline unsigned GridFor(int64_t n, int threads) {
  int64_t blocks = (n + threads - 1) / threads;
  // Grid-stride loops beyond this (the x dimension allows 2^31 - 1 blocks).
  const int64_t kMaxBlocks = int64_t{1} << 30;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}
constexpr int kThreads = 256;

// ------------------------------------------------------------------------------------------------
// Generic kernels.

// Coordinates of pooled element o: (image, output row, output column, lane).
struct PooledIndex {
  int64_t img, ph, pw, l;
};
__device__ __forceinline__ PooledIndex PooledIndexOf(const PoolParams& p, int64_t o) {
  PooledIndex q;
  q.l = o % p.lanes;
  int64_t t = o / p.lanes;
  q.pw = t % p.out_cols;
  t /= p.out_cols;
  q.ph = t % p.out_rows;
  q.img = t / p.out_rows;
  return q;
}

// One thread per pooled element: y and/or codes.
template <typename T, typename C, bool kWriteY, bool kWriteCodes>
__global__ void __launch_bounds__(kThreads) GenericForwardKernel(const PoolParams p,
                                                                 const T* __restrict__ z,
                                                                 T* __restrict__ y,
                                                                 C* __restrict__ codes, int64_t n) {
  for (int64_t o = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; o < n;
       o += int64_t{gridDim.x} * blockDim.x) {
    const int64_t L = p.lanes;
    const PooledIndex q = PooledIndexOf(p, o);
    const ClippedWindow win = WindowOf(p, q.ph, q.pw);
    const T* zi = z + q.img * p.in_rows * p.in_cols * L + q.l;
    MaxState<T> s;
    s.Init();
    int32_t pos = 0;
    for (int64_t h = win.row_begin; h < win.row_end; ++h) {
      for (int64_t w = win.col_begin; w < win.col_end; ++w) {
        const bool take = s.Take(zi[(h * p.in_cols + w) * L]);
        if (kWriteCodes && take) {
          pos = static_cast<int32_t>((h - win.row_begin) * p.code_pitch + (w - win.col_begin));
        }
      }
    }
    if (kWriteY) y[o] = s.bits;
    if (kWriteCodes) {
      const bool first_nan = IsNan(zi[(win.row_begin * p.in_cols + win.col_begin) * L]);
      codes[o] = (first_nan || !(s.m > Acc<T>(0))) ? CodeTraits<C>::kSentinel : static_cast<C>(pos);
    }
  }
}

// A window's code as the gather sees it.
struct Code {
  int64_t value;  // meaningful when !sentinel
  bool sentinel;
};

// Codes stored by the forward (or the workspace).
template <typename C>
struct StoredCodes {
  const C* __restrict__ codes;
  __device__ __forceinline__ Code Get(const PoolParams&, int64_t o, int64_t, int64_t,
                                      const ClippedWindow&) const {
    const C c = codes[o];
    return Code{static_cast<int64_t>(c), c == CodeTraits<C>::kSentinel};
  }
};

// Codes recomputed from z (disjoint windows only: each input element lies in at most one window,
// so each window is scanned by the elements of that window alone).
template <typename T>
struct RecomputedCodes {
  const T* __restrict__ z;
  __device__ __forceinline__ Code Get(const PoolParams& p, int64_t, int64_t img, int64_t l,
                                      const ClippedWindow& win) const {
    const int64_t L = p.lanes;
    const T* zi = z + img * p.in_rows * p.in_cols * L + l;
    MaxState<T> s;
    s.Init();
    int64_t pos = 0;
    for (int64_t h = win.row_begin; h < win.row_end; ++h) {
      for (int64_t w = win.col_begin; w < win.col_end; ++w) {
        if (s.Take(zi[(h * p.in_cols + w) * L])) {
          pos = (h - win.row_begin) * p.code_pitch + (w - win.col_begin);
        }
      }
    }
    const bool first_nan = IsNan(zi[(win.row_begin * p.in_cols + win.col_begin) * L]);
    return Code{pos, first_nan || !(s.m > Acc<T>(0))};
  }
};

__device__ __forceinline__ bool CodeValid(const PoolParams& p, const Code& c, const ClippedWindow& win) {
  if (c.sentinel) return true;
  const int64_t rows = win.row_end - win.row_begin, cols = win.col_end - win.col_begin;
  return c.value >= 0 && c.value / p.code_pitch < rows && c.value % p.code_pitch < cols;
}

// One thread per input element: sums, in output order, dy of the windows whose code routes to it,
// then applies the mask. With first_bad, the thread at each window's first position also checks
// that window's code (every window has one, so each code is checked exactly once).
template <typename T, typename Src>
__global__ void __launch_bounds__(kThreads) GenericGatherKernel(const PoolParams p, const Src src,
                                                                const T* __restrict__ dy,
                                                                T* __restrict__ dz,
                                                                unsigned long long* first_bad,
                                                                int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t L = p.lanes;
    const int64_t l = i % L;
    int64_t t = i / L;
    const int64_t w = t % p.in_cols;
    t /= p.in_cols;
    const int64_t h = t % p.in_rows;
    const int64_t img = t / p.in_rows;
    int64_t ph0, ph1, pw0, pw1;
    OutputsCovering(h, p.pad_top, p.window_rows, p.stride_rows, p.out_rows, &ph0, &ph1);
    OutputsCovering(w, p.pad_left, p.window_cols, p.stride_cols, p.out_cols, &pw0, &pw1);
    T a = ZeroT<T>();
    bool positive = false;
    for (int64_t ph = ph0; ph < ph1; ++ph) {
      for (int64_t pw = pw0; pw < pw1; ++pw) {
        const ClippedWindow win = WindowOf(p, ph, pw);
        const int64_t o = ((img * p.out_rows + ph) * p.out_cols + pw) * L + l;
        const Code c = src.Get(p, o, img, l, win);
        const bool first = h == win.row_begin && w == win.col_begin;
        const int64_t expected = (h - win.row_begin) * p.code_pitch + (w - win.col_begin);
        const bool hit = !c.sentinel && c.value == expected;
        if (hit || (first && c.sentinel)) a = AddT(a, dy[o]);
        positive |= hit;
        if (first_bad != nullptr && first && !CodeValid(p, c, win)) {
          atomicMin(first_bad, static_cast<unsigned long long>(o));
        }
      }
    }
    dz[i] = MaskT(a, positive);
  }
}

// One thread per pooled element: the CPU's FindInvalidArgmax rule.
template <typename C>
__global__ void __launch_bounds__(kThreads) FindInvalidKernel(const PoolParams p,
                                                              const C* __restrict__ codes,
                                                              unsigned long long* first_bad,
                                                              int64_t n) {
  for (int64_t o = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; o < n;
       o += int64_t{gridDim.x} * blockDim.x) {
    const PooledIndex q = PooledIndexOf(p, o);
    const C c = codes[o];
    const Code code{static_cast<int64_t>(c), c == CodeTraits<C>::kSentinel};
    if (!CodeValid(p, code, WindowOf(p, q.ph, q.pw))) {
      atomicMin(first_bad, static_cast<unsigned long long>(o));
    }
  }
}

// One thread per pooled element: the CPU's ReluMaxPoolGradGradFromArgmax, validating each code
// (an invalid one is recorded in first_bad and read as the sentinel, so nothing out of bounds).
template <typename T, typename C>
__global__ void __launch_bounds__(kThreads) GradGradKernel(const PoolParams p,
                                                           const T* __restrict__ ddz,
                                                           const C* __restrict__ codes,
                                                           T* __restrict__ ddy,
                                                           unsigned long long* first_bad,
                                                           int64_t n) {
  for (int64_t o = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; o < n;
       o += int64_t{gridDim.x} * blockDim.x) {
    const PooledIndex q = PooledIndexOf(p, o);
    const ClippedWindow win = WindowOf(p, q.ph, q.pw);
    const C c = codes[o];
    Code code{static_cast<int64_t>(c), c == CodeTraits<C>::kSentinel};
    if (!CodeValid(p, code, win)) {
      if (first_bad != nullptr) atomicMin(first_bad, static_cast<unsigned long long>(o));
      code.sentinel = true;
    }
    const int64_t r = win.row_begin + (code.sentinel ? 0 : code.value / p.code_pitch);
    const int64_t col = win.col_begin + (code.sentinel ? 0 : code.value % p.code_pitch);
    ddy[o] = MaskT(ddz[((q.img * p.in_rows + r) * p.in_cols + col) * p.lanes + q.l], !code.sentinel);
  }
}

// ------------------------------------------------------------------------------------------------
// Fast 2x2 / stride 2 kernels.

enum class FastOp { kForward, kForwardArgmax, kBackwardInput, kBackwardArgmax };

template <int kBytes>
struct Raw;
template <>
struct Raw<1> {
  using type = uint8_t;
};
template <>
struct Raw<2> {
  using type = uint16_t;
};
template <>
struct Raw<4> {
  using type = uint32_t;
};
template <>
struct Raw<8> {
  using type = uint2;
};
template <>
struct Raw<16> {
  using type = uint4;
};

// Cache hints of the fast kernels' global accesses (a tuning knob, measured by gpu_check):
// TFRP_STREAMING = 0: default caching; 1: stores evict-first (st.global.cs); 2: loads too.
#ifndef TFRP_STREAMING
#define TFRP_STREAMING 0
#endif
template <typename R>
__device__ __forceinline__ R LoadRaw(const R* p) {
#if TFRP_STREAMING >= 2
  return __ldcs(p);
#else
  return *p;
#endif
}
template <typename R>
__device__ __forceinline__ void StoreRaw(R* p, R v) {
#if TFRP_STREAMING >= 1
  __stcs(p, v);
#else
  *p = v;
#endif
}

// N values of type E, loaded/stored with the widest accesses their (aligned) size allows.
template <typename E, int N>
struct alignas(sizeof(E) * N > 16 ? 16 : sizeof(E) * N) Pack {
  E v[N];
};
template <typename E, int N>
__device__ __forceinline__ Pack<E, N> LoadPack(const E* p) {
  constexpr int kBytes = sizeof(E) * N;
  constexpr int kChunk = kBytes > 16 ? 16 : kBytes;
  using R = typename Raw<kChunk>::type;
  Pack<E, N> out;
  R* dst = reinterpret_cast<R*>(&out);
  const R* src = reinterpret_cast<const R*>(p);
#pragma unroll
  for (int i = 0; i < kBytes / kChunk; ++i) dst[i] = LoadRaw(src + i);
  return out;
}
template <typename E, int N>
__device__ __forceinline__ void StorePack(E* p, const Pack<E, N>& in) {
  constexpr int kBytes = sizeof(E) * N;
  constexpr int kChunk = kBytes > 16 ? 16 : kBytes;
  using R = typename Raw<kChunk>::type;
  const R* src = reinterpret_cast<const R*>(&in);
  R* dst = reinterpret_cast<R*>(p);
#pragma unroll
  for (int i = 0; i < kBytes / kChunk; ++i) StoreRaw(dst + i, src[i]);
}

// Geometry of the fast path, in the index type I (32 bits whenever the input fits).
template <typename I>
struct FastGeom {
  I groups;      // number of V-element groups of pooled elements
  I lane_groups; // NHWC: lanes / V; NCHW: out_cols / V
  I out_cols, out_rows, in_cols, lanes;
};

// Pooled elements per thread: V = 16 bytes / sizeof(T) (one 16-byte vector of y or dy), except
// for the NCHW backward, which takes V / 2 so that each thread's dz row segment is one 16-byte
// vector and a warp's stores cover contiguous memory.
template <typename T, FastOp kOp, bool kNchw>
__host__ __device__ constexpr int FastGroup() {
  return (kNchw && (kOp == FastOp::kBackwardInput || kOp == FastOp::kBackwardArgmax))
             ? int(16 / sizeof(T) / 2)
             : int(16 / sizeof(T));
}

// One thread per group of G pooled elements and their four window positions k = 2 * r + c.
// kNchw: the group is G adjacent output columns of one output row; the window positions of
// element j are columns 2j and 2j+1 of two 2G-element input row segments. NHWC: the group is G
// adjacent lanes of one output position; position k is one 16-byte vector.
template <typename T, typename C, FastOp kOp, bool kNchw, typename I>
__global__ void __launch_bounds__(kThreads) Fast2x2Kernel(const FastGeom<I> g,
                                                          const T* __restrict__ z,
                                                          const T* __restrict__ dy,
                                                          const C* __restrict__ codes_in,
                                                          T* __restrict__ out,
                                                          C* __restrict__ codes_out,
                                                          unsigned long long* first_bad) {
  constexpr int G = FastGroup<T, kOp, kNchw>();
  constexpr bool kReadZ = kOp != FastOp::kBackwardArgmax;
  constexpr bool kBackward = kOp == FastOp::kBackwardInput || kOp == FastOp::kBackwardArgmax;
  for (I grp = blockIdx.x * I(blockDim.x) + threadIdx.x; grp < g.groups;
       grp += I(gridDim.x) * I(blockDim.x)) {
    // o = first pooled element; in0 = first input element of the group's row-0 part.
    I o, in0, row_pitch;
    if (kNchw) {
      const I cg = grp % g.lane_groups;
      const I rowi = grp / g.lane_groups;  // img * out_rows + ph; input row 2 * rowi
      o = rowi * g.out_cols + cg * G;
      in0 = rowi * 2 * g.in_cols + cg * 2 * G;
      row_pitch = g.in_cols;
    } else {
      const I lg = grp % g.lane_groups;
      const I pix = grp / g.lane_groups;  // (img * out_rows + ph) * out_cols + pw
      const I pw = pix % g.out_cols;
      const I rowi = pix / g.out_cols;
      o = pix * g.lanes + lg * G;
      in0 = ((rowi * 2) * g.in_cols + 2 * pw) * g.lanes + lg * G;
      row_pitch = g.in_cols * g.lanes;
    }
    // x[k][j]: window position k of pooled element j.
    T x[4][G];
    if (kReadZ) {
      if (kNchw) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const Pack<T, 2 * G> row = LoadPack<T, 2 * G>(z + in0 + r * row_pitch);
#pragma unroll
          for (int j = 0; j < G; ++j) {
            x[2 * r][j] = row.v[2 * j];
            x[2 * r + 1][j] = row.v[2 * j + 1];
          }
        }
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const Pack<T, G> v = LoadPack<T, G>(z + in0 + (k >> 1) * row_pitch + (k & 1) * g.lanes);
#pragma unroll
          for (int j = 0; j < G; ++j) x[k][j] = v.v[j];
        }
      }
    }
    // Codes per element: 0..3, or -1 for the sentinel.
    int code[G];
    Pack<T, G> yv;
    if (kReadZ) {
#pragma unroll
      for (int j = 0; j < G; ++j) {
        MaxState<T> s;
        s.Init();
        int pos = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) pos = s.Take(x[k][j]) ? k : pos;
        yv.v[j] = s.bits;
        code[j] = (IsNan(x[0][j]) || !(s.m > Acc<T>(0))) ? -1 : pos;
      }
    } else {
      const Pack<C, G> cv = LoadPack<C, G>(codes_in + o);
      bool bad = false;
      int bad_j = 0;
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const C c = cv.v[j];
        const bool sentinel = c == CodeTraits<C>::kSentinel;
        const int64_t c64 = static_cast<int64_t>(c);
        const bool valid = sentinel || (c64 >= 0 && c64 < 4);
        if (!valid && !bad) {
          bad = true;
          bad_j = j;
        }
        code[j] = sentinel || !valid ? -1 : static_cast<int>(c64);
      }
      if (bad && first_bad != nullptr) {
        atomicMin(first_bad, static_cast<unsigned long long>(o + bad_j));
      }
    }
    if (kOp == FastOp::kForward || kOp == FastOp::kForwardArgmax) {
      StorePack<T, G>(out + o, yv);
      if (kOp == FastOp::kForwardArgmax) {
        Pack<C, G> cv;
#pragma unroll
        for (int j = 0; j < G; ++j) {
          cv.v[j] = code[j] < 0 ? CodeTraits<C>::kSentinel : static_cast<C>(code[j]);
        }
        StorePack<C, G>(codes_out + o, cv);
      }
    }
    if (kBackward) {
      const Pack<T, G> d = LoadPack<T, G>(dy + o);
      T dz[4][G];
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const int target = code[j] < 0 ? 0 : code[j];
        const T routed = FastRouted(d.v[j], code[j] >= 0);
#pragma unroll
        for (int k = 0; k < 4; ++k) dz[k][j] = k == target ? routed : ZeroT<T>();
      }
      if (kNchw) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          Pack<T, 2 * G> row;
#pragma unroll
          for (int j = 0; j < G; ++j) {
            row.v[2 * j] = dz[2 * r][j];
            row.v[2 * j + 1] = dz[2 * r + 1][j];
          }
          StorePack<T, 2 * G>(out + in0 + r * row_pitch, row);
        }
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          Pack<T, G> v;
#pragma unroll
          for (int j = 0; j < G; ++j) v.v[j] = dz[k][j];
          StorePack<T, G>(out + in0 + (k >> 1) * row_pitch + (k & 1) * g.lanes, v);
        }
      }
    }
  }
}

bool Aligned(const void* ptr, int64_t bytes) {
  return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0;
}

// Whether the fast path applies: 2x2 windows, stride 2, no padding, every input row and column in
// exactly one window, V-element groups that do not straddle rows/pixels, aligned pointers.
template <typename T, typename C, FastOp kOp>
bool UseFast2x2(const PoolParams& p, const void* a, const void* b, const void* c, const void* d,
                const C* codes) {
  constexpr int V = 16 / sizeof(T);
  constexpr int G = FastGroup<T, kOp, true>();  // NCHW group
  if (p.window_rows != 2 || p.window_cols != 2 || p.stride_rows != 2 || p.stride_cols != 2 ||
      p.pad_top != 0 || p.pad_left != 0 || p.in_rows != 2 * p.out_rows ||
      p.in_cols != 2 * p.out_cols || p.out_elements() == 0) {
    return false;
  }
  if (p.format == DataFormat::kNHWC ? p.lanes % V != 0 : (p.lanes != 1 || p.out_cols % G != 0)) {
    return false;
  }
  const int64_t group = p.format == DataFormat::kNHWC ? V : G;
  const int64_t code_align = sizeof(C) * group > 16 ? 16 : sizeof(C) * group;
  return Aligned(a, 16) && Aligned(b, 16) && Aligned(c, 16) && Aligned(d, 16) &&
         Aligned(codes, code_align);
}

// Grid of the fast kernels. TFRP_FAST_WAVES = 0: one thread per group; N > 0: at most N waves of
// resident blocks (8 blocks of 256 threads per multiprocessor), each thread looping over groups.
#ifndef TFRP_FAST_WAVES
#define TFRP_FAST_WAVES 0
#endif
unsigned FastGrid(int64_t groups) {
  const unsigned grid = GridFor(groups, kThreads);
  if (TFRP_FAST_WAVES <= 0) return grid;
  static std::atomic<int> sms_of[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return grid;
  int sms = sms_of[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return grid;
    sms_of[device].store(sms, std::memory_order_relaxed);
  }
  const int64_t cap = int64_t{sms} * (2048 / kThreads) * TFRP_FAST_WAVES;
  return grid < cap ? grid : static_cast<unsigned>(cap);
}

template <typename T, typename C, FastOp kOp, bool kNchw, typename I>
void LaunchFastTyped(const PoolParams& p, const T* z, const T* dy, const C* codes_in, T* out,
                     C* codes_out, unsigned long long* first_bad, cudaStream_t stream) {
  constexpr int G = FastGroup<T, kOp, kNchw>();
  FastGeom<I> g;
  g.groups = static_cast<I>(p.out_elements() / G);
  g.lane_groups = static_cast<I>(kNchw ? p.out_cols / G : p.lanes / G);
  g.out_cols = static_cast<I>(p.out_cols);
  g.out_rows = static_cast<I>(p.out_rows);
  g.in_cols = static_cast<I>(p.in_cols);
  g.lanes = static_cast<I>(p.lanes);
  Fast2x2Kernel<T, C, kOp, kNchw, I><<<FastGrid(g.groups), kThreads, 0, stream>>>(
      g, z, dy, codes_in, out, codes_out, first_bad);
}

template <typename T, typename C, FastOp kOp>
void LaunchFast(const PoolParams& p, const T* z, const T* dy, const C* codes_in, T* out,
                C* codes_out, unsigned long long* first_bad, cudaStream_t stream) {
  // 32-bit indices when every element offset (with slack for the last group) fits.
  const bool small = p.in_elements() + 64 < (int64_t{1} << 31);
  const bool nchw = p.format == DataFormat::kNCHW;
  if (small && nchw) {
    LaunchFastTyped<T, C, kOp, true, uint32_t>(p, z, dy, codes_in, out, codes_out, first_bad, stream);
  } else if (small) {
    LaunchFastTyped<T, C, kOp, false, uint32_t>(p, z, dy, codes_in, out, codes_out, first_bad, stream);
  } else if (nchw) {
    LaunchFastTyped<T, C, kOp, true, int64_t>(p, z, dy, codes_in, out, codes_out, first_bad, stream);
  } else {
    LaunchFastTyped<T, C, kOp, false, int64_t>(p, z, dy, codes_in, out, codes_out, first_bad, stream);
  }
}

cudaError_t Finish() {
  // Launch errors (bad configuration, no device, ...) surface here; execution errors later.
  return cudaGetLastError();
}

// The narrowest workspace code type, as in relu_max_pool_cpu_kernels.h (WithWorkspaceCodeType).
template <typename Fn>
cudaError_t WithWorkspaceCodeType(const PoolParams& p, Fn fn) {
  if (p.code_positions < CodeTraits<uint8_t>::kSentinel) return fn(uint8_t{});
  if (p.code_positions < CodeTraits<uint16_t>::kSentinel) return fn(uint16_t{});
  return fn(int32_t{});
}

}  // namespace

template <typename T>
cudaError_t ReluMaxPoolForwardGpu(const PoolParams& p, const T* z, T* y, cudaStream_t stream) {
  cudaGetLastError();  // clear an earlier non-sticky error so that Finish reports ours
  const int64_t n = p.out_elements();
  if (n == 0) return cudaSuccess;
  if (UseFast2x2<T, uint8_t, FastOp::kForward>(p, z, y, nullptr, nullptr, nullptr)) {
    LaunchFast<T, uint8_t, FastOp::kForward>(p, z, nullptr, nullptr, y, nullptr, nullptr, stream);
  } else {
    GenericForwardKernel<T, uint8_t, true, false>
        <<<GridFor(n, kThreads), kThreads, 0, stream>>>(p, z, y, nullptr, n);
  }
  return Finish();
}

template <typename T, typename C>
cudaError_t ReluMaxPoolForwardWithArgmaxGpu(const PoolParams& p, const T* z, T* y, C* argmax,
                                            cudaStream_t stream) {
  cudaGetLastError();
  const int64_t n = p.out_elements();
  if (n == 0) return cudaSuccess;
  if (UseFast2x2<T, C, FastOp::kForwardArgmax>(p, z, y, nullptr, nullptr, argmax)) {
    LaunchFast<T, C, FastOp::kForwardArgmax>(p, z, nullptr, nullptr, y, argmax, nullptr, stream);
  } else {
    GenericForwardKernel<T, C, true, true>
        <<<GridFor(n, kThreads), kThreads, 0, stream>>>(p, z, y, argmax, n);
  }
  return Finish();
}

template <typename T>
cudaError_t ReluMaxPoolBackwardFromInputGpu(const PoolParams& p, const T* z, const T* dy, T* dz,
                                            void* workspace, cudaStream_t stream) {
  cudaGetLastError();
  const int64_t n = p.in_elements();
  if (n == 0) return cudaSuccess;
  if (p.out_elements() == 0) return cudaMemsetAsync(dz, 0, n * sizeof(T), stream);
  if (UseFast2x2<T, uint8_t, FastOp::kBackwardInput>(p, z, dy, dz, nullptr, nullptr)) {
    LaunchFast<T, uint8_t, FastOp::kBackwardInput>(p, z, dy, nullptr, dz, nullptr, nullptr, stream);
    return Finish();
  }
  if (p.windows_disjoint()) {
    GenericGatherKernel<T, RecomputedCodes<T>><<<GridFor(n, kThreads), kThreads, 0, stream>>>(
        p, RecomputedCodes<T>{z}, dy, dz, nullptr, n);
    return Finish();
  }
  // Overlapping windows: codes into the workspace (z read once), then the gather.
  return WithWorkspaceCodeType(p, [&](auto c) {
    using C = decltype(c);
    C* codes = static_cast<C*>(workspace);
    const int64_t m = p.out_elements();
    GenericForwardKernel<T, C, false, true>
        <<<GridFor(m, kThreads), kThreads, 0, stream>>>(p, z, nullptr, codes, m);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    GenericGatherKernel<T, StoredCodes<C>><<<GridFor(n, kThreads), kThreads, 0, stream>>>(
        p, StoredCodes<C>{codes}, dy, dz, nullptr, n);
    return Finish();
  });
}

template <typename T, typename C>
cudaError_t ReluMaxPoolBackwardFromArgmaxGpu(const PoolParams& p, const T* dy, const C* argmax,
                                             T* dz, unsigned long long* first_bad,
                                             cudaStream_t stream) {
  cudaGetLastError();
  if (first_bad != nullptr) {
    const cudaError_t err = cudaMemsetAsync(first_bad, 0xff, sizeof(*first_bad), stream);
    if (err != cudaSuccess) return err;
  }
  const int64_t n = p.in_elements();
  if (n == 0) return cudaSuccess;
  if (p.out_elements() == 0) return cudaMemsetAsync(dz, 0, n * sizeof(T), stream);
  if (UseFast2x2<T, C, FastOp::kBackwardArgmax>(p, dy, dz, nullptr, nullptr, argmax)) {
    LaunchFast<T, C, FastOp::kBackwardArgmax>(p, nullptr, dy, argmax, dz, nullptr, first_bad,
                                              stream);
  } else {
    GenericGatherKernel<T, StoredCodes<C>><<<GridFor(n, kThreads), kThreads, 0, stream>>>(
        p, StoredCodes<C>{argmax}, dy, dz, first_bad, n);
  }
  return Finish();
}

template <typename T, typename C>
cudaError_t ReluMaxPoolGradGradFromArgmaxGpu(const PoolParams& p, const T* ddz, const C* argmax,
                                             T* ddy, unsigned long long* first_bad,
                                             cudaStream_t stream) {
  cudaGetLastError();
  if (first_bad != nullptr) {
    const cudaError_t err = cudaMemsetAsync(first_bad, 0xff, sizeof(*first_bad), stream);
    if (err != cudaSuccess) return err;
  }
  const int64_t n = p.out_elements();
  if (n == 0) return cudaSuccess;
  GradGradKernel<T, C><<<GridFor(n, kThreads), kThreads, 0, stream>>>(p, ddz, argmax, ddy,
                                                                       first_bad, n);
  return Finish();
}

template <typename C>
cudaError_t FindInvalidArgmaxGpu(const PoolParams& p, const C* argmax, void* scratch,
                                 int64_t* result, cudaStream_t stream) {
  cudaGetLastError();
  *result = -1;
  const int64_t n = p.out_elements();
  if (n == 0) return cudaSuccess;
  auto* bad = static_cast<unsigned long long*>(scratch);
  cudaError_t err = cudaMemsetAsync(bad, 0xff, sizeof(*bad), stream);
  if (err != cudaSuccess) return err;
  FindInvalidKernel<C><<<GridFor(n, kThreads), kThreads, 0, stream>>>(p, argmax, bad, n);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  unsigned long long host = 0;
  if ((err = cudaMemcpyAsync(&host, bad, sizeof(host), cudaMemcpyDeviceToHost, stream)) != cudaSuccess) {
    return err;
  }
  if ((err = cudaStreamSynchronize(stream)) != cudaSuccess) return err;
  *result = host == ~0ull ? -1 : static_cast<int64_t>(host);
  return cudaSuccess;
}

#define TFRP_GPU_INSTANTIATE_T(T)                                                                \
  template cudaError_t ReluMaxPoolForwardGpu<T>(const PoolParams&, const T*, T*, cudaStream_t);  \
  template cudaError_t ReluMaxPoolBackwardFromInputGpu<T>(const PoolParams&, const T*, const T*, \
                                                          T*, void*, cudaStream_t);
#define TFRP_GPU_INSTANTIATE_TC(T, C)                                                             \
  template cudaError_t ReluMaxPoolForwardWithArgmaxGpu<T, C>(const PoolParams&, const T*, T*, C*, \
                                                             cudaStream_t);                       \
  template cudaError_t ReluMaxPoolBackwardFromArgmaxGpu<T, C>(                                    \
      const PoolParams&, const T*, const C*, T*, unsigned long long*, cudaStream_t);              \
  template cudaError_t ReluMaxPoolGradGradFromArgmaxGpu<T, C>(                                    \
      const PoolParams&, const T*, const C*, T*, unsigned long long*, cudaStream_t);
#define TFRP_GPU_INSTANTIATE_ALL_C(T) \
  TFRP_GPU_INSTANTIATE_T(T)           \
  TFRP_GPU_INSTANTIATE_TC(T, uint8_t) \
  TFRP_GPU_INSTANTIATE_TC(T, uint16_t) \
  TFRP_GPU_INSTANTIATE_TC(T, int32_t)

TFRP_GPU_INSTANTIATE_ALL_C(float)
TFRP_GPU_INSTANTIATE_ALL_C(double)
TFRP_GPU_INSTANTIATE_ALL_C(Half)
TFRP_GPU_INSTANTIATE_ALL_C(BFloat16)

template cudaError_t FindInvalidArgmaxGpu<uint8_t>(const PoolParams&, const uint8_t*, void*, int64_t*, cudaStream_t);
template cudaError_t FindInvalidArgmaxGpu<uint16_t>(const PoolParams&, const uint16_t*, void*, int64_t*, cudaStream_t);
template cudaError_t FindInvalidArgmaxGpu<int32_t>(const PoolParams&, const int32_t*, void*, int64_t*, cudaStream_t);

}  // namespace tf_relupool
