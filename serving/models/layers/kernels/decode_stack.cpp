// Every layer of a decode-only step of the Llama-shaped decoder in one call.
//
// The per-layer kernels (linear or quantized linear, RMSNorm, RoPE + K/V store, decode attention,
// SiLU·mul) are the same ones the layer-by-layer Python forward calls, in the same order on the
// same buffers, so the result is bit for bit that forward's.  What the call saves is the Python
// between them: at one decode stream a step is ~12 kernel calls a layer, each ~5–15 µs of ctypes
// conversion and tensor allocation, as long as the kernels themselves.  The team's workers stay
// awake for the whole call (team::Hold), so no kernel pays a wake-up.
//
// Only a step whose every token decodes (no prefill chunk, no pooled rows) runs here; the caller
// checks, and runs the rest in Python.
#include <cstdint>
#include <cstring>
#include <vector>

#include "team.h"

extern "C" {
void linear_f32(const float* x, const float* wp, const float* bias, float* y, int64_t M, int64_t N, int64_t K);
void quant_linear(const float* x, int64_t M, int64_t K, int nparts, const int32_t* types,
                  const uint8_t* const* weights, const int64_t* rows, float* y, int64_t N);
void rms_norm_f32(const float* x, const float* residual, const float* weight, float* h, float* y, int64_t M,
                  int64_t D, float eps);
void rope_store_f32(const float* q, int64_t sq, const float* k, int64_t sk, const float* v, int64_t sv,
                    const float* cos, const float* sin, const int64_t* slots, float* q_out, float* k_pool,
                    float* v_pool, int64_t T, int64_t H, int64_t KVH, int64_t D);
void decode_attention_f32(const float* q, const float* k, const float* v, const int64_t* kv_idx, const int64_t* lens,
                          float* out, int64_t B, int64_t requests, int64_t H, int64_t KVH, int64_t D, int64_t LMAX,
                          float scale);
void silu_mul_f32(const float* gu, float* out, int64_t M, int64_t N);
}

namespace {

// One fused linear layer as the Python side holds it: the float32 kernel's packed panels, or a
// quantized layer's parts.  Field order and types match `serving.models.layers.decode_stack`.
struct Lin {
  const float* packed;  // float32 panels, or null for a quantized layer
  const float* bias;    // float32: padded to whole panels; quantized: [n] added after; or null
  const int32_t* types;
  const uint8_t* const* ptrs;
  const int64_t* rows;
  int64_t nparts, n, k;
};

struct Layer {
  const float* attn_norm;
  const float* mlp_norm;
  const float* q_norm;  // per-head RMSNorm weights [head_dim] (Qwen3), or null
  const float* k_norm;
  float* k_pool;
  float* v_pool;
  Lin qkv, o, gate_up, down;
};

struct Stack {
  const Layer* layers;
  int64_t num_layers, hidden, heads, kv_heads, head_dim;
  float eps;
};

void linear(const Lin& l, const float* x, float* y, int64_t M) {
  if (l.packed != nullptr) return linear_f32(x, l.packed, l.bias, y, M, l.n, l.k);
  quant_linear(x, M, l.k, static_cast<int>(l.nparts), l.types, l.ptrs, l.rows, y, l.n);
  if (l.bias != nullptr)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < l.n; ++j) y[m * l.n + j] += l.bias[j];
}

std::vector<float>& buffer(int i, int64_t size) {
  static thread_local std::vector<float> bufs[7];
  if (static_cast<int64_t>(bufs[i].size()) < size) bufs[i].resize(size);
  return bufs[i];
}

}  // namespace

extern "C" {

// h [B, hidden]: the residual stream in, the last layer's out (before the final norm).  Token b
// is at `positions[b]` (cos/sin: the [max_positions, head_dim] tables), writes its K/V into slot
// `slots[b]` and attends to `kv_idx[b, :lens[b]]` (LMAX columns).
void decode_stack_f32(const Stack* s, float* h, int64_t B, const float* cos_table, const float* sin_table,
                      const int64_t* positions, const int64_t* slots, const int64_t* kv_idx, const int64_t* lens,
                      int64_t lmax, int64_t requests, float scale) {
  team::Hold awake;
  const int64_t D = s->head_dim, H = s->heads, KVH = s->kv_heads, hid = s->hidden;
  const int64_t qn = H * D, kn = KVH * D;
  float* x = buffer(0, B * hid).data();
  float* cs = buffer(1, 2 * B * D).data();
  float* sn = cs + B * D;
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(cs + b * D, cos_table + positions[b] * D, sizeof(float) * D);
    std::memcpy(sn + b * D, sin_table + positions[b] * D, sizeof(float) * D);
  }
  for (int64_t i = 0; i < s->num_layers; ++i) {
    const Layer& L = s->layers[i];
    float* qkv = buffer(2, B * L.qkv.n).data();
    float* q = buffer(3, B * (qn + kn)).data();  // rope(q); the normed q, k first when the family norms them
    float* attn = buffer(4, B * qn).data();
    float* o = buffer(5, B * (L.o.n > L.down.n ? L.o.n : L.down.n)).data();
    rms_norm_f32(h, nullptr, L.attn_norm, nullptr, x, B, hid, s->eps);
    linear(L.qkv, x, qkv, B);
    const float *qs = qkv, *ks = qkv + qn;
    int64_t sq = L.qkv.n, sk = L.qkv.n;
    if (L.q_norm != nullptr) {  // each head's q and k normalised, contiguous, as the Python forward's copies are
      float* qk = buffer(6, B * (qn + kn)).data();
      for (int64_t b = 0; b < B; ++b) {
        std::memcpy(qk + b * qn, qkv + b * L.qkv.n, sizeof(float) * qn);
        std::memcpy(qk + B * qn + b * kn, qkv + b * L.qkv.n + qn, sizeof(float) * kn);
      }
      rms_norm_f32(qk, nullptr, L.q_norm, nullptr, qk, B * H, D, s->eps);
      rms_norm_f32(qk + B * qn, nullptr, L.k_norm, nullptr, qk + B * qn, B * KVH, D, s->eps);
      qs = qk, ks = qk + B * qn, sq = qn, sk = kn;
    }
    rope_store_f32(qs, sq, ks, sk, qkv + qn + kn, L.qkv.n, cs, sn, slots, q, L.k_pool, L.v_pool, B, H, KVH, D);
    decode_attention_f32(q, L.k_pool, L.v_pool, kv_idx, lens, attn, B, requests, H, KVH, D, lmax, scale);
    linear(L.o, attn, o, B);
    rms_norm_f32(h, o, L.mlp_norm, h, x, B, hid, s->eps);  // h += attention; x = its norm
    float* gu = buffer(2, B * L.gate_up.n).data();
    linear(L.gate_up, x, gu, B);
    float* act = buffer(3, B * (L.gate_up.n / 2)).data();
    silu_mul_f32(gu, act, B, L.gate_up.n / 2);
    linear(L.down, act, o, B);
    for (int64_t j = 0; j < B * hid; ++j) h[j] += o[j];
  }
}

}  // extern "C"
