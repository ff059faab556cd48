// Products of quantized weights with activations rounded to int8, for a few rows (a decode step),
// as llama.cpp computes them: each activation row is quantized once per product to Q8 blocks of
// 32 (int8 q, a float32 scale d, value = d * q, and d * sum(q)), and each weight block meets
// each activation block in one integer dot product, scaled once per block:
//   Q8_0: dw * da * sum(w q)
//   Q4_0: dw * da * sum(n q) - 8 dw (da sum(q))     (n: the unsigned nibbles)
//   Q4_1: dw * da * sum(n q) + mw (da sum(q))
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
  const int8_t* block(int64_t m, int64_t b) const { return q.data() + m * k + 32 * b; }
  float scale(int64_t m, int64_t b) const { return d.data()[m * (k / 32) + b]; }
  float scaled_sum(int64_t m, int64_t b) const { return s.data()[m * (k / 32) + b]; }
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

// A quantized block's scale, its minimum (Q4_1; 0 otherwise) and the factor on the activation
// block's scaled sum: -8 d for Q4_0, m for Q4_1.
template <int T>
inline void block_scales(const uint8_t* p, float& d, float& offset) {
  if constexpr (T == kQ4_1) {
    half2_to_float(p, d, offset);
  } else {
    d = half_to_float(read_u16(p));
    offset = T == kQ4_0 ? -8.f * d : 0.f;
  }
}


// out[m * ldo + j] = a's rows m0 .. m0 + MR - 1 . w.row(j) (+ bias): each block's integer dot
// products scaled and added to a float32 sum per row (a vector of partial sums, then the offset
// terms), in block order.
template <int T, int MR>
inline void tile_q8(const Weight& w, int64_t j, const Q8Rows& a, int64_t m0, float* out, int64_t ldo) {
  const int64_t blocks = w.k / 32;
  const uint8_t* row = w.row(j);
  float offsets[MR] = {};
#if defined(__AVX2__)
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
#else
  float acc[MR] = {};
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = row + row_bytes(T, 32) * b;
    float d, offset;
    block_scales<T>(p, d, offset);
#if defined(__AVX2__)
    __m256i u, sign;
    if constexpr (T == kQ8_0) {
      sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
      u = _mm256_sign_epi8(sign, sign);
    } else {
      u = unpack_nibbles(p + (T == kQ4_0 ? 2 : 4));
    }
    for (int m = 0; m < MR; ++m) {
      __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.block(m0 + m, b)));
      if constexpr (T == kQ8_0) q = _mm256_sign_epi8(q, sign);
      const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(u, q));
      acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * a.scale(m0 + m, b)), acc[m]);
      offsets[m] += offset * a.scaled_sum(m0 + m, b);
    }
#else
    for (int m = 0; m < MR; ++m) {
      const int8_t* q = a.block(m0 + m, b);
      int32_t dot = 0;
      if constexpr (T == kQ8_0) {
        const int8_t* v = reinterpret_cast<const int8_t*>(p + 2);
        for (int i = 0; i < 32; ++i) dot += v[i] * q[i];
      } else {
        const uint8_t* v = p + (T == kQ4_0 ? 2 : 4);
        for (int i = 0; i < 16; ++i) dot += (v[i] & 0x0f) * q[i] + (v[i] >> 4) * q[i + 16];
      }
      acc[m] += static_cast<float>(dot) * (d * a.scale(m0 + m, b));
      offsets[m] += offset * a.scaled_sum(m0 + m, b);
    }
#endif
  }
  for (int m = 0; m < MR; ++m) {
#if defined(__AVX2__)
    const float s = hsum8(acc[m]) + offsets[m];
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
// nothing on float32 tiles: more go to the float32 or bfloat16 products). Where the CPU has
// AVX-512 VNNI, only single rows do: int8_gemm.h takes two and more.
constexpr int64_t kInt8MaxRows = 4;

inline bool is_block_quantized(int type) { return type == kQ8_0 || type == kQ4_0 || type == kQ4_1; }

// a (the activations, quantized by quantize_rows_q8) times w's rows n0..n1-1 into out [rows, n]
// (row stride ldo); w block-quantized.
inline void product_q8(const Weight& w, const Q8Rows& a, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  with_format(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if constexpr (T == kQ8_0 || T == kQ4_0 || T == kQ4_1) {
      by_row_tiles<kQ8MR>(a.rows, [&](auto mr, int64_t m) {
        for (int64_t j = n0; j < n1; ++j) tile_q8<T, decltype(mr)::value>(w, j, a, m, out + m * ldo, ldo);
      });
    }
  });
}

}  // namespace bsgl
