// Element operations of the CPU kernels, shared by the general loops (relu_max_pool_cpu_kernels.cc)
// and the 2x2 loops (relu_max_pool_cpu_2x2.h): ReLU, selects by bits, loads of 16-bit values, the
// gradient's adds and masks. Compiled once per instruction set with them (relu_max_pool_cpu_isa.h).
//
// Every operation here is an exact IEEE operation (compare, select by bits, add, multiply by 0
// or 1), so every instruction-set path gives the same bits; keep it so
// (relu_max_pool_cpu_kernels.cc says more).
#ifndef TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_ELEMENT_H_
#define TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_ELEMENT_H_

#include <cstdint>
#include <cstring>

#include "numeric.h"
#include "relu_max_pool_cpu_isa.h"

TFRP_CPU_TARGET_BEGIN
namespace {

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

// a + b in T (16-bit types: in float, rounded back).
template <typename T>
inline T AddAcc(T a, T b) {
  return ValueTraits<T>::FromAcc(ValueTraits<T>::ToAcc(a) + ValueTraits<T>::ToAcc(b));
}
// Stock ReluGrad's multiply by (relu(z) > 0 ? 1 : 0).
template <typename T>
inline T MaskAcc(T a, bool keep) {
  return ValueTraits<T>::FromAcc(ValueTraits<T>::ToAcc(a) * static_cast<Acc<T>>(keep));
}


}  // namespace
TFRP_CPU_TARGET_END

#endif  // TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_ELEMENT_H_
