// x Wᵀ (+ b) in float32 for few rows: the GEMMs of decode steps (fleetserve/engine/layers/gemm.py
// routes up to SMALL_GEMM_MAX_ROWS[float32] rows here, more to oneDNN).
//
// At decode batch sizes a GEMM reads every weight from memory once and does only a few FMAs per
// weight, so it runs as fast as the weight stream keeps the FMA units fed. oneDNN's and MKL's
// kernels leave the memory idle while they compute (on the project's Intel box a batch-32 decode
// step's GEMMs took about read time + compute time: 43-53 ms for 528 MB and 8.5 GFLOP). Here the
// weight is packed once into panels of 32 output columns, [panels][K][32], one contiguous stream,
// and each thread walks its run of panels while prefetching the stream 32 KiB ahead into L2, so
// the loads of the next panels overlap the FMAs of this one.
//
// In a panel, K is walked in blocks of 128 (16 KiB of weight, L1-resident across the row
// blocks) and rows in blocks of up to 12 (24 zmm accumulators: 12 rows x 32 columns, the x value
// broadcast from memory into each FMA). The partial sums of a K block wait in a small float32
// buffer between blocks, so every output is one float32 FMA chain over k = 0..K-1 in order:
// exact to float32 rounding, and a row's result depends neither on the other rows nor on how many
// there are (unlike oneDNN's, whose single-row GEMV sums in another order).
//
// AVX-512, or AVX2 with FMA (AMD's Zen 2 and 3, Intel's client cores; compiled with
// -march=native): elsewhere small_gemm_supported() is false and the engine keeps oneDNN for every
// row count. AVX2 has 16 ymm registers where AVX-512 has 32 zmm, so there a row block is at most
// 6 rows and walks a panel's two 16-column halves one after the other (12 accumulators, two
// weight vectors, the broadcast). The FMA chain of each output is the same, so both give the same
// bits.
//
// On AVX2 CPUs it also takes bfloat16, where oneDNN cannot (it needs AVX-512 BW/VL/DQ or
// AVX-NE-CONVERT for bfloat16, and torch's fallback GEMM is 3-4x slower than float32): the
// weight packed in bfloat16 and widened as it is read, x widened once, float32 FMA chains as
// above, and each sum rounded to bfloat16 once after the bias is added in float32. There it takes
// every row count, since the alternative is that fallback.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16.h"

#include <strings.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#define FLEETSERVE_SMALL_GEMM 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FLEETSERVE_SMALL_GEMM 1
#define FLEETSERVE_SMALL_GEMM_BF16 1
#endif

namespace {

using bf16 = c10::BFloat16;

constexpr int64_t kPanel = 32;        // output columns a panel (two zmm)
constexpr int64_t kBlockK = 128;      // K a block: 16 KiB of a panel's weight
constexpr int64_t kChunkRows = 64;    // rows whose partial sums one panel keeps at a time
constexpr int64_t kPrefetchBytes = 32 << 10;
// A thread's least share of the weight stream, by what starting a parallel region costs.
// With spinning workers (OMP_WAIT_POLICY=ACTIVE, which fleetserve sets on dedicated cores) a
// region costs a microsecond or two, and a GEMM kept on one thread is what costs: the other
// workers idle past their bounded spin (about 0.1 ms), sleep, and the next region (the
// attention) waits about 50 us on a VM for each to wake. So split from one 8 KiB panel: in the
// tiny model's 64-prompt run (every GEMM at most 64 KiB of weight) the threads then slept 200
// times instead of 445, and the run took 0.39-0.42 s instead of 0.43-0.45. With sleeping
// workers (PASSIVE) every region pays that wake-up, so a thread takes at least 64 KiB (at 8 KiB
// the same run took 0.56-0.61 s instead of 0.47-0.51).
constexpr int64_t kGrainBytesSpinning = 8 << 10;
constexpr int64_t kGrainBytesSleeping = 64 << 10;

// Whether the OpenMP workers spin between regions: libgomp's policy, read from the same
// variable libgomp reads once at start (unset: libgomp spins for a while too).
bool workers_spin() {
  static const bool spin = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    return policy == nullptr || strcasecmp(policy, "PASSIVE") != 0;
  }();
  return spin;
}

