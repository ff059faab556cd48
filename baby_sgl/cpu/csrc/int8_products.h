// Products of quantized weights with activations rounded to int8, for a few rows (a decode step),
// as llama.cpp computes them: each activation row is quantized once per product to Q8 blocks of
// 32 (int8 q, a float32 scale d, value = d * q, and d * sum(q)), and each weight block meets
// each activation block in one integer dot product, scaled once per block:
//   Q8_0: dw * da * sum(w q)
//   Q4_0: dw * da * sum(n q) - 8 dw (da sum(q))     (n: the unsigned nibbles)
//   Q4_1: dw * da * sum(n q) + mw (da sum(q))
// and likewise Q5_0 / Q5_1 (5-bit n, -16 dw), IQ4_NL / IQ4_XS (their levels as signed bytes), and
// Q4_K / Q5_K per 32-value sub-block (its d * sc_j on the dot, -dmin * m_j on da sum(q)).
// The integer products run as unsigned x signed bytes: AVX-512 VNNI's vpdpbusd, AVX-VNNI's, or
// AVX2's vpmaddubsw + vpmaddwd (Q8_0's signed weights through the sign trick: |w| x sign(w) q),
// and a scalar loop elsewhere. Instead of widening every weight to float32 and an FMA per value,
// a block takes a handful of instructions. Rounding the activations changes the results (about
// 0.4% of an activation block's largest value per value), so this is a mode of the decode step
// (--cpu-int8-activations), not its float32 path. Each output is one row's sum over the blocks
// in a fixed order, whatever the number of rows computed with it.
#pragma once

#include "weights.h"

namespace bsgl {

// Activation rows as Q8 blocks: q [rows, k], d and s = d * sum(q) [rows, k / 32].
struct Q8Rows {
  int64_t rows = 0, k = 0;
  AlignedBuffer<int8_t> q;
  AlignedBuffer<float> d, s;
  AlignedBuffer<int32_t> sum_q;  // sum(q) itself, for the exact offsets of int8_gemm.h
  const int8_t* block(int64_t m, int64_t b) const { return q.data() + m * k + 32 * b; }
  float scale(int64_t m, int64_t b) const { return d.data()[m * (k / 32) + b]; }
  float scaled_sum(int64_t m, int64_t b) const { return s.data()[m * (k / 32) + b]; }
  int32_t sum(int64_t m, int64_t b) const { return sum_q.data()[m * (k / 32) + b]; }
};

// round(v[i] * inv) to int8, half to even; returns their sum. The product is rounded to float32
// before the conversion, as the reference computes it (no fused multiply-add can join them).
inline int32_t round_block(const float* v, float inv, int8_t* q) {
  int32_t r[32];
#if defined(__AVX512F__)
  for (int i = 0; i < 32; i += 16)
    _mm512_storeu_si512(r + i, _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + i), _mm512_set1_ps(inv))));
#elif defined(__AVX2__)
  for (int i = 0; i < 32; i += 8)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + i),
                        _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(inv))));
#else
  for (int i = 0; i < 32; ++i) r[i] = static_cast<int32_t>(std::nearbyint(v[i] * inv));
#endif
  int32_t sum = 0;
  for (int i = 0; i < 32; ++i) {
    q[i] = static_cast<int8_t>(r[i]);
    sum += r[i];
  }
  return sum;
}

// Sizes out for rows x k values.
inline void reserve_q8(int64_t rows, int64_t k, Q8Rows& out) {
  out.rows = rows;
  out.k = k;
  out.q.reserve(rows * k);
  out.d.reserve(rows * (k / 32));
  out.s.reserve(rows * (k / 32));
  out.sum_q.reserve(rows * (k / 32));
}

// Row m of out from v [k] (k a multiple of 32): per block d = max|v| / 127.
inline void quantize_row_q8(const float* v, int64_t m, Q8Rows& out) {
  const int64_t k = out.k, blocks = k / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    fv amax = splat(0.f);
    for (int i = 0; i < kBlockVecs; ++i) {
      const fv a = loadv(v + 32 * b + kLanes * i);
      amax = vmax(amax, vmax(a, -a));
    }
    const float d = hmax(amax) / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    const int32_t sum = round_block(v + 32 * b, inv, out.q.data() + m * k + 32 * b);
    out.d[m * blocks + b] = d;
    out.s[m * blocks + b] = d * static_cast<float>(sum);
    out.sum_q[m * blocks + b] = sum;
  }
}

