// The CPU's decode step in one call (the Python path's ops are in ops.cpp).
//
// DecodeStep::run computes a whole decode pass of a Llama-family model (Llama, Qwen2, Qwen3) for a
// few requests: embedding, every layer (RMSNorm, q/k/v, Qwen3's per-head q/k RMSNorm, rope, KV
// write, attention over the request's
// slots in the paged pool, o_proj, residual, RMSNorm, gate/up, SiLU, down, residual), the final
// norm and the logits. Activations stay float32 throughout (the KV pool keeps its dtype). The
// threads of a SpinPool run all of it: each op splits its outputs among them and a barrier
// separates it from the next, so they spin between ops instead of being put to sleep and woken
// hundreds of times a step, and no Python runs between them. Every output element is computed
// by one thread in a fixed order: the result does not depend on the thread count or on the
// other requests of the batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdlib>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "ops.h"
#include "spin_pool.h"
#include "torch_glue.h"
#include "weights.h"

namespace bsgl {
namespace {

struct Layer {
  Weight qkv, o, gate_up, down;
  const float* norm_in;
  const float* norm_post;
  const float* q_norm = nullptr;  // Qwen3: each query head's RMSNorm weights [head_dim] (and keys')
  const float* k_norm = nullptr;
};

class DecodeStep {
 public:
  DecodeStep(py::dict cfg, py::list layers, py::tuple embed, py::tuple lm_head, const at::Tensor& final_norm,
             const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> k_buffers,
             std::vector<at::Tensor> v_buffers)
      : hidden_(cfg["hidden_size"].cast<int64_t>()),
        heads_(cfg["num_heads"].cast<int64_t>()),
        kv_heads_(cfg["num_kv_heads"].cast<int64_t>()),
        head_dim_(cfg["head_dim"].cast<int64_t>()),
        inter_(cfg["intermediate_size"].cast<int64_t>()),
        vocab_(cfg["vocab_size"].cast<int64_t>()),
        eps_(cfg["rms_norm_eps"].cast<float>()),
        bf16_products_(kHasBF16Products && cfg["bf16_products"].cast<bool>()),
        pool_(cfg["num_threads"].cast<int>()),
        cos_(cos.contiguous()),
        sin_(sin.contiguous()),
        k_buffers_(std::move(k_buffers)),
        v_buffers_(std::move(v_buffers)) {
    TORCH_CHECK(cos_.scalar_type() == at::kFloat && sin_.sizes() == cos_.sizes() && cos_.size(1) == head_dim_,
                "rope tables must be float32 [positions, head_dim]");
    TORCH_CHECK(head_dim_ % 16 == 0 && head_dim_ <= 1024, "head_dim must be a multiple of 16, at most 1024");
    embed_ = weight(embed);
    lm_head_ = weight(lm_head);
    final_norm_ = keep_float(final_norm);
    for (auto item : layers) {
      auto l = item.cast<py::dict>();
      Layer layer;
      layer.qkv = weight(l["qkv"].cast<py::tuple>());
      layer.o = weight(l["o"].cast<py::tuple>());
      layer.gate_up = weight(l["gate_up"].cast<py::tuple>());
      layer.down = weight(l["down"].cast<py::tuple>());
      layer.norm_in = keep_float(l["norm_in"].cast<at::Tensor>());
      layer.norm_post = keep_float(l["norm_post"].cast<at::Tensor>());
      if (l.contains("q_norm")) {
        layer.q_norm = keep_float(l["q_norm"].cast<at::Tensor>(), head_dim_);
        layer.k_norm = keep_float(l["k_norm"].cast<at::Tensor>(), head_dim_);
      }
      layers_.push_back(layer);
    }
    TORCH_CHECK(k_buffers_.size() == layers_.size() && v_buffers_.size() == layers_.size(), "one K and V buffer per layer");
    const auto kv_dtype = k_buffers_[0].scalar_type();
    for (size_t i = 0; i < layers_.size(); ++i) {
      for (const auto* b : {&k_buffers_[i], &v_buffers_[i]}) {
        TORCH_CHECK(b->is_contiguous() && b->dim() == 3 && b->size(1) == kv_heads_ && b->size(2) == head_dim_ &&
                        b->scalar_type() == kv_dtype, "KV buffers must be contiguous [slots, kv_heads, head_dim]");
      }
    }
    TORCH_CHECK(kv_dtype == at::kFloat || kv_dtype == at::kBFloat16, "the KV pool must be float32 or bfloat16");
    const int64_t qkv = (heads_ + 2 * kv_heads_) * head_dim_;
    TORCH_CHECK(embed_.k == hidden_ && lm_head_.k == hidden_ && lm_head_.n == vocab_, "embedding/lm_head shapes");
    for (const auto& l : layers_) {
      TORCH_CHECK(l.qkv.n == qkv && l.qkv.k == hidden_ && l.o.n == hidden_ && l.o.k == heads_ * head_dim_ &&
                      l.gate_up.n == 2 * inter_ && l.gate_up.k == hidden_ && l.down.n == hidden_ && l.down.k == inter_,
                  "layer weight shapes do not match the config");
    }
  }

