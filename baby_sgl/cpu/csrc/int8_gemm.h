// Products of many activation rows (a prefill, a large decode batch) with block-quantized
// weights in int8, on CPUs with AVX-512 VNNI (int8_panels.h is AVX2's form, with the same bits). int8_products.h multiplies one weight row at a
// time, 32 values per instruction and a horizontal sum per output; here sixteen weight rows
// travel side by side, one per 32-bit lane, so one vpdpbusd does 64 multiply-adds for sixteen
// outputs and nothing is summed across lanes.
//
// The weights are not stored that way. A panel of them (about 256 KB, which the core's L2 holds)
// is rearranged once per product into groups of sixteen rows: for each 32-value block (a
// K-quant's sub-block), eight 64-byte vectors, vector q holding values 4q..4q+3 of each of the
// sixteen rows as unsigned bytes (unsigned values as they are, signed ones plus 128), and the
// sixteen rows' scales as float32 (and offsets, and Q6_K's integer scales of each 16 values).
// Every activation row of the product then meets the panel. The activations are the Q8 blocks
// of int8_products.h; each weight block meets an activation block in one exact integer sum,
// whose offset (Q4_0's 8, Q5_0's 16, signed values' 128) is taken out in integers (Q6_K: the
// sums of its two halves times their scales), then scaled and added to a float32 sum per output
// in block order, then the block's offset term (Q4_1, Q5_1, Q4_K, Q5_K). The rearranging is what
// keeps memory as stored: the panel is the only other copy, and it is a few hundred kilobytes.
//
// Each output is one row's sum over the blocks in block order whatever the number of rows
// (one row included: product_int8_row): a request's result does not depend on the batch it is
// in. (int8_products.h's tiles, for CPUs without VNNI and single rows where speed wins, round
// differently.)
#pragma once

#include "int8_products.h"

