// Framework-free test of the CPU kernels (cc/kernels/relu_max_pool_cpu.cc) against a naive
// reference written here from the documented semantics (stock MaxPool(Relu(z)) and
// ReluGrad(MaxPoolGrad(...))), for random geometries, all four value types and all three code
// types, with serial and multi-threaded runners. Also checks code validation with corrupted codes
// and ComputePoolParams' refusals. Built and run under -fsanitize=address,undefined
// (`make sanitize-cc`) and -fsanitize=thread (`make tsan`), where several threads also run the
// kernels concurrently on shared inputs.
//
// Lives outside cc/ on purpose: setup.py compiles every cc/**/*.cc into the op library.
//
// Usage: kernels_test [--iters N] [--seed S] [--threads T]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cc/kernels/relu_max_pool.h"

using namespace tf_relupool;

namespace {

int g_failures = 0;
#define CHECK(cond, ...)                                             \
  do {                                                               \
    if (!(cond)) {                                                   \
      ++g_failures;                                                  \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                             \
      std::fprintf(stderr, "\n");                                    \
      if (g_failures > 20) std::exit(1);                             \
    }                                                                \
  } while (0)

// Splits [0, total) into `chunks` ranges of random sizes, each run on its own std::thread.
class ThreadRunner : public ParallelRunner {
 public:
  ThreadRunner(int threads, uint64_t seed) : threads_(threads), seed_(seed) {}
  void For(int64_t total, int64_t, const std::function<void(int64_t, int64_t)>& fn) const override {
    if (total <= 0) return;
    std::mt19937_64 rng(seed_ + static_cast<uint64_t>(total));
    const int n = static_cast<int>(std::min<int64_t>(threads_, total));
    std::vector<int64_t> cuts = {0, total};
    for (int i = 1; i < n; ++i) cuts.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(total)));
    std::sort(cuts.begin(), cuts.end());
    std::vector<std::thread> ts;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      if (cuts[i] == cuts[i + 1]) continue;
      ts.emplace_back([&fn, b = cuts[i], e = cuts[i + 1]] { fn(b, e); });
    }
    for (auto& t : ts) t.join();
  }

 private:
  int threads_;
  uint64_t seed_;
};

template <typename T>
using Acc = typename ValueTraits<T>::Acc;
template <typename T>
Acc<T> A(T v) { return ValueTraits<T>::ToAcc(v); }
template <typename T>
T F(Acc<T> v) { return ValueTraits<T>::FromAcc(v); }

