// The interleaved quantized layouts (quant_interleaved.h): repacking at load, the VNNI tile and
// row lookups (a tied embedding reads the lm_head's repacked table).
#include "quant_interleaved.h"

#include <cstring>

#include "quant_types.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define IL_ENABLED 1
#define IL_512 1
#else
#define IL_ENABLED 1  // quant_simd.h requires AVX2 + FMA + F16C: the 256-bit tile below
#define IL_512 0
#endif

namespace il {
namespace {

constexpr bool five_bits(int layout) { return layout == U5 || layout == U5F; }
constexpr bool fp32_scales(int layout) { return layout == U4F || layout == U5F || layout == S6; }
constexpr bool byte_values(int layout) { return layout == S8 || layout == S6; }  // a byte per value
constexpr int64_t wbytes(int layout) { return byte_values(layout) ? 512 : five_bits(layout) ? 320 : 256; }
constexpr int64_t block_bytes(int layout) {
  return wbytes(layout) + (layout == S8 ? 32 : fp32_scales(layout) ? 128 : 64);
}

// One 32-value block of a row, decoded to what the layout stores: u[32], and d, m as floats
// (S6: d scales values 0-15, m values 16-31, each value u - 32).
struct Block {
  uint8_t u[32];
  float d, m;
};

void decode(int type, const uint8_t* row, int64_t c, Block& o) {
  switch (type) {
    case q::Q8_0: {
      const uint8_t* b = row + c * 34;
      o.d = q::fp16(b), o.m = -128.0f * o.d;
      for (int i = 0; i < 32; ++i) o.u[i] = b[2 + i] ^ 0x80;
      return;
    }
    case q::Q4_0:
    case q::Q4_1: {
      const bool one = type == q::Q4_1;
      const uint8_t* b = row + c * (one ? 20 : 18);
      o.d = q::fp16(b), o.m = one ? q::fp16(b + 2) : -8.0f * o.d;
      const uint8_t* qs = b + (one ? 4 : 2);
      for (int i = 0; i < 16; ++i) o.u[i] = qs[i] & 15, o.u[16 + i] = qs[i] >> 4;
      return;
    }
    case q::Q5_0:
    case q::Q5_1: {
      const bool one = type == q::Q5_1;
      const uint8_t* b = row + c * (one ? 24 : 22);
      o.d = q::fp16(b), o.m = one ? q::fp16(b + 2) : -16.0f * o.d;
      uint32_t qh;
      std::memcpy(&qh, b + (one ? 4 : 2), 4);
      const uint8_t* qs = b + (one ? 8 : 6);
      for (int i = 0; i < 16; ++i) {
        o.u[i] = (qs[i] & 15) | ((qh >> i) & 1) << 4;
        o.u[16 + i] = (qs[i] >> 4) | ((qh >> (16 + i)) & 1) << 4;
      }
      return;
    }
    case q::Q6_K: {  // sub-block s = 4h + t: low 4 bits from ql, 2 high bits at 2t of qh, a scale per 16
      const uint8_t* b = row + (c / 8) * 210;
      const int s = c % 8, h = s / 4, t = s % 4;
      const uint8_t* ql = b + 64 * h + 32 * (t % 2);
      const uint8_t* qh = b + 128 + 32 * h;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * t;
      const float d = q::fp16(b + 208);
      o.d = d * sc[0], o.m = d * sc[1];
      for (int i = 0; i < 32; ++i) o.u[i] = (t >= 2 ? ql[i] >> 4 : ql[i] & 15) | ((qh[i] >> (2 * t)) & 3) << 4;
      return;
    }
    case q::Q4_K:
    case q::Q5_K: {  // sub-block s: nibbles of 64-value chunk s / 2 (Q5_K: fifth bit s of qh[i])
      const bool five = type == q::Q5_K;
      const uint8_t* b = row + (c / 8) * (five ? 176 : 144);
      const int s = c % 8;
      uint8_t sc[8], mn[8];
      q::k_scales(b + 4, sc, mn);
      o.d = q::fp16(b) * sc[s], o.m = -q::fp16(b + 2) * mn[s];
      const uint8_t* qs = b + (five ? 48 : 16) + 32 * (s / 2);
      for (int i = 0; i < 32; ++i) {
        o.u[i] = s % 2 ? qs[i] >> 4 : qs[i] & 15;
        if (five) o.u[i] |= ((b[16 + i] >> s) & 1) << 4;
      }
      return;
    }
  }
}

uint16_t half(float f) { return _cvtss_sh(f, 0); }

// Software prefetch PREFETCH_BYTES ahead of the block being read.  A decode step streams every
// weight once from memory; on the 2-core Sapphire Rapids VM the hardware prefetchers alone left one
// thread at ~6 GB/s; with it and the coarser chunks of quant_linear.cpp a whole step's linears
// (Q4_1 layers, Q8_0 lm_head, M = 1, every weight streamed) took 6.2 ms instead of 10.0 (the chunks
// alone: 7.6).  Groups are contiguous, so it runs on into the next group; 2 KB did as well as 4 KB.
constexpr int64_t PREFETCH_BYTES = 4096;
template <int L>
inline void prefetch_ahead(const uint8_t* w) {
  for (int64_t o = 0; o < block_bytes(L); o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_BYTES + o), _MM_HINT_T0);
}

#if IL_512
template <int L, int R>
void tile(const q::XBlock* x, int64_t xs, const uint8_t* w, int64_t blocks, float* y, int64_t ldy, int cols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b, w += block_bytes(L)) {
    prefetch_ahead<L>(w);
    __m512i wv[8];
    if constexpr (!byte_values(L)) {
      for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_loadu_si512(w + 64 * k);
        wv[2 * k] = _mm512_and_si512(v, low);
        wv[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      if constexpr (five_bits(L)) {
        const __m512i five = _mm512_set1_epi8(0x10);
        for (int j = 0; j < 8; ++j) {
          uint64_t bits;
          std::memcpy(&bits, w + 256 + 8 * j, 8);
          wv[j] = _mm512_or_si512(wv[j], _mm512_maskz_mov_epi8(_cvtu64_mask64(bits), five));
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) wv[j] = _mm512_loadu_si512(w + 64 * j);
    }
    const uint8_t* sc = w + wbytes(L);
    const __m512 d = fp32_scales(L) ? _mm512_loadu_ps(sc) : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
    // S8: u = w + 128, so dot(u, x) - 128 sum(x) is the exact integer dot product, and m unused
    // S6: u = w + 32, corrected by -32 sum(x) per 16-value half; m is the second half's scale
    const __m512 m = fp32_scales(L) ? _mm512_loadu_ps(sc + 64)
                     : L != S8 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32)))
                               : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const q::XBlock& xb = x[r * xs + b];
      const int32_t* xq = reinterpret_cast<const int32_t*>(xb.q);
      const __m512 xd = _mm512_set1_ps(xb.d);
      if constexpr (L == S6) {
        __m512i lo = _mm512_set1_epi32(-32 * xb.sum_lo), hi = _mm512_set1_epi32(-32 * (xb.sum - xb.sum_lo));
        for (int j = 0; j < 4; ++j) {
          lo = _mm512_dpbusd_epi32(lo, wv[j], _mm512_set1_epi32(xq[j]));
          hi = _mm512_dpbusd_epi32(hi, wv[j + 4], _mm512_set1_epi32(xq[j + 4]));
        }
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(d, xd), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(m, xd), acc[r]);
        continue;
      }
      __m512i a0 = L == S8 ? _mm512_set1_epi32(-128 * xb.sum) : _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        a0 = _mm512_dpbusd_epi32(a0, wv[j], _mm512_set1_epi32(xq[j]));
        a1 = _mm512_dpbusd_epi32(a1, wv[j + 1], _mm512_set1_epi32(xq[j + 1]));
      }
      const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1));
      acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, xd), acc[r]);
      if constexpr (L != S8) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xb.s), acc[r]);
    }
  }
  const __mmask16 keep = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