bool supported() {
#if defined(FLEETSERVE_SMALL_GEMM)
  return true;
#else
  return false;
#endif
}

// Whether bfloat16 runs here too (the AVX2 build; AVX-512 CPUs have oneDNN's bfloat16 and AMX
// CPUs small_gemm_bf16.cpp).
bool bf16_supported() {
#if defined(FLEETSERVE_SMALL_GEMM_BF16)
  return true;
#else
  return false;
#endif
}

// A float32 CPU tensor, or bfloat16 where bf16_supported().
void check_weight(const at::Tensor& w, const char* name) {
  const bool bf16_ok = bf16_supported() && w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w.device().is_cpu() && (w.scalar_type() == at::kFloat || bf16_ok), name,
              bf16_supported() ? " must be a float32 or bfloat16 CPU tensor"
                               : " must be a float32 CPU tensor");
}

// [N, K] -> [ceil(N / 32), K, 32], the columns past N zero.
template <typename T>
at::Tensor pack_as(const at::Tensor& w) {
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, k, kPanel}, w.options());
  const T* src = w.const_data_ptr<T>();
  T* dst = packed.mutable_data_ptr<T>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j) {
        const T* row = src + (p * kPanel + j) * k;
        T* col = dst + p * k * kPanel + j;
        for (int64_t i = 0; i < k; ++i) col[i * kPanel] = row[i];
      }
    }
  });
  return packed;
}

at::Tensor pack(const at::Tensor& weight) {
  check_weight(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  const at::Tensor w = weight.contiguous();
  return w.scalar_type() == at::kFloat ? pack_as<float>(w) : pack_as<bf16>(w);
}

#if defined(__AVX512F__)
// acc[R rows][32] (+)= x[R rows][k0 : k0 + len] · panel[k0 : k0 + len][32]; while at it, prefetch
// `prefetch_lines` cache lines from `prefetch` into L2, one or two a k step.
// Float32 weights only: bfloat16 goes to oneDNN or AMX on these CPUs.
constexpr int kMaxBlockRows = 12;
template <int R, typename W>
void row_block(const float* x, int64_t ldx, const W* panel, int64_t len, float* acc, bool first,
               const char* prefetch, int64_t prefetch_lines) {
  static_assert(std::is_same_v<W, float>, "the AVX-512 row blocks take float32 weights");
  __m512 lo[R], hi[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    lo[r] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + r * kPanel);
    hi[r] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + r * kPanel + 16);
  }
  const int64_t per_step = prefetch_lines > len ? 2 : 1;
  for (int64_t i = 0; i < len; ++i) {
    if (i * per_step < prefetch_lines) {
      _mm_prefetch(prefetch + i * per_step * 64, _MM_HINT_T1);
      if (per_step == 2) _mm_prefetch(prefetch + i * per_step * 64 + 64, _MM_HINT_T1);
    }
    const __m512 w_lo = _mm512_loadu_ps(panel + i * kPanel);
    const __m512 w_hi = _mm512_loadu_ps(panel + i * kPanel + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + i]);
      lo[r] = _mm512_fmadd_ps(a, w_lo, lo[r]);
      hi[r] = _mm512_fmadd_ps(a, w_hi, hi[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(acc + r * kPanel, lo[r]);
    _mm512_store_ps(acc + r * kPanel + 16, hi[r]);
  }
}

#elif defined(FLEETSERVE_SMALL_GEMM)
// The same contract in AVX2: the panel's two 16-column halves one after the other, each over the
// whole K block (both halves of the block stay in L1), prefetching one line a k step of either.
constexpr int kMaxBlockRows = 6;

using fleetserve_cpu::widen8;  // 8 weights as float32 (bfloat16 widens exactly)

