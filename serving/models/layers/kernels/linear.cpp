// fp32 linear layers, y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias), for the shapes a decode step has:
// M from 1 (one stream) to a few hundred (a batch, a prefill chunk), N and K of a small model.
//
// The weight is repacked once at load into panels of P = NV vector widths of output columns,
// k-major inside a panel: packed[N/P][K][P].  A panel is then one contiguous stream: for every k
// the P weights of its columns are adjacent, so a tile of R rows of x reads each weight once from
// memory and does R·P multiply-adds with it, with R·NV accumulators held in registers.  At M = 1
// this reads every weight exactly once, sequentially (the step is bound by memory bandwidth); at
// larger M each panel (K·P floats: 72 KB at K = 576, under the L2 size) is reused from cache for
// every tile of rows of an M block (as many rows of x as fit in 256 KB).  Software prefetching
// of the next panel was measured slower (the hardware prefetcher follows the stream).
//
// The vector width is the machine's: built with -march=native, AVX-512 machines get 16 lanes and
// AVX2+FMA machines 8.  Without AVX2 and FMA it reports a panel width of 0 and the caller keeps
// torch's matmul.  Threads: the kernels' team (team.h).
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#include <cstring>

#include "team.h"

namespace {

#if defined(__AVX512F__)
using vf = __m512;
constexpr int VL = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
using vf = __m256;
constexpr int VL = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
#endif

constexpr int NV = 2;        // vectors per panel (3 and 4, with AVX-512 registers to spare, showed no clear gain)
constexpr int P = NV * VL;   // output columns per panel
constexpr int RMAX = 6;      // rows of x per register tile
constexpr int64_t X_BLOCK_BYTES = 256 * 1024;  // rows of x per cache block: as many as fit in this (L2)
constexpr int64_t CHUNKS_PER_THREAD = 16;

// One register tile: rows [0, R) of x against one panel; `cols` ≤ P of its columns are real.
template <int R>
inline void tile(const float* x, int64_t ldx, const float* wp, int64_t K, const float* bias, float* y,
                 int64_t ldy, int64_t cols) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const float* w = wp + k * P;
    vf wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = vload(w + v * VL);
    for (int r = 0; r < R; ++r) {
      vf xb = vbcast(x + r * ldx + k);
      for (int v = 0; v < NV; ++v) acc[r][v] = vfma(xb, wv[v], acc[r][v]);
    }
  }
  if (bias != nullptr) {  // padded to whole panels, like the weight
    for (int v = 0; v < NV; ++v) {
      vf b = vload(bias + v * VL);
      for (int r = 0; r < R; ++r) acc[r][v] = vadd(acc[r][v], b);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = y + r * ldy;
    if (cols == P) {
      for (int v = 0; v < NV; ++v) vstore(out + v * VL, acc[r][v]);
    } else {  // the last panel of an N that is not a multiple of P
      alignas(64) float tmp[P];
      for (int v = 0; v < NV; ++v) vstore(tmp + v * VL, acc[r][v]);
      std::memcpy(out, tmp, sizeof(float) * cols);
    }
  }
}

inline void rows(int64_t r, const float* x, int64_t K, const float* wp, const float* bias, float* y, int64_t N,
                 int64_t cols) {
  switch (r) {
    case 1: tile<1>(x, K, wp, K, bias, y, N, cols); break;
    case 2: tile<2>(x, K, wp, K, bias, y, N, cols); break;
    case 3: tile<3>(x, K, wp, K, bias, y, N, cols); break;
    case 4: tile<4>(x, K, wp, K, bias, y, N, cols); break;
    case 5: tile<5>(x, K, wp, K, bias, y, N, cols); break;
    default: tile<6>(x, K, wp, K, bias, y, N, cols); break;
  }
}

}  // namespace

extern "C" {

// Output columns per panel: the packed weight is [ceil(N / P)][K][P], zero-padded.
int linear_f32_panel() { return P; }

// y[M, N] = x[M, K] · Wᵀ + bias; `wp` packed as above; `bias` padded to whole panels, or null.
void linear_f32(const float* x, const float* wp, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t panels = (N + P - 1) / P;
  int64_t mb = X_BLOCK_BYTES / (K * static_cast<int64_t>(sizeof(float))) / RMAX * RMAX;
  mb = mb < RMAX ? RMAX : mb;
  const int64_t blocks = (M + mb - 1) / mb;
  // One chunk: `group` panels against one block of rows of x, block-major so that the rows of a
  // block stay in cache while the threads walk the panels.  About CHUNKS_PER_THREAD chunks per
  // thread: enough to even out a slow thread, few enough that claiming them costs nothing.
  const int64_t want = static_cast<int64_t>(team::size()) * CHUNKS_PER_THREAD;
  const int64_t group = panels * blocks >= want ? (panels * blocks) / want : 1;
  const int64_t groups = (panels + group - 1) / group;
  auto chunk = [&](int64_t c) {
    const int64_t m0 = c / groups * mb, g0 = c % groups * group;
    const int64_t m1 = m0 + mb < M ? m0 + mb : M;
    const int64_t g1 = g0 + group < panels ? g0 + group : panels;
    for (int64_t p = g0; p < g1; ++p) {
      const float* w = wp + p * K * P;
      const float* b = bias != nullptr ? bias + p * P : nullptr;
      const int64_t cols = N - p * P < P ? N - p * P : P;
      for (int64_t r0 = m0; r0 < m1; r0 += RMAX) {
        const int64_t r = m1 - r0 < RMAX ? m1 - r0 : RMAX;
        rows(r, x + r0 * K, K, w, b, y + r0 * N + p * P, N, cols);
      }
    }
  };
  team::parallel_for(blocks * groups, chunk);
}

}  // extern "C"

#else  // no AVX2: nothing to run here

extern "C" {
int linear_f32_panel() { return 0; }
void linear_f32(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t) {}
}

#endif