#else
// AVX2: the same layouts, each 16-row vector taken as two 8-row halves (rows 8h..8h+7 are bytes
// 32h..32h+31 of it).  Without VNNI the u8 x s8 product is `vpmaddubsw`, which would saturate on
// S8's unsigned w + 128: S8 is turned back into signed values and multiplied as |w| x sign(w)·x
// (llama.cpp's trick on AVX2), exact in int16 since |x| <= 127; the 4- and 5-bit values are <= 31.
template <int L>
inline __m256i half_vector(const uint8_t* w, int j, int h) {
  if constexpr (byte_values(L)) return q::load32(w + 64 * j + 32 * h);
  const __m256i v = q::load32(w + 64 * (j / 2) + 32 * h);
  __m256i u = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
  if constexpr (five_bits(L)) u = _mm256_or_si256(u, _mm256_and_si256(q::bits_to_bytes(w + 256 + 8 * j + 4 * h),
                                                                  _mm256_set1_epi8(0x10)));
  return u;
}

// Without VNNI, vpmaddubsw's int16 pair sums of SUMS16 consecutive steps j are added in int16
// before one vpmaddwd widens them: a pair sum is at most 2 · umax · 127 (3810 for 4-bit values,
// 7874 for 5-bit, 16002 for S6's 6-bit, 32512 for S8's |w| <= 128), so 8, 4, 2 and 1 of them fit
// in 32767.  That takes a vpmaddwd and an add off most steps of the 4- and 5-bit layouts.
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif
template <int L>
constexpr int sums16() {
  return L == S8 ? 1 : L == S6 ? 2 : five_bits(L) ? 4 : 8;
}

