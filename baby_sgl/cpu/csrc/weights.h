// Weight matrices as they are stored (formats.h), and their products with float32 activations.
//
// A block is widened to float32 in registers and multiplied there: nothing full-precision is
// ever written out, and the products accumulate in float32. Each output is one dot product
// whose order of operations is fixed (two 16-lane partial sums over the blocks, then a fixed
// tree), whatever the number of rows computed with it: a request's result does not depend on
// the batch it is in.
#pragma once

#include <vector>

#include "formats.h"

namespace bsgl {

// Calls f(std::integral_constant<int, R>{}, m) over [0, rows) in tiles of R rows: as many of MR
// as fit, then halves (a remainder of 7 under MR = 8 goes as 4, 2, 1). A row's result does not
// depend on its tile, so this only decides how many rows share each decoded block.
template <int MR, typename F>
inline void by_row_tiles(int64_t rows, F&& f, int64_t first = 0) {
  int64_t m = first;
  for (; m + MR <= rows; m += MR) f(std::integral_constant<int, MR>{}, m);
  if constexpr (MR > 1) {
    if (m < rows) by_row_tiles<MR / 2>(rows, f, m);
  }
}

struct Weight {
  int type = kF32;
  int64_t n = 0, k = 0, stride = 0;  // stride: bytes from one row to the next
  // Rows stored in groups of sixteen (int8_groups.h): stride is then the bytes from one group to
  // the next, and only product_grouped and dequantize_row read the weight (row() does not apply).
  bool grouped = false;
  const uint8_t* data = nullptr;
  const float* bias = nullptr;  // [n] or null
  const uint8_t* row(int64_t i) const { return data + i * stride; }
};

// Weights in groups of sixteen rows (Q8_0, Q4_0, Q4_1, Q4_K): for each block (Q4_K's 256-value
// super-block), the sixteen rows' fields side by side: their halves (d, and Q4_1's m or Q4_K's
// dmin), sixteen of each, then the rest of the block as 64-byte vectors, vector v holding bytes
// 4v..4v+3 of each row's rest (row c in bytes 4c..4c+3; Q4_K: three vectors of scales, then 32 of
// nibbles). The same bytes as stored, rearranged for int8_groups.h's products.
constexpr int64_t kGroupRows = 16;
constexpr bool groupable(int type) { return type == kQ8_0 || type == kQ4_0 || type == kQ4_1 || type == kQ4_K; }
constexpr int64_t group_halves(int type) { return type == kQ4_1 || type == kQ4_K ? 2 : 1; }
constexpr int64_t group_header_bytes(int type) { return kGroupRows * 2 * group_halves(type); }

// Row i of a grouped weight as GGUF stores it, into out (row_bytes(w.type, w.k) bytes).
inline void ungroup_row(const Weight& w, int64_t i, uint8_t* out) {
  const int64_t bb = block_bytes(w.type), halves = group_halves(w.type), c = i % kGroupRows;
  const uint8_t* group = w.data + i / kGroupRows * w.stride;
  for (int64_t b = 0; b < w.k / block_values(w.type); ++b) {
    const uint8_t* blk = group + b * kGroupRows * bb;
    uint8_t* o = out + b * bb;
    for (int64_t f = 0; f < halves; ++f) std::memcpy(o + 2 * f, blk + f * 2 * kGroupRows + 2 * c, 2);
    const uint8_t* rest = blk + group_header_bytes(w.type);
    for (int64_t v = 0; v < (bb - 2 * halves) / 4; ++v) std::memcpy(o + 2 * halves + 4 * v, rest + 64 * v + 4 * c, 4);
  }
}

// A block's partial sums into one vector: adjacent pairs, then pairs of pairs.
inline fv fold(const fv* a) {
  if constexpr (kBlockVecs == 2) return a[0] + a[1];
  else if constexpr (kBlockVecs == 4) return (a[0] + a[1]) + (a[2] + a[3]);
  else return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

template <int T>
inline float decode_one(const uint8_t* row, int64_t i) {
  if constexpr (T == kF32) return reinterpret_cast<const float*>(row)[i];
  else if constexpr (T == kBF16) return bf16_to_float(reinterpret_cast<const uint16_t*>(row)[i]);
  else {
    fv w[kBlockVecs];
    decode_block<T>(row, i / 32, w);
    return w[(i % 32) / kLanes][i % kLanes];
  }
}

template <int T>
void dequantize_row_t(const uint8_t* row, int64_t k, float* out) {
  for_each_block<T>(row, k / 32, [&](int64_t b, const fv* w) {
    for (int i = 0; i < kBlockVecs; ++i) storev(out + 32 * b + kLanes * i, w[i]);
  });
  for (int64_t i = k / 32 * 32; i < k; ++i) out[i] = decode_one<T>(row, i);
}

// out[m * ldo + j] = x[m] . w.row(j) (+ bias) for MR activation rows, which share each block's
// decoding; x is float32 with row stride ldx. Each output keeps kLanes partial sums per vector of
// the block, folded and summed in a fixed order at the end. One weight row at a time: reading two rows side by
// side (two streams a row apart) ran at a quarter of the memory bandwidth (Q8_0, 2-core Zen 5).
// Flattened: GCC left a K-quant row's unrolled super-block loop (for_each_block) a call of its own,
// the accumulators passing through memory at every block.
template <int T, int MR>
__attribute__((flatten)) inline void tile(const Weight& w, int64_t j, const float* x, int64_t ldx, float* out, int64_t ldo) {
  const int64_t blocks = w.k / 32;
  fv acc[MR][kBlockVecs] = {};
  const uint8_t* row = w.row(j);
  for_each_block<T>(row, blocks, [&](int64_t b, const fv* wv) {
    for (int m = 0; m < MR; ++m)
      for (int i = 0; i < kBlockVecs; ++i) acc[m][i] = fmadd(wv[i], loadv(x + m * ldx + 32 * b + kLanes * i), acc[m][i]);
  });
  for (int m = 0; m < MR; ++m) {
    float s = hsum(fold(acc[m]));
    for (int64_t i = 32 * blocks; i < w.k; ++i) s += decode_one<T>(row, i) * x[m * ldx + i];  // dense tails
    out[m * ldo + j] = w.bias ? s + w.bias[j] : s;
  }
}

// Activation rows per tile, by register file: AVX-512's 32 registers take 4 (8 rows ran Q8_0
// 576 -> 49152 at 133 GFLOP/s against 200 for 4), AVX2's 16 take 2, SSE's 16 narrower ones 1.
constexpr int kMR = kLanes == 16 ? 4 : kLanes == 8 ? 2 : 1;

// x [rows, k] (row stride ldx) times w's rows n0..n1-1 into out [rows, n] (row stride ldo).
inline void matmul(const Weight& w, const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo, int64_t n0,
                   int64_t n1) {
  with_format(w.type, [&](auto t) {
    by_row_tiles<kMR>(rows, [&](auto mr, int64_t m) {
      for (int64_t j = n0; j < n1; ++j) tile<decltype(t)::value, decltype(mr)::value>(w, j, x + m * ldx, ldx, out + m * ldo, ldo);
    });
  });
}

// Products with many activation rows (a prefill, a large decode batch). The tiles above decode
// each block once per MR rows, so a 1000-row product would decode every matrix 250 times and
// re-read it from memory as often. Here a panel of weight rows is decoded once into a buffer the
// core's L2 holds, and every activation row is multiplied with it, MR rows by NR weight rows at a
// time: the same decoded values, the same partial sums per output in the same order and the same
// final sum as tile(), so the results are the tiles' bits (a request's output still does not
// depend on the size of its batch). Whole blocks only (k a multiple of 32).
//
// A tile's sums are taken one vector position of the block at a time: partial sum v of every
// output (lanes v * kLanes.. of each block, over the blocks in order) before partial sum v + 1.
// Each partial sum meets the same products in the same order as in tile(), but only MR x NR of
// them are live at once instead of MR x NR x kBlockVecs, so the tile is larger and each loaded
// vector feeds more FMAs: 4 x 3 on AVX2 (7 loads per 12 FMAs, where taking every partial sum at
// once fitted 3 x 1: 4 loads per 3 FMAs). The blocks go in chunks of at most 16 (the tile's rows
// of a chunk stay in L1 while each partial sum passes over them), the partial sums kept in
// memory between chunks. One thread on a 2-core Zen 3, Q4_1 panels of 60 rows times 96 rows:
// 2.1x (k = 576) and 1.6x (k = 1536) the old tile, ~60% of its FMA peak. AVX-512 builds take
// 4 x 4 (8 loads per 16 FMAs, where the old tile took 4 x 2 with 6 per 8): not yet measured.
constexpr int kPanelMR = 4;
constexpr int kPanelNR = kLanes == 16 ? 4 : 3;  // 16 or 12 accumulators

// Weight rows per panel: at most 64, and about 384 KB of them.
inline int64_t panel_rows(int64_t k, int64_t elem_bytes, int nr) {
  const int64_t fit = 384 * 1024 / (k * elem_bytes);
  return std::max<int64_t>(nr, std::min<int64_t>(64, fit) / nr * nr);
}

// Keeps v in a register: GCC otherwise folds a tile's loads into its FMAs as memory operands,
// loading each weight vector once per activation row (16 loads per 12 FMAs on AVX2, not 7).
inline void in_register(fv& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__SSE__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

template <int MR, int NR>
inline void panel_tile(const float* wp, int64_t ldw, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo,
                       const float* bias) {
  fv part[MR][NR][kBlockVecs] = {};
  const int64_t blocks = k / 32, chunks = (blocks + 15) / 16;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = 32 * (blocks * (c + 1) / chunks);
    for (int v = 0; v < kBlockVecs; ++v) {
      fv acc[MR][NR];
      for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r) acc[m][r] = c ? part[m][r][v] : fv{};
      for (int64_t i = 32 * (blocks * c / chunks) + kLanes * v; i < end; i += 32) {
        fv wv[NR];
        for (int r = 0; r < NR; ++r) {
          wv[r] = loadv(wp + r * ldw + i);
          in_register(wv[r]);
        }
        for (int m = 0; m < MR; ++m) {
          fv xv = loadv(x + m * ldx + i);
          in_register(xv);
          for (int r = 0; r < NR; ++r) acc[m][r] = fmadd(wv[r], xv, acc[m][r]);
        }
      }
      for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r) part[m][r][v] = acc[m][r];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      const float s = hsum(fold(part[m][r]));
      out[m * ldo + r] = bias ? s + bias[r] : s;
    }
}

// Calls f(panel, ldw, j0, np) for panels of w's rows n0..n1-1 as Elem (float, or bfloat16 bits):
// stored rows of that type are used in place, others are decoded by decode(row, k, dst). A panel
// holds `rows` weight rows (0: panel_rows' choice, a multiple of nr).
template <typename Elem, int T, typename Decode, typename F>
inline void by_panels(const Weight& w, int64_t n0, int64_t n1, int nr, Decode&& decode, F&& f, int64_t rows = 0) {
  constexpr bool in_place = std::is_same_v<Elem, float> ? T == kF32 : T == kBF16;
  if (rows == 0) rows = panel_rows(w.k, sizeof(Elem), nr);
  thread_local AlignedBuffer<Elem> buf;
  if (!in_place) buf.reserve(rows * w.k);
  for (int64_t j0 = n0; j0 < n1; j0 += rows) {
    const int64_t np = std::min(rows, n1 - j0);
    if constexpr (in_place) {
      f(reinterpret_cast<const Elem*>(w.row(j0)), w.stride / static_cast<int64_t>(sizeof(Elem)), j0, np);
    } else {
      for (int64_t r = 0; r < np; ++r) decode(w.row(j0 + r), w.k, buf.data() + r * w.k);
      f(static_cast<const Elem*>(buf.data()), w.k, j0, np);
    }
  }
}

// matmul() for many rows: the same results.
inline void matmul_panels(const Weight& w, const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo,
                          int64_t n0, int64_t n1) {
  with_format(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    by_panels<float, T>(w, n0, n1, kPanelNR, dequantize_row_t<T>, [&](const float* wp, int64_t ldw, int64_t j0, int64_t np) {
      by_row_tiles<kPanelMR>(rows, [&](auto mr, int64_t m) {
        constexpr int MR = decltype(mr)::value;
        const float* xm = x + m * ldx;
        float* om = out + m * ldo + j0;
        int64_t r = 0;
        for (; r + kPanelNR <= np; r += kPanelNR)
          panel_tile<MR, kPanelNR>(wp + r * ldw, ldw, w.k, xm, ldx, om + r, ldo, w.bias ? w.bias + j0 + r : nullptr);
        for (; r < np; ++r) panel_tile<MR, 1>(wp + r * ldw, ldw, w.k, xm, ldx, om + r, ldo, w.bias ? w.bias + j0 + r : nullptr);
      });
    });
  });
}

