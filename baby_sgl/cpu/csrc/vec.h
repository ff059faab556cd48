// Vectors of floats in the CPU's own width, written with the compiler's vector extensions (GCC
// and clang): 16 lanes (one register) with AVX-512, 8 with AVX2, 4 otherwise (SSE, NEON, or
// scalar code where there is no SIMD), so one source is the fast path on every CPU and the
// portable one elsewhere. (A 16-float type on AVX2 compiled to two registers per value, and
// GCC spilled the kernels' accumulators to the stack: 15 GFLOP/s instead of 100.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace bsgl {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float fv __attribute__((vector_size(4 * kLanes)));
typedef int32_t iv __attribute__((vector_size(4 * kLanes)));
typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));

// While alive, this thread treats denormal floats as zero (x86's FTZ and DAZ bits). Attention
// weights of far-off keys are tiny (down to 1e-38), and products with them fall below the
// normal range, where each operation takes a microcode assist: a batch-1 decode step over
// real KV ran at twice its time over a zeroed pool. A flushed value is below 1e-38 of the sum
// it joins, so no float32 result moves.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

#if defined(__AVX2__)
// Eight vectors of eight 32-bit words transposed in place: afterwards v[q] holds word q of the
// vectors 0..7 that came in, vector c's in lane c.
inline void transpose8_epi32(__m256i (&v)[8]) {
  __m256i t[8], u[8];
  for (int r = 0; r < 8; r += 2) {  // t[r]: words 0, 1 (and 4, 5) of rows r, r + 1; t[r + 1]: 2, 3 (6, 7)
    t[r] = _mm256_unpacklo_epi32(v[r], v[r + 1]);
    t[r + 1] = _mm256_unpackhi_epi32(v[r], v[r + 1]);
  }
  for (int h = 0; h < 8; h += 4) {  // u[h + i]: word i of rows h .. h + 3, and word 4 + i in the high half
    u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
    u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
    u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
    u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
    v[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
  }
}
#endif

// A buffer of n T aligned to 64 bytes, growable (contents are not kept). Kernels' 16-float loads
// from a misaligned buffer straddle cache lines: that made a batch-8 decode step 1.6x slower.
template <typename T>
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(int64_t n) { reserve(n); }
  ~AlignedBuffer() { std::free(data_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  void reserve(int64_t n) {
    if (n <= size_) return;
    std::free(data_);
    data_ = static_cast<T*>(std::aligned_alloc(64, ((n * sizeof(T) + 63) / 64) * 64));
    if (data_ == nullptr) throw std::bad_alloc();
    size_ = n;
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  T& operator[](int64_t i) { return data_[i]; }

 private:
  T* data_ = nullptr;
  int64_t size_ = 0;
};

inline fv loadv(const float* p) {
  fv v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, fv v) { std::memcpy(p, &v, sizeof(v)); }

// a * b + c in one rounding where the CPU has FMA (what the compiler's contraction makes of
// `acc += a * b` elsewhere), spelled out where a kernel must not depend on whether the compiler
// contracts: weights.h's tiles and panel tiles, whose bits must be equal (GCC left a panel tile of
// one row by one column as a multiply and an add).
inline fv fmadd(fv a, fv b, fv c) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
  const __m512 r = _mm512_fmadd_ps(reinterpret_cast<__m512&>(a), reinterpret_cast<__m512&>(b), reinterpret_cast<__m512&>(c));
#else
  const __m256 r = _mm256_fmadd_ps(reinterpret_cast<__m256&>(a), reinterpret_cast<__m256&>(b), reinterpret_cast<__m256&>(c));
#endif
  static_assert(sizeof(r) == sizeof(fv));
  fv out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
#else
  return a * b + c;  // no FMA instruction here (SSE builds): nothing to contract either
#endif
}

inline fv splat(float x) {  // spelled out: compilers make the braces one broadcast
#if defined(__AVX512F__)
  return fv{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#elif defined(__AVX2__)
  return fv{x, x, x, x, x, x, x, x};
#else
  return fv{x, x, x, x};
#endif
}

// Sum of the lanes, always in the same order (halves added pairwise down to four lanes, then
// (0 + 2) + (1 + 3)), so a dot product's result does not depend on which kernel shape computed it.
inline float hsum(fv v) {
  f4v c;
  if constexpr (kLanes == 16) {
    f8v a, b;
    std::memcpy(&a, &v, 32);
    std::memcpy(&b, reinterpret_cast<const char*>(&v) + 32, 32);
    a += b;
    f4v d;
    std::memcpy(&c, &a, 16);
    std::memcpy(&d, reinterpret_cast<const char*>(&a) + 16, 16);
    c += d;
  } else if constexpr (kLanes == 8) {
    f4v d;
    std::memcpy(&c, &v, 16);
    std::memcpy(&d, reinterpret_cast<const char*>(&v) + 16, 16);
    c += d;
  } else {
    std::memcpy(&c, &v, 16);
  }
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// hsum of each of kLanes vectors, lane j of the result hsum(v[j]): on AVX-512 the sixteen sums
// are added up side by side, pair for pair as hsum adds them (so the same bits), in 15 additions
// and 30 shuffles rather than sixteen reductions.
inline fv lane_sums(const fv* v) {
#if defined(__AVX512F__)
  if constexpr (kLanes == 16) {
    __m512 x[16];
    std::memcpy(x, v, sizeof(x));
    // a_i = v_i + v_{i+8}: vectors 2t and 2t + 1 give [a of 2t | a of 2t + 1].
    __m512 a[8];
    for (int t = 0; t < 8; ++t)
      a[t] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * t], x[2 * t + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(x[2 * t], x[2 * t + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // c_i = a_i + a_{i+4}: [c of 4t | c of 4t + 1 | c of 4t + 2 | c of 4t + 3].
    __m512 c[4];
    for (int t = 0; t < 4; ++t)
      c[t] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    // (c0 + c2) + (c1 + c3), within each 128-bit lane: e = [c0 + c2, c1 + c3] of two vectors.
    __m512 e[2];
    for (int t = 0; t < 2; ++t)
      e[t] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * t], c[2 * t + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(c[2 * t], c[2 * t + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
    // Lane 4L + u holds vector 4u + L's sum: put vector j's in lane j.
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    fv out;
    const __m512 r = _mm512_permutexvar_ps(order, sums);
    std::memcpy(&out, &r, sizeof(out));
    return out;
  }
#endif
  fv out;
  for (int j = 0; j < kLanes; ++j) out[j] = hsum(v[j]);
  return out;
}

inline fv vmax(fv a, fv b) { return a > b ? a : b; }
inline fv vmin(fv a, fv b) { return a < b ? a : b; }

// Largest lane.
inline float hmax(fv v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// bfloat16 is the top half of a float32: widening is a shift.
inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if (std::isnan(f)) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// Widening kLanes narrow integers (uint8, int8 or uint16) to 32 bits. The compilers' generic
// conversion between vectors of different sizes is scalarized (GCC 12), so x86 gets the
// instructions by name.
template <typename Src>
inline iv widen(const Src* p) {
  static_assert(std::is_same_v<Src, uint8_t> || std::is_same_v<Src, int8_t> || std::is_same_v<Src, uint16_t>);
  iv r;
#if defined(__AVX512F__)
  __m512i v;
  if constexpr (std::is_same_v<Src, uint16_t>) {
    v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    v = std::is_same_v<Src, uint8_t> ? _mm512_cvtepu8_epi32(bytes) : _mm512_cvtepi8_epi32(bytes);
  }
  std::memcpy(&r, &v, 64);
#elif defined(__AVX2__)
  __m256i v;
  if constexpr (std::is_same_v<Src, uint16_t>) {
    v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    v = std::is_same_v<Src, uint8_t> ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
  }
  std::memcpy(&r, &v, 32);
#else
  for (int i = 0; i < kLanes; ++i) r[i] = p[i];
#endif
  return r;
}

inline fv load_bf16(const uint16_t* p) {
  const iv r = widen(p) << 16;
  fv f;
  std::memcpy(&f, &r, sizeof(f));
  return f;
}

inline fv to_float(iv v) { return __builtin_convertvector(v, fv); }

// IEEE half to float (GGUF block scales), exact.
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int shift = 0;
    while (!(mant & 0x400)) mant <<= 1, ++shift;
    bits = sign | ((113 - shift) << 23) | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// Two adjacent halves (a block's d and m) in one conversion.
inline void half2_to_float(const uint8_t* p, float& a, float& b) {
#if defined(__F16C__)
  int32_t bits;
  std::memcpy(&bits, p, 4);
  const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
  a = _mm_cvtss_f32(v);
  b = _mm_cvtss_f32(_mm_movehdup_ps(v));
#else
  uint16_t h[2];
  std::memcpy(h, p, 4);
  a = half_to_float(h[0]);
  b = half_to_float(h[1]);
#endif
}

// exp(x), a vector at a time: Cephes' expf (range reduction by ln 2, degree-6 polynomial, 2^k
// from the exponent bits), relative error ~1e-7. x is clamped to [-87, 88]: below, the result
// is ~1e-38 instead of 0; above, 1.6e38 instead of inf.
inline fv expv(fv x) {
  const fv v = vmin(vmax(x, splat(-87.f)), splat(88.f));
  const fv t = v * 1.44269504088896341f + 0.5f;
  fv k = __builtin_convertvector(__builtin_convertvector(t, iv), fv);  // truncated
  k = k > t ? k - 1.f : k;                                              // floor
  const fv r = v - k * 0.693359375f + k * 2.12194440e-4f;
  fv p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const iv bits = (__builtin_convertvector(k, iv) + 127) << 23;
  fv scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// exp in place over n floats.
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) storev(x + i, expv(loadv(x + i)));
  if (i < n) {
    float tail[kLanes] = {};
    std::memcpy(tail, x + i, (n - i) * sizeof(float));
    const fv e = expv(loadv(tail));
    std::memcpy(x + i, &e, (n - i) * sizeof(float));
  }
}

}  // namespace bsgl
