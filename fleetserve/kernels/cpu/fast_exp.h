// exp for the CPU kernels, in a form the compiler vectorizes (no libm call); shared by
// paged_attention.cpp (softmax) and elementwise.cpp (SiLU). fleetserve/kernels/cpu/build.py hashes
// this header into the build key with the sources.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace fleetserve_cpu {

// exp(x), with x clamped to [-87, 88] (the float range whose result is neither denormal nor
// inf: exp(-87) = 1.6e-38 is negligible next to a softmax max's 1, and SiLU's x / (1 + exp(-x))
// is exact enough at either end). x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6
// polynomial (relative error below 2e-7, about one float ulp), 2^n by building the exponent bits.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace fleetserve_cpu