  // Seconds thread 0 spent in each part since the last call (with profiling on), and whether to
  // keep measuring: scripts/profile_step.py reads it.
  py::dict profile(bool keep_on) {
    py::dict out;
    out["matmul"] = profile_[kMatmul];
    out["attention"] = profile_[kAttention];
    out["norms, rope, KV writes, activation"] = profile_[kOther];
    out["logits"] = profile_[kLogits];
    std::fill(profile_, profile_ + 4, 0.0);
    profiling_ = keep_on;
    return out;
  }

  // input_ids, positions, out_cache_loc, req_pool_indices, seq_lens: int64 [M]; req_to_token: the
  // request-to-slot table, int64 [requests, W], whose row req_pool_indices[m] holds row m's KV
  // slots in its first seq_lens[m] entries (the new token's last). Returns float32 logits [M, vocab].
  at::Tensor run(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& out_cache_loc,
                 const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                 int64_t num_threads) {
    const int64_t rows = input_ids.size(0);
    for (const auto* t : {&input_ids, &positions, &out_cache_loc, &req_pool_indices, &seq_lens})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == rows, "int64 inputs, one per row");
    TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.is_contiguous() && req_to_token.dim() == 2,
                "req_to_token must be a contiguous int64 table");
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t* req = req_pool_indices.data_ptr<int64_t>();
    const int64_t slots = k_buffers_[0].size(0);
    for (int64_t m = 0; m < rows; ++m) {
      TORCH_CHECK(ids[m] >= 0 && ids[m] < embed_.n, "token id ", ids[m], " out of range");
      TORCH_CHECK(req[m] >= 0 && req[m] < req_to_token.size(0), "request slot out of range");
      TORCH_CHECK(lens[m] >= 1 && lens[m] <= req_to_token.size(1), "sequence length out of range");
      TORCH_CHECK(positions.data_ptr<int64_t>()[m] >= 0 && positions.data_ptr<int64_t>()[m] < cos_.size(0),
                  "position outside the rope table");
      TORCH_CHECK(out_cache_loc.data_ptr<int64_t>()[m] >= 0 && out_cache_loc.data_ptr<int64_t>()[m] < slots,
                  "KV slot out of range");
    }
    at::Tensor logits = at::empty({rows, vocab_}, input_ids.options().dtype(at::kFloat));
    if (!scratch_ || scratch_->rows < rows) {  // kept between steps: fresh pages each step cost faults
      scratch_ = std::make_unique<Scratch>(rows, hidden_, (heads_ + 2 * kv_heads_) * head_dim_, heads_ * head_dim_,
                                           inter_);
    }
    Scratch& s = *scratch_;
    Batch b{rows, ids, positions.data_ptr<int64_t>(), out_cache_loc.data_ptr<int64_t>(), req_to_token.data_ptr<int64_t>(),
            req_to_token.size(1), req, lens, logits.data_ptr<float>()};
    {
      py::gil_scoped_release no_gil;
      if (k_buffers_[0].scalar_type() == at::kBFloat16) {
        forward<c10::BFloat16>(b, s, static_cast<int>(std::max<int64_t>(1, num_threads)));
      } else {
        forward<float>(b, s, static_cast<int>(std::max<int64_t>(1, num_threads)));
      }
    }
    return logits;
  }

 private:
  struct Batch {
    int64_t rows;
    const int64_t *ids, *pos, *loc, *table;
    int64_t width;
    const int64_t *req, *lens;
    float* logits;
  };
  // Activations (every value is written before it is read in a step).
  using Buffer = AlignedBuffer<float>;
  struct Scratch {
    int64_t rows;  // the largest batch it holds
    Buffer x, h, tmp, qkv, att, gate_up, act;
    Scratch(int64_t m, int64_t hidden, int64_t qkv_n, int64_t q_n, int64_t inter)
        : rows(m), x(m * hidden), h(m * hidden), tmp(m * hidden), qkv(m * qkv_n), att(m * q_n),
          gate_up(m * 2 * inter), act(m * inter) {}
  };

  Weight weight(py::tuple t) {
    auto data = t[0].cast<at::Tensor>();
    keep_.push_back(data);
    c10::optional<at::Tensor> bias;
    if (!t[4].is_none()) {
      bias = t[4].cast<at::Tensor>().to(at::kFloat).contiguous();
      keep_.push_back(*bias);
    }
    return make_weight(data, t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<int64_t>(), bias);
  }