// Bit pattern, all NaNs mapped to one value.
template <typename T>
uint64_t Key(T v) {
  const double d = static_cast<double>(A(v));
  if (d != d) return ~uint64_t{0};
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

// Flat (images, rows, cols, lanes) offset.
inline int64_t Off(int64_t img, int64_t h, int64_t w, int64_t l, int64_t rows, int64_t cols,
                   int64_t lanes) {
  return ((img * rows + h) * cols + w) * lanes + l;
}

// ---- Naive reference, from stock TensorFlow's definitions ----
struct RefResult {
  std::vector<int64_t> argmax_flat;  // stock argmax (flat input index) per output element
  std::vector<int64_t> code;         // expected window code, -1 for the sentinel
};

// Window of output (ph, pw) in the padded input, clipped, computed independently of WindowOf.
void RefWindow(const PoolParams& p, int64_t ph, int64_t pw, int64_t* r0, int64_t* r1, int64_t* c0,
               int64_t* c1) {
  int64_t rs = ph * p.stride_rows - p.pad_top, cs = pw * p.stride_cols - p.pad_left;
  *r0 = std::max<int64_t>(rs, 0);
  *r1 = std::min<int64_t>(rs + p.window_rows, p.in_rows);
  *c0 = std::max<int64_t>(cs, 0);
  *c1 = std::min<int64_t>(cs + p.window_cols, p.in_cols);
}

template <typename T>
void RefForward(const PoolParams& p, const std::vector<T>& z, std::vector<T>* y, RefResult* r) {
  const int64_t L = p.lanes;
  y->assign(p.out_elements(), T{});
  r->argmax_flat.assign(p.out_elements(), -1);
  r->code.assign(p.out_elements(), -1);
  for (int64_t img = 0; img < p.images; ++img)
    for (int64_t ph = 0; ph < p.out_rows; ++ph)
      for (int64_t pw = 0; pw < p.out_cols; ++pw)
        for (int64_t l = 0; l < L; ++l) {
          int64_t r0, r1, c0, c1;
          RefWindow(p, ph, pw, &r0, &r1, &c0, &c1);
          const int64_t o = Off(img, ph, pw, l, p.out_rows, p.out_cols, L);
          // Forward: from lowest, take r when max < r.
          Acc<T> m = ValueTraits<T>::Lowest();
          // Gradient argmax: first in-bounds position, then best < r.
          int64_t best_idx = -1, best_code = -1;
          Acc<T> best = 0;
          for (int64_t h = r0; h < r1; ++h)
            for (int64_t w = c0; w < c1; ++w) {
              const int64_t i = Off(img, h, w, l, p.in_rows, p.in_cols, L);
              Acc<T> v = A(z[i]);
              Acc<T> rv = v < Acc<T>(0) ? Acc<T>(0) : v;
              if (m < rv) m = rv;
              const int64_t code = (h - r0) * p.code_pitch + (w - c0);
              if (best_idx < 0 || best < rv) {
                best_idx = i;
                best = rv;
                best_code = code;
              }
            }
          (*y)[o] = F<T>(m);
          r->argmax_flat[o] = best_idx;
          r->code[o] = best > Acc<T>(0) ? best_code : -1;  // NaN > 0 is false
        }
}

// dz = ReluGrad(MaxPoolGrad): dy added in output order at the stock argmax, then masked.
template <typename T>
void RefBackward(const PoolParams& p, const std::vector<T>& z, const std::vector<T>& dy,
                 const RefResult& r, std::vector<T>* dz) {
  dz->assign(p.in_elements(), F<T>(Acc<T>(0)));
  for (int64_t o = 0; o < p.out_elements(); ++o) {
    const int64_t i = r.argmax_flat[o];
    (*dz)[i] = F<T>(A((*dz)[i]) + A(dy[o]));
  }
  for (int64_t i = 0; i < p.in_elements(); ++i) {
    const Acc<T> v = A(z[i]);
    const Acc<T> rv = v < Acc<T>(0) ? Acc<T>(0) : v;
    (*dz)[i] = F<T>(A((*dz)[i]) * static_cast<Acc<T>>(rv > Acc<T>(0) ? 1 : 0));
  }
}

template <typename T>
T RandomValue(std::mt19937_64& rng, bool specials) {
  const int k = static_cast<int>(rng() % 100);
  double v;
  if (specials && k < 4) {
    const double s[] = {0.0, -0.0, INFINITY, -INFINITY};
    v = s[k];
  } else if (specials && k < 7) {
    v = NAN;
  } else if (k < 60) {
    v = static_cast<double>(static_cast<int>(rng() % 7) - 4);  // ties, non-positive windows
  } else {
    v = std::normal_distribution<double>(0.0, 2.0)(rng);
  }
  return F<T>(static_cast<Acc<T>>(v));
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b, int64_t* first) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (Key(a[i]) != Key(b[i])) {
      *first = static_cast<int64_t>(i);
      return false;
    }
  }
  return true;
}

std::string Describe(const PoolParams& p, const char* type) {
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "%s %s batch=%lld in=%lldx%lld ch=%lld win=%lldx%lld stride=%lldx%lld out=%lldx%lld "
                "pad=%lld,%lld",
                type, p.format == DataFormat::kNHWC ? "NHWC" : "NCHW", (long long)p.batch,
                (long long)p.in_rows, (long long)p.in_cols, (long long)p.channels,
                (long long)p.window_rows, (long long)p.window_cols, (long long)p.stride_rows,
                (long long)p.stride_cols, (long long)p.out_rows, (long long)p.out_cols,
                (long long)p.pad_top, (long long)p.pad_left);
  return buf;
}

