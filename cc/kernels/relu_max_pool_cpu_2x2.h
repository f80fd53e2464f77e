// The explicit vector loops for 2x2 windows with stride 2 in float and bfloat16 (what CNN training
// uses): forward (max and window code of kVecLanes outputs from four vector loads) and backward
// (kVecLanes codes and dy values expanded into the four dz values of each window), with
// prefetching and streaming stores. relu_max_pool_cpu_kernels.cc calls them for the rows whose
// windows lie inside the input and takes the rest with its general loops.
//
// Compiled once per instruction set with the kernel source (relu_max_pool_cpu_isa.h), on
// relu_max_pool_cpu_simd.h's primitives; without TFRP_CPU_SIMD, stubs that the general loops never
// call. The rules of relu_max_pool_cpu_kernels.cc hold here: exact IEEE operations in a fixed
// order, no a * b + c, no max/min instructions, bitwise equal to the general loops.
#ifndef TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_2X2_H_
#define TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_2X2_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "numeric.h"
#include "relu_max_pool.h"
#include "relu_max_pool_cpu_element.h"
#include "relu_max_pool_cpu_isa.h"
#include "relu_max_pool_cpu_simd.h"

TFRP_CPU_TARGET_BEGIN
namespace {

// ---- 2x2 windows, stride 2 (float and bfloat16) ----
//
// Per output element, the four window values v0..v3 in row-major order. The forward's max from
// the lowest value with `max < relu(v)` equals the scan of RowScan; its code is the first position
// holding that max when the max is positive and v0 is not NaN (the stock gradient's argmax, see
// relu_max_pool.h), else the sentinel. Routing a positive max to the FIRST position equal to it
// is the scan's rule: later positions take over only when strictly greater.

#if !TFRP_CPU_SIMD
// No vector extensions in this build: the general loops do everything.
constexpr int kVecBytes = 4;
constexpr int kVecLanes = 1;
constexpr size_t kStreamChunk = 4;
template <typename T>
constexpr bool kHas2x2Path = false;
template <typename T>
inline bool Use2x2Path(const PoolParams&) { return false; }
inline int64_t FullRows2x2(const PoolParams&) { return 0; }
inline int64_t FullCols2x2(const PoolParams&) { return 0; }
template <typename T, bool kY, bool kCodes, bool kStream>
void Forward2x2Rows(const PoolParams&, const T*, int64_t, int64_t, int64_t, T*, uint8_t*) {}
template <typename T, bool kFromInput, bool kStream>
void Backward2x2Rows(const PoolParams&, const T*, const uint8_t*, const T*, int64_t, int64_t,
                     int64_t, T*) {}
inline void StreamFence() {}
#else
template <typename T>
constexpr bool kHas2x2Path = VecType<T>::kSupported;
template <typename T>
inline bool Use2x2Path(const PoolParams& p) {
  return kHas2x2Path<T> && p.window_rows == 2 && p.window_cols == 2 &&
         p.stride_rows == 2 && p.stride_cols == 2 && p.pad_top == 0 && p.pad_left == 0;
}
// Output rows / columns [0, n) whose 2x2 windows lie wholly inside the input.
inline int64_t FullRows2x2(const PoolParams& p) { return std::min(p.in_rows / 2, p.out_rows); }
inline int64_t FullCols2x2(const PoolParams& p) { return std::min(p.in_cols / 2, p.out_cols); }

// One output element (scalar; the tails of the vector loops). code: 0..3, or -1 for the sentinel.
template <typename A>
TFRP_VEC_INLINE void Pool4(A v0, A v1, A v2, A v3, A lowest, A* max, int32_t* code) {
  const A r0 = Relu(v0), r1 = Relu(v1), r2 = Relu(v2), r3 = Relu(v3);
  A m = lowest;
  m = SelectValue(m < r0, r0, m);
  m = SelectValue(m < r1, r1, m);
  m = SelectValue(m < r2, r2, m);
  m = SelectValue(m < r3, r3, m);
  int32_t pos = r2 == m ? 2 : 3;
  pos = r1 == m ? 1 : pos;
  pos = r0 == m ? 0 : pos;
  const bool none = (v0 != v0) | !(m > A(0));
  *max = m;
  *code = none ? -1 : pos;
}

// mask ? a : b lane by lane, as a select (see SelectValue): `a` passes through an empty asm, so
// GCC cannot see the select as a max of the values compared.
TFRP_VEC_INLINE VecF VecSelect(VecI mask, VecF a, VecF b) {
  asm("" : "+v"(a));
  return mask ? a : b;
}
TFRP_VEC_INLINE VecF VecRelu(VecF v) { return VecSelect(v < VecF{}, VecF{}, v); }

// kVecLanes output elements; code lanes hold 0..3 or `sentinel`.
TFRP_VEC_INLINE void Pool4Vec(VecF v0, VecF v1, VecF v2, VecF v3, VecF lowest,
                              uint32_t sentinel, VecF* max, VecU* code) {
  const VecF zero = {};
  const VecF r0 = VecRelu(v0), r1 = VecRelu(v1), r2 = VecRelu(v2), r3 = VecRelu(v3);
  VecF m = lowest;
  m = VecSelect(m < r0, r0, m);
  m = VecSelect(m < r1, r1, m);
  m = VecSelect(m < r2, r2, m);
  m = VecSelect(m < r3, r3, m);
  VecU pos = r2 == m ? SplatU(2) : SplatU(3);
  pos = r1 == m ? SplatU(1) : pos;
  pos = r0 == m ? SplatU(0) : pos;
  const VecI none = (v0 != v0) | ~(m > zero);
  *max = m;
  *code = none ? SplatU(sentinel) : pos;
}

// The four dz values (as T bits) of one window from its code and dy, as RowGrad::Set/Write:
// dy + 0 at the code's position; for the sentinel, (dy + 0) * 0 at position 0; +0 elsewhere.
template <typename T>
TFRP_VEC_INLINE void Scatter4(int32_t code, T dy, Bits<T> out[4]) {
  const T zero = ValueTraits<T>::FromAcc(Acc<T>(0));
  const T g = AddAcc(zero, dy);
  const Bits<T> hit = ToBits(g);
  const Bits<T> first = code < 0 ? ToBits(MaskAcc(g, false)) : Bits<T>(0);
  out[0] = code == 0 ? hit : first;
  out[1] = code == 1 ? hit : Bits<T>(0);
  out[2] = code == 2 ? hit : Bits<T>(0);
  out[3] = code == 3 ? hit : Bits<T>(0);
}
template <typename T>
TFRP_VEC_INLINE void Scatter4Vec(VecU code, VecF dy, uint32_t sentinel, VecU out[4]) {
  using V = VecType<T>;
  // AddAcc(+0, dy), then MaskAcc(that, false): +0 + dy and (+0 + dy) * 0 are dy, a zero or a
  // NaN (or, under flush-to-zero, a flushed denormal: zero), all exact in T.
  const VecU hit = V::RoundExactOrNaN(VecF{} + dy);
  const VecU masked = V::RoundExactOrNaN(V::Widen(hit) * SplatF(0.0f));
  const VecU zero = {};
  const VecU first = code == sentinel ? masked : zero;
  out[0] = code == 0u ? hit : first;
  out[1] = code == 1u ? hit : zero;
  out[2] = code == 2u ? hit : zero;
  out[3] = code == 3u ? hit : zero;
}

// Calls vec(i, done) for i = 0, kVecLanes, 2 * kVecLanes, ... with done = 0 and, when n is not a
// multiple of kVecLanes, once more for the last kVecLanes elements, overlapping the previous
// call: done = how many of them that call wrote already (they are computed and written twice,
// with the same bits, which is cheaper than a scalar tail; streaming stores leave them out).
// Calls scalar(i) for every i when n < kVecLanes. Outputs never alias inputs (the OpKernels
// allocate every output), so a second write cannot change what is read.
template <typename Vec, typename Scalar>
TFRP_VEC_INLINE void ForEachVectorOverlap(int64_t n, Vec vec, Scalar scalar) {
  if (n < kVecLanes) {
    for (int64_t i = 0; i < n; ++i) scalar(i);
    return;
  }
  int64_t i = 0;
  for (; i + kVecLanes <= n; i += kVecLanes) vec(i, 0);
  if (i < n) vec(n - kVecLanes, i - (n - kVecLanes));
}
// The same with vec(i).
template <typename Vec, typename Scalar>
TFRP_VEC_INLINE void ForEachVector(int64_t n, Vec vec, Scalar scalar) {
  ForEachVectorOverlap(n, [&](int64_t i, int64_t) { vec(i); }, scalar);
}

// How far ahead of the loads the 2x2 loops prefetch z: the hardware prefetchers alone left the
// forward 10-25% slower (they stop at every 4 KiB page, and a unit reads two rows at once).
// Measured on an AMD EPYC (Zen 4) from 0 to 8 KiB ahead: 8 KiB was best overall for NHWC (two
// rows of a small image ahead, or the next image's), no distance mattered much for NCHW.
constexpr int64_t kPrefetchBytes = 8192;

// Prefetches the cache lines of [p, p + bytes) kPrefetchBytes ahead (a hint: never faults).
template <typename T>
TFRP_VEC_INLINE void PrefetchAhead(const T* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p) + kPrefetchBytes;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b);
}

