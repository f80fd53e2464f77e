// The CPU kernels' public entry points (relu_max_pool.h): run-time dispatch over instruction sets.
//
// The kernels (relu_max_pool_cpu_kernels.cc) are compiled once per instruction set: baseline
// x86-64 (SSE2, what the library is built for), AVX2 and AVX-512 (F, BW, VL, DQ), each into its
// own namespace (relu_max_pool_cpu_isa.h; the builds pass each compilation its define). Each
// public entry point here picks one at run time from ActiveCpuIsa(): the best the CPU has, or the
// one TF_RELUPOOL_CPU_ISA names.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "relu_max_pool.h"
#include "relu_max_pool_cpu_isa.h"
#include "relu_max_pool_cpu_kernels.h"
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace tf_relupool {

// ---- Choosing the path ----
namespace {

constexpr const char* kIsaEnv = "TF_RELUPOOL_CPU_ISA";

bool Supported(CpuIsa isa) {
  if (isa == CpuIsa::kBaseline) return true;
#if TFRP_CPU_MULTI_ISA
  // __builtin_cpu_supports also checks that the OS saves the YMM / ZMM registers (XCR0).
  __builtin_cpu_init();
  if (isa == CpuIsa::kAvx2) return __builtin_cpu_supports("avx2");
  if (isa == CpuIsa::kAvx512) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }
#endif
  return false;
}

CpuIsa Best() {
  if (Supported(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (Supported(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kBaseline;
}

// The path from TF_RELUPOOL_CPU_ISA, or the best one; a bad request is logged once (this file
// has no logging framework: one line on stderr, like TensorFlow's own start-up messages).
CpuIsa FromEnvironment() {
  const char* env = std::getenv(kIsaEnv);
  const std::string want = env == nullptr ? "" : env;
  if (want.empty() || want == "auto") return Best();
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (want != CpuIsaName(isa)) continue;
    if (Supported(isa)) return isa;
    std::fprintf(stderr,
                 "tf_relupool: %s=%s, but this CPU or build cannot run that path; using %s\n",
                 kIsaEnv, env, CpuIsaName(Best()));
    return Best();
  }
  std::fprintf(stderr,
               "tf_relupool: %s=%s is not one of auto, baseline, avx2, avx512; using %s\n",
               kIsaEnv, env, CpuIsaName(Best()));
  return Best();
}

std::atomic<int> g_isa{-1};  // -1: not chosen yet
std::once_flag g_isa_once;

}  // namespace

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    default: return "baseline";
  }
}

bool CpuIsaSupported(CpuIsa isa) { return Supported(isa); }

CpuIsa ActiveCpuIsa() {
  int isa = g_isa.load(std::memory_order_acquire);
  if (isa < 0) {
    std::call_once(g_isa_once, [] {
      int unset = -1;
      g_isa.compare_exchange_strong(unset, static_cast<int>(FromEnvironment()));
    });
    isa = g_isa.load(std::memory_order_acquire);
  }
  return static_cast<CpuIsa>(isa);
}

std::string SetCpuIsa(CpuIsa isa) {
  if (!Supported(isa)) {
    return std::string("CPU path ") + CpuIsaName(isa) + " is not supported by this CPU or build";
  }
  ActiveCpuIsa();  // read the environment first, so that it cannot override this later
  g_isa.store(static_cast<int>(isa), std::memory_order_release);
  return "";
}

// Calls `cpu_<isa>::<call>` for the active path. The chosen path is read once per call.
#if TFRP_CPU_MULTI_ISA
#define TFRP_CPU_DISPATCH(...)                                  \
  switch (ActiveCpuIsa()) {                                     \
    case CpuIsa::kAvx512: return cpu_avx512::__VA_ARGS__;       \
    case CpuIsa::kAvx2: return cpu_avx2::__VA_ARGS__;           \
    default: return cpu_baseline::__VA_ARGS__;                  \
  }
#else
#define TFRP_CPU_DISPATCH(...) return cpu_baseline::__VA_ARGS__;
#endif

// The pooling loops run their vectors along a row (NCHW: output columns, NHWC: channels), and a
// row narrower than a vector falls to scalar code. So each forward and backward call takes the
// widest path, up to the active one, whose vectors fit the row; every path gives the same bits.
// Measured (AMD EPYC Zen 4, NCHW float32, forward with codes): 28x28 planes 4.5 ms on the AVX-512
// path (16 lanes > 14 columns) and 0.74 ms on the AVX2 path; 14x14 planes 15.6 ms on AVX-512 or
// AVX2 and 3.1 ms on the baseline path (4 lanes). Except NCHW 2x2 stride-2 rows on the AVX-512
// path, whose loops take rows narrower than a vector themselves (several whole rows per vector,
// or one masked vector per row: kPartialVectors, relu_max_pool_cpu_2x2.h's FlatRows).
#if TFRP_CPU_MULTI_ISA
namespace {
CpuIsa PathFor(const PoolParams& p) {
  CpuIsa isa = ActiveCpuIsa();
  if (isa == CpuIsa::kAvx512 && p.lanes == 1 && p.window_rows == 2 && p.window_cols == 2 &&
      p.stride_rows == 2 && p.stride_cols == 2) {
    return isa;
  }
  const int64_t row = p.lanes == 1 ? p.out_cols : p.lanes;
  if (isa == CpuIsa::kAvx512 && row < 16) isa = CpuIsa::kAvx2;
  if (isa == CpuIsa::kAvx2 && row < 8) isa = CpuIsa::kBaseline;
  return isa;
}
}  // namespace

// TFRP_CPU_DISPATCH with the path PathFor(p) chooses.
#define TFRP_CPU_DISPATCH_ROWS(p, ...)                          \
  switch (PathFor(p)) {                                         \
    case CpuIsa::kAvx512: return cpu_avx512::__VA_ARGS__;       \
    case CpuIsa::kAvx2: return cpu_avx2::__VA_ARGS__;           \
    default: return cpu_baseline::__VA_ARGS__;                  \
  }
#else
#define TFRP_CPU_DISPATCH_ROWS(p, ...) return cpu_baseline::__VA_ARGS__;
#endif

// Asks the kernel to back [p, p + bytes) with 2 MiB pages where it can (a hint: errors are
// ignored, the data never changes). An output TensorFlow's CPU allocator takes from a fresh
// mapping (glibc maps every block above 32 MiB anew) is paid for in page faults, one per 4 KiB
// page written, each zeroing its page: for a 64 MiB dz, 16,384 faults, which cost more than the
// kernel's own work. With the hint, 32. Pages already in use are left as they are. Measured
// (AMD EPYC, oneDNN off, float32 2x2 NHWC): the backward from codes into a fresh 64 MiB dz
// 24.9 -> 14.2 ms, forward+backward in tf.function 1.4-1.7x faster; oneDNN on (reused memory):
// unchanged.
namespace {
constexpr int64_t kHugePageBytes = int64_t{2} << 20;
constexpr int64_t kAdviseMinBytes = 4 * kHugePageBytes;
void AdviseHugePages(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (p == nullptr || bytes < kAdviseMinBytes) return;
  const uintptr_t huge = kHugePageBytes;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + huge - 1) & ~(huge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(huge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}
}  // namespace

template <typename T>
void ReluMaxPoolForwardCpu(const PoolParams& p, const T* z, T* y, const ParallelRunner& runner) {
  AdviseHugePages(y, p.out_elements() * int64_t(sizeof(T)));
  TFRP_CPU_DISPATCH_ROWS(p, Forward<T>(p, z, y, runner));
}

template <typename T, typename C>
void ReluMaxPoolForwardWithArgmaxCpu(const PoolParams& p, const T* z, T* y, C* argmax,
                                     const ParallelRunner& runner) {
  AdviseHugePages(y, p.out_elements() * int64_t(sizeof(T)));
  TFRP_CPU_DISPATCH_ROWS(p, ForwardWithArgmax<T, C>(p, z, y, argmax, runner));
}

int64_t BackwardFromInputWorkspaceBytes(const PoolParams& p) {
  if (p.windows_disjoint()) return 0;
  return WithWorkspaceCodeType(p, [&](auto c) { return p.out_elements() * int64_t(sizeof(c)); });
}

template <typename T>
void ReluMaxPoolBackwardFromInputCpu(const PoolParams& p, const T* z, const T* dy, T* dz,
                                     void* workspace, const ParallelRunner& runner) {
  AdviseHugePages(dz, p.in_elements() * int64_t(sizeof(T)));
  TFRP_CPU_DISPATCH_ROWS(p, BackwardFromInput<T>(p, z, dy, dz, workspace, runner));
}

template <typename C>
int64_t FindInvalidArgmaxCpu(const PoolParams& p, const C* argmax, const ParallelRunner& runner) {
  TFRP_CPU_DISPATCH(FindInvalidArgmax<C>(p, argmax, runner));
}

template <typename T, typename C>
void ReluMaxPoolBackwardFromArgmaxCpu(const PoolParams& p, const T* dy, const C* argmax, T* dz,
                                      const ParallelRunner& runner) {
  AdviseHugePages(dz, p.in_elements() * int64_t(sizeof(T)));
  TFRP_CPU_DISPATCH_ROWS(p, BackwardFromArgmax<T, C>(p, dy, argmax, dz, runner));
}

template <typename T, typename C>
void ReluMaxPoolGradGradFromArgmaxCpu(const PoolParams& p, const T* ddz, const C* argmax, T* ddy,
                                      const ParallelRunner& runner) {
  TFRP_CPU_DISPATCH_ROWS(p, GradGradFromArgmax<T, C>(p, ddz, argmax, ddy, runner));
}

// The public names of the entry points (relu_max_pool.h), for TFRP_CPU_INSTANTIATE_ALL.
#define TFRP_CPU_NAME(f) TFRP_CPU_PUBLIC_##f
#define TFRP_CPU_PUBLIC_Forward ReluMaxPoolForwardCpu
#define TFRP_CPU_PUBLIC_ForwardWithArgmax ReluMaxPoolForwardWithArgmaxCpu
#define TFRP_CPU_PUBLIC_BackwardFromInput ReluMaxPoolBackwardFromInputCpu
#define TFRP_CPU_PUBLIC_FindInvalidArgmax FindInvalidArgmaxCpu
#define TFRP_CPU_PUBLIC_BackwardFromArgmax ReluMaxPoolBackwardFromArgmaxCpu
#define TFRP_CPU_PUBLIC_GradGradFromArgmax ReluMaxPoolGradGradFromArgmaxCpu
TFRP_CPU_INSTANTIATE_ALL

}  // namespace tf_relupool

// C entry points for tools that load the op library with ctypes (tests/test_cpu_dispatch.py,
// benchmarks/bench_ops.py): which path runs, and switching it within a process.
extern "C" {
__attribute__((visibility("default"))) const char* tf_relupool_cpu_isa() {
  return tf_relupool::CpuIsaName(tf_relupool::ActiveCpuIsa());
}
// Returns 0 on success, -1 for an unknown name, -2 for a path this CPU or build cannot run.
__attribute__((visibility("default"))) int tf_relupool_set_cpu_isa(const char* name) {
  using tf_relupool::CpuIsa;
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (std::strcmp(name, tf_relupool::CpuIsaName(isa)) == 0) {
      return tf_relupool::SetCpuIsa(isa).empty() ? 0 : -2;
    }
  }
  return -1;
}
__attribute__((visibility("default"))) int tf_relupool_cpu_isa_supported(const char* name) {
  using tf_relupool::CpuIsa;
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (std::strcmp(name, tf_relupool::CpuIsaName(isa)) == 0) {
      return tf_relupool::CpuIsaSupported(isa) ? 1 : 0;
    }
  }
  return 0;
}
}