namespace bsgl {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHasInt8Gemm = true;
constexpr int kGroup = 16;    // weight rows per group: one per 32-bit lane
constexpr int kGemmMR = 4, kGemmNR = 2;  // a tile: 4 activation rows by 2 groups (8 integer, 8 float sums)
// From this many rows: one row ran at 0.8x int8_products.h's tile (the rearranging is not shared),
// two and three rows at 2.2-2.4x its tiles (2-core Zen 4, Q4_0 2048 -> 2048, 2048 -> 16384, 8192 -> 2048).
constexpr int64_t kInt8GemmMinRows = 2;

// The formats it takes: every block format.
constexpr bool has_int8_gemm(int type) { return type != kF32 && type != kBF16; }

// Formats with a one-row twin of the gemm (product_int8_row: the same bits, read in place).
constexpr bool has_int8_row(int type) { return type == kQ8_0 || type == kQ4_0 || type == kQ4_1; }

// Whether a product of `rows` activation rows takes the gemm's arithmetic (product_int8):
// always where every row count must give the same bits (--enable-deterministic-inference, and
// the op-by-op path), else from kInt8GemmMinRows rows, or for Q6_K (no int8_products.h tile).
// Otherwise a single row takes int8_products.h's tile, which reads the weights faster (Q8_0,
// Q4_0, Q4_1: a batch-1 step of the default model 5.0 against 6.3 ms on a 2-core Zen 4); the
// K-quants' few rows take kquant_rows.h's tiles before this is asked (takes_kquant_rows).
constexpr bool takes_int8_gemm(int type, int64_t rows, bool same_bits_for_any_rows) {
  return has_int8_gemm(type) && (rows >= kInt8GemmMinRows || !has_int8_products(type) || same_bits_for_any_rows);
}

// What a weight type's unsigned bytes are offset by: value = d * (u - offset) (+ the offset
// term for the formats that have one). Signed values are stored plus 128. Each block's integer
// sum starts at -offset * sum(q), so that it comes out exact.
template <int T>
constexpr int32_t byte_offset() { return signed_values(T) ? 128 : T == kQ4_0 ? 8 : T == kQ5_0 ? 16 : 0; }

struct Int8Panel {
  int64_t groups = 0, blocks = 0;
  AlignedBuffer<uint8_t> q;  // [group][block][8][64]
  AlignedBuffer<float> d, m; // [group][block][16]; m for the formats with an offset term
  AlignedBuffer<int32_t> sc; // [group][block][2][16]: Q6_K's scales of values 0..15, then 16..31
  const uint8_t* qs(int64_t g, int64_t b) const { return q.data() + (g * blocks + b) * 512; }
  const float* scales(int64_t g, int64_t b) const { return d.data() + (g * blocks + b) * kGroup; }
  const float* mins(int64_t g, int64_t b) const { return m.data() + (g * blocks + b) * kGroup; }
  const int32_t* int_scales(int64_t g, int64_t b) const { return sc.data() + (g * blocks + b) * 2 * kGroup; }
};

// Sixteen rows of 32 bytes (v[c]: row c) as eight vectors at dst, vector q holding bytes
// 4q..4q+3 of row c in lane c: an 8 x 8 transpose of dwords in each 256-bit half.
inline void store_transposed(const __m256i v[kGroup], uint8_t* dst) {
  // z[r] holds rows a and a + 4 (a = r, then r + 4 from r = 4): after the unpacks within 128-bit
  // lanes, one shuffle of lanes leaves the rows in order.
  __m512i z[8], t[8], u[8];
  for (int r = 0; r < 8; ++r) {
    const int a = r < 4 ? r : r + 4;
    z[r] = _mm512_inserti64x4(_mm512_castsi256_si512(v[a]), v[a + 4], 1);
  }
  for (int r = 0; r < 8; r += 2) {
    t[r] = _mm512_unpacklo_epi32(z[r], z[r + 1]);
    t[r + 1] = _mm512_unpackhi_epi32(z[r], z[r + 1]);
  }
  for (int h = 0; h < 8; h += 4) {  // u[h + i]: dwords i (128-bit lanes 0, 2) and 4 + i (lanes 1, 3)
    u[h] = _mm512_unpacklo_epi64(t[h], t[h + 2]);
    u[h + 1] = _mm512_unpackhi_epi64(t[h], t[h + 2]);
    u[h + 2] = _mm512_unpacklo_epi64(t[h + 1], t[h + 3]);
    u[h + 3] = _mm512_unpackhi_epi64(t[h + 1], t[h + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    _mm512_store_si512(dst + 64 * i, _mm512_shuffle_i32x4(u[i], u[4 + i], 0x88));
    _mm512_store_si512(dst + 64 * (4 + i), _mm512_shuffle_i32x4(u[i], u[4 + i], 0xdd));
  }
}

// Rearranges w's rows j .. j + 15 (rows from j + valid on repeat row j) into panel group g: each
// block's values as int8_products.h reads them (int_block, int_values), made unsigned.
template <int T>
inline void pack_group(const Weight& w, int64_t j, int valid, Int8Panel& p, int64_t g) {
  BlockWalk<T> rows[kGroup];
  for (int c = 0; c < kGroup; ++c) rows[c].row = w.row(c < valid ? j + c : j);
  for (int64_t b = 0; b < p.blocks; ++b) {
    const int64_t at = g * p.blocks + b;
    if (b % 2 == 0)  // sixteen streams a row apart, which the hardware prefetchers follow poorly
      for (int c = 0; c < kGroup; ++c) {
        const char* ahead = reinterpret_cast<const char*>(rows[c].row) + row_bytes(T, 32 * (b + 16));
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
      }
    __m256i v[kGroup];
    for (int c = 0; c < kGroup; ++c) {
      int sub;
      float d, offset;
      const uint8_t* blk = rows[c].block(b, sub, d, offset);
      p.d[at * kGroup + c] = d;
      if constexpr (has_offset_term(T)) p.m[at * kGroup + c] = offset;
      if constexpr (T == kQ6_K) k6_sub_scales(blk, sub, p.sc[at * 2 * kGroup + c], p.sc[(at * 2 + 1) * kGroup + c]);
      v[c] = int_values<T>(blk, sub);
      if constexpr (signed_values(T)) v[c] = _mm256_xor_si256(v[c], _mm256_set1_epi8(static_cast<char>(0x80)));
    }
    store_transposed(v, p.q.data() + at * 512);
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

// dot[m][r] += the integer products of values 4 q0 .. 4 q1 - 1 of block b of groups g + r with
// activation row m0 + m: each activation dword broadcast once serves NR groups.
template <int MR, int NR>
inline void add_dots(const Int8Panel& p, int64_t g, const Q8Rows& a, int64_t m0, int64_t b, int q0, int q1,
                     __m512i (&dot)[MR][NR]) {
  for (int q = q0; q < q1; ++q) {
    __m512i wq[NR];
    for (int r = 0; r < NR; ++r) wq[r] = _mm512_load_si512(p.qs(g + r, b) + 64 * q);
    for (int m = 0; m < MR; ++m) {
      int32_t x4;
      std::memcpy(&x4, a.block(m0 + m, b) + 4 * q, 4);
      const __m512i xv = _mm512_set1_epi32(x4);
      for (int r = 0; r < NR; ++r) dot[m][r] = _mm512_dpbusd_epi32(dot[m][r], wq[r], xv);
    }
  }
}

// The exact integer sums of block b for activation rows m0.. and groups g..: one sum over the 32
// values, or for Q6_K its two halves' sums times their scales (low_sums: sum(q) of each activation
// block's first 16 values, [rows][blocks]).
template <int T, int MR, int NR>
inline void block_sums(const Int8Panel& p, int64_t g, const Q8Rows& a, const int32_t* low_sums, int64_t m0,
                       int64_t b, __m512i (&dot)[MR][NR]) {
  if constexpr (T == kQ6_K) {
    __m512i half[MR][NR];
    for (int m = 0; m < MR; ++m) {
      const int32_t low = low_sums[(m0 + m) * p.blocks + b];
      for (int r = 0; r < NR; ++r) {
        dot[m][r] = _mm512_set1_epi32(-byte_offset<T>() * low);
        half[m][r] = _mm512_set1_epi32(-byte_offset<T>() * (a.sum(m0 + m, b) - low));
      }
    }
    add_dots<MR, NR>(p, g, a, m0, b, 0, 4, dot);
    add_dots<MR, NR>(p, g, a, m0, b, 4, 8, half);
    for (int r = 0; r < NR; ++r) {
      const __m512i lo = _mm512_loadu_si512(p.int_scales(g + r, b)), hi = _mm512_loadu_si512(p.int_scales(g + r, b) + kGroup);
      for (int m = 0; m < MR; ++m)
        dot[m][r] = _mm512_add_epi32(_mm512_mullo_epi32(dot[m][r], lo), _mm512_mullo_epi32(half[m][r], hi));
    }
  } else {
    for (int m = 0; m < MR; ++m) {
      const __m512i init = _mm512_set1_epi32(-byte_offset<T>() * a.sum(m0 + m, b));
      for (int r = 0; r < NR; ++r) dot[m][r] = init;
    }
    add_dots<MR, NR>(p, g, a, m0, b, 0, 8, dot);
  }
}

// out[m * ldo + 16 r + c] for activation rows m0 .. m0 + MR - 1, NR groups from g on, and the
// outputs c < valid[r]: per block, its exact integer sum times d * da, then the offset term.
template <int T, int MR, int NR, typename Out>
inline void gemm_tile(const Int8Panel& p, int64_t g, const Q8Rows& a, const int32_t* low_sums, int64_t m0,
                      const int* valid, const float* bias, Out* out, int64_t ldo) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m512i dot[MR][NR];
    block_sums<T, MR, NR>(p, g, a, low_sums, m0, b, dot);
    for (int r = 0; r < NR; ++r) {
      const __m512 d = _mm512_loadu_ps(p.scales(g + r, b));
      for (int m = 0; m < MR; ++m) {
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][r]), _mm512_mul_ps(d, _mm512_set1_ps(a.scale(m0 + m, b))), acc[m][r]);
        if constexpr (has_offset_term(T))
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
    const __m512i v = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + values_at(T)))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + values_at(T))), 1);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {  // 16 bytes of nibbles: the low halves are values 0..15, the high halves 16..31
    constexpr int at = values_at(T);
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
    if constexpr (has_int8_row(T)) {
      for (int64_t j = n0; j < n1; j += kGroup)
        row_group<T>(w, j, static_cast<int>(std::min<int64_t>(kGroup, n1 - j)), a, out);
    }
  });
}