// Every kernel for one geometry and type; codes of type C.
// n elements of bytes 0x5a: 1.5e16 in float and bfloat16, codes 90.
template <typename T>
std::vector<T> Poisoned(int64_t n) {
  std::vector<T> v(static_cast<size_t>(n));
  if (n > 0) std::memset(static_cast<void*>(v.data()), 0x5a, v.size() * sizeof(T));
  return v;
}

template <typename T, typename C>
void CheckCase(const PoolParams& p, std::mt19937_64& rng, const ParallelRunner& runner,
               const char* tname) {
  const std::string what = Describe(p, tname);
  std::vector<T> z(p.in_elements()), dy(p.out_elements());
  const bool specials = rng() % 3 == 0;
  for (auto& v : z) v = RandomValue<T>(rng, specials);
  for (auto& v : dy) v = RandomValue<T>(rng, rng() % 8 == 0);
  std::vector<T> y_ref, dz_ref;
  RefResult ref;
  RefForward(p, z, &y_ref, &ref);
  RefBackward(p, z, dy, ref, &dz_ref);
  int64_t bad = -1;

  // Exact-size heap buffers (no slack), so ASan sees any overrun; outputs start as a poison
  // pattern (not zeros, not NaN), so an element the kernels leave unwritten shows.
  std::vector<T> y = Poisoned<T>(p.out_elements());
  if (p.out_elements() > 0) ReluMaxPoolForwardCpu(p, z.data(), y.data(), runner);
  CHECK(SameBits(y, y_ref, &bad), "%s: forward differs at %lld", what.c_str(), (long long)bad);

  std::vector<T> y2 = Poisoned<T>(p.out_elements());
  std::vector<C> codes = Poisoned<C>(p.out_elements());
  if (p.out_elements() > 0)
    ReluMaxPoolForwardWithArgmaxCpu(p, z.data(), y2.data(), codes.data(), runner);
  CHECK(SameBits(y2, y_ref, &bad), "%s: forward with argmax differs at %lld", what.c_str(),
        (long long)bad);
  for (int64_t o = 0; o < p.out_elements(); ++o) {
    const int64_t want = ref.code[o] < 0 ? static_cast<int64_t>(ArgmaxSentinel<C>()) : ref.code[o];
    if (static_cast<int64_t>(codes[o]) != want) {
      CHECK(false, "%s: code[%lld] = %lld, expected %lld", what.c_str(), (long long)o,
            (long long)codes[o], (long long)want);
      break;
    }
  }

  // Backward recomputed from z.
  std::vector<T> dz = Poisoned<T>(p.in_elements());
  const int64_t ws_bytes = BackwardFromInputWorkspaceBytes(p);
  std::vector<uint8_t> ws(static_cast<size_t>(ws_bytes));
  if (p.in_elements() > 0)
    ReluMaxPoolBackwardFromInputCpu(p, z.data(), dy.data(), dz.data(),
                                    ws_bytes > 0 ? ws.data() : nullptr, runner);
  CHECK(SameBits(dz, dz_ref, &bad), "%s: backward from input differs at %lld", what.c_str(),
        (long long)bad);

  // Backward from the codes.
  if (p.in_elements() > 0) {
    CHECK(FindInvalidArgmaxCpu(p, codes.data(), runner) == -1, "%s: valid codes refused",
          what.c_str());
    std::vector<T> dz2 = Poisoned<T>(p.in_elements());
    ReluMaxPoolBackwardFromArgmaxCpu(p, dy.data(), codes.data(), dz2.data(), runner);
    CHECK(SameBits(dz2, dz_ref, &bad), "%s: backward from argmax differs at %lld", what.c_str(),
          (long long)bad);
  }

  // Corrupted codes: validation must find exactly the smallest invalid index.
  if (p.out_elements() > 0 && p.in_elements() > 0) {
    std::vector<C> bad_codes = codes;
    const int n_corrupt = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < n_corrupt; ++k) {
      const int64_t o = static_cast<int64_t>(rng() % static_cast<uint64_t>(p.out_elements()));
      switch (rng() % 4) {
        case 0: bad_codes[o] = static_cast<C>(rng()); break;                 // random bits
        case 1: bad_codes[o] = ArgmaxSentinel<C>(); break;                    // sentinel (valid)
        case 2: bad_codes[o] = static_cast<C>(p.code_positions + rng() % 3); break;  // just past
        default: bad_codes[o] = static_cast<C>(rng() % std::max<int64_t>(1, p.code_positions)); // maybe in padding
      }
    }
    int64_t want = -1;
    for (int64_t o = 0; o < p.out_elements() && want < 0; ++o) {
      const int64_t img_ph_pw = o / p.lanes;
      const int64_t pw = img_ph_pw % p.out_cols, ph = (img_ph_pw / p.out_cols) % p.out_rows;
      int64_t r0, r1, c0, c1;
      RefWindow(p, ph, pw, &r0, &r1, &c0, &c1);
      const C c = bad_codes[o];
      if (c == ArgmaxSentinel<C>()) continue;
      const int64_t v = static_cast<int64_t>(c);
      const bool ok = v >= 0 && v / p.code_pitch < r1 - r0 && v % p.code_pitch < c1 - c0;
      if (!ok) want = o;
    }
    const int64_t got = FindInvalidArgmaxCpu(p, bad_codes.data(), runner);
    CHECK(got == want, "%s: FindInvalidArgmax = %lld, expected %lld", what.c_str(), (long long)got,
          (long long)want);
    if (want < 0) {
      // All still valid (sentinels or in-window positions): the kernel must run cleanly.
      std::vector<T> dz3(p.in_elements());
      ReluMaxPoolBackwardFromArgmaxCpu(p, dy.data(), bad_codes.data(), dz3.data(), runner);
    }
  }
}

