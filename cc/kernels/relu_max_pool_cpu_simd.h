// Per-ISA vector primitives for the CPU kernels' 2x2 loops (relu_max_pool_cpu_2x2.h), for the
// instruction set this compilation targets (relu_max_pool_cpu_isa.h): 16-byte vectors for SSE2,
// 32 for AVX2, 64 for AVX-512. Empty without TFRP_CPU_SIMD (no vector extensions).
//
// The vectors are GCC/Clang vector extensions of one register's width: every operation on them is
// the same IEEE operation as the scalar code's, lane by lane (compare, select, add, multiply by
// 0/1), so vector and scalar results are bitwise identical. Intrinsics only where the vector
// extensions fall short: conversions between bytes or 16-bit values and 32-bit lanes (GCC lowers
// __builtin_convertvector between those widths to element-by-element code or split halves) and
// streaming stores.

#ifndef TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_SIMD_H_
#define TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_SIMD_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "numeric.h"
#include "relu_max_pool_cpu_isa.h"

// Everything here and the per-element helpers of the 2x2 loops are forced inline: GCC otherwise
// leaves some of them out of line inside the big loop bodies, passing vectors through memory.
#define TFRP_VEC_INLINE inline __attribute__((always_inline))

#if TFRP_CPU_SIMD
#include <immintrin.h>

// The 64- and 128-byte vectors of the SIMD code are passed only between inlined functions of
// internal linkage: GCC's note that their calling convention differs between targets is moot.
#pragma GCC diagnostic ignored "-Wpsabi"

TFRP_CPU_TARGET_BEGIN
namespace {

constexpr int kVecBytes = TFRP_CPU_VEC_BYTES;
constexpr int kVecLanes = kVecBytes / 4;  // 32-bit lanes per vector: 4, 8 or 16
typedef float VecF __attribute__((vector_size(kVecBytes)));
typedef int32_t VecI __attribute__((vector_size(kVecBytes)));  // comparison masks: 0 / -1
typedef uint32_t VecU __attribute__((vector_size(kVecBytes)));
typedef uint16_t VecU16 __attribute__((vector_size(kVecBytes / 2)));  // kVecLanes 16-bit values
typedef uint64_t VecU64 __attribute__((vector_size(kVecBytes * 2)));  // kVecLanes 64-bit values

template <typename V>
TFRP_VEC_INLINE V LoadVec(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}
template <typename V>
TFRP_VEC_INLINE void StoreVec(void* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}
TFRP_VEC_INLINE VecF SplatF(float f) { return VecF{} + f; }
TFRP_VEC_INLINE VecU SplatU(uint32_t u) { return VecU{} + u; }

// Writes the sizeof(V) bytes of v to p; with kStream, as non-temporal (streaming) stores where p
// is aligned to the chunk width: they skip reading the destination's cache lines before writing
// them (a third of a copy's memory traffic) and do not evict the inputs from the caches. Worth it
// only for outputs far larger than the caches; the caller decides, and ends with StreamFence().
//
// Chunks of at most 32 bytes (the write-combining buffers still turn a line's two into one
// whole-line write), so that more row layouts have every store aligned (StreamDz). Measured:
// 16-byte chunks made the bfloat16 NCHW backward slower, 64-byte ones left float32 NCHW rows of
// 56 values unstreamed.
constexpr size_t kStreamChunk = kVecBytes < 32 ? kVecBytes : 32;
//
// `skip`: bytes at the start that an earlier store already wrote with the same bits (the
// overlapping last vector of a row, ForEachVector): streaming stores leave them out, since a
// second streaming store to a line already on its way to memory is a partial-line write. A
// multiple of the chunk width (StreamDz checks that every vector starts at one).
template <bool kStream, typename V>
TFRP_VEC_INLINE void PutVec(void* p, const V& v, size_t skip = 0) {
  constexpr size_t kChunk = sizeof(V) < kStreamChunk ? sizeof(V) : kStreamChunk;
  if (!kStream || kChunk < 16 || reinterpret_cast<uintptr_t>(p) % kChunk != 0) {
    std::memcpy(p, &v, sizeof(V));
    return;
  }
  for (size_t at = skip; at < sizeof(V); at += kChunk) {
    char* q = static_cast<char*>(p) + at;
    const char* src = reinterpret_cast<const char*>(&v) + at;
    if constexpr (kChunk == 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(q),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#if defined(TFRP_CPU_ISA_AVX2) || defined(TFRP_CPU_ISA_AVX512)
    } else if constexpr (kChunk == 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(q),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
#endif
    } else {
      std::memcpy(q, src, kChunk);
    }
  }
}
// Orders this thread's streaming stores before its later stores (the runner's completion
// signal): streaming stores are weakly ordered.
TFRP_VEC_INLINE void StreamFence() { _mm_sfence(); }

// kVecLanes bytes <-> 32-bit lanes (values 0..255).
TFRP_VEC_INLINE VecU WidenBytes(const uint8_t* p) {
#ifdef TFRP_CPU_ISA_AVX512
  // The maskz forms: GCC 12's plain ones start from an "undefined" vector and warn about it.
  return (VecU)_mm512_maskz_cvtepu8_epi32(0xffff, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(TFRP_CPU_ISA_AVX2)
  return (VecU)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  int32_t word;
  std::memcpy(&word, p, 4);
  const __m128i zero = _mm_setzero_si128();
  return (VecU)_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(word), zero), zero);
#endif
}
template <bool kStream>
TFRP_VEC_INLINE void NarrowToBytes(VecU v, uint8_t* p) {
#ifdef TFRP_CPU_ISA_AVX512
  PutVec<kStream>(p, _mm512_maskz_cvtepi32_epi8(0xffff, (__m512i)v));
#elif defined(TFRP_CPU_ISA_AVX2)
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

// kVecLanes 16-bit values <-> 32-bit lanes (zero-extended; narrowing keeps the low 16 bits of
// lanes that hold values below 2^16). GCC splits these conversions into halves otherwise.
TFRP_VEC_INLINE VecU Widen16(const void* p) {
#ifdef TFRP_CPU_ISA_AVX512
  return (VecU)_mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(TFRP_CPU_ISA_AVX2)
  return (VecU)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return (VecU)_mm_unpacklo_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), _mm_setzero_si128());
