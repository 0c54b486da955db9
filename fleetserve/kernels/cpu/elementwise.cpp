// The elementwise pieces between the GEMMs, fused for the CPU: RMSNorm (with the residual add),
// neox rotary (in place) and SiLU-and-mul. Each is one pass over its rows where eager torch
// makes three to six (every op a full read and write of the activations, and a dispatch).
//
// Registered in the `fleetserve_cpu` namespace beside paged_attention.cpp (one library, built by
// fleetserve/kernels/cpu/build.py). Float32 and bfloat16; float16 keeps the torch ops
// (fleetserve/kernels/cpu/ops.py chooses). The arithmetic follows the engine's torch code
// (fleetserve/kernels/reference.py); float32 results differ from it by a few ulp at most: the
// order of RMSNorm's sum of squares, the exponential (a polynomial here, about one ulp), and
// multiply-adds fused by the compiler.
//
// In bfloat16 the kernels compute in float32 and round to bfloat16 (to nearest even, as torch's
// conversion) exactly where torch's bfloat16 ops round: after each op of the reference. So
// rotary and the residual add give torch's bits, and RMSNorm and SiLU differ from it only where
// the few-ulp float32 difference above crosses a bfloat16 rounding boundary (one bfloat16 ulp).
// Each kernel is written once for both dtypes, in plain loops the compiler vectorizes for the
// CPU it is built on (AVX2 CPUs among them). AVX-512 builds keep the hand-written 16-lane
// bfloat16 kernels (masked tails, the same rounding) that were measured on the project's Intel
// box; the plain bfloat16 loops have not been timed against them there.
//
// Work is split over rows with at::parallel_for (torch's pool); the grain keeps small batches
// (decode steps) on one thread, where waking the pool costs more than the work. A row is always
// reduced by one thread in one order, so a row's result does not depend on the batch around it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "bf16.h"
#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGrainElements = 1 << 16;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a CPU tensor [rows, hidden] with contiguous rows");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

void check_same_dtype(std::initializer_list<const at::Tensor*> tensors) {
  const at::ScalarType dtype = (*tensors.begin())->scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "the tensors must be float32 or bfloat16, got ", dtype);
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->scalar_type() == dtype, "every tensor must have one dtype, got ", dtype,
                " and ", t->scalar_type());
  }
}

using bf16 = at::BFloat16;

// A T value as float32 (bfloat16 widens exactly).
inline float widen(float v) { return v; }
inline float widen(bf16 v) { return fleetserve_cpu::widen1(v); }

// v as a T: the float32 value, or rounded to bfloat16.
template <typename T>
T narrow(float v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return fleetserve_cpu::narrow1(v);
  } else {
    return v;
  }
}

// The value a torch op of dtype T hands on: v itself in float32, rounded in bfloat16.
template <typename T>
float rounded(float v) {
  return widen(narrow<T>(v));
}

#if defined(__AVX512F__)
using fleetserve_cpu::lanes16;
using fleetserve_cpu::narrow16;
using fleetserve_cpu::round16;
using fleetserve_cpu::widen16;
#endif

// out = weight * (v * rsqrt(mean(v^2) + eps)) per row, v = x, or x + residual (then also written
// to `summed`). In bfloat16: x + residual rounded (torch adds in bfloat16), the sum of squares in
// float32, the normalised value rounded before the weight multiplies it (as HF's RMSNorm casts it
// back to the input dtype), and the product rounded.
template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                   double eps, at::Tensor& out, at::Tensor* summed) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* rp = residual ? residual->const_data_ptr<T>() : nullptr;
  const T* wp = weight.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  T* sp = summed ? summed->mutable_data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  const int64_t os = out.stride(0), ss = summed ? summed->stride(0) : 0;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    float* v = row.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      if (rp != nullptr) {
        const T* rr = rp + r * rs;
        T* sr = sp + r * ss;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) {
          v[i] = rounded<T>(widen(xr[i]) + widen(rr[i]));
          sr[i] = narrow<T>(v[i]);
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) v[i] = widen(xr[i]);
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) sum += v[i] * v[i];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + feps);
      T* o = op + r * os;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) {
        o[i] = narrow<T>(widen(wp[i]) * rounded<T>(v[i] * inv));
      }
    }
  });
}

