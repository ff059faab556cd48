// The ops the Python path calls on CPU (prefill and mixed passes, and decode where the one-call
// step does not run): the linear layer over stored (possibly quantized) weights, row lookups of
// them, RMSNorm and SiLU-and-mul in one pass each, and prefill attention over the paged pool.

#include <type_traits>
#include <vector>

#include "attention.h"
#include "int8_gemm.h"
#include "int8_panels.h"
#include "int8_products.h"
#include "kquant_rows.h"
#include "ops.h"
#include "tile_products.h"
#include "torch_glue.h"

namespace bsgl {
namespace {

// x [M, K] (float32 or bfloat16) times the weight's rows: [M, N] in x's dtype. A bfloat16 x of
// at least kBF16MinRows rows on a CPU with AVX512_BF16 takes bfloat16 products (what torch's
// bfloat16 GEMM computes); otherwise the products are float32. (The matrix tiles: linear_tiles.)
at::Tensor linear(const at::Tensor& x, const at::Tensor& data, int64_t type, int64_t n, int64_t k,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [M, ", k, "]");
  const Weight w = make_weight(data, type, n, k, bias);
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && rows >= kBF16MinRows && k % 32 == 0) {
    const at::Tensor xc = x.contiguous();
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) { product_bf16(w, xb, rows, op, n, begin, end); });
    return out.to(at::kBFloat16);
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) { product(w, xp, k, rows, op, n, begin, end); });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// x [M, K] bfloat16 times the weight's rows on the matrix tiles (tile_products.h: without AMX,
// torch's bfloat16 GEMM on the same panels), float32 [M, N]: the op-by-op path's products of
// bfloat16 batches under --cpu-matrix-tiles. Takes weights in groups of sixteen rows too.
at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& data, int64_t type, int64_t n, int64_t k,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kBFloat16, "x must be bfloat16 [M, ", k, "]");
  TORCH_CHECK(k % 32 == 0, "the tiles take rows of whole 32-value steps: k must be a multiple of 32");
  const Weight w = make_weight(data, type, n, k, bias, /*grouped_ok=*/true);
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  const at::Tensor xc = x.contiguous();
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (n + kTilePanel - 1) / kTilePanel, 1, [&](int64_t begin, int64_t end) {  // whole panels
    product_tiles(w, xb, x.size(0), op, n, begin * kTilePanel, std::min(n, end * kTilePanel));
  });
  return out;
}

// x [M, K] (float32 or bfloat16) times a block-quantized weight with x rounded to int8 blocks
// first (int8_products.h, int8_gemm.h, kquant_rows.h): what the decode step computes with
// --cpu-int8-activations, in its deterministic mode (same_bits_for_any_rows, what the op-by-op
// path asks) or its default one. [M, N] in x's dtype.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& data, int64_t type, int64_t n, int64_t k,
                       const c10::optional<at::Tensor>& bias, bool same_bits_for_any_rows) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, ", k, "]");
  const int64_t rows = x.size(0);
  const Weight w = make_weight(data, type, n, k, bias, /*grouped_ok=*/true);
  TORCH_CHECK(!w.grouped || kHasInt8Gemm, "weights in groups of sixteen rows are multiplied on CPUs with AVX-512 VNNI "
              "only (this build has none)");
  const bool kquant_rows = !w.grouped && takes_kquant_rows(w.type, rows, k, same_bits_for_any_rows);
  const bool panels = !w.grouped && takes_int8_panels(w.type, rows, same_bits_for_any_rows);
  TORCH_CHECK(kquant_rows || panels || has_int8_products(w.type) || has_int8_gemm(w.type),
              "int8 activations meet block-quantized weights only (Q6_K: with AVX-512 VNNI; elsewhere only where a "
              "row's bits may depend on its batch, in one row, in two or three of at most ", kKRowsMaxValues,
              " values in all", kHasInt8Panels ? ", or in four and more (AVX2)" : "", ")");
  const at::Tensor xc = x.contiguous();
  Q8Rows a;
  reserve_q8(rows, k, a);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(xc.scalar_type() == at::kBFloat16 ? k : 0);
    for (int64_t m = begin; m < end; ++m) {
      if (xc.scalar_type() == at::kFloat) {
        quantize_row_q8(xc.data_ptr<float>() + m * k, m, a);
        continue;
      }
      const uint16_t* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()) + m * k;
      for (int64_t i = 0; i < k; ++i) row[i] = bf16_to_float(xb[i]);
      quantize_row_q8(row.data(), m, a);
    }
  });
  if (kquant_rows) {
    at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
    float* op = out.data_ptr<float>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) { product_kquant_rows(w, a, op, n, begin, end); });
    return out.to(x.scalar_type());
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (w.grouped) {
    at::Tensor out = at::empty({rows, n}, x.options());
    at::parallel_for(0, n / kGroup, 1, [&](int64_t begin, int64_t end) {
      if (x.scalar_type() == at::kFloat) product_grouped(w, a, out.data_ptr<float>(), n, begin * kGroup, end * kGroup);
      else product_grouped(w, a, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, begin * kGroup, end * kGroup);
    });
    return out;
  }
  if (takes_int8_gemm(w.type, rows, same_bits_for_any_rows)) {  // results written in x's dtype: no float32 copy of a prefill's [M, N]
    at::Tensor out = at::empty({rows, n}, x.options());
    at::parallel_for(0, n, kGroup, [&](int64_t begin, int64_t end) {
      if (x.scalar_type() == at::kFloat) product_int8(w, a, out.data_ptr<float>(), n, begin, end);
      else product_int8(w, a, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, begin, end);
    });
    return out;
  }
