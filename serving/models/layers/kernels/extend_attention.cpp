// Extend (prefill chunk) attention over the paged KV pool: a chunk's n query tokens attend, causally,
// to its prefix's slots and its own, read in place: no gathered copy of the context, no mask tensor,
// and no work above the diagonal beyond a block's few rows.
//
// One task per (block of QB query tokens, KV head): the block's QB · G query rows (G query heads per
// KV head) share every K and V row read, the vector routines of attention_vec.h over up to 6 rows at
// once.  Query i (position prefix + i of the slot list) sees keys [lo_i, prefix + i] where lo_i is 0,
// or, under a sliding window, its window's first key; a block scores the union of its rows' ranges
// and each row's softmax covers its own range only.  Built and loaded by serving/models/layers/native.py.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_vec.h"
#include "team.h"

namespace {

constexpr int64_t BLOCK_ROWS = 6;  // query rows per task: 4 K rows × 6 accumulators fit AVX-512's registers

template <typename T>
void extend_attention(const float* q, const T* k, const T* v, const int64_t* slots, float* out, int64_t n,
                      int64_t L, int64_t H, int64_t KVH, int64_t D, int64_t window, float scale) {
  const int64_t G = H / KVH;
  const int64_t QB = G < BLOCK_ROWS ? BLOCK_ROWS / G : 1;  // query tokens per block
  const Routines<T> fns(QB * G, D);
  const int64_t prefix = L - n, blocks = (n + QB - 1) / QB;
  auto first_key = [&](int64_t i) {  // query i's oldest visible key
    const int64_t lo = prefix + i + 1 - window;
    return window > 0 && lo > 0 ? lo : 0;
  };
  team::parallel_for(blocks * KVH, [&](int64_t t) {
    static thread_local std::vector<float> qbuf, scores, obuf;
    const int64_t b = t / KVH, kh = t % KVH, i0 = b * QB;
    const int64_t qn = n - i0 < QB ? n - i0 : QB, rows = QB * G;
    const int64_t lo = first_key(i0), hi = prefix + i0 + qn, len = hi - lo;  // the block's keys [lo, hi)
    qbuf.assign(rows * D, 0.f);  // the block's query rows, contiguous (a short last block's rest stays 0)
    for (int64_t qi = 0; qi < qn; ++qi)
      std::memcpy(qbuf.data() + qi * G * D, q + ((i0 + qi) * H + kh * G) * D, sizeof(float) * G * D);
    scores.assign(rows * len, 0.f);
    fns.scores(qbuf.data(), k, slots + lo, len, KVH, kh, D, scale, scores.data());
    for (int64_t r = 0; r < rows; ++r) {
      float* s = scores.data() + r * len;
      const int64_t qi = r / G;
      if (qi >= qn) {  // padding rows of a short block: no weight on any V row
        std::memset(s, 0, sizeof(float) * len);
        continue;
      }
      const int64_t a = first_key(i0 + qi) - lo, e = prefix + i0 + qi + 1 - lo;  // this row's keys [a, e)
      float mx = -INFINITY;
      for (int64_t l = a; l < e; ++l) mx = s[l] > mx ? s[l] : mx;
      const float inv = 1.f / vmath::exp_shifted(s + a, e - a, mx);
      for (int64_t l = a; l < e; ++l) s[l] *= inv;
      std::memset(s, 0, sizeof(float) * a);
      std::memset(s + e, 0, sizeof(float) * (len - e));
    }
    obuf.resize(rows * D);
    fns.values(scores.data(), v, slots + lo, len, KVH, kh, D, obuf.data());
    for (int64_t qi = 0; qi < qn; ++qi)
      std::memcpy(out + ((i0 + qi) * H + kh * G) * D, obuf.data() + qi * G * D, sizeof(float) * G * D);
  });
}

}  // namespace

extern "C" {
void extend_attention_f32(const float* q, const float* k, const float* v, const int64_t* slots, float* out, int64_t n,
                          int64_t L, int64_t H, int64_t KVH, int64_t D, int64_t window, float scale) {
  extend_attention(q, k, v, slots, out, n, L, H, KVH, D, window, scale);
}
void extend_attention_bf16(const float* q, const uint16_t* k, const uint16_t* v, const int64_t* slots, float* out,
                           int64_t n, int64_t L, int64_t H, int64_t KVH, int64_t D, int64_t window, float scale) {
  extend_attention(q, k, v, slots, out, n, L, H, KVH, D, window, scale);
}
}