#if defined(__AVX512F__)
// rms_norm_impl<bf16> in 16-lane vectors, the tails masked.
void rms_norm_bf16(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                   double eps, at::Tensor& out, at::Tensor* summed) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const bf16* xp = x.const_data_ptr<bf16>();
  const bf16* rp = residual ? residual->const_data_ptr<bf16>() : nullptr;
  const bf16* wp = weight.const_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  bf16* sp = summed ? summed->mutable_data_ptr<bf16>() : nullptr;
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  const int64_t os = out.stride(0), ss = summed ? summed->stride(0) : 0;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden + 16);
    float* v = row.data();
    for (int64_t r = begin; r < end; ++r) {
      __m512 squares = _mm512_setzero_ps();
      for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = lanes16(i, hidden);
        __m512 a = widen16(xp + r * xs + i, m);
        if (rp != nullptr) {
          a = round16(_mm512_add_ps(a, widen16(rp + r * rs + i, m)));
          narrow16(sp + r * ss + i, a, m);
        }
        _mm512_storeu_ps(v + i, a);  // masked-off lanes are zero
        squares = _mm512_fmadd_ps(a, a, squares);
      }
      const float sum = _mm512_reduce_add_ps(squares);
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(sum / static_cast<float>(hidden) + feps));
      for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = lanes16(i, hidden);
        const __m512 normed = round16(_mm512_mul_ps(_mm512_loadu_ps(v + i), inv));
        narrow16(op + r * os + i, _mm512_mul_ps(widen16(wp + i, m), normed), m);
      }
    }
  });
}
#endif

void rms_norm_any(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                  double eps, at::Tensor& out, at::Tensor* summed) {
  if (x.scalar_type() == at::kBFloat16) {
#if defined(__AVX512F__)
    rms_norm_bf16(x, residual, weight, eps, out, summed);
#else
    rms_norm_impl<bf16>(x, residual, weight, eps, out, summed);
#endif
    return;
  }
  rms_norm_impl<float>(x, residual, weight, eps, out, summed);
}

void rms_norm_checks(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must be shaped like x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be contiguous [hidden]");
  check_same_dtype({&x, &weight, &out});
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  rms_norm_checks(x, weight, out);
  rms_norm_any(x, nullptr, weight, eps, out, nullptr);
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps, at::Tensor& out,
                        at::Tensor& summed) {
  rms_norm_checks(x, weight, out);
  check_rows(residual, "residual");
  check_rows(summed, "summed");
  TORCH_CHECK(residual.sizes() == x.sizes() && summed.sizes() == x.sizes(),
              "residual and summed must be shaped like x");
  check_same_dtype({&x, &residual, &summed});
  rms_norm_any(x, &residual, weight, eps, out, &summed);
}

// Neox rotary of x [T, heads, D] in place: the pairs (i, i + D/2) of each head rotate by the
// angle of their token's position. As the engine's torch code: x * cos + rotate_half(x) * sin,
// with cos/sin tables [max_position, D] (the halves duplicated). In bfloat16, x * cos and
// rotate_half(x) * sin are each rounded, then their sum, as torch's ops round. Every product of
// two bfloat16 values is exact in float32, so these are torch's bits.
template <typename T>
void rotate_rows(T* x, int64_t tokens, int64_t heads, int64_t D, int64_t s0, int64_t s1,
                 const int64_t* pos, const T* cos_cache, const T* sin_cache, int64_t cs) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens, grain_rows(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos_cache + pos[t] * cs;
      const T* s = sin_cache + pos[t] * cs;
      for (int64_t h = 0; h < heads; ++h) {
        T* a = x + t * s0 + h * s1;
        T* b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = widen(a[i]), x2 = widen(b[i]);
          a[i] = narrow<T>(rounded<T>(x1 * widen(c[i])) - rounded<T>(x2 * widen(s[i])));
          b[i] = narrow<T>(rounded<T>(x2 * widen(c[half + i])) +
                           rounded<T>(x1 * widen(s[half + i])));
        }
      }
    }
  });
}

#if defined(__AVX512F__)
// rotate_rows<bf16> in 16-lane vectors, the tails masked.
void rotate_rows_bf16(bf16* x, int64_t tokens, int64_t heads, int64_t D, int64_t s0, int64_t s1,
                      const int64_t* pos, const bf16* cos_cache, const bf16* sin_cache,
                      int64_t cs) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens, grain_rows(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* c = cos_cache + pos[t] * cs;
      const bf16* s = sin_cache + pos[t] * cs;
      for (int64_t h = 0; h < heads; ++h) {
        bf16* a = x + t * s0 + h * s1;
        bf16* b = a + half;
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = lanes16(i, half);
          const __m512 x1 = widen16(a + i, m), x2 = widen16(b + i, m);
          const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
          const __m512 lo = _mm512_add_ps(round16(_mm512_mul_ps(x1, widen16(c + i, m))),
                                          round16(_mm512_mul_ps(neg_x2, widen16(s + i, m))));
          const __m512 hi = _mm512_add_ps(round16(_mm512_mul_ps(x2, widen16(c + half + i, m))),
                                          round16(_mm512_mul_ps(x1, widen16(s + half + i, m))));
          narrow16(a + i, lo, m);
          narrow16(b + i, hi, m);
        }
      }
    }
  });
}
#endif