// x [rows, k] (row stride ldx, k a multiple of 32) -> out.
inline void quantize_rows_q8(const float* x, int64_t ldx, int64_t rows, int64_t k, Q8Rows& out) {
  reserve_q8(rows, k, out);
  for (int64_t m = 0; m < rows; ++m) quantize_row_q8(x + m * ldx, m, out);
}

#if defined(__AVX2__)
// Eight int32 sums of four products u[i] * s[i] (u unsigned, s signed bytes). maddubs's int16
// pair sums cannot saturate here: |u| <= 128 and |s| <= 127 (weights' nibbles or |int8|). One
// block per 256-bit vector with AVX-512 too: two blocks per 512-bit vpdpbusd (joined with
// vinserti64x4, their scales by a blend) took 1.5x the time on a Zen 4, which splits 512-bit
// operations in two.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// A nibble block's 16 bytes as its 32 values in order (low halves, then high halves).
inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0f));
}

inline float hsum8(__m256 v) {
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  return (c[0] + c[2]) + (c[1] + c[3]);
}
#endif

// Weight formats with one-row integer tiles: all the block formats but Q6_K (whose two scales per
// 32 values, k6_sub_scales, split each block's dot product in two; int8_gemm.h takes it).
constexpr bool has_int8_products(int type) { return type != kF32 && type != kBF16 && type != kQ6_K; }

// Formats whose values are signed bytes (through the sign trick); the others' are unsigned.
constexpr bool signed_values(int type) {
  return type == kQ8_0 || type == kIQ4_NL || type == kIQ4_XS || type == kQ6_K;
}

// Q6_K's signed 8-bit scales of values 0..15 and 16..31 of sub-block j of the super-block at p:
// a block's exact integer sum is lo * sum(values 0..15 x q) + hi * sum(values 16..31 x q).
inline void k6_sub_scales(const uint8_t* p, int j, int32_t& lo, int32_t& hi) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(p + kQ6ScalesAt) + 2 * j;
  lo = sc[0];
  hi = sc[1];
}

// Block b of a row for the integer products: where its 32 values sit (p), the scale d on their
// integer dot product and the factor offset on the activation block's scaled sum:
//   Q8_0, IQ4, Q6_K: offset 0;  Q4_0: -8 d;  Q5_0: -16 d;  Q4_1, Q5_1: m;  Q4_K, Q5_K: -dmin * m_j.
// For the K-quants and IQ4_XS, j is the sub-block and p its super-block; Q6_K's d is the
// super-block's (its sub-block scales are integers, k6_sub_scales).
template <int T>
inline const uint8_t* int_block(const uint8_t* row, int64_t b, int& j, float& d, float& offset) {
  j = static_cast<int>(b % 8);
  if constexpr (T == kQ4_K || T == kQ5_K || T == kQ6_K || T == kIQ4_XS) {
    const uint8_t* p = row + block_bytes(T) * (b / 8);
    if constexpr (T == kQ6_K) {
      d = half_to_float(read_u16(p + kQ6DAt));
      offset = 0.f;
    } else if constexpr (T == kIQ4_XS) {
      d = iq4_xs_scale(p, j);
      offset = 0.f;
    } else {
      k4_sub_scales(p, j, d, offset);
      offset = -offset;
    }
    return p;
  } else {
    const uint8_t* p = row + block_bytes(T) * b;
    if constexpr (T == kQ4_1 || T == kQ5_1) {
      half2_to_float(p, d, offset);
    } else {
      d = half_to_float(read_u16(p));
      offset = T == kQ4_0 ? -8.f * d : T == kQ5_0 ? -16.f * d : 0.f;
    }
    return p;
  }
}

// Formats whose blocks add a float offset times the activation block's scaled sum (int_block's).
constexpr bool has_offset_term(int type) { return type == kQ4_1 || type == kQ5_1 || type == kQ4_K || type == kQ5_K; }

// sum(q) of the first 16 values of each of a's blocks, into sums [rows][blocks]: Q6_K's halves in
// the many-row products (int8_gemm.h, int8_panels.h).
inline void low_half_sums(const Q8Rows& a, AlignedBuffer<int32_t>& sums) {
  const int64_t blocks = a.k / 32;
  sums.reserve(a.rows * blocks);
  for (int64_t m = 0; m < a.rows; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* q = a.block(m, b);
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) s += q[i];
      sums[m * blocks + b] = s;
    }
}

