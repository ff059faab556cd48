// Products with weights stored in groups of sixteen rows (QuantizedWeight.grouped), on CPUs with
// AVX-512 VNNI: the layout int8_gemm.h rearranges a panel into for every product, made once at
// load and kept in the file's own bytes per block.
//
// The layout is weights.h's (kGroupRows): per block, sixteen rows' halves, then vectors holding
// four bytes of each row, row c in 32-bit lane c (Q4_0 and Q4_1: four vectors of nibbles; Q8_0:
// eight of int8 values; Q4_K: three of scale bytes, then 32 of nibbles). A Q4 vector's low nibbles
// are values 4i..4i+3 of each row and its high nibbles values 16 + 4i.. (Q4_K: one sub-block's
// and the next one's), so one AND and one shift give two of the vectors vpdpbusd takes, and nothing
// has to be moved across lanes: a row's 32-bit lane meets an activation dword broadcast to all
// sixteen. A single row (a batch-1 decode step) then does 64 multiply-adds per instruction as a
// batch does, with no horizontal sums. Q4_K products of many rows unpack the groups into
// int8_gemm.h's panels instead (kQ4KPanelRows).
//
// The arithmetic is int8_gemm.h's (gemm_tile): each block's exact integer sum, times d * da,
// added in block order, then the offset term; a row's bits are those of the ungrouped weight's
// product_int8, whatever the number of rows.
#pragma once

#include "int8_gemm.h"

namespace bsgl {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static_assert(kGroup == kGroupRows, "a group is a vector's lanes");

// The exact integer sums of block b (at blk_r for group r) for activation rows m0..: the first
// four value vectors into dot, the last four into high (two chains where few rows give few
// independent sums; one where there are enough), both starting from the offset's term.
template <int T, int MR, int NR>
inline void group_block_sums(const uint8_t* const (&blk)[NR], const Q8Rows& a, int64_t m0, int64_t b,
                             __m512i (&dot)[MR][NR]) {
  constexpr bool split = MR * NR < 8;
  __m512i high[MR][NR];
  for (int m = 0; m < MR; ++m) {
    const __m512i init = _mm512_set1_epi32(-byte_offset<T>() * a.sum(m0 + m, b));
    for (int r = 0; r < NR; ++r) {
      dot[m][r] = init;
      if constexpr (split) high[m][r] = _mm512_setzero_si512();
    }
  }
  auto& second = [&]() -> __m512i(&)[MR][NR] { if constexpr (split) return high; else return dot; }();
  for (int i = 0; i < 4; ++i) {
    __m512i lo[NR], hi[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* v = blk[r] + group_header_bytes(T);
      if constexpr (T == kQ8_0) {
        const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
        lo[r] = _mm512_xor_si512(_mm512_loadu_si512(v + 64 * i), sign);
        hi[r] = _mm512_xor_si512(_mm512_loadu_si512(v + 64 * (i + 4)), sign);
      } else {
        const __m512i p = _mm512_loadu_si512(v + 64 * i), mask = _mm512_set1_epi8(0x0f);
        lo[r] = _mm512_and_si512(p, mask);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(p, 4), mask);
      }
    }
    for (int m = 0; m < MR; ++m) {
      int32_t x_lo, x_hi;
      std::memcpy(&x_lo, a.block(m0 + m, b) + 4 * i, 4);
      std::memcpy(&x_hi, a.block(m0 + m, b) + 4 * (i + 4), 4);
      const __m512i xl = _mm512_set1_epi32(x_lo), xh = _mm512_set1_epi32(x_hi);
      for (int r = 0; r < NR; ++r) {
        dot[m][r] = _mm512_dpbusd_epi32(dot[m][r], lo[r], xl);
        second[m][r] = _mm512_dpbusd_epi32(second[m][r], hi[r], xh);
      }
    }
  }
  if constexpr (split)
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) dot[m][r] = _mm512_add_epi32(dot[m][r], high[m][r]);
}

// A tile's sums plus the bias into out[m * ldo + 16 r + c] (groups g.. of w).
template <int MR, int NR, typename Out>
inline void store_group_tile(const __m512 (&acc)[MR][NR], const Weight& w, int64_t g, Out* out, int64_t ldo) {
  for (int r = 0; r < NR; ++r) {
    const __m512 bv = w.bias ? _mm512_loadu_ps(w.bias + (g + r) * kGroup) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) store_results(out + m * ldo + kGroup * r, 0xffff, _mm512_add_ps(acc[m][r], bv));
  }
}