#endif
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  if (panels) {
    at::parallel_for(0, n, kPanelGroup, [&](int64_t begin, int64_t end) { product_int8_panels(w, a, op, n, begin, end); });
    return out.to(x.scalar_type());
  }
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) { product_q8(w, a, op, n, begin, end); });
  return out.to(x.scalar_type());
}

// Rows `ids` of the weight (or all rows) as float32 or bfloat16: embedding lookups, and whole
// matrices for large batches.
at::Tensor dequantize(const at::Tensor& data, int64_t type, int64_t n, int64_t k, const c10::optional<at::Tensor>& ids,
                      at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize gives float32 or bfloat16");
  const Weight w = make_weight(data, type, n, k, c10::nullopt, /*grouped_ok=*/true);
  at::Tensor idx = ids ? ids->to(at::kLong).contiguous() : at::Tensor();
  const int64_t rows = ids ? idx.numel() : n;
  const int64_t* ip = ids ? idx.data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; ip && r < rows; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < n, "row id ", ip[r], " out of range");
  at::Tensor out = at::empty({rows, k}, data.options().dtype(dtype));
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dtype == at::kFloat ? 0 : k);
    for (int64_t r = begin; r < end; ++r) {
      if (dtype == at::kFloat) {
        dequantize_row(w, ip ? ip[r] : r, out.data_ptr<float>() + r * k);
        continue;
      }
      dequantize_row(w, ip ? ip[r] : r, row.data());
      uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + r * k;
      for (int64_t i = 0; i < k; ++i) dst[i] = float_to_bf16(row[i]);
    }
  });
  return out;
}

// RMSNorm of each row as transformers computes it: in float32, x * rsqrt(mean(x^2) + eps),
// rounded to x's dtype, then times the weight in that dtype. One pass over the rows, where the
// op-by-op version made eight (a 2560-token prefill spent 0.15 s in its norms).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm: x [T, H] and weight [H] of one dtype, float32 or bfloat16");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t T = xc.size(0), H = xc.size(1);
  auto run = [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    const E* xp = xc.data_ptr<E>();
    const E* wp = wc.data_ptr<E>();
    E* op = out.data_ptr<E>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(H);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t i = 0; i < H; ++i) row[i] = to_float(xp[t * H + i]);
        fv acc{};
        int64_t i = 0;
        for (; i + kLanes <= H; i += kLanes) {
          const fv v = loadv(row.data() + i);
          acc += v * v;
        }
        float ss = hsum(acc);
        for (; i < H; ++i) ss += row[i] * row[i];
        const float r = 1.f / std::sqrt(ss / H + static_cast<float>(eps));
        for (int64_t j = 0; j < H; ++j) {
          const float normed = to_float(from_float<E>(row[j] * r));  // rounded to the dtype first
          op[t * H + j] = from_float<E>(to_float(wp[j]) * normed);
        }
      }
    });
  };
  if (x.scalar_type() == at::kFloat) run(static_cast<float*>(nullptr));
  else run(static_cast<c10::BFloat16*>(nullptr));
  return out;
}

