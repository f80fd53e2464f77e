// CPU kernels for fused ReLU + max pooling; the reference the CUDA kernels are checked against.
//
// NO include guard: relu_max_pool_cpu.cc includes this file once per instruction set (baseline
// x86-64, AVX2, AVX-512), each time inside its own namespace and `#pragma GCC target` region,
// after relu_max_pool_cpu_simd.h, and dispatches at run time. One source for every path, so the
// paths cannot drift apart; they are bitwise identical because every operation here is an exact
// IEEE operation (compare, select by bits, add, multiply by 0 or 1) done in a fixed order,
// whatever the vector width. Keep it so: no a * b + c anywhere (the AVX-512 target allows FMA,
// and every build passes -ffp-contract=off as a second guard), no reassociated sums, no max/min
// instructions (SelectValue says why).
//
// Layout: (images x rows x cols x lanes), see PoolParams. Loops keep lanes innermost so that NHWC
// channels vectorise. Work is split over (image, row) units; each unit writes a disjoint part of
// the output and no result depends on the split, so any thread count gives identical bits.
//
// Two kinds of loops:
//  - general ones (any window, stride, padding, dtype), written in plain C++ for the compiler to
//    vectorise along lanes (NHWC) or output columns (NCHW interior windows);
//  - for 2x2 windows with stride 2 in float and bfloat16 (what CNN training uses), explicit
//    vector loops (relu_max_pool_cpu_simd.h) that read each input once and write each output
//    once with no intermediate buffers: the forward computes the max and the window code of
//    kVecLanes outputs from four vector loads; the backward expands kVecLanes codes and dy
//    values into the four dz values of each window. They prefetch z ahead and write outputs
//    far larger than the caches with streaming stores. Windows clipped by the input's edge
//    (odd sizes) go through the general loops.

template <typename T>
using Acc = typename ValueTraits<T>::Acc;

// take ? a : b on integers, without a branch.
template <typename I>
inline I SelectBits(bool take, I a, I b) {
  const I mask = static_cast<I>(-static_cast<I>(take));
  return static_cast<I>((a & mask) | (b & ~mask));
}

// Unsigned integer of T's size: selects of T values vectorise as bit operations (T may be a
// 16-bit struct). AliasBits is the same type, allowed to alias T for writing T's buffers.
template <int N>
struct UIntOf;
template <>
struct UIntOf<2> {
  using type = uint16_t;
  typedef uint16_t __attribute__((may_alias)) alias;
};
template <>
struct UIntOf<4> {
  using type = uint32_t;
  typedef uint32_t __attribute__((may_alias)) alias;
};
template <>
struct UIntOf<8> {
  using type = uint64_t;
  typedef uint64_t __attribute__((may_alias)) alias;
};
template <typename T>
using Bits = typename UIntOf<sizeof(T)>::type;
template <typename T>
using AliasBits = typename UIntOf<sizeof(T)>::alias;

template <typename T>
inline Bits<T> ToBits(T v) {
  Bits<T> b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}