// out[m * ldo + 16 r + c] for activation rows m0 .. m0 + MR - 1 and groups g .. g + NR - 1 of w.
template <int T, int MR, int NR, typename Out>
inline void group_tile(const Weight& w, int64_t g, const Q8Rows& a, int64_t m0, Out* out, int64_t ldo) {
  constexpr int64_t bb = kGroup * block_bytes(T);
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w.data + (g + r) * w.stride;
  for (int64_t b = 0; b < w.k / 32; ++b) {
    const uint8_t* blk[NR];
    for (int r = 0; r < NR; ++r) blk[r] = rows[r] + bb * b;
    __m512i dot[MR][NR];
    group_block_sums<T, MR, NR>(blk, a, m0, b, dot);
    for (int r = 0; r < NR; ++r) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[r])));
      for (int m = 0; m < MR; ++m) {
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][r]), _mm512_mul_ps(d, _mm512_set1_ps(a.scale(m0 + m, b))), acc[m][r]);
        if constexpr (has_offset_term(T))
          acc[m][r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[r] + 32))),
                                      _mm512_set1_ps(a.scaled_sum(m0 + m, b)), acc[m][r]);
      }
    }
  }
  store_group_tile(acc, w, g, out, ldo);
}

// Where a grouped Q4_K super-block's nibbles start: after the halves and three vectors of scales.
constexpr int64_t kQ4KValuesAt = group_header_bytes(kQ4_K) + 3 * 64;

// The scales d * sc_j and offsets -dmin * m_j (as int8_gemm.h's panels hold them) of the eight
// sub-blocks of a grouped Q4_K super-block at blk, sixteen rows a vector: k4_scale_min_bytes's
// four words of each row, one row per lane.
inline void k4_group_scales(const uint8_t* blk, float (&scale)[8][kGroup], float (&offset)[8][kGroup]) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
  const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
  const uint8_t* sc = blk + group_header_bytes(kQ4_K);
  const __m512i s0 = _mm512_loadu_si512(sc), s1 = _mm512_loadu_si512(sc + 64), s2 = _mm512_loadu_si512(sc + 128);
  const __m512i low6 = _mm512_set1_epi32(0x3f3f3f3f), low4 = _mm512_set1_epi32(0x0f0f0f0f),
                low2 = _mm512_set1_epi32(0x03030303), byte = _mm512_set1_epi32(0xff);
  const __m512i u[4] = {
      _mm512_and_si512(s0, low6),
      _mm512_or_si512(_mm512_and_si512(s2, low4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s0, 6), low2), 4)),
      _mm512_and_si512(s1, low6),
      _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, 4), low4),
                      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s1, 6), low2), 4))};
  for (int j = 0; j < 8; ++j) {
    const __m512i s = _mm512_and_si512(_mm512_srli_epi32(u[j / 4], 8 * (j % 4)), byte);
    const __m512i m = _mm512_and_si512(_mm512_srli_epi32(u[2 + j / 4], 8 * (j % 4)), byte);
    _mm512_storeu_ps(scale[j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
    const __m512i product = _mm512_castps_si512(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m)));  // negated exactly:
    _mm512_storeu_ps(offset[j], _mm512_castsi512_ps(_mm512_xor_si512(product, _mm512_set1_epi32(INT32_MIN))));
  }
}

// group_tile for Q4_K, a 256-value super-block at a time: its scales unpacked once, then its four
// pairs of sub-blocks, each pair eight vectors of nibbles (sub-block 2p in the low nibbles, 2p + 1
// in the high ones), two exact sums, and the two blocks' float steps in block order.
template <int MR, int NR, typename Out>
inline void k4_group_tile(const Weight& w, int64_t g, const Q8Rows& a, int64_t m0, Out* out, int64_t ldo) {
  constexpr int64_t sb = kGroup * block_bytes(kQ4_K);
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  alignas(64) float scale[NR][8][kGroup], offset[NR][8][kGroup];
  const __m512i mask = _mm512_set1_epi8(0x0f);
  for (int64_t s = 0; s < w.k / 256; ++s) {
    const uint8_t* blk[NR];
    for (int r = 0; r < NR; ++r) {
      blk[r] = w.data + (g + r) * w.stride + sb * s;
      k4_group_scales(blk[r], scale[r], offset[r]);
    }
    for (int p = 0; p < 4; ++p) {
      const int64_t b = 8 * s + 2 * p;  // the activation block of sub-block 2p
      __m512i dot[2][MR][NR];
      for (int h = 0; h < 2; ++h)
        for (int m = 0; m < MR; ++m)
          for (int r = 0; r < NR; ++r) dot[h][m][r] = _mm512_setzero_si512();
      for (int v = 0; v < 8; ++v) {
        __m512i lo[NR], hi[NR];
        for (int r = 0; r < NR; ++r) {
          const __m512i q = _mm512_loadu_si512(blk[r] + kQ4KValuesAt + 64 * (8 * p + v));
          lo[r] = _mm512_and_si512(q, mask);
          hi[r] = _mm512_and_si512(_mm512_srli_epi16(q, 4), mask);
        }
        for (int m = 0; m < MR; ++m) {
          int32_t x_even, x_odd;
          std::memcpy(&x_even, a.block(m0 + m, b) + 4 * v, 4);
          std::memcpy(&x_odd, a.block(m0 + m, b + 1) + 4 * v, 4);
          const __m512i xe = _mm512_set1_epi32(x_even), xo = _mm512_set1_epi32(x_odd);
          for (int r = 0; r < NR; ++r) {
            dot[0][m][r] = _mm512_dpbusd_epi32(dot[0][m][r], lo[r], xe);
            dot[1][m][r] = _mm512_dpbusd_epi32(dot[1][m][r], hi[r], xo);
          }
        }
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < NR; ++r) {
          const __m512 d = _mm512_load_ps(scale[r][2 * p + h]), mn = _mm512_load_ps(offset[r][2 * p + h]);
          for (int m = 0; m < MR; ++m) {
            acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[h][m][r]), _mm512_mul_ps(d, _mm512_set1_ps(a.scale(m0 + m, b + h))), acc[m][r]);
            acc[m][r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.scaled_sum(m0 + m, b + h)), acc[m][r]);
          }
        }
    }
  }
  store_group_tile(acc, w, g, out, ldo);
}

