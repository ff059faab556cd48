// Products of many activation rows (a prefill, a large decode batch) with block-quantized
// weights in int8, on CPUs with AVX-512 VNNI. int8_products.h multiplies one weight row at a
// time, 32 values per instruction and a horizontal sum per output; here sixteen weight rows
// travel side by side, one per 32-bit lane, so one vpdpbusd does 64 multiply-adds for sixteen
// outputs and nothing is summed across lanes.
//
// The weights are not stored that way. A panel of them (about 256 KB, which the core's L2 holds)
// is rearranged once per product into groups of sixteen rows: for each 32-value block, eight
// 64-byte vectors, vector q holding values 4q..4q+3 of each of the sixteen rows as unsigned
// bytes (a nibble as it is, a Q8_0 value plus 128), and the sixteen rows' scales as float32.
// Every activation row of the product then meets the panel. The activations are the Q8 blocks
// of int8_products.h; each weight block meets an activation block in one exact integer sum,
// whose offset (the nibbles' 8, Q8_0's 128) is taken out in integers, then scaled and added to a
// float32 sum per output in block order. The rearranging is what keeps memory as stored: the
// panel is the only other copy, and it is a few hundred kilobytes.
//
// Each output is one row's sum over the blocks in block order whatever the number of rows
// (one row included: product_int8_row): a request's result does not depend on the batch it is
// in. (int8_products.h's tiles, for the other formats and for CPUs without VNNI, round
// differently.)
#pragma once

#include "int8_products.h"

namespace bsgl {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHasInt8Gemm = true;
constexpr int kGroup = 16;    // weight rows per group: one per 32-bit lane
constexpr int kGemmMR = 4, kGemmNR = 2;  // a tile: 4 activation rows by 2 groups (8 integer, 8 float sums)
// Two and three rows ran at 2.2-2.4x int8_products.h's tiles (2-core Zen 4, Q4_0 2048 -> 2048,
// 2048 -> 16384, 8192 -> 2048); one row at 0.8x (the rearranging is not shared): one row goes by
// product_int8_row below, with the same arithmetic.

// The formats it takes (the K-quants and the others go one row at a time, int8_products.h).
constexpr bool has_int8_gemm(int type) { return type == kQ8_0 || type == kQ4_0 || type == kQ4_1; }

// What a weight type's unsigned bytes are offset by: value = d * (u - offset) (+ m for Q4_1).
// Each block's integer sum starts at -offset * sum(q), so that it comes out exact.
template <int T>
constexpr int32_t byte_offset() { return T == kQ8_0 ? 128 : T == kQ4_0 ? 8 : 0; }

struct Int8Panel {
  int64_t groups = 0, blocks = 0;
  AlignedBuffer<uint8_t> q;  // [group][block][8][64]
  AlignedBuffer<float> d, m; // [group][block][16]; m for Q4_1 only
  const uint8_t* qs(int64_t g, int64_t b) const { return q.data() + (g * blocks + b) * 512; }
  const float* scales(int64_t g, int64_t b) const { return d.data() + (g * blocks + b) * kGroup; }
  const float* mins(int64_t g, int64_t b) const { return m.data() + (g * blocks + b) * kGroup; }
};

// Dword i (bytes 4i..4i+3) of each of the sixteen 16-byte rows held four to a vector in z.
inline __m512i dwords_of_rows(const __m512i z[4], int i) {
  // Lanes l and 8 + l: row l % 4 of the first (l < 4) or second vector of each pair.
  const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28),
                                       _mm512_set1_epi32(i));
  const __m512i a = _mm512_permutex2var_epi32(z[0], idx, z[1]);  // rows 0..7 in lanes 0..7
  const __m512i b = _mm512_permutex2var_epi32(z[2], idx, z[3]);  // rows 8..15 in lanes 8..15
  return _mm512_mask_blend_epi32(0xff00, a, b);
}