#endif
}
template <bool kStream>
TFRP_VEC_INLINE void Narrow16(VecU v, void* p, size_t skip = 0) {
#ifdef TFRP_CPU_ISA_AVX512
  PutVec<kStream>(p, _mm512_maskz_cvtepi32_epi16(0xffff, (__m512i)v), skip);
#elif defined(TFRP_CPU_ISA_AVX2)
  const __m256i w = _mm256_packus_epi32((__m256i)v, (__m256i)v);  // per 128-bit half
  PutVec<kStream>(p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(w, 0x08)), skip);
#else
  // SSE2 has only the signed pack: sign-extend the 16-bit values first, so none saturates.
  const __m128i x = _mm_srai_epi32(_mm_slli_epi32((__m128i)v, 16), 16);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(x, x));
#endif
}

// Rows narrower than a vector (an NCHW row of a small image) take one partial vector where the
// instruction set has masked loads and stores (AVX-512): the first n <= kVecLanes lanes are read
// and written, the others read as 0 (a masked load never faults on them) and are not stored.
#ifdef TFRP_CPU_ISA_AVX512
constexpr bool kPartialVectors = true;
TFRP_VEC_INLINE __mmask16 FirstLanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
template <typename = void>  // a template, like the declaration-only version below
TFRP_VEC_INLINE VecU WidenBytesPartial(const uint8_t* p, int64_t n) {
  return (VecU)_mm512_maskz_cvtepu8_epi32(0xffff, _mm_maskz_loadu_epi8(FirstLanes(n), p));
}
template <typename = void>
TFRP_VEC_INLINE void NarrowToBytesPartial(VecU v, uint8_t* p, int64_t n) {
  _mm512_mask_cvtepi32_storeu_epi8(p, FirstLanes(n), (__m512i)v);
}
#else
constexpr bool kPartialVectors = false;
// Declared only, for the discarded `if constexpr (kPartialVectors)` branches: never instantiated.
template <typename = void>
VecU WidenBytesPartial(const uint8_t* p, int64_t n);
template <typename = void>
void NarrowToBytesPartial(VecU v, uint8_t* p, int64_t n);
#endif

