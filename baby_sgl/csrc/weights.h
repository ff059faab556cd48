// Weight matrices as they are stored, and their products with float32 activations.
//
// A weight is N rows of K values, each row a run of 32-value blocks: plain float32 or bfloat16,
// or one of GGUF's block formats, which stay quantized in memory:
//   Q8_0: half d, 32 x int8 q          value = d * q
//   Q4_0: half d, 16 bytes of nibbles  value = d * (q - 8)
//   Q4_1: half d, half m, 16 bytes     value = d * q + m
// (in a nibble block byte j holds value j in its low half and value j + 16 in its high half).
// A block is widened to float32 in registers and multiplied there: nothing full-precision is
// ever written out, and the products accumulate in float32. Each output is one dot product
// whose order of operations is fixed (two 16-lane partial sums over the blocks, then a fixed
// tree), whatever the number of rows computed with it: a request's result does not depend on
// the batch it is in.
#pragma once

#include "vec.h"

namespace bsgl {

enum WeightType : int { kF32 = 0, kBF16 = 1, kQ8_0 = 2, kQ4_0 = 3, kQ4_1 = 4 };

inline int64_t row_bytes(int type, int64_t k) {
  switch (type) {
    case kF32: return 4 * k;
    case kBF16: return 2 * k;
    case kQ8_0: return k / 32 * 34;
    case kQ4_0: return k / 32 * 18;
    case kQ4_1: return k / 32 * 20;
  }
  return -1;
}

// Calls f(std::integral_constant<int, T>{}) for the weight format T: one switch for every kernel.
template <typename F>
inline void with_format(int type, F&& f) {
  switch (type) {
    case kF32: return f(std::integral_constant<int, kF32>{});
    case kBF16: return f(std::integral_constant<int, kBF16>{});
    case kQ8_0: return f(std::integral_constant<int, kQ8_0>{});
    case kQ4_0: return f(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int, kQ4_1>{});
  }
}

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
  const uint8_t* data = nullptr;
  const float* bias = nullptr;  // [n] or null
  const uint8_t* row(int64_t i) const { return data + i * stride; }
};

inline uint16_t read_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// 16 bytes of nibbles: the low halves are values 0..15 of the block, the high halves 16..31.
inline void nibbles(const uint8_t* p, f16v& lo, f16v& hi) {
  const i16v v = widen(p);
  lo = to_float(v & 0x0f);
  hi = to_float(v >> 4);
}

// Block b of a row as two vectors: values 32b..32b+15 and 32b+16..32b+31.
template <int T>
inline void decode_block(const uint8_t* row, int64_t b, f16v& w0, f16v& w1) {
  if constexpr (T == kF32) {
    const float* p = reinterpret_cast<const float*>(row) + 32 * b;
    w0 = load16(p);
    w1 = load16(p + 16);
  } else if constexpr (T == kBF16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + 32 * b;
    w0 = load_bf16x16(p);
    w1 = load_bf16x16(p + 16);
  } else if constexpr (T == kQ8_0) {
    const uint8_t* p = row + 34 * b;
    const f16v d = splat(half_to_float(read_u16(p)));
    w0 = to_float(widen(reinterpret_cast<const int8_t*>(p + 2))) * d;
    w1 = to_float(widen(reinterpret_cast<const int8_t*>(p + 18))) * d;
  } else if constexpr (T == kQ4_0) {
    const uint8_t* p = row + 18 * b;
    const f16v d = splat(half_to_float(read_u16(p)));
    nibbles(p + 2, w0, w1);
    w0 = (w0 - 8.f) * d;
    w1 = (w1 - 8.f) * d;
  } else {
    const uint8_t* p = row + 20 * b;
    float d, m;
    half2_to_float(p, d, m);
    nibbles(p + 4, w0, w1);
    w0 = w0 * splat(d) + splat(m);
    w1 = w1 * splat(d) + splat(m);
  }
}

template <int T>
inline float decode_one(const uint8_t* row, int64_t i) {
  if constexpr (T == kF32) return reinterpret_cast<const float*>(row)[i];
  else if constexpr (T == kBF16) return bf16_to_float(reinterpret_cast<const uint16_t*>(row)[i]);
  else {
    f16v w0, w1;
    decode_block<T>(row, i / 32, w0, w1);
    return (i % 32) < 16 ? w0[i % 16] : w1[i % 16];
  }
}

