// The CPU's decode step in one call (the Python path's ops are in ops.cpp).
//
// DecodeStep::run computes a whole decode pass of any family models/llama.py serves for a few
// requests: embedding, every layer (RMSNorm, q/k/v, per-head q/k RMSNorm, rope over all or part of
// each head, KV write, attention over the request's slots in the paged pool — its last `window`
// ones in a windowed layer —, o_proj, residual, RMSNorm, the MLP (gate/up, SiLU or GELU-tanh,
// down) or a mixture of experts, residual; Gemma's norms around each sublayer), the final norm and
// the logits (soft-capped where the model says). Each row may add its own LoRA adapter's deltas to
// the projections (lora_add). Activations stay float32 throughout (the KV pool keeps its
// element type: float32, bfloat16, or 1-byte fp8 / int8 with a scale per slot and head). The
// threads of a StepTeam run all of it: each op splits its outputs among them and a barrier
// separates it from the next, so they spin between ops instead of being put to sleep and woken
// hundreds of times a step, and no Python runs between them. Every output element is computed
// by one thread in a fixed order: the result does not depend on the thread count or on the
// other requests of the batch.


#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "attention.h"
#include "blas_products.h"
#include "int8_gemm.h"
#include "int8_panels.h"
#include "int8_products.h"
#include "kquant_rows.h"
#include "ops.h"
#include "step_team.h"
#include "tile_products.h"
#include "torch_glue.h"
#include "weights.h"

namespace bsgl {
namespace {

// A mixture-of-experts MLP (layers/moe.py): the router, and each expert's gate/up and down.
struct Experts {
  Weight router;
  std::vector<Weight> gate_up, down;
};

// A thread's copy of a product's activations in the form its products take: bfloat16, or int8
// blocks.
struct RowCopies {
  std::vector<uint16_t> bf16;
  Q8Rows int8;
};

// A fused projection (q/k/v, gate/up): its parts' rows one after another, each part in its own
// format (a file may hold v in another format than q and k).
struct Fused {
  std::vector<Weight> parts;
  int64_t n = 0, k = 0;
};

// The LoRA adapters' slots of one projection (lora/memory_pool.py): A [slots, rank, k] and B
// transposed, [slots, rank, n], in the model's dtype (float32, or bfloat16: half the bytes to
// read, widened to float32 as they are read), the scale folded into B; a is null when none are
// served. The projection's outputs are parts (q, k, v; gate, up) ending at part_end; used [slots,
// rank, parts] says which rows of B^T are not zero over which part (a fused adapter's parts each
// have ranks of their own), so the zeros are skipped.
struct LoRAStack {
  const void* a = nullptr;
  const void* b = nullptr;
  bool bf16 = false;
  const uint8_t* used = nullptr;
  int64_t slots = 0, rank = 0, k = 0, n = 0;
  std::vector<int64_t> part_end;
};

// The output columns a thread writes in a projection's product: one run per part of a fused one.
struct Columns {
  int64_t begin[4], end[4];
  int count = 0;
};

// An adapter slot's values, float32 or bfloat16 bits, as float32.
inline fv load_slot(const float* p) { return loadv(p); }
inline fv load_slot(const uint16_t* p) { return load_bf16(p); }
inline float slot_value(float v) { return v; }
inline float slot_value(uint16_t v) { return bf16_to_float(v); }

template <typename E>
inline float dot(const E* a, const float* b, int64_t n) {
  fv acc = splat(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load_slot(a + i) * loadv(b + i);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += slot_value(a[i]) * b[i];
  return sum;
}

// out[r] = a . x[r] for four rows x[r] at once (each as dot computes it): a is read once, and the
// four sums are independent chains.
template <typename E>
inline void dot4(const E* a, const float* const* x, int64_t n, float* out) {
  fv acc[4] = {splat(0.f), splat(0.f), splat(0.f), splat(0.f)};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const fv av = load_slot(a + i);
    for (int r = 0; r < 4; ++r) acc[r] += av * loadv(x[r] + i);
  }
  for (int r = 0; r < 4; ++r) {
    out[r] = hsum(acc[r]);
    for (int64_t k = i; k < n; ++k) out[r] += slot_value(a[k]) * x[r][k];
  }
}

// y[i] += sum over q of a[q] x[q][i], for i in [0, n), the q in order (a row's outputs of B^T's
// rows x): each y vector is read and written once.
template <typename E>
inline void axpy_rows(const float* a, const E* const* x, int count, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    fv acc = loadv(y + i);
    for (int q = 0; q < count; ++q) acc += splat(a[q]) * load_slot(x[q] + i);
    storev(y + i, acc);
  }
  for (; i < n; ++i)
    for (int q = 0; q < count; ++q) y[i] += a[q] * slot_value(x[q][i]);
}

struct Layer {
  Fused qkv, gate_up;  // gate_up and down: a dense MLP's
  Weight o, down;
  LoRAStack lora_qkv, lora_o, lora_gate_up, lora_down;
  const float* norm_in;
  const float* norm_post;  // before the MLP; Gemma: on the attention's output, before its residual
  const float* pre_ff_norm = nullptr;  // Gemma: before the MLP, and on its output
  const float* post_ff_norm = nullptr;
  const float* q_norm = nullptr;  // Qwen3, Gemma: each query head's RMSNorm weights [head_dim] (and keys')
  const float* k_norm = nullptr;
  int64_t window = 0;  // > 0: attends over the last `window` positions only
  bool local_rope = false;  // Gemma's windowed layers: the second rope tables
  std::unique_ptr<Experts> experts;  // set: a mixture of experts instead of gate_up/down
};

class DecodeStep {
 public:
  // Norm weights come as the scale they apply (Gemma's 1 + weight already added); cos/sin: the
  // rope tables [positions, rotated values], local_cos/local_sin the windowed layers' (Gemma).
  // k_scales/v_scales: a 1-byte pool's scales per layer ([slots, kv_heads] each), else empty.
  DecodeStep(py::dict cfg, py::list layers, py::tuple embed, py::tuple lm_head, const at::Tensor& final_norm,
             const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& local_cos, const at::Tensor& local_sin,
             std::vector<at::Tensor> k_buffers, std::vector<at::Tensor> v_buffers, std::vector<at::Tensor> k_scales,
             std::vector<at::Tensor> v_scales)
      : hidden_(cfg["hidden_size"].cast<int64_t>()),
        heads_(cfg["num_heads"].cast<int64_t>()),
        kv_heads_(cfg["num_kv_heads"].cast<int64_t>()),
        head_dim_(cfg["head_dim"].cast<int64_t>()),
        inter_(cfg["intermediate_size"].cast<int64_t>()),
        vocab_(cfg["vocab_size"].cast<int64_t>()),
        eps_(cfg["rms_norm_eps"].cast<float>()),
        attn_scale_(cfg["attn_scale"].cast<float>()),
        embed_scale_(cfg["embed_scale"].cast<float>()),
        softcap_(cfg["final_logit_softcap"].cast<float>()),
        gelu_(cfg["hidden_act"].cast<std::string>() == "gelu_tanh"),
        top_k_(cfg["num_experts_per_tok"].cast<int64_t>()),
        expert_size_(cfg["moe_intermediate_size"].cast<int64_t>()),
        renormalize_(cfg["norm_topk_prob"].cast<bool>()),
        bf16_products_(kHasBF16Products && cfg["bf16_products"].cast<bool>()),
        tile_products_(cfg["tile_products"].cast<bool>()),
        int8_activations_(cfg["int8_activations"].cast<bool>()),
        deterministic_(cfg["deterministic"].cast<bool>()),
        team_(cfg["num_threads"].cast<int>()),
        cos_(cos.contiguous()),
        sin_(sin.contiguous()),
        local_cos_(local_cos.contiguous()),
        local_sin_(local_sin.contiguous()),
        k_buffers_(std::move(k_buffers)),
        v_buffers_(std::move(v_buffers)),
        k_scales_(std::move(k_scales)),
        v_scales_(std::move(v_scales)) {
    for (const auto* t : {&cos_, &sin_, &local_cos_, &local_sin_}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->sizes() == cos_.sizes() && cos_.size(1) <= head_dim_ &&
                      cos_.size(1) % 2 == 0, "rope tables must be float32 [positions, an even count <= head_dim]");
    }
    TORCH_CHECK(cfg["hidden_act"].cast<std::string>() == "silu" || gelu_, "unknown activation");
    TORCH_CHECK(head_dim_ % 16 == 0 && head_dim_ <= 1024, "head_dim must be a multiple of 16, at most 1024");
    embed_ = weight(embed);
    lm_head_ = weight(lm_head);
    final_norm_ = keep_float(final_norm);
    for (auto item : layers) {
      auto l = item.cast<py::dict>();
      Layer layer;
      layer.qkv = fused(l["qkv"].cast<py::list>());
      layer.o = weight(l["o"].cast<py::tuple>());
      if (l.contains("gate_up")) {
        layer.gate_up = fused(l["gate_up"].cast<py::list>());
        layer.down = weight(l["down"].cast<py::tuple>());
      }
      layer.norm_in = keep_float(l["norm_in"].cast<at::Tensor>());
      layer.norm_post = keep_float(l["norm_post"].cast<at::Tensor>());
      if (l.contains("pre_ff_norm")) {
        layer.pre_ff_norm = keep_float(l["pre_ff_norm"].cast<at::Tensor>());
        layer.post_ff_norm = keep_float(l["post_ff_norm"].cast<at::Tensor>());
      }
      if (l.contains("q_norm")) {
        layer.q_norm = keep_float(l["q_norm"].cast<at::Tensor>(), head_dim_);
        layer.k_norm = keep_float(l["k_norm"].cast<at::Tensor>(), head_dim_);
      }
      if (l.contains("lora_qkv")) {
        const int64_t q = heads_ * head_dim_;
        layer.lora_qkv = lora_stack(l["lora_qkv"].cast<py::tuple>(), hidden_, q + 2 * kv_heads_ * head_dim_);
        layer.lora_o = lora_stack(l["lora_o"].cast<py::tuple>(), q, hidden_);
        if (l.contains("gate_up")) {
          layer.lora_gate_up = lora_stack(l["lora_gate_up"].cast<py::tuple>(), hidden_, 2 * inter_);
          layer.lora_down = lora_stack(l["lora_down"].cast<py::tuple>(), inter_, hidden_);
        }
      }
      layer.window = l["window"].cast<int64_t>();
      layer.local_rope = l["local_rope"].cast<bool>();
      if (l.contains("router")) {
        layer.experts = std::make_unique<Experts>();
        layer.experts->router = weight(l["router"].cast<py::tuple>());
        for (auto e : l["experts_gate_up"]) layer.experts->gate_up.push_back(weight(e.cast<py::tuple>()));
        for (auto e : l["experts_down"]) layer.experts->down.push_back(weight(e.cast<py::tuple>()));
        const auto& x = *layer.experts;
        TORCH_CHECK(x.router.k == hidden_ && x.router.n == static_cast<int64_t>(x.gate_up.size()) &&
                        x.down.size() == x.gate_up.size() && top_k_ >= 1 && top_k_ <= std::min<int64_t>(64, x.router.n),
                    "one gate/up and one down matrix per expert, top-k within the experts");
        num_experts_ = x.router.n;
        for (size_t e = 0; e < x.gate_up.size(); ++e) {
          TORCH_CHECK(x.gate_up[e].n == 2 * expert_size_ && x.gate_up[e].k == hidden_ && x.down[e].n == hidden_ &&
                          x.down[e].k == expert_size_, "expert weight shapes do not match the config");
        }
      }
      layers_.push_back(std::move(layer));
    }
    TORCH_CHECK(k_buffers_.size() == layers_.size() && v_buffers_.size() == layers_.size(), "one K and V buffer per layer");
    const auto kv_dtype = k_buffers_[0].scalar_type();
    for (size_t i = 0; i < layers_.size(); ++i) {
      for (const auto* b : {&k_buffers_[i], &v_buffers_[i]}) {
        TORCH_CHECK(b->is_contiguous() && b->dim() == 3 && b->size(1) == kv_heads_ && b->size(2) == head_dim_ &&
                        b->scalar_type() == kv_dtype, "KV buffers must be contiguous [slots, kv_heads, head_dim]");
      }
    }
    dispatch_kv(kv_dtype, [](auto*) {});  // refuses any other element type
    const bool scaled = k_buffers_[0].element_size() == 1;
    TORCH_CHECK(k_scales_.size() == (scaled ? layers_.size() : 0) && v_scales_.size() == k_scales_.size(),
                "one K and V scale tensor per layer for a 1-byte pool, none otherwise");
    for (size_t i = 0; i < k_scales_.size(); ++i) {
      check_kv_scales(k_buffers_[i], k_scales_[i]);
      check_kv_scales(v_buffers_[i], v_scales_[i]);
    }
    const int64_t qkv = (heads_ + 2 * kv_heads_) * head_dim_;
    TORCH_CHECK(embed_.k == hidden_ && lm_head_.k == hidden_ && lm_head_.n == vocab_, "embedding/lm_head shapes");
    for (const auto& l : layers_) {
      TORCH_CHECK(l.qkv.n == qkv && l.qkv.k == hidden_ && l.o.n == hidden_ && l.o.k == heads_ * head_dim_ &&
                      (l.experts || (l.gate_up.n == 2 * inter_ && l.gate_up.k == hidden_ && l.down.n == hidden_ &&
                                     l.down.k == inter_)), "layer weight shapes do not match the config");
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
    out["experts (router, products, activation)"] = profile_[kExperts];
    std::fill(profile_, profile_ + kKinds, 0.0);
    profiling_ = keep_on;
    return out;
  }