// Rows of x r < R against both 8-row halves of a group at once when R <= 2 (each broadcast of x
// serves 16 rows of W), one half at a time for taller tiles (the registers would not hold both).
template <int L, int R>
void tile(const q::XBlock* x, int64_t xs, const uint8_t* w, int64_t blocks, float* y, int64_t ldy, int cols) {
  constexpr int HT = R <= 2 ? 2 : 1;  // halves per pass
  constexpr int PARTS = L == S6 ? 2 : 1;  // S6 sums each 16-value half apart (a scale per half)
  constexpr int STEPS = 8 / PARTS, G16 = sums16<L>();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h0 = 0; h0 < 2 && 8 * h0 < cols; h0 += HT) {
    __m256 acc[R][HT];
    for (int r = 0; r < R; ++r)
      for (int hh = 0; hh < HT; ++hh) acc[r][hh] = _mm256_setzero_ps();
    const uint8_t* wb = w;
    for (int64_t b = 0; b < blocks; ++b, wb += block_bytes(L)) {
      if (h0 == 0) prefetch_ahead<L>(wb);
      for (int part = 0; part < PARTS; ++part) {
        __m256i ai[R][HT], s16[R][HT];
        for (int r = 0; r < R; ++r) {
          const q::XBlock& xb = x[r * xs + b];
          for (int hh = 0; hh < HT; ++hh)
            ai[r][hh] = L != S6 ? _mm256_setzero_si256()
                                : _mm256_set1_epi32(-32 * (part == 0 ? xb.sum_lo : xb.sum - xb.sum_lo));
        }
#pragma GCC unroll 8
        for (int j = STEPS * part; j < STEPS * (part + 1); ++j) {  // unrolled: k below is then a constant
          __m256i u[HT], sgn[HT];
          for (int hh = 0; hh < HT; ++hh) {
            u[hh] = sgn[hh] = half_vector<L>(wb, j, h0 + hh);
            if constexpr (L == S8) sgn[hh] = _mm256_xor_si256(u[hh], _mm256_set1_epi8(static_cast<char>(0x80))),
                                   u[hh] = _mm256_abs_epi8(sgn[hh]);
          }
          for (int r = 0; r < R; ++r) {
            int32_t xj;
            std::memcpy(&xj, x[r * xs + b].q + 4 * j, 4);
            const __m256i xb = _mm256_set1_epi32(xj);
            for (int hh = 0; hh < HT; ++hh) {
              const __m256i xv = L == S8 ? _mm256_sign_epi8(xb, sgn[hh]) : xb;
              if constexpr (VNNI) {
                ai[r][hh] = _mm256_add_epi32(ai[r][hh], q::dot_u8s8(u[hh], xv));
                continue;
              }
              const __m256i pairs = _mm256_maddubs_epi16(u[hh], xv);
              const int k = (j - STEPS * part) % G16;
              s16[r][hh] = k == 0 ? pairs : _mm256_add_epi16(s16[r][hh], pairs);
              if (k == G16 - 1) ai[r][hh] = _mm256_add_epi32(ai[r][hh], _mm256_madd_epi16(s16[r][hh], ones));
            }
          }
        }
        const uint8_t* sc = wb + wbytes(L);
        for (int hh = 0; hh < HT; ++hh) {
          const int h = h0 + hh;
          const __m256 d = fp32_scales(L) ? _mm256_loadu_ps(reinterpret_cast<const float*>(sc) + 8 * h)
                                   : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * h)));
          const __m256 m = fp32_scales(L) ? _mm256_loadu_ps(reinterpret_cast<const float*>(sc + 64) + 8 * h)
                           : L != S8 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 32 + 16 * h)))
                                     : _mm256_setzero_ps();
          const __m256 scale = L == S6 && part == 1 ? m : d;
          for (int r = 0; r < R; ++r) {
            const q::XBlock& xb = x[r * xs + b];
            acc[r][hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[r][hh]), _mm256_mul_ps(scale, _mm256_set1_ps(xb.d)),
                                         acc[r][hh]);
            if constexpr (!byte_values(L)) acc[r][hh] = _mm256_fmadd_ps(m, _mm256_set1_ps(xb.s), acc[r][hh]);
          }
        }
      }
    }
    for (int hh = 0; hh < HT; ++hh) {
      const int n = cols - 8 * (h0 + hh) >= 8 ? 8 : cols - 8 * (h0 + hh);
      if (n <= 0) break;
      const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      for (int r = 0; r < R; ++r) _mm256_maskstore_ps(y + r * ldy + 8 * (h0 + hh), keep, acc[r][hh]);
    }
  }
}
#endif