// Rearranges w's rows j .. j + 15 (rows from j + valid on repeat row j) into panel group g.
template <int T>
inline void pack_group(const Weight& w, int64_t j, int valid, Int8Panel& p, int64_t g) {
  const uint8_t* rows[kGroup];
  for (int c = 0; c < kGroup; ++c) rows[c] = w.row(c < valid ? j + c : j);
  constexpr int64_t bb = row_bytes(T, 32);
  constexpr int nib = T == kQ4_1 ? 4 : 2;  // where a block's values start
  for (int64_t b = 0; b < p.blocks; ++b) {
    uint8_t* dst = p.q.data() + (g * p.blocks + b) * 512;
    float* d = p.d.data() + (g * p.blocks + b) * kGroup;
    for (int c = 0; c < kGroup; ++c) {
      const uint8_t* blk = rows[c] + bb * b;
      if constexpr (T == kQ4_1) half2_to_float(blk, d[c], p.m.data()[(g * p.blocks + b) * kGroup + c]);
      else d[c] = half_to_float(read_u16(blk));
    }
    if constexpr (T == kQ8_0) {
      // 32 bytes a row: vector q is dword q of every row, gathered.
      alignas(64) int32_t offs[16];
      for (int c = 0; c < kGroup; ++c) offs[c] = static_cast<int32_t>(rows[c] - rows[0]);
      const __m512i vidx = _mm512_load_si512(offs);
      const uint8_t* base = rows[0] + bb * b + nib;
      for (int q = 0; q < 8; ++q) {
        const __m512i v = _mm512_i32gather_epi32(vidx, base + 4 * q, 1);
        _mm512_store_si512(dst + 64 * q, _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))));
      }
    } else {
      // 16 bytes of nibbles a row: byte i holds value i (low half) and value 16 + i (high half),
      // so dword i's low halves are values 4i.. and its high halves values 16 + 4i...
      __m512i z[4];
      for (int r = 0; r < 4; ++r) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * r] + bb * b + nib)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * r + 1] + bb * b + nib)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * r + 2] + bb * b + nib)), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * r + 3] + bb * b + nib)), 3);
        z[r] = v;
      }
      const __m512i low = _mm512_set1_epi8(0x0f);
      for (int i = 0; i < 4; ++i) {
        const __m512i v = dwords_of_rows(z, i);
        _mm512_store_si512(dst + 64 * i, _mm512_and_si512(v, low));
        _mm512_store_si512(dst + 64 * (4 + i), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
    }
  }
}

// out[m * ldo + 16 r + c] for activation rows m0 .. m0 + MR - 1, NR groups from g on, and the
// outputs c < valid[r]: each activation dword broadcast once serves NR groups.
// Sixteen results into out: float32, or bfloat16 bits rounded to nearest even (as torch rounds).
inline void store_results(float* out, __mmask16 keep, __m512 v) { _mm512_mask_storeu_ps(out, keep, v); }
inline void store_results(uint16_t* out, __mmask16 keep, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));  // NaN
  _mm256_mask_storeu_epi16(out, keep, _mm512_cvtepi32_epi16(r));
}

template <int T, int MR, int NR, typename Out>
inline void gemm_tile(const Int8Panel& p, int64_t g, const Q8Rows& a, int64_t m0,
                      const int* valid, const float* bias, Out* out, int64_t ldo) {
  const int64_t blocks = p.blocks;
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[MR][NR];
    for (int m = 0; m < MR; ++m) {
      const __m512i init = _mm512_set1_epi32(-byte_offset<T>() * a.sum(m0 + m, b));
      for (int r = 0; r < NR; ++r) dot[m][r] = init;
    }
    for (int q = 0; q < 8; ++q) {
      __m512i wq[NR];
      for (int r = 0; r < NR; ++r) wq[r] = _mm512_load_si512(p.qs(g + r, b) + 64 * q);
      for (int m = 0; m < MR; ++m) {
        int32_t x4;
        std::memcpy(&x4, a.block(m0 + m, b) + 4 * q, 4);
        const __m512i xv = _mm512_set1_epi32(x4);
        for (int r = 0; r < NR; ++r) dot[m][r] = _mm512_dpbusd_epi32(dot[m][r], wq[r], xv);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 d = _mm512_loadu_ps(p.scales(g + r, b));
      for (int m = 0; m < MR; ++m) {
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][r]), _mm512_mul_ps(d, _mm512_set1_ps(a.scale(m0 + m, b))), acc[m][r]);
        if constexpr (T == kQ4_1)
          acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(p.mins(g + r, b)), _mm512_set1_ps(a.scaled_sum(m0 + m, b)), acc[m][r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __mmask16 keep = static_cast<__mmask16>((1u << valid[r]) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + kGroup * r) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) store_results(out + m * ldo + kGroup * r, keep, _mm512_add_ps(acc[m][r], bv));
  }
}