// a (quantize_rows_q8) times w's rows n0..n1-1 into out [rows, n] (row stride ldo), by panels
// of about 256 KB: pack(j, valid, p, g) rearranges rows j .. j + valid - 1 into the panel's group g.
template <int T, typename Out, typename Pack>
inline void int8_panels(const Weight& w, const Q8Rows& a, Out* out, int64_t ldo, int64_t n0, int64_t n1, Pack&& pack) {
  thread_local Int8Panel p;
  thread_local AlignedBuffer<int32_t> low_sums;
  if constexpr (T == kQ6_K) low_half_sums(a, low_sums);
  p.blocks = w.k / 32;
  const int64_t group_bytes = p.blocks * (512 + 4 * kGroup * (1 + has_offset_term(T) + 2 * (T == kQ6_K)));
  const int64_t per_panel = std::max<int64_t>(1, 256 * 1024 / group_bytes);
  p.q.reserve(per_panel * p.blocks * 512);
  p.d.reserve(per_panel * p.blocks * kGroup);
  if (has_offset_term(T)) p.m.reserve(per_panel * p.blocks * kGroup);
  if (T == kQ6_K) p.sc.reserve(per_panel * p.blocks * 2 * kGroup);
  for (int64_t j0 = n0; j0 < n1; j0 += per_panel * kGroup) {
    const int64_t j1 = std::min(n1, j0 + per_panel * kGroup);
    p.groups = (j1 - j0 + kGroup - 1) / kGroup;
    for (int64_t g = 0; g < p.groups; ++g)
      pack(j0 + g * kGroup, static_cast<int>(std::min<int64_t>(kGroup, j1 - j0 - g * kGroup)), p, g);
    by_row_tiles<kGemmMR>(a.rows, [&](auto mr, int64_t m) {
      constexpr int MR = decltype(mr)::value;
      int valid[kGemmNR];
      for (int64_t g = 0; g < p.groups; g += kGemmNR) {
        const int nr = static_cast<int>(std::min<int64_t>(kGemmNR, p.groups - g));
        for (int r = 0; r < nr; ++r)
          valid[r] = static_cast<int>(std::min<int64_t>(kGroup, j1 - j0 - (g + r) * kGroup));
        const int64_t j = j0 + g * kGroup;
        const float* bias = w.bias ? w.bias + j : nullptr;
        if (nr == kGemmNR) gemm_tile<T, MR, kGemmNR>(p, g, a, low_sums.data(), m, valid, bias, out + m * ldo + j, ldo);
        else gemm_tile<T, MR, 1>(p, g, a, low_sums.data(), m, valid, bias, out + m * ldo + j, ldo);
      }
    });
  }
}

// a (quantize_rows_q8) times w's rows n0..n1-1 into out [rows, n] (row stride ldo); w
// block-quantized, k a multiple of 32, its rows as stored.
template <typename Out>  // float, or uint16_t for bfloat16 results
inline void product_int8_gemm(const Weight& w, const Q8Rows& a, Out* out, int64_t ldo,
                              int64_t n0, int64_t n1) {
  with_format(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if constexpr (has_int8_gemm(T))
      int8_panels<T>(w, a, out, ldo, n0, n1,
                     [&](int64_t j, int valid, Int8Panel& p, int64_t g) { pack_group<T>(w, j, valid, p, g); });
  });
}
// The gemm's arithmetic for any number of rows: one row by product_int8_row where the format
// has it, else (and for more rows) by the gemm.
template <typename Out>
inline void product_int8(const Weight& w, const Q8Rows& a, Out* out, int64_t ldo, int64_t n0, int64_t n1) {
  if (a.rows == 1 && has_int8_row(w.type)) product_int8_row(w, a, out, n0, n1);
  else product_int8_gemm(w, a, out, ldo, n0, n1);
}
#else
constexpr bool kHasInt8Gemm = false;
constexpr bool has_int8_gemm(int) { return false; }
#endif

}  // namespace bsgl
