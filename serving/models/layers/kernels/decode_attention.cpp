// Decode attention over the paged KV pool: one query token per request, read straight from
// its slots (no gather into a padded copy, no mask, no padding work).
//
// One task per (request, KV head): its K rows are read once for all the query heads that
// share them (grouped-query attention), softmax in float, then its V rows are read once.
// Built and loaded by serving/models/layers/native.py; runs on the kernels' team (team.h).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "team.h"
#include "vec_math.h"

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

template <typename T>
void decode_attention(const float* q, const T* k, const T* v, const int64_t* kv_idx, const int64_t* lens,
                      float* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t LMAX, float scale) {
  const int64_t G = H / KVH;
  auto task = [&](int64_t t) {  // one (request, KV head)
    static thread_local std::vector<float> scores, acc;
    const int64_t b = t / KVH, kh = t % KVH;
    acc.assign(G * D, 0.f);
    const int64_t len = lens[b];
    const int64_t* slots = kv_idx + b * LMAX;
    const float* qb = q + (b * H + kh * G) * D;  // this KV head's G query heads, contiguous
    scores.assign(G * len, 0.f);
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
