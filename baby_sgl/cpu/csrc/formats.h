// The row formats of stored weights, and each one's 32-value blocks widened to float32 vectors.
//
// A weight is N rows of K values: plain float32 or bfloat16, or one of GGUF's block formats,
// which stay quantized in memory (ggml-common.h defines them; "half" is IEEE fp16):
//   Q8_0:   half d, 32 x int8 q                        value = d * q
//   Q4_0:   half d, 16 bytes of nibbles                value = d * (q - 8)
//   Q4_1:   half d, half m, 16 bytes of nibbles        value = d * q + m
//   Q5_0:   half d, 32 high bits, 16 bytes of nibbles  value = d * (q - 16)
//   Q5_1:   half d, half m, 32 high bits, 16 bytes     value = d * q + m
//   IQ4_NL: half d, 16 bytes of nibbles                value = d * kIQ4Values[q]
// (in these 32-value blocks byte j holds value j in its low half and value j + 16 in its high
// half; high bit j of a 5-bit q is bit j of the little-endian uint32). The K-quants group 8
// such sub-blocks of 32 (16 of 16 for Q6_K) into a 256-value super-block under one fp16 scale:
//   Q4_K: half d, half dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
//         value = (d * sc_j) * q - dmin * m_j; sub-block j's nibbles are bytes 32 (j / 2)..,
//         low halves for even j, high halves for odd j
//   Q5_K: Q4_K's fields, then 32 bytes of high bits (bit j of byte l: sub-block j's value l)
//   Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, half d
//         value = (d * sc_i) * (q - 32), sc_i for each 16 values
//   IQ4_XS: half d, 16 bits of high scale bits, 4 bytes of low scale nibbles, 128 bytes of
//         nibbles; value = (d * (ls_j - 32)) * kIQ4Values[q], sub-block j's nibbles as IQ4_NL's
// Every product above is exact in float32 but the last (Q6_K, IQ4_XS), which is rounded once
// as the reference dequantizers round it: the decoded values are theirs, bit for bit.
#pragma once

#include <utility>

#include "vec.h"

