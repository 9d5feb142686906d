// exp for float32 in a form the compiler vectorises (`#pragma omp simd` loops): Cody–Waite
// reduction by ln 2 and Cephes' degree-6 polynomial, within 2 ulp of expf over the float range
// (clamped so that the result stays a normal float).  glibc's expf is scalar here: it is what made
// softmax and SiLU the slow part of their kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace vmath {

#pragma omp declare simd
inline float exp_f32(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
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

}  // namespace vmath
