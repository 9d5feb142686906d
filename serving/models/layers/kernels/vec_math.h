// exp for float32 on whole vectors (AVX2 + FMA, AVX-512) with a scalar twin for the tails:
// Cody–Waite reduction by ln 2 and Cephes' degree-6 polynomial, within 2 ulp of expf over the
// float range (clamped so that the result stays a normal float).  The vector forms are written
// with intrinsics because gcc does not vectorise the clamp's branches on AVX2 builds (a scalar
// exp made SiLU·mul 8 µs a row of 1536 values); glibc's expf is scalar too.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace vmath {

constexpr float LO = -87.3f, HI = 88.3f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f,
                LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;

inline float exp_f32(float x) {
  x = x < LO ? LO : (x > HI ? HI : x);
  const float n = std::nearbyint(x * LOG2E);
  const float r = std::fma(n, -LN2_LO, std::fma(n, -LN2_HI, x));  // x − n·ln 2 in two parts
  float p = P0;
  p = std::fma(p, r, P1);
  p = std::fma(p, r, P2);
  p = std::fma(p, r, P3);
  p = std::fma(p, r, P4);
  p = std::fma(p, r, P5);
  p = std::fma(p * r, r, r) + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// One vector of floats for this build: 16 with AVX-512, 8 with AVX2 + FMA (VM_VECTOR), and
// the few operations the kernels write their loops with, so each loop is written once.
#if defined(__AVX512F__)
#define VM_VECTOR 1
using vf = __m512;
constexpr int64_t VL = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const uint16_t* p) {  // bfloat16: the high half of a float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
}
inline vf vbcast(float x) { return _mm512_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vclamp(vf x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vbcast(lo)), vbcast(hi)); }
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2(vf n) {  // 2^n for whole n in the normal range
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define VM_VECTOR 1
using vf = __m256;
constexpr int64_t VL = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const uint16_t* p) {  // bfloat16: the high half of a float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))), 16));
}
inline vf vbcast(float x) { return _mm256_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vclamp(vf x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, vbcast(lo)), vbcast(hi)); }
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2(vf n) {  // 2^n for whole n in the normal range
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline float vsum(vf v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
#endif

#if VM_VECTOR
inline vf vexp(vf x) {  // exp_f32, a vector at a time
  x = vclamp(x, LO, HI);
  const vf n = vround(vmul(x, vbcast(LOG2E)));
  const vf r = vfnma(n, vbcast(LN2_LO), vfnma(n, vbcast(LN2_HI), x));
  vf p = vbcast(P0);
  for (float c : {P1, P2, P3, P4, P5}) p = vfma(p, r, vbcast(c));
  p = vadd(vfma(vmul(p, r), r, r), vbcast(1.f));
  return vmul(p, vpow2(n));
}
#endif

// x[i] = exp(x[i] - shift) for i < n; returns their sum (softmax's numerators and denominator).
inline float exp_shifted(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.f;
#if VM_VECTOR
  vf acc = vzero();
  for (; i + VL <= n; i += VL) {
    const vf e = vexp(vsub(vload(x + i), vbcast(shift)));
    vstore(x + i, e);
    acc = vadd(acc, e);
  }
  sum = vsum(acc);
#endif
  for (; i < n; ++i) sum += x[i] = exp_f32(x[i] - shift);
  return sum;
}

// out[i] = SiLU(g[i]) · u[i] = g[i] / (1 + exp(-g[i])) · u[i].
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
#if VM_VECTOR
  for (; i + VL <= n; i += VL) {
    const vf gv = vload(g + i);
    vstore(out + i, vmul(vdiv(gv, vadd(vbcast(1.f), vexp(vsub(vzero(), gv)))), vload(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.f + exp_f32(-g[i])) * u[i];
}

}  // namespace vmath