bool RandomParams(std::mt19937_64& rng, PoolParams* p, bool big_window) {
  auto U = [&](int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1)); };
  const DataFormat fmt = rng() % 2 ? DataFormat::kNHWC : DataFormat::kNCHW;
  const Padding pad = static_cast<Padding>(rng() % 3);  // VALID, SAME, EXPLICIT
  int64_t n = rng() % 12 == 0 ? U(0, 2) : U(1, 3);
  int64_t c = rng() % 12 == 0 ? U(0, 2) : U(1, 9);
  int64_t h = rng() % 12 == 0 ? U(0, 1) : U(1, 13);
  int64_t w = rng() % 12 == 0 ? U(0, 1) : U(1, 13);
  int64_t kh = U(1, 6), kw = U(1, 6), sh = U(1, 5), sw = U(1, 5);
  if (!big_window && rng() % 3 == 0) {
    // 2x2 stride 2 with sizes that reach the vector loops (16 channels or 16 output columns per
    // vector with AVX-512) and their scalar tails, even and odd.
    kh = kw = sh = sw = 2;
    c = U(1, 40);
    h = U(1, 12);
    w = fmt == DataFormat::kNCHW ? U(1, 72) : U(1, 12);
  }
  if (big_window) {  // more than 255 positions: uint16 / int32 codes
    h = U(16, 20);
    w = U(16, 20);
    kh = U(16, h);
    kw = U(16, w);
    c = U(1, 2);
    n = 1;
  }
  const bool nhwc = fmt == DataFormat::kNHWC;
  const int64_t dims[4] = {n, nhwc ? h : c, nhwc ? w : h, nhwc ? c : w};
  const int64_t ks[4] = {1, nhwc ? kh : 1, nhwc ? kw : kh, nhwc ? 1 : kw};
  const int64_t st[4] = {1, nhwc ? sh : 1, nhwc ? sw : sh, nhwc ? 1 : sw};
  // Explicit pads below the window; none over an empty plane (windows of padding only are
  // refused, see the validation test).
  const bool empty_plane = h == 0 || w == 0;
  const int64_t pt = empty_plane ? 0 : U(0, kh - 1), pb = empty_plane ? 0 : U(0, kh - 1);
  const int64_t pl = empty_plane ? 0 : U(0, kw - 1), pr = empty_plane ? 0 : U(0, kw - 1);
  const int64_t pads[8] = {0, 0, nhwc ? pt : 0, nhwc ? pb : 0, nhwc ? pl : pt, nhwc ? pr : pb,
                           nhwc ? 0 : pl, nhwc ? 0 : pr};
  const std::string err = ComputePoolParams(dims, 4, ks, 4, st, 4, pad, fmt, p, pads, 8);
  CHECK(err.empty(), "valid params refused: %s", err.c_str());
  return err.empty();
}

