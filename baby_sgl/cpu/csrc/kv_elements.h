// The KV pool's 1-byte elements (--kv-cache-dtype, core/kv_cache_dtype.py): fp8 e4m3 (torch's
// float8_e4m3fn: no infinities, 448 the largest), fp8 e5m2 and int8, each with a float32 scale per
// slot and KV head (value = element * scale). Attention widens them a vector at a time in
// registers (load_scaled); the decode step rounds a head's new values to them (quantize_head) as
// kv_cache_dtype.quantize does.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace bsgl {

// fp8 with M mantissa bits and exponent bias B; the stored byte as is.
template <int M, int B>
struct Fp8 {
  uint8_t bits;
  static constexpr int kMantissa = M, kBias = B;
};
using Fp8E4M3 = Fp8<3, 7>;
using Fp8E5M2 = Fp8<2, 15>;

template <typename T>
constexpr bool kScaledKV = std::is_same_v<T, int8_t> || std::is_same_v<T, Fp8E4M3> || std::is_same_v<T, Fp8E5M2>;

// kLanes fp8 bytes, widened to 32 bits, as floats. Normal numbers move their exponent and
// mantissa into float32's places and rebias; subnormals (exponent 0) are the mantissa times the
// smallest step, through an exact int-to-float conversion (not a float32 subnormal, which the
// kernels' denormals-as-zero mode would read as 0). NaN is never stored (writes saturate).
template <int M, int B>
inline fv fp8_to_float(iv b) {
  const iv mag = b & 0x7f, sign = (b & 0x80) << 24;
  const iv normal_bits = (mag << (23 - M)) + ((127 - B) << 23);
  fv normal;
  std::memcpy(&normal, &normal_bits, sizeof(normal));
  const fv subnormal = to_float(mag & ((1 << M) - 1)) * std::ldexp(1.f, 1 - B - M);
  const fv value = (mag >> M) == 0 ? subnormal : normal;
  iv bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits |= sign;
  fv out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// kLanes fp8 bytes as floats through the CPU's half-precision conversion (F16C): each byte's
// exponent and mantissa go to the top of a half's (e5m2 is the top byte of a half), whose value is
// the fp8 one times 2^(B - 15), subnormals included (the conversion reads half subnormals exactly).
// A third of the instructions of fp8_to_float: an fp8 pool's decode step was slower than bfloat16's.
#if defined(__F16C__) && (defined(__AVX512F__) || defined(__AVX2__))
template <int M, int B>
inline fv fp8_to_float_f16c(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 10 - M));
  const __m512 f = _mm512_cvtph_ps(half);
#else
  const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                                    _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7f)), 10 - M));
  const __m256 f = _mm256_cvtph_ps(half);
#endif
  fv out;
  std::memcpy(&out, &f, sizeof(out));
  if constexpr (B != 15) out *= std::ldexp(1.f, 15 - B);
  return out;
}
#endif

// kLanes stored elements from p as floats, before their scale.
template <typename T>
inline fv load_scaled(const T* p) {
  if constexpr (std::is_same_v<T, int8_t>) {
    return to_float(widen(p));
  } else {
#if defined(__F16C__) && (defined(__AVX512F__) || defined(__AVX2__))
    return fp8_to_float_f16c<T::kMantissa, T::kBias>(reinterpret_cast<const uint8_t*>(p));
#else
    return fp8_to_float<T::kMantissa, T::kBias>(widen(reinterpret_cast<const uint8_t*>(p)));
#endif
  }
}

// One element, for the scalar paths.
template <typename T>
inline float scaled_to_float(T x) {
  if constexpr (std::is_same_v<T, int8_t>) {
    return static_cast<float>(x);
  } else {
    int8_t lane[kLanes] = {};
    std::memcpy(lane, &x, 1);
    return load_scaled(reinterpret_cast<const T*>(lane))[0];
  }
}

// The fp8 byte nearest to x (ties to even, as torch's conversion), |x| at most the largest finite.
template <int M, int B>
inline uint8_t float_to_fp8(float x) {
  constexpr int kLargest = (B == 7 && M == 3) ? 0x7e : 0x7b;  // e4m3fn: 448; e5m2: 57344
  uint32_t f;
  std::memcpy(&f, &x, sizeof(f));
  const uint8_t sign = static_cast<uint8_t>((f >> 24) & 0x80);
  const float a = std::fabs(x);
  int code;
  if (a < std::ldexp(1.f, 1 - B)) {  // subnormal (or 0): a count of the smallest step
    code = static_cast<int>(std::nearbyint(a * std::ldexp(1.f, B + M - 1)));  // 2^M is the first normal: the same code
  } else {
    uint32_t u = f & 0x7fffffff;
    u += (1u << (22 - M)) - 1 + ((u >> (23 - M)) & 1);  // round the dropped mantissa bits to nearest even
    code = static_cast<int>(u >> (23 - M)) - ((127 - B) << M);
  }
  return sign | static_cast<uint8_t>(code < kLargest ? code : kLargest);
}

// A head's D values written as T with their scale: the largest magnitude maps to T's largest.
template <typename T>
inline void quantize_head(const float* x, int64_t D, T* dst, float* scale) {
  constexpr float kLargest = std::is_same_v<T, int8_t> ? 127.f : std::is_same_v<T, Fp8E4M3> ? 448.f : 57344.f;
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = amax > 0.f ? amax / kLargest : 1.f;
  *scale = s;
  for (int64_t i = 0; i < D; ++i) {
    const float y = std::min(std::max(x[i] / s, -kLargest), kLargest);
    if constexpr (std::is_same_v<T, int8_t>) {
      dst[i] = static_cast<int8_t>(std::nearbyint(y));
    } else {
      dst[i].bits = float_to_fp8<T::kMantissa, T::kBias>(y);
    }
  }
}

}  // namespace bsgl
