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
// AVX-512 only (compiled with -march=native): elsewhere small_gemm_supported() is false and the
// engine keeps oneDNN for every row count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <strings.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

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
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

void check_weight(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat, name,
              " must be a float32 CPU tensor");
}

// [N, K] -> [ceil(N / 32), K, 32], the columns past N zero.
at::Tensor pack(const at::Tensor& weight) {
  check_weight(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, k, kPanel}, w.options());
  const float* src = w.const_data_ptr<float>();
  float* dst = packed.mutable_data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j) {
        const float* row = src + (p * kPanel + j) * k;
        float* col = dst + p * k * kPanel + j;
        for (int64_t i = 0; i < k; ++i) col[i * kPanel] = row[i];
      }
    }
  });
  return packed;
}

#if defined(__AVX512F__)
// acc[R rows][32] (+)= x[R rows][k0 : k0 + len] · panel[k0 : k0 + len][32]; while at it, prefetch
// `prefetch_lines` cache lines from `prefetch` into L2, one or two a k step.
template <int R>
void row_block(const float* x, int64_t ldx, const float* panel, int64_t len, float* acc,
               bool first, const char* prefetch, int64_t prefetch_lines) {
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

using RowBlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, bool,
                            const char*, int64_t);
constexpr int kMaxBlockRows = 12;
constexpr RowBlockFn kRowBlocks[kMaxBlockRows + 1] = {
    nullptr,        row_block<1>,  row_block<2>, row_block<3>, row_block<4>,
    row_block<5>,   row_block<6>,  row_block<7>, row_block<8>, row_block<9>,
    row_block<10>,  row_block<11>, row_block<12>};

// One panel's 32 columns of `rows` rows starting at x (row stride ldx) into out (row stride ldo).
void panel_rows(const float* x, int64_t ldx, int64_t rows, const float* panel, int64_t k,
                const float* bias, int64_t cols, float* out, int64_t ldo) {
  alignas(64) float acc[kChunkRows * kPanel];
  for (int64_t m0 = 0; m0 < rows; m0 += kChunkRows) {
    const int64_t chunk = std::min(kChunkRows, rows - m0);
    const int64_t blocks = (chunk + kMaxBlockRows - 1) / kMaxBlockRows;
    for (int64_t k0 = 0; k0 < k; k0 += kBlockK) {
      const int64_t len = std::min(kBlockK, k - k0);
      const float* sub = panel + k0 * kPanel;
      // The row blocks share the prefetch of what follows this K block in the stream.
      const int64_t lines = len * kPanel / 16;
      const int64_t share = (lines + blocks - 1) / blocks;
      const char* ahead = reinterpret_cast<const char*>(sub) + kPrefetchBytes;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t m = b * kMaxBlockRows;
        const int r = static_cast<int>(std::min<int64_t>(kMaxBlockRows, chunk - m));
        const int64_t from = b * share;
        const int64_t count = std::max<int64_t>(0, std::min(share, lines - from));
        kRowBlocks[r](x + (m0 + m) * ldx + k0, ldx, sub, len, acc + m * kPanel, k0 == 0,
                      ahead + from * 64, count);
      }
    }
    for (int64_t m = 0; m < chunk; ++m) {
      float* row = out + (m0 + m) * ldo;
      const float* sums = acc + m * kPanel;
      if (bias == nullptr) {
        std::memcpy(row, sums, cols * sizeof(float));
      } else {
        for (int64_t j = 0; j < cols; ++j) row[j] = sums[j] + bias[j];
      }
    }
  }
}
#endif

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "small_gemm needs AVX-512 (check small_gemm_supported() first)");
  check_weight(x, "x");
  check_weight(packed, "packed");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, in_features], rows contiguous");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed must come from small_gemm_pack");
  const int64_t rows = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "x has ", k, " features, the packed weight ", packed.size(1));
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features ", out_features, " does not match the packed weight's ", panels,
              " panels");
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_weight(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous(),
                "bias must be [out_features], contiguous");
    bp = bias->const_data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, out_features}, x.options());
#if defined(__AVX512F__)
  const float* xp = x.const_data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float* wp = packed.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t panel_bytes = k * kPanel * static_cast<int64_t>(sizeof(float));
  const int64_t grain_bytes = workers_spin() ? kGrainBytesSpinning : kGrainBytesSleeping;
  const int64_t grain = std::max<int64_t>(1, grain_bytes / std::max<int64_t>(1, panel_bytes));
  if (rows > 0) {
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, out_features - p * kPanel);
        panel_rows(xp, ldx, rows, wp + p * k * kPanel, k, bp ? bp + p * kPanel : nullptr, cols,
                   op + p * kPanel, out_features);
      }
    });
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fleetserve_cpu, m) {
  m.def("small_gemm_supported() -> bool", &supported);
  m.def("small_gemm_pack(Tensor weight) -> Tensor");
  m.def("small_gemm(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fleetserve_cpu, CPU, m) {
  m.impl("small_gemm_pack", &pack);
  m.impl("small_gemm", &small_gemm);
}
