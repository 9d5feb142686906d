// The gated MLP's activation: out[m, j] = SiLU(gate[m, j]) · up[m, j], where row m of `gu` holds the
// fused gate/up projection's output (gate columns first, then up).  One call instead of torch's
// chunk, SiLU and multiply; exp is a vectorised Cody–Waite reduction with Cephes' polynomial
// (within 2e-7 relative of float64 SiLU·mul over the float range, as accurate as torch's).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "team.h"

namespace {

constexpr int64_t VALUES_PER_CHUNK = 16384;

inline float exp_f32(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);  // e^x stays a normal float
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x − n·ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = g[j] / (1.f + exp_f32(-g[j])) * u[j];
}

}  // namespace

extern "C" {

// gu: [M, 2N]; out: [M, N].
void silu_mul_f32(const float* gu, float* out, int64_t M, int64_t N) {
  const int64_t rows_per_chunk = N >= VALUES_PER_CHUNK ? 1 : VALUES_PER_CHUNK / N;
  team::parallel_for((M + rows_per_chunk - 1) / rows_per_chunk, [&](int64_t c) {
    const int64_t end = (c + 1) * rows_per_chunk < M ? (c + 1) * rows_per_chunk : M;
    for (int64_t m = c * rows_per_chunk; m < end; ++m) silu_mul_row(gu + m * 2 * N, gu + m * 2 * N + N, out + m * N, N);
  });
}

}  // extern "C"