// One activation row (a batch-1 decode step) with gemm_tile's arithmetic, so that a row's bits
// do not depend on how many rows its product has. Rearranging a panel for a single row costs
// more than it saves, so the sixteen weight rows of a group are read where they are, two to a
// vector (row A's 32 values in the low half, row B's in the high half), each meeting the
// activation block in one vpdpbusd; the sixteen vectors of partial sums are then added up
// across lanes into one vector of sixteen exact block sums, and from there it is gemm_tile.
// The rows of z[i]: (i, i + 4) for i < 4, (i + 4, i + 8) after, which the lane sums below put
// back in order.
template <int T>
inline __m512i row_pair_values(const uint8_t* a, const uint8_t* b) {
  if constexpr (T == kQ8_0) {  // signed bytes + 128, as the panels hold them
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2))),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), 1);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {  // 16 bytes of nibbles: the low halves are values 0..15, the high halves 16..31
    constexpr int at = T == kQ4_1 ? 4 : 2;
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + at)));
    v = _mm512_mask_broadcast_i32x4(v, 0xff00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + at)));
    const __m512i shifts = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0, 0,
                                             0x0004000400040004, 0x0004000400040004);
    return _mm512_and_si512(_mm512_srlv_epi16(v, shifts), _mm512_set1_epi8(0x0f));
  }
}

// The sixteen sums of the row pairs' lanes, rows in order (integers: any order is exact).
inline __m512i row_sums(const __m512i z[8]) {
  __m512i pairs[4];
  for (int i = 0; i < 4; ++i)
    pairs[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]), _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]));
  // Per 128-bit lane L: the sums over L of z[0..3] (e) and of z[4..7] (f).
  const __m512i e = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[0], pairs[1]), _mm512_unpackhi_epi64(pairs[0], pairs[1]));
  const __m512i f = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2], pairs[3]), _mm512_unpackhi_epi64(pairs[2], pairs[3]));
  return _mm512_add_epi32(_mm512_shuffle_i64x2(e, f, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_i64x2(e, f, _MM_SHUFFLE(3, 1, 3, 1)));
}

template <int T, typename Out>
inline void row_group(const Weight& w, int64_t j, int valid, const Q8Rows& a, Out* out) {
  const uint8_t* rows[kGroup];
  for (int c = 0; c < kGroup; ++c) rows[c] = w.row(c < valid ? j + c : j);
  alignas(64) int32_t offs[kGroup];
  for (int c = 0; c < kGroup; ++c) offs[c] = static_cast<int32_t>(rows[c] - rows[0]);
  const __m512i heads = _mm512_load_si512(offs);
  constexpr int64_t bb = row_bytes(T, 32);
  // The next group's rows are asked for while this one is multiplied, a line per row every
  // `every` blocks: sixteen rows read side by side are sixteen streams, and without it a Q8_0
  // matrix larger than the caches ran at 20 GB/s against 45 for one row at a time.
  constexpr int64_t every = std::max<int64_t>(1, 64 / bb);
  const uint8_t* next = w.row(j) + kGroup * w.stride;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.k / 32; ++b) {
    if (b % every == 0)
      for (int c = 0; c < kGroup; ++c) __builtin_prefetch(next + c * w.stride + bb * b);
    const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.block(0, b))));
    __m512i z[8];
    for (int i = 0; i < 8; ++i) {
      const int ra = i < 4 ? i : i + 4;
      z[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), row_pair_values<T>(rows[ra] + bb * b, rows[ra + 4] + bb * b), x);
    }
    const __m512i dot = _mm512_add_epi32(row_sums(z), _mm512_set1_epi32(-byte_offset<T>() * a.sum(0, b)));
    // Each row's block header: d (and Q4_1's m) as float16.
    const __m512i head = _mm512_i32gather_epi32(heads, rows[0] + bb * b, 1);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(a.scale(0, b))), acc);
    if constexpr (T == kQ4_1)
      acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16))),
                            _mm512_set1_ps(a.scaled_sum(0, b)), acc);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 bv = w.bias ? _mm512_maskz_loadu_ps(keep, w.bias + j) : _mm512_setzero_ps();
  store_results(out + j, keep, _mm512_add_ps(acc, bv));
}

