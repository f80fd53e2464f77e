// Value types and conversions shared by the CPU and CUDA kernels.
//
// The kernels never see TensorFlow or Eigen: 16-bit floats are carried as their bit patterns
// (tf_relupool::Half, tf_relupool::BFloat16), which have the same size and layout as
// Eigen::half / Eigen::bfloat16 and CUDA's __half / __nv_bfloat16, so callers reinterpret their
// buffers. All arithmetic on 16-bit types is done in float and rounded back to nearest-even after
// every operation, which is exactly what Eigen's half/bfloat16 operators do.
#ifndef TF_RELUPOOL_CC_KERNELS_NUMERIC_H_
#define TF_RELUPOOL_CC_KERNELS_NUMERIC_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TFRP_HD __host__ __device__ __forceinline__
#else
#define TFRP_HD inline
#endif

namespace tf_relupool {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};
static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2, "16-bit value types must be 2 bytes");

TFRP_HD float BitsToFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
TFRP_HD uint32_t FloatToBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

// Exact for every half (subnormals, Inf, NaN payloads) and branch-free, so loops converting
// arrays of halves vectorise: the exponent is rebiased, Inf/NaN get the extra rebias to 255,
// and zero/subnormal inputs are renormalised by one float subtraction.
TFRP_HD float HalfToFloat(uint16_t h) {
  const uint32_t shifted_exp = 0x7c00u << 13;
  const uint32_t o = (static_cast<uint32_t>(h) & 0x7fffu) << 13;
  const uint32_t exp = o & shifted_exp;
  // All-ones masks instead of branches or ?: (GCC will not if-convert those here).
  const uint32_t is_inf_nan = 0u - static_cast<uint32_t>(exp == shifted_exp);
  const uint32_t is_small = 0u - static_cast<uint32_t>(exp == 0);
  const uint32_t normal = o + ((127u - 15u) << 23) + (is_inf_nan & ((128u - 16u) << 23));
  const uint32_t subnormal =
      FloatToBits(BitsToFloat(o + (113u << 23)) - BitsToFloat(113u << 23));
  const uint32_t magnitude = (subnormal & is_small) | (normal & ~is_small);
  return BitsToFloat(magnitude | ((static_cast<uint32_t>(h) & 0x8000u) << 16));
}

// Round to nearest even; NaN becomes the quiet NaN 0x7e00 (sign kept), as Eigen does.
TFRP_HD uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (au >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to Inf
  if (au < 0x38800000u) {
    // Result is subnormal or zero: add 0.5 (as a float) to shift the mantissa into place.
    const float magic = BitsToFloat(0x3f000000u);  // 0.5
    const float shifted = BitsToFloat(au) + magic;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(FloatToBits(shifted) - FloatToBits(magic)));
  }
  const uint32_t mant_odd = (au >> 13) & 1u;
  const uint32_t r = au + 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(r >> 13));
}

TFRP_HD float BFloat16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

TFRP_HD uint16_t FloatToBFloat16(float f) {
  const uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7fc0u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// ValueTraits<T>: the type arithmetic is done in (Acc), conversions, and the value every window
// starts from (what a window whose ReLU'd values are all NaN yields): the lowest finite value of T,
// Eigen's NumTraits<T>::lowest(), for every T. That is what stock MaxPool's plain Eigen kernels
// give for every dtype on every CPU; stock is itself machine-dependent for 16-bit types (-Inf from
// some oneDNN and vectorised paths), so the fused ops define it once, the same on every device.
template <typename T>
struct ValueTraits;

template <>
struct ValueTraits<float> {
  using Acc = float;
  static TFRP_HD float ToAcc(float v) { return v; }
  static TFRP_HD float FromAcc(float v) { return v; }
  static TFRP_HD float Lowest() { return -3.40282346638528859812e+38F; }
  static constexpr const char* kName = "float";
};
template <>
struct ValueTraits<double> {
  using Acc = double;
  static TFRP_HD double ToAcc(double v) { return v; }
  static TFRP_HD double FromAcc(double v) { return v; }
  static TFRP_HD double Lowest() { return -1.79769313486231570815e+308; }
  static constexpr const char* kName = "double";
};
template <>
struct ValueTraits<Half> {
  using Acc = float;
  static TFRP_HD float ToAcc(Half v) { return HalfToFloat(v.bits); }
  static TFRP_HD Half FromAcc(float v) { return Half{FloatToHalf(v)}; }
  static TFRP_HD float Lowest() { return -65504.0f; }  // lowest finite half, 0xfbff
  static constexpr const char* kName = "half";
};
template <>
struct ValueTraits<BFloat16> {
  using Acc = float;
  static TFRP_HD float ToAcc(BFloat16 v) { return BFloat16ToFloat(v.bits); }
  static TFRP_HD BFloat16 FromAcc(float v) { return BFloat16{FloatToBFloat16(v)}; }
  static TFRP_HD float Lowest() { return BitsToFloat(0xff7f0000u); }  // lowest finite, 0xff7f
  static constexpr const char* kName = "bfloat16";
};

}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_KERNELS_NUMERIC_H_
