// Products of one to three activation rows (a decode step's) with Q4_K, Q5_K or Q6_K weights,
// read where they are stored, for the decode step's default int8 mode. The activations are
// int8_products.h's Q8 blocks of 32 (one per K-quant sub-block). Per 256-value super-block and
// activation row, each sub-block j gives one exact integer sum isum_j; the eight of a
// super-block are turned to float together, as one vector:
//   Q4_K, Q5_K: acc += isum * (d * sc) * da - (dmin * m) * (da * sum(q))
//   Q6_K:       acc += (sc_lo * isum_lo + sc_hi * isum_hi) * d * da    (a scale per 16 values)
// and each output is one horizontal sum of its vector at the end. A super-block's scales and
// mins are unpacked once, for all its sub-blocks and rows (k4_super_scales). int8_gemm.h's
// products rearrange sixteen weight rows per lane group before a row meets them, which at one
// row costs more than the row's products; here nothing is rearranged but the activations.
//
// The sums round differently from int8_gemm.h's, so the deterministic mode (a row's bits the
// same in any batch) keeps taking the gemm; these serve only where speed is asked for.
#pragma once

#include "int8_products.h"

namespace bsgl {

constexpr bool has_kquant_rows(int type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

// Products of up to this many rows take these tiles in the default mode: each super-block's
// unpacked values serve every row. Against int8_gemm.h (2-core Zen 4, two threads, weights
// streamed from memory, Q4_K / Q6_K): 1 row 2.1-2.9x as fast, 2 rows 1.1-2.8x, 3 rows 1.8-2.1x
// at 2048 -> 8192 but 0.9-1.0x at 8192 -> 2048, where the rows' activations that every weight
// row re-reads (24 KB) no longer stay in the 32 KB L1 beside the streamed weights.
constexpr int64_t kKRowsMax = 3;
constexpr int64_t kKRowsMaxValues = 16384;  // rows * k, for more than one row

// Whether a product of `rows` activation rows of k values with w's type takes these tiles:
// never where every row count must give the same bits (--enable-deterministic-inference, the
// op-by-op path).
constexpr bool takes_kquant_rows(int type, int64_t rows, int64_t k, bool same_bits_for_any_rows) {
  return has_kquant_rows(type) && (rows == 1 || (rows <= kKRowsMax && rows * k <= kKRowsMaxValues)) &&
         !same_bits_for_any_rows;
}

// The activation rows as the tiles read them. AVX-512: Q4_K's and Q5_K's sub-blocks reordered
// 0, 2, 1, 3, 4, 6, 5, 7 in each super-block, as one 64-byte load of weight nibbles holds them
// (sub-blocks 0 and 2 in the low halves, 1 and 3 in the high halves). Q6_K, AVX-512 and AVX2:
// the sums of each 16 values times 32 (its values are stored plus 32), [rows][k / 16], in the
// order each build's krows_sums takes them (q6_half_at).
struct KRowsInput {
  const Q8Rows* a = nullptr;
  const int8_t* q = nullptr;  // [rows][k]: a->q, or the reordered copy
  const int32_t* half_sums = nullptr;
  const int8_t* block(int64_t m, int64_t b) const { return q + m * a->k + 32 * b; }
};

// Where the sum of 16-value half h of a row goes in KRowsInput::half_sums: AVX-512 in order; AVX2
// per super-block the first halves of sub-blocks 0..3, their second halves, then 4..7's.
constexpr int64_t q6_half_at(int64_t h) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return h;
#else
  const int64_t j = h % 16 / 2;
  return h - h % 16 + j / 4 * 8 + h % 2 * 4 + j % 4;
#endif
}

template <int T>
inline KRowsInput krows_input(const Q8Rows& a, AlignedBuffer<int8_t>& reordered, AlignedBuffer<int32_t>& half_sums) {
  KRowsInput in{&a, a.q.data(), nullptr};
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (T == kQ4_K || T == kQ5_K) {
    constexpr int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    reordered.reserve(a.rows * a.k);
    for (int64_t m = 0; m < a.rows; ++m)
      for (int64_t b = 0; b < a.k / 32; ++b)
        std::memcpy(reordered.data() + m * a.k + 32 * b, a.block(m, b - b % 8 + order[b % 8]), 32);
    in.q = reordered.data();
  }
#else
  (void)reordered;
#endif
#if defined(__AVX2__)
  if constexpr (T == kQ6_K) {
    half_sums.reserve(a.rows * a.k / 16);
    for (int64_t m = 0; m < a.rows; ++m)
      for (int64_t h = 0; h < a.k / 16; ++h) {
        const int8_t* q = a.q.data() + m * a.k + 16 * h;
        int32_t s = 0;
        for (int i = 0; i < 16; ++i) s += q[i];
        half_sums[m * (a.k / 16) + q6_half_at(h)] = 32 * s;
      }
    in.half_sums = half_sums.data();
  }
#else
  (void)half_sums;
#endif
  return in;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// A super-block's values as four vectors of unsigned bytes, two sub-blocks each (the first in
// bytes 0..31); the activation blocks of KRowsInput match them in order.
//   Q4_K, Q5_K: sub-blocks (0, 2), (1, 3), (4, 6), (5, 7);   Q6_K: (0, 1), (2, 3), (4, 5), (6, 7).
template <int T>
inline void krows_values(const uint8_t* p, __m512i z[4]) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  if constexpr (T == kQ4_K || T == kQ5_K) {
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(p + values_at(T) + 64 * h);
      z[2 * h] = _mm512_and_si512(v, low4);
      z[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    if constexpr (T == kQ5_K) {  // bit j of high byte l: sub-block j's value l
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + high_bits_at(T))));
      const __m512i sixteen = _mm512_set1_epi8(16);
      for (int i = 0; i < 4; ++i) {
        const int a = i / 2 * 4 + i % 2;  // the vector's sub-blocks: a and a + 2
        const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << a)),
                                                _mm256_set1_epi8(static_cast<char>(1 << (a + 2))), 1);
        z[i] = _mm512_mask_add_epi8(z[i], _mm512_test_epi8_mask(qh, bits), z[i], sixteen);
      }
    }
  } else {
    static_assert(T == kQ6_K);
    const __m512i low2 = _mm512_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {  // 128 values: low nibbles at 64 h, 2-bit highs at 128 + 32 h
      const __m512i ql = _mm512_loadu_si512(p + values_at(T) + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + high_bits_at(T) + 32 * h)));
      for (int g = 0; g < 2; ++g) {  // sub-blocks 4h + 2g (shift 4g), 4h + 2g + 1 (shift 4g + 2) of qh
        const __m512i lo = _mm512_and_si512(g == 0 ? ql : _mm512_srli_epi16(ql, 4), low4);
        const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(4 * g)),
                                                  _mm256_set1_epi16(static_cast<int16_t>(4 * g + 2)), 1);
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(qh, shifts), low2);
        z[2 * h + g] = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
      }
    }
  }
}