// a's one row (quantize_rows_q8) times w's rows n0..n1-1 into out[n0..n1); w as for the gemm.
template <typename Out>
inline void product_int8_row(const Weight& w, const Q8Rows& a, Out* out, int64_t n0, int64_t n1) {
  with_format(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if constexpr (T == kQ8_0 || T == kQ4_0 || T == kQ4_1) {
      for (int64_t j = n0; j < n1; j += kGroup)
        row_group<T>(w, j, static_cast<int>(std::min<int64_t>(kGroup, n1 - j)), a, out);
    }
  });
}

// a (quantize_rows_q8) times w's rows n0..n1-1 into out [rows, n] (row stride ldo); w
// block-quantized, k a multiple of 32. Panels of about 256 KB of rearranged rows.
template <typename Out>  // float, or uint16_t for bfloat16 results
inline void product_int8_gemm(const Weight& w, const Q8Rows& a, Out* out, int64_t ldo,
                              int64_t n0, int64_t n1) {
  with_format(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if constexpr (T == kQ8_0 || T == kQ4_0 || T == kQ4_1) {
      thread_local Int8Panel p;
      p.blocks = w.k / 32;
      const int64_t group_bytes = p.blocks * (512 + 2 * 4 * kGroup);
      const int64_t per_panel = std::max<int64_t>(1, 256 * 1024 / group_bytes);
      p.q.reserve(per_panel * p.blocks * 512);
      p.d.reserve(per_panel * p.blocks * kGroup);
      if (T == kQ4_1) p.m.reserve(per_panel * p.blocks * kGroup);
      for (int64_t j0 = n0; j0 < n1; j0 += per_panel * kGroup) {
        const int64_t j1 = std::min(n1, j0 + per_panel * kGroup);
        p.groups = (j1 - j0 + kGroup - 1) / kGroup;
        for (int64_t g = 0; g < p.groups; ++g)
          pack_group<T>(w, j0 + g * kGroup, static_cast<int>(std::min<int64_t>(kGroup, j1 - j0 - g * kGroup)), p, g);
        by_row_tiles<kGemmMR>(a.rows, [&](auto mr, int64_t m) {
          constexpr int MR = decltype(mr)::value;
          int valid[kGemmNR];
          for (int64_t g = 0; g < p.groups; g += kGemmNR) {
            const int nr = static_cast<int>(std::min<int64_t>(kGemmNR, p.groups - g));
            for (int r = 0; r < nr; ++r)
              valid[r] = static_cast<int>(std::min<int64_t>(kGroup, j1 - j0 - (g + r) * kGroup));
            const int64_t j = j0 + g * kGroup;
            const float* bias = w.bias ? w.bias + j : nullptr;
            if (nr == kGemmNR) gemm_tile<T, MR, kGemmNR>(p, g, a, m, valid, bias, out + m * ldo + j, ldo);
            else gemm_tile<T, MR, 1>(p, g, a, m, valid, bias, out + m * ldo + j, ldo);
          }
        });
      }
    }
  });
}
#else
constexpr bool kHasInt8Gemm = false;
#endif

}  // namespace bsgl
