// bfloat16 products of many activation rows on the CPU's matrix tiles (AMX), for a bfloat16
// model: batched decode and prefill.
//
// AMX multiplies 16 x 32 bfloat16 tiles, 1024 products a cycle against 32 for an AVX512_BF16
// dot product (torch's bfloat16 GEMM, oneDNN's AMX kernels, measured 2.3 TFLOP/s on a 2-core
// Xeon VM where our vdpbf16ps products reached ~0.27). Here a panel of kTilePanel weight rows
// is decoded to bfloat16 in buffers the thread owns (never the whole weight: for 32 rows of
// 2048 values, two buffers of 128 KB, in L2), its pairs of values transposed into the layout the
// tiles multiply (pack_pairs), and every block of activation rows is multiplied by it with
// torch's batch-reduce GEMM (cpublas::brgemm: oneDNN's AMX micro-kernel, which configures the
// tiles), accumulating in float32 straight into out.
//
// Whether the CPU has them is asked once, of the CPU and the kernel (has_tile_products), never of
// a stopwatch; a refusal leaves the other products. Without AMX the same code hands the
// unpacked panel to brgemm, which runs torch's own bfloat16 GEMM: --cpu-matrix-tiles on takes
// it on any CPU, so the tests run this path (its panels, tails and epilogue, and the step's
// claims of whole panels) everywhere; auto takes it only where AMX is there.
//
// The sums' order is oneDNN's: like the BLAS products, outside the deterministic mode.
// kTileMinRows is the crossover the sources report (IPEX and the vendors' notes switch from
// VNNI to AMX at 32 rows), not yet measured on an AMX CPU.
#pragma once

#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <vector>

#include "weights.h"

namespace bsgl {

constexpr int64_t kTileMinRows = 32, kTilePanel = 32, kTileRowBlock = 64;

// The process asks the kernel for the tiles' state first (arch_prctl, torch's init_amx: CPUID's
// AMX bits, then the permission, which the kernel may refuse), then whether oneDNN would run its
// AMX kernels (its own view of the CPU and the OS's XSAVE state).
inline bool has_tile_products() {
  static const bool has = at::cpu::init_amx() && at::native::cpublas::could_pack(at::kBFloat16);
  return has;
}

// A stored row as bfloat16 values (rounded to nearest even, as torch rounds).
template <int T>
inline void decode_row_to_bf16(const uint8_t* row, int64_t k, uint16_t* dst) {
  if constexpr (T == kBF16) {
    std::memcpy(dst, row, k * sizeof(uint16_t));
  } else {
#if defined(__AVX512BF16__)
    decode_row_bf16<T>(row, k, dst);
#else
    thread_local std::vector<float> values;
    values.resize(k);
    dequantize_row_t<T>(row, k, values.data());
    for (int64_t i = 0; i < k; ++i) dst[i] = float_to_bf16(values[i]);
#endif
  }
}

// x [rows, k] float32 (row stride ldx) -> bfloat16 bits [rows, k], rounded to nearest even.
inline void rows_to_bf16(const float* x, int64_t ldx, int64_t rows, int64_t k, uint16_t* out) {
#if defined(__AVX512BF16__)
  if (k % 16 == 0) return to_bf16_rows(x, ldx, rows, k, out);
#endif
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < k; ++i) out[m * k + i] = float_to_bf16(x[m * ldx + i]);
}

// kTilePanel rows of bfloat16 values (row r at rows + r * k) as the tiles' right-hand operand,
// [k / 2][kTilePanel][2]: the pair of values 2p, 2p + 1 of row r in 32-bit word p * kTilePanel + r
// (the layout oneDNN's packing of a [k, kTilePanel] matrix gives for AMX, checked at start:
// own_pairs_match). A transpose of 32-bit words, eight by eight with AVX2.
inline void pack_pairs(const uint16_t* rows, int64_t k, uint16_t* out) {
  const int64_t words = k / 2;  // a multiple of 16
#if defined(__AVX2__)
  for (int64_t r0 = 0; r0 < kTilePanel; r0 += 8)
    for (int64_t p0 = 0; p0 < words; p0 += 8) {
      __m256i v[8];
      for (int c = 0; c < 8; ++c) v[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + (r0 + c) * k + 2 * p0));
      transpose8_epi32(v);
      for (int q = 0; q < 8; ++q)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * ((p0 + q) * kTilePanel + r0)), v[q]);
    }