// NCHW planes of at most kVecLanes / 2 output columns whose 2x2 windows tile them exactly (input
// width and height twice the output's, no padding), on the AVX-512 path: a row is too narrow for
// a vector of its own, but the input rows of consecutive output rows follow one another in
// memory (the planes of a tensor do too), so k = kVecLanes / out_cols whole output rows share a
// vector. Their 4 * out_cols * k input values (at most 64) are loaded as four vectors, and
// permutes pick each window's four values out of them; the outputs (y, codes, dy) of the k rows
// are consecutive too. The backward puts the four window gradients back in place the same way.
#ifdef TFRP_CPU_ISA_AVX512
// Lane i of the result: element idx[i] (0..63) of the 64 values in r[0..3].
TFRP_VEC_INLINE VecF Pick64(const VecF r[4], VecU idx) {
  const __m512 lo = _mm512_permutex2var_ps(r[0], (__m512i)idx, r[1]);  // uses idx & 31
  const __m512 hi = _mm512_permutex2var_ps(r[2], (__m512i)idx, r[3]);
  return _mm512_mask_blend_ps(_mm512_cmpge_epu32_mask((__m512i)idx, _mm512_set1_epi32(32)), lo, hi);
}

// The n <= 64 values at p as four vectors (lanes past n: 0).
template <typename T>
TFRP_VEC_INLINE void Load64(const T* p, int64_t n, VecF r[4]) {
  for (int q = 0; q < 4; ++q) {
    const int64_t left = n - q * kVecLanes;
    r[q] = left >= kVecLanes ? VecType<T>::Load(p + q * kVecLanes)
           : left > 0        ? VecType<T>::LoadPartial(p + q * kVecLanes, left)
                             : VecF{};
  }
}