// One or two rows: the panel's 32 columns in one pass, four accumulators a row, so that enough
// independent FMA chains are in flight (two a row leave the FMA latency exposed: a bfloat16 row
// took as long as a float32 one, for half the bytes). Each output's chain is the same.
template <int R, typename W>
void narrow_row_block(const float* x, int64_t ldx, const W* panel, int64_t len, float* acc,
                      bool first, const char* prefetch, int64_t prefetch_lines) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 4; ++c) {
      a[r][c] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + r * kPanel + 8 * c);
    }
  }
  const int64_t per_step = prefetch_lines > len ? 2 : 1;
  for (int64_t i = 0; i < len; ++i) {
    if (i * per_step < prefetch_lines) {
      _mm_prefetch(prefetch + i * per_step * 64, _MM_HINT_T1);
      if (per_step == 2) _mm_prefetch(prefetch + i * per_step * 64 + 64, _MM_HINT_T1);
    }
    __m256 w[4];
    for (int c = 0; c < 4; ++c) w[c] = widen8(panel + i * kPanel + 8 * c);
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + i);
      for (int c = 0; c < 4; ++c) a[r][c] = _mm256_fmadd_ps(b, w[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 4; ++c) _mm256_store_ps(acc + r * kPanel + 8 * c, a[r][c]);
  }
}

template <int R, typename W>
void row_block(const float* x, int64_t ldx, const W* panel, int64_t len, float* acc, bool first,
               const char* prefetch, int64_t prefetch_lines) {
  if constexpr (R <= 2) {
    narrow_row_block<R, W>(x, ldx, panel, len, acc, first, prefetch, prefetch_lines);
    return;
  }
  int64_t line = 0;
  for (int64_t half = 0; half < kPanel; half += 16) {
    __m256 lo[R], hi[R];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      lo[r] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + r * kPanel + half);
      hi[r] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + r * kPanel + half + 8);
    }
    for (int64_t i = 0; i < len; ++i) {
      if (line < prefetch_lines) _mm_prefetch(prefetch + 64 * line++, _MM_HINT_T1);
      const __m256 w_lo = widen8(panel + i * kPanel + half);
      const __m256 w_hi = widen8(panel + i * kPanel + half + 8);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(x + r * ldx + i);
        lo[r] = _mm256_fmadd_ps(a, w_lo, lo[r]);
        hi[r] = _mm256_fmadd_ps(a, w_hi, hi[r]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(acc + r * kPanel + half, lo[r]);
      _mm256_store_ps(acc + r * kPanel + half + 8, hi[r]);
    }
  }
}
#endif

#if defined(FLEETSERVE_SMALL_GEMM)

template <typename W>
using RowBlockFn = void (*)(const float*, int64_t, const W*, int64_t, float*, bool, const char*,
                            int64_t);

// row_block<r, W> for r = 1 .. kMaxBlockRows, indexed by r (entry 0 unused).
template <typename W, int... R>
RowBlockFn<W> row_block_fn(int r, std::integer_sequence<int, R...>) {
  static constexpr RowBlockFn<W> kRowBlocks[] = {nullptr, row_block<R + 1, W>...};
  return kRowBlocks[r];
}
template <typename W>
RowBlockFn<W> row_block_fn(int r) {
  return row_block_fn<W>(r, std::make_integer_sequence<int, kMaxBlockRows>{});
}

// One panel's 32 columns of `rows` rows starting at x (row stride ldx) into out (row stride ldo),
// the weight, bias and out of type W (each sum rounded to W once, after the bias).
template <typename W>
void panel_rows(const float* x, int64_t ldx, int64_t rows, const W* panel, int64_t k,
                const W* bias, int64_t cols, W* out, int64_t ldo) {
  alignas(64) float acc[kChunkRows * kPanel];
  for (int64_t m0 = 0; m0 < rows; m0 += kChunkRows) {
    const int64_t chunk = std::min(kChunkRows, rows - m0);
    const int64_t blocks = (chunk + kMaxBlockRows - 1) / kMaxBlockRows;
    for (int64_t k0 = 0; k0 < k; k0 += kBlockK) {
      const int64_t len = std::min(kBlockK, k - k0);
      const W* sub = panel + k0 * kPanel;
      // The row blocks share the prefetch of what follows this K block in the stream.
      const int64_t lines = len * kPanel * static_cast<int64_t>(sizeof(W)) / 64;
      const int64_t share = (lines + blocks - 1) / blocks;
      const char* ahead = reinterpret_cast<const char*>(sub) + kPrefetchBytes;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t m = b * kMaxBlockRows;
        const int r = static_cast<int>(std::min<int64_t>(kMaxBlockRows, chunk - m));
        const int64_t from = b * share;
        const int64_t count = std::max<int64_t>(0, std::min(share, lines - from));
        row_block_fn<W>(r)(x + (m0 + m) * ldx + k0, ldx, sub, len, acc + m * kPanel, k0 == 0,
                           ahead + from * 64, count);
      }
    }
    for (int64_t m = 0; m < chunk; ++m) {
      W* row = out + (m0 + m) * ldo;
      const float* sums = acc + m * kPanel;
      if (bias == nullptr) {
        for (int64_t j = 0; j < cols; ++j) row[j] = static_cast<W>(sums[j]);
      } else {
        for (int64_t j = 0; j < cols; ++j) {
          row[j] = static_cast<W>(sums[j] + static_cast<float>(bias[j]));
        }
      }
    }
  }
}

