// Float32 products of many activation rows through the BLAS torch is built with (MKL's sgemm),
// outside the deterministic mode.
//
// weights.h's panels keep every output one dot product in a fixed order (the same bits in a
// batch of one row as in a prefill of a thousand), which ties them to dot-product tiles: each
// FMA meets one activation row and one weight row, partial sums folded and summed at the end. On
// a 2-core EPYC (Zen 3) they ran a 544-row prefill's Q4_1 products at ~85 GFLOP/s where torch's
// float32 GEMM ran the same matrices dequantized at ~135. Here a panel of 128 weight rows is
// dequantized into a buffer the thread owns and multiplied by MKL's sgemm on that thread alone:
// the default model's prefill of 4 x 544 tokens took 4.2 s in the products instead of 6.9, a
// batch-32 decode round 111 ms instead of 144, batch 16 69 instead of 74; at 12 rows the two
// were level and at 8 the panels were faster (43.5 against 45.9 ms), hence kBlasMinRows.
//
// The sums' order is then MKL's, which can differ from the tiles' (the greedy tests still give
// transformers' ids): a request's result may depend on the number of rows it was computed with,
// as in SGLang and vLLM; the deterministic mode keeps the panels. It does not depend on the
// threads: panels start at fixed multiples of kBlasPanel columns and a thread claims whole
// panels, so every sgemm call is the same whoever makes it.
#pragma once

#include <ATen/Config.h>

#include "weights.h"

#if AT_MKL_ENABLED()
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c, const int* ldc);
int MKL_Set_Num_Threads_Local(int n);
}
#endif

namespace bsgl {

#if AT_MKL_ENABLED()
constexpr bool kHasBlasProducts = true;
#else
constexpr bool kHasBlasProducts = false;
#endif
constexpr int64_t kBlasMinRows = 16, kBlasPanel = 128;

// x [rows, k] (float32, row stride k) times w's rows n0..n1-1 into out [rows, n] (row stride
// ldo), n0 a multiple of kBlasPanel; w.k a multiple of 32; w not in groups (int8_groups.h).
inline void product_blas(const Weight& w, const float* x, int64_t rows, float* out, int64_t ldo, int64_t n0,
                         int64_t n1) {
#if AT_MKL_ENABLED()
  const int before = MKL_Set_Num_Threads_Local(1);  // this thread alone: the step's threads share the columns
  with_format(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    by_panels<float, T>(w, n0, n1, 1, dequantize_row_t<T>, [&](const float* wp, int64_t ldw, int64_t j0, int64_t np) {
      // Column-major terms: out^T [np, rows] = panel [k, np]^T x^T [k, rows].
      const char ta = 'T', tb = 'N';
      const int m = static_cast<int>(np), n = static_cast<int>(rows), k = static_cast<int>(w.k);
      const int lda = static_cast<int>(ldw), ldb = k, ldc = static_cast<int>(ldo);
      const float one = 1.f, zero = 0.f;
      sgemm_(&ta, &tb, &m, &n, &k, &one, wp, &lda, x, &ldb, &zero, out + j0, &ldc);
      if (w.bias)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t i = 0; i < np; ++i) out[r * ldo + j0 + i] += w.bias[j0 + i];
    }, kBlasPanel);
  });
  MKL_Set_Num_Threads_Local(before);
#else
  (void)w, (void)x, (void)rows, (void)out, (void)ldo, (void)n0, (void)n1;
#endif
}

}  // namespace bsgl
