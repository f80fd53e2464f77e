// TensorFlow-free GPU harness: checks the CUDA kernels (fused and cuDNN paths) bitwise against the
// CPU kernels, then times them against the HBM floor. Built and run by `make gpu-check`;
// `make gpu-sanitize` runs its --small mode under compute-sanitizer.
//
//   gpu_check [--small] [--no-cudnn] [--no-timing] [--configs N] [--seed S]
//
// Exit status 0 only when every check passed.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cc/kernels/relu_max_pool.h"
#include "cc/kernels/relu_max_pool_gpu.h"

using namespace tf_relupool;

#define CUDA_OK(expr)                                                                        \
  do {                                                                                       \
    cudaError_t e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(2);                                                                          \
    }                                                                                        \
  } while (0)

namespace {

int g_failures = 0;
int g_checks = 0;

class ThreadRunner : public ParallelRunner {
 public:
  void For(int64_t total, int64_t, const std::function<void(int64_t, int64_t)>& fn) const override {
    if (total <= 0) return;
    int n = std::max(1u, std::thread::hardware_concurrency());
    if (total < 64) n = 1;
    n = static_cast<int>(std::min<int64_t>(n, total));
    std::vector<std::thread> ts;
    for (int i = 0; i < n; ++i) {
      const int64_t b = total * i / n, e = total * (i + 1) / n;
      ts.emplace_back([&fn, b, e] { fn(b, e); });
    }
    for (auto& t : ts) t.join();
  }
};
const ThreadRunner kRunner;

template <typename T>
T FromF(double v) {
  return ValueTraits<T>::FromAcc(static_cast<typename ValueTraits<T>::Acc>(v));
}
template <typename T>
double ToD(T v) {
  return static_cast<double>(ValueTraits<T>::ToAcc(v));
}

// Device buffer.
struct DBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DBuf(size_t n) : bytes(n) { CUDA_OK(cudaMalloc(&p, std::max<size_t>(n, 16))); }
  ~DBuf() { cudaFree(p); }
  template <typename X>
  X* as() const { return static_cast<X*>(p); }
};
template <typename X>
void Up(DBuf& d, const std::vector<X>& h) {
  CUDA_OK(cudaMemcpy(d.p, h.data(), h.size() * sizeof(X), cudaMemcpyHostToDevice));
}
template <typename X>
std::vector<X> Down(const DBuf& d, size_t n) {
  std::vector<X> h(n);
  CUDA_OK(cudaMemcpy(h.data(), d.p, n * sizeof(X), cudaMemcpyDeviceToHost));
  return h;
}
void Poison(DBuf& d) { CUDA_OK(cudaMemset(d.p, 0xff, d.bytes)); }

std::string Describe(const PoolParams& p) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%s N%lld C%lld H%lld W%lld k%lldx%lld s%lldx%lld pad%lld,%lld out%lldx%lld",
                p.format == DataFormat::kNHWC ? "NHWC" : "NCHW", (long long)p.batch,
                (long long)p.channels, (long long)p.in_rows, (long long)p.in_cols,
                (long long)p.window_rows, (long long)p.window_cols, (long long)p.stride_rows,
                (long long)p.stride_cols, (long long)p.pad_top, (long long)p.pad_left,
                (long long)p.out_rows, (long long)p.out_cols);
  return buf;
}

