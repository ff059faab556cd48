// Decode attention on the CPU, reading K/V straight from the paged pool.
//
// Each row is one task: for every KV head, its G queries (the query heads of that KV head, or
// the queries of every request in a shared-prefix group) walk the row's slot list in blocks,
// computing the scores in float32, keeping a running maximum and sum (online softmax) and
// accumulating V. Nothing is gathered or padded, and a row's result does not depend on the
// other rows of the batch. Returns the output and the log-sum-exp of each query's scores, so
// that partial results over disjoint key sets can be merged (shared_prefix.merge). The pool may
// hold another type than q (its 1-byte types come with a scale per slot and head, applied as each
// key's row is widened).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "torch_glue.h"
#include "vec.h"

namespace {

constexpr int64_t kBlock = 32;  // keys scored before their values are accumulated
constexpr int64_t kLanes = 16;  // independent partial sums, so the compiler can vectorize dot products

template <typename T>
inline float as_float(T x) {
  return static_cast<float>(x);
}

// bfloat16 is the top half of a float32: widening is a shift, which vectorizes.
template <>
inline float as_float<c10::BFloat16>(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// n stored values as floats; a 1-byte type's times its scale.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n, float scale = 1.f) {
  if constexpr (bsgl::kScaledKV<T>) {
    int64_t i = 0;
    for (; i + bsgl::kLanes <= n; i += bsgl::kLanes) bsgl::storev(dst + i, bsgl::load_scaled(src + i) * bsgl::splat(scale));
    for (; i < n; ++i) dst[i] = bsgl::scaled_to_float(src[i]) * scale;
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = as_float(src[i]);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += a[i + l] * b[i + l];
  float total = 0.f;
  for (; i < n; ++i) total += a[i] * b[i];
  for (int64_t l = 0; l < kLanes; ++l) total += part[l];
  return total;
}

// T: q's and the output's type; K: the pool's element.
template <typename T, typename K>
void decode_rows(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& table,
                 const at::Tensor& lens, double scale, const float* k_scale, const float* v_scale, at::Tensor& out,
                 at::Tensor& lse) {
  const int64_t rows = q.size(0), heads = q.size(1), group = q.size(2), dim = q.size(3);
  const int64_t width = table.size(1), slot_stride = k_buf.stride(0), head_stride = k_buf.stride(1);
  const T* qp = q.data_ptr<T>();
  const K* kp = static_cast<const K*>(k_buf.data_ptr());
  const K* vp = static_cast<const K*>(v_buf.data_ptr());
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  float* sp = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One task per row; its heads are handled together, so each slot's K (and V) row, all heads
  // side by side in the pool, is read from memory once.
  const int64_t hg = heads * group;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    const bsgl::FlushDenormals flush;  // see vec.h: far-off keys' tiny weights
    std::vector<float> qf(hg * dim), acc(hg * dim), scores(hg * kBlock), mx(hg), sum(hg), row(heads * dim);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = lp[r];
      widen(qp + r * hg * dim, qf.data(), hg * dim);
      for (auto& x : qf) x *= fscale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t start = 0; start < len; start += kBlock) {
        const int64_t n = std::min(kBlock, len - start);
        const int64_t* slots = tp + r * width + start;
        for (int64_t j = 0; j < n; ++j) {
          const K* krow = kp + slots[j] * slot_stride;
          for (int64_t h = 0; h < heads; ++h)
            widen(krow + h * head_stride, row.data() + h * dim, dim, k_scale ? k_scale[slots[j] * heads + h] : 1.f);
          for (int64_t qi = 0; qi < hg; ++qi) scores[qi * kBlock + j] = dot(qf.data() + qi * dim, row.data() + qi / group * dim, dim);
        }
        for (int64_t qi = 0; qi < hg; ++qi) {
          float* sq = scores.data() + qi * kBlock;
          float block_max = mx[qi];
          for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, sq[j]);
          const float rescale = std::exp(mx[qi] - block_max);  // 0 on the first block
          float* aq = acc.data() + qi * dim;
          for (int64_t d = 0; d < dim; ++d) aq[d] *= rescale;
          sum[qi] *= rescale;
          mx[qi] = block_max;
          for (int64_t j = 0; j < n; ++j) sq[j] -= block_max;
          bsgl::exp_inplace(sq, n);
          for (int64_t j = 0; j < n; ++j) sum[qi] += sq[j];
        }
        for (int64_t j = 0; j < n; ++j) {
          const K* vrow = vp + slots[j] * slot_stride;
          for (int64_t h = 0; h < heads; ++h)
            widen(vrow + h * head_stride, row.data() + h * dim, dim, v_scale ? v_scale[slots[j] * heads + h] : 1.f);
          for (int64_t qi = 0; qi < hg; ++qi) {
            const float p = scores[qi * kBlock + j];
            const float* vq = row.data() + qi / group * dim;
            float* aq = acc.data() + qi * dim;
            for (int64_t d = 0; d < dim; ++d) aq[d] += p * vq[d];
          }
        }
      }
      T* orow = op + r * hg * dim;
      for (int64_t qi = 0; qi < hg; ++qi) {
        const float inv = sum[qi] > 0.f ? 1.f / sum[qi] : 0.f;
        for (int64_t d = 0; d < dim; ++d) orow[qi * dim + d] = static_cast<T>(acc[qi * dim + d] * inv);
        sp[r * hg + qi] = sum[qi] > 0.f ? mx[qi] + std::log(sum[qi]) : -std::numeric_limits<float>::infinity();
      }
    }
  });
}

// q: [N, H, G, D] contiguous; k_buf, v_buf: [slots, H, D] with unit stride in D; table: [N, W]
// int64 slot ids (row r uses its first lens[r]); k_scale, v_scale: a 1-byte pool's [slots, H]
// float32 scales; returns (out [N, H, G, D] in q's dtype, lse [N, H, G] float32).
std::vector<at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                                         const at::Tensor& table, const at::Tensor& lens, double scale,
                                         const c10::optional<at::Tensor>& k_scale,
                                         const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "q must be a contiguous [N, H, G, D] tensor");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.stride(2) == 1 && v_buf.strides() == k_buf.strides(),
              "k_buf and v_buf must be [slots, H, D] with the same layout");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "k_buf and v_buf must share a dtype");
  bsgl::check_kv_scales(k_buf, k_scale);
  bsgl::check_kv_scales(v_buf, v_scale);
  TORCH_CHECK(!k_scale || k_buf.is_contiguous(), "a 1-byte pool must be contiguous");
  TORCH_CHECK(table.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && table.is_contiguous(),
              "table and lens must be int64 (table contiguous)");
  TORCH_CHECK(q.size(1) == k_buf.size(1) && q.size(3) == k_buf.size(2), "q and the KV pool disagree on heads/dim");
  TORCH_CHECK(table.size(0) == q.size(0) && lens.size(0) == q.size(0), "one table row and one length per query row");
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    auto run = [&](auto* tag) {
      decode_rows<scalar_t, std::remove_pointer_t<decltype(tag)>>(q, k_buf, v_buf, table, lens.contiguous(), scale,
                                                                   bsgl::scale_data(k_scale), bsgl::scale_data(v_scale),
                                                                   out, lse);
    };
    if (k_buf.scalar_type() == q.scalar_type()) run(static_cast<scalar_t*>(nullptr));  // the pool in the model's dtype
    else bsgl::dispatch_kv(k_buf.scalar_type(), run);
  });
  return {out, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over the paged KV pool (CPU)", py::arg("q"),
        py::arg("k_buf"), py::arg("v_buf"), py::arg("table"), py::arg("lens"), py::arg("scale"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
}
