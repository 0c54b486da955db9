// x Wᵀ (+ b) in bfloat16 for few rows (decode steps) on AMX tiles: the bfloat16 counterpart of
// small_gemm.cpp (fleetserve/engine/layers/gemm.py routes up to SMALL_GEMM_MAX_ROWS[bfloat16]
// rows here, more to oneDNN).
//
// A decode step's GEMM reads every weight once and does few multiplies per weight. In bfloat16
// oneDNN (prepacked) took 16.7-21.4 ms for a SmolLM2 step's GEMMs at 1 to 32 rows on the
// project's Intel box, where reading the 269 MB of weights takes about 10.4 (its kernels leave
// the memory idle while they compute). AVX512-BF16's dot product (32 multiply-adds an
// instruction, about one a cycle) streams the weights at memory speed for one row but is
// compute-bound from about 8 rows (39 ms at 32). One AMX TDPBF16PS does 8,192 multiply-adds (16
// rows x 16 columns x 32 k) in a few dozen cycles, so at up to 32 rows the weight stream bounds
// the kernel: 11.5 ms at 1 row, 12.4 at 32 (`fleetserve bench gemm --dtype bfloat16`).
//
// The weight is packed once into panels of 32 output columns, K padded to a multiple of 32 with
// zeros, each panel [K / 2][32][2]: the pairs (k, k + 1) of a column side by side, the layout AMX
// reads its B tiles in (one tile: 16 pairs x 16 columns, 128 bytes apart). A panel is one
// contiguous stream, prefetched 32 KiB ahead into L2 as small_gemm.cpp does.
//
// Per panel and up to 32 rows: four float32 accumulator tiles (2 x 16 rows, 2 x 16 columns) stay
// in tile registers over all of K, A tiles read x in place (16 rows x 32 k), and the sums are
// rounded once to bfloat16 (with the bias added in float32 first), as oneDNN's bfloat16 GEMM
// does. Each output is the same chain of TDPBF16PS steps over k whatever rows are beside it, so
// a row's result depends neither on the other rows nor on how many there are.
//
// AMX only (compiled with -march=native on a CPU with AMX-BF16, and the kernel's permission to use
// the tile state granted): elsewhere small_gemm_bf16_supported() is false and the engine keeps
// oneDNN.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "bf16.h"

#include <algorithm>
#include <cstring>
#include <optional>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define FLEETSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using bf16 = c10::BFloat16;

constexpr int64_t kPanel = 32;   // output columns a panel (two B tiles)
constexpr int64_t kStepK = 32;   // k a TDPBF16PS step (one A tile's row, one B tile's 16 pairs)
constexpr int64_t kTileRows = 16;
constexpr int64_t kPrefetchBytes = 32 << 10;
// A thread's least share of the weight stream: see small_gemm.cpp (spinning OpenMP workers).
constexpr int64_t kGrainBytes = 8 << 10;

int64_t padded_k(int64_t k) { return (k + kStepK - 1) / kStepK * kStepK; }

#if defined(FLEETSERVE_AMX)
// Linux hands out the AMX tile state only to processes that ask for it (once per process).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-1: the accumulators of the first 16 rows (columns 0-15, 16-31), 2-3 of the next
// `second` rows; 4 and 5 their A tiles; 6 and 7 the panel's two B tiles.
void configure_tiles(int first, int second) {
  TileConfig config;
  const auto set = [&](int tile, int rows) {
    config.rows[tile] = static_cast<uint8_t>(rows);
    config.colsb[tile] = rows > 0 ? 64 : 0;
  };
  for (int tile : {0, 1, 4}) set(tile, first);
  for (int tile : {2, 3, 5}) set(tile, second);
  for (int tile : {6, 7}) set(tile, kTileRows);
  _tile_loadconfig(&config);
}