struct FlatRows {
  int64_t cols, k;
  VecU src[4];      // window position p (0..3), lane i: index of its value in the 64 loaded
  VecU dst[4];      // dz vector q, lane e: lane of the window gradient it receives, + 16 if the
                    // gradient is that of a right-hand position (permutes of two vectors)
  __mmask16 bottom[4];  // dz vector q: lanes in a window's bottom row
  explicit FlatRows(int64_t out_cols) : cols(out_cols), k(kVecLanes / out_cols) {
    for (int64_t i = 0; i < kVecLanes; ++i) {
      const int64_t j = i / cols, pw = i % cols;
      const bool used = j < k;
      const uint32_t tl = used ? static_cast<uint32_t>(j * 4 * cols + 2 * pw) : 0;
      src[0][i] = tl;
      src[1][i] = used ? tl + 1 : 0;
      src[2][i] = used ? tl + static_cast<uint32_t>(2 * cols) : 0;
      src[3][i] = used ? tl + static_cast<uint32_t>(2 * cols) + 1 : 0;
    }
    for (int q = 0; q < 4; ++q) {
      bottom[q] = 0;
      for (int64_t l = 0; l < kVecLanes; ++l) {
        const int64_t e = q * kVecLanes + l;  // index in the k rows' dz values
        const int64_t j = e / (4 * cols), r = e % (4 * cols);
        const int64_t t = r / (2 * cols), c = r % (2 * cols);
        const bool used = j < k;
        dst[q][l] = used ? static_cast<uint32_t>(j * cols + c / 2 + (c % 2) * kVecLanes) : 0;
        if (used && t == 1) bottom[q] |= static_cast<__mmask16>(1u << l);
      }
    }
  }