// Bitwise equality, except that any NaN equals any NaN (see relu_max_pool_gpu.h).
template <typename T>
bool SameValue(T a, T b) {
  if (std::memcmp(&a, &b, sizeof(T)) == 0) return true;
  return std::isnan(ToD(a)) && std::isnan(ToD(b));
}
template <typename T>
int64_t CountDiff(const std::vector<T>& got, const std::vector<T>& want, int64_t* first) {
  int64_t n = 0;
  *first = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!SameValue(got[i], want[i])) {
      if (n++ == 0) *first = static_cast<int64_t>(i);
    }
  }
  return n;
}
template <typename T>
bool Expect(const char* what, const std::string& ctx, const std::vector<T>& got,
            const std::vector<T>& want) {
  ++g_checks;
  int64_t first;
  const int64_t n = CountDiff(got, want, &first);
  if (n == 0) return true;
  ++g_failures;
  if (g_failures <= 30) {
    std::printf("FAIL %s [%s] %s: %lld of %zu differ; first at %lld: got %.9g want %.9g\n", what,
                ValueTraits<T>::kName, ctx.c_str(), (long long)n, want.size(), (long long)first,
                ToD(got[first]), ToD(want[first]));
  }
  return false;
}
template <typename C>
bool ExpectCodes(const char* what, const std::string& ctx, const std::vector<C>& got,
                 const std::vector<C>& want) {
  ++g_checks;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i]) {
      ++g_failures;
      if (g_failures <= 30) {
        std::printf("FAIL %s %s: code %zu: got %lld want %lld\n", what, ctx.c_str(), i,
                    (long long)got[i], (long long)want[i]);
      }
      return false;
    }
  }
  return true;
}
void ExpectEq(const char* what, const std::string& ctx, int64_t got, int64_t want) {
  ++g_checks;
  if (got != want) {
    ++g_failures;
    if (g_failures <= 30) {
      std::printf("FAIL %s %s: got %lld want %lld\n", what, ctx.c_str(), (long long)got, (long long)want);
    }
  }
}

enum class Data { kInts, kSpecial, kNormal };
const char* DataName(Data d) {
  return d == Data::kInts ? "ints" : d == Data::kSpecial ? "special" : "normal";
}

// Input values: small integers give ties and all-non-positive windows; `special` adds +-Inf,
// NaN, -0.0 and values near T's limits; `normal` is ordinary N(0,1) data (few ties).
template <typename T>
std::vector<T> MakeData(int64_t n, Data kind, std::mt19937_64& rng) {
  std::vector<T> v(n);
  std::uniform_int_distribution<int> small(-3, 3), pick(0, 19);
  std::normal_distribution<double> normal(0.0, 1.0);
  const double specials[] = {INFINITY, -INFINITY, NAN, -0.0, 0.0, -NAN, 1e-30, -1e-30};
  for (int64_t i = 0; i < n; ++i) {
    double x;
    if (kind == Data::kNormal) {
      x = normal(rng);
    } else if (kind == Data::kInts) {
      x = small(rng);
      if (x == 0 && pick(rng) < 10) x = -0.0;
    } else {
      const int k = pick(rng);
      x = k < 8 ? specials[k] : k < 14 ? double(small(rng)) : normal(rng);
    }
    v[i] = FromF<T>(x);
  }
  return v;
}

// One random geometry. `fast_bias` makes 2x2 stride 2 with vector-friendly sizes likely.
bool RandomParams(std::mt19937_64& rng, bool small, PoolParams* p) {
  std::uniform_int_distribution<int> coin(0, 3);
  auto U = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const DataFormat fmt = coin(rng) & 1 ? DataFormat::kNCHW : DataFormat::kNHWC;
  const Padding pad = coin(rng) & 1 ? Padding::kSame : Padding::kValid;
  int64_t n = U(1, small ? 2 : 3), c, h, w, kh, kw, sh, sw;
  const int mode = U(0, 5);
  if (mode <= 1) {  // fast-path candidates: 2x2 stride 2 (sometimes odd sizes / lanes)
    kh = kw = sh = sw = 2;
    c = mode == 0 ? 8 * U(1, small ? 2 : 4) : U(1, 9);
    h = 2 * U(1, small ? 4 : 9) + (coin(rng) == 0);
    w = (mode == 0 ? 16 * U(1, small ? 1 : 3) : 2 * U(1, 9)) + (coin(rng) == 0);
  } else {
    c = U(1, small ? 5 : 9);
    h = U(1, small ? 9 : 17);
    w = U(1, small ? 9 : 17);
    kh = U(1, mode == 5 ? 9 : 4);  // mode 5: windows often larger than the input
    kw = U(1, mode == 5 ? 9 : 4);
    sh = U(1, 4);
    sw = U(1, 4);
    if (mode == 2) {  // overlapping 3x3 stride 2
      kh = kw = 3;
      sh = sw = 2;
    }
  }
  const bool nhwc = fmt == DataFormat::kNHWC;
  const int64_t dims[4] = {n, nhwc ? h : c, nhwc ? w : h, nhwc ? c : w};
  const int64_t ks[4] = {1, nhwc ? kh : 1, nhwc ? kw : kh, nhwc ? 1 : kw};
  const int64_t st[4] = {1, nhwc ? sh : 1, nhwc ? sw : sh, nhwc ? 1 : sw};
  return ComputePoolParams(dims, 4, ks, 4, st, 4, pad, fmt, p).empty();
}