// out = x Wᵀ (+ bias) with W packed in W's type; x float32 (rows contiguous, stride ldx).
template <typename W>
void run_panels(const float* xp, int64_t ldx, int64_t rows, int64_t k, const at::Tensor& packed,
                const W* bp, int64_t out_features, at::Tensor& out) {
  const int64_t panels = packed.size(0);
  const W* wp = packed.const_data_ptr<W>();
  W* op = out.mutable_data_ptr<W>();
  const int64_t panel_bytes = k * kPanel * static_cast<int64_t>(sizeof(W));
  const int64_t grain_bytes = workers_spin() ? kGrainBytesSpinning : kGrainBytesSleeping;
  const int64_t grain = std::max<int64_t>(1, grain_bytes / std::max<int64_t>(1, panel_bytes));
  if (rows == 0) return;
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, out_features - p * kPanel);
      panel_rows<W>(xp, ldx, rows, wp + p * k * kPanel, k, bp ? bp + p * kPanel : nullptr, cols,
                    op + p * kPanel, out_features);
    }
  });
}
#endif

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(),
              "small_gemm needs AVX-512 or AVX2 with FMA (check small_gemm_supported() first)");
  check_weight(x, "x");
  check_weight(packed, "packed");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type(), "x and the packed weight must share a "
              "dtype, got ", x.scalar_type(), " and ", packed.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, in_features], rows contiguous");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed must come from small_gemm_pack");
  const int64_t rows = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "x has ", k, " features, the packed weight ", packed.size(1));
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features ", out_features, " does not match the packed weight's ", panels,
              " panels");
  if (bias.has_value()) {
    check_weight(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "bias must have x's dtype");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous(),
                "bias must be [out_features], contiguous");
  }
  at::Tensor out = at::empty({rows, out_features}, x.options());
#if defined(FLEETSERVE_SMALL_GEMM)
  if (x.scalar_type() == at::kFloat) {
    run_panels<float>(x.const_data_ptr<float>(), x.stride(0), rows, k, packed,
                      bias.has_value() ? bias->const_data_ptr<float>() : nullptr, out_features,
                      out);
  }
#endif
#if defined(FLEETSERVE_SMALL_GEMM_BF16)
  if (x.scalar_type() == at::kBFloat16) {
    // x widened once (exact), so the row blocks read float32 as in the float32 GEMM. In a plain
    // buffer: through x.to(kFloat) each call paid about 10 us of dispatch and allocation, 1.2 ms
    // of a batch-1 SmolLM2 step's 121 calls.
    const std::unique_ptr<float[]> xf(new float[rows * k]);
    const bf16* xp = x.const_data_ptr<bf16>();
    for (int64_t r = 0; r < rows; ++r) {
      const bf16* row = xp + r * x.stride(0);
      for (int64_t i = 0; i < k; ++i) xf[r * k + i] = fleetserve_cpu::widen1(row[i]);
    }
    run_panels<bf16>(xf.get(), k, rows, k, packed,
                     bias.has_value() ? bias->const_data_ptr<bf16>() : nullptr, out_features,
                     out);
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fleetserve_cpu, m) {
  m.def("small_gemm_supported() -> bool", &supported);
  m.def("small_gemm_widen_bf16_supported() -> bool", &bf16_supported);
  m.def("small_gemm_pack(Tensor weight) -> Tensor");
  m.def("small_gemm(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fleetserve_cpu, CPU, m) {
  m.impl("small_gemm_pack", &pack);
  m.impl("small_gemm", &small_gemm);
}