// The sums of four vectors' dwords per 128-bit lane: element i of lane L of the result is the
// sum of z[i]'s four dwords in lane L (each a quarter of a sub-block, 8 values).
inline __m512i lane_sums(const __m512i z[4]) {
  const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(z[0], z[1]), _mm512_unpackhi_epi32(z[0], z[1]));
  const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2], z[3]), _mm512_unpackhi_epi32(z[2], z[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

// The exact integer sums of a super-block's 8 sub-blocks with activation row m, in order.
template <int T>
inline __m256i krows_sums(const __m512i z[4], const KRowsInput& in, int64_t m, int64_t s, __m512i q6_scales) {
  __m512i dots[4];
  for (int i = 0; i < 4; ++i)
    dots[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z[i], _mm512_loadu_si512(in.block(m, 8 * s + 2 * i)));
  const __m512i c = lane_sums(dots);
  if constexpr (T == kQ6_K) {
    // c's element 4L + i: half L % 2 of sub-block 2i + L / 2, i.e. the 16-value half 4i + L.
    const __m512i halves = _mm512_sub_epi32(
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), c),
        _mm512_loadu_si512(in.half_sums + m * (in.a->k / 16) + 16 * s));
    const __m512i scaled = _mm512_mullo_epi32(halves, q6_scales);
    return _mm512_cvtepi64_epi32(_mm512_add_epi32(scaled, _mm512_srli_epi64(scaled, 32)));
  } else {
    // Lanes 0 and 1 hold the first sub-block of each vector, 2 and 3 the second.
    const __m512i both = _mm512_add_epi32(c, _mm512_shuffle_i32x4(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castsi512_si256(
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 1, 8, 9, 2, 3, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0), both));
  }
}
#elif defined(__AVX2__)
// The sums of each half (lanes 0..3, lanes 4..7) of four vectors: [z0..z3 low halves | z0..z3 high].
inline __m256i half_sums4(const __m256i* z) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(z[0], z[1]), _mm256_hadd_epi32(z[2], z[3]));
}

// The exact integer sums of a super-block's 8 sub-blocks with activation row m, in order. Q6_K's
// values are taken as stored (plus 32, unsigned): each 16-value half's dot product less 32 times
// its activations' sum (KRowsInput::half_sums), times the half's scale (q6_scales, in the halves'
// order here: sub-blocks 0..3's first halves, their second halves, then 4..7's).
template <int T>
inline __m256i krows_sums(const uint8_t* p, const KRowsInput& in, int64_t m, int64_t s, const __m256i q6_scales[2]) {
  __m256i dots[8];
  for (int j = 0; j < 8; ++j) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.block(m, 8 * s + j)));
    dots[j] = dot_u8s8(T == kQ6_K ? k6_stored_values(p, j) : int_values<T>(p, j), q);
  }
  __m256i h0 = half_sums4(dots), h1 = half_sums4(dots + 4);
  if constexpr (T == kQ6_K) {
    const __m256i* hs = reinterpret_cast<const __m256i*>(in.half_sums + m * (in.a->k / 16) + 16 * s);
    h0 = _mm256_mullo_epi32(_mm256_sub_epi32(h0, _mm256_loadu_si256(hs)), q6_scales[0]);
    h1 = _mm256_mullo_epi32(_mm256_sub_epi32(h1, _mm256_loadu_si256(hs + 1)), q6_scales[1]);
  }
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