template <typename T>
inline T FromBits(Bits<T> b) {
  T v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

// take ? a : b for compared float values, selected by their bits. Never `take ? a : b` on the
// floats themselves where take compares a and b: GCC turns that into a max instruction (or not:
// it depends on the vector width), and the two differ under denormals-are-zero, which TensorFlow
// sets in the threads that run ops: compares then see a denormal as zero, a select keeps its
// bits, a max returns it flushed to zero. Selects keep every instruction-set path bitwise
// identical, and give stock's result where stock is consistent (its bfloat16 max pooling keeps a
// denormal's bits). tests/test_cpu_dispatch.py checks that the kernels hold no max/min.
template <typename A>
inline A SelectValue(bool take, A a, A b) {
  return FromBits<A>(SelectBits<Bits<A>>(take, ToBits(a), ToBits(b)));
}

// ReLU as std::max(v, 0): negative -> +0, -0 and NaN kept. This is what stock Relu does for
// half and bfloat16 everywhere, and for float/double outside Eigen's vector packets (inside them
// it gives +0 for -0, so stock's sign of a zero result depends on the element's position).
template <typename A>
inline A Relu(A v) {
  return SelectValue(v < A(0), A(0), v);
}

// z[i] in the arithmetic type. 16-bit types are loaded as plain integers: GCC does not vectorise
// loads of the Half/BFloat16 structs.
template <typename T>
inline Acc<T> LoadAcc(const T* z, int64_t i) {
  return ValueTraits<T>::ToAcc(z[i]);
}
template <>
inline float LoadAcc<Half>(const Half* z, int64_t i) {
  return HalfToFloat(reinterpret_cast<const AliasBits<Half>*>(z)[i]);
}
template <>
inline float LoadAcc<BFloat16>(const BFloat16* z, int64_t i) {
  return BFloat16ToFloat(reinterpret_cast<const AliasBits<BFloat16>*>(z)[i]);
}

// Rough cycles per element, for the runner's split.
constexpr int64_t kCyclesPerElement = 4;

// Output columns [begin, end) whose windows lie wholly inside the input's columns. With one lane
// (NCHW) these are scanned together, vectorised along the output row.
struct ColumnRange {
  int64_t begin, end;
};
inline ColumnRange InteriorColumns(const PoolParams& p) {
  const int64_t begin = (p.pad_left + p.stride_cols - 1) / p.stride_cols;
  const int64_t span = p.in_cols + p.pad_left - p.window_cols;
  const int64_t end = span < 0 ? 0 : std::min(span / p.stride_cols + 1, p.out_cols);
  return {begin, std::max(begin, end)};
}

// Scan results for one output row, element i = pw * lanes + l; reused across rows of one shard.
template <typename T>
struct RowScan {
  std::vector<Acc<T>> max;      // forward max, from lowest, skips NaN
  std::vector<int32_t> pos;     // argmax (window code), stock gradient rule
  std::vector<uint8_t> first_nan;

  explicit RowScan(const PoolParams& p)
      : max(p.out_cols * p.lanes), pos(p.out_cols * p.lanes), first_nan(p.out_cols * p.lanes) {}

  // Scans output row (img, ph) of z from output column pw_begin on (elements from
  // pw_begin * lanes). WithArgmax also tracks positions.
  template <bool WithArgmax>
  void Run(const PoolParams& p, const T* __restrict z, int64_t img, int64_t ph,
           int64_t pw_begin = 0) {
    ColumnRange inner = p.lanes == 1 ? InteriorColumns(p) : ColumnRange{0, 0};
    inner.begin = std::max(inner.begin, pw_begin);
    for (int64_t pw = pw_begin; pw < p.out_cols; ++pw) {
      if (pw == inner.begin && inner.end > inner.begin) {
        RunInterior<WithArgmax>(p, z, img, ph, inner);
        pw = inner.end - 1;
        continue;
      }
      RunWindow<WithArgmax>(p, z, img, WindowOf(p, ph, pw), pw * p.lanes);
    }
  }

  // The code stored for element i: the argmax when it holds a positive value, else the sentinel.
  template <typename C>
  C Code(int64_t i) const {
    const bool none = first_nan[i] | !(max[i] > Acc<T>(0));
    return SelectBits<C>(none, ArgmaxSentinel<C>(), static_cast<C>(pos[i]));
  }

 private:
  // One window, all lanes (vectorised along lanes), into elements [at, at + lanes).
  template <bool WithArgmax>
  void RunWindow(const PoolParams& p, const T* __restrict z, int64_t img, const ClippedWindow& win,
                 int64_t at) {
    const int64_t L = p.lanes;
    Acc<T>* __restrict m = max.data() + at;
    int32_t* __restrict ps = pos.data() + at;
    const Acc<T> lowest = ValueTraits<T>::Lowest();
    for (int64_t l = 0; l < L; ++l) m[l] = lowest;
    if (WithArgmax) {
      const T* zp = z + ((img * p.in_rows + win.row_begin) * p.in_cols + win.col_begin) * L;
      for (int64_t l = 0; l < L; ++l) {
        const Acc<T> v = LoadAcc(zp, l);
        ps[l] = 0;
        first_nan[at + l] = v != v;
      }
    }
    for (int64_t h = win.row_begin; h < win.row_end; ++h) {
      for (int64_t w = win.col_begin; w < win.col_end; ++w) {
        const T* __restrict zp = z + ((img * p.in_rows + h) * p.in_cols + w) * L;
        const int32_t code =
            static_cast<int32_t>((h - win.row_begin) * p.code_pitch + (w - win.col_begin));
        for (int64_t l = 0; l < L; ++l) Step<WithArgmax>(LoadAcc(zp, l), code, &m[l], &ps[l]);
      }
    }
  }

  // One lane: the interior windows of the row at once, vectorised along output columns (strided
  // loads). Interior windows share their rows and are unclipped, so codes are h * pitch + dw.
  template <bool WithArgmax>
  void RunInterior(const PoolParams& p, const T* __restrict z, int64_t img, int64_t ph,
                   ColumnRange cols) {
    const ClippedWindow rows = WindowOf(p, ph, cols.begin);
    const int64_t s = p.stride_cols;
    Acc<T>* __restrict m = max.data();
    int32_t* __restrict ps = pos.data();
    const Acc<T> lowest = ValueTraits<T>::Lowest();
    for (int64_t pw = cols.begin; pw < cols.end; ++pw) m[pw] = lowest;
    const T* row0 = z + (img * p.in_rows + rows.row_begin) * p.in_cols - p.pad_left;
    if (WithArgmax) {
      for (int64_t pw = cols.begin; pw < cols.end; ++pw) {
        const Acc<T> v = LoadAcc(row0, pw * s);
        ps[pw] = 0;
        first_nan[pw] = v != v;
      }
    }
    for (int64_t h = rows.row_begin; h < rows.row_end; ++h) {
      const T* __restrict zr = z + (img * p.in_rows + h) * p.in_cols - p.pad_left;
      for (int64_t dw = 0; dw < p.window_cols; ++dw) {
        const int32_t code = static_cast<int32_t>((h - rows.row_begin) * p.code_pitch + dw);
        for (int64_t pw = cols.begin; pw < cols.end; ++pw) {
          Step<WithArgmax>(LoadAcc(zr, pw * s + dw), code, &m[pw], &ps[pw]);
        }
      }
    }
  }

  template <bool WithArgmax>
  static inline void Step(Acc<T> zv, int32_t code, Acc<T>* m, int32_t* ps) {
    const Acc<T> r = Relu(zv);
    const Acc<T> cur = *m;
    const bool take = cur < r;
    *m = SelectValue(take, r, cur);
    // Branch-free select so that the loop vectorises (the data decides `take` at random).
    if (WithArgmax) *ps = SelectBits(take, code, *ps);
  }
};

template <typename T>
inline T AddAcc(T a, T b) {
  return ValueTraits<T>::FromAcc(ValueTraits<T>::ToAcc(a) + ValueTraits<T>::ToAcc(b));
}
// Stock ReluGrad's multiply by (relu(z) > 0 ? 1 : 0).
template <typename T>
inline T MaskAcc(T a, bool keep) {
  return ValueTraits<T>::FromAcc(ValueTraits<T>::ToAcc(a) * static_cast<Acc<T>>(keep));
}

// Input rows [*begin, *end) owned by output row `out_row` when windows are disjoint: the rows
// from its window start to the next window's start, the first and last rows extended to the edges.
inline void RowBand(const PoolParams& p, int64_t out_row, int64_t* begin, int64_t* end) {
  const int64_t b = out_row * p.stride_rows - p.pad_top;
  const int64_t e = b + p.stride_rows;
  *begin = out_row == 0 ? 0 : std::min(std::max(b, int64_t{0}), p.in_rows);
  *end = out_row == p.out_rows - 1 ? p.in_rows : std::min(std::max(e, int64_t{0}), p.in_rows);
}

template <typename T>
void FillZero(T* data, int64_t n, const ParallelRunner& runner) {
  runner.For(n, 1, [&](int64_t b, int64_t e) { std::memset(data + b, 0, (e - b) * sizeof(T)); });
}


// ---- 2x2 windows, stride 2 (float and bfloat16) ----
//
// Per output element, the four window values v0..v3 in row-major order. The forward's max from
// the lowest value with `max < relu(v)` equals the scan of RowScan; its code is the first position
// holding that max when the max is positive and v0 is not NaN (the stock gradient's argmax, see
// relu_max_pool.h), else the sentinel. Routing a positive max to the FIRST position equal to it
// is the scan's rule: later positions take over only when strictly greater.

#ifdef TFRP_CPU_NO_SIMD
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
#if TFRP_CPU_ISA_AVX512
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
#endif  // TFRP_CPU_NO_SIMD

// The run of output rows [u, end') starting at u whose windows the 2x2 loops take (end' == u when
// row u is not one): rows below full_rows of u's image, or up to `end` when every row is full.
inline int64_t Full2x2Run(const PoolParams& p, int64_t u, int64_t end, int64_t full_rows,
                          int64_t full_cols) {
  if (full_cols == 0) return u;
  const int64_t ph = u % p.out_rows;
  if (ph >= full_rows) return u;
  return full_rows == p.out_rows ? end : std::min(end, u + (full_rows - ph));
}

// True when the windows tile the input exactly (window == stride and no leftover rows or
// columns): then every dz element is written by exactly one window and nothing needs zeroing.
inline bool WindowsTileInput(const PoolParams& p) {
  return p.window_rows == p.stride_rows && p.window_cols == p.stride_cols &&
         p.out_rows * p.stride_rows - p.pad_top >= p.in_rows &&
         p.out_cols * p.stride_cols - p.pad_left >= p.in_cols;
}

// Outputs at least this large are written with streaming stores where the 2x2 loops can: too
// large to stay in the caches for the next op anyway.
constexpr int64_t kStreamMinBytes = int64_t{16} << 20;

// Whether the 2x2 forward writes y (and the codes) with streaming stores: NHWC only, with whole
// vectors of channels, every store at a multiple of PutVec's chunk width (see StreamDz), and no
// clipped window. Measured: 5-10% faster for large float32 outputs; NCHW rows of small images
// rarely align, and a line written partly by streaming stores costs more than it saves.
template <typename T, typename C>
inline bool StreamForward(const PoolParams& p, const T* y, const C* codes) {
  if (p.lanes == 1 || !Use2x2Path<T>(p) || !WindowsTileInput(p) || p.lanes % kVecLanes != 0 ||
      p.out_elements() * int64_t(sizeof(T)) < kStreamMinBytes) {
    return false;
  }
  const int64_t width = std::min<int64_t>(kVecLanes * int64_t(sizeof(T)), kStreamChunk);
  const int64_t code_width = std::min<int64_t>(kVecLanes, kStreamChunk);
  return width >= 16 && reinterpret_cast<uintptr_t>(y) % width == 0 &&
         (p.lanes * int64_t(sizeof(T))) % width == 0 &&
         (codes == nullptr ||
          (reinterpret_cast<uintptr_t>(codes) % code_width == 0 && p.lanes % code_width == 0));
}

// Forward; y and/or argmax may be null (the keep-z backward only wants the codes).
template <typename T, typename C>
void ForwardImpl(const PoolParams& p, const T* z, T* y, C* argmax, const ParallelRunner& runner) {
  const int64_t units = p.images * p.out_rows;
  const int64_t cost = std::max<int64_t>(1, p.out_cols * p.lanes * p.window_rows * p.window_cols) *
                       kCyclesPerElement;
  const int64_t row = p.out_cols * p.lanes;
  // The 2x2 loops write uint8 codes (the default code type of 2x2 windows) or none.
  const bool fast = Use2x2Path<T>(p) && (argmax == nullptr || std::is_same<C, uint8_t>::value);
  const int64_t full_rows = fast ? FullRows2x2(p) : 0, full_cols = fast ? FullCols2x2(p) : 0;
  const bool stream = fast && y != nullptr && StreamForward(p, y, argmax);
  runner.For(units, cost, [&](int64_t begin, int64_t end) {
    RowScan<T> scan(p);
    // Output row u from output column `done` on, by the general loops.
    auto general = [&](int64_t u, int64_t done) {
      const int64_t img = u / p.out_rows, ph = u % p.out_rows;
      if (argmax != nullptr) {
        scan.template Run<true>(p, z, img, ph, done);
        C* __restrict cp = argmax + u * row;
        for (int64_t i = done * p.lanes; i < row; ++i) cp[i] = scan.template Code<C>(i);
      } else {
        scan.template Run<false>(p, z, img, ph, done);
      }
      if (y != nullptr) {
        T* __restrict yp = y + u * row;
        for (int64_t i = done * p.lanes; i < row; ++i) yp[i] = ValueTraits<T>::FromAcc(scan.max[i]);
      }
    };
    for (int64_t u = begin; u < end;) {
      const int64_t run_end = Full2x2Run(p, u, end, full_rows, full_cols);
      if (run_end == u) {
        general(u++, 0);
        continue;
      }
      if constexpr (kHas2x2Path<T>) {
        uint8_t* codes = nullptr;
        if constexpr (std::is_same<C, uint8_t>::value) codes = argmax;
        if (y != nullptr && codes != nullptr) {
          if (stream) {
            Forward2x2Rows<T, true, true, true>(p, z, u, run_end, full_cols, y, codes);
          } else {
            Forward2x2Rows<T, true, true, false>(p, z, u, run_end, full_cols, y, codes);
          }
        } else if (y != nullptr) {
          if (stream) {
            Forward2x2Rows<T, true, false, true>(p, z, u, run_end, full_cols, y, nullptr);
          } else {
            Forward2x2Rows<T, true, false, false>(p, z, u, run_end, full_cols, y, nullptr);
          }
        } else {
          Forward2x2Rows<T, false, true, false>(p, z, u, run_end, full_cols, nullptr, codes);
        }
      }
      for (; u < run_end; ++u) {
        if (full_cols < p.out_cols) general(u, full_cols);
      }
    }
    if (stream) StreamFence();
  });
}


// Gradient of one output row, ready to be written: element i = pw * lanes + l puts `hit[i]` at
// window code `pos[i]` (-1: none) and `first[i]` at the window's first position; all else +0.
template <typename T>
struct RowGrad {
  std::vector<int32_t> pos;
  std::vector<Bits<T>> hit, first;  // T values as bits
  explicit RowGrad(const PoolParams& p)
      : pos(p.out_cols * p.lanes), hit(p.out_cols * p.lanes), first(p.out_cols * p.lanes) {}

  // Element i's code c (sentinel: route to the first position, times zero) and its dy.
  template <typename C>
  void Set(int64_t i, C c, T dy) {
    const T zero = ValueTraits<T>::FromAcc(Acc<T>(0));
    const T g = AddAcc(zero, dy);  // stock adds dy to a zeroed buffer
    const bool positive = c != ArgmaxSentinel<C>();
    pos[i] = SelectBits<int32_t>(positive, static_cast<int32_t>(c), -1);
    hit[i] = ToBits(g);
    first[i] = SelectBits<Bits<T>>(positive, Bits<T>(0), ToBits(MaskAcc(g, false)));
  }

  // Writes the row's windows from output column pw_begin on into dz (disjoint windows only).
  // +0 is all-zero bits in every type.
  void Write(const PoolParams& p, int64_t img, int64_t ph, int64_t pw_begin, T* dz) const {
    ColumnRange inner = p.lanes == 1 ? InteriorColumns(p) : ColumnRange{0, 0};
    inner.begin = std::max(inner.begin, pw_begin);
    for (int64_t pw = pw_begin; pw < p.out_cols; ++pw) {
      if (pw == inner.begin && inner.end > inner.begin) {
        WriteInterior(p, img, ph, inner, dz);
        pw = inner.end - 1;
        continue;
      }
      WriteWindow(p, img, WindowOf(p, ph, pw), pw * p.lanes, dz);
    }
  }

 private:
  static inline Bits<T> Pick(int32_t pos, int32_t code, Bits<T> hit, Bits<T> other) {
    return SelectBits<Bits<T>>(pos == code, hit, other);
  }

  void WriteWindow(const PoolParams& p, int64_t img, const ClippedWindow& win, int64_t at,
                   T* dz) const {
    const int64_t L = p.lanes;
    const int32_t* __restrict ps = pos.data() + at;
    const Bits<T>* __restrict h1 = hit.data() + at;
    const Bits<T>* __restrict f1 = first.data() + at;
    for (int64_t h = win.row_begin; h < win.row_end; ++h) {
      for (int64_t w = win.col_begin; w < win.col_end; ++w) {
        const int32_t code =
            static_cast<int32_t>((h - win.row_begin) * p.code_pitch + (w - win.col_begin));
        AliasBits<T>* __restrict d =
            reinterpret_cast<AliasBits<T>*>(dz + ((img * p.in_rows + h) * p.in_cols + w) * L);
        if (code == 0) {
          for (int64_t l = 0; l < L; ++l) d[l] = Pick(ps[l], code, h1[l], f1[l]);
        } else {
          for (int64_t l = 0; l < L; ++l) d[l] = Pick(ps[l], code, h1[l], 0);
        }
      }
    }
  }

  // One lane: all interior windows of the row at once, vectorised along output columns.
  void WriteInterior(const PoolParams& p, int64_t img, int64_t ph, ColumnRange cols, T* dz) const {
    const ClippedWindow rows = WindowOf(p, ph, cols.begin);
    const int64_t s = p.stride_cols;
    const int32_t* __restrict ps = pos.data();
    const Bits<T>* __restrict h1 = hit.data();
    const Bits<T>* __restrict f1 = first.data();
    for (int64_t h = rows.row_begin; h < rows.row_end; ++h) {
      AliasBits<T>* __restrict d =
          reinterpret_cast<AliasBits<T>*>(dz + (img * p.in_rows + h) * p.in_cols - p.pad_left);
      for (int64_t dw = 0; dw < p.window_cols; ++dw) {
        const int32_t code = static_cast<int32_t>((h - rows.row_begin) * p.code_pitch + dw);
        if (code == 0) {
          for (int64_t pw = cols.begin; pw < cols.end; ++pw) {
            d[pw * s + dw] = Pick(ps[pw], code, h1[pw], f1[pw]);
          }
        } else {
          for (int64_t pw = cols.begin; pw < cols.end; ++pw) {
            d[pw * s + dw] = Pick(ps[pw], code, h1[pw], 0);
          }
        }
      }
    }
  }
};

// Whether the 2x2 backward writes dz with streaming stores (PutVec): dz is too large to stay in
// the caches for the next op anyway, and every store to dz streams, i.e. starts at a multiple of
// PutVec's chunk width (a cache line written partly by streaming and partly by ordinary stores
// costs more than either): no clipped window (vectors cover every row), dz aligned, every row
// and every vector, the overlapping last one of a row included, at a multiple of the width.
// (The overlapping vector writes a few bytes twice, both times streaming: the same bits.)
template <typename T>
inline bool StreamDz(const PoolParams& p, const T* dz) {
  if (!Use2x2Path<T>(p) || !WindowsTileInput(p) ||
      p.in_elements() * int64_t(sizeof(T)) < kStreamMinBytes) {
    return false;
  }
  // NHWC stores kVecLanes values at lane offsets l; NCHW stores 2 * kVecLanes values (pairs)
  // at offsets 2 * pw. n: how many vectors' worth a row has; step: values per output element.
  const int64_t n = p.lanes == 1 ? FullCols2x2(p) : p.lanes;
  const int64_t step = p.lanes == 1 ? 2 : 1;
  const int64_t store = step * kVecLanes * int64_t(sizeof(T));
  const int64_t width = std::min<int64_t>(store, kStreamChunk);
  const int64_t last = (n - kVecLanes) * step * int64_t(sizeof(T));  // the last vector's offset
  const int64_t row = p.in_cols * p.lanes * int64_t(sizeof(T));
  return width >= 16 && n >= kVecLanes && reinterpret_cast<uintptr_t>(dz) % width == 0 &&
         row % width == 0 && store % width == 0 && last % width == 0 &&
         (p.lanes == 1 || (p.lanes * int64_t(sizeof(T))) % width == 0);
}

// Disjoint windows: each (image, output row) unit owns a band of input rows; it zeroes the band
// unless the windows tile it, then writes the row's window gradients: fast(u_begin, u_end) writes
// output columns [0, full_cols) of a run of rows that the 2x2 loops take (Full2x2Run); fill()
// gives a per-shard function that sets the elements of `grad` from output column pw_begin on,
// which RowGrad then writes: the other rows and columns.
template <typename T, typename Fill, typename Fast>
void DisjointBackward(const PoolParams& p, const ParallelRunner& runner, T* dz, bool stream,
                      int64_t full_rows, int64_t full_cols, Fill fill, Fast fast) {
  const int64_t units = p.images * p.out_rows;
  const int64_t cost = std::max<int64_t>(1, p.in_cols * p.lanes * p.stride_rows) * kCyclesPerElement;
  const bool tiles = WindowsTileInput(p);
  runner.For(units, cost, [&](int64_t begin, int64_t end) {
    RowGrad<T> grad(p);
    auto fill_row = fill();  // per-shard state
    auto zero_band = [&](int64_t u) {
      int64_t rb, re;
      RowBand(p, u % p.out_rows, &rb, &re);
      const int64_t row_elems = p.in_cols * p.lanes;
      std::memset(dz + ((u / p.out_rows) * p.in_rows + rb) * row_elems, 0,
                  (re - rb) * row_elems * sizeof(T));
    };
    // Output row u from output column `done` on, by the general loops.
    auto general = [&](int64_t u, int64_t done) {
      const int64_t img = u / p.out_rows, ph = u % p.out_rows;
      fill_row(img, ph, done, &grad);
      grad.Write(p, img, ph, done, dz);
    };
    for (int64_t u = begin; u < end;) {
      const int64_t run_end = Full2x2Run(p, u, end, full_rows, full_cols);
      if (run_end == u) {
        if (!tiles) zero_band(u);
        general(u++, 0);
        continue;
      }
      if (!tiles) {
        for (int64_t v = u; v < run_end; ++v) zero_band(v);
      }
      fast(u, run_end);
      for (; u < run_end; ++u) {
        if (full_cols < p.out_cols) general(u, full_cols);
      }
    }
    if (stream) StreamFence();
  });
}

// Gather form for overlapping windows: each input element sums, in output order, dy of the
// windows whose code routes to it, then applies the mask.
template <typename T, typename C>
void GatherBackward(const PoolParams& p, const T* dy, const C* argmax, T* dz,
                    const ParallelRunner& runner) {
  const int64_t units = p.images * p.in_rows;
  const int64_t per_elem = ((p.window_rows + p.stride_rows - 1) / p.stride_rows) *
                           ((p.window_cols + p.stride_cols - 1) / p.stride_cols);
  const int64_t cost = std::max<int64_t>(1, p.in_cols * p.lanes * per_elem) * kCyclesPerElement;
  const C sentinel = ArgmaxSentinel<C>();
  runner.For(units, cost, [&](int64_t begin, int64_t end) {
    std::vector<T> acc(p.lanes);
    std::vector<int32_t> positive(p.lanes);  // int32 like the codes compared: vectorises
    const T zero = ValueTraits<T>::FromAcc(Acc<T>(0));
    for (int64_t u = begin; u < end; ++u) {
      const int64_t img = u / p.in_rows, h = u % p.in_rows;
      int64_t ph0, ph1;
      OutputsCovering(h, p.pad_top, p.window_rows, p.stride_rows, p.out_rows, &ph0, &ph1);
      for (int64_t w = 0; w < p.in_cols; ++w) {
        int64_t pw0, pw1;
        OutputsCovering(w, p.pad_left, p.window_cols, p.stride_cols, p.out_cols, &pw0, &pw1);
        T* __restrict a = acc.data();
        int32_t* __restrict pos = positive.data();
        for (int64_t l = 0; l < p.lanes; ++l) {
          a[l] = zero;
          pos[l] = 0;
        }
        for (int64_t ph = ph0; ph < ph1; ++ph) {
          for (int64_t pw = pw0; pw < pw1; ++pw) {
            const ClippedWindow win = WindowOf(p, ph, pw);
            const int32_t expected =
                static_cast<int32_t>((h - win.row_begin) * p.code_pitch + (w - win.col_begin));
            const bool first = h == win.row_begin && w == win.col_begin;
            const int32_t first_sentinel = first ? static_cast<int32_t>(sentinel) : -2;
            const int64_t o = ((img * p.out_rows + ph) * p.out_cols + pw) * p.lanes;
            const C* __restrict cp = argmax + o;
            const T* __restrict gp = dy + o;
            for (int64_t l = 0; l < p.lanes; ++l) {
              const int32_t c = static_cast<int32_t>(cp[l]);
              const bool hit = c == expected;
              const bool take = hit | (c == first_sentinel);
              // a + (+0) == a for every a this sum can hold (it starts at +0, so it is never
              // -0): adding a selected zero keeps the loop branch-free.
              a[l] = AddAcc(a[l], FromBits<T>(SelectBits<Bits<T>>(take, ToBits(gp[l]), 0)));
              pos[l] |= hit;
            }
          }
        }
        T* __restrict out = dz + ((img * p.in_rows + h) * p.in_cols + w) * p.lanes;
        for (int64_t l = 0; l < p.lanes; ++l) out[l] = MaskAcc(a[l], pos[l] != 0);
      }
    }
  });
}

// One-lane (NCHW) form for overlapping windows: each image plane is small, so a sequential
// scatter in output order (the order stock adds in) beats the gather, which cannot vectorise
// across lanes here. `received` marks elements some positive code routed to: the mask.
template <typename T, typename C>
void ScatterBackwardOneLane(const PoolParams& p, const T* dy, const C* argmax, T* dz,
                            const ParallelRunner& runner) {
  const int64_t plane = p.in_rows * p.in_cols, out_plane = p.out_rows * p.out_cols;
  // Offset of each code from its window's first element, without a division per element.
  std::vector<int64_t> offset(p.code_positions);
  for (int64_t c = 0; c < p.code_positions; ++c) {
    offset[c] = (c / p.code_pitch) * p.in_cols + c % p.code_pitch;
  }
  const C sentinel = ArgmaxSentinel<C>();
  runner.For(p.images, std::max<int64_t>(1, plane + out_plane) * kCyclesPerElement,
             [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> received(plane);
    for (int64_t img = begin; img < end; ++img) {
      T* d = dz + img * plane;
      std::memset(d, 0, plane * sizeof(T));
      std::fill(received.begin(), received.end(), 0);
      const C* cp = argmax + img * out_plane;
      const T* gp = dy + img * out_plane;
      for (int64_t ph = 0; ph < p.out_rows; ++ph) {
        for (int64_t pw = 0; pw < p.out_cols; ++pw) {
          const ClippedWindow win = WindowOf(p, ph, pw);
          const C c = cp[ph * p.out_cols + pw];
          const bool positive = c != sentinel;
          const int64_t i = win.row_begin * p.in_cols + win.col_begin +
                            (positive ? offset[static_cast<int64_t>(c)] : 0);
          d[i] = AddAcc(d[i], gp[ph * p.out_cols + pw]);
          received[i] |= positive;
        }
      }
      for (int64_t i = 0; i < plane; ++i) d[i] = MaskAcc(d[i], received[i] != 0);
    }
  });
}

template <typename T, typename C>
void OverlappingBackward(const PoolParams& p, const T* dy, const C* argmax, T* dz,
                         const ParallelRunner& runner) {
  if (p.lanes == 1) return ScatterBackwardOneLane<T, C>(p, dy, argmax, dz, runner);
  GatherBackward<T, C>(p, dy, argmax, dz, runner);
}

// The narrowest code type for the keep-z backward's workspace.
template <typename Fn>
auto WithWorkspaceCodeType(const PoolParams& p, Fn fn) {
  if (p.code_positions < ArgmaxSentinel<uint8_t>()) return fn(uint8_t{});
  if (p.code_positions < ArgmaxSentinel<uint16_t>()) return fn(uint16_t{});
  return fn(int32_t{});
}

// ---- Entry points (called by relu_max_pool_cpu.cc's dispatch) ----

template <typename T>
void Forward(const PoolParams& p, const T* z, T* y, const ParallelRunner& runner) {
  ForwardImpl<T, uint8_t>(p, z, y, nullptr, runner);
}

template <typename T, typename C>
void ForwardWithArgmax(const PoolParams& p, const T* z, T* y, C* argmax,
                       const ParallelRunner& runner) {
  ForwardImpl<T, C>(p, z, y, argmax, runner);
}

template <typename T>
void BackwardFromInput(const PoolParams& p, const T* z, const T* dy, T* dz, void* workspace,
                       const ParallelRunner& runner) {
  if (p.out_elements() == 0) return FillZero(dz, p.in_elements(), runner);
  if (!p.windows_disjoint()) {
    // Overlapping windows: codes into the workspace (z read once), then the gather.
    WithWorkspaceCodeType(p, [&](auto c) {
      using C = decltype(c);
      C* codes = static_cast<C*>(workspace);
      ForwardImpl<T, C>(p, z, nullptr, codes, runner);
      OverlappingBackward<T, C>(p, dy, codes, dz, runner);
      return 0;
    });
    return;
  }
  const int64_t full_rows = Use2x2Path<T>(p) ? FullRows2x2(p) : 0;
  const int64_t full_cols = Use2x2Path<T>(p) ? FullCols2x2(p) : 0;
  const int64_t row = p.out_cols * p.lanes;
  const bool stream = StreamDz(p, dz);
  DisjointBackward<T>(
      p, runner, dz, stream, full_rows, full_cols,
      [&]() {
        return [&p, z, dy, row, scan = RowScan<T>(p)](int64_t img, int64_t ph, int64_t pw_begin,
                                                      RowGrad<T>* grad) mutable {
          scan.template Run<true>(p, z, img, ph, pw_begin);
          const T* dyr = dy + (img * p.out_rows + ph) * row;
          for (int64_t i = pw_begin * p.lanes; i < row; ++i) {
            grad->Set(i, scan.template Code<int32_t>(i), dyr[i]);
          }
        };
      },
      [&](int64_t u_begin, int64_t u_end) {
        if constexpr (kHas2x2Path<T>) {
          if (stream) {
            Backward2x2Rows<T, true, true>(p, z, nullptr, dy, u_begin, u_end, full_cols, dz);
          } else {
            Backward2x2Rows<T, true, false>(p, z, nullptr, dy, u_begin, u_end, full_cols, dz);
          }
        }
      });
}

// True when no window is clipped by the input's edges: then a code is valid exactly when it is
// the sentinel or below code_positions, which one pass over the codes checks.
inline bool AllWindowsInside(const PoolParams& p) {
  return p.pad_top == 0 && p.pad_left == 0 &&
         (p.out_rows == 0 || (p.out_rows - 1) * p.stride_rows <= p.in_rows - p.window_rows) &&
         (p.out_cols == 0 || (p.out_cols - 1) * p.stride_cols <= p.in_cols - p.window_cols);
}

template <typename C>
int64_t FindInvalidArgmax(const PoolParams& p, const C* argmax, const ParallelRunner& runner) {
  using U = std::make_unsigned_t<C>;  // negative int32 codes become huge, hence invalid
  const U sentinel = static_cast<U>(ArgmaxSentinel<C>());
  if (AllWindowsInside(p)) {
    // One branch-free pass (it vectorises); only when it finds a bad code does the search below
    // run, to name the first one whatever the split.
    const U limit = static_cast<U>(p.code_positions);
    const U* codes = reinterpret_cast<const U*>(argmax);
    constexpr int64_t kBlock = 4096;
    std::atomic<bool> any_bad{false};
    runner.For((p.out_elements() + kBlock - 1) / kBlock, kBlock, [&](int64_t begin, int64_t end) {
      const int64_t stop = std::min(end * kBlock, p.out_elements());
      U bad = 0;
      for (int64_t i = begin * kBlock; i < stop; ++i) {
        bad |= static_cast<U>((codes[i] != sentinel) & (codes[i] >= limit));
      }
      if (bad != 0) any_bad.store(true);
    });
    if (!any_bad.load()) return -1;
  }
  std::atomic<int64_t> first_bad{-1};
  const int64_t units = p.images * p.out_rows;
  runner.For(units, std::max<int64_t>(1, p.out_cols * p.lanes) * 2, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t img = u / p.out_rows, ph = u % p.out_rows;
      for (int64_t pw = 0; pw < p.out_cols; ++pw) {
        const ClippedWindow win = WindowOf(p, ph, pw);
        const int64_t rows = win.row_end - win.row_begin, cols = win.col_end - win.col_begin;
        const int64_t o = ((img * p.out_rows + ph) * p.out_cols + pw) * p.lanes;
        const U* cp = reinterpret_cast<const U*>(argmax + o);
        // Codes below rows * pitch name a row of the window; unless the window is clipped on
        // the right (cols < pitch) that is all there is to check, without a division per code.
        const uint64_t limit = static_cast<uint64_t>(rows * p.code_pitch);
        bool any_bad = false;
        for (int64_t l = 0; l < p.lanes; ++l) {
          any_bad |= (cp[l] != sentinel) & (static_cast<uint64_t>(cp[l]) >= limit);
        }
        if (!any_bad && cols == p.code_pitch) continue;
        for (int64_t l = 0; l < p.lanes; ++l) {
          if (cp[l] == sentinel) continue;
          const uint64_t v = cp[l];
          if (v < limit && static_cast<int64_t>(v % p.code_pitch) < cols) continue;
          // Keep the smallest bad index whatever the split, so the error message is stable.
          int64_t cur = first_bad.load();
          while ((cur < 0 || o + l < cur) && !first_bad.compare_exchange_weak(cur, o + l)) {
          }
          break;
        }
      }
    }
  });
  return first_bad.load();
}