  // Pools the windows of a group of rows from its n <= 64 input values at z.
  template <typename T>
  TFRP_VEC_INLINE void Pool(const T* z, int64_t n, VecF lowest, VecF* max, VecU* code) const {
    VecF r[4];
    Load64(z, n, r);
    Pool4Vec(Pick64(r, src[0]), Pick64(r, src[1]), Pick64(r, src[2]), Pick64(r, src[3]), lowest,
             ArgmaxSentinel<uint8_t>(), max, code);
  }
};

template <typename T, bool kY, bool kCodes>
void ForwardFlatRows(const PoolParams& p, const T* __restrict z, int64_t u_begin, int64_t u_end,
                     T* __restrict y, uint8_t* __restrict codes) {
  using V = VecType<T>;
  const FlatRows f(p.out_cols);
  const VecF vlowest = SplatF(ValueTraits<T>::Lowest());
  for (int64_t u = u_begin; u < u_end; u += f.k) {
    const int64_t n = std::min(f.k, u_end - u) * f.cols;  // outputs of this vector
    VecF m;
    VecU code;
    f.Pool(z + 4 * u * f.cols, 4 * n, vlowest, &m, &code);
    if (kY) V::StorePartial(y + u * f.cols, V::Exact(m), n);
    if (kCodes) NarrowToBytesPartial(code, codes + u * f.cols, n);
  }
}

template <typename T, bool kFromInput>
void BackwardFlatRows(const PoolParams& p, const T* __restrict z, const uint8_t* __restrict codes,
                      const T* __restrict dy, int64_t u_begin, int64_t u_end, T* __restrict dz) {
  using V = VecType<T>;
  const FlatRows f(p.out_cols);
  const VecF vlowest = SplatF(ValueTraits<T>::Lowest());
  constexpr uint32_t kSentinel = ArgmaxSentinel<uint8_t>();
  for (int64_t u = u_begin; u < u_end; u += f.k) {
    const int64_t n = std::min(f.k, u_end - u) * f.cols;
    VecU code;
    if (kFromInput) {
      VecF m;
      f.Pool(z + 4 * u * f.cols, 4 * n, vlowest, &m, &code);
    } else {
      code = WidenBytesPartial(codes + u * f.cols, n);
    }
    VecU g[4];
    Scatter4Vec<T>(code, V::LoadPartial(dy + u * f.cols, n), kSentinel, g);
    T* d = dz + 4 * u * f.cols;
    for (int q = 0; q < 4; ++q) {
      const int64_t left = 4 * n - q * kVecLanes;
      if (left <= 0) break;
      const __m512i idx = (__m512i)f.dst[q];
      const VecU v = (VecU)_mm512_mask_blend_epi32(
          f.bottom[q], _mm512_permutex2var_epi32((__m512i)g[0], idx, (__m512i)g[1]),
          _mm512_permutex2var_epi32((__m512i)g[2], idx, (__m512i)g[3]));
      if (left >= kVecLanes) {
        V::template Store<false>(d + q * kVecLanes, v);
      } else {
        V::StorePartial(d + q * kVecLanes, v, left);
      }
    }
  }
}
#else
// Declared only, for the discarded `if constexpr (kPartialVectors)` branches: never instantiated.
template <typename T, bool kY, bool kCodes>
void ForwardFlatRows(const PoolParams& p, const T* z, int64_t u_begin, int64_t u_end, T* y,
                     uint8_t* codes);
template <typename T, bool kFromInput>
void BackwardFlatRows(const PoolParams& p, const T* z, const uint8_t* codes, const T* dy,
                      int64_t u_begin, int64_t u_end, T* dz);
