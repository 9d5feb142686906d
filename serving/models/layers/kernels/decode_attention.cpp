// Decode attention over the paged KV pool: one query token per request, read straight from
// its slots (no gather into a padded copy, no mask, no padding work).
//
// One task per (request, KV head): its K rows are read once for all the query heads that
// share them (grouped-query attention), softmax in float, then its V rows are read once.
// Built and loaded by serving/models/layers/native.py; runs on the kernels' team (team.h).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "team.h"
#include "vec_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define DA_VECTOR 1
#endif

namespace {

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
// One vector of floats: 16 with AVX-512, 8 with AVX2 + FMA (the machine's own build).
#if defined(__AVX512F__)
using vf = __m512;
constexpr int64_t VL = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
}
inline vf vbcast(float x) { return _mm512_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
#else
using vf = __m256;
constexpr int64_t VL = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))), 16));
}
inline vf vbcast(float x) { return _mm256_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
#endif

// Scores of G query heads against each K row: the row is loaded once, a vector at a time, for
// every head (G accumulators), then each is summed across its lanes.  D is a multiple of VL.
template <int G, typename T>
void scores_vec(const float* qb, const T* k, const int64_t* slots, int64_t len, int64_t KVH, int64_t kh,
                int64_t D, float scale, float* scores) {
  for (int64_t l = 0; l < len; ++l) {
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

// out[g] = Σ_l p[g, l] · V row l, one vector of columns at a time (G accumulators in registers;
// each pass reads one vector of every V row, so each V byte is still read once).
template <int G, typename T>
void values_vec(const float* scores, const T* v, const int64_t* slots, int64_t len, int64_t KVH, int64_t kh,
                int64_t D, float* out) {
  for (int64_t d = 0; d < D; d += VL) {
    vf acc[G];
    for (int g = 0; g < G; ++g) acc[g] = vzero();
    for (int64_t l = 0; l < len; ++l) {
      const vf vv = vload(v + (slots[l] * KVH + kh) * D + d);
      for (int g = 0; g < G; ++g) acc[g] = vfma(vbcast(scores[g * len + l]), vv, acc[g]);
    }
    for (int g = 0; g < G; ++g) vstore(out + g * D + d, acc[g]);
  }
}

template <typename T>
using ScoresFn = void (*)(const float*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float, float*);
template <typename T>
using ValuesFn = void (*)(const float*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float*);

// The vector routines for G query heads per K/V head (1 to 8), or nulls (the scalar loops run).
template <typename T>
std::pair<ScoresFn<T>, ValuesFn<T>> vector_fns(int64_t G, int64_t D) {
  if (D % VL != 0) return {nullptr, nullptr};
  switch (G) {
    case 1: return {scores_vec<1, T>, values_vec<1, T>};
    case 2: return {scores_vec<2, T>, values_vec<2, T>};
    case 3: return {scores_vec<3, T>, values_vec<3, T>};
    case 4: return {scores_vec<4, T>, values_vec<4, T>};
    case 5: return {scores_vec<5, T>, values_vec<5, T>};
    case 6: return {scores_vec<6, T>, values_vec<6, T>};
    case 7: return {scores_vec<7, T>, values_vec<7, T>};
    case 8: return {scores_vec<8, T>, values_vec<8, T>};
    default: return {nullptr, nullptr};
  }
}
#endif

template <typename T>
void decode_attention(const float* q, const T* k, const T* v, const int64_t* kv_idx, const int64_t* lens,
                      float* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t LMAX, float scale) {
  const int64_t G = H / KVH;
#if DA_VECTOR
  const auto fns = vector_fns<T>(G, D);
#endif
  auto task = [&](int64_t t) {  // one (request, KV head)
    static thread_local std::vector<float> scores, acc;
    const int64_t b = t / KVH, kh = t % KVH;
    acc.assign(G * D, 0.f);
    const int64_t len = lens[b];
    const int64_t* slots = kv_idx + b * LMAX;
    const float* qb = q + (b * H + kh * G) * D;  // this KV head's G query heads, contiguous
    scores.assign(G * len, 0.f);
#if DA_VECTOR
    if (fns.first != nullptr) {
      fns.first(qb, k, slots, len, KVH, kh, D, scale, scores.data());
    } else
#endif
    for (int64_t l = 0; l < len; ++l) {
      const T* kp = k + (slots[l] * KVH + kh) * D;
      if (l + PREFETCH < len) prefetch_row(k + (slots[l + PREFETCH] * KVH + kh) * D, D);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qb + g * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qg[d] * load(kp[d]);
        scores[g * len + l] = s * scale;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores.data() + g * len;
      float mx = -INFINITY;
      for (int64_t l = 0; l < len; ++l) mx = sg[l] > mx ? sg[l] : mx;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t l = 0; l < len; ++l) {
        sg[l] = vmath::exp_f32(sg[l] - mx);
        sum += sg[l];
      }
      const float inv = 1.f / sum;
      for (int64_t l = 0; l < len; ++l) sg[l] *= inv;
    }
#if DA_VECTOR
    if (fns.second != nullptr) {
      fns.second(scores.data(), v, slots, len, KVH, kh, D, out + (b * H + kh * G) * D);
      return;
    }
#endif
    for (int64_t l = 0; l < len; ++l) {
      const T* vp = v + (slots[l] * KVH + kh) * D;
      if (l + PREFETCH < len) prefetch_row(v + (slots[l + PREFETCH] * KVH + kh) * D, D);
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * len + l];
        float* ag = acc.data() + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * load(vp[d]);
      }
    }
    std::memcpy(out + (b * H + kh * G) * D, acc.data(), sizeof(float) * G * D);
  };
  team::parallel_for(B * KVH, task);
}

}  // namespace

extern "C" {
void decode_attention_f32(const float* q, const float* k, const float* v, const int64_t* kv_idx, const int64_t* lens,
                          float* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t LMAX, float scale) {
  decode_attention(q, k, v, kv_idx, lens, out, B, H, KVH, D, LMAX, scale);
}
void decode_attention_bf16(const float* q, const uint16_t* k, const uint16_t* v, const int64_t* kv_idx,
                           const int64_t* lens, float* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t LMAX,
                           float scale) {
  decode_attention(q, k, v, kv_idx, lens, out, B, H, KVH, D, LMAX, scale);
}
}