// Group g of a Q4_K w into group pg of an int8_gemm.h panel: each 32-value sub-block's values as
// bytes, its scale and offset; no transposing, the groups hold the rows side by side already.
inline void pack_from_groups(const Weight& w, int64_t g, Int8Panel& p, int64_t pg) {
  const uint8_t* group = w.data + g * w.stride;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  alignas(64) float scale[8][kGroup], offset[8][kGroup];
  for (int64_t b = 0; b < p.blocks; ++b) {
    const int64_t at = pg * p.blocks + b;
    const int j = static_cast<int>(b % 8);
    const uint8_t* blk = group + b / 8 * kGroup * block_bytes(kQ4_K);
    if (j == 0) k4_group_scales(blk, scale, offset);
    _mm512_storeu_ps(p.d.data() + at * kGroup, _mm512_load_ps(scale[j]));
    _mm512_storeu_ps(p.m.data() + at * kGroup, _mm512_load_ps(offset[j]));
    for (int v = 0; v < 8; ++v) {
      const __m512i q = _mm512_loadu_si512(blk + kQ4KValuesAt + 64 * (8 * (j / 2) + v));
      _mm512_store_si512(p.q.data() + at * 512 + 64 * v, _mm512_and_si512(j % 2 ? _mm512_srli_epi16(q, 4) : q, low4));
    }
  }
}

// From this many rows Q4_K's groups are unpacked into int8_gemm.h's panels, whose tiles then only
// multiply: 2048 -> 16384 at 16 rows 2.6 ms read in place against 3.0 by panels, at 32 rows 5.2
// against 4.7, at 512 rows 77 against 59 (2-core Zen 4). Q8_0, Q4_0 and Q4_1 read in place as
// fast or faster at any number of rows (Q4_0 at 512 rows 50 against 52 ms).
constexpr int64_t kQ4KPanelRows = 32;

// a (quantize_rows_q8) times grouped w's rows n0..n1-1 into out [rows, n] (row stride ldo); n0
// and n1 whole groups (multiples of kGroup, as every caller splits). One row goes four groups at a time (four independent sums). More rows go by panels of groups
// (about 256 KB, which L2 holds) as int8_gemm.h's: every tile of rows meets a panel's groups in
// pairs, so a panel is read from memory once and the activations once per panel.
template <typename Out>
inline void product_grouped(const Weight& w, const Q8Rows& a, Out* out, int64_t ldo, int64_t n0, int64_t n1) {
  if (n0 >= n1) return;
  with_format(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if constexpr (groupable(T)) {
      auto groups = [&](auto mr, auto nr, int64_t m, int64_t g) {
        constexpr int MR = decltype(mr)::value, NR = decltype(nr)::value;
        if constexpr (T == kQ4_K) k4_group_tile<MR, NR>(w, g, a, m, out + m * ldo + g * kGroup, ldo);
        else group_tile<T, MR, NR>(w, g, a, m, out + m * ldo + g * kGroup, ldo);
      };
      using One = std::integral_constant<int, 1>;
      using Two = std::integral_constant<int, 2>;
      const int64_t g0 = n0 / kGroup, g1 = n1 / kGroup;
      if (a.rows == 1) {
        int64_t g = g0;
        for (; g + 4 <= g1; g += 4) groups(One{}, std::integral_constant<int, 4>{}, 0, g);
        for (; g < g1; ++g) groups(One{}, One{}, 0, g);
        return;
      }
      if constexpr (T == kQ4_K) {
        if (a.rows >= kQ4KPanelRows) {
          int8_panels<T>(w, a, out, ldo, n0, n1,
                         [&](int64_t j, int, Int8Panel& p, int64_t pg) { pack_from_groups(w, j / kGroup, p, pg); });
          return;
        }
      }
      const int64_t per_panel = std::max<int64_t>(2, 256 * 1024 / (w.k / block_values(T) * kGroup * block_bytes(T)) / 2 * 2);
      for (int64_t p0 = g0; p0 < g1; p0 += per_panel) {
        const int64_t p1 = std::min(g1, p0 + per_panel);
        by_row_tiles<4>(a.rows, [&](auto mr, int64_t m) {
          int64_t g = p0;
          for (; g + 2 <= p1; g += 2) groups(mr, Two{}, m, g);
          if (g < p1) groups(mr, One{}, m, g);
        });
      }
    }
  });
}
#endif

}  // namespace bsgl
