// The entry points of the CPU kernels for each instruction set, which relu_max_pool_cpu.cc's
// run-time dispatch calls. relu_max_pool_cpu_kernels.cc defines them, compiled once per set into
// namespace cpu_baseline, cpu_avx2 or cpu_avx512 (relu_max_pool_cpu_isa.h); every set gives the
// same bits. Their contracts are those of the public functions of relu_max_pool.h:
//   Forward             ReluMaxPoolForwardCpu
//   ForwardWithArgmax   ReluMaxPoolForwardWithArgmaxCpu
//   BackwardFromInput   ReluMaxPoolBackwardFromInputCpu (BackwardFromInputWorkspaceBytes)
//   FindInvalidArgmax   FindInvalidArgmaxCpu
//   BackwardFromArgmax  ReluMaxPoolBackwardFromArgmaxCpu
//   GradGradFromArgmax  ReluMaxPoolGradGradFromArgmaxCpu
#ifndef TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_KERNELS_H_
#define TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_KERNELS_H_

#include <cstdint>

#include "numeric.h"
#include "relu_max_pool.h"

namespace tf_relupool {

#define TFRP_CPU_DECLARE_ENTRY_POINTS                                                            \
  template <typename T>                                                                          \
  void Forward(const PoolParams& p, const T* z, T* y, const ParallelRunner& runner);             \
  template <typename T, typename C>                                                              \
  void ForwardWithArgmax(const PoolParams& p, const T* z, T* y, C* argmax,                       \
                         const ParallelRunner& runner);                                          \
  template <typename T>                                                                          \
  void BackwardFromInput(const PoolParams& p, const T* z, const T* dy, T* dz, void* workspace,   \
                         const ParallelRunner& runner);                                          \
  template <typename C>                                                                          \
  int64_t FindInvalidArgmax(const PoolParams& p, const C* argmax, const ParallelRunner& runner); \
  template <typename T, typename C>                                                              \
  void BackwardFromArgmax(const PoolParams& p, const T* dy, const C* argmax, T* dz,              \
                          const ParallelRunner& runner);                                         \
  template <typename T, typename C>                                                              \
  void GradGradFromArgmax(const PoolParams& p, const T* ddz, const C* argmax, T* ddy,            \
                          const ParallelRunner& runner);
namespace cpu_baseline {
TFRP_CPU_DECLARE_ENTRY_POINTS
}  // namespace cpu_baseline
namespace cpu_avx2 {
TFRP_CPU_DECLARE_ENTRY_POINTS
}  // namespace cpu_avx2
namespace cpu_avx512 {
TFRP_CPU_DECLARE_ENTRY_POINTS
}  // namespace cpu_avx512
#undef TFRP_CPU_DECLARE_ENTRY_POINTS

// The types the kernels are instantiated for: EACH_T(T) for every value type T, EACH_TC(T, C) for
// every T and code type C, EACH_C(C) for every C.
#define TFRP_CPU_FOR_EACH_TYPE(EACH_T, EACH_TC, EACH_C)                                 \
  EACH_T(float) EACH_T(double) EACH_T(Half) EACH_T(BFloat16)                            \
  TFRP_CPU_FOR_EACH_CODE_TYPE_OF(float, EACH_TC)                                        \
  TFRP_CPU_FOR_EACH_CODE_TYPE_OF(double, EACH_TC)                                       \
  TFRP_CPU_FOR_EACH_CODE_TYPE_OF(Half, EACH_TC)                                         \
  TFRP_CPU_FOR_EACH_CODE_TYPE_OF(BFloat16, EACH_TC)                                     \
  EACH_C(uint8_t) EACH_C(uint16_t) EACH_C(int32_t)
#define TFRP_CPU_FOR_EACH_CODE_TYPE_OF(T, EACH_TC) \
  EACH_TC(T, uint8_t) EACH_TC(T, uint16_t) EACH_TC(T, int32_t)

// The explicit instantiations of one set of entry points for every type of the list above: the
// file that expands TFRP_CPU_INSTANTIATE_ALL defines TFRP_CPU_NAME(f) as its name for entry point
// f (each instruction set's: f itself; relu_max_pool_cpu.cc's: the public ...Cpu function).
#define TFRP_CPU_INSTANTIATE_T(T)                                                            \
  template void TFRP_CPU_NAME(Forward)<T>(const PoolParams&, const T*, T*,                  \
                                         const ParallelRunner&);                            \
  template void TFRP_CPU_NAME(BackwardFromInput)<T>(const PoolParams&, const T*, const T*, T*, \
                                                   void*, const ParallelRunner&);
#define TFRP_CPU_INSTANTIATE_TC(T, C)                                                         \
  template void TFRP_CPU_NAME(ForwardWithArgmax)<T, C>(const PoolParams&, const T*, T*, C*,   \
                                                      const ParallelRunner&);                 \
  template void TFRP_CPU_NAME(BackwardFromArgmax)<T, C>(const PoolParams&, const T*, const C*, \
                                                       T*, const ParallelRunner&);            \
  template void TFRP_CPU_NAME(GradGradFromArgmax)<T, C>(const PoolParams&, const T*, const C*, \
                                                       T*, const ParallelRunner&);
#define TFRP_CPU_INSTANTIATE_C(C)                                                    \
  template int64_t TFRP_CPU_NAME(FindInvalidArgmax)<C>(const PoolParams&, const C*, \
                                                       const ParallelRunner&);
#define TFRP_CPU_INSTANTIATE_ALL \
  TFRP_CPU_FOR_EACH_TYPE(TFRP_CPU_INSTANTIATE_T, TFRP_CPU_INSTANTIATE_TC, TFRP_CPU_INSTANTIATE_C)

// The narrowest code type for the keep-z backward's workspace: fn(C{}) for that C.
template <typename Fn>
auto WithWorkspaceCodeType(const PoolParams& p, Fn fn) {
  if (p.code_positions < ArgmaxSentinel<uint8_t>()) return fn(uint8_t{});
  if (p.code_positions < ArgmaxSentinel<uint16_t>()) return fn(uint16_t{});
  return fn(int32_t{});
}

}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_KERNELS_H_
