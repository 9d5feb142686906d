// The vector routines of attention over the paged KV pool, shared by the decode kernel
// (decode_attention.cpp: one query token per request) and the extend kernel (extend_attention.cpp:
// a prefill chunk's query tokens, a block of them per task): scores of G query rows against K rows
// read through a slot list, then the probability-weighted sum of the V rows.  `scores_fn`/`values_fn`
// give the vector routine for G rows and this head size, else the scalar one.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>

#include "vec_math.h"

#if VM_VECTOR
#define DA_VECTOR 1
#endif

namespace {

template <typename T>
using ScoresFn = void (*)(const float*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float, float*);
template <typename T>
using ValuesFn = void (*)(const float*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float*);

constexpr int64_t PREFETCH = 8;  // rows ahead: slots are scattered, so the hardware prefetcher cannot follow them

template <typename T>
inline void prefetch_row(const T* p, int64_t D) {
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + off);
}

inline float load(float x) { return x; }
inline float load(uint16_t bf16) {  // bfloat16 is the high half of a float32
  uint32_t u = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#if DA_VECTOR
using vmath::vbcast, vmath::vf, vmath::vfma, vmath::vload, vmath::vstore, vmath::vsum, vmath::vzero, vmath::VL;
#if defined(__AVX512F__)
inline __m256 half_sum(vf v) {  // lanes i and i + 8 added
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
inline __m256 half_sum(vf v) { return v; }
#endif

// The lane sums of four vectors, as one [sum a, sum b, sum c, sum d].
inline __m128 vsum4(vf a, vf b, vf c, vf d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(half_sum(a), half_sum(b)), _mm256_hadd_ps(half_sum(c), half_sum(d)));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Vectors in registers: 16 on AVX2, 32 on AVX-512; the routines below keep their accumulators
// within BUDGET of them.
constexpr int BUDGET = VL == 16 ? 24 : 12;

// Scores of G query heads against each K row: the row is loaded once, a vector at a time, for
// every head (G accumulators), then each is summed across its lanes.  Where 4 · G accumulators
// fit, 4 rows go together: 4 · G independent FMA chains instead of G (one row's chain of D / VL
// dependent FMAs made the loop latency-bound), and their sums come out 4 at a time (vsum4).
// D is a multiple of VL.
template <int G, typename T>
void scores_vec(const float* qb, const T* k, const int64_t* slots, int64_t len, int64_t KVH, int64_t kh,
                int64_t D, float scale, float* scores) {
  int64_t l = 0;
  if constexpr (4 * G <= BUDGET) {
    for (; l + 4 <= len; l += 4) {
      const T* kp[4];
      for (int r = 0; r < 4; ++r) {
        kp[r] = k + (slots[l + r] * KVH + kh) * D;
        if (l + r + PREFETCH < len) prefetch_row(k + (slots[l + r + PREFETCH] * KVH + kh) * D, D);
      }
      vf acc[G][4];
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < 4; ++r) acc[g][r] = vzero();
      for (int64_t d = 0; d < D; d += VL) {
        vf kv[4];
        for (int r = 0; r < 4; ++r) kv[r] = vload(kp[r] + d);
        for (int g = 0; g < G; ++g) {
          const vf qv = vload(qb + g * D + d);
          for (int r = 0; r < 4; ++r) acc[g][r] = vfma(qv, kv[r], acc[g][r]);
        }
      }
      for (int g = 0; g < G; ++g)
        _mm_storeu_ps(scores + g * len + l,
                      _mm_mul_ps(vsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale)));
    }
  }
  for (; l < len; ++l) {
    const T* kp = k + (slots[l] * KVH + kh) * D;
    if (l + PREFETCH < len) prefetch_row(k + (slots[l + PREFETCH] * KVH + kh) * D, D);
    vf acc[G];
    for (int g = 0; g < G; ++g) acc[g] = vzero();
    for (int64_t d = 0; d < D; d += VL) {
      const vf kv = vload(kp + d);
      for (int g = 0; g < G; ++g) acc[g] = vfma(vload(qb + g * D + d), kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * len + l] = vsum(acc[g]) * scale;
  }
}

// Vectors of a V row per pass of values_vec: as many as keep G·P accumulators within BUDGET and
// divide the row.  A pass reads whole cache lines of every row (P vectors: 2 lines on AVX2 at
// P = 4) and prefetches them PREFETCH rows ahead, so each V byte is read once and the loads are
// not left to the hardware prefetcher.

// out[g] = Σ_l p[g, l] · V row l, P vectors of columns at a time.
template <int G, int P, typename T>
void values_vec(const float* scores, const T* v, const int64_t* slots, int64_t len, int64_t KVH, int64_t kh,
                int64_t D, float* out) {
  for (int64_t d = 0; d < D; d += P * VL) {
    vf acc[G][P];
    for (int g = 0; g < G; ++g)
      for (int p = 0; p < P; ++p) acc[g][p] = vzero();
    for (int64_t l = 0; l < len; ++l) {
      const T* vp = v + (slots[l] * KVH + kh) * D + d;
      if (l + PREFETCH < len) {
        const char* ahead = reinterpret_cast<const char*>(v + (slots[l + PREFETCH] * KVH + kh) * D + d);
        for (int64_t off = 0; off < P * VL * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(ahead + off);
      }
      vf pg[G];
      for (int g = 0; g < G; ++g) pg[g] = vbcast(scores[g * len + l]);
      for (int p = 0; p < P; ++p) {
        const vf vv = vload(vp + p * VL);
        for (int g = 0; g < G; ++g) acc[g][p] = vfma(pg[g], vv, acc[g][p]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int p = 0; p < P; ++p) vstore(out + g * D + d + p * VL, acc[g][p]);
  }
}


template <int G, typename T>
std::pair<ScoresFn<T>, ValuesFn<T>> fns_for(int64_t D) {
  const int64_t vectors = D / VL;
  if (G * 4 <= BUDGET && vectors % 4 == 0) return {scores_vec<G, T>, values_vec<G, 4, T>};
  if (G * 2 <= BUDGET && vectors % 2 == 0) return {scores_vec<G, T>, values_vec<G, 2, T>};
  return {scores_vec<G, T>, values_vec<G, 1, T>};
}

// The vector routines for G query heads per K/V head (1 to 8), or nulls (the scalar loops run).
template <typename T>
std::pair<ScoresFn<T>, ValuesFn<T>> vector_fns(int64_t G, int64_t D) {
  if (D % VL != 0) return {nullptr, nullptr};
  switch (G) {
    case 1: return fns_for<1, T>(D);
    case 2: return fns_for<2, T>(D);
    case 3: return fns_for<3, T>(D);
    case 4: return fns_for<4, T>(D);
    case 5: return fns_for<5, T>(D);
    case 6: return fns_for<6, T>(D);
    case 7: return fns_for<7, T>(D);
    case 8: return fns_for<8, T>(D);
    default: return {nullptr, nullptr};
  }
}
#endif

// scores[g, l] = scale · q[g] · K row l, for the G rows of `qb` (any G, any D).
template <typename T>
void scores_scalar(const float* qb, const T* k, const int64_t* slots, int64_t len, int64_t KVH, int64_t kh,
                   int64_t D, float scale, float* scores, int64_t G) {
  for (int64_t l = 0; l < len; ++l) {
    const T* kp = k + (slots[l] * KVH + kh) * D;
    if (l + PREFETCH < len) prefetch_row(k + (slots[l + PREFETCH] * KVH + kh) * D, D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qb + g * D;
      float sc = 0.f;
#pragma omp simd reduction(+ : sc)
      for (int64_t d = 0; d < D; ++d) sc += qg[d] * load(kp[d]);
      scores[g * len + l] = sc * scale;
    }
  }
}

// out[g] = Σ_l p[g, l] · V row l (any G, any D).
template <typename T>
void values_scalar(const float* scores, const T* v, const int64_t* slots, int64_t len, int64_t KVH, int64_t kh,
                   int64_t D, float* out, int64_t G) {
  std::memset(out, 0, sizeof(float) * G * D);
  for (int64_t l = 0; l < len; ++l) {
    const T* vp = v + (slots[l] * KVH + kh) * D;
    if (l + PREFETCH < len) prefetch_row(v + (slots[l + PREFETCH] * KVH + kh) * D, D);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * len + l];
      float* og = out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += p * load(vp[d]);
    }
  }
}

// Both routines for G query rows per K/V head: the vector ones where this build has them for G and D,
// else the scalar ones.
template <typename T>
struct Routines {
  ScoresFn<T> scores_vec = nullptr;
  ValuesFn<T> values_vec = nullptr;
  int64_t G;

  Routines(int64_t g, int64_t D) : G(g) {
#if DA_VECTOR
    std::tie(scores_vec, values_vec) = vector_fns<T>(g, D);
#else
    (void)D;
#endif
  }
  void scores(const float* qb, const T* k, const int64_t* slots, int64_t len, int64_t KVH, int64_t kh, int64_t D,
              float scale, float* out) const {
    if (scores_vec != nullptr) return scores_vec(qb, k, slots, len, KVH, kh, D, scale, out);
    scores_scalar(qb, k, slots, len, KVH, kh, D, scale, out, G);
  }
  void values(const float* p, const T* v, const int64_t* slots, int64_t len, int64_t KVH, int64_t kh, int64_t D,
              float* out) const {
    if (values_vec != nullptr) return values_vec(p, v, slots, len, KVH, kh, D, out);
    values_scalar(p, v, slots, len, KVH, kh, D, out, G);
  }
};

}  // namespace