// One weight row read block after block (b = 0, 1, ...) by the many-row products, which rearrange
// it into panels (int8_gemm.h, int8_panels.h): int_block's fields, the K-quants' from their
// super-block's scales and mins unpacked once for its eight blocks.
template <int T>
struct BlockWalk {
  const uint8_t* row = nullptr;
  float k4_scales[8], k4_offsets[8];
  const uint8_t* block(int64_t b, int& sub, float& d, float& offset) {
    if constexpr (T == kQ4_K || T == kQ5_K) {
      const uint8_t* p = row + block_bytes(T) * (b / 8);
      if (b % 8 == 0) k4_super_scales(p, k4_scales, k4_offsets);
      sub = static_cast<int>(b % 8);
      d = k4_scales[sub];
      offset = -k4_offsets[sub];
      return p;
    } else {
      return int_block<T>(row, b, sub, d, offset);
    }
  }
};

// Value i of a 32-value block from int_block, as an integer.
template <int T>
inline int32_t int_value(const uint8_t* p, int j, int i) {
  auto nibble = [i](const uint8_t* q) { return i < 16 ? q[i] & 0x0f : q[i - 16] >> 4; };
  auto high = [i](const uint8_t* qh) {
    uint32_t h;
    std::memcpy(&h, qh, 4);
    return static_cast<int32_t>((h >> i) & 1) << 4;
  };
  const uint8_t* q = sub_block_values<T>(p, j);
  if constexpr (T == kQ8_0) return reinterpret_cast<const int8_t*>(q)[i];
  else if constexpr (T == kQ4_0 || T == kQ4_1) return nibble(q);
  else if constexpr (T == kQ5_0 || T == kQ5_1) return nibble(q) | high(p + high_bits_at(T));
  else if constexpr (T == kIQ4_NL || T == kIQ4_XS) return kIQ4Levels[nibble(q)];
  else if constexpr (T == kQ6_K) {
    const int32_t lo = (q[i] >> (4 * (j % 4 / 2))) & 0x0f;
    return (lo | (((p[high_bits_at(T) + 32 * (j / 4) + i] >> (2 * (j % 4))) & 3) << 4)) - 32;
  } else {
    int32_t v = (q[i] >> (4 * (j % 2))) & 0x0f;
    if constexpr (T == kQ5_K) v |= ((p[high_bits_at(T) + i] >> j) & 1) << 4;
    return v;
  }
}

#if defined(__AVX2__)
// 32 bits -> 32 bytes, 0xff where the bit is set.
inline __m256i bytes_from_bits(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)),
                                             _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                0x0303030303030303));
  const __m256i probe = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(probe, _mm256_set1_epi64x(-1));
}

// IQ4's levels for 32 nibbles, as signed bytes.
inline __m256i iq4_bytes(__m256i nibbles) {
  const __m128i levels = _mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Levels));
  return _mm256_shuffle_epi8(_mm256_set_m128i(levels, levels), nibbles);
}

// Q6_K sub-block j's 32 values as stored, unsigned bytes 0..63 (each value plus 32): its low
// nibbles, and bits 2 (j % 4) and 2 (j % 4) + 1 of the high bytes moved to bits 4 and 5 (a 16-bit
// shift by at most 4 moves none of those bits across a byte).
inline __m256i k6_stored_values(const uint8_t* p, int j) {
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sub_block_values<kQ6_K>(p, j)));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + high_bits_at(kQ6_K) + 32 * (j / 4)));
  const __m256i lo = _mm256_and_si256(j % 4 < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(0x0f));
  const int at = 2 * (j % 4);
  const __m256i hi = at <= 4 ? _mm256_slli_epi16(qh, 4 - at) : _mm256_srli_epi16(qh, at - 4);
  return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}

// The 32 values of a block from int_block as bytes, in order.
template <int T>
inline __m256i int_values(const uint8_t* p, int j) {
  const uint8_t* q = sub_block_values<T>(p, j);
  if constexpr (T == kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  else if constexpr (T == kQ4_0 || T == kQ4_1) return unpack_nibbles(q);
  else if constexpr (T == kQ5_0 || T == kQ5_1)
    return _mm256_or_si256(unpack_nibbles(q), _mm256_and_si256(bytes_from_bits(p + high_bits_at(T)), _mm256_set1_epi8(0x10)));
  else if constexpr (T == kIQ4_NL || T == kIQ4_XS) return iq4_bytes(unpack_nibbles(q));
  else if constexpr (T == kQ6_K) return _mm256_sub_epi8(k6_stored_values(p, j), _mm256_set1_epi8(32));
  else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(v, 4 * (j % 2)), _mm256_set1_epi8(0x0f));
    if constexpr (T == kQ4_K) {
      return low;
    } else {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + high_bits_at(T)));
      return _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1)), 4));
    }
  }
}
#endif