namespace bsgl {

enum WeightType : int {
  kF32 = 0, kBF16 = 1, kQ8_0 = 2, kQ4_0 = 3, kQ4_1 = 4, kQ5_0 = 5, kQ5_1 = 6, kQ4_K = 7, kQ5_K = 8, kQ6_K = 9,
  kIQ4_NL = 10, kIQ4_XS = 11,
};
constexpr int kLastWeightType = kIQ4_XS;
// Added to a format's code where its rows are stored in groups of sixteen (int8_groups.h).
constexpr int kGroupedCode = 256;

// Values per block: rows hold whole blocks.
constexpr int64_t block_values(int type) {
  return type <= kBF16 ? 1 : type >= kQ4_K && type != kIQ4_NL ? 256 : 32;
}

constexpr int64_t block_bytes(int type) {
  switch (type) {
    case kF32: return 4;
    case kBF16: return 2;
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    case kIQ4_NL: return 18;
    case kIQ4_XS: return 136;
  }
  return -1;
}

constexpr int64_t row_bytes(int type, int64_t k) { return k / block_values(type) * block_bytes(type); }

// Calls f(std::integral_constant<int, T>{}) for the weight format T: one switch for every kernel.
template <typename F>
inline void with_format(int type, F&& f) {
  switch (type) {
    case kF32: return f(std::integral_constant<int, kF32>{});
    case kBF16: return f(std::integral_constant<int, kBF16>{});
    case kQ8_0: return f(std::integral_constant<int, kQ8_0>{});
    case kQ4_0: return f(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int, kQ5_1>{});
    case kQ4_K: return f(std::integral_constant<int, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int, kQ6_K>{});
    case kIQ4_NL: return f(std::integral_constant<int, kIQ4_NL>{});
    case kIQ4_XS: return f(std::integral_constant<int, kIQ4_XS>{});
  }
}

inline uint16_t read_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

constexpr int kBlockVecs = 32 / kLanes;  // vectors per 32-value block

// Values kLanes * i.. of a block's 16 bytes of nibbles (byte j holds value j in its low half and
// value j + 16 in its high half), as integers.
inline iv nibble_ints(const uint8_t* p, int i) {
  constexpr int per_half = 16 / kLanes;
  const iv v = widen(p + (i % per_half) * kLanes);
  return i < per_half ? (v & 0x0f) : (v >> 4);
}

inline fv nibbles(const uint8_t* p, int i) { return to_float(nibble_ints(p, i)); }

// Bit j of a lane for each of a block's 32 values j, kLanes to a vector.
alignas(64) inline constexpr uint32_t kValueBits[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,  1u << 8,  1u << 9,  1u << 10,
    1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15, 1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21,
    1u << 22, 1u << 23, 1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

// Values kLanes * i.. of a Q5 block: its nibbles with bit (value index) of qh on top.
inline iv five_bits(const uint8_t* p, uint32_t qh, int i) {
  iv bits;
  std::memcpy(&bits, kValueBits + kLanes * i, sizeof(bits));
  const iv h = (iv{} + static_cast<int32_t>(qh)) & bits;
  return nibble_ints(p, i) | ((h != 0) & 16);
}

// IQ4's 16 levels (kvalues_iq4nl in ggml-common.h), as bytes and as float32.
alignas(16) inline constexpr int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                      1,    13,   25,  38,  53,  69,  89,  113};
struct IQ4Floats {
  alignas(64) float v[16];
};
inline constexpr IQ4Floats kIQ4Values = [] {
  IQ4Floats f{};
  for (int i = 0; i < 16; ++i) f.v[i] = kIQ4Levels[i];
  return f;
}();

// Where a block's fields start, in bytes (ggml-common.h's layouts): its values (Q8_0's bytes, the
// nibbles, Q6_K's low nibbles; IQ4_XS: sub-block 0's), and the 5-bit and 6-bit formats' high bits.
constexpr int values_at(int type) {
  return type == kQ4_1 ? 4 : type == kQ5_0 ? 6 : type == kQ5_1 || type == kIQ4_XS ? 8 : type == kQ4_K ? 16
       : type == kQ5_K ? 48 : type == kQ6_K ? 0 : 2;  // 2: Q8_0, Q4_0, IQ4_NL, after d
}
constexpr int high_bits_at(int type) { return type == kQ5_0 ? 2 : type == kQ5_1 ? 4 : type == kQ5_K ? 16 : 128; }
constexpr int kQ6ScalesAt = 192, kQ6DAt = 208;  // Q6_K's int8 scales and its half d

// The bytes holding (the low bits of) sub-block j's values in the super-block at p, or a 32-value
// block's values (p the block, j unused). Q4_K / Q5_K: low halves for even j, high halves for odd
// j; Q6_K: the low nibbles of 32-value groups g = j % 4 of each 128 values, g's 0 and 1 in low
// halves, 2 and 3 in high halves.
template <int T>
inline const uint8_t* sub_block_values(const uint8_t* p, int j) {
  if constexpr (T == kIQ4_XS) return p + values_at(T) + 16 * j;
  else if constexpr (T == kQ4_K || T == kQ5_K) return p + values_at(T) + 32 * (j / 2);
  else if constexpr (T == kQ6_K) return p + values_at(T) + 64 * (j / 4) + 32 * (j % 2);
  else return p + values_at(T);
}

// kIQ4Values[q] for values kLanes * i.. of a block's 16 bytes of nibbles (nibble_ints's q).
inline fv iq4_values(const uint8_t* p, int i) {
  fv out;
#if defined(__AVX512F__)
  const iv q = nibble_ints(p, i);
  __m512i idx;
  std::memcpy(&idx, &q, 64);
  const __m512 r = _mm512_permutexvar_ps(idx, _mm512_load_ps(kIQ4Values.v));
  std::memcpy(&out, &r, 64);
#elif defined(__AVX2__)
  // One byte shuffle looks the eight levels up as int8s: a one-row IQ4 product took 1.4x as long
  // with two float permutes and a blend.
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + (i % 2) * 8));
  if (i >= 2) bytes = _mm_srli_epi16(bytes, 4);
  const __m128i q = _mm_and_si128(bytes, _mm_set1_epi8(0x0f));
  const __m128i levels = _mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Levels)), q);
  const __m256 r = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(levels));
  std::memcpy(&out, &r, 32);