template <typename T>
void CheckAllCodeTypes(const PoolParams& p, std::mt19937_64& rng, const ParallelRunner& runner,
                       const char* tname) {
  if (CheckArgmaxType<uint8_t>(p, "uint8").empty()) CheckCase<T, uint8_t>(p, rng, runner, tname);
  if (CheckArgmaxType<uint16_t>(p, "uint16").empty()) CheckCase<T, uint16_t>(p, rng, runner, tname);
  CheckCase<T, int32_t>(p, rng, runner, tname);
}

void CheckOneRandomCase(std::mt19937_64& rng, const ParallelRunner& runner, bool big_window) {
  PoolParams p;
  if (!RandomParams(rng, &p, big_window)) return;
  switch (rng() % 4) {
    case 0: CheckAllCodeTypes<float>(p, rng, runner, "float"); break;
    case 1: CheckAllCodeTypes<double>(p, rng, runner, "double"); break;
    case 2: CheckAllCodeTypes<Half>(p, rng, runner, "half"); break;
    default: CheckAllCodeTypes<BFloat16>(p, rng, runner, "bfloat16"); break;
  }
}

// 2x2 stride-2 problems whose dz is 16 MiB or more (kStreamMinBytes): the 2x2 loops write it
// with streaming stores, rows that are not a whole number of vectors included (the last vector
// overlaps the one before and leaves out what that one wrote).
void CheckStreamedCases(std::mt19937_64& rng, const ParallelRunner& runner) {
  struct Case {
    DataFormat fmt;
    int64_t dims[4];
    bool bf16;
  };
  const Case cases[] = {
      {DataFormat::kNCHW, {6, 64, 112, 112}, false},  // 56 output columns
      {DataFormat::kNCHW, {22, 64, 56, 56}, false},   // 28
      {DataFormat::kNHWC, {44, 64, 64, 24}, false},   // 24 channels
      {DataFormat::kNCHW, {12, 64, 112, 112}, true},
  };
  for (const Case& c : cases) {
    const bool nhwc = c.fmt == DataFormat::kNHWC;
    const int64_t four[4] = {1, nhwc ? 2 : 1, 2, nhwc ? 1 : 2};
    PoolParams p;
    const std::string err =
        ComputePoolParams(c.dims, 4, four, 4, four, 4, Padding::kValid, c.fmt, &p, nullptr, 0);
    CHECK(err.empty(), "valid params refused: %s", err.c_str());
    if (!err.empty()) continue;
    if (c.bf16) {
      CheckCase<BFloat16, uint8_t>(p, rng, runner, "bfloat16");
    } else {
      CheckCase<float, uint8_t>(p, rng, runner, "float");
    }
  }
}

// 2x2 stride-2 problems for every row width from 1 to 40 (NCHW: output columns, even and odd
// input sizes; NHWC: channels): rows narrower than a vector (several rows or one partial vector
// per vector on AVX-512, a narrower path elsewhere), whole vectors, an overlapping last vector.
void CheckEveryRowWidth(std::mt19937_64& rng, const ParallelRunner& runner) {
  for (int64_t width = 1; width <= 40; ++width) {
    for (int variant = 0; variant < 3; ++variant) {
      const DataFormat fmt = variant < 2 ? DataFormat::kNCHW : DataFormat::kNHWC;
      const bool nhwc = fmt == DataFormat::kNHWC;
      // NCHW: even input sizes (windows tile the planes: ForwardFlatRows on AVX-512), then odd.
      const int64_t cols = nhwc ? 6 : 2 * width + variant, rows = 4 + variant;
      const int64_t dims[4] = {3, nhwc ? rows : 3, nhwc ? cols : rows, nhwc ? width : cols};
      const int64_t four[4] = {1, nhwc ? 2 : 1, 2, nhwc ? 1 : 2};
      PoolParams p;
      const std::string err =
          ComputePoolParams(dims, 4, four, 4, four, 4, Padding::kValid, fmt, &p, nullptr, 0);
      CHECK(err.empty(), "valid params refused: %s", err.c_str());
      if (!err.empty()) continue;
      CheckCase<float, uint8_t>(p, rng, runner, "float");
      CheckCase<BFloat16, uint8_t>(p, rng, runner, "bfloat16");
    }
  }
}