// out[m * ldo + j] = a's rows m0 .. m0 + MR - 1 . w.row(j) (+ bias): each block's integer dot
// products scaled and added to a float32 sum per row (a vector of partial sums, then the offset
// terms), in block order.
template <int T, int MR>
inline void tile_q8(const Weight& w, int64_t j, const Q8Rows& a, int64_t m0, float* out, int64_t ldo) {
  const int64_t blocks = w.k / 32;
  const uint8_t* row = w.row(j);
  float offsets[MR] = {};
#if defined(__AVX2__)
  // Even and odd blocks in two sums per row, added at the end: two dependency chains of
  // multiply-adds instead of one.
  __m256 acc[MR], acc_odd[MR];
  for (int m = 0; m < MR; ++m) acc[m] = acc_odd[m] = _mm256_setzero_ps();
  auto block = [&](int64_t b, __m256 (&sums)[MR]) {
    int sub;
    float d, offset;
    const uint8_t* p = int_block<T>(row, b, sub, d, offset);
    const __m256i v = int_values<T>(p, sub);
    const __m256i u = signed_values(T) ? _mm256_sign_epi8(v, v) : v;
    for (int m = 0; m < MR; ++m) {
      __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.block(m0 + m, b)));
      if constexpr (signed_values(T)) q = _mm256_sign_epi8(q, v);
      const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(u, q));
      sums[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * a.scale(m0 + m, b)), sums[m]);
      offsets[m] += offset * a.scaled_sum(m0 + m, b);
    }
  };
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    block(b, acc);
    block(b + 1, acc_odd);
  }
  if (b < blocks) block(b, acc);
#else
  float acc[MR] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    int sub;
    float d, offset;
    const uint8_t* p = int_block<T>(row, b, sub, d, offset);
    int32_t v[32];
    for (int i = 0; i < 32; ++i) v[i] = int_value<T>(p, sub, i);
    for (int m = 0; m < MR; ++m) {
      const int8_t* q = a.block(m0 + m, b);
      int32_t dot = 0;
      for (int i = 0; i < 32; ++i) dot += v[i] * q[i];
      acc[m] += static_cast<float>(dot) * (d * a.scale(m0 + m, b));
      offsets[m] += offset * a.scaled_sum(m0 + m, b);
    }
  }
#endif
  for (int m = 0; m < MR; ++m) {
#if defined(__AVX2__)
    const float s = hsum8(_mm256_add_ps(acc[m], acc_odd[m])) + offsets[m];
#else
    const float s = acc[m] + offsets[m];
#endif
    out[m * ldo + j] = w.bias ? s + w.bias[j] : s;
  }
}

// Activation rows per tile: each decoded weight block serves all of them. Against float32 tiles
// (one thread, 2-core Zen 4, Q4_1 576 -> 3072 and 1536 -> 576): 1.6x as fast for 1 to 3 rows;
// 4 rows in one tile of 4 were 0.7-0.8x, in two tiles of 2 about level.
constexpr int kQ8MR = 2;

// Products of fewer rows than this take these tiles when the mode is on (from 4 rows they gained
// nothing on float32 tiles: more go to AVX2's int8_panels.h, else to the float32 or bfloat16
// products), and so do all row counts where a row's bits must not depend on its batch. Where the
// CPU has AVX-512 VNNI, only single rows do (int8_gemm.h takes two rows and more). In the default
// mode the K-quants' products of up to three rows take kquant_rows.h's tiles instead.
constexpr int64_t kInt8MaxRows = 4;


// a (the activations, quantized by quantize_rows_q8) times w's rows n0..n1-1 into out [rows, n]
// (row stride ldo); w in a format with integer products.
inline void product_q8(const Weight& w, const Q8Rows& a, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  with_format(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if constexpr (has_int8_products(T)) {
      by_row_tiles<kQ8MR>(a.rows, [&](auto mr, int64_t m) {
        for (int64_t j = n0; j < n1; ++j) tile_q8<T, decltype(mr)::value>(w, j, a, m, out + m * ldo, ldo);
      });
    }
  });
}

}  // namespace bsgl