// Up to 32 rows of one panel: out[r][0 : cols] = x[r] · panel (+ bias), rounded to bfloat16.
void panel_rows(const bf16* x, int64_t ldx, int first, int second, const bf16* panel, int64_t k,
                const bf16* bias, int64_t cols, bf16* out, int64_t ldo) {
  _tile_zero(0);
  _tile_zero(1);
  if (second > 0) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const char* stream = reinterpret_cast<const char*>(panel);
  const int64_t x_stride = ldx * static_cast<int64_t>(sizeof(bf16));
  for (int64_t k0 = 0; k0 < k; k0 += kStepK) {
    const char* w = stream + k0 * kPanel * static_cast<int64_t>(sizeof(bf16));  // k0 / 2 pairs
    for (int line = 0; line < 32; ++line) _mm_prefetch(w + kPrefetchBytes + line * 64, _MM_HINT_T1);
    _tile_loadd(6, w, 128);
    _tile_loadd(7, w + 64, 128);
    _tile_loadd(4, x + k0, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (second > 0) {
      _tile_loadd(5, x + kTileRows * ldx + k0, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[2 * kTileRows * kPanel];
  _tile_stored(0, sums, kPanel * sizeof(float));
  _tile_stored(1, sums + 16, kPanel * sizeof(float));
  if (second > 0) {
    _tile_stored(2, sums + kTileRows * kPanel, kPanel * sizeof(float));
    _tile_stored(3, sums + kTileRows * kPanel + 16, kPanel * sizeof(float));
  }
  for (int r = 0; r < first + second; ++r) {
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 m = fleetserve_cpu::lanes16(c, cols);
      __m512 v = _mm512_load_ps(sums + r * kPanel + c);
      if (bias != nullptr) v = _mm512_add_ps(v, fleetserve_cpu::widen16(bias + c, m));
      fleetserve_cpu::narrow16(out + r * ldo + c, v, m);
    }
  }
}
#endif

bool supported() {
#if defined(FLEETSERVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name,
              " must be a bfloat16 CPU tensor");
}

// [N, K] -> [ceil(N / 32), padded K / 2, 32, 2]: pairs of k side by side per column, the padding
// (columns past N, k past K) zero.
at::Tensor pack(const at::Tensor& weight) {
  check_bf16(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  const int64_t pairs = padded_k(k) / 2;
  at::Tensor packed = at::zeros({panels, pairs, kPanel, 2}, w.options());
  const bf16* src = w.const_data_ptr<bf16>();
  bf16* dst = packed.mutable_data_ptr<bf16>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j) {
        const bf16* row = src + (p * kPanel + j) * k;
        bf16* col = dst + p * pairs * kPanel * 2 + j * 2;
        for (int64_t i = 0; i < k; ++i) col[(i / 2) * kPanel * 2 + i % 2] = row[i];
      }
    }
  });
  return packed;
}

at::Tensor small_gemm_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "small_gemm_bf16 needs AMX-BF16 (check small_gemm_bf16_supported())");
  check_bf16(x, "x");
  check_bf16(packed, "packed");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, in_features], rows contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == 2 &&
                  packed.is_contiguous(),
              "packed must come from small_gemm_bf16_pack");
  const int64_t rows = x.size(0), k = x.size(1), panels = packed.size(0);
  const int64_t kp = packed.size(1) * 2;
  TORCH_CHECK(padded_k(k) == kp, "x has ", k, " features, the packed weight ", kp, " (padded)");
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features ", out_features, " does not match the packed weight's ", panels,
              " panels");
  const bf16* bp = nullptr;
  if (bias.has_value()) {
    check_bf16(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous(),
                "bias must be [out_features], contiguous");
    bp = bias->const_data_ptr<bf16>();
  }
  at::Tensor out = at::empty({rows, out_features}, x.options());
#if defined(FLEETSERVE_AMX)
  // The A tiles read 32 k at a time: a K that is not a multiple of 32 reads a zero-padded copy
  // (the padded weight is zero there too).
  at::Tensor xs = x;
  if (kp != k) {
    xs = at::zeros({rows, kp}, x.options());
    xs.narrow(1, 0, k).copy_(x);
  }
  const bf16* xp = xs.const_data_ptr<bf16>();
  const int64_t ldx = xs.stride(0);
  const bf16* wp = packed.const_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  const int64_t panel_elems = kp * kPanel;
  const int64_t grain =
      std::max<int64_t>(1, kGrainBytes / (panel_elems * static_cast<int64_t>(sizeof(bf16))));
  if (rows > 0) {
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      // Each thread loads its own tile configuration (oneDNN's kernels load theirs on the same
      // threads between calls) and releases the tile state when done.
      int configured = -1;
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, out_features - p * kPanel);
        for (int64_t m0 = 0; m0 < rows; m0 += 2 * kTileRows) {
          const int chunk = static_cast<int>(std::min<int64_t>(2 * kTileRows, rows - m0));
          const int first = std::min<int>(chunk, kTileRows), second = chunk - first;
          if (chunk != configured) {
            configure_tiles(first, second);
            configured = chunk;
          }
          panel_rows(xp + m0 * ldx, ldx, first, second, wp + p * panel_elems, kp,
                     bp ? bp + p * kPanel : nullptr, cols, op + m0 * out_features + p * kPanel,
                     out_features);
        }
      }
      _tile_release();
    });
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fleetserve_cpu, m) {
  m.def("small_gemm_bf16_supported() -> bool", &supported);
  m.def("small_gemm_bf16_pack(Tensor weight) -> Tensor");
  m.def("small_gemm_bf16(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fleetserve_cpu, CPU, m) {
  m.impl("small_gemm_bf16_pack", &pack);
  m.impl("small_gemm_bf16", &small_gemm_bf16);
}