#else
  for (int64_t p = 0; p < words; ++p)
    for (int64_t r = 0; r < kTilePanel; ++r) std::memcpy(out + 2 * (p * kTilePanel + r), rows + r * k + 2 * p, 4);
#endif
}

// The same operand unpacked, [k][kTilePanel]: what brgemm multiplies without AMX, and what
// oneDNN's own packing starts from.
inline void unpack_pairs(const uint16_t* pairs, int64_t k, uint16_t* out) {
  for (int64_t i = 0; i < k; ++i)
    for (int64_t r = 0; r < kTilePanel; ++r) out[i * kTilePanel + r] = pairs[2 * ((i / 2) * kTilePanel + r) + i % 2];
}

// Whether pack_pairs lays a panel out as oneDNN's packing does on this machine (asked once, where
// the tiles run): if not, every panel goes through oneDNN's packing, from unpack_pairs' matrix.
inline bool own_pairs_match() {
  constexpr int64_t k = 64;
  std::vector<uint16_t> rows(kTilePanel * k), ours(k * kTilePanel), plain(k * kTilePanel), theirs(k * kTilePanel);
  for (int64_t i = 0; i < kTilePanel * k; ++i) rows[i] = float_to_bf16(static_cast<float>(i % 509) - 254.f);
  pack_pairs(rows.data(), k, ours.data());
  unpack_pairs(ours.data(), k, plain.data());
  at::native::cpublas::pack(k, kTilePanel, kTilePanel, kTilePanel, at::kBFloat16, at::kBFloat16, plain.data(),
                            theirs.data());
  return ours == theirs;
}

// xb [rows, k] (bfloat16 bits, row stride k) times w's rows n0..n1-1 into out [rows, n] (float32,
// row stride ldo); w.k a multiple of 32 (a tile's depth: the pairs need no padding). A weight in
// groups of sixteen rows (int8_groups.h) is read a row at a time as stored.
inline void product_tiles(const Weight& w, const uint16_t* xb, int64_t rows, float* out, int64_t ldo, int64_t n0,
                          int64_t n1) {
  namespace blas = at::native::cpublas;
  const bool packed = has_tile_products();
  static const bool own_pairs = packed && own_pairs_match();
  const int64_t k = w.k;
  thread_local AlignedBuffer<uint16_t> rowwise, pairs, plain;
  thread_local std::vector<uint8_t> ungrouped;  // a grouped row put back as stored
  if (w.grouped) ungrouped.resize(row_bytes(w.type, k));
  rowwise.reserve(kTilePanel * k);
  pairs.reserve(k * kTilePanel);
  if (!own_pairs) plain.reserve(k * kTilePanel);
  const auto* a = reinterpret_cast<const at::BFloat16*>(xb);
  with_format(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    for (int64_t j0 = n0; j0 < n1; j0 += kTilePanel) {
      const int64_t np = std::min(kTilePanel, n1 - j0);
      for (int64_t r = 0; r < np; ++r) {
        if (w.grouped) ungroup_row(w, j0 + r, ungrouped.data());
        decode_row_to_bf16<T>(w.grouped ? ungrouped.data() : w.row(j0 + r), k, rowwise.data() + r * k);
      }
      if (np < kTilePanel) std::memset(rowwise.data() + np * k, 0, (kTilePanel - np) * k * sizeof(uint16_t));
      pack_pairs(rowwise.data(), k, pairs.data());
      const uint16_t* b = pairs.data();
      if (!own_pairs) {  // without AMX the plain matrix; with it, oneDNN's packing of that
        unpack_pairs(pairs.data(), k, plain.data());
        if (packed) blas::pack(k, kTilePanel, kTilePanel, kTilePanel, at::kBFloat16, at::kBFloat16, plain.data(),
                               pairs.data());
        else b = plain.data();
      }
      for (int64_t m = 0; m < rows; m += kTileRowBlock) {
        const int64_t mb = std::min(kTileRowBlock, rows - m);
        blas::brgemm(mb, np, k, k, kTilePanel, ldo, /*add_C=*/false, a + m * k,
                     reinterpret_cast<const at::BFloat16*>(b), out + m * ldo + j0, packed);
      }
      if (w.bias)
        for (int64_t m = 0; m < rows; ++m)
          for (int64_t r = 0; r < np; ++r) out[m * ldo + j0 + r] += w.bias[j0 + r];
    }
  });
  if (packed) blas::brgemm_release();  // the tiles' state, before other code runs on this thread
}

}  // namespace bsgl