  const float* keep_float(const at::Tensor& t, int64_t n = -1) {
    keep_.push_back(t.to(at::kFloat).contiguous());
    TORCH_CHECK(keep_.back().numel() == (n < 0 ? hidden_ : n), "norm weights must have ", (n < 0 ? hidden_ : n),
                " values");
    return keep_.back().data_ptr<float>();
  }

  // out = x * rsqrt(mean(x^2) + eps) * w, one row.
  void rms_norm(const float* x, const float* w, float* out) const {
    float ss = 0.f;
    for (int64_t i = 0; i < hidden_; ++i) ss += x[i] * x[i];
    const float r = 1.f / std::sqrt(ss / hidden_ + eps_);
    for (int64_t i = 0; i < hidden_; ++i) out[i] = w[i] * (x[i] * r);
  }

  template <typename T>
  void forward(const Batch& b, Scratch& s, int nthreads) {
    const int64_t H = hidden_, M = b.rows;
    pool_.run(nthreads, [&](int tid, int nt) {
      const FlushDenormals flush;
      auto my_rows = [&](int64_t n, int64_t& begin, int64_t& end) {
        begin = n * tid / nt;
        end = n * (tid + 1) / nt;
      };
      std::vector<uint16_t> xb;  // this thread's bfloat16 copy of a product's activations
      auto linear = [&](const Weight& w, const float* x, float* out) {
        int64_t n0, n1;
        split_range(w.n, tid, nt, n0, n1);
#if defined(__AVX512BF16__)
        if (bf16_products_ && M >= kBF16MinRows && w.k % 32 == 0) {
          xb.resize(M * w.k);
          to_bf16_rows(x, w.k, M, w.k, xb.data());
          product_bf16(w, xb.data(), M, out, w.n, n0, n1);
          return;
        }
#endif
        product(w, x, w.k, M, out, w.n, n0, n1);
      };
      // Thread 0 charges the time since its last mark (its op and the wait for the others) to
      // one of matmul / attention / the rest when profiling is on.
      auto last = std::chrono::steady_clock::now();
      auto mark = [&](int kind) {
        if (tid != 0 || !profiling_) return;
        const auto now = std::chrono::steady_clock::now();
        profile_[kind] += std::chrono::duration<double>(now - last).count();
        last = now;
      };
      int64_t r0, r1;
      my_rows(M, r0, r1);
      for (int64_t m = r0; m < r1; ++m) {
        dequantize_row(embed_, b.ids[m], s.x.data() + m * H);
        rms_norm(s.x.data() + m * H, layers_[0].norm_in, s.h.data() + m * H);
      }
      pool_.barrier();
      mark(kOther);
      for (size_t li = 0; li < layers_.size(); ++li) {
        const Layer& l = layers_[li];
        linear(l.qkv, s.h.data(), s.qkv.data());
        pool_.barrier();
        mark(kMatmul);
        rope_and_store<T>(b, s, li, tid, nt);
        pool_.barrier();
        mark(kOther);
        attend<T>(b, s, li, tid, nt);
        pool_.barrier();
        mark(kAttention);
        linear(l.o, s.att.data(), s.tmp.data());
        pool_.barrier();
        mark(kMatmul);
        for (int64_t m = r0; m < r1; ++m) {
          float* x = s.x.data() + m * H;
          for (int64_t i = 0; i < H; ++i) x[i] += s.tmp[m * H + i];
          rms_norm(x, l.norm_post, s.h.data() + m * H);
        }
        pool_.barrier();
        mark(kOther);
        linear(l.gate_up, s.h.data(), s.gate_up.data());
        pool_.barrier();
        mark(kMatmul);
        for (int64_t m = 0; m < M; ++m) {  // SiLU(gate) * up, each thread a share of every row
          int64_t i0, i1;
          my_rows(inter_, i0, i1);
          const float* g = s.gate_up.data() + m * 2 * inter_;
          float* a = s.act.data() + m * inter_;
          for (int64_t i = i0; i < i1; ++i) a[i] = -g[i];
          exp_inplace(a + i0, i1 - i0);
          for (int64_t i = i0; i < i1; ++i) a[i] = g[i] / (1.f + a[i]) * g[inter_ + i];
        }
        pool_.barrier();
        mark(kOther);
        linear(l.down, s.act.data(), s.tmp.data());
        pool_.barrier();
        mark(kMatmul);
        const float* next_norm = li + 1 < layers_.size() ? layers_[li + 1].norm_in : final_norm_;
        for (int64_t m = r0; m < r1; ++m) {
          float* x = s.x.data() + m * H;
          for (int64_t i = 0; i < H; ++i) x[i] += s.tmp[m * H + i];
          rms_norm(x, next_norm, s.h.data() + m * H);
        }
        pool_.barrier();
        mark(kOther);
      }
      linear(lm_head_, s.h.data(), b.logits);
      mark(kLogits);  // thread 0's share: the pool waits for the others before run() returns
    });
  }

