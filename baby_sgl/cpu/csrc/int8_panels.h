// Products of many activation rows (a prefill, a decode batch) with block-quantized weights in
// int8, on AVX2 CPUs without AVX-512 VNNI (int8_gemm.h is those CPUs' form). int8_products.h's
// tiles decode each weight block once per two rows and sum each output across lanes; from four
// rows on, a panel of weight rows is rearranged once per product into groups of eight, one row
// per 32-bit lane (for each 32-value block, eight 32-byte vectors, vector q holding values
// 4q..4q+3 of each of the eight rows), and every activation row then meets the panel: a dword of
// four activations broadcast to all lanes, vpmaddubsw (unsigned weight bytes x signed activation
// bytes, pairs summed to int16), and nothing summed across lanes.
//
// AVX2 has no vpdpbusd, and vpmaddubsw's int16 pair sums saturate. The panel holds each format's
// values where they cannot: unsigned as stored (Q4_0, Q4_1, Q4_K: 0..15; Q5_0, Q5_1, Q5_K:
// 0..31; Q6_K: 0..63, its values plus 32), whose offset (Q4_0's 8, Q5_0's 16, Q6_K's 32) is taken
// out of the block's integer sum as int8_gemm.h does; signed values (Q8_0, IQ4_NL, IQ4_XS) through
// the sign trick, |w| x (q with w's sign). A pair sum is then at most 2 x 63 x 127 (or 2 x 128 x
// 127) in magnitude, and int16 sums of several steps stay exact too: eight steps for 4-bit values,
// four for 5-bit, two for Q6_K, one for signed bytes (steps_per_widening), before vpmaddwd widens
// them to int32.
//
// Each block's exact integer sum is then scaled and added as int8_gemm.h's gemm_tile adds it (d *
// da on the sum, then the offset term, in block order): the same integers and the same float
// operations, so these products give int8_gemm.h's bits. They are not used where a row's bits must
// not depend on its batch (int8_products.h's tiles, which take one and two rows, round differently).
#pragma once

#include "int8_products.h"

namespace bsgl {

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
constexpr bool kHasInt8Panels = true;
constexpr int kPanelGroup = 8;  // weight rows per group: one per 32-bit lane
// A tile: 2 activation rows by 2 groups (4 int16 and 4 int32 sums live, the rest of AVX2's 16
// registers for the weights and the broadcast activations). One thread, 128 rows, Q4_0, Q4_K and
// Q6_K at 2048 -> 8192 and 8192 -> 2048 on a Zen 3: 104-128 G multiply-adds x 2 per second, against
// 66-75 for 4 x 1, 70-110 for 2 x 3, 93-118 for 1 x 4, 87-123 for 2 x 4 (4 x 2 and wider spill).
constexpr int kInt8PanelMR = 2, kInt8PanelNR = 2;

// From this many rows: fewer take int8_products.h's tiles (kquant_rows.h's for the K-quants),
// which need no rearranging.
constexpr int64_t kInt8PanelMinRows = 4;

constexpr bool has_int8_panels(int type) { return type != kF32 && type != kBF16; }

// Whether a product of `rows` activation rows takes these panels (never where every row count
// must give the same bits).
constexpr bool takes_int8_panels(int type, int64_t rows, bool same_bits_for_any_rows) {
  return has_int8_panels(type) && rows >= kInt8PanelMinRows && !same_bits_for_any_rows;
}

constexpr bool panel_signed(int type) { return type == kQ8_0 || type == kIQ4_NL || type == kIQ4_XS; }

// What an unsigned format's bytes are offset by: value = d * (u - offset) (+ the offset term).
constexpr int32_t panel_offset(int type) { return type == kQ4_0 ? 8 : type == kQ5_0 ? 16 : type == kQ6_K ? 32 : 0; }

// vpmaddubsw steps whose int16 sums stay exact: 2 * max|w| * 127 per step, under 32767.
constexpr int steps_per_widening(int type) {
  if (panel_signed(type)) return 1;
  if (type == kQ6_K) return 2;
  if (type == kQ5_0 || type == kQ5_1 || type == kQ5_K) return 4;
  return 8;
}

struct Int8Panel8 {
  int64_t groups = 0, blocks = 0;
  AlignedBuffer<uint8_t> q;   // [group][block][8][32]
  AlignedBuffer<float> d, m;  // [group][block][8]; m for the formats with an offset term
  AlignedBuffer<int32_t> sc;  // [group][block][2][8]: Q6_K's scales of values 0..15, then 16..31
  const uint8_t* qs(int64_t g, int64_t b) const { return q.data() + (g * blocks + b) * 256; }
  const float* scales(int64_t g, int64_t b) const { return d.data() + (g * blocks + b) * kPanelGroup; }
  const float* mins(int64_t g, int64_t b) const { return m.data() + (g * blocks + b) * kPanelGroup; }
  const int32_t* int_scales(int64_t g, int64_t b) const { return sc.data() + (g * blocks + b) * 2 * kPanelGroup; }
};

// Eight rows of 32 bytes (v[c]: row c) as eight vectors at dst, vector q holding bytes 4q..4q+3 of
// row c in lane c: an 8 x 8 transpose of dwords.
inline void store_transposed8(const __m256i (&v)[kPanelGroup], uint8_t* dst) {
  __m256i t[8];
  for (int r = 0; r < 8; ++r) t[r] = v[r];
  transpose8_epi32(t);
  for (int q = 0; q < 8; ++q) _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 32 * q), t[q]);
}

