// Attention over a request's slots in the paged KV pool, two ways. attend_rows: query rows one
// at a time (a decode step) or several tokens of one request together, each row with the same
// arithmetic (per key a dot product, then a horizontal sum): the deterministic mode's, where a
// token's bits are the same in a decode step and in any prefill. attend_lanes: the runs of
// several rows in the default mode and the op-by-op prefill, each lane of a vector one row's
// query head, a key's scores for every lane built without horizontal sums (1.7-1.9x faster on a
// 1000-token prefill). Scores, softmax and the weighted sum are float32 whatever the pool's dtype;
// keys go in blocks of 32 with a running maximum and sum per query head (online softmax). Each
// output depends only on its own row's inputs. A pool of 1-byte elements (kv_elements.h) is
// widened a vector at a time, its scales applied to the widened keys and values (attend_lanes)
// or to a key's score and a value's softmax weight (attend_rows).
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

// One row (a decode step's): attend_rows' arithmetic, reading each key straight from the pool (a
// key's row widened once for its G query heads, kept in registers where V is fixed). A pool of
// 2- or 1-byte elements has each block's values widened once per KV head into ws.vf, which its G
// query heads then read as floats (the same sums, the same bits). Widened G times in their loops
// (G = 3 in the default model), a 4000-token fp8_e4m3 pool's 30 layers took 20.3-25.6 ms on one
// Zen 3 thread, 14.3-19.8 this way; int8 and bfloat16 stayed level (10.2 and 11.9-12.1 at best).
// from > 0: the keys before slot `from` were attended already, and ws.acc, ws.mx and ws.sum hold
// their running state (attend_shared).
template <int kV, typename T>
void attend_row_v(const KVPool<T>& kv, const float* q_in, float scale, const int64_t* slots, int64_t len, int64_t kvh0,
                  int64_t H, int64_t G, float* out, AttnScratch& ws, int64_t from = 0) {
  constexpr int64_t kBlock = 32;
  const int64_t D = kv.head_dim, V = kV > 0 ? kV : D / kLanes, Q = H * G, stride = kv.slot_stride();
  ws.q.resize(Q * V);
  ws.row.resize(V);
  ws.scores.reserve(Q * kBlock);
  if (from == 0) {
    ws.acc.assign(Q * V, fv{});
    ws.mx.assign(Q, -std::numeric_limits<float>::infinity());
    ws.sum.assign(Q, 0.f);
  }
  fv* q = ws.q.data();
  fv* acc = ws.acc.data();
  float* scores = ws.scores.data();
  ws.vf.reserve(kBlock * D);
  float* vf = ws.vf.data();
  float v_scales[kBlock];
  for (int64_t i = 0; i < Q * V; ++i) q[i] = loadv(q_in + kLanes * i) * splat(scale);
  const T* kp = kv.k + kvh0 * D;
  const T* vp = kv.v + kvh0 * D;
  fv fixed_row[kV > 0 ? kV : 1];
  fv* row = kV > 0 ? fixed_row : ws.row.data();
  for (int64_t start = from; start < len; start += kBlock) {
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
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t j = 0; j < n; ++j) {
          const T* vrow = vp + slots[start + j] * stride + h * D;
          for (int64_t v = 0; v < V; ++v) storev(vf + j * D + kLanes * v, load_kv(vrow + kLanes * v));
          if constexpr (kScaledKV<T>) v_scales[j] = kv.v_scale[slots[start + j] * kv.kv_heads + kvh0 + h];
        }
      }
      for (int64_t g = h * G; g < (h + 1) * G; ++g) {
        fv o[kV > 0 ? kV : 1];
        fv* a = kV > 0 ? o : acc + g * V;
        if constexpr (kV > 0) {
          for (int64_t v = 0; v < V; ++v) a[v] = acc[g * V + v];
        }
        for (int64_t j = 0; j < n; ++j) {
          float weight = scores[g * kBlock + j];
          if constexpr (kScaledKV<T>) weight *= v_scales[j];
          const fv p = splat(weight);
          const float* vrow = vf + j * D;
          if constexpr (std::is_same_v<T, float>) vrow = vp + slots[start + j] * stride + h * D;
          for (int64_t v = 0; v < V; ++v) a[v] += p * loadv(vrow + kLanes * v);
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

// The default mode's runs of several rows (a prefill's tokens, a verify pass's drafts): each
// lane of a vector one (row, query head) pair, kLanes pairs at a time. A key's score for every
// lane is built along head_dim from the key's values broadcast against the queries laid out by
// dimension (no horizontal sums), the online softmax runs on vectors of lanes, and the values are
// summed the same way into the outputs laid out by dimension. Each block's keys and values are
// widened (and for 1-byte pools scaled) once for all of the run's lanes. A lane's arithmetic does
// not depend on the other lanes, but it is not attend_rows_v's: the deterministic mode keeps that.
struct LaneScratch {
  AlignedBuffer<float> qt, o, kf, vf, s;
  std::vector<fv> mx, sum;
  std::vector<iv> len;
  std::vector<float> q;  // attend_shared's rows' queries, side by side
  std::vector<int64_t> shared_lens;
  std::vector<uint16_t> zeros;  // a key's row of zeros (attend_lanes_bf16_v's padding)
  bool unpacked = false;  // o's dimensions in unpack_order (attend_lanes_bf16_v's)
};

// kLanes pairs' scores for keys j0 .. j0 + 7 of the block: s[j] = sum over d of kf[j][d] * qt[d].
template <int kD>
inline void lane_scores(const float* qt, const float* kf, int64_t D, int64_t j0, float* s) {
  fv a[8] = {};
  const int64_t n = kD > 0 ? kD : D;
  for (int64_t d = 0; d < n; ++d) {
    const fv qd = loadv(qt + d * kLanes);
    for (int jj = 0; jj < 8; ++jj) a[jj] += splat(kf[(j0 + jj) * n + d]) * qd;
  }
  for (int jj = 0; jj < 8; ++jj) storev(s + (j0 + jj) * kLanes, a[jj]);
}

// Whether any lane of a group sees keys from `start` on; all: whether every lane sees the whole
// block of `block` keys from there (no masking).
inline bool lanes_reach(iv len, int64_t start, int64_t block, bool& all) {
  bool any = false;
  all = true;
  for (int l = 0; l < kLanes; ++l) {
    any |= len[l] > start;
    all &= len[l] >= start + block;
  }
  return any;
}

// One block's online softmax for a vector of lanes: s holds n keys' scores (a vector each), masked
// to -inf where a key is at or past a lane's length unless `all` lanes see the whole block; leaves
// the weights in s (0 where masked), updates the running maximum and sum, and returns the factor
// the lanes' value sums are rescaled by (~0 on the first block, where they and the sum are 0).
inline fv lane_softmax(float* s, int64_t n, int64_t start, iv len, bool all, fv& mx, fv& sum) {
  const fv minus_inf = splat(-std::numeric_limits<float>::infinity());
  fv top = mx;
  for (int64_t j = 0; j < n; ++j) {
    fv sj = loadv(s + j * kLanes);
    if (!all) sj = len > static_cast<int32_t>(start + j) ? sj : minus_inf;
    storev(s + j * kLanes, sj);
    top = vmax(top, sj);
  }
  const fv rescale = expv(mx - top);
  mx = top;
  fv total{};
  for (int64_t j = 0; j < n; ++j) {
    fv pj = expv(loadv(s + j * kLanes) - top);
    if (!all) pj = len > static_cast<int32_t>(start + j) ? pj : fv{};
    storev(s + j * kLanes, pj);
    total += pj;
  }
  sum = sum * rescale + total;
  return rescale;
}

// out null: the outputs are not written; lane p's running maximum, sum and (unnormalised) value
// sums stay in ws (lane_state reads them).
template <int kD, typename T>
void attend_lanes_v(const KVPool<T>& kv, const float* q_in, int64_t q_stride, float scale, const int64_t* slots,
                    const int64_t* lens, int64_t R, int64_t kvh, int64_t G, float* out, int64_t out_stride,
                    LaneScratch& ws) {
  constexpr int64_t kBlock = 32;
  constexpr int kChunk = kLanes == 16 ? 16 : 8;  // output dimensions summed in registers at a time
  const int64_t D = kD > 0 ? kD : kv.head_dim, stride = kv.slot_stride();
  const int64_t P = R * G, groups = (P + kLanes - 1) / kLanes;
  ws.qt.reserve(groups * D * kLanes);
  ws.o.reserve(groups * D * kLanes);
  ws.kf.reserve(kBlock * D);
  ws.vf.reserve(kBlock * D);
  ws.s.reserve(kBlock * kLanes);
  ws.mx.assign(groups, splat(-std::numeric_limits<float>::infinity()));
  ws.sum.assign(groups, fv{});
  ws.len.assign(groups, iv{});
  std::fill(ws.o.data(), ws.o.data() + groups * D * kLanes, 0.f);
  int64_t longest = 0;
  for (int64_t p = 0; p < groups * kLanes; ++p) {  // lane p: row p / G, query head p % G
    const int64_t grp = p / kLanes, lane = p % kLanes, r = p / G, g = p % G;
    float* qt = ws.qt.data() + grp * D * kLanes + lane;
    if (p < P) {
      for (int64_t d = 0; d < D; ++d) qt[d * kLanes] = q_in[r * q_stride + g * D + d] * scale;
      longest = std::max(longest, lens[r]);
    } else {
      for (int64_t d = 0; d < D; ++d) qt[d * kLanes] = 0.f;
    }
    ws.len[grp][lane] = static_cast<int32_t>(p < P ? lens[r] : 1);  // a padding lane sees key 0
  }
  const T* kp = kv.k + kvh * D;
  const T* vp = kv.v + kvh * D;
  float* kf = ws.kf.data();
  float* vf = ws.vf.data();
  float* s = ws.s.data();
  for (int64_t start = 0; start < longest; start += kBlock) {
    const int64_t n = std::min(kBlock, longest - start), n8 = (n + 7) / 8 * 8;
    for (int64_t j = 0; j < n8; ++j) {
      float* kj = kf + j * D;
      float* vj = vf + j * D;
      if (j >= n) {
        std::fill(kj, kj + D, 0.f);
        std::fill(vj, vj + D, 0.f);
        continue;
      }
      if (start + j + kAhead < longest) {
        prefetch_row(kp + slots[start + j + kAhead] * stride, D);
        prefetch_row(vp + slots[start + j + kAhead] * stride, D);
      }
      const T* krow = kp + slots[start + j] * stride;
      const T* vrow = vp + slots[start + j] * stride;
      fv ks = splat(1.f), vs = splat(1.f);
      if constexpr (kScaledKV<T>) {
        const int64_t at = slots[start + j] * kv.kv_heads + kvh;
        ks = splat(kv.k_scale[at]);
        vs = splat(kv.v_scale[at]);
      }
      for (int64_t d = 0; d < D; d += kLanes) {
        storev(kj + d, load_kv(krow + d) * ks);
        storev(vj + d, load_kv(vrow + d) * vs);
      }
    }
    for (int64_t grp = 0; grp < groups; ++grp) {
      const iv len = ws.len[grp];
      bool all;
      if (!lanes_reach(len, start, kBlock, all)) continue;
      const float* qt = ws.qt.data() + grp * D * kLanes;
      for (int64_t j0 = 0; j0 < n8; j0 += 8) lane_scores<kD>(qt, kf, D, j0, s);
      const fv rescale = lane_softmax(s, n, start, len, all, ws.mx[grp], ws.sum[grp]);
      float* o = ws.o.data() + grp * D * kLanes;
      for (int64_t c = 0; c < D; c += kChunk) {
        fv acc[kChunk];
        for (int dd = 0; dd < kChunk; ++dd) acc[dd] = loadv(o + (c + dd) * kLanes) * rescale;
        for (int64_t j = 0; j < n; ++j) {
          const fv pj = loadv(s + j * kLanes);
          const float* vj = vf + j * D + c;
          for (int dd = 0; dd < kChunk; ++dd) acc[dd] += splat(vj[dd]) * pj;
        }
        for (int dd = 0; dd < kChunk; ++dd) storev(o + (c + dd) * kLanes, acc[dd]);
      }
    }
  }
  for (int64_t p = 0; p < (out != nullptr ? P : 0); ++p) {
    const int64_t grp = p / kLanes, lane = p % kLanes, r = p / G, g = p % G;
    const float inv = 1.f / ws.sum[grp][lane];
    const float* o = ws.o.data() + grp * D * kLanes + lane;
    float* dst = out + r * out_stride + g * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = o[d * kLanes] * inv;
  }
}

// Dimension of the i-th pair of an interleaved value row: _mm512_unpacklo/hi_epi16 pair the
// words 8L .. 8L + 3 (lo) and 8L + 4 .. 8L + 7 (hi) of each 128-bit lane L of 32 dimensions.
inline int64_t unpack_order(int64_t i) {
  const int64_t half = i / 32, k = i % 32, hi = k / 16, lane = (k % 16) / 4;
  return 32 * half + 8 * lane + 4 * hi + k % 4;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// attend_lanes_v in bfloat16 dot products, for a bfloat16 pool of a bfloat16 model on CPUs with
// AVX512_BF16: each vdpbf16ps multiplies pairs, summed in float32. Scores: a key's two adjacent
// dimensions, as stored, against every lane's two (its scaled query rounded to bfloat16). Values:
// two keys' values of one dimension against every lane's two softmax weights (rounded to
// bfloat16; the running sum keeps them in float32), the block's values interleaved in pairs of
// keys once for all of the run's lanes. Half the instructions of the float32 FMAs, and keys are
// not widened. The outputs' dimensions are summed in the order the interleaving leaves them
// (unpack_order) and put back in place at the end.
template <int kD, typename T>
void attend_lanes_bf16_v(const KVPool<T>& kv, const float* q_in, int64_t q_stride, float scale, const int64_t* slots,
                         const int64_t* lens, int64_t R, int64_t kvh, int64_t G, float* out, int64_t out_stride,
                         LaneScratch& ws) {
  static_assert(sizeof(T) == 2 && kLanes == 16);
  constexpr int64_t kBlock = 32;
  const int64_t D = kD > 0 ? kD : kv.head_dim, stride = kv.slot_stride();
  const int64_t P = R * G, groups = (P + kLanes - 1) / kLanes;
  ws.qt.reserve(groups * D / 2 * kLanes);  // 32-bit words: two bfloat16 of a lane's query
  ws.o.reserve(groups * D * kLanes);
  ws.vf.reserve(kBlock / 2 * D);  // 32-bit words: one dimension's values of two keys
  ws.s.reserve(kBlock * kLanes);
  ws.zeros.assign(D, 0);
  ws.mx.assign(groups, splat(-std::numeric_limits<float>::infinity()));
  ws.sum.assign(groups, fv{});
  ws.len.assign(groups, iv{});
  std::fill(ws.o.data(), ws.o.data() + groups * D * kLanes, 0.f);
  uint32_t* qp = reinterpret_cast<uint32_t*>(ws.qt.data());
  int64_t longest = 0;
  for (int64_t p = 0; p < groups * kLanes; ++p) {
    const int64_t grp = p / kLanes, lane = p % kLanes, r = p / G, g = p % G;
    uint32_t* qg = qp + grp * D / 2 * kLanes + lane;
    for (int64_t t = 0; t < D / 2; ++t) {
      const float* q = q_in + r * q_stride + g * D + 2 * t;
      qg[t * kLanes] = p < P ? float_to_bf16(q[0] * scale) | static_cast<uint32_t>(float_to_bf16(q[1] * scale)) << 16 : 0;
    }
    if (p < P) longest = std::max(longest, lens[r]);
    ws.len[grp][lane] = static_cast<int32_t>(p < P ? lens[r] : 1);
  }
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(kv.k) + kvh * D;
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(kv.v) + kvh * D;
  uint32_t* vpair = reinterpret_cast<uint32_t*>(ws.vf.data());
  float* s = ws.s.data();
  // Word l of a lane pair vector: lanes' weights of key 2jp (words 0..15) and 2jp + 1 (16..31).
  __m512i pair_order;
  {
    alignas(64) uint16_t idx[32];
    for (int l = 0; l < 16; ++l) {
      idx[2 * l] = static_cast<uint16_t>(l);
      idx[2 * l + 1] = static_cast<uint16_t>(16 + l);
    }
    pair_order = _mm512_load_si512(idx);
  }
  const uint16_t* krow[kBlock];
  for (int64_t start = 0; start < longest; start += kBlock) {
    const int64_t n = std::min(kBlock, longest - start), n8 = (n + 7) / 8 * 8, pairs = (n + 1) / 2;
    for (int64_t j = 0; j < n8; ++j) {
      krow[j] = j < n ? kp + slots[start + j] * stride : ws.zeros.data();
      if (j < n && start + j + kAhead < longest) {
        prefetch_row(kp + slots[start + j + kAhead] * stride, D);
        prefetch_row(vp + slots[start + j + kAhead] * stride, D);
      }
    }
    for (int64_t jp = 0; jp < pairs; ++jp) {
      const uint16_t* a = vp + slots[start + 2 * jp] * stride;
      const uint16_t* b = 2 * jp + 1 < n ? vp + slots[start + 2 * jp + 1] * stride : ws.zeros.data();
      for (int64_t h = 0; h < D; h += 32) {
        const __m512i va = _mm512_loadu_si512(a + h), vb = _mm512_loadu_si512(b + h);
        _mm512_storeu_si512(vpair + jp * D + h, _mm512_unpacklo_epi16(va, vb));
        _mm512_storeu_si512(vpair + jp * D + h + 16, _mm512_unpackhi_epi16(va, vb));
      }
    }
    for (int64_t grp = 0; grp < groups; ++grp) {
      const iv len = ws.len[grp];
      bool all;
      if (!lanes_reach(len, start, kBlock, all)) continue;
      const uint32_t* qg = qp + grp * D / 2 * kLanes;
      for (int64_t j0 = 0; j0 < n8; j0 += 8) {
        __m512 a[8];
        for (int jj = 0; jj < 8; ++jj) a[jj] = _mm512_setzero_ps();
        for (int64_t t = 0; t < D / 2; ++t) {
          const __m512bh qt = (__m512bh)_mm512_loadu_si512(qg + t * kLanes);
          for (int jj = 0; jj < 8; ++jj) {
            uint32_t pair;
            std::memcpy(&pair, krow[j0 + jj] + 2 * t, 4);
            a[jj] = _mm512_dpbf16_ps(a[jj], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), qt);
          }
        }
        for (int jj = 0; jj < 8; ++jj) _mm512_storeu_ps(s + (j0 + jj) * kLanes, a[jj]);
      }
      const fv rescale = lane_softmax(s, n, start, len, all, ws.mx[grp], ws.sum[grp]);
      __m512i pp[kBlock / 2];
      for (int64_t jp = 0; jp < pairs; ++jp) {
        const __m512 pa = _mm512_loadu_ps(s + 2 * jp * kLanes);
        const __m512 pb = 2 * jp + 1 < n ? _mm512_loadu_ps(s + (2 * jp + 1) * kLanes) : _mm512_setzero_ps();
        pp[jp] = _mm512_permutexvar_epi16(pair_order, (__m512i)_mm512_cvtne2ps_pbh(pb, pa));
      }
      float* o = ws.o.data() + grp * D * kLanes;
      __m512 r;
      std::memcpy(&r, &rescale, sizeof(r));
      for (int64_t c = 0; c < D; c += 16) {
        __m512 acc[16];
        for (int dd = 0; dd < 16; ++dd) acc[dd] = _mm512_mul_ps(_mm512_loadu_ps(o + (c + dd) * kLanes), r);
        for (int64_t jp = 0; jp < pairs; ++jp) {
          const __m512bh w = (__m512bh)pp[jp];
          const uint32_t* vj = vpair + jp * D + c;
          for (int dd = 0; dd < 16; ++dd)
            acc[dd] = _mm512_dpbf16_ps(acc[dd], (__m512bh)_mm512_set1_epi32(static_cast<int>(vj[dd])), w);
        }
        for (int dd = 0; dd < 16; ++dd) _mm512_storeu_ps(o + (c + dd) * kLanes, acc[dd]);
      }
    }
  }
  for (int64_t p = 0; p < (out != nullptr ? P : 0); ++p) {
    const int64_t grp = p / kLanes, lane = p % kLanes, r = p / G, g = p % G;
    const float inv = 1.f / ws.sum[grp][lane];
    const float* o = ws.o.data() + grp * D * kLanes + lane;
    float* dst = out + r * out_stride + g * D;
    for (int64_t i = 0; i < D; ++i) dst[unpack_order(i)] = o[i * kLanes] * inv;
  }
}
#endif

// Whether a run of R rows with G query heads each goes by attend_lanes_v: enough pairs to fill
// half a vector (fewer go by attend_rows_v's dot products).
constexpr bool takes_lanes(int64_t R, int64_t G, int64_t head_dim) {
  return R >= 2 && 2 * R * G >= kLanes && head_dim % kLanes == 0 && head_dim % 8 == 0;
}

// bf16_dots: a bfloat16 pool's products in bfloat16 dot products where the CPU has them
// (attend_lanes_bf16_v; a 2-byte pool holds bfloat16).
template <typename T>
void attend_lanes(const KVPool<T>& kv, const float* q, int64_t q_stride, float scale, const int64_t* slots,
                  const int64_t* lens, int64_t R, int64_t kvh, int64_t G, float* out, int64_t out_stride,
                  LaneScratch& ws, bool bf16_dots = false) {
  ws.unpacked = false;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (sizeof(T) == 2) {
    if (bf16_dots && kv.head_dim % 32 == 0) {
      ws.unpacked = true;
      if (kv.head_dim == 64) return attend_lanes_bf16_v<64>(kv, q, q_stride, scale, slots, lens, R, kvh, G, out, out_stride, ws);
      return attend_lanes_bf16_v<0>(kv, q, q_stride, scale, slots, lens, R, kvh, G, out, out_stride, ws);
    }
  }
#endif
  switch (kv.head_dim) {
    case 64: return attend_lanes_v<64>(kv, q, q_stride, scale, slots, lens, R, kvh, G, out, out_stride, ws);
    case 128: return attend_lanes_v<128>(kv, q, q_stride, scale, slots, lens, R, kvh, G, out, out_stride, ws);
    default: return attend_lanes_v<0>(kv, q, q_stride, scale, slots, lens, R, kvh, G, out, out_stride, ws);
  }
}

// Decode rows of U requests whose first `shared` slots are the same (a prefix they share through
// the radix cache), for KV head kvh: the shared keys go through attend_lanes' arithmetic once for
// every row's query heads, then each row attends its own slots after them by attend_row_v, from
// its lanes' running state. q_rows[u], out_rows[u]: row u's G query heads of kvh (G * head_dim
// floats); slot_rows[u], lens[u]: its slots.
template <typename T>
void attend_shared(const KVPool<T>& kv, const float* const* q_rows, float scale, const int64_t* const* slot_rows,
                   const int64_t* lens, int64_t U, int64_t shared, int64_t kvh, int64_t G, float* const* out_rows,
                   AttnScratch& ws, LaneScratch& lanes, bool bf16_dots) {
  const int64_t D = kv.head_dim, V = D / kLanes;
  lanes.q.resize(U * G * D);
  for (int64_t u = 0; u < U; ++u) std::copy(q_rows[u], q_rows[u] + G * D, lanes.q.data() + u * G * D);
  lanes.shared_lens.assign(U, shared);
  attend_lanes(kv, lanes.q.data(), G * D, scale, slot_rows[0], lanes.shared_lens.data(), U, kvh, G, nullptr, 0, lanes,
               bf16_dots);
  for (int64_t u = 0; u < U; ++u) {
    ws.acc.resize(G * V);
    ws.mx.resize(G);
    ws.sum.resize(G);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t p = u * G + g, grp = p / kLanes, lane = p % kLanes;
      ws.mx[g] = lanes.mx[grp][lane];
      ws.sum[g] = lanes.sum[grp][lane];
      const float* o = lanes.o.data() + grp * D * kLanes + lane;
      for (int64_t i = 0; i < D; ++i) {
        const int64_t d = lanes.unpacked ? unpack_order(i) : i;
        ws.acc[g * V + d / kLanes][d % kLanes] = o[i * kLanes];
      }
    }
    switch (V) {
      case 64 / kLanes:
        attend_row_v<64 / kLanes>(kv, q_rows[u], scale, slot_rows[u], lens[u], kvh, 1, G, out_rows[u], ws, shared);
        break;
      case 128 / kLanes:
        attend_row_v<128 / kLanes>(kv, q_rows[u], scale, slot_rows[u], lens[u], kvh, 1, G, out_rows[u], ws, shared);
        break;
      default: attend_row_v<0>(kv, q_rows[u], scale, slot_rows[u], lens[u], kvh, 1, G, out_rows[u], ws, shared);
    }
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

}  // namespace bsgl