template <typename T, typename C>
void BackwardFromArgmax(const PoolParams& p, const T* dy, const C* argmax, T* dz,
                        const ParallelRunner& runner) {
  if (p.out_elements() == 0) return FillZero(dz, p.in_elements(), runner);
  if (!p.windows_disjoint()) return OverlappingBackward<T, C>(p, dy, argmax, dz, runner);
  const bool fast = Use2x2Path<T>(p) && std::is_same<C, uint8_t>::value;
  const int64_t full_rows = fast ? FullRows2x2(p) : 0, full_cols = fast ? FullCols2x2(p) : 0;
  const int64_t row = p.out_cols * p.lanes;
  const bool stream = StreamDz(p, dz);
  DisjointBackward<T>(
      p, runner, dz, stream, full_rows, full_cols,
      [&]() {
        return [&p, dy, argmax, row](int64_t img, int64_t ph, int64_t pw_begin, RowGrad<T>* grad) {
          const int64_t o = (img * p.out_rows + ph) * row;
          for (int64_t i = pw_begin * p.lanes; i < row; ++i) grad->Set(i, argmax[o + i], dy[o + i]);
        };
      },
      [&](int64_t u_begin, int64_t u_end) {
        if constexpr (kHas2x2Path<T> && std::is_same<C, uint8_t>::value) {
          if (stream) {
            Backward2x2Rows<T, false, true>(p, nullptr, argmax, dy, u_begin, u_end, full_cols, dz);
          } else {
            Backward2x2Rows<T, false, false>(p, nullptr, argmax, dy, u_begin, u_end, full_cols, dz);
          }
        }
      });
}

