// The gated MLP's activation: out[m, j] = SiLU(gate[m, j]) · up[m, j], where row m of `gu` holds the
// fused gate/up projection's output (gate columns first, then up).  One call instead of torch's
// chunk, SiLU and multiply, on whole vectors; exp is vec_math.h's (within 2e-7 relative of float64
// SiLU·mul over the float range, as accurate as torch's).
#include <cstdint>

#include "team.h"
#include "vec_math.h"

namespace {

constexpr int64_t VALUES_PER_CHUNK = 16384;

}  // namespace

extern "C" {

// gu: [M, 2N]; out: [M, N].
void silu_mul_f32(const float* gu, float* out, int64_t M, int64_t N) {
  const int64_t rows_per_chunk = N >= VALUES_PER_CHUNK ? 1 : VALUES_PER_CHUNK / N;
  team::parallel_for((M + rows_per_chunk - 1) / rows_per_chunk, [&](int64_t c) {
    const int64_t end = (c + 1) * rows_per_chunk < M ? (c + 1) * rows_per_chunk : M;
    for (int64_t m = c * rows_per_chunk; m < end; ++m) vmath::silu_mul(gu + m * 2 * N, gu + m * 2 * N + N, out + m * N, N);
  });
}

}  // extern "C"