// Q6_K's 16 scales of the super-block at p as two vectors of int32 in krows_sums's halves' order.
inline void k6_half_scales(const uint8_t* p, __m256i scales[2]) {
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  for (int i = 0; i < 2; ++i)
    scales[i] = _mm256_permutevar8x32_epi32(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kQ6ScalesAt + 8 * i))), order);
}
#endif

// out[m * ldo + j] for activation rows m0 .. m0 + MR - 1 and weight row j (+ bias).
template <int T, int MR>
inline void krows_tile(const Weight& w, int64_t j, const KRowsInput& in, int64_t m0, float* out, int64_t ldo) {
  const Q8Rows& a = *in.a;
  const int64_t supers = w.k / 256, blocks = w.k / 32;
  const uint8_t* row = w.row(j);
#if defined(__AVX2__)
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* p = row + block_bytes(T) * s;
    __m256 scale, offset = _mm256_setzero_ps();
    if constexpr (T == kQ6_K) scale = _mm256_set1_ps(half_to_float(read_u16(p + kQ6DAt)));
    else k4_super_scales(p, scale, offset);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i z[4];
    krows_values<T>(p, z);
    const __m512i q6_scales = T == kQ6_K ? _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kQ6ScalesAt)))
                                         : _mm512_setzero_si512();
#else
    __m256i q6_scales[2] = {};
    if constexpr (T == kQ6_K) k6_half_scales(p, q6_scales);
#endif
    for (int m = 0; m < MR; ++m) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      const __m256i isum = krows_sums<T>(z, in, m0 + m, s, q6_scales);
#else
      const __m256i isum = krows_sums<T>(p, in, m0 + m, s, q6_scales);
#endif
      const int64_t at = (m0 + m) * blocks + 8 * s;
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(scale, _mm256_loadu_ps(a.d.data() + at)), acc[m]);
      if constexpr (T != kQ6_K) acc[m] = _mm256_fnmadd_ps(offset, _mm256_loadu_ps(a.s.data() + at), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    const float r = hsum8(acc[m]);
#else
  float acc[MR] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    int sub;
    float d, offset;
    const uint8_t* p = int_block<T>(row, b, sub, d, offset);
    int32_t v[32];
    for (int i = 0; i < 32; ++i) v[i] = int_value<T>(p, sub, i);
    int32_t lo = 1, hi = 1;
    if constexpr (T == kQ6_K) k6_sub_scales(p, sub, lo, hi);
    for (int m = 0; m < MR; ++m) {
      const int8_t* q = in.block(m0 + m, b);
      int32_t dot_lo = 0, dot_hi = 0;
      for (int i = 0; i < 16; ++i) dot_lo += v[i] * q[i];
      for (int i = 16; i < 32; ++i) dot_hi += v[i] * q[i];
      acc[m] += static_cast<float>(lo * dot_lo + hi * dot_hi) * (d * a.scale(m0 + m, b)) + offset * a.scaled_sum(m0 + m, b);
    }
  }
  for (int m = 0; m < MR; ++m) {
    const float r = acc[m];
#endif
    out[m * ldo + j] = w.bias ? r + w.bias[j] : r;
  }
}

// a's rows (quantize_rows_q8) times w's rows n0..n1-1 into out [rows, n]
// (row stride ldo); w Q4_K, Q5_K or Q6_K.
inline void product_kquant_rows(const Weight& w, const Q8Rows& a, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  with_format(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if constexpr (has_kquant_rows(T)) {
      thread_local AlignedBuffer<int8_t> reordered;
      thread_local AlignedBuffer<int32_t> half_sums;
      const KRowsInput in = krows_input<T>(a, reordered, half_sums);
      for (int64_t m = 0; m < a.rows; m += kKRowsMax) {  // tiles of 3 rows, then 1 or 2
        auto tiles = [&](auto mr) {
          for (int64_t j = n0; j < n1; ++j) krows_tile<T, decltype(mr)::value>(w, j, in, m, out + m * ldo, ldo);
        };
        const int64_t mr = std::min(kKRowsMax, a.rows - m);
        if (mr == 1) tiles(std::integral_constant<int, 1>{});
        else if (mr == 2) tiles(std::integral_constant<int, 2>{});
        else tiles(std::integral_constant<int, 3>{});
      }
    }
  });
}

}  // namespace bsgl
