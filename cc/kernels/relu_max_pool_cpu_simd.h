// Per-ISA vector primitives for the CPU kernels (relu_max_pool_cpu_impl.h).
//
// NO include guard: relu_max_pool_cpu.cc includes this once per instruction set, inside that
// set's namespace and `#pragma GCC target` region, after defining TFRP_CPU_VEC_BYTES (16: SSE2,
// 32: AVX2, 64: AVX-512) and TFRP_CPU_ISA_AVX2 / TFRP_CPU_ISA_AVX512 (0 or 1).
//
// The vectors are GCC/Clang vector extensions of one register's width: every operation on them is
// the same IEEE operation as the scalar code's, lane by lane (compare, select, add, multiply by
// 0/1), so vector and scalar results are bitwise identical. Only conversions between bytes and
// 32-bit lanes use intrinsics, because GCC lowers __builtin_convertvector between those widths to
// element-by-element code.

constexpr int kVecBytes = TFRP_CPU_VEC_BYTES;
constexpr int kVecLanes = kVecBytes / 4;  // 32-bit lanes per vector: 4, 8 or 16
typedef float VecF __attribute__((vector_size(kVecBytes)));
typedef int32_t VecI __attribute__((vector_size(kVecBytes)));  // comparison masks: 0 / -1
typedef uint32_t VecU __attribute__((vector_size(kVecBytes)));
typedef uint16_t VecU16 __attribute__((vector_size(kVecBytes / 2)));  // kVecLanes 16-bit values
typedef uint64_t VecU64 __attribute__((vector_size(kVecBytes * 2)));  // kVecLanes 64-bit values

template <typename V>
inline V LoadVec(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}
template <typename V>
inline void StoreVec(void* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}
inline VecF SplatF(float f) { return VecF{} + f; }
inline VecU SplatU(uint32_t u) { return VecU{} + u; }

// kVecLanes bytes <-> 32-bit lanes (values 0..255).
inline VecU WidenBytes(const uint8_t* p) {
#if TFRP_CPU_ISA_AVX512
  // The maskz forms: GCC 12's plain ones start from an "undefined" vector and warn about it.
  return (VecU)_mm512_maskz_cvtepu8_epi32(0xffff, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif TFRP_CPU_ISA_AVX2
  return (VecU)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  int32_t word;
  std::memcpy(&word, p, 4);
  const __m128i zero = _mm_setzero_si128();
  return (VecU)_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(word), zero), zero);
#endif
}
inline void NarrowToBytes(VecU v, uint8_t* p) {
#if TFRP_CPU_ISA_AVX512
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_maskz_cvtepi32_epi8(0xffff, (__m512i)v));
#elif TFRP_CPU_ISA_AVX2
  const __m128i lo = _mm256_castsi256_si128((__m256i)v);
  const __m128i hi = _mm256_extracti128_si256((__m256i)v, 1);
  const __m128i w = _mm_packs_epi32(lo, hi);  // values <= 255: no saturation
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
#else
  const __m128i w = _mm_packs_epi32((__m128i)v, (__m128i)v);
  const int32_t word = _mm_cvtsi128_si32(_mm_packus_epi16(w, w));
  std::memcpy(p, &word, 4);
#endif
}

// Value types with a vector path: float and bfloat16, both computed in float lanes.
//   Load(p):        kVecLanes consecutive values as floats (exact).
//   LoadPairs(p):   2 * kVecLanes consecutive values, split into even and odd elements.
//   Round(f):       the bits of ValueTraits<T>::FromAcc(f), in 32-bit lanes.
//   Exact(f):       the same for f that T represents exactly (no rounding needed).
//   Widen(bits):    ValueTraits<T>::ToAcc of T bits held in 32-bit lanes.
//   Store / StorePairs: write T bits (32-bit lanes); StorePairs interleaves even and odd.
template <typename T>
struct VecType {
  static constexpr bool kSupported = false;
};

template <>
struct VecType<float> {
  static constexpr bool kSupported = true;
  static VecF Load(const float* p) { return LoadVec<VecF>(p); }
  static void LoadPairs(const float* p, VecF* even, VecF* odd) {
    VecU64 pairs;  // element 2i in the low half of 64-bit lane i
    std::memcpy(&pairs, p, sizeof(pairs));
    *even = (VecF)__builtin_convertvector(pairs, VecU);
    *odd = (VecF)__builtin_convertvector(pairs >> 32, VecU);
  }
  static VecU Round(VecF f) { return (VecU)f; }
  static VecU Exact(VecF f) { return (VecU)f; }
  static VecF Widen(VecU bits) { return (VecF)bits; }
  static void Store(float* p, VecU bits) { StoreVec(p, bits); }
  static void StorePairs(float* p, VecU even, VecU odd) {
    // (memcpy, not StoreVec: a 128-byte vector argument draws an ABI note from GCC at -O1.)
    const VecU64 pairs =
        __builtin_convertvector(even, VecU64) | (__builtin_convertvector(odd, VecU64) << 32);
    std::memcpy(p, &pairs, sizeof(pairs));
  }
};

template <>
struct VecType<BFloat16> {
  static constexpr bool kSupported = true;
  static VecF Load(const BFloat16* p) {
    return (VecF)(__builtin_convertvector(LoadVec<VecU16>(p), VecU) << 16);
  }
  static void LoadPairs(const BFloat16* p, VecF* even, VecF* odd) {
    const VecU pairs = LoadVec<VecU>(p);  // element 2i in the low 16 bits of lane i
    *even = (VecF)(pairs << 16);
    *odd = (VecF)(pairs & 0xffff0000u);
  }
  // FloatToBFloat16, lane by lane: NaN -> sign | 0x7fc0, else round to nearest even.
  static VecU Round(VecF f) {
    const VecU u = (VecU)f;
    const VecU nan = (VecU)((u & 0x7fffffffu) > 0x7f800000u);
    const VecU quiet = ((u >> 16) & 0x8000u) | 0x7fc0u;
    const VecU rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (nan & quiet) | (~nan & rounded);
  }
  static VecU Exact(VecF f) { return (VecU)f >> 16; }
  static VecF Widen(VecU bits) { return (VecF)(bits << 16); }
  static void Store(BFloat16* p, VecU bits) { StoreVec(p, __builtin_convertvector(bits, VecU16)); }
  static void StorePairs(BFloat16* p, VecU even, VecU odd) { StoreVec(p, even | (odd << 16)); }
};