cudnnHandle_t g_cudnn = nullptr;
bool g_use_cudnn = true;
struct CudnnStats {
  int64_t checks = 0, exact = 0, unsupported = 0;
  int64_t fwd_diff = 0, bwd_diff = 0;
  std::string first_fwd, first_bwd;
};
CudnnStats g_cudnn_stats[3];  // per Data kind

template <typename T, typename C>
void CheckArgmaxOps(const PoolParams& p, const std::string& ctx, const std::vector<T>& z,
                    const std::vector<T>& dy, DBuf& dz_d, DBuf& y_d, DBuf& dy_d, DBuf& z_d,
                    std::mt19937_64& rng, const char* cname) {
  if (!CheckArgmaxType<C>(p, cname).empty()) return;
  const int64_t nin = p.in_elements(), nout = p.out_elements();
  std::vector<T> y_ref(nout), dz_ref(nin);
  std::vector<C> codes_ref(nout);
  if (nout > 0) ReluMaxPoolForwardWithArgmaxCpu(p, z.data(), y_ref.data(), codes_ref.data(), kRunner);
  DBuf codes_d(nout * sizeof(C)), bad_d(8);
  Poison(y_d);
  Poison(codes_d);
  CUDA_OK(ReluMaxPoolForwardWithArgmaxGpu(p, z_d.as<T>(), y_d.as<T>(), codes_d.as<C>(), 0));
  CUDA_OK(cudaDeviceSynchronize());
  const std::string c2 = ctx + " C=" + cname;
  Expect("forward_with_argmax.y", c2, Down<T>(y_d, nout), y_ref);
  ExpectCodes("forward_with_argmax.codes", c2, Down<C>(codes_d, nout), codes_ref);
  // Backward from (valid) codes, with fused validation.
  ReluMaxPoolBackwardFromArgmaxCpu(p, dy.data(), codes_ref.data(), dz_ref.data(), kRunner);
  Up(codes_d, codes_ref);
  Poison(dz_d);
  CUDA_OK(ReluMaxPoolBackwardFromArgmaxGpu(p, dy_d.as<T>(), codes_d.as<C>(), dz_d.as<T>(),
                                           bad_d.as<unsigned long long>(), 0));
  CUDA_OK(cudaDeviceSynchronize());
  Expect("backward_from_argmax", c2, Down<T>(dz_d, nin), dz_ref);
  unsigned long long bad = Down<unsigned long long>(bad_d, 1)[0];
  ExpectEq("backward_from_argmax.validation(valid codes)", c2, bad == ~0ull ? -1 : (int64_t)bad, -1);
  int64_t found = 0;
  CUDA_OK(FindInvalidArgmaxGpu(p, codes_d.as<C>(), bad_d.p, &found, 0));
  ExpectEq("find_invalid(valid codes)", c2, found, -1);
  // Second order from (valid) codes, z standing in for the input-shaped incoming gradient (it has
  // the specials, so NaN/Inf * 0 and -0 are exercised); y_d receives the result.
  std::vector<T> ddy_ref(nout);
  if (nout > 0) ReluMaxPoolGradGradFromArgmaxCpu(p, z.data(), codes_ref.data(), ddy_ref.data(), kRunner);
  Poison(y_d);
  CUDA_OK(ReluMaxPoolGradGradFromArgmaxGpu(p, z_d.as<T>(), codes_d.as<C>(), y_d.as<T>(),
                                           bad_d.as<unsigned long long>(), 0));
  CUDA_OK(cudaDeviceSynchronize());
  Expect("grad_grad_from_argmax", c2, Down<T>(y_d, nout), ddy_ref);
  bad = Down<unsigned long long>(bad_d, 1)[0];
  ExpectEq("grad_grad_from_argmax.validation(valid codes)", c2, bad == ~0ull ? -1 : (int64_t)bad, -1);
  if (nout == 0) return;
  // Plant invalid codes and compare the first bad index with the CPU's.
  std::vector<C> bad_codes = codes_ref;
  std::uniform_int_distribution<int64_t> at(0, nout - 1);
  const int plants = 1 + static_cast<int>(at(rng) % 3);
  for (int i = 0; i < plants; ++i) {
    const int64_t k = at(rng);
    int64_t v = p.code_positions + static_cast<int64_t>(rng() % 3);  // past every window
    if (rng() % 3 == 0) v = p.code_pitch - 1 + p.code_pitch * (p.code_positions / p.code_pitch);
    if (std::is_signed<C>::value && rng() % 3 == 0) v = -1 - static_cast<int64_t>(rng() % 5);
    if (v == static_cast<int64_t>(ArgmaxSentinel<C>())) v = p.code_positions;
    bad_codes[k] = static_cast<C>(v);
  }
  const int64_t want = FindInvalidArgmaxCpu(p, bad_codes.data(), kRunner);
  Up(codes_d, bad_codes);
  CUDA_OK(FindInvalidArgmaxGpu(p, codes_d.as<C>(), bad_d.p, &found, 0));
  ExpectEq("find_invalid(planted)", c2, found, want);
  CUDA_OK(ReluMaxPoolBackwardFromArgmaxGpu(p, dy_d.as<T>(), codes_d.as<C>(), dz_d.as<T>(),
                                           bad_d.as<unsigned long long>(), 0));
  CUDA_OK(cudaDeviceSynchronize());
  bad = Down<unsigned long long>(bad_d, 1)[0];
  ExpectEq("backward_from_argmax.validation(planted)", c2, bad == ~0ull ? -1 : (int64_t)bad, want);
  CUDA_OK(ReluMaxPoolGradGradFromArgmaxGpu(p, z_d.as<T>(), codes_d.as<C>(), y_d.as<T>(),
                                           bad_d.as<unsigned long long>(), 0));
  CUDA_OK(cudaDeviceSynchronize());
  bad = Down<unsigned long long>(bad_d, 1)[0];
  ExpectEq("grad_grad_from_argmax.validation(planted)", c2, bad == ~0ull ? -1 : (int64_t)bad, want);
}

