// Which instruction set a compilation of the CPU kernels targets, and where its code goes.
//
// relu_max_pool_cpu_kernels.cc is compiled once per instruction set; the build (setup.py, BUILD,
// the Makefile's test and GPU harness builds) passes the set's define:
//   (none)                 baseline x86-64 (SSE2), namespace cpu_baseline
//   -DTFRP_CPU_ISA_AVX2    AVX2, namespace cpu_avx2
//   -DTFRP_CPU_ISA_AVX512  AVX-512 F, BW, VL, DQ (Skylake-SP and later, Zen 4 and later),
//                          namespace cpu_avx512
// relu_max_pool_cpu.cc picks one of the three at run time (ActiveCpuIsa).
//
// The kernel headers and the kernel source put their code between TFRP_CPU_TARGET_BEGIN and
// TFRP_CPU_TARGET_END, after their #includes: a `#pragma GCC target` region and the set's
// namespace, where the code is internal (an anonymous namespace) except for the entry points
// that relu_max_pool_cpu_kernels.h declares. Why a pragma and not a -mavx2 flag for the whole
// file: functions from headers (std::vector, std::function, numeric.h) are emitted as weak
// symbols by every object that uses them, and the linker keeps one copy; compiled with -mavx2 in
// one object, that copy could run on a CPU without AVX2 and die of SIGILL. Under the pragma only
// the functions defined after it get the new target; the shared header functions stay baseline
// (they are inlined into the target code where used there). tests/test_cpu_dispatch.py checks
// the binary: AVX instructions appear only in functions of the cpu_avx2 / cpu_avx512 namespaces.
#ifndef TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_ISA_H_
#define TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_ISA_H_

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && \
    (defined(__clang__) || __GNUC__ >= 12)
// GCC >= 12 / Clang: target pragmas, vector extensions with __builtin_convertvector and
// __builtin_cpu_supports. Anything else builds the baseline path alone, with no vector code
// (TFRP_CPU_SIMD 0), and the AVX2 / AVX-512 compilations of the kernel source are empty.
#define TFRP_CPU_MULTI_ISA 1
#else
#define TFRP_CPU_MULTI_ISA 0
#endif

#if defined(TFRP_CPU_ISA_AVX2) && defined(TFRP_CPU_ISA_AVX512)
#error "define at most one of TFRP_CPU_ISA_AVX2 and TFRP_CPU_ISA_AVX512"
#endif

// TFRP_CPU_ISA_COMPILED: whether this compilation holds kernels (the baseline always, the others
// with TFRP_CPU_MULTI_ISA). TFRP_CPU_SIMD: whether it has the explicit vector code
// (relu_max_pool_cpu_simd.h, the 2x2 loops). TFRP_CPU_TARGET_PUSH / _POP: the target region.
#if defined(TFRP_CPU_ISA_AVX512)
#define TFRP_CPU_NAMESPACE cpu_avx512
#define TFRP_CPU_VEC_BYTES 64
#define TFRP_CPU_ISA_COMPILED TFRP_CPU_MULTI_ISA
#ifdef __clang__
// Clang: its attribute pragma gives every function of the region the target.
#define TFRP_CPU_TARGET_PUSH \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq\"))), apply_to = function)")
#define TFRP_CPU_TARGET_POP _Pragma("clang attribute pop")
#else
#define TFRP_CPU_TARGET_PUSH \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq\")")
#define TFRP_CPU_TARGET_POP _Pragma("GCC pop_options")
#endif
#elif defined(TFRP_CPU_ISA_AVX2)
#define TFRP_CPU_NAMESPACE cpu_avx2
#define TFRP_CPU_VEC_BYTES 32
#define TFRP_CPU_ISA_COMPILED TFRP_CPU_MULTI_ISA
#ifdef __clang__
#define TFRP_CPU_TARGET_PUSH \
  _Pragma("clang attribute push(__attribute__((target(\"avx2\"))), apply_to = function)")
#define TFRP_CPU_TARGET_POP _Pragma("clang attribute pop")
#else
#define TFRP_CPU_TARGET_PUSH _Pragma("GCC push_options") _Pragma("GCC target(\"avx2\")")
#define TFRP_CPU_TARGET_POP _Pragma("GCC pop_options")
#endif
#else
#define TFRP_CPU_NAMESPACE cpu_baseline
#define TFRP_CPU_VEC_BYTES 16
#define TFRP_CPU_ISA_COMPILED 1
#define TFRP_CPU_TARGET_PUSH
#define TFRP_CPU_TARGET_POP
#endif
#define TFRP_CPU_SIMD TFRP_CPU_MULTI_ISA

// Opens the set's target region and namespace tf_relupool::TFRP_CPU_NAMESPACE.
#define TFRP_CPU_TARGET_BEGIN \
  TFRP_CPU_TARGET_PUSH namespace tf_relupool { namespace TFRP_CPU_NAMESPACE {
// Closes what TFRP_CPU_TARGET_BEGIN opened.
#define TFRP_CPU_TARGET_END \
  }  /* namespace TFRP_CPU_NAMESPACE */ }  /* namespace tf_relupool */ TFRP_CPU_TARGET_POP

#endif  // TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_ISA_H_