  // How many decode rows so far attended behind a prefix shared with other rows (attend_shared).
  int64_t shared_prefix_rows() const { return shared_prefix_rows_; }
  // How many decode rows so far attended in more than one piece (plan_pieces).
  int64_t split_rows() const { return split_rows_; }
  // How many outputs of products so far came from the matrix tiles (tile_products.h).
  int64_t tile_outputs() const { return tile_outputs_.load(); }

  // The threads of its pool: the count asked for, at most the cores the process may use.
  int num_threads() const { return team_.size(); }

  // input_ids, positions, out_cache_loc, req_pool_indices, seq_lens: int64 [M]; req_to_token: the
  // request-to-slot table, int64 [requests, W], whose row req_pool_indices[m] holds row m's KV
  // slots in its first seq_lens[m] entries (its own token's last). A prefill is one row per new
  // token (row m sees its request's first seq_lens[m] slots, the tokens before it in the pass
  // included: every row writes its KV before any row attends). lora_slots: int64 [M], each row's
  // adapter slot (-1: none), or empty (no adapters). logit_rows, hidden_rows: int64 row numbers.
  // Returns float32 logits [logit_rows, vocab] and the final normalised hidden states
  // [hidden_rows, hidden] (prompt logprobs: logits() turns them into logits).
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& input_ids, const at::Tensor& positions,
                                         const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
                                         const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                                         const at::Tensor& lora_slots, int64_t num_threads,
                                         const at::Tensor& logit_rows, const at::Tensor& hidden_rows) {
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
    const int64_t* lora = nullptr;
    if (lora_slots.numel() > 0) {
      TORCH_CHECK(lora_slots.scalar_type() == at::kLong && lora_slots.is_contiguous() && lora_slots.numel() == rows,
                  "lora_slots: int64, one per row");
      TORCH_CHECK(layers_[0].lora_qkv.a != nullptr, "lora_slots given to a step built without adapter slots");
      lora = lora_slots.data_ptr<int64_t>();
      lora_rows_.assign(layers_[0].lora_qkv.slots, {});
      for (int64_t m = 0; m < rows; ++m) {
        TORCH_CHECK(lora[m] >= -1 && lora[m] < layers_[0].lora_qkv.slots, "LoRA slot out of range");
        if (lora[m] >= 0) lora_rows_[lora[m]].push_back(m);
      }
      int64_t rank = 0;
      for (const Layer& l : layers_) rank = std::max({rank, l.lora_qkv.rank, l.lora_o.rank, l.lora_gate_up.rank, l.lora_down.rank});
      lora_t_.resize(rows * rank);
    }
    for (const auto* t : {&logit_rows, &hidden_rows}) {
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, "int64 row numbers");
      for (int64_t i = 0; i < t->numel(); ++i)
        TORCH_CHECK(t->data_ptr<int64_t>()[i] >= 0 && t->data_ptr<int64_t>()[i] < rows, "row number out of range");
    }
    at::Tensor logits = at::empty({logit_rows.numel(), vocab_}, input_ids.options().dtype(at::kFloat));
    at::Tensor hidden = at::empty({hidden_rows.numel(), hidden_}, input_ids.options().dtype(at::kFloat));
    run_start_.assign(1, 0);  // consecutive rows of one request, up to kRunRows (attend)
    longest_run_ = 1;
    for (int64_t m = 1; m <= rows; ++m) {
      const int64_t r0 = run_start_.back();
      if (m == rows || req[m] != req[r0] || m - r0 == kRunRows) {
        run_start_.push_back(m);
        longest_run_ = std::max(longest_run_, m - r0);
      }
    }
    find_shared_prefixes(req, lens, req_to_token.data_ptr<int64_t>(), req_to_token.size(1));
    plan_pieces(lens);
    if (!scratch_ || scratch_->rows < rows) {  // kept between steps: fresh pages each step cost faults
      scratch_ = std::make_unique<Scratch>(rows, hidden_, (heads_ + 2 * kv_heads_) * head_dim_, heads_ * head_dim_,
                                           inter_, num_experts_, top_k_, expert_size_);
    }
    Scratch& s = *scratch_;
    Batch b{rows, ids, positions.data_ptr<int64_t>(), out_cache_loc.data_ptr<int64_t>(), req_to_token.data_ptr<int64_t>(),
            req_to_token.size(1), req, lens, logit_rows.data_ptr<int64_t>(), logit_rows.numel(), logits.data_ptr<float>(),
            hidden_rows.data_ptr<int64_t>(), hidden_rows.numel(), hidden.data_ptr<float>(),
            lora != nullptr ? &lora_rows_ : nullptr};
    {
      py::gil_scoped_release no_gil;
      dispatch_kv(k_buffers_[0].scalar_type(), [&](auto* tag) {
        forward<std::remove_pointer_t<decltype(tag)>>(b, s, static_cast<int>(std::max<int64_t>(1, num_threads)));
      });
    }
    return {logits, hidden};
  }

  // Logits of final hidden states [rows, hidden] (from run's hidden_rows), as run computes them.
  at::Tensor logits(const at::Tensor& hidden, int64_t num_threads) {
    TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.is_contiguous() && hidden.dim() == 2 &&
                    hidden.size(1) == hidden_, "float32 hidden states [rows, hidden_size]");
    at::Tensor out = at::empty({hidden.size(0), vocab_}, hidden.options());
    py::gil_scoped_release no_gil;
    team_.run(static_cast<int>(std::max<int64_t>(1, num_threads)), [&](int tid, int nt) {
      const FlushDenormals flush;
      RowCopies xb;
      head(hidden.data_ptr<float>(), hidden.size(0), out.data_ptr<float>(), xb);
    });
    return out;
  }

 private:
  struct Batch {
    int64_t rows;
    const int64_t *ids, *pos, *loc, *table;
    int64_t width;
    const int64_t *req, *lens;
    const int64_t* logit_rows;
    int64_t num_logits;
    float* logits;
    const int64_t* hidden_rows;
    int64_t num_hidden;
    float* hidden;
    const std::vector<std::vector<int64_t>>* lora;  // the rows of each adapter slot; null: no adapters
  };
  // Activations (every value is written before it is read in a step).
  using Buffer = AlignedBuffer<float>;
  struct Scratch {
    int64_t rows;  // the largest batch it holds
    Buffer x, h, tmp, qkv, att, gate_up, act;
    Buffer router, expert_gate_up, expert_act, expert_out;  // a mixture of experts': one row per (token, choice)
    Scratch(int64_t m, int64_t hidden, int64_t qkv_n, int64_t q_n, int64_t inter, int64_t experts, int64_t top_k,
            int64_t expert_size)
        : rows(m), x(m * hidden), h(m * hidden), tmp(m * hidden), qkv(m * qkv_n), att(m * q_n),
          gate_up(m * 2 * inter), act(m * inter), router(m * experts), expert_gate_up(m * top_k * 2 * expert_size),
          expert_act(m * top_k * expert_size), expert_out(m * top_k * hidden) {}
  };

  // A batch's routing: its (token, choice) pairs grouped by expert, ascending (as layers/moe.py).
  struct Routing {
    std::vector<int64_t> row;       // each pair's token
    std::vector<float> weight;      // its routing weight
    std::vector<int64_t> start;     // expert e's pairs: start[e] .. start[e + 1] - 1
    std::vector<std::vector<int64_t>> of_row;  // each token's pairs, experts ascending
  };

  // A matrix as the step takes it; in groups of sixteen rows (int8_groups.h) where the products
  // round activations to int8.
  Weight weight(py::tuple t) {
    auto data = t[0].cast<at::Tensor>();
    keep_.push_back(data);
    c10::optional<at::Tensor> bias;
    if (!t[4].is_none()) {
      bias = t[4].cast<at::Tensor>().to(at::kFloat).contiguous();
      keep_.push_back(*bias);
    }
    return make_weight(data, t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<int64_t>(), bias,
                       /*grouped_ok=*/int8_activations_ && kHasInt8Gemm);
  }

  Fused fused(py::list parts) {
    Fused f;
    for (auto p : parts) {
      f.parts.push_back(weight(p.cast<py::tuple>()));
      f.n += f.parts.back().n;
      TORCH_CHECK(f.parts.back().k == f.parts[0].k, "the parts of a fused projection must have rows of one width");
    }
    TORCH_CHECK(!f.parts.empty() && f.parts.size() <= 4, "a fused projection has one to four parts");
    f.k = f.parts[0].k;
    return f;
  }

  LoRAStack lora_stack(py::tuple t, int64_t k, int64_t n) {
    const auto a = t[0].cast<at::Tensor>(), b = t[1].cast<at::Tensor>(), used = t[2].cast<at::Tensor>();
    const auto part_end = t[3].cast<std::vector<int64_t>>();
    TORCH_CHECK(used.scalar_type() == at::kByte && used.is_contiguous() && used.dim() == 3 &&
                    used.size(0) == a.size(0) && used.size(1) == a.size(1) &&
                    used.size(2) == static_cast<int64_t>(part_end.size()) && !part_end.empty() && part_end.back() == n,
                "LoRA slots' used rows must be uint8 [slots, rank, parts], the parts ending at the outputs' end");
    keep_.push_back(used);
    TORCH_CHECK((a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
                    b.scalar_type() == a.scalar_type() && a.is_contiguous() && b.is_contiguous() && a.dim() == 3 &&
                    b.dim() == 3 && a.size(2) == k && b.size(2) == n && b.size(0) == a.size(0) && b.size(1) == a.size(1),
                "LoRA slots must be contiguous float32 or bfloat16 A [slots, rank, in] and B^T [slots, rank, out]");
    keep_.push_back(a);
    keep_.push_back(b);
    return {a.data_ptr(), b.data_ptr(), a.scalar_type() == at::kBFloat16, used.data_ptr<uint8_t>(), a.size(0),
            a.size(1), k, n, part_end};
  }

  // Thread tid's output columns of w: whole groups where w is grouped.
  static void split_columns(const Weight& w, int tid, int nt, int64_t& n0, int64_t& n1) {
    const int64_t unit = w.grouped ? kGroupRows : 1;
    split_range(w.n / unit, tid, nt, n0, n1);
    n0 *= unit;
    n1 *= unit;
  }

  static Columns columns(const Weight& w, int tid, int nt) {
    Columns c;
    split_columns(w, tid, nt, c.begin[0], c.end[0]);
    c.count = 1;
    return c;
  }

  static Columns columns(const Fused& f, int tid, int nt) {
    Columns c;
    int64_t first = 0;
    for (const Weight& w : f.parts) {
      split_columns(w, tid, nt, c.begin[c.count], c.end[c.count]);
      c.begin[c.count] += first;
      c.end[c.count++] += first;
      first += w.n;
    }
    return c;
  }

  // The first half of each row's adapter delta (x A^T) B^T: t = x A^T into lora_t_ [rows, rank]
  // (x's rows l.k wide), this thread's share of each adapter's rank rows, so that its matrices are
  // read once per pass: then a barrier, then lora_expand. An adapter's rows go together; the rank
  // rows no part uses (padding up to the slot's rank) are skipped, as lora_expand skips them.
  template <typename E>
  void lora_shrink(const LoRAStack& l, const Batch& b, const float* x, int tid, int nt) {
    const size_t parts = l.part_end.size();
    for (size_t slot = 0; slot < b.lora->size(); ++slot) {
      const std::vector<int64_t>& rows = (*b.lora)[slot];
      if (rows.empty()) continue;
      int64_t j0, j1;
      split_range(l.rank, tid, nt, j0, j1);
      const E* a = static_cast<const E*>(l.a) + slot * l.rank * l.k;
      const uint8_t* used = l.used + slot * l.rank * parts;
      for (int64_t j = j0; j < j1; ++j) {
        if (std::none_of(used + j * parts, used + (j + 1) * parts, [](uint8_t u) { return u != 0; })) continue;
        const E* aj = a + j * l.k;
        size_t r = 0;
        for (; r + 4 <= rows.size(); r += 4) {
          const float* xs[4] = {x + rows[r] * l.k, x + rows[r + 1] * l.k, x + rows[r + 2] * l.k, x + rows[r + 3] * l.k};
          float t[4];
          dot4(aj, xs, l.k, t);
          for (int q = 0; q < 4; ++q) lora_t_[rows[r + q] * l.rank + j] = t[q];
        }
        for (; r < rows.size(); ++r) lora_t_[rows[r] * l.rank + j] = dot(aj, x + rows[r] * l.k, l.k);
      }
    }
  }

  // The second half: adds t_j times row j of B^T to this thread's fixed share of the columns of
  // out [rows, ldo] (the barrier after lora_shrink put the projection's columns there, whichever
  // thread computed them), j in order, skipping the rows of B^T that are zero over a part.
  template <typename E, typename W>
  void lora_expand(const LoRAStack& l, const W& w, const Batch& b, float* out, int64_t ldo, int tid, int nt) const {
    const Columns c = columns(w, tid, nt);
    std::vector<const E*> bj(l.rank);
    std::vector<float> tj(l.rank);
    for (size_t slot = 0; slot < b.lora->size(); ++slot) {
      const std::vector<int64_t>& rows = (*b.lora)[slot];
      const E* bt = static_cast<const E*>(l.b) + slot * l.rank * l.n;
      const uint8_t* used = l.used + slot * l.rank * l.part_end.size();
      for (int i = 0; i < c.count && !rows.empty(); ++i) {
        for (size_t p = 0, p0 = 0; p < l.part_end.size(); p0 = l.part_end[p++]) {
          const int64_t c0 = std::max<int64_t>(c.begin[i], p0), c1 = std::min(c.end[i], l.part_end[p]);
          std::vector<int64_t> js;
          for (int64_t j = 0; j < l.rank && c0 < c1; ++j)
            if (used[j * l.part_end.size() + p]) js.push_back(j);
          for (size_t q = 0; q < js.size(); ++q) bj[q] = bt + js[q] * l.n + c0;
          for (const int64_t m : rows) {
            if (js.empty()) break;
            for (size_t q = 0; q < js.size(); ++q) tj[q] = lora_t_[m * l.rank + js[q]];
            axpy_rows(tj.data(), bj.data(), static_cast<int>(js.size()), out + m * ldo + c0, c1 - c0);
          }
        }
      }
    }
  }

  // Each row's adapter delta added to out (a projection's product, w's, of x), if the pass has
  // adapters: lora_shrink, a barrier, lora_expand.
  template <typename W>
  void lora_add(const LoRAStack& l, const W& w, const Batch& b, const float* x, float* out, int64_t ldo, int tid,
                int nt) {
    if (b.lora == nullptr || l.a == nullptr) return;
    if (l.bf16) {
      lora_shrink<uint16_t>(l, b, x, tid, nt);
      team_.barrier();
      lora_expand<uint16_t>(l, w, b, out, ldo, tid, nt);
    } else {
      lora_shrink<float>(l, b, x, tid, nt);
      team_.barrier();
      lora_expand<float>(l, w, b, out, ldo, tid, nt);
    }
  }

  const float* keep_float(const at::Tensor& t, int64_t n = -1) {
    keep_.push_back(t.to(at::kFloat).contiguous());
    TORCH_CHECK(keep_.back().numel() == (n < 0 ? hidden_ : n), "norm weights must have ", (n < 0 ? hidden_ : n),
                " values");
    return keep_.back().data_ptr<float>();
  }

  // out = x * rsqrt(mean(x^2) + eps) * w, one row (may be x).
  void rms_norm(const float* x, const float* w, float* out) const {
    float ss = 0.f;
    for (int64_t i = 0; i < hidden_; ++i) ss += x[i] * x[i];
    const float r = 1.f / std::sqrt(ss / hidden_ + eps_);
    for (int64_t i = 0; i < hidden_; ++i) out[i] = w[i] * (x[i] * r);
  }

  // The fewest output columns a thread claims at a time: at batch 1, 16 of the default model's
  // 576-wide Q4_1 rows are ~1.3 us of float32 work (~4.5 ns a block of 32 on a Zen 3 core), against
  // one compare-and-swap to claim them.
  static constexpr int64_t kMinChunk = 16;

  // This thread's share of out[rows, w.n] = x[rows, w.k] w^T: the chunks of output columns it
  // claims (StepTeam::share), and after each, after(c0, c1) if given; copies: its copy of x in the
  // form the products take (every thread makes its own: no barrier, and the same values).
  // ldo: out's row stride (w.n unless w is part of a fused projection).
  template <typename After = std::nullptr_t>
  void linear(const Weight& w, const float* x, int64_t rows, float* out, RowCopies& copies, int64_t ldo = 0,
              After after = nullptr) const {
    if (ldo == 0) ldo = w.n;
    const int64_t rows_unit = w.grouped ? kGroupRows : 1;  // a grouped weight's rows are claimed by whole groups
    auto each_chunk = [&](int64_t unit, auto&& product) {
      team_.share(w.n, unit, std::max<int64_t>(unit, kMinChunk), [&](int64_t n0, int64_t n1) {
        product(n0, n1);
        if constexpr (!std::is_same_v<After, std::nullptr_t>) after(n0, n1);
      });
    };
    if (tile_products_ && !deterministic_ && rows >= kTileMinRows && w.k % 32 == 0) {  // whole panels a claim
      copies.bf16.resize(rows * w.k);
      rows_to_bf16(x, w.k, rows, w.k, copies.bf16.data());
      each_chunk(kTilePanel, [&](int64_t n0, int64_t n1) {
        product_tiles(w, copies.bf16.data(), rows, out, ldo, n0, n1);
        tile_outputs_.fetch_add(rows * (n1 - n0), std::memory_order_relaxed);
      });
      return;
    }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (w.grouped) {
      quantize_rows_q8(x, w.k, rows, w.k, copies.int8);
      each_chunk(rows_unit, [&](int64_t n0, int64_t n1) { product_grouped(w, copies.int8, out, ldo, n0, n1); });
      return;
    }
#endif
    if (int8_activations_ && takes_kquant_rows(w.type, rows, w.k, deterministic_)) {
      quantize_rows_q8(x, w.k, rows, w.k, copies.int8);
      each_chunk(rows_unit, [&](int64_t n0, int64_t n1) { product_kquant_rows(w, copies.int8, out, ldo, n0, n1); });
      return;
    }
    if (int8_activations_ && takes_int8_panels(w.type, rows, deterministic_)) {
      quantize_rows_q8(x, w.k, rows, w.k, copies.int8);
      each_chunk(kPanelGroup, [&](int64_t n0, int64_t n1) { product_int8_panels(w, copies.int8, out, ldo, n0, n1); });
      return;
    }
    if (int8_activations_ && (has_int8_products(w.type) || has_int8_gemm(w.type))) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if (takes_int8_gemm(w.type, rows, deterministic_)) {
        quantize_rows_q8(x, w.k, rows, w.k, copies.int8);
        each_chunk(rows_unit, [&](int64_t n0, int64_t n1) { product_int8(w, copies.int8, out, ldo, n0, n1); });
        return;
      }
#endif
      if (rows < kInt8MaxRows || deterministic_) {
        quantize_rows_q8(x, w.k, rows, w.k, copies.int8);
        each_chunk(rows_unit, [&](int64_t n0, int64_t n1) { product_q8(w, copies.int8, out, ldo, n0, n1); });
        return;
      }
    }
#if defined(__AVX512BF16__)
    if (bf16_products_ && (rows >= kBF16MinRows || deterministic_) && w.k % 32 == 0) {
      copies.bf16.resize(rows * w.k);
      to_bf16_rows(x, w.k, rows, w.k, copies.bf16.data());
      each_chunk(rows_unit, [&](int64_t n0, int64_t n1) { product_bf16(w, copies.bf16.data(), rows, out, ldo, n0, n1); });
      return;
    }
#endif
    if (kHasBlasProducts && !deterministic_ && rows >= kBlasMinRows && w.k % 32 == 0) {  // whole panels a claim
      each_chunk(kBlasPanel, [&](int64_t n0, int64_t n1) { product_blas(w, x, rows, out, ldo, n0, n1); });
      return;
    }
    each_chunk(rows_unit, [&](int64_t n0, int64_t n1) { product(w, x, w.k, rows, out, ldo, n0, n1); });
  }

  // The same over a fused projection: each part's outputs in its columns of out [rows, f.n].
  void linear(const Fused& f, const float* x, int64_t rows, float* out, RowCopies& copies) const {
    int64_t first = 0;
    for (const Weight& w : f.parts) {
      linear(w, x, rows, out + first, copies, f.n);
      first += w.n;
    }
  }

  // The activation of a gate/up row into out[0 .. n): SiLU(gate) * up or GELU-tanh(gate) * up,
  // values i0 .. i1 - 1.
  void activate(const float* g, int64_t n, float* out, int64_t i0, int64_t i1) const {
    if (gelu_) {
      constexpr float kC = 0.7978845608028654f;  // sqrt(2 / pi)
      for (int64_t i = i0; i < i1; ++i) {
        const float v = g[i];
        out[i] = 0.5f * v * (1.f + std::tanh(kC * (v + 0.044715f * v * v * v))) * g[n + i];
      }
      return;
    }
    for (int64_t i = i0; i < i1; ++i) out[i] = -g[i];
    exp_inplace(out + i0, i1 - i0);
    for (int64_t i = i0; i < i1; ++i) out[i] = g[i] / (1.f + out[i]) * g[n + i];
  }

  // Each token's top-k experts from its router logits, as layers/moe.py's route: softmax over all
  // experts, the k largest (the lower index first on a tie), optionally renormalised to sum to one.
  void route(const float* logits, int64_t rows, Routing& r) const {
    const int64_t E = num_experts_, K = top_k_;
    std::vector<std::vector<std::pair<int64_t, float>>> by_expert(E);
    std::vector<float> p(E);
    for (int64_t m = 0; m < rows; ++m) {
      const float* l = logits + m * E;
      const float mx = *std::max_element(l, l + E);
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
      int64_t chosen[64];
      float w[64], picked = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
          if (std::find(chosen, chosen + k, e) == chosen + k && (best < 0 || p[e] > p[best])) best = e;
        }
        chosen[k] = best;
        picked += (w[k] = p[best]);
      }
      for (int64_t k = 0; k < K; ++k) by_expert[chosen[k]].push_back({m, renormalize_ ? w[k] / picked : w[k]});
    }
    r.row.clear();
    r.weight.clear();
    r.start.assign(1, 0);
    r.of_row.assign(rows, {});
    for (int64_t e = 0; e < E; ++e) {
      for (const auto& [m, w] : by_expert[e]) {
        r.of_row[m].push_back(static_cast<int64_t>(r.row.size()));
        r.row.push_back(m);
        r.weight.push_back(w);
      }
      r.start.push_back(static_cast<int64_t>(r.row.size()));
    }
  }

  template <typename T>
  void forward(const Batch& b, Scratch& s, int nthreads) {
    const int64_t H = hidden_, M = b.rows;
    team_.run(nthreads, [&](int tid, int nt) {
      const FlushDenormals flush;
      RowCopies xb;  // this thread's copy of a product's activations
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
      split_range(M, tid, nt, r0, r1);
      for (int64_t m = r0; m < r1; ++m) {
        float* x = s.x.data() + m * H;
        dequantize_row(embed_, b.ids[m], x);
        if (embed_scale_ != 1.f) for (int64_t i = 0; i < H; ++i) x[i] *= embed_scale_;
        rms_norm(x, layers_[0].norm_in, s.h.data() + m * H);
      }
      team_.barrier();
      mark(kOther);
      for (size_t li = 0; li < layers_.size(); ++li) {
        const Layer& l = layers_[li];
        linear(l.qkv, s.h.data(), M, s.qkv.data(), xb);
        lora_add(l.lora_qkv, l.qkv, b, s.h.data(), s.qkv.data(), l.qkv.n, tid, nt);
        team_.barrier();
        mark(kMatmul);
        rope_and_store<T>(b, s, li, tid, nt);
        team_.barrier();
        mark(kOther);
        attend<T>(b, s, li, tid, nt);
        team_.barrier();
        mark(kAttention);
        linear(l.o, s.att.data(), M, s.tmp.data(), xb);
        lora_add(l.lora_o, l.o, b, s.att.data(), s.tmp.data(), H, tid, nt);
        team_.barrier();
        mark(kMatmul);
        for (int64_t m = r0; m < r1; ++m) {
          float* x = s.x.data() + m * H;
          float* o = s.tmp.data() + m * H;
          if (l.pre_ff_norm != nullptr) rms_norm(o, l.norm_post, o);  // Gemma: the output normalised first
          for (int64_t i = 0; i < H; ++i) x[i] += o[i];
          rms_norm(x, l.pre_ff_norm != nullptr ? l.pre_ff_norm : l.norm_post, s.h.data() + m * H);
        }
        team_.barrier();
        mark(kOther);
        if (l.experts) {
          experts(*l.experts, s, M, tid, nt, xb, mark);
        } else {
          linear(l.gate_up, s.h.data(), M, s.gate_up.data(), xb);
          lora_add(l.lora_gate_up, l.gate_up, b, s.h.data(), s.gate_up.data(), 2 * inter_, tid, nt);
          team_.barrier();
          mark(kMatmul);
          int64_t i0, i1;
          split_range(inter_, tid, nt, i0, i1);
          for (int64_t m = 0; m < M; ++m) activate(s.gate_up.data() + m * 2 * inter_, inter_, s.act.data() + m * inter_, i0, i1);
          team_.barrier();
          mark(kOther);
          linear(l.down, s.act.data(), M, s.tmp.data(), xb);
          lora_add(l.lora_down, l.down, b, s.act.data(), s.tmp.data(), H, tid, nt);
          team_.barrier();
          mark(kMatmul);
        }
        const float* next_norm = li + 1 < layers_.size() ? layers_[li + 1].norm_in : final_norm_;
        for (int64_t m = r0; m < r1; ++m) {
          float* x = s.x.data() + m * H;
          float* out = s.tmp.data() + m * H;
          if (l.experts) {  // the weighted sum of the token's experts, in ascending expert order
            std::fill(out, out + H, 0.f);
            for (const int64_t pair : routing_.of_row[m]) {
              const float* d = s.expert_out.data() + pair * H;
              const float w = routing_.weight[pair];
              for (int64_t i = 0; i < H; ++i) out[i] += d[i] * w;
            }
          }
          if (l.post_ff_norm != nullptr) rms_norm(out, l.post_ff_norm, out);
          for (int64_t i = 0; i < H; ++i) x[i] += out[i];
          rms_norm(x, next_norm, s.h.data() + m * H);
        }
        team_.barrier();
        mark(kOther);
      }
      // The rows that need them: their hidden states out, and gathered for the logits.
      int64_t i0, i1;
      split_range(b.num_hidden, tid, nt, i0, i1);
      for (int64_t i = i0; i < i1; ++i) std::memcpy(b.hidden + i * H, s.h.data() + b.hidden_rows[i] * H, H * sizeof(float));
      split_range(b.num_logits, tid, nt, i0, i1);
      for (int64_t i = i0; i < i1; ++i) std::memcpy(s.tmp.data() + i * H, s.h.data() + b.logit_rows[i] * H, H * sizeof(float));
      team_.barrier();
      head(s.tmp.data(), b.num_logits, b.logits, xb);
      mark(kLogits);  // thread 0's share: the pool waits for the others before run() returns
    });
  }

  // The logits of final hidden states h [rows, hidden] into out [rows, vocab]: the columns this
  // thread claims (linear).
  void head(const float* h, int64_t rows, float* out, RowCopies& xb) const {
    if (softcap_ <= 0.f) return linear(lm_head_, h, rows, out, xb);
    linear(lm_head_, h, rows, out, xb, 0, [&](int64_t n0, int64_t n1) {  // Gemma: into (-cap, cap)
      for (int64_t m = 0; m < rows; ++m) {
        float* row = out + m * vocab_;
        for (int64_t j = n0; j < n1; ++j) row[j] = std::tanh(row[j] / softcap_) * softcap_;
      }
    });
  }

  // A mixture of experts over s.h: the router's logits, each token's top-k experts (every thread
  // routes the whole batch, the same way, so no barrier is needed for it), then each active
  // expert's gate/up product over its tokens, the activation, and its down product into one row
  // per (token, choice) of s.expert_out; the caller adds them up per token.
  template <typename Mark>
  void experts(const Experts& x, Scratch& s, int64_t M, int tid, int nt, RowCopies& xb, Mark& mark) {
    const int64_t H = hidden_, S = expert_size_;
    linear(x.router, s.h.data(), M, s.router.data(), xb);
    team_.barrier();
    mark(kExperts);
    if (tid == 0) route(s.router.data(), M, routing_);
    team_.barrier();
    const Routing& r = routing_;
    // This thread's copy of the tokens, grouped by expert (kept between layers and steps: the
    // pool's threads live as long as the step).
    thread_local std::vector<float> gathered;
    gathered.resize(r.row.size() * H);
    for (size_t p = 0; p < r.row.size(); ++p) std::memcpy(gathered.data() + p * H, s.h.data() + r.row[p] * H, H * sizeof(float));
    for (int64_t e = 0; e < num_experts_; ++e) {
      const int64_t p0 = r.start[e], n = r.start[e + 1] - p0;
      if (n > 0) linear(x.gate_up[e], gathered.data() + p0 * H, n, s.expert_gate_up.data() + p0 * 2 * S, xb);
    }
    team_.barrier();
    mark(kExperts);
    int64_t i0, i1;
    split_range(S, tid, nt, i0, i1);
    for (size_t p = 0; p < r.row.size(); ++p) activate(s.expert_gate_up.data() + p * 2 * S, S, s.expert_act.data() + p * S, i0, i1);
    team_.barrier();
    mark(kExperts);
    for (int64_t e = 0; e < num_experts_; ++e) {
      const int64_t p0 = r.start[e], n = r.start[e + 1] - p0;
      if (n > 0) linear(x.down[e], s.expert_act.data() + p0 * S, n, s.expert_out.data() + p0 * H, xb);
    }
    team_.barrier();
    mark(kExperts);
  }

  // Rotates each row's queries and keys to its position (rotate-half layout over the tables'
  // first values, the rest passing through; the sine table carries the sign) and writes its key
  // and value to its KV slot (a 1-byte pool: each head rounded with its scale).
  template <typename T>
  void rope_and_store(const Batch& b, Scratch& s, size_t layer, int tid, int nt) {
    const int64_t D = head_dim_, R = cos_.size(1), half = R / 2, qk_heads = heads_ + kv_heads_;
    const Layer& l = layers_[layer];
    const float* cos = (l.local_rope ? local_cos_ : cos_).data_ptr<float>();
    const float* sin = (l.local_rope ? local_sin_ : sin_).data_ptr<float>();
    const int64_t qkv_n = (heads_ + 2 * kv_heads_) * D, tasks = b.rows * (qk_heads + kv_heads_);
    T* kp = static_cast<T*>(k_buffers_[layer].data_ptr());
    T* vp = static_cast<T*>(v_buffers_[layer].data_ptr());
    float tmp[1024];
    for (int64_t t = tasks * tid / nt; t < tasks * (tid + 1) / nt; ++t) {
      const int64_t m = t / (qk_heads + kv_heads_), h = t % (qk_heads + kv_heads_);
      float* v = s.qkv.data() + m * qkv_n + h * D;
      if (h < qk_heads) {
        if (l.q_norm != nullptr) {  // Qwen3, Gemma: this head's RMSNorm before rope
          const float* w = h < heads_ ? l.q_norm : l.k_norm;
          float ss = 0.f;
          for (int64_t i = 0; i < D; ++i) ss += v[i] * v[i];
          const float r = 1.f / std::sqrt(ss / D + eps_);
          for (int64_t i = 0; i < D; ++i) v[i] = w[i] * (v[i] * r);
        }
        const float* c = cos + b.pos[m] * R;
        const float* sn = sin + b.pos[m] * R;
        for (int64_t i = 0; i < R; ++i) tmp[i] = v[i] * c[i] + v[(i + half) % R] * sn[i];
        std::memcpy(v, tmp, R * sizeof(float));
        if (h >= heads_) store_head<T>(v, kp, k_scales_, layer, b.loc[m], h - heads_);
      } else {
        store_head<T>(v, vp, v_scales_, layer, b.loc[m], h - qk_heads);
      }
    }
  }

  // Head kvh of slot `slot` in a layer's K or V buffer `buf` (and its scale, a 1-byte pool's).
  template <typename T>
  void store_head(const float* v, T* buf, const std::vector<at::Tensor>& scales, size_t layer, int64_t slot,
                  int64_t kvh) const {
    const int64_t D = head_dim_;
    T* dst = buf + (slot * kv_heads_ + kvh) * D;
    if constexpr (kScaledKV<T>) {
      quantize_head(v, D, dst, scales[layer].data_ptr<float>() + slot * kv_heads_ + kvh);
    } else {
      for (int64_t i = 0; i < D; ++i) dst[i] = from_float<T>(v[i]);
    }
  }

  // Rows attend in runs: consecutive rows of one request (a prefill's tokens, a verify pass's
  // drafts), up to kRunRows, share each block of keys and values (attention.h: attend_lanes in
  // the default mode, attend_rows in the deterministic one). In a windowed layer each row goes
  // alone (its window starts where its own does). A task is a run's KV heads kvh0 .. kvh0 + H - 1:
  // all of them when the batch is many single rows (a slot's heads are adjacent in the pool and
  // read as one run: a batch-32 step's attention took 0.7x the time of head by head), else one.
  // Tasks go head by head (a head's keys stay in cache from run to run), dealt round-robin: a
  // prefill's later rows see more keys.
  static constexpr int64_t kRunRows = 64;

  // Decode rows whose requests share a prefix of KV slots (the default mode's, in layers without
  // a window): rows grouped by their first slot, a group a unit if its rows' slots agree on at
  // least kMinShared keys (the unit's shared length: the fewest any of them agrees with its first
  // row on). attend_shared reads those keys once for the unit. solo_runs_: the other runs.
  static constexpr int64_t kMinShared = 32;
  struct SharedUnit {
    std::vector<int64_t> rows;
    int64_t shared;
  };

  // Rows per unit: the fewest whose query heads (G each) fill whole vectors of lanes, at least
  // two vectors; then halved while the units would give fewer than two tasks a thread (a unit's
  // lanes are each their own arithmetic, so how rows are grouped changes only the speed). Each
  // unit reads the shared keys once. On a 2-core EPYC (Zen 3, G = 3), 16 rows behind a 512-token
  // prefix took 0.72 s of attention over 16 decode rounds in two units of 8 against 0.88 s in
  // eight units of 2 (the old rule: 6 of a vector's 8 lanes); a round 120 against 132 ms (5 runs
  // of each, alternated in one process).
  static size_t rows_per_unit(int64_t G) {
    const int64_t whole = kLanes / std::gcd<int64_t>(kLanes, G);  // rows that fill whole vectors
    const int64_t least = (2 * kLanes + G - 1) / G;
    return static_cast<size_t>((least + whole - 1) / whole * whole);
  }

  void find_shared_prefixes(const int64_t* req, const int64_t* lens, const int64_t* table, int64_t width) {
    const int64_t runs = static_cast<int64_t>(run_start_.size()) - 1;
    units_.clear();
    solo_runs_.clear();
    std::vector<bool> in_unit(runs, false);
    if (!deterministic_) {
      std::unordered_map<int64_t, std::vector<int64_t>> by_first;  // first slot -> single-row runs
      for (int64_t r = 0; r < runs; ++r)
        if (run_start_[r + 1] - run_start_[r] == 1) by_first[table[req[run_start_[r]] * width]].push_back(r);
      for (auto& [slot, group] : by_first) {
        if (group.size() < 2) continue;
        const int64_t m0 = run_start_[group[0]];
        const int64_t* first = table + req[m0] * width;
        int64_t shared = lens[m0];
        for (size_t i = 1; i < group.size() && shared >= kMinShared; ++i) {
          const int64_t m = run_start_[group[i]];
          const int64_t* other = table + req[m] * width;
          int64_t n = 0;
          const int64_t most = std::min(shared, lens[m]);
          while (n < most && other[n] == first[n]) ++n;
          shared = n;
        }
        if (shared < kMinShared) continue;
        size_t per_unit = rows_per_unit(heads_ / kv_heads_);
        while (per_unit > 2 && (group.size() + per_unit - 1) / per_unit * kv_heads_ < 2 * team_.size())
          per_unit = (per_unit + 1) / 2;  // fewer tasks than two a thread: smaller units
        for (size_t i = 0; i < group.size(); i += per_unit) {
          SharedUnit unit{{}, shared};
          for (size_t j = i; j < std::min(group.size(), i + per_unit); ++j) {
            unit.rows.push_back(run_start_[group[j]]);
            in_unit[group[j]] = true;
          }
          units_.push_back(std::move(unit));
        }
        shared_prefix_rows_ += static_cast<int64_t>(group.size());
      }
    }
    for (int64_t r = 0; r < runs; ++r)
      if (!in_unit[r]) solo_runs_.push_back(r);
  }

  // Decode rows alone in their runs (outside the deterministic mode, whose rows must keep a
  // prefill's arithmetic) attend in pieces, each piece a task of its own, their results merged by
  // their log-sum-exps (merge_pieces): one long request's attention no longer falls to one thread
  // (a batch-1 step of the default model, 3 KV heads read together as one task, left the other
  // thread idle). A piece holds at least kMinPiece keys and about 1/kPieceTasks of all such rows'
  // keys together, so a batch of many rows is not split (a batch of 32 rows of 400 keys, each in
  // two pieces, took 1.05-1.3x the attention time of one piece each). A batch of one row, which
  // nothing else can balance, goes in pieces from kLoneMinPiece keys: on a 2-core EPYC (Zen 3)
  // pieces of 64 keys took a batch-1 step of the default model at 130-160 keys from 1.22 to 1.01
  // ms of attention, and made batches of 2 and 4 rows 2-3% slower. The pieces depend on the
  // batch's rows alone, not on the threads. pieces_: the solo runs' tasks, in solo-run order; a
  // piece's part (-1 for a run of one piece) names its output in part_out_ and part_lse_.
  static constexpr int64_t kMinPiece = 256, kLoneMinPiece = 64, kPieceTasks = 16;
  struct Piece {
    int64_t row, rows, lo, hi, part;  // the run of `rows` rows from `row`; its (one row's) keys lo .. hi - 1
  };
  struct Split {
    int64_t row, part0, parts;  // the row whose attention is parts part0 .. part0 + parts - 1
  };

  void plan_pieces(const int64_t* lens) {
    pieces_.clear();
    splits_.clear();
    int64_t parts = 0;
    const bool windows_only = std::all_of(layers_.begin(), layers_.end(), [](const Layer& l) { return l.window > 0; });
    auto whole = [&](size_t r) {
      return deterministic_ || windows_only || run_start_[solo_runs_[r] + 1] - run_start_[solo_runs_[r]] > 1;
    };
    int64_t keys = 0;
    for (size_t r = 0; r < solo_runs_.size(); ++r)
      if (!whole(r)) keys += lens[run_start_[solo_runs_[r]]];
    const int64_t least = run_start_.back() == 1 ? kLoneMinPiece : kMinPiece;
    const int64_t piece = std::max(least, (keys + kPieceTasks - 1) / kPieceTasks);
    for (size_t r = 0; r < solo_runs_.size(); ++r) {
      const int64_t m0 = run_start_[solo_runs_[r]], len = lens[m0];
      const int64_t n = whole(r) ? 1 : (len + piece - 1) / piece;
      if (n == 1) {
        pieces_.push_back({m0, run_start_[solo_runs_[r] + 1] - m0, 0, len, -1});
        continue;
      }
      splits_.push_back({m0, parts, n});
      ++split_rows_;
      for (int64_t i = 0; i < n; ++i)  // near-equal pieces, whole blocks of 32 keys but the last
        pieces_.push_back({m0, 1, i * len / n / 32 * 32, i + 1 < n ? (i + 1) * len / n / 32 * 32 : len, parts++});
    }
    part_out_.resize(parts * heads_ * head_dim_);
    part_lse_.resize(parts * heads_);
  }

  // Each split row's query heads: its pieces' outputs weighted by exp(lse - the largest lse),
  // divided by the weights' sum, pieces in order.
  void merge_pieces(Scratch& s, int tid, int nt) {
    const int64_t D = head_dim_, items = static_cast<int64_t>(splits_.size()) * heads_;
    for (int64_t t = tid; t < items; t += nt) {
      const Split& sp = splits_[t / heads_];
      const int64_t h = t % heads_;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < sp.parts; ++i) top = std::max(top, part_lse_[(sp.part0 + i) * heads_ + h]);
      float* out = s.att.data() + sp.row * heads_ * D + h * D;
      std::fill(out, out + D, 0.f);
      float total = 0.f;
      for (int64_t i = 0; i < sp.parts; ++i) {
        const float w = std::exp(part_lse_[(sp.part0 + i) * heads_ + h] - top);
        const float* o = part_out_.data() + ((sp.part0 + i) * heads_ + h) * D;
        for (int64_t d = 0; d < D; ++d) out[d] += w * o[d];
        total += w;
      }
      for (int64_t d = 0; d < D; ++d) out[d] /= total;
    }
  }

  template <typename T>
  void attend(const Batch& b, Scratch& s, size_t layer, int tid, int nt) {
    const int64_t D = head_dim_, G = heads_ / kv_heads_, qkv_n = (heads_ + 2 * kv_heads_) * D;
    const int64_t window = layers_[layer].window;
    const bool alone = window > 0;  // each row a run of its own, and no units
    const int64_t runs = alone ? b.rows : static_cast<int64_t>(pieces_.size());  // a piece a task (per H heads)
    const int64_t units = alone ? 0 : static_cast<int64_t>(units_.size());
    auto first_row = [&](int64_t run) { return alone ? run : pieces_[run].row; };
    auto run_rows = [&](int64_t run) { return alone ? 1 : pieces_[run].rows; };
    const int64_t longest = alone ? 1 : longest_run_;
    // Decode rows alone take several KV heads a task: a key's heads are then read together, one
    // stretch of the slot's row (a batch-1 step of the 1.7B shape: 2.8 ms of attention with a head
    // a task); halved while that leaves fewer than two tasks a thread. A head's sums are the same
    // whatever H.
    int64_t H = longest == 1 ? kv_heads_ : 1;
    while (H % 2 == 0 && runs * (kv_heads_ / H) < 2 * nt) H /= 2;
    const int64_t groups = kv_heads_ / H;
    const int64_t unit_tasks = units * kv_heads_, tasks = unit_tasks + runs * groups;
    const bool scaled = !k_scales_.empty();
    const KVPool<T> kv{static_cast<const T*>(k_buffers_[layer].data_ptr()), static_cast<const T*>(v_buffers_[layer].data_ptr()),
                       kv_heads_, D, scaled ? k_scales_[layer].data_ptr<float>() : nullptr,
                       scaled ? v_scales_[layer].data_ptr<float>() : nullptr};
    thread_local AttnScratch ws;  // the pool's threads live as long as the step
    thread_local LaneScratch lanes;
    thread_local std::vector<const float*> q_rows;
    thread_local std::vector<float*> out_rows;
    thread_local std::vector<const int64_t*> slot_rows;
    thread_local std::vector<int64_t> unit_lens;
    int64_t lens[kRunRows];
    auto unit_task = [&](int64_t t) {
      const SharedUnit& unit = units_[t % units];
      const int64_t kvh = t / units;
      q_rows.clear();
      out_rows.clear();
      slot_rows.clear();
      unit_lens.clear();
      for (int64_t m : unit.rows) {
        q_rows.push_back(s.qkv.data() + m * qkv_n + kvh * G * D);
        out_rows.push_back(s.att.data() + m * heads_ * D + kvh * G * D);
        slot_rows.push_back(b.table + b.req[m] * b.width);
        unit_lens.push_back(b.lens[m]);
      }
      attend_shared(kv, q_rows.data(), attn_scale_, slot_rows.data(), unit_lens.data(),
                    static_cast<int64_t>(unit.rows.size()), unit.shared, kvh, G, out_rows.data(), ws, lanes, bf16_products_);
    };
    auto run_task = [&](int64_t t) {
      const int64_t run = t % runs, m0 = first_row(run), R = run_rows(run), kvh0 = (t / runs) * H;
      const int64_t first = alone ? std::max<int64_t>(0, b.lens[m0] - window) : pieces_[run].lo;
      for (int64_t r = 0; r < R; ++r) lens[r] = (R == 1 && !alone ? pieces_[run].hi : b.lens[m0 + r]) - first;
      const int64_t part = alone ? -1 : pieces_[run].part;
      const float* q = s.qkv.data() + m0 * qkv_n + kvh0 * G * D;
      float* out = (part < 0 ? s.att.data() + m0 * heads_ * D : part_out_.data() + part * heads_ * D) + kvh0 * G * D;
      const int64_t* slots = b.table + b.req[m0] * b.width + first;
      if (!deterministic_ && H == 1 && takes_lanes(R, G, D))
        attend_lanes(kv, q, qkv_n, attn_scale_, slots, lens, R, kvh0, G, out, heads_ * D, lanes, bf16_products_);
      else
        attend_rows(kv, q, qkv_n, attn_scale_, slots, lens, R, kvh0, H, G, out, heads_ * D, ws);
      if (part >= 0)  // one row: ws holds its query heads' running maxima and sums
        for (int64_t g = 0; g < H * G; ++g) part_lse_[part * heads_ + kvh0 * G + g] = ws.mx[g] + std::log(ws.sum[g]);
    };
    team_.share(tasks, 1, 1, [&](int64_t t0, int64_t t1) {  // the shared units' tasks first
      for (int64_t t = t0; t < t1; ++t) t < unit_tasks ? unit_task(t) : run_task(t - unit_tasks);
    });
    if (!alone && !splits_.empty()) {
      team_.barrier();
      merge_pieces(s, tid, nt);
    }
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, inter_, vocab_;
  float eps_, attn_scale_, embed_scale_, softcap_;  // softcap_ 0: none
  bool gelu_;  // GELU-tanh (Gemma), else SiLU
  int64_t top_k_, expert_size_, num_experts_ = 0;  // a mixture of experts' (num_experts_ 0: none)
  bool renormalize_;
  Routing routing_;  // the current layer's (thread 0 routes, the others read)
  enum { kMatmul, kAttention, kOther, kLogits, kExperts, kKinds };
  bool profiling_ = false;
  double profile_[kKinds] = {};
  bool bf16_products_;  // bfloat16 dtype on a CPU with AVX512_BF16: batches and attention use vdpbf16ps
  // --cpu-matrix-tiles (bfloat16 dtype; auto: a CPU with AMX): products of kTileMinRows rows and
  // more, outside the deterministic mode, run on the matrix tiles, before the other products.
  bool tile_products_;
  bool int8_activations_;  // a few rows times quantized weights go in int8 (int8_products.h)
  // --enable-deterministic-inference: each product's kernel is chosen by the weight's format
  // alone, never by the number of rows, so a row's bits do not depend on its batch.
  bool deterministic_;
  StepTeam team_;
  std::unique_ptr<Scratch> scratch_;  // run() is called by one thread at a time (the scheduler's)
  std::vector<std::vector<int64_t>> lora_rows_;  // this pass's rows of each adapter slot
  std::vector<int64_t> run_start_;  // this pass's attention runs: run i is rows run_start_[i] .. [i + 1] - 1
  std::vector<SharedUnit> units_;  // decode rows behind a shared prefix (find_shared_prefixes)
  std::vector<int64_t> solo_runs_;  // the runs in no unit
  std::vector<Piece> pieces_;  // the solo runs' attention tasks (plan_pieces)
  std::vector<Split> splits_;  // the rows attending in more than one piece
  std::vector<float> part_out_, part_lse_;  // each piece's output [parts, heads, head_dim] and log-sum-exp
  int64_t shared_prefix_rows_ = 0, split_rows_ = 0;
  mutable std::atomic<int64_t> tile_outputs_{0};  // added to by every thread of the team (in const linear)
  int64_t longest_run_ = 1;
  std::vector<float> lora_t_;  // x A^T of the current projection, [rows, rank] (lora_shrink)
  at::Tensor cos_, sin_, local_cos_, local_sin_;
  std::vector<at::Tensor> k_buffers_, v_buffers_, k_scales_, v_scales_, keep_;
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
                    const at::Tensor&, const at::Tensor&, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>>())
      .def("run", &bsgl::DecodeStep::run)
      .def("logits", &bsgl::DecodeStep::logits)
      .def("profile", &bsgl::DecodeStep::profile)
      .def("shared_prefix_rows", &bsgl::DecodeStep::shared_prefix_rows)
      .def("tile_outputs", &bsgl::DecodeStep::tile_outputs)
      .def("split_rows", &bsgl::DecodeStep::split_rows)
      .def_property_readonly("num_threads", &bsgl::DecodeStep::num_threads);
}