// SiLU(gate) * up for x = [gate | up] ([T, 2I] -> [T, I]), rounding as torch's two ops do: the
// SiLU to x's dtype, then the product. One pass instead of three.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "silu_and_mul: x [T, 2I], float32 or bfloat16");
  const at::Tensor xc = x.contiguous();
  const int64_t T = xc.size(0), I = xc.size(1) / 2;
  at::Tensor out = at::empty({T, I}, xc.options());
  auto run = [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    const E* xp = xc.data_ptr<E>();
    E* op = out.data_ptr<E>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> e(I);
      for (int64_t t = begin; t < end; ++t) {
        const E* g = xp + t * 2 * I;
        for (int64_t i = 0; i < I; ++i) e[i] = -to_float(g[i]);
        exp_inplace(e.data(), I);
        for (int64_t i = 0; i < I; ++i) {
          const float silu = to_float(from_float<E>(to_float(g[i]) / (1.f + e[i])));
          op[t * I + i] = from_float<E>(silu * to_float(g[I + i]));
        }
      }
    });
  };
  if (x.scalar_type() == at::kFloat) run(static_cast<float*>(nullptr));
  else run(static_cast<c10::BFloat16*>(nullptr));
  return out;
}

// Prefill attention over the pool, for the Python path: q [T, heads, head_dim] holds the new
// tokens of B requests one after another; request r's KV slots are rows[r, :prefix_lens[r] +
// extend_lens[r]] (its new tokens' K and V already written), and its new token j (absolute
// position prefix + j) sees its slots 0 .. prefix + j. Returns [T, heads, head_dim] in q's dtype.
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& rows, const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                            double scale, const c10::optional<at::Tensor>& k_scale,
                            const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && k_buf.sizes() == v_buf.sizes() && k_buf.is_contiguous() &&
                  v_buf.is_contiguous() && k_buf.scalar_type() == v_buf.scalar_type() && q.size(2) == k_buf.size(2),
              "q [T, heads, D] and contiguous K/V buffers [slots, kv_heads, D] of one dtype");
  check_kv_scales(k_buf, k_scale);
  check_kv_scales(v_buf, v_scale);
  const int64_t T = q.size(0), heads = q.size(1), kv_heads = k_buf.size(1), D = q.size(2), slots = k_buf.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && D % 16 == 0 && D <= 1024, "heads must be a multiple of kv_heads, head_dim of 16");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.is_contiguous(), "rows: int64 [B, W]");
  const int64_t B = rows.size(0), W = rows.size(1);
  for (const auto* t : {&prefix_lens, &extend_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == B, "int64 lengths, one per request");
  const int64_t* pre = prefix_lens.data_ptr<int64_t>();
  const int64_t* ext = extend_lens.data_ptr<int64_t>();
  const int64_t* table = rows.data_ptr<int64_t>();
  // Tasks: runs of up to kTokens new tokens of one request, for one KV head.
  constexpr int64_t kTokens = 64;
  struct Task {
    int64_t req, first, count, kvh;  // first: the run's first token in q
  };
  std::vector<Task> tasks;
  std::vector<int64_t> token_len(T);
  int64_t first = 0;
  for (int64_t r = 0; r < B; ++r) {
    TORCH_CHECK(pre[r] >= 0 && ext[r] >= 1 && pre[r] + ext[r] <= W, "request lengths out of range");
    for (int64_t i = 0; i < pre[r] + ext[r]; ++i)
      TORCH_CHECK(table[r * W + i] >= 0 && table[r * W + i] < slots, "KV slot out of range");
    TORCH_CHECK(first + ext[r] <= T, "q holds ", T, " tokens, the lengths more");
    for (int64_t j = 0; j < ext[r]; ++j) token_len[first + j] = pre[r] + j + 1;
    for (int64_t j = 0; j < ext[r]; j += kTokens)
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({r, first + j, std::min(kTokens, ext[r] - j), h});
    first += ext[r];
  }
  TORCH_CHECK(first == T, "q holds ", T, " tokens, the lengths ", first);
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const bool bf16_model = q.scalar_type() == at::kBFloat16;  // a bfloat16 pool: bfloat16 dot products
  at::Tensor out = at::empty({T, heads, D}, q.options().dtype(at::kFloat));
  const int64_t G = heads / kv_heads;
  const int nthreads = at::get_num_threads();
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  // Tasks go round-robin: a causal prefill's later tokens see more slots, so contiguous shares
  // would load the last thread most. (Which thread computes a token changes nothing in it.)
  auto run = [&](auto* tag) {
    using Elem = std::remove_pointer_t<decltype(tag)>;
    const KVPool<Elem> kv{static_cast<const Elem*>(k_buf.data_ptr()), static_cast<const Elem*>(v_buf.data_ptr()),
                          kv_heads, D, scale_data(k_scale), scale_data(v_scale)};
    at::parallel_for(0, nthreads, 1, [&](int64_t begin, int64_t end) {
      const FlushDenormals flush;
      LaneScratch ws;
      for (int64_t tid = begin; tid < end; ++tid)
        for (int64_t t = tid; t < ntasks; t += nthreads) {
          const Task& k = tasks[t];
          const int64_t offset = (k.first * heads + k.kvh * G) * D;
          attend_lanes(kv, qf.data_ptr<float>() + offset, heads * D, static_cast<float>(scale), table + k.req * W,
                       token_len.data() + k.first, k.count, k.kvh, G, out.data_ptr<float>() + offset, heads * D, ws,
                       bf16_model);
        }
    });
  };
  dispatch_kv(k_buf.scalar_type(), run);
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

// Keys or values x [N, kv_heads, D] (float32) written to slots loc [N] of a 1-byte pool buf
// [slots, kv_heads, D] with their scales [slots, kv_heads], each head rounded as the decode step
// rounds it (kv_elements.h quantize_head): a slot holds the same bytes whichever pass wrote it.
void store_kv(const at::Tensor& x, const at::Tensor& loc, at::Tensor& buf, at::Tensor& scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3 && buf.dim() == 3 &&
                  buf.is_contiguous() && x.size(1) == buf.size(1) && x.size(2) == buf.size(2),
              "x: contiguous float32 [N, kv_heads, D] for a contiguous [slots, kv_heads, D] pool");
  TORCH_CHECK(buf.element_size() == 1, "store_kv writes 1-byte pools");
  check_kv_scales(buf, scales);
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.is_contiguous() && loc.numel() == x.size(0), "loc: int64 [N]");
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2), slots = buf.size(0);
  const int64_t* lp = loc.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(lp[i] >= 0 && lp[i] < slots, "KV slot out of range");
  dispatch_kv(buf.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (kScaledKV<T>) {
      T* out = static_cast<T*>(buf.data_ptr());
      const float* xp = x.data_ptr<float>();
      float* sp = scales.data_ptr<float>();
      at::parallel_for(0, N * H, 64, [&](int64_t begin, int64_t end) {
        const FlushDenormals flush;  // as in the decode step
        for (int64_t t = begin; t < end; ++t) {
          const int64_t row = t / H, h = t % H, at = lp[row] * H + h;
          quantize_head(xp + t * D, D, out + at * D, sp + at);
        }
      });
    }
  });
}

}  // namespace

