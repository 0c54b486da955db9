// bfloat16 <-> float32 for the CPU kernels: one element anywhere, 8 lanes with AVX2, 16 with
// AVX-512. Shared by elementwise.cpp, paged_attention.cpp, small_gemm.cpp and
// small_gemm_bf16.cpp (fleetserve/kernels/cpu/build.py hashes this header into the build key
// with the sources).
//
// A bfloat16 is a float32's high half, so widening is exact. Narrowing rounds to nearest even,
// as c10::BFloat16 does, and keeps a NaN a NaN: the same bits torch's bfloat16 ops produce from
// the same float32 value.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fleetserve_cpu {

// One value widened to float32. Plain integer and float operations, so that the compiler can
// vectorize a loop of them for whatever the CPU has (the kernels without intrinsics).
inline float widen1(c10::BFloat16 b) {
  const uint32_t bits = static_cast<uint32_t>(b.x) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// v rounded to bfloat16.
inline c10::BFloat16 narrow1(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(v != v ? 0x7FC0u : rounded),
                       c10::BFloat16::from_bits());
}

#if defined(__AVX2__)
// 8 values as float32: float32 loaded as it is, bfloat16 widened (the kernels that take either
// dtype call one name).
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

#if defined(__AVX512F__)
// The lanes of i .. min(i + 16, n) as a mask (the tail of a row).
inline __mmask16 lanes16(int64_t i, int64_t n) {
  return n - i >= 16 ? static_cast<__mmask16>(0xFFFF)
                     : static_cast<__mmask16>((1u << (n - i)) - 1u);
}

// 16 bfloat16 values (the masked-off lanes zero) widened to float32.
inline __m512 widen16(const c10::BFloat16* p, __mmask16 m = 0xFFFF) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Each lane's bfloat16 bits (in the low half of the lane), rounded to nearest even.
inline __m512i narrow_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(up, 16), _mm512_set1_epi32(0x7FC0));
}

// v rounded to bfloat16 and widened again: the value a torch bfloat16 op hands on.
inline __m512 round16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(narrow_bits16(v), 16));
}

// v rounded to bfloat16 into the lanes of m at p.
inline void narrow16(c10::BFloat16* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm512_mask_cvtepi32_storeu_epi16(p, m, narrow_bits16(v));
}
#endif

}  // namespace fleetserve_cpu