// bfloat16 products: on CPUs with AVX512_BF16, a batch computed in bfloat16 (the engine's dtype)
// multiplies with vdpbf16ps, 32 products per instruction against 16 for float32 FMAs. The
// block is widened as above, rounded to bfloat16 pairs, and multiplied with the activations
// rounded to bfloat16 once per product (what torch's bfloat16 GEMM computes), accumulating in
// float32. Eight activation rows share each decoded block: a decode batch of 32 was compute-
// bound in the float32 kernel (~230 GFLOP/s on a 2-core Zen 5).
#if defined(__AVX512BF16__)
constexpr bool kHasBF16Products = true;
constexpr int kBF16MR = 8;

// x [rows, k] float32 -> bfloat16 (round to nearest even), k a multiple of 16.
inline void to_bf16_rows(const float* x, int64_t ldx, int64_t rows, int64_t k, uint16_t* out) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < k; i += 16) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + m * ldx + i));
      std::memcpy(out + m * k + i, &v, 32);
    }
}

template <int T, int MR>
__attribute__((flatten)) inline void tile_bf16(const Weight& w, int64_t j, const uint16_t* xb, float* out, int64_t ldo) {
  const int64_t blocks = w.k / 32;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* row = w.row(j);
  for_each_block<T>(row, blocks, [&](int64_t b, const fv* wv) {
    __m512 lo, hi;
    std::memcpy(&lo, &wv[0], 64);
    std::memcpy(&hi, &wv[1], 64);
    const __m512bh pairs = _mm512_cvtne2ps_pbh(hi, lo);  // values 0..31 of the block, in order
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = _mm512_loadu_si512(xb + m * w.k + 32 * b);
      __m512bh xp;
      std::memcpy(&xp, &xv, 64);
      acc[m] = _mm512_dpbf16_ps(acc[m], pairs, xp);
    }
  });
  for (int m = 0; m < MR; ++m) {
    const float s = _mm512_reduce_add_ps(acc[m]);
    out[m * ldo + j] = w.bias ? s + w.bias[j] : s;
  }
}