template <typename T>
void CheckOne(const PoolParams& p, Data kind, std::mt19937_64& rng) {
  const int64_t nin = p.in_elements(), nout = p.out_elements();
  const std::string ctx = Describe(p) + " data=" + DataName(kind);
  std::vector<T> z = MakeData<T>(nin, kind, rng);
  std::vector<T> dy = MakeData<T>(nout, kind == Data::kSpecial ? Data::kSpecial : Data::kNormal, rng);
  DBuf z_d(nin * sizeof(T)), y_d(nout * sizeof(T)), dy_d(nout * sizeof(T)), dz_d(nin * sizeof(T));
  DBuf ws_d(std::max<int64_t>(BackwardFromInputWorkspaceBytes(p), 16));
  Up(z_d, z);
  Up(dy_d, dy);
  // Forward.
  std::vector<T> y_ref(nout), dz_ref(nin);
  if (nout > 0) ReluMaxPoolForwardCpu(p, z.data(), y_ref.data(), kRunner);
  Poison(y_d);
  CUDA_OK(ReluMaxPoolForwardGpu(p, z_d.as<T>(), y_d.as<T>(), 0));
  CUDA_OK(cudaDeviceSynchronize());
  Expect("forward", ctx, Down<T>(y_d, nout), y_ref);
  // Backward from input.
  std::vector<uint8_t> ws(std::max<int64_t>(BackwardFromInputWorkspaceBytes(p), 1));
  ReluMaxPoolBackwardFromInputCpu(p, z.data(), dy.data(), dz_ref.data(), ws.data(), kRunner);
  Poison(dz_d);
  Poison(ws_d);
  CUDA_OK(ReluMaxPoolBackwardFromInputGpu(p, z_d.as<T>(), dy_d.as<T>(), dz_d.as<T>(), ws_d.p, 0));
  CUDA_OK(cudaDeviceSynchronize());
  Expect("backward_from_input", ctx, Down<T>(dz_d, nin), dz_ref);
  // Compact ops, every code type that fits.
  CheckArgmaxOps<T, uint8_t>(p, ctx, z, dy, dz_d, y_d, dy_d, z_d, rng, "uint8");
  CheckArgmaxOps<T, uint16_t>(p, ctx, z, dy, dz_d, y_d, dy_d, z_d, rng, "uint16");
  CheckArgmaxOps<T, int32_t>(p, ctx, z, dy, dz_d, y_d, dy_d, z_d, rng, "int32");
  // cuDNN path: must equal the CPU on ordinary data; other data is measured, not required.
  if (!g_use_cudnn || nout == 0) return;
  CudnnStats& st = g_cudnn_stats[static_cast<int>(kind)];
  if (!CudnnPathUnsupportedReason(p).empty()) {
    ++st.unsupported;
    return;
  }
  DBuf tmp(CudnnBackwardTempBytes(p, sizeof(T)));
  Poison(y_d);
  std::string err = ReluMaxPoolForwardCudnn(g_cudnn, 0, p, z_d.as<T>(), y_d.as<T>(), tmp.p);
  if (!err.empty()) {
    ++g_failures;
    std::printf("FAIL cudnn forward [%s] %s: %s\n", ValueTraits<T>::kName, ctx.c_str(), err.c_str());
    return;
  }
  CUDA_OK(cudaDeviceSynchronize());
  Poison(dz_d);
  err = ReluMaxPoolBackwardCudnn(g_cudnn, 0, p, z_d.as<T>(), dy_d.as<T>(), dz_d.as<T>(), tmp.p);
  if (!err.empty()) {
    ++g_failures;
    std::printf("FAIL cudnn backward [%s] %s: %s\n", ValueTraits<T>::kName, ctx.c_str(), err.c_str());
    return;
  }
  CUDA_OK(cudaDeviceSynchronize());
  int64_t f1, f2;
  const int64_t d1 = CountDiff(Down<T>(y_d, nout), y_ref, &f1);
  const int64_t d2 = CountDiff(Down<T>(dz_d, nin), dz_ref, &f2);
  ++st.checks;
  st.fwd_diff += d1 > 0;
  st.bwd_diff += d2 > 0;
  st.exact += d1 == 0 && d2 == 0;
  const std::string tag = std::string("[") + ValueTraits<T>::kName + "] " + ctx;
  if (d1 > 0 && st.first_fwd.empty()) st.first_fwd = tag;
  if (d2 > 0 && st.first_bwd.empty()) st.first_bwd = tag;
  if (kind == Data::kNormal && (d1 > 0 || d2 > 0)) {
    // Ordinary data must give the stock result; overlapping windows may sum in another order.
    const bool overlap = !p.windows_disjoint();
    if (d1 > 0 || !overlap) {
      ++g_failures;
      std::printf("FAIL cudnn path on ordinary data [%s] %s: forward %lld, backward %lld elements differ\n",
                  ValueTraits<T>::kName, ctx.c_str(), (long long)d1, (long long)d2);
    }
  }
}

