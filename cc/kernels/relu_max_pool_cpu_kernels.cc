// The CPU kernels for fused ReLU + max pooling; the reference the CUDA kernels are checked against.
//
// Compiled once per instruction set (baseline x86-64, AVX2, AVX-512: relu_max_pool_cpu_isa.h
// names the defines the build passes, and the namespace and target each gets); relu_max_pool_cpu.cc
// dispatches to the entry points (relu_max_pool_cpu_kernels.h) at run time. One source for every
// path, so the paths cannot drift apart; they are bitwise identical because every operation here
// is an exact IEEE operation (compare, select by bits, add, multiply by 0 or 1) done in a fixed
// order, whatever the vector width. Keep it so: no a * b + c anywhere (the AVX-512 target allows
// FMA, and every build passes -ffp-contract=off as a second guard), no reassociated sums, no
// max/min instructions (SelectValue, relu_max_pool_cpu_element.h, says why).
//
// Layout: (images x rows x cols x lanes), see PoolParams. Loops keep lanes innermost so that NHWC
// channels vectorise. Work is split over (image, row) units; each unit writes a disjoint part of
// the output and no result depends on the split, so any thread count gives identical bits.
//
// Two kinds of loops:
//  - general ones (any window, stride, padding, dtype), written in plain C++ for the compiler to
//    vectorise along lanes (NHWC) or output columns (NCHW interior windows), here;
//  - for 2x2 windows with stride 2 in float and bfloat16 (what CNN training uses), explicit
//    vector loops (relu_max_pool_cpu_2x2.h, on relu_max_pool_cpu_simd.h's primitives) that read
//    each input once and write each output once with no intermediate buffers: the forward
//    computes the max and the window code of kVecLanes outputs from four vector loads; the
//    backward expands kVecLanes codes and dy values into the four dz values of each window. They
//    prefetch z ahead and write outputs far larger than the caches with streaming stores. Windows
//    clipped by the input's edge (odd sizes) go through the general loops.
#include "relu_max_pool_cpu_isa.h"

#if TFRP_CPU_ISA_COMPILED
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "numeric.h"
#include "relu_max_pool.h"
#include "relu_max_pool_cpu_2x2.h"
#include "relu_max_pool_cpu_element.h"
#include "relu_max_pool_cpu_kernels.h"
#include "relu_max_pool_cpu_simd.h"

TFRP_CPU_TARGET_BEGIN
namespace {

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

// True when no window is clipped by the input's edges: then a code is valid exactly when it is
// the sentinel or below code_positions, which one pass over the codes checks.
inline bool AllWindowsInside(const PoolParams& p) {
  return p.pad_top == 0 && p.pad_left == 0 &&
         (p.out_rows == 0 || (p.out_rows - 1) * p.stride_rows <= p.in_rows - p.window_rows) &&
         (p.out_cols == 0 || (p.out_cols - 1) * p.stride_cols <= p.in_cols - p.window_cols);
}

}  // namespace

// ---- Entry points (relu_max_pool_cpu_kernels.h) ----

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

#define TFRP_CPU_NAME(f) f
TFRP_CPU_INSTANTIATE_ALL
#undef TFRP_CPU_NAME

TFRP_CPU_TARGET_END
#endif  // TFRP_CPU_ISA_COMPILED