// xb: the activations already rounded by to_bf16_rows ([rows, k]); w.k a multiple of 32.
inline void matmul_bf16(const Weight& w, const uint16_t* xb, int64_t rows, float* out, int64_t ldo, int64_t n0,
                        int64_t n1) {
  with_format(w.type, [&](auto t) {
    by_row_tiles<kBF16MR>(rows, [&](auto mr, int64_t m) {
      for (int64_t j = n0; j < n1; ++j) tile_bf16<decltype(t)::value, decltype(mr)::value>(w, j, xb + m * w.k, out + m * ldo, ldo);
    });
  });
}

// matmul_bf16() for many rows, by panels as matmul_panels(): the same results.
constexpr int kBF16PanelMR = 8, kBF16PanelNR = 2;

// A row's blocks rounded to bfloat16, in order: the pairs tile_bf16() multiplies.
template <int T>
inline void decode_row_bf16(const uint8_t* row, int64_t k, uint16_t* dst) {
  for_each_block<T>(row, k / 32, [&](int64_t b, const fv* wv) {
    __m512 lo, hi;
    std::memcpy(&lo, &wv[0], 64);
    std::memcpy(&hi, &wv[1], 64);
    const __m512bh pairs = _mm512_cvtne2ps_pbh(hi, lo);
    std::memcpy(dst + 32 * b, &pairs, 64);
  });
}

