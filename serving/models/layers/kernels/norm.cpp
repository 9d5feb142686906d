// RMSNorm over rows of D floats, optionally fused with the residual add before it:
//   h = x (+ residual);  y = weight · h / sqrt(mean(h²) + eps)
// In the decoder the add and the norm always come together (h += attention(...); then the MLP's
// norm of h); fused they read h once and cost one call instead of the eight small torch ops of
// an add and an RMSNorm.  The mean is a float32 sum in another order than torch's, so results
// agree with torch's to rounding, not bit for bit.
#include <cmath>
#include <cstdint>

#include "team.h"

namespace {

constexpr int64_t ROWS_PER_CHUNK = 16;

void norm_row(const float* x, const float* res, const float* w, float* h, float* y, int64_t D, float eps) {
  float ss = 0.f;
  if (res != nullptr) {
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; ++d) {
      const float v = x[d] + res[d];
      h[d] = v;
      ss += v * v;
    }
    x = h;
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] = w[d] * (x[d] * inv);
}

}  // namespace

extern "C" {

// x, y: [M, D]; residual and h: [M, D] or both null (then h is not written).
void rms_norm_f32(const float* x, const float* residual, const float* weight, float* h, float* y, int64_t M,
                  int64_t D, float eps) {
  const int64_t chunks = (M + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
  team::parallel_for(chunks, [&](int64_t c) {
    const int64_t end = (c + 1) * ROWS_PER_CHUNK < M ? (c + 1) * ROWS_PER_CHUNK : M;
    for (int64_t r = c * ROWS_PER_CHUNK; r < end; ++r)
      norm_row(x + r * D, residual != nullptr ? residual + r * D : nullptr, weight, h != nullptr ? h + r * D : nullptr,
               y + r * D, D, eps);
  });
}

}  // extern "C"