#if IL_ENABLED
constexpr int RMAX = 4;

template <int L, int R = RMAX>
void rows_of_x(int64_t r, const q::XBlock* x, int64_t xs, const uint8_t* w, int64_t blocks, float* y, int64_t ldy,
               int cols) {
  if constexpr (R > 1) {
    if (r < R) return rows_of_x<L, R - 1>(r, x, xs, w, blocks, y, ldy, cols);
  }
  tile<L, R>(x, xs, w, blocks, y, ldy, cols);
}

template <int L>
void run_group(const uint8_t* w, int64_t n0, int64_t cols, const q::XBlock* xq, int64_t xs, int64_t m0, int64_t m1,
               float* y, int64_t ldy, int64_t k) {
  const int64_t blocks = k / 32;
  const uint8_t* g = w + n0 / ROWS * blocks * block_bytes(L);
  for (int64_t r0 = m0; r0 < m1; r0 += RMAX) {
    const int64_t r = m1 - r0 < RMAX ? m1 - r0 : RMAX;
    rows_of_x<L>(r, xq + r0 * xs, xs, g, blocks, y + r0 * ldy + n0, ldy, static_cast<int>(cols));
  }
}
#endif

}  // namespace

int layout_of(int type) {
  if (!IL_ENABLED) return -1;
  switch (type) {
    case q::Q8_0: return S8;
    case q::Q4_0:
    case q::Q4_1: return U4;
    case q::Q5_0:
    case q::Q5_1: return U5;
    case q::Q4_K: return U4F;
    case q::Q5_K: return U5F;
    case q::Q6_K: return S6;
    default: return -1;
  }
}

void group(int layout, const uint8_t* w, int64_t n0, int64_t cols, const q::XBlock* xq, int64_t xs, int64_t m0,
           int64_t m1, float* y, int64_t ldy, int64_t k) {
#if IL_ENABLED
  if (layout == S8) return run_group<S8>(w, n0, cols, xq, xs, m0, m1, y, ldy, k);
  if (layout == U4) return run_group<U4>(w, n0, cols, xq, xs, m0, m1, y, ldy, k);
  if (layout == U5) return run_group<U5>(w, n0, cols, xq, xs, m0, m1, y, ldy, k);
  if (layout == U5F) return run_group<U5F>(w, n0, cols, xq, xs, m0, m1, y, ldy, k);
  if (layout == S6) return run_group<S6>(w, n0, cols, xq, xs, m0, m1, y, ldy, k);
  return run_group<U4F>(w, n0, cols, xq, xs, m0, m1, y, ldy, k);
#endif
}

}  // namespace il