// out[m * ldo + j] = x[m] . w.row(j) (+ bias) for MR activation rows, which share each block's
// decoding; x is float32 with row stride ldx. One weight row at a time: reading two rows side by
// side (two streams a row apart) ran at a quarter of the memory bandwidth (Q8_0, 2-core Zen 5).
template <int T, int MR>
inline void tile(const Weight& w, int64_t j, const float* x, int64_t ldx, float* out, int64_t ldo) {
  const int64_t blocks = w.k / 32;
  f16v acc0[MR] = {}, acc1[MR] = {};
  const uint8_t* row = w.row(j);
  for (int64_t b = 0; b < blocks; ++b) {
    f16v w0, w1;
    decode_block<T>(row, b, w0, w1);
    for (int m = 0; m < MR; ++m) {
      acc0[m] += w0 * load16(x + m * ldx + 32 * b);
      acc1[m] += w1 * load16(x + m * ldx + 32 * b + 16);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float s = hsum(acc0[m] + acc1[m]);
    for (int64_t i = 32 * blocks; i < w.k; ++i) s += decode_one<T>(row, i) * x[m * ldx + i];  // dense tails
    out[m * ldo + j] = w.bias ? s + w.bias[j] : s;
  }
}

// Activation rows per tile: with AVX-512's 32 registers, 4 (8 rows ran Q8_0 576 -> 49152 at 133
// GFLOP/s against 200 for 4); with 16 registers, where a 16-float vector takes two, 2.
#if defined(__AVX512F__)
constexpr int kMR = 4;
#else
constexpr int kMR = 2;
#endif

// x [rows, k] (row stride ldx) times w's rows n0..n1-1 into out [rows, n] (row stride ldo).
inline void matmul(const Weight& w, const float* x, int64_t ldx, int64_t rows, float* out, int64_t ldo, int64_t n0,
                   int64_t n1) {
  with_format(w.type, [&](auto t) {
    by_row_tiles<kMR>(rows, [&](auto mr, int64_t m) {
      for (int64_t j = n0; j < n1; ++j) tile<decltype(t)::value, decltype(mr)::value>(w, j, x + m * ldx, ldx, out + m * ldo, ldo);
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
inline void tile_bf16(const Weight& w, int64_t j, const uint16_t* xb, float* out, int64_t ldo) {
  const int64_t blocks = w.k / 32;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* row = w.row(j);
  for (int64_t b = 0; b < blocks; ++b) {
    f16v w0, w1;
    decode_block<T>(row, b, w0, w1);
    __m512 lo, hi;
    std::memcpy(&lo, &w0, 64);
    std::memcpy(&hi, &w1, 64);
    const __m512bh pairs = _mm512_cvtne2ps_pbh(hi, lo);  // values 0..31 of the block, in order
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = _mm512_loadu_si512(xb + m * w.k + 32 * b);
      __m512bh xp;
      std::memcpy(&xp, &xv, 64);
      acc[m] = _mm512_dpbf16_ps(acc[m], pairs, xp);
    }
  }
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
#else
constexpr bool kHasBF16Products = false;
#endif

template <int T>
void dequantize_row_t(const uint8_t* row, int64_t k, float* out) {
  int64_t b = 0;
  for (; 32 * (b + 1) <= k; ++b) {
    f16v w0, w1;
    decode_block<T>(row, b, w0, w1);
    store16(out + 32 * b, w0);
    store16(out + 32 * b + 16, w1);
  }
  for (int64_t i = 32 * b; i < k; ++i) out[i] = decode_one<T>(row, i);
}

inline void dequantize_row(const Weight& w, int64_t i, float* out) {
  with_format(w.type, [&](auto t) { dequantize_row_t<decltype(t)::value>(w.row(i), w.k, out); });
}

// Thread tid's share of n outputs.
inline void split_range(int64_t n, int tid, int nthreads, int64_t& begin, int64_t& end) {
  begin = n * tid / nthreads;
  end = n * (tid + 1) / nthreads;
}

}  // namespace bsgl