// Value types with a vector path: float and bfloat16, both computed in float lanes.
//   Load(p):        kVecLanes consecutive values as floats (exact).
//   LoadPairs(p):   2 * kVecLanes consecutive values, split into even and odd elements.
//   Round(f):       the bits of ValueTraits<T>::FromAcc(f), in 32-bit lanes.
//   RoundExactOrNaN(f): the same, for f that T represents exactly or NaN (cheaper).
//   Exact(f):       the same for f that T represents exactly (no rounding needed).
//   Widen(bits):    ValueTraits<T>::ToAcc of T bits held in 32-bit lanes.
//   Store / StorePairs: write T bits (32-bit lanes); StorePairs interleaves even and odd; `skip`
//                   as in PutVec.
//   LoadPartial, StorePartial (kPartialVectors only): the same for the first n <= kVecLanes
//                   lanes; LoadPairsPartial, StorePairsPartial: for n < kVecLanes.
template <typename T>
struct VecType {
  static constexpr bool kSupported = false;
};

template <>
struct VecType<float> {
  static constexpr bool kSupported = true;
  static TFRP_VEC_INLINE VecF Load(const float* p) { return LoadVec<VecF>(p); }
  static TFRP_VEC_INLINE void LoadPairs(const float* p, VecF* even, VecF* odd) {
    VecU64 pairs;  // element 2i in the low half of 64-bit lane i
    std::memcpy(&pairs, p, sizeof(pairs));
    *even = (VecF)__builtin_convertvector(pairs, VecU);
    *odd = (VecF)__builtin_convertvector(pairs >> 32, VecU);
  }
  static TFRP_VEC_INLINE VecU Round(VecF f) { return (VecU)f; }
  static TFRP_VEC_INLINE VecU RoundExactOrNaN(VecF f) { return (VecU)f; }
  static TFRP_VEC_INLINE VecU Exact(VecF f) { return (VecU)f; }
  static TFRP_VEC_INLINE VecF Widen(VecU bits) { return (VecF)bits; }
  template <bool kStream>
  static TFRP_VEC_INLINE void Store(float* p, VecU bits, size_t skip = 0) {
    PutVec<kStream>(p, bits, skip);
  }
  template <bool kStream>
  static TFRP_VEC_INLINE void StorePairs(float* p, VecU even, VecU odd, size_t skip = 0) {
    const VecU64 pairs =
        __builtin_convertvector(even, VecU64) | (__builtin_convertvector(odd, VecU64) << 32);
    PutVec<kStream>(p, pairs, skip);
  }
#ifdef TFRP_CPU_ISA_AVX512
  static TFRP_VEC_INLINE VecF LoadPartial(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(FirstLanes(n), p);
  }
  // 2n values from two masked loads; even and odd elements picked across both registers.
  static TFRP_VEC_INLINE void LoadPairsPartial(const float* p, int64_t n, VecF* even, VecF* odd) {
    const __mmask16 lo = n >= 8 ? 0xffff : FirstLanes(2 * n);
    const __mmask16 hi = n >= 8 ? FirstLanes(2 * n - 16) : 0;
    const __m512 a = _mm512_maskz_loadu_ps(lo, p), b = _mm512_maskz_loadu_ps(hi, p + 16);
    const VecU lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    *even = _mm512_permutex2var_ps(a, (__m512i)(2 * lane), b);
    *odd = _mm512_permutex2var_ps(a, (__m512i)(2 * lane + 1), b);
  }
  static TFRP_VEC_INLINE void StorePartial(float* p, VecU bits, int64_t n) {
    _mm512_mask_storeu_epi32(p, FirstLanes(n), (__m512i)bits);
  }
  // Interleaves even and odd (lane i of the first register: even[i / 2] or odd[i / 2]) and
  // stores the first 2n values.
  static TFRP_VEC_INLINE void StorePairsPartial(float* p, VecU even, VecU odd, int64_t n) {
    const VecU half = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const __m512i a = _mm512_permutex2var_epi32((__m512i)even, (__m512i)half, (__m512i)odd);
    const __m512i b = _mm512_permutex2var_epi32((__m512i)even, (__m512i)(half + 8), (__m512i)odd);
    _mm512_mask_storeu_epi32(p, n >= 8 ? 0xffff : FirstLanes(2 * n), a);
    if (n > 8) _mm512_mask_storeu_epi32(p + 16, FirstLanes(2 * n - 16), b);
  }
#endif
};