#endif

// The windows of the first n < kVecLanes outputs of an NCHW row whose two input rows start at r0
// and r1, as one partial vector (kPartialVectors only).
template <typename T>
TFRP_VEC_INLINE void PoolRowPartial(const T* r0, const T* r1, int64_t n, VecF lowest, VecF* max,
                                    VecU* code) {
  VecF v0, v1, v2, v3;
  VecType<T>::LoadPairsPartial(r0, n, &v0, &v1);
  VecType<T>::LoadPairsPartial(r1, n, &v2, &v3);
  Pool4Vec(v0, v1, v2, v3, lowest, ArgmaxSentinel<uint8_t>(), max, code);
}

// Whether output rows with `cols` full columns take ForwardFlatRows / BackwardFlatRows.
inline bool UseFlatRows(const PoolParams& p, int64_t cols) {
  return kPartialVectors && p.lanes == 1 && cols == p.out_cols && 2 * p.out_cols <= kVecLanes &&
         p.in_cols == 2 * p.out_cols && p.in_rows == 2 * p.out_rows && p.pad_top == 0 &&
         p.pad_left == 0 && p.window_rows == 2 && p.window_cols == 2 && p.stride_rows == 2 &&
         p.stride_cols == 2;
}

// Units (output rows) [u_begin, u_end), all with full windows: their output columns [0, cols).
// Calls row(u, img, ph) for each; the loops below take a whole run of rows per call, because an
// NCHW row of a small image is a single vector and a call per row would cost more than the row.
template <typename Row>
TFRP_VEC_INLINE void ForEachRow(const PoolParams& p, int64_t u_begin, int64_t u_end, Row row) {
  int64_t img = u_begin / p.out_rows, ph = u_begin % p.out_rows;
  for (int64_t u = u_begin; u < u_end; ++u) {
    row(u, img, ph);
    if (++ph == p.out_rows) {
      ph = 0;
      ++img;
    }
  }
}