template <int MR, int NR>
inline void panel_tile_bf16(const uint16_t* wp, int64_t ldw, int64_t k, const uint16_t* xb, int64_t ldx, float* out,
                            int64_t ldo, const float* bias) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    __m512bh wv[NR];
    for (int r = 0; r < NR; ++r) {
      const __m512i v = _mm512_loadu_si512(wp + r * ldw + i);
      std::memcpy(&wv[r], &v, 64);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i v = _mm512_loadu_si512(xb + m * ldx + i);
      __m512bh xp;
      std::memcpy(&xp, &v, 64);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xp);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      const float s = _mm512_reduce_add_ps(acc[m][r]);
      out[m * ldo + r] = bias ? s + bias[r] : s;
    }
}

inline void matmul_bf16_panels(const Weight& w, const uint16_t* xb, int64_t rows, float* out, int64_t ldo, int64_t n0,
                               int64_t n1) {
  with_format(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    by_panels<uint16_t, T>(w, n0, n1, kBF16PanelNR, decode_row_bf16<T>,
                           [&](const uint16_t* wp, int64_t ldw, int64_t j0, int64_t np) {
      by_row_tiles<kBF16PanelMR>(rows, [&](auto mr, int64_t m) {
        constexpr int MR = decltype(mr)::value;
        const uint16_t* xm = xb + m * w.k;
        float* om = out + m * ldo + j0;
        int64_t r = 0;
        for (; r + kBF16PanelNR <= np; r += kBF16PanelNR)
          panel_tile_bf16<MR, kBF16PanelNR>(wp + r * ldw, ldw, w.k, xm, w.k, om + r, ldo, w.bias ? w.bias + j0 + r : nullptr);
        for (; r < np; ++r)
          panel_tile_bf16<MR, 1>(wp + r * ldw, ldw, w.k, xm, w.k, om + r, ldo, w.bias ? w.bias + j0 + r : nullptr);
      });
    });
  });
}
#else
constexpr bool kHasBF16Products = false;
#endif

