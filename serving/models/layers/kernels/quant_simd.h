// The SIMD pieces the quantized linear kernels share: 32-byte integer dot products, fp16 scales,
// horizontal sums, and the int8 activation blocks (one scale per 32 values, as GGUF's Q8_0).
//
// Everything works on 256-bit vectors, one 32-value block per vector.  Built with -march=native:
// where the CPU has AVX-512 VNNI (with VL) or AVX-VNNI the u8 x s8 dot product is one `vpdpbusd`;
// on AVX2 alone it is `vpmaddubsw` (pairs into int16, which cannot saturate here: one operand is
// at most 128, the other at most 127 in magnitude) then `vpmaddwd` against ones (into int32).
// Both leave lane i holding the sum over bytes 4i..4i+3, so a lane covers a fixed quarter-block.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the quantized linear kernels need AVX2, FMA and F16C"
#endif

namespace q {

// a[i] (unsigned) x b[i] (signed), summed per 4 bytes into 8 int32 lanes.
inline __m256i dot_u8s8(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes of packed nibbles -> 32 bytes: the low nibbles (values 0-15), then the high ones (16-31).
inline __m256i nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, 0xFF where the bit is set (bit j of the little-endian word -> byte j).
inline __m256i bits_to_bytes(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof x);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
  const __m256i mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
  return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, mask), _mm256_set1_epi64x(-1));
}

// One block of activations: x[i] ~= d * q[i], s = d * sum(q) (the term a weight's offset multiplies)
// and sum = sum(q) itself (the interleaved kernel's exact correction for its unsigned Q8_0 weights).
struct XBlock {
  float d;
  float s;
  int32_t sum;
  int32_t sum_lo;  // sum(q[0..16)): the interleaved Q6_K kernel corrects each 16-value half
  int8_t q[32];
};

inline int32_t hsum_i32(__m256i v) {
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, _MM_SHUFFLE(2, 3, 0, 1))));
}

// x[0..k) -> k/32 blocks, round to nearest (ties to even), |q| <= 127.
inline void quantize_row(const float* x, int64_t k, XBlock* out) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < k / 32; ++b) {
    const float* p = x + b * 32;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(p + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    // packs work within 128-bit lanes: the permute puts the 32 values back in order
    const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const int32_t total = hsum_i32(sum), low = hsum_i32(_mm256_add_epi32(i32[0], i32[1]));
    out[b].d = d;
    out[b].s = d * static_cast<float>(total);
    out[b].sum = total;
    out[b].sum_lo = low;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].q), i8);
  }
}

}  // namespace q