// Forward of output rows [u_begin, u_end), columns [0, cols) (all windows inside the input):
// y (kY) and uint8 codes (kCodes), with streaming stores when kStream (StreamForward).
template <typename T, bool kY, bool kCodes, bool kStream>
void Forward2x2Rows(const PoolParams& p, const T* __restrict z, int64_t u_begin, int64_t u_end,
                    int64_t cols, T* __restrict y, uint8_t* __restrict codes) {
  if constexpr (kPartialVectors && !kStream) {
    if (UseFlatRows(p, cols)) return ForwardFlatRows<T, kY, kCodes>(p, z, u_begin, u_end, y, codes);
  }
  using V = VecType<T>;
  const int64_t L = p.lanes;
  const int64_t out_row = p.out_cols * L;
  const Acc<T> lowest = ValueTraits<T>::Lowest();
  const VecF vlowest = SplatF(lowest);
  constexpr uint32_t kSentinel = ArgmaxSentinel<uint8_t>();
  ForEachRow(p, u_begin, u_end, [&](int64_t u, int64_t img, int64_t ph) {
    const T* r0 = z + (img * p.in_rows + 2 * ph) * p.in_cols * L;
    const T* r1 = r0 + p.in_cols * L;
    T* yr = kY ? y + u * out_row : nullptr;
    uint8_t* cr = kCodes ? codes + u * out_row : nullptr;
    // Output element o from the window whose first value is at offset `at` of both input rows;
    // `next` is the offset of the window's second column.
    auto scalar = [&](int64_t o, int64_t at, int64_t next) {
      Acc<T> m;
      int32_t code;
      Pool4(LoadAcc(r0, at), LoadAcc(r0, at + next), LoadAcc(r1, at), LoadAcc(r1, at + next),
            lowest, &m, &code);
      if (kY) yr[o] = ValueTraits<T>::FromAcc(m);
      if (kCodes) cr[o] = static_cast<uint8_t>(code < 0 ? kSentinel : code);
    };
    auto store = [&](VecF m, VecU code, int64_t o) {
      if (kY) V::template Store<kStream>(yr + o, V::Exact(m));  // m is one of T's values: exact
      if (kCodes) NarrowToBytes<kStream>(code, cr + o);
    };
    if (L == 1) {
      if constexpr (kPartialVectors) {
        if (cols < kVecLanes) {  // the whole row in one partial vector
          VecF m;
          VecU code;
          PoolRowPartial(r0, r1, cols, vlowest, &m, &code);
          if (kY) V::StorePartial(yr, V::Exact(m), cols);
          if (kCodes) NarrowToBytesPartial(code, cr, cols);
          return;
        }
      }
      // NCHW: kVecLanes outputs of the row from 2 * kVecLanes values of each input row.
      ForEachVector(
          cols,
          [&](int64_t pw) {
            VecF v0, v1, v2, v3, m;
            VecU code;
            PrefetchAhead(r0 + 2 * pw, 2 * kVecLanes * sizeof(T));
            PrefetchAhead(r1 + 2 * pw, 2 * kVecLanes * sizeof(T));
            V::LoadPairs(r0 + 2 * pw, &v0, &v1);
            V::LoadPairs(r1 + 2 * pw, &v2, &v3);
            Pool4Vec(v0, v1, v2, v3, vlowest, kSentinel, &m, &code);
            store(m, code, pw);
          },
          [&](int64_t pw) { scalar(pw, 2 * pw, 1); });
      return;
    }
    // NHWC: kVecLanes channels of one window at a time.
    for (int64_t pw = 0; pw < cols; ++pw) {
      const int64_t at = 2 * pw * L;
      PrefetchAhead(r0 + at, 2 * L * sizeof(T));
      PrefetchAhead(r1 + at, 2 * L * sizeof(T));
      ForEachVector(
          L,
          [&](int64_t l) {
            VecF m;
            VecU code;
            Pool4Vec(V::Load(r0 + at + l), V::Load(r0 + at + L + l), V::Load(r1 + at + l),
                     V::Load(r1 + at + L + l), vlowest, kSentinel, &m, &code);
            store(m, code, pw * L + l);
          },
          [&](int64_t l) { scalar(pw * L + l, at + l, L); });
    }
  });
}