#else
  const iv q = nibble_ints(p, i);
  for (int l = 0; l < kLanes; ++l) out[l] = kIQ4Values.v[q[l]];
#endif
  return out;
}

// Q4_K's / Q5_K's 6-bit scale and min of sub-block j (get_scale_min_k4 in ggml-quants.c).
inline void k4_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Sub-block j's scale d * sc and offset dmin * m of a Q4_K / Q5_K super-block at p.
inline void k4_sub_scales(const uint8_t* p, int j, float& scale, float& offset) {
  float d, dmin;
  half2_to_float(p, d, dmin);
  int sc, m;
  k4_scale_min(p + 4, j, sc, m);
  scale = d * static_cast<float>(sc);
  offset = dmin * static_cast<float>(m);
}

// The 6-bit scales (bytes 0..7) and mins (bytes 8..15) of a Q4_K / Q5_K super-block at p, unpacked
// four at a time as ggml's ggml_vec_dot_q4_K_q8_K does (u[0], u[1]: scales; u[2], u[3]: mins).
inline void k4_scale_min_bytes(const uint8_t* p, uint32_t u[4]) {
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  uint32_t s[3];
  std::memcpy(s, p + 4, 12);
  u[0] = s[0] & low6;
  u[1] = (s[2] & low4) | (((s[0] >> 6) & low2) << 4);
  u[2] = s[1] & low6;
  u[3] = ((s[2] >> 4) & low4) | (((s[1] >> 6) & low2) << 4);
}

#if defined(__AVX2__)
// The scales d * sc_j and offsets dmin * m_j of all 8 sub-blocks of a Q4_K / Q5_K super-block at
// p, as k4_sub_scales computes each, as vectors: k4_scale_min_bytes's four words in one vector
// from the block's first 16 bytes (d, dmin, the 12 bytes s[0..2]), no scalar step.
inline void k4_super_scales(const uint8_t* p, __m256& scale, __m256& offset) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_and_si128(  // s[0] & low6, s[2] & low4, s[1] & low6, (s[2] >> 4) & low4
      _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(3, 2, 3, 1)), _mm_setr_epi32(0, 0, 0, 4)),
      _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i high = _mm_and_si128(  // bits 6 and 7 of s[0]'s and s[1]'s bytes, moved to bits 4 and 5
      _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 0, 1, 0)), 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  const __m128i fields = _mm_or_si128(low, high);  // scales in bytes 0..7, mins in 8..15
#if defined(__F16C__)
  const __m128 d = _mm_cvtph_ps(v);  // d, dmin
#else
  float d0, d1;
  half2_to_float(p, d0, d1);
  const __m128 d = _mm_setr_ps(d0, d1, 0.f, 0.f);
#endif
  scale = _mm256_mul_ps(_mm256_broadcastss_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(fields)));
  offset = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(d)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(fields, fields))));
}
#endif

// The same into scale[8] and offset[8].
inline void k4_super_scales(const uint8_t* p, float* scale, float* offset) {
#if defined(__AVX2__)
  __m256 s, o;
  k4_super_scales(p, s, o);
  _mm256_storeu_ps(scale, s);
  _mm256_storeu_ps(offset, o);
#else
  uint32_t u[4];
  k4_scale_min_bytes(p, u);
  float d, dmin;
  half2_to_float(p, d, dmin);
  uint8_t b[16];
  std::memcpy(b, u, 16);
  for (int j = 0; j < 8; ++j) {
    scale[j] = d * static_cast<float>(b[j]);
    offset[j] = dmin * static_cast<float>(b[8 + j]);
  }
#endif
}