extern "C" {

// The interleaved layout a ggml type repacks into (il::S8, il::U4), or -1 (none, or not this build).
int quant_il_layout(int type) { return il::layout_of(type); }

// Bytes of a [rows, k] weight repacked (rows padded to a multiple of 16).
int64_t quant_il_bytes(int type, int64_t rows, int64_t k) {
  const int layout = il::layout_of(type);
  if (layout < 0) return 0;
  return (rows + il::ROWS - 1) / il::ROWS * (k / 32) * il::block_bytes(layout);
}

// Repack a row-major [rows, k] weight of ggml type `type` (k a multiple of its block) into `out`.
void quant_il_pack(int type, const uint8_t* w, int64_t rows, int64_t k, int64_t row_bytes, uint8_t* out) {
  const int layout = il::layout_of(type);
  if (layout < 0) return;
  const int64_t blocks = k / 32, wb = il::wbytes(layout);
  const int64_t groups = (rows + il::ROWS - 1) / il::ROWS;
  std::memset(out, 0, groups * blocks * il::block_bytes(layout));
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* dst = out + (g * blocks + b) * il::block_bytes(layout);
      uint8_t* sc = dst + wb;
      for (int rr = 0; rr < il::ROWS && g * il::ROWS + rr < rows; ++rr) {
        il::Block blk;
        il::decode(type, w + (g * il::ROWS + rr) * row_bytes, b, blk);
        if (il::fp32_scales(layout)) {
          std::memcpy(sc + 4 * rr, &blk.d, 4);
          std::memcpy(sc + 64 + 4 * rr, &blk.m, 4);
        } else {
          const uint16_t dm[2] = {il::half(blk.d), il::half(blk.m)};
          std::memcpy(sc + 2 * rr, dm, 2);
          if (layout != il::S8) std::memcpy(sc + 32 + 2 * rr, dm + 1, 2);
        }
        if (!il::byte_values(layout)) {
          for (int kk = 0; kk < 4; ++kk)
            for (int i = 0; i < 4; ++i)
              dst[(kk * il::ROWS + rr) * 4 + i] = (blk.u[8 * kk + i] & 15) | (blk.u[8 * kk + 4 + i] & 15) << 4;
          for (int c = 0; il::five_bits(layout) && c < 32; ++c) {
            const int bit = (c % 4) + 4 * rr;  // mask c / 4, value 4 (c / 4) + c % 4
            dst[256 + 8 * (c / 4) + bit / 8] |= static_cast<uint8_t>((blk.u[c] >> 4) << (bit % 8));
          }
        } else {
          for (int j = 0; j < 8; ++j)
            for (int i = 0; i < 4; ++i) dst[(j * il::ROWS + rr) * 4 + i] = blk.u[4 * j + i];
        }
      }
    }
  }
}

// out[i, :] = row ids[i] of a repacked [rows, k] weight, dequantized (a tied embedding's lookups).
void quant_il_rows(int layout, const uint8_t* w, int64_t k, const int64_t* ids, int64_t n, float* out) {
  const int64_t blocks = k / 32, wb = il::wbytes(layout), bb = il::block_bytes(layout);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = ids[i] / il::ROWS, rr = ids[i] % il::ROWS;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* src = w + (g * blocks + b) * bb;
      const uint8_t* sc = src + wb;
      float d, m;
      if (il::fp32_scales(layout)) {
        std::memcpy(&d, sc + 4 * rr, 4);
        std::memcpy(&m, sc + 64 + 4 * rr, 4);
      } else {
        uint16_t h[2];
        std::memcpy(h, sc + 2 * rr, 2);
        if (layout != il::S8) std::memcpy(h + 1, sc + 32 + 2 * rr, 2);
        d = _cvtsh_ss(h[0]), m = layout == il::S8 ? 0.0f : _cvtsh_ss(h[1]);
      }
      float* o = out + i * k + b * 32;
      for (int c = 0; c < 32; ++c) {
        int u = il::byte_values(layout) ? src[((c / 4) * il::ROWS + rr) * 4 + c % 4]
                                 : src[((c / 8) * il::ROWS + rr) * 4 + c % 4] >> (c % 8 < 4 ? 0 : 4) & 15;
        const int bit = (c % 4) + 4 * static_cast<int>(rr);
        if (il::five_bits(layout)) u |= (src[256 + 8 * (c / 4) + bit / 8] >> (bit % 8) & 1) << 4;
        o[c] = layout == il::S8   ? d * static_cast<float>(u - 128)
               : layout == il::S6 ? (c < 16 ? d : m) * static_cast<float>(u - 32)
                                  : d * static_cast<float>(u) + m;
      }
    }
  }
}

}  // extern "C"