// A block's 32 values as the panel holds them: unsigned as stored, or signed bytes.
template <int T>
inline __m256i panel_values(const uint8_t* p, int j) {
  if constexpr (T == kQ6_K) return k6_stored_values(p, j);
  else return int_values<T>(p, j);
}

// Rearranges w's rows j .. j + 7 (rows from j + valid on repeat row j) into panel group g.
template <int T>
inline void pack_group8(const Weight& w, int64_t j, int valid, Int8Panel8& p, int64_t g) {
  BlockWalk<T> rows[kPanelGroup];
  for (int c = 0; c < kPanelGroup; ++c) rows[c].row = w.row(c < valid ? j + c : j);
  constexpr int64_t bb = block_bytes(T) * 32 / block_values(T);  // a block's bytes (a super-block's eighth)
  constexpr int64_t every = std::max<int64_t>(1, 64 / bb);
  const uint8_t* next = w.row(j) + kPanelGroup * w.stride;
  for (int64_t b = 0; b < p.blocks; ++b) {
    const int64_t at = g * p.blocks + b;
    if (b % every == 0)  // the next group's rows: eight short streams, which the prefetchers find late
      for (int c = 0; c < kPanelGroup; ++c) _mm_prefetch(reinterpret_cast<const char*>(next + c * w.stride + bb * b), _MM_HINT_T0);
    __m256i v[kPanelGroup];
    for (int c = 0; c < kPanelGroup; ++c) {
      int sub;
      float d, offset;
      const uint8_t* blk = rows[c].block(b, sub, d, offset);
      p.d[at * kPanelGroup + c] = d;
      if constexpr (has_offset_term(T)) p.m[at * kPanelGroup + c] = offset;
      if constexpr (T == kQ6_K)
        k6_sub_scales(blk, sub, p.sc[at * 2 * kPanelGroup + c], p.sc[(at * 2 + 1) * kPanelGroup + c]);
      v[c] = panel_values<T>(blk, sub);
    }
    store_transposed8(v, p.q.data() + at * 256);
  }
}

