// Rotary position embedding of one step's Q and K, fused with storing K and V in their KV slots:
//   q_out[t, h] = rope(q[t, h]);  k_pool[slot[t], h] = rope(k[t, h]);  v_pool[slot[t], h] = v[t, h]
// with rope(x)[i] = x[i]·cos[i] − x[i + D/2]·sin[i] and rope(x)[i + D/2] = x[i + D/2]·cos[i + D/2] + x[i]·sin[i + D/2]
// (transformers' rotate_half convention; cos/sin already gathered at each token's position).  In
// torch these are about sixteen small ops a layer (two rotations, two indexed stores); here one call.
#include <cstdint>
#include <cstring>

#include "team.h"

namespace {

constexpr int64_t TOKENS_PER_CHUNK = 8;

inline void rotate(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    out[i] = a * c[i] - b * s[i];
    out[i + half] = b * c[i + half] + a * s[i + half];
  }
}

}  // namespace

extern "C" {

// q: [T] rows of H·D floats, `sq` floats apart; k, v: [T] rows of KVH·D, `sk` and `sv` apart;
// cos, sin: [T, D]; slots: [T]; q_out: [T, H, D]; k_pool, v_pool: [slots, KVH, D].
void rope_store_f32(const float* q, int64_t sq, const float* k, int64_t sk, const float* v, int64_t sv,
                    const float* cos, const float* sin, const int64_t* slots, float* q_out, float* k_pool,
                    float* v_pool, int64_t T, int64_t H, int64_t KVH, int64_t D) {
  const int64_t chunks = (T + TOKENS_PER_CHUNK - 1) / TOKENS_PER_CHUNK;
  team::parallel_for(chunks, [&](int64_t ch) {
    const int64_t end = (ch + 1) * TOKENS_PER_CHUNK < T ? (ch + 1) * TOKENS_PER_CHUNK : T;
    for (int64_t t = ch * TOKENS_PER_CHUNK; t < end; ++t) {
      const float* c = cos + t * D;
      const float* s = sin + t * D;
      for (int64_t h = 0; h < H; ++h) rotate(q + t * sq + h * D, c, s, q_out + (t * H + h) * D, D);
      float* kd = k_pool + slots[t] * KVH * D;
      for (int64_t h = 0; h < KVH; ++h) rotate(k + t * sk + h * D, c, s, kd + h * D, D);
      std::memcpy(v_pool + slots[t] * KVH * D, v + t * sv, sizeof(float) * KVH * D);
    }
  });
}

}  // extern "C"