void register_ops(pybind11::module& m) {
  m.def("linear", &linear, "x times a stored (possibly quantized) weight, float32 accumulation (CPU)");
  m.def("linear_int8", &linear_int8, "x rounded to int8 blocks times a quantized weight (CPU)", py::arg("x"),
        py::arg("data"), py::arg("type"), py::arg("n"), py::arg("k"), py::arg("bias"),
        py::arg("same_bits_for_any_rows") = true);
  m.attr("has_int8_gemm") = kHasInt8Gemm;  // many rows in int8 as fast as few (int8_gemm.h)
  m.attr("has_int8_panels") = kHasInt8Panels;  // AVX2's many-row int8 products (int8_panels.h)
  m.def("linear_tiles", &linear_tiles, "bfloat16 x times a stored weight on the matrix tiles (AMX, else torch's "
        "bfloat16 GEMM), float32 accumulation (CPU)");
  m.attr("tile_min_rows") = kTileMinRows;  // the fewest rows the step gives the tiles
  m.def("has_tile_products", &has_tile_products, "whether the CPU multiplies on matrix tiles (AMX, the kernel granting it)");
  m.def("dequantize", &dequantize, "rows of a stored weight as float32 or bfloat16 (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, rounding as transformers does (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up of [gate | up] rows (CPU)");
  m.def("extend_attention", &extend_attention, "prefill attention of new tokens over the paged KV pool (CPU)",
        py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("rows"), py::arg("prefix_lens"),
        py::arg("extend_lens"), py::arg("scale"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("store_kv", &store_kv, "keys or values rounded into slots of a 1-byte KV pool, with their scales (CPU)");
}

}  // namespace bsgl