template <typename T>
void rotate_both(int64_t tokens, const int64_t* pos, at::Tensor& query, at::Tensor& key,
                 const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  for (at::Tensor* t : {&query, &key}) {
    T* x = t->mutable_data_ptr<T>();
    const T* c = cos_cache.const_data_ptr<T>();
    const T* s = sin_cache.const_data_ptr<T>();
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, bf16>) {
      rotate_rows_bf16(x, tokens, t->size(1), t->size(2), t->stride(0), t->stride(1), pos, c, s,
                       cos_cache.stride(0));
      continue;
    }
#endif
    rotate_rows<T>(x, tokens, t->size(1), t->size(2), t->stride(0), t->stride(1), pos, c, s,
                   cos_cache.stride(0));
  }
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.dim() == 1,
              "positions must be contiguous int64 [T]");
  const int64_t tokens = positions.size(0);
  for (const at::Tensor* t : {&query, &key}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) >= tokens && t->stride(2) == 1,
                "query and key must be [T, heads, head_size] with contiguous heads");
  }
  check_same_dtype({&query, &key, &cos_cache, &sin_cache});
  const int64_t D = query.size(2);
  TORCH_CHECK(key.size(2) == D && D % 2 == 0, "query and key need one even head_size");
  for (const at::Tensor* t : {&cos_cache, &sin_cache}) {
    TORCH_CHECK(t->dim() == 2 && t->size(1) == D && t->stride(1) == 1,
                "cos_cache and sin_cache must be [max_position, head_size] rows");
  }
  TORCH_CHECK(sin_cache.stride(0) == cos_cache.stride(0), "cos and sin caches must share a layout");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_cache.size(0), "position ", pos[t],
                " is outside the cos/sin tables");
  }
  if (query.scalar_type() == at::kBFloat16) {
    rotate_both<bf16>(tokens, pos, query, key, cos_cache, sin_cache);
  } else {
    rotate_both<float>(tokens, pos, query, key, cos_cache, sin_cache);
  }
}

// out [rows, d] = silu(x[:, :d]) * x[:, d:], silu(g) = g / (1 + exp(-g)). In bfloat16, silu(g)
// rounded (torch's F.silu returns bfloat16), then the product rounded.
template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  const T* xp = x.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xp + r * xs;
      const T* u = g + d;
      T* o = op + r * os;
#if defined(__AVX512F__)
      static_assert(std::is_same_v<T, float>, "AVX-512 builds take bfloat16 in silu_and_mul_bf16");
      // 16 lanes, the tail masked: every element takes the same instructions wherever it lies,
      // and the loop runs twice as wide as the one GCC makes of the scalar form.
      const auto silu_mul16 = [](__m512 gv, __m512 uv) {
        const __m512 e = fleetserve_cpu::exp_clamped16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        return _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), uv);
      };
      const int64_t whole = d / 16 * 16;
      for (int64_t i = 0; i < whole; i += 16) {
        _mm512_storeu_ps(o + i, silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
      }
      if (whole < d) {
        const __mmask16 tail = static_cast<__mmask16>((1u << (d - whole)) - 1u);
        _mm512_mask_storeu_ps(o + whole, tail,
                              silu_mul16(_mm512_maskz_loadu_ps(tail, g + whole),
                                         _mm512_maskz_loadu_ps(tail, u + whole)));
      }
#else
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        const float gi = widen(g[i]);
        o[i] = narrow<T>(rounded<T>(gi / (1.f + fleetserve_cpu::exp_clamped(-gi))) * widen(u[i]));
      }
#endif
    }
  });
}

#if defined(__AVX512F__)
// silu_and_mul_impl<bf16> in 16-lane vectors, the tails masked.
void silu_and_mul_bf16(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  const bf16* xp = x.const_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* g = xp + r * xs;
      for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 m = lanes16(i, d);
        const __m512 gv = widen16(g + i, m);
        const __m512 e = fleetserve_cpu::exp_clamped16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 silu = round16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        narrow16(op + r * os + i, _mm512_mul_ps(silu, widen16(g + d + i, m)), m);
      }
    }
  });
}
#endif

void silu_and_mul(const at::Tensor& x, at::Tensor& out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2,
              "x must be [rows, 2d] and out [rows, d]");
  check_same_dtype({&x, &out});
  if (x.scalar_type() == at::kBFloat16) {
#if defined(__AVX512F__)
    silu_and_mul_bf16(x, out);
#else
    silu_and_mul_impl<bf16>(x, out);
#endif
    return;
  }
  silu_and_mul_impl<float>(x, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fleetserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, Tensor(a!) out, "
      "Tensor(b!) summed) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_cache, "
      "Tensor sin_cache) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(fleetserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
