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

#include "attention_vec.h"
#include "team.h"

namespace {

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
  const Routines<T> fns(G, D);
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
    fns.scores(qb, k, slots, len, KVH, kh, D, scale, scores.data());
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
    fns.values(scores.data(), v, slots, len, KVH, kh, D, o);
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
