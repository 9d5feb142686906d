// GGUF's weight block layouts (ggml's, byte for byte), each decoded into the one form the dot
// product takes: per 32 values, 32 bytes of integers, a scale per int32 lane and an offset, so
//   w[i] = scale[lane(i)] * int(i) + min        (lane(i) = i / 4, see quant_simd.h)
// where int(i) is `u` (unsigned, 0..63) for offset types, or the signed `sgn` for symmetric types
// (Q8_0, Q6_K), whose `u` holds |sgn| for the u8 x s8 product: x's signs are moved onto it
// (`_mm256_sign_epi8`), as llama.cpp does.  Symmetric 4/5-bit types (Q4_0, Q5_0) are unsigned with
// an offset of -8d / -16d: exact, and cheaper than moving signs.
//
// A type's block holds QK values (32, or 256 for the K-quants: SUB = QK / 32 sub-blocks).
#pragma once

#include "quant_simd.h"

namespace q {

template <int SUB>
struct Decoded {
  __m256i u[SUB];      // the unsigned operand
  __m256i sgn[SUB];    // symmetric types: the signed values (their signs go onto x)
  __m256 scale[SUB];   // per int32 lane
  float min[SUB];      // offset types: added to every value of the sub-block
};

// ggml's type ids (enum ggml_type), which the Python side passes in.
enum TypeId : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct TQ4_0 {
  static constexpr int QK = 32, BYTES = 18;
  static constexpr bool SIGNED = false, HAS_MIN = true;
  static void decode(const uint8_t* b, Decoded<1>& o) {
    const float d = fp16(b);
    o.u[0] = nibbles(b + 2);
    o.scale[0] = _mm256_set1_ps(d);
    o.min[0] = -8.0f * d;
  }
};

struct TQ4_1 {
  static constexpr int QK = 32, BYTES = 20;
  static constexpr bool SIGNED = false, HAS_MIN = true;
  static void decode(const uint8_t* b, Decoded<1>& o) {
    o.u[0] = nibbles(b + 4);
    o.scale[0] = _mm256_set1_ps(fp16(b));
    o.min[0] = fp16(b + 2);
  }
};

// The fifth bit of value j is bit j of the 32-bit word `qh`.
inline __m256i five_bits(const uint8_t* qh, const uint8_t* qs) {
  return _mm256_or_si256(nibbles(qs), _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
}

struct TQ5_0 {
  static constexpr int QK = 32, BYTES = 22;
  static constexpr bool SIGNED = false, HAS_MIN = true;
  static void decode(const uint8_t* b, Decoded<1>& o) {
    const float d = fp16(b);
    o.u[0] = five_bits(b + 2, b + 6);
    o.scale[0] = _mm256_set1_ps(d);
    o.min[0] = -16.0f * d;
  }
};

struct TQ5_1 {
  static constexpr int QK = 32, BYTES = 24;
  static constexpr bool SIGNED = false, HAS_MIN = true;
  static void decode(const uint8_t* b, Decoded<1>& o) {
    o.u[0] = five_bits(b + 4, b + 8);
    o.scale[0] = _mm256_set1_ps(fp16(b));
    o.min[0] = fp16(b + 2);
  }
};

struct TQ8_0 {
  static constexpr int QK = 32, BYTES = 34;
  static constexpr bool SIGNED = true, HAS_MIN = false;
  static void decode(const uint8_t* b, Decoded<1>& o) {
    const __m256i w = load32(b + 2);
    o.sgn[0] = w;
    o.u[0] = _mm256_sign_epi8(w, w);  // |w|; -128 stays 0x80, which is 128 unsigned
    o.scale[0] = _mm256_set1_ps(fp16(b));
    o.min[0] = 0.0f;
  }
};

// Q4_K/Q5_K's 12 bytes of 6-bit scales and mins, one pair per 32-value sub-block.
inline void k_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// Sub-block s of a K-quant's 128 nibble bytes: 64-value chunk s/2, low nibbles first, then high.
inline __m256i k_nibbles(const uint8_t* qs, int s) {
  const __m256i v = load32(qs + 32 * (s / 2));
  return _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}

// `mask`-wide field at bit `shift` of each byte of qh[0..32), moved up to bit `up`.
inline __m256i k_high_bits(const uint8_t* qh, int shift, int mask, int up) {
  const __m256i v = _mm256_srl_epi16(load32(qh), _mm_cvtsi32_si128(shift));
  return _mm256_sll_epi16(_mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(mask))), _mm_cvtsi32_si128(up));
}

template <bool FIVE>
struct TK4or5 {
  static constexpr int QK = 256, BYTES = FIVE ? 176 : 144;
  static constexpr bool SIGNED = false, HAS_MIN = true;
  static void decode(const uint8_t* b, Decoded<8>& o) {
    const float d = fp16(b), dmin = fp16(b + 2);
    uint8_t sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    const uint8_t* qs = b + (FIVE ? 48 : 16);
    for (int s = 0; s < 8; ++s) {
      o.u[s] = k_nibbles(qs, s);
      if (FIVE) o.u[s] = _mm256_or_si256(o.u[s], k_high_bits(b + 16, s, 1, 4));
      o.scale[s] = _mm256_set1_ps(d * sc[s]);
      o.min[s] = -dmin * mn[s];
    }
  }
};
using TQ4_K = TK4or5<false>;
using TQ5_K = TK4or5<true>;

// Q6_K: 256 values in two halves of 128; sub-block t of a half takes its low 4 bits from 32 bytes
// of ql (t odd: the next 32; t >= 2: the high nibbles) and 2 bits from qh at bit 2t; a scale per 16.
struct TQ6_K {
  static constexpr int QK = 256, BYTES = 210;
  static constexpr bool SIGNED = true, HAS_MIN = false;
  static void decode(const uint8_t* b, Decoded<8>& o) {
    const float d = fp16(b + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    for (int s = 0; s < 8; ++s) {
      const int h = s / 4, t = s % 4;
      const __m256i ql = load32(b + 64 * h + 32 * (t % 2));
      const __m256i lo = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0F));
      const __m256i w = _mm256_sub_epi8(_mm256_or_si256(lo, k_high_bits(b + 128 + 32 * h, 2 * t, 3, 4)),
                                        _mm256_set1_epi8(32));
      o.sgn[s] = w;
      o.u[s] = _mm256_sign_epi8(w, w);
      const int8_t* sc = scales + 8 * h + 2 * t;
      o.scale[s] = _mm256_set_m128(_mm_set1_ps(d * sc[1]), _mm_set1_ps(d * sc[0]));
      o.min[s] = 0.0f;
    }
  }
};

// Calls f(T{}) with the decoder for a ggml type id; false when the type has none here.
template <class F>
bool with_type(int type, F&& f) {
  switch (type) {
    case Q4_0: f(TQ4_0{}); return true;
    case Q4_1: f(TQ4_1{}); return true;
    case Q5_0: f(TQ5_0{}); return true;
    case Q5_1: f(TQ5_1{}); return true;
    case Q8_0: f(TQ8_0{}); return true;
    case Q4_K: f(TQ4_K{}); return true;
    case Q5_K: f(TQ5_K{}); return true;
    case Q6_K: f(TQ6_K{}); return true;
    default: return false;
  }
}

}  // namespace q