// IQ4_XS's scale d * (ls_j - 32) of sub-block j of the super-block at p.
inline float iq4_xs_scale(const uint8_t* p, int j) {
  const int ls = ((p[4 + j / 2] >> (4 * (j % 2))) & 0x0f) | (((read_u16(p + 2) >> (2 * j)) & 3) << 4);
  return half_to_float(read_u16(p)) * static_cast<float>(ls - 32);
}

// Calls f(std::integral_constant<int, J>{}) for J = 0..N-1, unrolled.
template <typename F, int... J>
inline void unroll_seq(F&& f, std::integer_sequence<int, J...>) {
  (f(std::integral_constant<int, J>{}), ...);
}
template <int N, typename F>
inline void unroll(F&& f) {
  unroll_seq(f, std::make_integer_sequence<int, N>{});
}

// A super-block's scales, each as the reference dequantizer rounds it: Q4_K / Q5_K: d * sc_j and
// dmin * m_j of its 8 sub-blocks; Q6_K: d * sc_i of its 16 groups of 16.
template <int T>
struct SuperScales {
  alignas(64) float scale[16];
  alignas(32) float offset[8];
  explicit SuperScales(const uint8_t* p) {
    if constexpr (T == kQ4_K || T == kQ5_K) {
      k4_super_scales(p, scale, offset);
    } else if constexpr (T == kQ6_K) {
      const float d = half_to_float(read_u16(p + kQ6DAt));
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + kQ6ScalesAt);
      for (int i = 0; i < 16; ++i) scale[i] = d * static_cast<float>(sc[i]);
    }  // IQ4_XS: none; its one scale per sub-block is as quick to take where it is used
  }
};

// Sub-block j (32 values) of the super-block at p as kBlockVecs vectors, values in order. Inlined
// where j is a constant, the shifts and offsets that depend on it are too.
template <int T>
inline void decode_sub(const uint8_t* p, const SuperScales<T>& s, int j, fv* w) {
  if constexpr (T == kQ4_K || T == kQ5_K) {
    const uint8_t* q = sub_block_values<T>(p, j);
    for (int i = 0; i < kBlockVecs; ++i) {
      const iv bytes = widen(q + kLanes * i);  // zero-extended: the high half needs no mask
      iv v = j % 2 ? bytes >> 4 : bytes & 0x0f;
      if constexpr (T == kQ5_K) v |= ((widen(p + high_bits_at(T) + kLanes * i) >> j) & 1) << 4;
      w[i] = to_float(v) * splat(s.scale[j]) - splat(s.offset[j]);
    }
  } else if constexpr (T == kQ6_K) {
    const int g = j % 4;
    const uint8_t* ql = sub_block_values<T>(p, j);
    const uint8_t* qh = p + high_bits_at(T) + 32 * (j / 4);
    for (int i = 0; i < kBlockVecs; ++i) {
      const iv lo = g / 2 ? widen(ql + kLanes * i) >> 4 : widen(ql + kLanes * i) & 0x0f;
      const iv h = widen(qh + kLanes * i);  // bits 2g, 2g + 1 -> 4, 5
      const iv hi = (g < 2 ? h << (4 - 2 * g) : g == 2 ? h : h >> 2) & 0x30;
      w[i] = to_float((lo | hi) - 32) * splat(s.scale[2 * j + kLanes * i / 16]);
    }
  } else {
    static_assert(T == kIQ4_XS);
    const fv d = splat(iq4_xs_scale(p, j));
    for (int i = 0; i < kBlockVecs; ++i) w[i] = iq4_values(sub_block_values<T>(p, j), i) * d;
  }
}