  // Rotates each row's queries and keys to its position (rotate-half layout; the sine table
  // carries the sign) and writes its key and value to its KV slot.
  template <typename T>
  void rope_and_store(const Batch& b, Scratch& s, size_t layer, int tid, int nt) {
    const int64_t D = head_dim_, half = D / 2, qk_heads = heads_ + kv_heads_;
    const int64_t qkv_n = (heads_ + 2 * kv_heads_) * D, tasks = b.rows * (qk_heads + kv_heads_);
    T* kp = k_buffers_[layer].data_ptr<T>();
    T* vp = v_buffers_[layer].data_ptr<T>();
    float tmp[1024];
    for (int64_t t = tasks * tid / nt; t < tasks * (tid + 1) / nt; ++t) {
      const int64_t m = t / (qk_heads + kv_heads_), h = t % (qk_heads + kv_heads_);
      float* v = s.qkv.data() + m * qkv_n + h * D;
      const int64_t slot = b.loc[m] * kv_heads_ * D;
      if (h < qk_heads) {
        const Layer& l = layers_[layer];
        if (l.q_norm != nullptr) {  // Qwen3: this head's RMSNorm before rope
          const float* w = h < heads_ ? l.q_norm : l.k_norm;
          float ss = 0.f;
          for (int64_t i = 0; i < D; ++i) ss += v[i] * v[i];
          const float r = 1.f / std::sqrt(ss / D + eps_);
          for (int64_t i = 0; i < D; ++i) v[i] = w[i] * (v[i] * r);
        }
        const float* c = cos_.data_ptr<float>() + b.pos[m] * D;
        const float* sn = sin_.data_ptr<float>() + b.pos[m] * D;
        for (int64_t i = 0; i < D; ++i) tmp[i] = v[i] * c[i] + v[(i + half) % D] * sn[i];
        std::memcpy(v, tmp, D * sizeof(float));
        if (h >= heads_) {
          T* dst = kp + slot + (h - heads_) * D;
          for (int64_t i = 0; i < D; ++i) dst[i] = from_float<T>(v[i]);
        }
      } else {
        T* dst = vp + slot + (h - qk_heads) * D;
        for (int64_t i = 0; i < D; ++i) dst[i] = from_float<T>(v[i]);
      }
    }
  }

  // A task is a row's KV heads kvh0 .. kvh0 + H - 1: all of them when there are rows enough to
  // share out (a slot's heads are adjacent in the pool and read as one run: a batch-32 step's
  // attention took 0.7x the time of head by head), else one (so a single row still splits).
  template <typename T>
  void attend(const Batch& b, Scratch& s, size_t layer, int tid, int nt) {
    const int64_t D = head_dim_, G = heads_ / kv_heads_, qkv_n = (heads_ + 2 * kv_heads_) * D;
    const int64_t H = b.rows >= 4 * nt ? kv_heads_ : 1, groups = kv_heads_ / H, tasks = b.rows * groups;
    const KVPool<T> kv{k_buffers_[layer].data_ptr<T>(), v_buffers_[layer].data_ptr<T>(), kv_heads_, D};
    const float scale = 1.f / std::sqrt(static_cast<float>(D));
    AttnScratch ws;
    for (int64_t t = tasks * tid / nt; t < tasks * (tid + 1) / nt; ++t) {
      const int64_t m = t / groups, kvh0 = (t % groups) * H;
      attend_row(kv, s.qkv.data() + m * qkv_n + kvh0 * G * D, scale, b.table + b.req[m] * b.width, b.lens[m], kvh0, H, G,
                 s.att.data() + m * heads_ * D + kvh0 * G * D, ws);
    }
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, inter_, vocab_;
  float eps_;
  enum { kMatmul, kAttention, kOther, kLogits };
  bool profiling_ = false;
  double profile_[4] = {};
  bool bf16_products_;  // bfloat16 dtype on a CPU with AVX512_BF16: batches use vdpbf16ps
  SpinPool pool_;
  std::unique_ptr<Scratch> scratch_;  // run() is called by one thread at a time (the scheduler's)
  at::Tensor cos_, sin_;
  std::vector<at::Tensor> k_buffers_, v_buffers_, keep_;
  Weight embed_, lm_head_;
  const float* final_norm_ = nullptr;
  std::vector<Layer> layers_;
};

}  // namespace
}  // namespace bsgl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bsgl::register_ops(m);
  py::class_<bsgl::DecodeStep>(m, "DecodeStep")
      .def(py::init<py::dict, py::list, py::tuple, py::tuple, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    std::vector<at::Tensor>, std::vector<at::Tensor>>())
      .def("run", &bsgl::DecodeStep::run)
      .def("profile", &bsgl::DecodeStep::profile);
}