template <typename T, typename C>
void GradGradFromArgmax(const PoolParams& p, const T* ddz, const C* argmax, T* ddy,
                        const ParallelRunner& runner) {
  const int64_t units = p.images * p.out_rows;
  const int64_t row = p.out_cols * p.lanes;
  const C sentinel = ArgmaxSentinel<C>();
  // Input offset of each code from its window's first element, without a division per element.
  std::vector<int64_t> offset(std::max<int64_t>(p.code_positions, 1));
  for (int64_t c = 0; c < p.code_positions; ++c) {
    offset[c] = ((c / p.code_pitch) * p.in_cols + c % p.code_pitch) * p.lanes;
  }
  runner.For(units, std::max<int64_t>(1, row) * kCyclesPerElement, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t img = u / p.out_rows, ph = u % p.out_rows;
      const C* __restrict cp = argmax + u * row;
      T* __restrict out = ddy + u * row;
      for (int64_t pw = 0; pw < p.out_cols; ++pw) {
        const ClippedWindow win = WindowOf(p, ph, pw);
        const T* first = ddz + ((img * p.in_rows + win.row_begin) * p.in_cols + win.col_begin) * p.lanes;
        for (int64_t l = 0; l < p.lanes; ++l) {
          const C c = cp[pw * p.lanes + l];
          const bool positive = c != sentinel;
          const int64_t at = (positive ? offset[static_cast<int64_t>(c)] : 0) + l;
          out[pw * p.lanes + l] = MaskAcc(first[at], positive);
        }
      }
    }
  });
}