void RunChecks(int configs, bool small, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int done = 0;
  while (done < configs) {
    PoolParams p;
    if (!RandomParams(rng, small, &p)) continue;
    ++done;
    for (Data kind : {Data::kInts, Data::kSpecial, Data::kNormal}) {
      CheckOne<float>(p, kind, rng);
      CheckOne<double>(p, kind, rng);
      CheckOne<Half>(p, kind, rng);
      CheckOne<BFloat16>(p, kind, rng);
    }
  }
  // Fixed cases: the timed shapes' geometry at small batch (fast path both formats).
  for (int fmt = 0; fmt < 2; ++fmt) {
    const bool nhwc = fmt == 0;
    const int64_t c = 64, h = small ? 16 : 112, w = small ? 16 : 112;
    const int64_t dims[4] = {2, nhwc ? h : c, nhwc ? w : h, nhwc ? c : w};
    const int64_t ks[4] = {1, nhwc ? 2 : 1, 2, nhwc ? 1 : 2};
    PoolParams p;
    ComputePoolParams(dims, 4, ks, 4, ks, 4, Padding::kValid, nhwc ? DataFormat::kNHWC : DataFormat::kNCHW, &p);
    for (Data kind : {Data::kInts, Data::kSpecial, Data::kNormal}) {
      CheckOne<float>(p, kind, rng);
      CheckOne<double>(p, kind, rng);
      CheckOne<Half>(p, kind, rng);
      CheckOne<BFloat16>(p, kind, rng);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Timing.

// Median over `samples` of the mean time of `batch` back-to-back launches (launch i uses buffer
// set i % sets, so consecutive launches never find their inputs in the L2). Back-to-back launches
// are how the kernels run inside a training step; a lone launch adds a few microseconds of launch
// latency that no kernel can avoid.
template <typename F>
float MedianMs(F&& launch, int warmup, int samples, int batch = 10) {
  for (int i = 0; i < warmup; ++i) launch(i);
  std::vector<float> ms(samples);
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  int k = warmup;
  for (int i = 0; i < samples; ++i) {
    CUDA_OK(cudaEventRecord(a));
    for (int j = 0; j < batch; ++j) launch(k++);
    CUDA_OK(cudaEventRecord(b));
    CUDA_OK(cudaEventSynchronize(b));
    CUDA_OK(cudaEventElapsedTime(&ms[i], a, b));
    ms[i] /= batch;
  }
  CUDA_OK(cudaEventDestroy(a));
  CUDA_OK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[samples / 2];
}

double g_copy_bw = 0;  // bytes (read + written) per second

void MeasureCopy() {
  const size_t bytes = size_t{1} << 30;
  DBuf a(bytes), b(bytes);
  CUDA_OK(cudaMemset(a.p, 1, bytes));
  const float ms = MedianMs([&](int) { CUDA_OK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice)); }, 3, 20, 1);
  g_copy_bw = 2.0 * bytes / (ms * 1e-3);
  const float ms_set = MedianMs([&](int) { CUDA_OK(cudaMemsetAsync(b.p, 0, bytes)); }, 3, 20, 1);
  std::printf("device-to-device copy: %.3f TB/s (bytes read + written); memset (write only): %.3f TB/s\n",
              g_copy_bw / 1e12, bytes / (ms_set * 1e-3) / 1e12);
}

struct Row {
  std::string shape, fmt, dtype, op;
  double fused_ms, cudnn_ms, floor_ms;
};
std::vector<Row> g_rows;

template <typename T>
void TimeShape(int64_t n, int64_t c, int64_t h, int64_t w, DataFormat fmt) {
  const bool nhwc = fmt == DataFormat::kNHWC;
  const int64_t dims[4] = {n, nhwc ? h : c, nhwc ? w : h, nhwc ? c : w};
  const int64_t ks[4] = {1, nhwc ? 2 : 1, 2, nhwc ? 1 : 2};
  PoolParams p;
  ComputePoolParams(dims, 4, ks, 4, ks, 4, Padding::kValid, fmt, &p);
  const int64_t nin = p.in_elements(), nout = p.out_elements(), s = sizeof(T);
  // Rotate over enough buffer sets that the working set is far larger than the L2.
  const int64_t set_bytes = 2 * nin * s + 2 * nout * s + nout;
  const int sets = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(8, (int64_t{1} << 30) / set_bytes + 1)));
  std::vector<std::unique_ptr<DBuf>> z, y, dy, dz, codes;
  std::mt19937_64 rng(7);
  for (int i = 0; i < sets; ++i) {
    z.emplace_back(new DBuf(nin * s));
    dz.emplace_back(new DBuf(nin * s));
    y.emplace_back(new DBuf(nout * s));
    dy.emplace_back(new DBuf(nout * s));
    codes.emplace_back(new DBuf(nout));
    Up(*z.back(), MakeData<T>(nin, Data::kNormal, rng));
    Up(*dy.back(), MakeData<T>(nout, Data::kNormal, rng));
    CUDA_OK(ReluMaxPoolForwardWithArgmaxGpu(p, z[i]->template as<T>(), y[i]->template as<T>(), codes[i]->template as<uint8_t>(), 0));
  }
  DBuf bad(8), tmp(CudnnBackwardTempBytes(p, s));
  CUDA_OK(cudaDeviceSynchronize());
  const int W = 10, I = 30;
  auto R = [&](int i) { return i % sets; };
  const float f_fwd = MedianMs([&](int i) { CUDA_OK(ReluMaxPoolForwardGpu(p, z[R(i)]->template as<T>(), y[R(i)]->template as<T>(), 0)); }, W, I);
  const float f_fwda = MedianMs([&](int i) {
    CUDA_OK(ReluMaxPoolForwardWithArgmaxGpu(p, z[R(i)]->template as<T>(), y[R(i)]->template as<T>(), codes[R(i)]->template as<uint8_t>(), 0)); }, W, I);
  const float f_bwdz = MedianMs([&](int i) {
    CUDA_OK(ReluMaxPoolBackwardFromInputGpu(p, z[R(i)]->template as<T>(), dy[R(i)]->template as<T>(), dz[R(i)]->template as<T>(), nullptr, 0)); }, W, I);
  const float f_bwda = MedianMs([&](int i) {
    CUDA_OK(ReluMaxPoolBackwardFromArgmaxGpu(p, dy[R(i)]->template as<T>(), codes[R(i)]->template as<uint8_t>(), dz[R(i)]->template as<T>(),
                                             bad.as<unsigned long long>(), 0)); }, W, I);
  float c_fwd = NAN, c_bwd = NAN;
  if (g_use_cudnn) {
    auto check = [](const std::string& e) {
      if (!e.empty()) {
        std::printf("cudnn error: %s\n", e.c_str());
        std::exit(2);
      }
    };
    c_fwd = MedianMs([&](int i) { check(ReluMaxPoolForwardCudnn(g_cudnn, 0, p, z[R(i)]->template as<T>(), y[R(i)]->template as<T>(), tmp.p)); }, W, I);
    c_bwd = MedianMs([&](int i) {
      check(ReluMaxPoolBackwardCudnn(g_cudnn, 0, p, z[R(i)]->template as<T>(), dy[R(i)]->template as<T>(), dz[R(i)]->template as<T>(), tmp.p)); }, W, I);
  }
  CUDA_OK(cudaDeviceSynchronize());
  char shape[64];
  std::snprintf(shape, sizeof(shape), "%lldx%lldx%lldx%lld", (long long)n, (long long)c, (long long)h, (long long)w);
  const std::string f = nhwc ? "NHWC" : "NCHW", dt = ValueTraits<T>::kName;
  auto floor_ms = [&](double bytes) { return bytes / g_copy_bw * 1e3; };
  const double b_fwd = (nin + nout) * s, b_fwda = (nin + nout) * s + nout;
  const double b_bwdz = (2 * nin + nout) * s, b_bwda = (nin + nout) * s + nout;
  g_rows.push_back({shape, f, dt, "fwd", f_fwd, c_fwd, floor_ms(b_fwd)});
  g_rows.push_back({shape, f, dt, "fwd+argmax(u8)", f_fwda, NAN, floor_ms(b_fwda)});
  g_rows.push_back({shape, f, dt, "bwd from z", f_bwdz, c_bwd, floor_ms(b_bwdz)});
  g_rows.push_back({shape, f, dt, "bwd from argmax", f_bwda, NAN, floor_ms(b_bwda)});
  g_rows.push_back({shape, f, dt, "fwd+bwd keep z", f_fwd + f_bwdz, c_fwd + c_bwd, floor_ms(b_fwd + b_bwdz)});
  g_rows.push_back({shape, f, dt, "fwd+bwd argmax", f_fwda + f_bwda, c_fwd + c_bwd, floor_ms(b_fwda + b_bwda)});
}