// ComputePoolParams refuses bad inputs with a message naming the argument, never crashes.
void CheckValidation() {
  PoolParams p;
  const int64_t ok_dims[4] = {1, 4, 4, 1}, ok_k[4] = {1, 2, 2, 1};
  auto expect = [&](const int64_t* dims, int rank, const int64_t* k, int klen, const int64_t* s,
                    int slen, const char* needle) {
    const std::string err =
        ComputePoolParams(dims, rank, k, klen, s, slen, Padding::kValid, DataFormat::kNHWC, &p);
    CHECK(err.find(needle) != std::string::npos, "expected error containing '%s', got '%s'", needle,
          err.c_str());
  };
  const int64_t neg[4] = {1, -4, 4, 1};
  expect(neg, 4, ok_k, 4, ok_k, 4, "negative");
  expect(ok_dims, 3, ok_k, 4, ok_k, 4, "4-D");
  expect(ok_dims, 4, ok_k, 3, ok_k, 4, "ksize must have 4");
  const int64_t zero_k[4] = {1, 0, 2, 1}, big_k[4] = {1, int64_t{1} << 40, 2, 1},
                batch_k[4] = {2, 2, 2, 1}, min_k[4] = {1, std::numeric_limits<int64_t>::min(), 1, 1};
  expect(ok_dims, 4, zero_k, 4, ok_k, 4, "ksize[1]");
  expect(ok_dims, 4, big_k, 4, ok_k, 4, "too large");
  expect(ok_dims, 4, batch_k, 4, ok_k, 4, "batch and channel");
  expect(ok_dims, 4, ok_k, 4, min_k, 4, "strides[1]");
  // Huge (but valid int64) dimensions and attributes: geometry must not overflow.
  const int64_t huge_dims[4] = {1, int64_t{1} << 40, int64_t{1} << 20, 3};
  const int64_t max_k[4] = {1, 2147483647, 2147483647, 1};
  // Regression: INT64_MAX rows (a valid TensorShape, reachable through the compact gradient's
  // input_shape) overflowed PooledSize (signed overflow, negative sizes, a TF CHECK crash).
  const int64_t max_dims[4] = {1, std::numeric_limits<int64_t>::max(), 1, 1};
  const int64_t k2[4] = {1, 2, 1, 1}, k3[4] = {1, 3, 1, 1};
  for (int pad = 0; pad < 2; ++pad) {
    const Padding padding = static_cast<Padding>(pad);
    for (const auto& c : {std::make_pair(huge_dims, max_k), std::make_pair(max_dims, max_k),
                          std::make_pair(max_dims, k2), std::make_pair(max_dims, k3)}) {
      const std::string err = ComputePoolParams(c.first, 4, c.second, 4, c.second, 4, padding,
                                                DataFormat::kNHWC, &p);
      CHECK(err.empty(), "huge geometry refused: %s", err.c_str());
      CHECK(p.out_rows >= 0 && p.out_cols >= 0 && p.pad_top >= 0 && p.pad_left >= 0,
            "huge geometry: negative size");
    }
    const std::string err = ComputePoolParams(max_dims, 4, k3, 4, k2, 4, padding, DataFormat::kNHWC, &p);
    CHECK(err.empty() && p.out_rows == (pad ? std::numeric_limits<int64_t>::max() / 2 + 1
                                            : (std::numeric_limits<int64_t>::max() - 3) / 2 + 1),
          "INT64_MAX rows: out_rows %lld", (long long)p.out_rows);
  }
  // PooledSize against TensorFlow's formulas, in a range where they do not overflow.
  for (int64_t in = 0; in < 40; ++in)
    for (int64_t k = 1; k < 7; ++k)
      for (int64_t s = 1; s < 7; ++s) {
        CHECK(PooledSize(in, k, s, Padding::kSame) == (in + s - 1) / s, "SAME size");
        CHECK(PooledSize(in, k, s, Padding::kValid) == std::max<int64_t>(0, (in - k + s) / s),
              "VALID size");
        for (int64_t a = 0; a < k; ++a)
          for (int64_t b = 0; b < k; ++b)
            CHECK(PooledSize(in, k, s, Padding::kExplicit, a, b) ==
                      (in + a + b < k ? 0 : (in + a + b - k) / s + 1),
                  "EXPLICIT size");
      }
  // Explicit padding: every refusal names explicit_paddings; INT64_MAX rows with pads that
  // exceed the window together (in - (window - pads) would overflow) stay exact.
  const int64_t k33[4] = {1, 3, 3, 1}, s11[4] = {1, 1, 1, 1}, dims5[4] = {1, 5, 5, 2};
  const int64_t bad_pads[][8] = {{1, 0, 0, 0, 0, 0, 0, 0}, {0, 0, 3, 0, 0, 0, 0, 0},
                                 {0, 0, 0, 0, -1, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 0, 1}};
  for (const auto& pads : bad_pads) {
    const std::string err = ComputePoolParams(dims5, 4, k33, 4, s11, 4, Padding::kExplicit,
                                              DataFormat::kNHWC, &p, pads, 8);
    CHECK(err.find("explicit_paddings[") == 0, "bad explicit pads accepted: '%s'", err.c_str());
  }
  const int64_t ok_pads[8] = {0, 0, 2, 1, 0, 2, 0, 0};
  CHECK(ComputePoolParams(dims5, 4, k33, 4, s11, 4, Padding::kExplicit, DataFormat::kNHWC, &p,
                          ok_pads, 7)
                .find("8 elements") != std::string::npos,
        "7 explicit pads accepted");
  CHECK(ComputePoolParams(dims5, 4, k33, 4, s11, 4, Padding::kExplicit, DataFormat::kNHWC, &p,
                          ok_pads, 8).empty() &&
            p.out_rows == 6 && p.out_cols == 5 && p.pad_top == 2 && p.pad_left == 0,
        "explicit geometry");
  const int64_t max_pads[8] = {0, 0, 2, 2, 0, 0, 0, 0};
  CHECK(ComputePoolParams(max_dims, 4, k3, 4, k2, 4, Padding::kExplicit, DataFormat::kNHWC, &p,
                          max_pads, 8).empty() &&
            p.out_rows == std::numeric_limits<int64_t>::max() / 2 + 2,  // (max + 4 - 3) / 2 + 1
        "INT64_MAX rows, explicit: out_rows %lld", (long long)p.out_rows);
  const int64_t no_rows[4] = {1, 0, 4, 1}, k2x1[4] = {1, 2, 1, 1}, pads11[8] = {0, 0, 1, 1, 0, 0, 0, 0};
  CHECK(ComputePoolParams(no_rows, 4, k2x1, 4, s11, 4, Padding::kExplicit, DataFormat::kNHWC, &p,
                          pads11, 8).find("padding only") != std::string::npos,
        "padding-only windows accepted");
}