inline void dequantize_row(const Weight& w, int64_t i, float* out) {
  thread_local std::vector<uint8_t> ungrouped;  // a grouped row put back as stored
  if (w.grouped) {
    ungrouped.resize(row_bytes(w.type, w.k));
    ungroup_row(w, i, ungrouped.data());
  }
  const uint8_t* row = w.grouped ? ungrouped.data() : w.row(i);
  with_format(w.type, [&](auto t) { dequantize_row_t<decltype(t)::value>(row, w.k, out); });
}

// Rows from which a product goes by panels (both ways give the same bits). AVX-512: with 8 rows
// the panels ran at 0.7-0.9x the tiles, with 16 at 1.0-1.3x, with 32 at 1.0-1.4x (2-core Zen 5,
// Q4_1, before the panels' 4 x 3 tiles). AVX2 (2-core Zen 3, default model's decode step, the
// step's product time): 8 rows 0.62-0.9x the tiles' time, 12 rows 0.7-0.8x, 4 and 6 rows no gain.
constexpr int64_t kPanelMinRows = kLanes == 16 ? 16 : 8;

// x [rows, k] (float32, row stride ldx) times w's rows n0..n1-1 into out [rows, n] (row stride ldo).
inline void product(const Weight& w, const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo, int64_t n0,
                    int64_t n1) {
  if (rows >= kPanelMinRows && w.k % 32 == 0) matmul_panels(w, x, ldx, rows, out, ldo, n0, n1);
  else matmul(w, x, ldx, rows, out, ldo, n0, n1);
}

#if defined(__AVX512BF16__)
// The same with bfloat16 products; xb [rows, k] holds the activations as bfloat16, k % 32 == 0.
inline void product_bf16(const Weight& w, const uint16_t* xb, int64_t rows, float* out, int64_t ldo, int64_t n0,
                         int64_t n1) {
  if (rows >= kPanelMinRows) matmul_bf16_panels(w, xb, rows, out, ldo, n0, n1);
  else matmul_bf16(w, xb, rows, out, ldo, n0, n1);
}
#endif

// Thread tid's share of n outputs.
inline void split_range(int64_t n, int tid, int nthreads, int64_t& begin, int64_t& end) {
  begin = n * tid / nthreads;
  end = n * (tid + 1) / nthreads;
}

}  // namespace bsgl