// sum[m][r] (int32, per lane) = the products of values 4 q0 .. 4 q1 - 1 of block b of groups
// g + r with activation rows m0 + m, int16 sums widened every steps_per_widening(T) steps: each
// activation dword broadcast once serves NR groups.
template <int T, int MR, int NR>
inline void panel_dots(const Int8Panel8& p, int64_t g, const Q8Rows& a, int64_t m0, int64_t b, int q0, int q1,
                       __m256i (&sum)[MR][NR]) {
  constexpr int S = steps_per_widening(T);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i part[MR][NR];
  for (int q = q0; q < q1; ++q) {
    __m256i wq[NR], u[NR];
    for (int r = 0; r < NR; ++r) {
      wq[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(p.qs(g + r, b) + 32 * q));
      u[r] = panel_signed(T) ? _mm256_sign_epi8(wq[r], wq[r]) : wq[r];
    }
    for (int m = 0; m < MR; ++m) {
      int32_t x4;
      std::memcpy(&x4, a.block(m0 + m, b) + 4 * q, 4);
      const __m256i xv = _mm256_set1_epi32(x4);
      for (int r = 0; r < NR; ++r) {
        const __m256i prod = _mm256_maddubs_epi16(u[r], panel_signed(T) ? _mm256_sign_epi8(xv, wq[r]) : xv);
        part[m][r] = (q - q0) % S == 0 ? prod : _mm256_add_epi16(part[m][r], prod);
        if ((q - q0) % S == S - 1 || q == q1 - 1) {
          const __m256i wide = _mm256_madd_epi16(part[m][r], ones);
          sum[m][r] = q - q0 < S ? wide : _mm256_add_epi32(sum[m][r], wide);
        }
      }
    }
  }
}

// out[m * ldo + 8 r + c] for activation rows m0 .. m0 + MR - 1, groups g .. g + NR - 1 and their
// outputs c < valid[r]: per block, its exact integer sum times d * da, then the offset term, in
// block order. low_sums: Q6_K's sum(q) of the first 16 values of each activation block, [rows][blocks].
template <int T, int MR, int NR>
inline void panel_tile(const Int8Panel8& p, int64_t g, const Q8Rows& a, const int32_t* low_sums, int64_t m0,
                       const int* valid, const float* bias, float* out, int64_t ldo) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m256i dot[MR][NR];
    if constexpr (T == kQ6_K) {  // its two halves' sums, each times its scale
      __m256i high[MR][NR];
      panel_dots<T, MR, NR>(p, g, a, m0, b, 0, 4, dot);
      panel_dots<T, MR, NR>(p, g, a, m0, b, 4, 8, high);
      for (int r = 0; r < NR; ++r) {
        const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(p.int_scales(g + r, b)));
        const __m256i hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(p.int_scales(g + r, b) + kPanelGroup));
        for (int m = 0; m < MR; ++m) {
          const int32_t low = low_sums[(m0 + m) * p.blocks + b];
          const __m256i l = _mm256_add_epi32(dot[m][r], _mm256_set1_epi32(-panel_offset(T) * low));
          const __m256i h = _mm256_add_epi32(high[m][r], _mm256_set1_epi32(-panel_offset(T) * (a.sum(m0 + m, b) - low)));
          dot[m][r] = _mm256_add_epi32(_mm256_mullo_epi32(l, lo), _mm256_mullo_epi32(h, hi));
        }
      }
    } else {
      panel_dots<T, MR, NR>(p, g, a, m0, b, 0, 8, dot);
      if constexpr (panel_offset(T) != 0)
        for (int m = 0; m < MR; ++m)
          for (int r = 0; r < NR; ++r)
            dot[m][r] = _mm256_add_epi32(dot[m][r], _mm256_set1_epi32(-panel_offset(T) * a.sum(m0 + m, b)));
    }
    for (int r = 0; r < NR; ++r) {
      const __m256 d = _mm256_load_ps(p.scales(g + r, b));
      for (int m = 0; m < MR; ++m) {
        acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][r]), _mm256_mul_ps(d, _mm256_set1_ps(a.scale(m0 + m, b))),
                                    acc[m][r]);
        if constexpr (has_offset_term(T))
          acc[m][r] = _mm256_fmadd_ps(_mm256_load_ps(p.mins(g + r, b)), _mm256_set1_ps(a.scaled_sum(m0 + m, b)), acc[m][r]);
      }
    }
  }
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int r = 0; r < NR; ++r) {
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid[r]), lanes);
    const __m256 bv = bias ? _mm256_maskload_ps(bias + kPanelGroup * r, keep) : _mm256_setzero_ps();
    for (int m = 0; m < MR; ++m) _mm256_maskstore_ps(out + m * ldo + kPanelGroup * r, keep, _mm256_add_ps(acc[m][r], bv));
  }
}