template <>
struct VecType<BFloat16> {
  static constexpr bool kSupported = true;
  static TFRP_VEC_INLINE VecF Load(const BFloat16* p) { return (VecF)(Widen16(p) << 16); }
  static TFRP_VEC_INLINE void LoadPairs(const BFloat16* p, VecF* even, VecF* odd) {
    const VecU pairs = LoadVec<VecU>(p);  // element 2i in the low 16 bits of lane i
    *even = (VecF)(pairs << 16);
    *odd = (VecF)(pairs & 0xffff0000u);
  }
  // FloatToBFloat16, lane by lane: NaN -> sign | 0x7fc0, else round to nearest even.
  static TFRP_VEC_INLINE VecU Round(VecF f) {
    const VecU u = (VecU)f;
    const VecU nan = (VecU)((u & 0x7fffffffu) > 0x7f800000u);
    const VecU quiet = ((u >> 16) & 0x8000u) | 0x7fc0u;
    const VecU rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (nan & quiet) | (~nan & rounded);
  }
  static TFRP_VEC_INLINE VecU Exact(VecF f) { return (VecU)f >> 16; }
  // Round(f) for f that is a bfloat16 value or a NaN (sums and products of bfloat16 values with
  // +0 and 0): the low 16 bits are zero, so rounding is a shift; NaN as in Round.
  static TFRP_VEC_INLINE VecU RoundExactOrNaN(VecF f) {
    const VecU u = (VecU)f;
    const VecU nan = (VecU)((u & 0x7fffffffu) > 0x7f800000u);
    return (nan & (((u >> 16) & 0x8000u) | 0x7fc0u)) | (~nan & (u >> 16));
  }
  static TFRP_VEC_INLINE VecF Widen(VecU bits) { return (VecF)(bits << 16); }
  template <bool kStream>
  static TFRP_VEC_INLINE void Store(BFloat16* p, VecU bits, size_t skip = 0) {
    Narrow16<kStream>(bits, p, skip);
  }
  template <bool kStream>
  static TFRP_VEC_INLINE void StorePairs(BFloat16* p, VecU even, VecU odd, size_t skip = 0) {
    PutVec<kStream>(p, even | (odd << 16), skip);
  }
#ifdef TFRP_CPU_ISA_AVX512
  static TFRP_VEC_INLINE VecF LoadPartial(const BFloat16* p, int64_t n) {
    const __m256i bits = _mm256_maskz_loadu_epi16(FirstLanes(n), p);
    return (VecF)((VecU)_mm512_maskz_cvtepu16_epi32(0xffff, bits) << 16);
  }
  static TFRP_VEC_INLINE void LoadPairsPartial(const BFloat16* p, int64_t n, VecF* even,
                                               VecF* odd) {
    // Lane i: elements 2i and 2i + 1.
    const VecU pairs = (VecU)_mm512_maskz_loadu_epi32(FirstLanes(n), p);
    *even = (VecF)(pairs << 16);
    *odd = (VecF)(pairs & 0xffff0000u);
  }
  static TFRP_VEC_INLINE void StorePartial(BFloat16* p, VecU bits, int64_t n) {
    const __m256i narrow = _mm512_maskz_cvtepi32_epi16(0xffff, (__m512i)bits);
    _mm256_mask_storeu_epi16(p, FirstLanes(n), narrow);
  }
  static TFRP_VEC_INLINE void StorePairsPartial(BFloat16* p, VecU even, VecU odd, int64_t n) {
    _mm512_mask_storeu_epi32(p, FirstLanes(n), (__m512i)(even | (odd << 16)));
  }
#endif
};

}  // namespace
TFRP_CPU_TARGET_END
#endif  // TFRP_CPU_SIMD

#endif  // TF_RELUPOOL_CC_KERNELS_RELU_MAX_POOL_CPU_SIMD_H_
