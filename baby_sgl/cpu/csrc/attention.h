// Attention over a request's slots in the paged KV pool: attend_rows, query rows one at a time
// (a decode step) or several tokens of one request together (a prefill in the one-call step),
// each row with the same arithmetic; and attend_prefill, the op-by-op prefill's kernel, blocked
// differently. Scores, softmax and the weighted sum are float32 whatever the pool's dtype; keys
// go in blocks of 32 with a running maximum and sum per query head (online softmax). Each output
// depends only on its own row's inputs. A pool of 1-byte elements (kv_elements.h) is widened a
// vector at a time; a key's scale multiplies its score, a value's its softmax weight, so no
// value is rescaled one by one.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kv_elements.h"
#include "vec.h"

namespace bsgl {

// One layer's K and V buffers, [slots, kv_heads, head_dim] each, and for 1-byte elements their
// scales, [slots, kv_heads] each (else null).
template <typename T>
struct KVPool {
  const T* k;
  const T* v;
  int64_t kv_heads, head_dim;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t slot_stride() const { return kv_heads * head_dim; }
};

// Working memory of attend_rows, reused from call to call.
struct AttnScratch {
  std::vector<fv> q, acc, row;
  AlignedBuffer<float> kf, vf, scores;
  std::vector<float> mx, sum;
};

// kLanes stored values as floats (a 1-byte element before its scale).
template <typename T>
inline fv load_kv(const T* p) {
  if constexpr (std::is_same_v<T, float>) return loadv(p);
  else if constexpr (kScaledKV<T>) return load_scaled(p);
  else return load_bf16(reinterpret_cast<const uint16_t*>(p));
}

// A row's K or V heads are a few cache lines, one slot's worth apart from the next key's (and
// slots need not be in order): the hardware prefetchers miss them, so ask kAhead keys early.
// (Over 1000 slots a batch-1 step took 9.9 ms without it, 6.2 ms 8 keys ahead, 5.3 ms 24 ahead.)
constexpr int64_t kAhead = 24;
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

// One 32-score block of a query head into its online softmax: sg's first n scores (the rest
// padded), its running maximum and sum, and its accumulator a (V vectors) rescaled. Leaves the
// block's weights in sg (zeros past n).
inline void softmax_block(float* sg, int64_t n, float& mx, float& sum, fv* a, int64_t V) {
  constexpr int64_t kBlock = 32;
  std::fill(sg + n, sg + kBlock, -std::numeric_limits<float>::infinity());
  fv top = loadv(sg);
  for (int64_t i = kLanes; i < kBlock; i += kLanes) top = vmax(top, loadv(sg + i));
  const float block_max = std::max(mx, hmax(top));
  const float rescale = std::exp(mx - block_max);  // 0 on the first block
  for (int64_t v = 0; v < V; ++v) a[v] *= splat(rescale);
  mx = block_max;
  for (int64_t i = 0; i < kBlock; i += kLanes) storev(sg + i, expv(loadv(sg + i) - block_max));
  std::fill(sg + n, sg + kBlock, 0.f);
  fv total = loadv(sg);
  for (int64_t i = kLanes; i < kBlock; i += kLanes) total += loadv(sg + i);
  sum = sum * rescale + hsum(total);
}

// One row (a decode step's): attend_rows' arithmetic, reading each key and value straight from the
// pool (a key's row widened once for its G query heads, kept in registers where V is fixed).
template <int kV, typename T>
void attend_row_v(const KVPool<T>& kv, const float* q_in, float scale, const int64_t* slots, int64_t len, int64_t kvh0,
                  int64_t H, int64_t G, float* out, AttnScratch& ws) {
  constexpr int64_t kBlock = 32;
  const int64_t D = kv.head_dim, V = kV > 0 ? kV : D / kLanes, Q = H * G, stride = kv.slot_stride();
  ws.q.resize(Q * V);
  ws.acc.assign(Q * V, fv{});
  ws.row.resize(V);
  ws.scores.reserve(Q * kBlock);
  ws.mx.assign(Q, -std::numeric_limits<float>::infinity());
  ws.sum.assign(Q, 0.f);
  fv* q = ws.q.data();
  fv* acc = ws.acc.data();
  float* scores = ws.scores.data();
  for (int64_t i = 0; i < Q * V; ++i) q[i] = loadv(q_in + kLanes * i) * splat(scale);
  const T* kp = kv.k + kvh0 * D;
  const T* vp = kv.v + kvh0 * D;
  fv fixed_row[kV > 0 ? kV : 1];
  fv* row = kV > 0 ? fixed_row : ws.row.data();
  for (int64_t start = 0; start < len; start += kBlock) {
    const int64_t n = std::min(kBlock, len - start);
    for (int64_t j = 0; j < n; ++j) {
      if (start + j + kAhead < len) {  // this key's values are read after the block's scores
        prefetch_row(kp + slots[start + j + kAhead] * stride, H * D);
        prefetch_row(vp + slots[start + j + kAhead] * stride, H * D);
      }
      const T* krow = kp + slots[start + j] * stride;
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t v = 0; v < V; ++v) row[v] = load_kv(krow + h * D + kLanes * v);
        for (int64_t g = h * G; g < (h + 1) * G; ++g) {
          fv part = q[g * V] * row[0];
          for (int64_t v = 1; v < V; ++v) part += q[g * V + v] * row[v];
          scores[g * kBlock + j] = hsum(part);
          if constexpr (kScaledKV<T>) scores[g * kBlock + j] *= kv.k_scale[slots[start + j] * kv.kv_heads + kvh0 + h];
        }
      }
    }
    for (int64_t g = 0; g < Q; ++g) softmax_block(scores + g * kBlock, n, ws.mx[g], ws.sum[g], acc + g * V, V);
    for (int64_t h = 0; h < H; ++h) {  // each query head's sum over the block's values in registers
      for (int64_t g = h * G; g < (h + 1) * G; ++g) {
        fv o[kV > 0 ? kV : 1];
        fv* a = kV > 0 ? o : acc + g * V;
        if constexpr (kV > 0) {
          for (int64_t v = 0; v < V; ++v) a[v] = acc[g * V + v];
        }
        for (int64_t j = 0; j < n; ++j) {
          const T* vrow = vp + slots[start + j] * stride + h * D;
          float weight = scores[g * kBlock + j];
          if constexpr (kScaledKV<T>) weight *= kv.v_scale[slots[start + j] * kv.kv_heads + kvh0 + h];
          const fv p = splat(weight);
          for (int64_t v = 0; v < V; ++v) a[v] += p * load_kv(vrow + kLanes * v);
        }
        if constexpr (kV > 0) {
          for (int64_t v = 0; v < V; ++v) acc[g * V + v] = a[v];
        }
      }
    }
  }
  for (int64_t g = 0; g < Q; ++g) {
    const fv inv = splat(1.f / ws.sum[g]);
    for (int64_t v = 0; v < V; ++v) storev(out + g * D + kLanes * v, acc[g * V + v] * inv);
  }
}