// Block b of a row as kBlockVecs vectors, values in order.
template <int T>
inline void decode_block(const uint8_t* row, int64_t b, fv* w) {
  if constexpr (T == kF32) {
    const float* p = reinterpret_cast<const float*>(row) + 32 * b;
    for (int i = 0; i < kBlockVecs; ++i) w[i] = loadv(p + kLanes * i);
  } else if constexpr (T == kBF16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + 32 * b;
    for (int i = 0; i < kBlockVecs; ++i) w[i] = load_bf16(p + kLanes * i);
  } else if constexpr (T == kQ8_0) {
    const uint8_t* p = row + 34 * b;
    const fv d = splat(half_to_float(read_u16(p)));
    for (int i = 0; i < kBlockVecs; ++i) w[i] = to_float(widen(reinterpret_cast<const int8_t*>(p + values_at(T)) + kLanes * i)) * d;
  } else if constexpr (T == kQ4_0 || T == kIQ4_NL) {
    const uint8_t* p = row + 18 * b;
    const fv d = splat(half_to_float(read_u16(p)));
    for (int i = 0; i < kBlockVecs; ++i)
      w[i] = (T == kQ4_0 ? nibbles(p + values_at(T), i) - 8.f : iq4_values(p + values_at(T), i)) * d;
  } else if constexpr (T == kQ4_1) {
    const uint8_t* p = row + 20 * b;
    float d, m;
    half2_to_float(p, d, m);
    for (int i = 0; i < kBlockVecs; ++i) w[i] = nibbles(p + values_at(T), i) * splat(d) + splat(m);
  } else if constexpr (T == kQ5_0) {
    const uint8_t* p = row + 22 * b;
    const fv d = splat(half_to_float(read_u16(p)));
    uint32_t qh;
    std::memcpy(&qh, p + high_bits_at(T), 4);
    for (int i = 0; i < kBlockVecs; ++i) w[i] = to_float(five_bits(p + values_at(T), qh, i) - 16) * d;
  } else if constexpr (T == kQ5_1) {
    const uint8_t* p = row + 24 * b;
    float d, m;
    half2_to_float(p, d, m);
    uint32_t qh;
    std::memcpy(&qh, p + high_bits_at(T), 4);
    for (int i = 0; i < kBlockVecs; ++i) w[i] = to_float(five_bits(p + values_at(T), qh, i)) * splat(d) + splat(m);
  } else {
    static_assert(block_values(T) == 256);
    const uint8_t* p = row + block_bytes(T) * (b / 8);
    decode_sub<T>(p, SuperScales<T>(p), static_cast<int>(b % 8), w);
  }
}

// Calls f(b, w) for blocks 0..blocks-1 of a row in order, w the block's values as decode_block<T>
// gives them. A super-block's scales are unpacked once for its eight blocks, and with vectors of 8
// or 16 lanes each block's place in it is a constant (the eight unrolled; with 4 lanes that spilled
// to the stack). The K-quants' products of one to three rows ran 1.4-2.0x as fast as when each
// block unpacked its own scales and place (AVX2, one thread). decode_block itself unpacks a whole
// super-block's scales for its one block: for those formats only decode_one calls it, for values
// past a row's last whole block, which their rows (whole super-blocks) do not have.
template <int T, typename F>
inline void for_each_block(const uint8_t* row, int64_t blocks, F&& f) {
  if constexpr (block_values(T) == 256) {
    for (int64_t sb = 0; sb < blocks / 8; ++sb) {
      const uint8_t* p = row + block_bytes(T) * sb;
      const SuperScales<T> s(p);
      auto sub = [&](int j) {
        fv w[kBlockVecs];
        decode_sub<T>(p, s, j, w);
        f(8 * sb + j, w);
      };
      if constexpr (kLanes >= 8) unroll<8>(sub);
      else
        for (int j = 0; j < 8; ++j) sub(j);
    }
  } else {
    for (int64_t b = 0; b < blocks; ++b) {
      fv w[kBlockVecs];
      decode_block<T>(row, b, w);
      f(b, w);
    }
  }
}

}  // namespace bsgl