// Backward of output rows [u_begin, u_end), columns [0, cols) (all windows inside the input),
// into dz rows 2 * ph and 2 * ph + 1 of each. The codes are read (kFromInput false: `codes`, from
// the forward) or computed from z (kFromInput: the keep="input" backward, which reads z once).
template <typename T, bool kFromInput, bool kStream>
void Backward2x2Rows(const PoolParams& p, const T* __restrict z, const uint8_t* __restrict codes,
                     const T* __restrict dy, int64_t u_begin, int64_t u_end, int64_t cols,
                     T* __restrict dz) {
  if constexpr (kPartialVectors && !kStream) {
    if (UseFlatRows(p, cols)) {
      return BackwardFlatRows<T, kFromInput>(p, z, codes, dy, u_begin, u_end, dz);
    }
  }
  using V = VecType<T>;
  const int64_t L = p.lanes;
  const int64_t row = p.in_cols * L;
  const int64_t out_row = p.out_cols * L;
  const Acc<T> lowest = ValueTraits<T>::Lowest();
  const VecF vlowest = SplatF(lowest);
  constexpr uint32_t kSentinel = ArgmaxSentinel<uint8_t>();
  ForEachRow(p, u_begin, u_end, [&](int64_t u, int64_t img, int64_t ph) {
    const int64_t first = (img * p.in_rows + 2 * ph) * row;
    T* d0 = dz + first;
    T* d1 = d0 + row;
    const T* r0 = kFromInput ? z + first : nullptr;
    const T* r1 = kFromInput ? r0 + row : nullptr;
    const uint8_t* cr = kFromInput ? nullptr : codes + u * out_row;
    const T* gr = dy + u * out_row;
    AliasBits<T>* b0 = reinterpret_cast<AliasBits<T>*>(d0);
    AliasBits<T>* b1 = reinterpret_cast<AliasBits<T>*>(d1);
    // Output element o, whose window starts at offset `at` of both rows; `next` is the offset of
    // the window's second column.
    auto scalar = [&](int64_t o, int64_t at, int64_t next) {
      int32_t code;
      if (kFromInput) {
        Acc<T> m;
        Pool4(LoadAcc(r0, at), LoadAcc(r0, at + next), LoadAcc(r1, at), LoadAcc(r1, at + next),
              lowest, &m, &code);
      } else {
        code = cr[o] == kSentinel ? -1 : cr[o];
      }
      Bits<T> s[4];
      Scatter4<T>(code, gr[o], s);
      b0[at] = s[0];
      b0[at + next] = s[1];
      b1[at] = s[2];
      b1[at + next] = s[3];
    };
    // kVecLanes codes of output elements [o, o + kVecLanes); the windows start at offset `at` of
    // both rows, as pairs (NCHW) or at `at` and `at + L` (NHWC).
    auto vector_code = [&](int64_t o, int64_t at, bool pairs) -> VecU {
      if (!kFromInput) return WidenBytes(cr + o);
      VecF v0, v1, v2, v3, m;
      VecU code;
      const int64_t bytes = (pairs ? 2 * kVecLanes : kVecLanes) * int64_t(sizeof(T));
      PrefetchAhead(r0 + at, bytes);
      PrefetchAhead(r1 + at, bytes);
      if (!pairs) {
        PrefetchAhead(r0 + at + L, bytes);
        PrefetchAhead(r1 + at + L, bytes);
      }
      if (pairs) {
        V::LoadPairs(r0 + at, &v0, &v1);
        V::LoadPairs(r1 + at, &v2, &v3);
      } else {
        v0 = V::Load(r0 + at);
        v1 = V::Load(r0 + at + L);
        v2 = V::Load(r1 + at);
        v3 = V::Load(r1 + at + L);
      }
      Pool4Vec(v0, v1, v2, v3, vlowest, kSentinel, &m, &code);
      return code;
    };
    if (L == 1) {
      if constexpr (kPartialVectors) {
        if (cols < kVecLanes) {  // the whole row in one partial vector
          VecU code;
          if (kFromInput) {
            VecF m;
            PoolRowPartial(r0, r1, cols, vlowest, &m, &code);
          } else {
            code = WidenBytesPartial(cr, cols);
          }
          VecU out[4];
          Scatter4Vec<T>(code, V::LoadPartial(gr, cols), kSentinel, out);
          V::StorePairsPartial(d0, out[0], out[1], cols);
          V::StorePairsPartial(d1, out[2], out[3], cols);
          return;
        }
      }
      ForEachVectorOverlap(
          cols,
          [&](int64_t pw, int64_t done) {
            VecU out[4];
            Scatter4Vec<T>(vector_code(pw, 2 * pw, true), V::Load(gr + pw), kSentinel, out);
            const size_t skip = 2 * done * sizeof(T);
            V::template StorePairs<kStream>(d0 + 2 * pw, out[0], out[1], skip);
            V::template StorePairs<kStream>(d1 + 2 * pw, out[2], out[3], skip);
          },
          [&](int64_t pw) { scalar(pw, 2 * pw, 1); });
      return;
    }
    for (int64_t pw = 0; pw < cols; ++pw) {
      const int64_t at = 2 * pw * L;
      ForEachVectorOverlap(
          L,
          [&](int64_t l, int64_t done) {
            VecU out[4];
            Scatter4Vec<T>(vector_code(pw * L + l, at + l, false), V::Load(gr + pw * L + l),
                           kSentinel, out);
            const size_t skip = done * sizeof(T);
            V::template Store<kStream>(d0 + at + l, out[0], skip);
            V::template Store<kStream>(d0 + at + L + l, out[1], skip);
            V::template Store<kStream>(d1 + at + l, out[2], skip);
            V::template Store<kStream>(d1 + at + L + l, out[3], skip);
          },
          [&](int64_t l) { scalar(pw * L + l, at + l, L); });
    }
  });
}
#endif  // TFRP_CPU_SIMD

}  // namespace
TFRP_CPU_TARGET_END

#endif  // TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_2X2_H_
