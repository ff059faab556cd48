// What the kernels need from torch: its bfloat16 type, and weights given as tensors.
#pragma once

// torch's narrow headers, not <torch/extension.h>: that one parses the whole C++ frontend
// (nn, optim, ...) and took two thirds of each file's build time.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include "int8_groups.h"
#include "kv_elements.h"
#include "weights.h"

namespace bsgl {

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }
template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 v) { return bf16_to_float(v.x); }
template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) {
  c10::BFloat16 b;
  b.x = float_to_bf16(v);
  return b;
}

// Calls f with a null pointer of the KV pool's element type: float32, bfloat16 or a 1-byte type.
template <typename F>
void dispatch_kv(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat: return f(static_cast<float*>(nullptr));
    case at::kBFloat16: return f(static_cast<c10::BFloat16*>(nullptr));
    case at::kChar: return f(static_cast<int8_t*>(nullptr));
    case at::kFloat8_e4m3fn: return f(static_cast<Fp8E4M3*>(nullptr));
    case at::kFloat8_e5m2: return f(static_cast<Fp8E5M2*>(nullptr));
    default: TORCH_CHECK(false, "the KV pool must be float32, bfloat16, float8_e4m3fn, float8_e5m2 or int8");
  }
}

// A 1-byte pool comes with its float32 scales, one per slot and KV head; the others with none.
inline void check_kv_scales(const at::Tensor& buf, const c10::optional<at::Tensor>& scale) {
  const bool scaled = buf.element_size() == 1;
  TORCH_CHECK(scaled == scale.has_value(), "a 1-byte KV pool needs its scales, a wider one has none");
  TORCH_CHECK(!scaled || (scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->dim() == 2 &&
                          scale->size(0) == buf.size(0) && scale->size(1) == buf.size(1)),
              "KV scales must be contiguous float32 [slots, kv_heads]");
}

inline const float* scale_data(const c10::optional<at::Tensor>& scale) {
  return scale ? scale->data_ptr<float>() : nullptr;
}

// Batches of at least this many rows take the bfloat16 products (weights.h) when the dtype is
// bfloat16; a single row is bound by reading the weights, not by the products, and keeps float32.
constexpr int64_t kBF16MinRows = 4;

// A weight from its bytes: type is a format's code, plus kGroupedCode for rows in groups of
// sixteen, which the int8 products and row lookups take, the float products not (grouped_ok).
inline Weight make_weight(const at::Tensor& data, int64_t code, int64_t n, int64_t k, const c10::optional<at::Tensor>& bias,
                          bool grouped_ok = false) {
  const bool grouped = code >= kGroupedCode;
  const int64_t type = grouped ? code - kGroupedCode : code;
  TORCH_CHECK(type >= kF32 && type <= kLastWeightType, "unknown weight type ", code);
  TORCH_CHECK(!grouped || (grouped_ok && groupable(static_cast<int>(type)) && n % kGroupRows == 0),
              "weights in groups of sixteen rows are read by the int8 products and row lookups only, in Q8_0, "
              "Q4_0, Q4_1 or Q4_K with whole groups (this call does not take them)");
  const int64_t rows = grouped ? n / kGroupRows : n, per_row = grouped ? kGroupRows : 1;
  TORCH_CHECK(data.device().is_cpu() && data.dim() == 2 && data.size(0) == rows && data.stride(1) == 1,
              "weight data must be a CPU [", rows, ", row] tensor with unit inner stride");
  TORCH_CHECK(k % block_values(static_cast<int>(type)) == 0, "quantized rows must hold whole ",
              block_values(static_cast<int>(type)), "-value blocks");
  const int64_t bytes = data.size(1) * data.element_size();
  TORCH_CHECK(bytes == per_row * row_bytes(static_cast<int>(type), k), "weight rows hold ", bytes, " bytes, expected ",
              per_row * row_bytes(static_cast<int>(type), k));
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "bias must be a contiguous float32 [n] tensor");
  Weight w;
  w.type = static_cast<int>(type);
  w.grouped = grouped;
  w.n = n;
  w.k = k;
  w.stride = data.stride(0) * data.element_size();
  w.data = static_cast<const uint8_t*>(data.data_ptr());
  w.bias = bias ? bias->data_ptr<float>() : nullptr;
  return w;
}

}  // namespace bsgl
