// exp for the CPU kernels, in a form the compiler vectorizes (no libm call); shared by
// paged_attention.cpp (softmax) and elementwise.cpp (SiLU). fleetserve/kernels/cpu/build.py hashes
// this header into the build key with the sources.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fleetserve_cpu {

// The constants exp_clamped and exp_clamped16 share: log2(e), ln 2 split into a high part
// exact in float and the rest, and the polynomial's coefficients from the highest degree down.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f;
constexpr float kLn2Lo = 1.42860682030941723212e-6f;
constexpr float kExpPoly[7] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f, 1.f, 1.f};

// exp(x), with x clamped to [-87, 88] (the float range whose result is neither denormal nor
// inf: exp(-87) = 1.6e-38 is negligible next to a softmax max's 1, and SiLU's x / (1 + exp(-x))
// is exact enough at either end). x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6
// polynomial (relative error below 2e-7, about one float ulp), 2^n by building the exponent bits.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::nearbyint(x * kLog2e);
  const float r = x - n * kLn2Hi - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 7; ++i) p = p * r + kExpPoly[i];
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX512F__)
// exp_clamped on 16 lanes: the same reduction and polynomial, with fused multiply-adds.
inline __m512 exp_clamped16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

}  // namespace fleetserve_cpu