// R >= 2 query rows of one request (one row goes by attend_row_v): row r's query heads for KV heads kvh0 .. kvh0 + H - 1 (G each,
// H * G * head_dim floats) at q_in + r * q_stride, scores scaled by `scale`, seeing the first
// lens[r] of `slots`; its output (H * G * head_dim floats) at out + r * out_stride. A prefill's
// new tokens share each block's keys and values, widened once. A row's arithmetic is its own
// whatever rows come with it, and attend_row_v's: per key, a dot product (FMAs over head_dim,
// then hsum's order, here sixteen keys at a time by lane_sums), the same online softmax and the
// same weighted sum, so a token's result is the same bits in a decode step and in any prefill. V: vectors per head (head_dim / kLanes) if fixed at
// compile time (the usual head_dims, whose loops then unroll), else 0.
template <int kV, typename T>
void attend_rows_v(const KVPool<T>& kv, const float* q_in, int64_t q_stride, float scale, const int64_t* slots,
                   const int64_t* lens, int64_t R, int64_t kvh0, int64_t H, int64_t G, float* out, int64_t out_stride,
                   AttnScratch& ws) {
  constexpr int64_t kBlock = 32;
  const int64_t D = kv.head_dim, V = kV > 0 ? kV : D / kLanes, Q = H * G, stride = kv.slot_stride(), HD = H * D;
  ws.q.resize(R * Q * V);
  ws.acc.assign(R * Q * V, fv{});
  ws.kf.reserve(kBlock * HD);
  ws.vf.reserve(kBlock * HD);
  ws.scores.reserve(R * Q * kBlock);
  ws.mx.assign(R * Q, -std::numeric_limits<float>::infinity());
  ws.sum.assign(R * Q, 0.f);
  fv* q = ws.q.data();
  fv* acc = ws.acc.data();
  float* kf = ws.kf.data();
  float* vf = ws.vf.data();
  int64_t longest = 0;
  for (int64_t r = 0; r < R; ++r) {
    longest = std::max(longest, lens[r]);
    for (int64_t i = 0; i < Q * V; ++i) q[r * Q * V + i] = loadv(q_in + r * q_stride + kLanes * i) * splat(scale);
  }
  const T* kp = kv.k + kvh0 * D;
  const T* vp = kv.v + kvh0 * D;
  for (int64_t start = 0; start < longest; start += kBlock) {
    const int64_t n = std::min(kBlock, longest - start);
    for (int64_t j = 0; j < kBlock; ++j) {  // the block's keys and values as floats (zeros past n)
      float* kj = kf + j * HD;
      float* vj = vf + j * HD;
      if (j >= n) {
        std::fill(kj, kj + HD, 0.f);
        continue;
      }
      if (start + j + kAhead < longest) {  // read a block later
        prefetch_row(kp + slots[start + j + kAhead] * stride, H * D);
        prefetch_row(vp + slots[start + j + kAhead] * stride, H * D);
      }
      const T* krow = kp + slots[start + j] * stride;
      const T* vrow = vp + slots[start + j] * stride;
      for (int64_t i = 0; i < HD; i += kLanes) {
        storev(kj + i, load_kv(krow + i));
        storev(vj + i, load_kv(vrow + i));
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      if (lens[r] <= start) continue;
      const int64_t nr = std::min(kBlock, lens[r] - start);
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t g = h * G; g < (h + 1) * G; ++g) {
          const int64_t rg = r * Q + g;
          const fv* qg = q + rg * V;
          float* sg = ws.scores.data() + rg * kBlock;
          for (int64_t j0 = 0; j0 < nr; j0 += kLanes) {
            fv part[kLanes];
            for (int jj = 0; jj < kLanes; ++jj) {
              const float* krow = kf + (j0 + jj) * HD + h * D;
              fv p = qg[0] * loadv(krow);
              for (int64_t v = 1; v < V; ++v) p += qg[v] * loadv(krow + kLanes * v);
              part[jj] = p;
            }
            storev(sg + j0, lane_sums(part));
          }
          if constexpr (kScaledKV<T>) {
            for (int64_t j = 0; j < nr; ++j) sg[j] *= kv.k_scale[slots[start + j] * kv.kv_heads + kvh0 + h];
          }
          fv* a = acc + rg * V;
          softmax_block(sg, nr, ws.mx[rg], ws.sum[rg], a, V);
          // The weighted sum of the block's values, in registers where V is fixed.
          fv o[kV > 0 ? kV : 1];
          fv* av = kV > 0 ? o : a;
          if constexpr (kV > 0) {
            for (int64_t v = 0; v < V; ++v) av[v] = a[v];
          }
          for (int64_t j = 0; j < nr; ++j) {
            float weight = sg[j];
            if constexpr (kScaledKV<T>) weight *= kv.v_scale[slots[start + j] * kv.kv_heads + kvh0 + h];
            const fv p = splat(weight);
            const float* vrow = vf + j * HD + h * D;
            for (int64_t v = 0; v < V; ++v) av[v] += p * loadv(vrow + kLanes * v);
          }
          if constexpr (kV > 0) {
            for (int64_t v = 0; v < V; ++v) a[v] = av[v];
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < Q; ++g) {
      const fv inv = splat(1.f / ws.sum[r * Q + g]);
      for (int64_t v = 0; v < V; ++v) storev(out + r * out_stride + g * D + kLanes * v, acc[(r * Q + g) * V + v] * inv);
    }
}

template <typename T>
void attend_rows(const KVPool<T>& kv, const float* q, int64_t q_stride, float scale, const int64_t* slots,
                 const int64_t* lens, int64_t R, int64_t kvh0, int64_t H, int64_t G, float* out, int64_t out_stride,
                 AttnScratch& ws) {
  if (R == 1) {
    switch (kv.head_dim / kLanes) {
      case 64 / kLanes: return attend_row_v<64 / kLanes>(kv, q, scale, slots, lens[0], kvh0, H, G, out, ws);
      case 128 / kLanes: return attend_row_v<128 / kLanes>(kv, q, scale, slots, lens[0], kvh0, H, G, out, ws);
      default: return attend_row_v<0>(kv, q, scale, slots, lens[0], kvh0, H, G, out, ws);
    }
  }
  switch (kv.head_dim / kLanes) {
    case 64 / kLanes: return attend_rows_v<64 / kLanes>(kv, q, q_stride, scale, slots, lens, R, kvh0, H, G, out, out_stride, ws);
    case 128 / kLanes: return attend_rows_v<128 / kLanes>(kv, q, q_stride, scale, slots, lens, R, kvh0, H, G, out, out_stride, ws);
    default: return attend_rows_v<0>(kv, q, q_stride, scale, slots, lens, R, kvh0, H, G, out, out_stride, ws);
  }
}

// Prefill: several new tokens of one request together, each a query row per head of KV head kvh
// (row i sees the request's first lens[i] slots). Per block of 32 keys the keys are transposed and
// the values widened once for all rows; then NR rows at a time, a row's 32 scores are vectors
// built along head_dim (no horizontal sums) and its values' sum runs in registers. Each row's
// arithmetic is its own, whatever rows it is grouped with: a token's result does not depend on
// the other tokens of its prefill or on the batch.
struct PrefillScratch {
  AlignedBuffer<float> q, kt, vf, scores, acc;
  std::vector<float> mx, sum;
};

constexpr int64_t kKeyBlock = 32;
constexpr int kScoreVecs = kKeyBlock / kLanes;

// Rows rows[0..NR) of the block starting at key `start`: scores, online softmax, values.
template <int NR, int kV>
inline void prefill_rows(const int64_t* rows, const int64_t* lens, int64_t start, int64_t D, PrefillScratch& ws) {
  const float* kt = ws.kt.data();
  fv sc[NR][kScoreVecs] = {};
  for (int64_t d = 0; d < D; ++d) {
    fv k[kScoreVecs];
    for (int c = 0; c < kScoreVecs; ++c) k[c] = loadv(kt + d * kKeyBlock + c * kLanes);
    for (int r = 0; r < NR; ++r) {
      const fv qd = splat(ws.q[rows[r] * D + d]);
      for (int c = 0; c < kScoreVecs; ++c) sc[r][c] += qd * k[c];
    }
  }
  float p[NR][kKeyBlock];
  int64_t n[NR];
  for (int r = 0; r < NR; ++r) {
    const int64_t i = rows[r];
    n[r] = std::min(kKeyBlock, lens[i] - start);
    float* pr = p[r];
    for (int c = 0; c < kScoreVecs; ++c) storev(pr + c * kLanes, sc[r][c]);
    std::fill(pr + n[r], pr + kKeyBlock, -std::numeric_limits<float>::infinity());
    fv top = loadv(pr);
    for (int c = 1; c < kScoreVecs; ++c) top = vmax(top, loadv(pr + c * kLanes));
    const float block_max = std::max(ws.mx[i], hmax(top));
    const float rescale = std::exp(ws.mx[i] - block_max);  // 0 on the first block
    ws.mx[i] = block_max;
    fv total{};
    for (int c = 0; c < kScoreVecs; ++c) {
      const fv e = expv(loadv(pr + c * kLanes) - block_max);
      storev(pr + c * kLanes, e);
    }
    std::fill(pr + n[r], pr + kKeyBlock, 0.f);
    for (int c = 0; c < kScoreVecs; ++c) total += loadv(pr + c * kLanes);
    ws.sum[i] = ws.sum[i] * rescale + hsum(total);
    float* a = ws.acc.data() + i * D;
    for (int64_t v = 0; v < D; v += kLanes) storev(a + v, loadv(a + v) * splat(rescale));
  }
  const int64_t V = kV > 0 ? kV : D / kLanes;
  const float* vf = ws.vf.data();
  if constexpr (kV > 0) {
    fv a[NR][kV];
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < kV; ++v) a[r][v] = loadv(ws.acc.data() + rows[r] * D + v * kLanes);
    int64_t most = 0;
    for (int r = 0; r < NR; ++r) most = std::max(most, n[r]);
    for (int64_t j = 0; j < most; ++j) {  // past a row's n its p is 0: adds exact zeros
      fv val[kV];
      for (int v = 0; v < kV; ++v) val[v] = loadv(vf + j * D + v * kLanes);
      for (int r = 0; r < NR; ++r) {
        const fv pj = splat(p[r][j]);
        for (int v = 0; v < kV; ++v) a[r][v] += pj * val[v];
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < kV; ++v) storev(ws.acc.data() + rows[r] * D + v * kLanes, a[r][v]);
  } else {
    for (int r = 0; r < NR; ++r) {
      float* a = ws.acc.data() + rows[r] * D;
      for (int64_t j = 0; j < n[r]; ++j) {
        const fv pj = splat(p[r][j]);
        for (int64_t v = 0; v < V; ++v) storev(a + v * kLanes, loadv(a + v * kLanes) + pj * loadv(vf + j * D + v * kLanes));
      }
    }
  }
}

// q: T tokens' query rows for KV head kvh (G heads each; token t's head g at q + t * q_stride +
// g * D), token t seeing the first lens[t] of `slots` (lens increasing); out: the same layout.
template <int kV, typename T>
void attend_prefill_v(const KVPool<T>& kv, const float* q, int64_t q_stride, float scale, const int64_t* slots,
                      const int64_t* token_lens, int64_t T_, int64_t kvh, int64_t G, float* out, PrefillScratch& ws) {
  constexpr int NR = 4;
  const int64_t D = kv.head_dim, NQ = T_ * G, stride = kv.slot_stride();
  ws.q.reserve(NQ * D);
  ws.acc.reserve(NQ * D);
  ws.kt.reserve(D * kKeyBlock);
  ws.vf.reserve(kKeyBlock * D);
  ws.mx.assign(NQ, -std::numeric_limits<float>::infinity());
  ws.sum.assign(NQ, 0.f);
  std::vector<int64_t> lens(NQ);
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = t * G + g;
      lens[i] = token_lens[t];
      for (int64_t d = 0; d < D; ++d) ws.q[i * D + d] = q[t * q_stride + g * D + d] * scale;
    }
  std::fill(ws.acc.data(), ws.acc.data() + NQ * D, 0.f);
  const T* kp = kv.k + kvh * D;
  const T* vp = kv.v + kvh * D;
  const int64_t longest = token_lens[T_ - 1];
  std::vector<int64_t> active;
  for (int64_t start = 0; start < longest; start += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, longest - start);
    float* kt = ws.kt.data();
    float* vf = ws.vf.data();
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      if (j < n) {
        const T* kr = kp + slots[start + j] * stride;
        const T* vr = vp + slots[start + j] * stride;
        if constexpr (kScaledKV<T>) {  // the block's keys and values widened once, scaled
          const int64_t at = slots[start + j] * kv.kv_heads + kvh;
          const fv ks = splat(kv.k_scale[at]), vs = splat(kv.v_scale[at]);
          for (int64_t d = 0; d < D; d += kLanes) {
            const fv kd = load_kv(kr + d) * ks;
            for (int l = 0; l < kLanes; ++l) kt[(d + l) * kKeyBlock + j] = kd[l];
            storev(vf + j * D + d, load_kv(vr + d) * vs);
          }
        } else {
          for (int64_t d = 0; d < D; ++d) kt[d * kKeyBlock + j] = static_cast<float>(kr[d]);
          for (int64_t v = 0; v < D; v += kLanes) storev(vf + j * D + v, load_kv(vr + v));
        }
      } else {
        for (int64_t d = 0; d < D; ++d) kt[d * kKeyBlock + j] = 0.f;
      }
    }
    active.clear();
    for (int64_t i = 0; i < NQ; ++i)
      if (lens[i] > start) active.push_back(i);
    size_t a = 0;
    for (; a + NR <= active.size(); a += NR) prefill_rows<NR, kV>(active.data() + a, lens.data(), start, D, ws);
    for (; a < active.size(); ++a) prefill_rows<1, kV>(active.data() + a, lens.data(), start, D, ws);
  }
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = t * G + g;
      const fv inv = splat(1.f / ws.sum[i]);
      for (int64_t v = 0; v < D; v += kLanes) storev(out + t * q_stride + g * D + v, loadv(ws.acc.data() + i * D + v) * inv);
    }
}

template <typename T>
void attend_prefill(const KVPool<T>& kv, const float* q, int64_t q_stride, float scale, const int64_t* slots,
                    const int64_t* token_lens, int64_t T_, int64_t kvh, int64_t G, float* out, PrefillScratch& ws) {
  switch (kv.head_dim / kLanes) {
    case 64 / kLanes: return attend_prefill_v<64 / kLanes>(kv, q, q_stride, scale, slots, token_lens, T_, kvh, G, out, ws);
    case 128 / kLanes: return attend_prefill_v<128 / kLanes>(kv, q, q_stride, scale, slots, token_lens, T_, kvh, G, out, ws);
    default: return attend_prefill_v<0>(kv, q, q_stride, scale, slots, token_lens, T_, kvh, G, out, ws);
  }
}

}  // namespace bsgl