void PrintTable() {
  std::printf("\ntimes: median of 30 samples, each the mean of 10 back-to-back launches over rotating "
              "buffer sets (working set > 1 GiB); 2x2 window, stride 2, VALID; HBM floor = bytes that "
              "must move / copy bandwidth above; bwd from argmax includes the fused code validation; "
              "cudnn = ReLU kernel + cudnnPoolingForward (+ cudnnPoolingForward + cudnnPoolingBackward "
              "+ ReluGrad kernel for bwd)\n");
  std::printf("\n| shape (NCHW sizes) | format | dtype | op | fused ms | cudnn ms | HBM floor ms | fused / floor | cudnn / fused |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : g_rows) {
    char cud[32] = "-", sp[32] = "-";
    if (!std::isnan(r.cudnn_ms)) {
      std::snprintf(cud, sizeof(cud), "%.4f", r.cudnn_ms);
      std::snprintf(sp, sizeof(sp), "%.2fx", r.cudnn_ms / r.fused_ms);
    }
    std::printf("| %s | %s | %s | %s | %.4f | %s | %.4f | %.3f | %s |\n", r.shape.c_str(), r.fmt.c_str(),
                r.dtype.c_str(), r.op.c_str(), r.fused_ms, cud, r.floor_ms, r.floor_ms / r.fused_ms, sp);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false, timing = true;
  int configs = 60;
  uint64_t seed = 12345;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--small") {
      small = true;
    } else if (a == "--no-cudnn") {
      g_use_cudnn = false;
    } else if (a == "--no-timing") {
      timing = false;
    } else if (a == "--configs" && i + 1 < argc) {
      configs = std::atoi(argv[++i]);
    } else if (a == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: %s [--small] [--no-cudnn] [--no-timing] [--configs N] [--seed S]\n", argv[0]);
      return 2;
    }
  }
  if (small) {
    timing = false;
    if (configs == 60) configs = 12;
  }
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::printf("device: %s, %d SMs, L2 %d MiB, driver API %d, runtime %d\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, driver, runtime);
  if (g_use_cudnn) {
    const std::string err = CudnnCreateHandle(&g_cudnn);
    if (!err.empty()) {
      std::printf("cuDNN unavailable, skipping the cuDNN path: %s\n", err.c_str());
      g_use_cudnn = false;
    }
  }
  RunChecks(configs, small, seed);
  std::printf("checks: %d, failures: %d (%d random configurations x 3 data kinds x 4 dtypes + fixed)\n",
              g_checks, g_failures, configs);
  if (g_use_cudnn) {
    for (int k = 0; k < 3; ++k) {
      const CudnnStats& s = g_cudnn_stats[k];
      std::printf("cudnn path vs CPU, data=%s: %lld cases, %lld bitwise equal, forward differs in %lld, "
                  "backward differs in %lld, %lld geometries not expressible in cuDNN (fused used)\n",
                  DataName(static_cast<Data>(k)), (long long)s.checks, (long long)s.exact,
                  (long long)s.fwd_diff, (long long)s.bwd_diff, (long long)s.unsupported);
      if (!s.first_fwd.empty()) std::printf("  first forward difference: %s\n", s.first_fwd.c_str());
      if (!s.first_bwd.empty()) std::printf("  first backward difference: %s\n", s.first_bwd.c_str());
    }
  }
  if (timing) {
    MeasureCopy();
    for (DataFormat fmt : {DataFormat::kNCHW, DataFormat::kNHWC}) {
      TimeShape<float>(128, 64, 112, 112, fmt);
      TimeShape<BFloat16>(128, 64, 112, 112, fmt);
      TimeShape<float>(512, 64, 32, 32, fmt);
      TimeShape<BFloat16>(512, 64, 32, 32, fmt);
    }
    PrintTable();
  }
  if (g_cudnn) CudnnDestroyHandle(g_cudnn);
  std::printf("%s\n", g_failures == 0 ? "ALL CHECKS PASSED" : "CHECKS FAILED");
  return g_failures == 0 ? 0 : 1;
}