// Several threads run the kernels at once on shared, read-only inputs (each with its own
// outputs): every result must equal the serial one. Under TSan this also checks for races.
template <typename T>
void CheckConcurrentCalls(uint64_t seed, int threads) {
  std::mt19937_64 rng(seed);
  const int64_t dims[4] = {2, 23, 19, 5}, k[4] = {1, 3, 3, 1}, s[4] = {1, 2, 1, 1};
  PoolParams p;
  CHECK(ComputePoolParams(dims, 4, k, 4, s, 4, Padding::kSame, DataFormat::kNHWC, &p).empty(), "params");
  std::vector<T> z(p.in_elements()), dy(p.out_elements());
  for (auto& v : z) v = RandomValue<T>(rng, true);
  for (auto& v : dy) v = RandomValue<T>(rng, false);
  const SerialRunner serial;
  std::vector<T> y0(p.out_elements()), dz0(p.in_elements()), dza0(p.in_elements());
  std::vector<uint8_t> c0(p.out_elements()), ws(BackwardFromInputWorkspaceBytes(p));
  ReluMaxPoolForwardWithArgmaxCpu(p, z.data(), y0.data(), c0.data(), serial);
  ReluMaxPoolBackwardFromInputCpu(p, z.data(), dy.data(), dz0.data(), ws.data(), serial);
  ReluMaxPoolBackwardFromArgmaxCpu(p, dy.data(), c0.data(), dza0.data(), serial);
  std::vector<std::thread> ts;
  std::vector<int> ok(threads, 0);
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      const ThreadRunner runner(3, seed + t);
      bool good = true;
      for (int rep = 0; rep < 3; ++rep) {
        std::vector<T> y(p.out_elements()), y1(p.out_elements()), dz(p.in_elements()),
            dza(p.in_elements());
        std::vector<uint8_t> c(p.out_elements()), w(ws.size());
        ReluMaxPoolForwardCpu(p, z.data(), y.data(), runner);
        ReluMaxPoolForwardWithArgmaxCpu(p, z.data(), y1.data(), c.data(), runner);
        good &= FindInvalidArgmaxCpu(p, c0.data(), runner) == -1;
        ReluMaxPoolBackwardFromInputCpu(p, z.data(), dy.data(), dz.data(), w.data(), runner);
        ReluMaxPoolBackwardFromArgmaxCpu(p, dy.data(), c0.data(), dza.data(), runner);
        int64_t b;
        good &= SameBits(y, y0, &b) && SameBits(y1, y0, &b) && c == c0 && SameBits(dz, dz0, &b) &&
                SameBits(dza, dza0, &b);
      }
      ok[t] = good;
    });
  }
  for (auto& t : ts) t.join();
  for (int t = 0; t < threads; ++t) CHECK(ok[t], "concurrent thread %d got different results", t);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 400, threads = 4;
  uint64_t seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--iters") iters = std::atoi(argv[i + 1]);
    else if (a == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--threads") threads = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [--iters N] [--seed S] [--threads T]\n", argv[0]);
      return 2;
    }
  }
  CheckValidation();
  // Every instruction-set path this CPU runs, each against the same naive reference.
  std::string isas;
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!CpuIsaSupported(isa)) continue;
    CHECK(SetCpuIsa(isa).empty() && ActiveCpuIsa() == isa, "cannot select %s", CpuIsaName(isa));
    isas += std::string(isas.empty() ? "" : ", ") + CpuIsaName(isa);
    std::mt19937_64 rng(seed);
    const SerialRunner serial;
    for (int it = 0; it < iters; ++it) {
      const ThreadRunner threaded(threads, seed * 1000003 + it);
      const ParallelRunner& runner = it % 2 ? static_cast<const ParallelRunner&>(threaded) : serial;
      CheckOneRandomCase(rng, runner, it % 40 == 39);
    }
    CheckEveryRowWidth(rng, serial);
    CheckEveryRowWidth(rng, ThreadRunner(threads, seed + 7));
    CheckStreamedCases(rng, ThreadRunner(threads, seed));
    CheckConcurrentCalls<float>(seed, threads);
    CheckConcurrentCalls<BFloat16>(seed + 1, threads);
  }
  if (g_failures) {
    std::fprintf(stderr, "kernels_test: %d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("kernels_test: %d random cases (seed %llu, %d threads) + validation + concurrent calls "
              "on each CPU path (%s): OK\n",
              iters, (unsigned long long)seed, threads, isas.c_str());
  return 0;
}
