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

#if VM_VECTOR
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

template <typename T>
using ScoresFn = void (*)(const float*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float, float*);
template <typename T>
using ValuesFn = void (*)(const float*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float*);

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

// Splits of each request's rows: enough tasks for every thread of the team (SPLIT_TASKS each)
// when the batch has fewer requests than that (one stream would leave all but one thread idle),
// each split at least MIN_SPLIT_ROWS rows.  `requests` counts requests, not rows: a request fed
// several rows (a speculative draft verified) splits each as its one decode row would be split,
// so it sums in the same order and gets the same result to the bit.
constexpr int64_t SPLIT_TASKS = 4, MIN_SPLIT_ROWS = 32;

int64_t splits_for(int64_t requests, int64_t max_len) {
  const int64_t want = (SPLIT_TASKS * team::size() + requests - 1) / requests;
  const int64_t most = max_len / MIN_SPLIT_ROWS;
  return want < most ? want : (most > 1 ? most : 1);
}

// A split's partial result for one query head: the max score m, Σ exp(s - m) and Σ exp(s - m) · V.
struct Partial {
  float m, l;
};

template <typename T>
void decode_attention(const float* q, const T* k, const T* v, const int64_t* kv_idx, const int64_t* lens,
                      float* out, int64_t B, int64_t requests, int64_t H, int64_t KVH, int64_t D, int64_t LMAX,
                      float scale) {
  const int64_t G = H / KVH;
#if DA_VECTOR
  const auto fns = vector_fns<T>(G, D);
#endif
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = lens[b] > max_len ? lens[b] : max_len;
  const int64_t S = splits_for(requests > 0 ? requests : B, max_len);
  static thread_local std::vector<float> part_out;  // [B, KVH, S, G, D] when S > 1
  static thread_local std::vector<Partial> parts;   // [B, KVH, S, G]
  if (S > 1) part_out.resize(B * KVH * S * G * D), parts.resize(B * KVH * S * G);
  float* const outs = part_out.data();  // the caller's buffers: the task runs on the team's threads too
  Partial* const stats = parts.data();
  auto head = [&](int64_t b, int64_t kh, int64_t s) {  // one KV head of one split of a request
    static thread_local std::vector<float> scores;
    const int64_t t = (b * KVH + kh) * S + s;
    const int64_t per = (lens[b] + S - 1) / S, l0 = s * per;
    const int64_t len = lens[b] - l0 < per ? (lens[b] - l0 > 0 ? lens[b] - l0 : 0) : per;
    const int64_t* slots = kv_idx + b * LMAX + l0;
    const float* qb = q + (b * H + kh * G) * D;  // this KV head's G query heads, contiguous
    float* o = S == 1 ? out + (b * H + kh * G) * D : outs + t * G * D;
    Partial* part = S == 1 ? nullptr : stats + t * G;
    if (len == 0) {
      std::memset(o, 0, sizeof(float) * G * D);
      for (int64_t g = 0; part != nullptr && g < G; ++g) part[g] = {-INFINITY, 0.f};
      return;
    }
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
        float sc = 0.f;
#pragma omp simd reduction(+ : sc)
        for (int64_t d = 0; d < D; ++d) sc += qg[d] * load(kp[d]);
        scores[g * len + l] = sc * scale;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores.data() + g * len;
      float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
      for (int64_t l = 0; l < len; ++l) mx = sg[l] > mx ? sg[l] : mx;
      const float sum = vmath::exp_shifted(sg, len, mx);
      if (part != nullptr) {  // normalised when the splits are combined
        part[g] = {mx, sum};
        continue;
      }
      const float inv = 1.f / sum;
      for (int64_t l = 0; l < len; ++l) sg[l] *= inv;
    }
#if DA_VECTOR
    if (fns.second != nullptr) return fns.second(scores.data(), v, slots, len, KVH, kh, D, o);
#endif
    std::memset(o, 0, sizeof(float) * G * D);
    for (int64_t l = 0; l < len; ++l) {
      const T* vp = v + (slots[l] * KVH + kh) * D;
      if (l + PREFETCH < len) prefetch_row(v + (slots[l + PREFETCH] * KVH + kh) * D, D);
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * len + l];
        float* og = o + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) og[d] += p * load(vp[d]);
      }
    }
  };
  // A task is a split of one request with all its KV heads: a pool row holds every head's K (or
  // V), so one task reads whole rows, not a head's third of each (which, spread over tasks, made
  // the prefetchers fetch each row once per head).
  team::parallel_for(B * S, [&](int64_t t) {
    for (int64_t kh = 0; kh < KVH; ++kh) head(t / S, kh, t % S);
  });
  if (S == 1) return;
  for (int64_t pair = 0; pair < B * KVH; ++pair) {  // out = Σ_s e^(m_s - M) o_s / Σ_s e^(m_s - M) l_s
    for (int64_t g = 0; g < G; ++g) {
      float M = -INFINITY;
      for (int64_t s = 0; s < S; ++s) M = stats[(pair * S + s) * G + g].m > M ? stats[(pair * S + s) * G + g].m : M;
      float* o = out + (pair * G + g) * D;  // pair = b * KVH + kh: head kh * G + g of request b
      std::memset(o, 0, sizeof(float) * D);
      float total = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        const Partial& p = stats[(pair * S + s) * G + g];
        if (p.l == 0.f) continue;
        const float w = vmath::exp_f32(p.m - M);
        total += w * p.l;
        const float* os = outs + ((pair * S + s) * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * os[d];
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

}  // namespace

extern "C" {
void decode_attention_f32(const float* q, const float* k, const float* v, const int64_t* kv_idx, const int64_t* lens,
                          float* out, int64_t B, int64_t requests, int64_t H, int64_t KVH, int64_t D, int64_t LMAX,
                          float scale) {
  decode_attention(q, k, v, kv_idx, lens, out, B, requests, H, KVH, D, LMAX, scale);
}
void decode_attention_bf16(const float* q, const uint16_t* k, const uint16_t* v, const int64_t* kv_idx,
                           const int64_t* lens, float* out, int64_t B, int64_t requests, int64_t H, int64_t KVH,
                           int64_t D, int64_t LMAX, float scale) {
  decode_attention(q, k, v, kv_idx, lens, out, B, requests, H, KVH, D, LMAX, scale);
}
}