// a (quantize_rows_q8) times w's rows n0..n1-1 into out [rows, n] (row stride ldo), by panels of
// about 256 KB; w block-quantized, k a multiple of 32, its rows as stored.
inline void product_int8_panels(const Weight& w, const Q8Rows& a, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  with_format(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if constexpr (has_int8_panels(T)) {
      thread_local Int8Panel8 p;
      thread_local AlignedBuffer<int32_t> low_sums;
      if constexpr (T == kQ6_K) low_half_sums(a, low_sums);
      p.blocks = w.k / 32;
      const int64_t group_bytes = p.blocks * (256 + 4 * kPanelGroup * (1 + has_offset_term(T) + 2 * (T == kQ6_K)));
      const int64_t per_panel = std::max<int64_t>(1, 256 * 1024 / group_bytes);
      p.q.reserve(per_panel * p.blocks * 256);
      p.d.reserve(per_panel * p.blocks * kPanelGroup);
      if (has_offset_term(T)) p.m.reserve(per_panel * p.blocks * kPanelGroup);
      if (T == kQ6_K) p.sc.reserve(per_panel * p.blocks * 2 * kPanelGroup);
      for (int64_t j0 = n0; j0 < n1; j0 += per_panel * kPanelGroup) {
        const int64_t j1 = std::min(n1, j0 + per_panel * kPanelGroup);
        p.groups = (j1 - j0 + kPanelGroup - 1) / kPanelGroup;
        for (int64_t g = 0; g < p.groups; ++g)
          pack_group8<T>(w, j0 + g * kPanelGroup, static_cast<int>(std::min<int64_t>(kPanelGroup, j1 - j0 - g * kPanelGroup)), p, g);
        by_row_tiles<kInt8PanelMR>(a.rows, [&](auto mr, int64_t m) {
          constexpr int MR = decltype(mr)::value;
          auto tile = [&](auto nr, int64_t g) {  // groups g .. g + nr - 1
            constexpr int NR = decltype(nr)::value;
            int valid[NR];
            for (int r = 0; r < NR; ++r)
              valid[r] = static_cast<int>(std::min<int64_t>(kPanelGroup, j1 - j0 - (g + r) * kPanelGroup));
            const int64_t j = j0 + g * kPanelGroup;
            panel_tile<T, MR, NR>(p, g, a, low_sums.data(), m, valid, w.bias ? w.bias + j : nullptr, out + m * ldo + j, ldo);
          };
          int64_t g = 0;
          for (; g + kInt8PanelNR <= p.groups; g += kInt8PanelNR) tile(std::integral_constant<int, kInt8PanelNR>{}, g);
          for (; g < p.groups; ++g) tile(std::integral_constant<int, 1>{}, g);
        });
      }
    }
  });
}
#else
constexpr bool kHasInt8Panels = false;
constexpr int kPanelGroup = 1;
constexpr int64_t kInt8PanelMinRows = 0;
constexpr bool has_int8_panels(int) { return false; }
constexpr bool takes_int8_panels(int, int64_t, bool) { return false; }
inline void product_int8_panels(const Weight&, const Q8Rows&, float*, int64_t, int64_t, int64_t) {}
#endif

}  // namespace bsgl
