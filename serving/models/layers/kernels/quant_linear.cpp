// Linear layers on GGUF-quantized weights: y[M, N] = x[M, K] · Wᵀ, with W in its own block layout
// (quant_types.h, row-major: each output row is K / QK consecutive blocks, as in the file) and x
// quantized on the fly to int8 per 32 values (quant_simd.h); integer dot products per block, scaled
// and summed in fp32.
//
// One call runs several weights over the same x (fused Q/K/V, gate/up), each of its own type, their
// outputs side by side in y: x is quantized once.  A register tile is R rows of x by C rows of W: C
// weight blocks are decoded once and each is dotted with R activation blocks, so at M = 1 the weight
// is read once (C independent rows keep the pipelines busy) and for batches each decoded block
// serves R rows.  Threads: the kernels' team (team.h), a chunk per span of consecutive groups of
// output rows and block of rows of x (as many rows as fit in X_BLOCK_BYTES, reused by every group
// from cache).
#include <vector>

#include "quant_interleaved.h"
#include "quant_types.h"
#include "team.h"

namespace {

using q::Decoded;
using q::XBlock;

#if defined(__AVX512F__)
constexpr int RMAX = 4, CMAX = 4;  // 32 vector registers: 16 accumulators
#else
constexpr int RMAX = 2, CMAX = 4;  // 16 vector registers: 8 accumulators
#endif
constexpr int64_t X_BLOCK_BYTES = 256 * 1024;
constexpr int64_t CHUNK_WORK = 16 * 18;  // block-rows per chunk: 16 groups at K = 576, M = 1

template <class T, int R, int C>
void tile(const XBlock* x, int64_t x_stride, const uint8_t* w, int64_t row_bytes, int64_t blocks, float* y,
          int64_t ldy) {
  constexpr int SUB = T::QK / 32;
  __m256 acc[R][C];
  float off[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps(), off[r][c] = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    Decoded<SUB> dw[C];
    for (int c = 0; c < C; ++c) T::decode(w + c * row_bytes + b * T::BYTES, dw[c]);
    for (int s = 0; s < SUB; ++s) {
      for (int r = 0; r < R; ++r) {
        const XBlock& xb = x[r * x_stride + b * SUB + s];
        const __m256i xq = q::load32(reinterpret_cast<const uint8_t*>(xb.q));
        const __m256 dx = _mm256_set1_ps(xb.d);
        for (int c = 0; c < C; ++c) {
          const __m256i xs = T::SIGNED ? _mm256_sign_epi8(xq, dw[c].sgn[s]) : xq;
          const __m256 prod = _mm256_cvtepi32_ps(q::dot_u8s8(dw[c].u[s], xs));
          acc[r][c] = _mm256_fmadd_ps(prod, _mm256_mul_ps(dw[c].scale[s], dx), acc[r][c]);
          if (T::HAS_MIN) off[r][c] += dw[c].min[s] * xb.s;
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = q::hsum(acc[r][c]) + off[r][c];
}

// Rows of x r <= RMAX: the tile of exactly that height.
template <class T, int C, int R = RMAX>
void rows_of_x(int64_t r, const XBlock* x, int64_t xs, const uint8_t* w, int64_t rb, int64_t nb, float* y,
               int64_t ldy) {
  if constexpr (R > 1) {
    if (r < R) return rows_of_x<T, C, R - 1>(r, x, xs, w, rb, nb, y, ldy);
  }
  tile<T, R, C>(x, xs, w, rb, nb, y, ldy);
}

struct Part {
  int type;
  const uint8_t* w;
  int64_t rows;
  int64_t col;  // its first column in y
};

// Rows [n0, n0 + cols) of one weight against rows [m0, m1) of x.
template <class T>
void group(const Part& p, int64_t n0, int64_t cols, const XBlock* xq, int64_t xs, int64_t m0, int64_t m1, float* y,
           int64_t ldy, int64_t k) {
  const int64_t blocks = k / T::QK, rb = blocks * T::BYTES;
  const uint8_t* w = p.w + n0 * rb;
  for (int64_t r0 = m0; r0 < m1; r0 += RMAX) {
    const int64_t r = m1 - r0 < RMAX ? m1 - r0 : RMAX;
    float* out = y + r0 * ldy + p.col + n0;
    if (cols == CMAX) {
      rows_of_x<T, CMAX>(r, xq + r0 * xs, xs, w, rb, blocks, out, ldy);
    } else {
      for (int64_t c = 0; c < cols; ++c) rows_of_x<T, 1>(r, xq + r0 * xs, xs, w + c * rb, rb, blocks, out + c, ldy);
    }
  }
}

// Output rows per chunk of a part: a register tile's weight rows (an interleaved group of 16).
int64_t group_rows(int type) { return type >= il::S8 && type <= il::S6 ? il::ROWS : CMAX; }

std::vector<XBlock>& scratch() {
  static thread_local std::vector<XBlock> buf;
  return buf;
}

}  // namespace

extern "C" {

// Whether this build runs the ggml type id natively.
int quant_supported(int type) {
  if (type >= il::S8 && type <= il::S6) return il::layout_of(q::Q8_0) >= 0;
  return q::with_type(type, [](auto) {}) ? 1 : 0;
}

int quant_vnni() {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  return 1;
#else
  return 0;
#endif
}

// y[M, N] = x[M, K] · [W_0; W_1; ...]ᵀ.  Part i: ggml type `types[i]` (or an interleaved layout,
// quant_interleaved.h), `rows[i]` rows of K values at `weights[i]`; its outputs are columns [sum(rows[:i]), + rows[i]) of y.  K is a multiple of every
// part's block size (the caller checks).
void quant_linear(const float* x, int64_t M, int64_t K, int nparts, const int32_t* types,
                  const uint8_t* const* weights, const int64_t* rows, float* y, int64_t N) {
  Part parts[8];
  int64_t groups_before[9] = {0};
  int64_t col = 0;
  for (int i = 0; i < nparts && i < 8; ++i) {
    parts[i] = {types[i], weights[i], rows[i], col};
    col += rows[i];
    groups_before[i + 1] = groups_before[i] + (rows[i] + group_rows(types[i]) - 1) / group_rows(types[i]);
  }
  const int64_t groups = groups_before[nparts], xs = K / 32;
  std::vector<XBlock>& xq = scratch();
  if (static_cast<int64_t>(xq.size()) < M * xs) xq.resize(M * xs);
  XBlock* xqp = xq.data();
  int64_t mb = X_BLOCK_BYTES / (xs * static_cast<int64_t>(sizeof(XBlock))) / RMAX * RMAX;
  mb = mb < RMAX ? RMAX : mb;
  const int64_t m_blocks = (M + mb - 1) / mb;
  team::parallel_for(M, [&](int64_t m) { q::quantize_row(x + m * K, K, xqp + m * xs); });
  // One chunk: a span of consecutive groups of output rows against one block of rows of x,
  // block-major.  Claiming a chunk costs a cache line passed between cores (~0.1-0.2 µs), as long as
  // a 16-row group takes at one row of x, so a span holds about CHUNK_WORK block-rows of work (at
  // least one group), while keeping at least 8 chunks per thread for balance.
  const int64_t rows_x = M < mb ? M : mb;
  int64_t span = CHUNK_WORK / (xs * rows_x);
  const int64_t most = groups / (8 * team::size());
  span = span > most ? most : span;
  span = span < 1 ? 1 : span;
  const int64_t spans = (groups + span - 1) / span;
  team::parallel_for(m_blocks * spans, [&](int64_t c) {
    const int64_t m0 = c / spans * mb, g0 = c % spans * span;
    const int64_t m1 = m0 + mb < M ? m0 + mb : M;
    for (int64_t g = g0; g < g0 + span && g < groups; ++g) {
      int i = 0;
      while (g >= groups_before[i + 1]) ++i;
      const Part& p = parts[i];
      const int64_t gr = group_rows(p.type), n0 = (g - groups_before[i]) * gr;
      const int64_t cols = p.rows - n0 < gr ? p.rows - n0 : gr;
      if (gr == il::ROWS) {
        il::group(p.type, p.w, n0, cols, xqp, xs, m0, m1, y + p.col, N, K);
        continue;
      }
      q::with_type(p.type, [&](auto t) { group<decltype(t)>(p, n0, cols, xqp, xs, m0, m1, y, N, K); });
    }
  });
}

// out[i, :] = row ids[i] of a [rows, K] weight of ggml type `type`, dequantized (embedding lookups).
void quant_dequant_rows(int type, const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out) {
  q::with_type(type, [&](auto t) {
    using T = decltype(t);
    constexpr int SUB = T::QK / 32;
    const int64_t blocks = K / T::QK, rb = blocks * T::BYTES;
    for (int64_t i = 0; i < n; ++i) {
      float* o = out + i * K;
      for (int64_t b = 0; b < blocks; ++b) {
        Decoded<SUB> d;
        T::decode(w + ids[i] * rb + b * T::BYTES, d);
        for (int s = 0; s < SUB; ++s) {
          alignas(32) int8_t v[32];
          alignas(32) float sc[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(v), T::SIGNED ? d.sgn[s] : d.u[s]);
          _mm256_store_ps(sc, d.scale[s]);
          for (int j = 0; j < 32; ++j) o[(b * SUB + s) * 32 + j] = sc[j / 4] * v[j] + d.min[s];
        }
      }
    }
  });
}

// x[M, K] -> M * K / 32 activation blocks (for tests: the kernel's own rounding).
void quant_activations(const float* x, int64_t M, int64_t K, float* d, float* s, int8_t* qs) {
  std::vector<XBlock> buf(K / 32);
  for (int64_t m = 0; m < M; ++m) {
    q::quantize_row(x + m * K, K, buf.data());
    for (int64_t b = 0; b < K / 32; ++b) {
      d[m * (K / 32) + b] = buf[b].d;
      s[m * (K / 32) + b] = buf[b].s;
      std::memcpy(qs + (m * (K / 32) + b) * 32, buf[b].q, 32);
    }
  }
}

}  // extern "C"
