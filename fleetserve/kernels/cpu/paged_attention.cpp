// Paged attention and the KV-cache write for the CPU, reading the paged cache in place.
//
// Registered as torch ops in the `fleetserve_cpu` namespace (loaded with torch.ops.load_library
// by fleetserve/kernels/cpu/build.py, which compiles this file once per source hash and machine).
//
// Layout (fleetserve/engine/layers/attention/metadata.py): one cache per layer,
// [2, num_blocks, block_size, num_kv_heads, head_size], index 0 = keys, 1 = values; requests lie
// back to back in the token dimension, request r owns query rows
// query_start_loc[r] .. query_start_loc[r + 1] at positions seq_len - query_len + j.
//
// Decode rows are handed to at::parallel_for's threads (torch's thread pool, so
// torch.set_num_threads governs it) one query row at a time. A row reads each key and value row
// once for all the query heads that share it (GQA), block by block straight from the cache, with
// the softmax in float32: no gathered K/V, no padding to the longest sequence, no mask.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "bf16.h"
#include "fast_exp.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// Ask for rows [from, to) of a block (`width` values each, token_stride apart) ahead of use:
// blocks are scattered over a cache far larger than the CPU's caches, so without this each row
// waits on a DRAM miss the hardware prefetcher cannot predict. Into L2 (the T1 hint): the rows
// asked for are two blocks ahead, which in L1 would crowd out the block being read.
template <typename T>
inline void prefetch_rows(const T* rows, int64_t from, int64_t to, int64_t token_stride,
                          int64_t width) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t t = from; t < to; ++t) {
    for (int64_t d = 0; d < width; d += kLine) {
      __builtin_prefetch(rows + t * token_stride + d, 0, 2);
    }
  }
}

#if defined(__AVX512F__)
// Folds 16 vectors into one whose lane i is the sum of v[i]'s lanes: a transpose-and-add tree,
// 45 shuffles and adds for the 16 sums where a horizontal sum per vector is about 8 dependent
// operations each. Levels: lanes paired within 128-bit quarters (unpack), then the quarters'
// four sums per vector gathered (shuffle_ps), then the quarters added across (shuffle_f32x4).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 w[8], u[4];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  }
  const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                   _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                   _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88),
                       _mm512_shuffle_f32x4(v01, v23, 0xDD));
}

// 16 cached values as float32: bfloat16 widens exactly (it is a float32's high half).
inline __m512 load_f32x16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_f32x16(const c10::BFloat16* p) { return fleetserve_cpu::widen16(p); }

// logits[0..15] = q · k_t for 16 float32 or bfloat16 key rows token_stride apart (D a multiple
// of 16): the rows' products summed lane-wise, then the 16 sums folded together by sum_lanes16.
template <int64_t D, typename T>
inline void dot16(const float* q, const T* k, int64_t token_stride, float* logits) {
  __m512 qv[D / 16], v[16];
  for (int64_t c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int t = 0; t < 16; ++t) {
    const T* kt = k + t * token_stride;
    __m512 a = _mm512_mul_ps(qv[0], load_f32x16(kt));
    for (int64_t c = 1; c < D / 16; ++c) a = _mm512_fmadd_ps(qv[c], load_f32x16(kt + 16 * c), a);
    v[t] = a;
  }
  _mm512_storeu_ps(logits, sum_lanes16(v));
}
#elif defined(__AVX2__) && defined(__FMA__)
// dot16's AVX2 counterpart, 8 key rows at a time: lane-wise products over D / 8 chunks, then the
// 8 row sums folded together by two levels of hadd and one swap of 128-bit halves (11 shuffles
// and adds for 8 sums where a horizontal sum per row is about 5 dependent operations each).
inline __m256 sum_lanes8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

using fleetserve_cpu::widen8;

// logits[0..7] = q · k_t for 8 float32 or bfloat16 key rows token_stride apart (D a multiple
// of 8).
template <int64_t D, typename T>
inline void dot8(const float* q, const T* k, int64_t token_stride, float* logits) {
  __m256 qv[D / 8], v[8];
  for (int64_t c = 0; c < D / 8; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
  for (int t = 0; t < 8; ++t) {
    const T* kt = k + t * token_stride;
    __m256 a = _mm256_mul_ps(qv[0], widen8(kt));
    for (int64_t c = 1; c < D / 8; ++c) a = _mm256_fmadd_ps(qv[c], widen8(kt + 8 * c), a);
    v[t] = a;
  }
  _mm256_storeu_ps(logits, sum_lanes8(v));
}
#endif

// s[0..n) = softmax(s[0..n)) in place (n >= 1). With AVX-512 in 16-lane vectors, tails
// masked; the scalar loops, which GCC vectorizes only 8 lanes wide with a peeled prologue and
// epilogue per loop, took most of a prefill call (tiny shape: 1.7 of 2.8 ms).
inline void softmax_inplace(float* s, int64_t n) {
#if defined(__AVX512F__)
  const int64_t whole = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - whole)) - 1u);
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < whole; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
  if (tail) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, s + whole));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 e = fleetserve_cpu::exp_clamped16(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (tail) {
    const __m512 e =
        fleetserve_cpu::exp_clamped16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + whole), m));
    _mm512_mask_storeu_ps(s + whole, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t i = 0; i < whole; i += 16) {
    _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
  }
  if (tail) {
    _mm512_mask_storeu_ps(s + whole, tail,
                          _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + whole), inv));
  }
#else
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    s[i] = fleetserve_cpu::exp_clamped(s[i] - m);
    sum += s[i];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
#endif
}

// Whether attend_row computes its logits several key rows at a time: 16 with AVX-512 (dot16),
// 8 with AVX2 (dot8).
template <typename T, int64_t kHeadSize>
constexpr bool kDotRows =
#if defined(__AVX512F__)
    (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) && kHeadSize > 0 &&
    kHeadSize % 16 == 0;
#elif defined(__AVX2__) && defined(__FMA__)
    (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) && kHeadSize > 0 &&
    kHeadSize % 8 == 0;
#else
    false;
#endif

// One query row: its query heads attend over the row's first kv_len cached positions. Two
// passes over the blocks, not an online softmax: every logit first (each key row read once for
// the query heads that share it), then one max and exp per head over its contiguous logits
// (vectorized), then every value row read once and added to the heads' accumulators. Each pass
// walks a block once for all kv heads, since a block's keys (or values) are one contiguous run
// of block_size × num_kv_heads × head_size values: read whole, such runs came from memory about
// 30% faster than as one strided walk per kv head (0.66-0.80 against 0.93-1.19 ms for SmolLM2's
// batch-32 cache, 10 MB, on the AVX2 box). The rows two blocks ahead in the walk (keys, then
// values) are prefetched a kv head's slice at a time between the dot products, not a block in
// one burst. `logits` holds num_kv_heads × group × kv_len floats, `acc` num_kv_heads × group × D;
// query head h = kvh × group + g. Each output is the same float32 chain, over the tokens in
// order, whatever the walk's order of heads.
//
// kHeadSize > 0 fixes D at compile time (fully unrolled dot products and updates for the common
// head sizes), kGroup > 0 the GQA group; 0 takes either at run time. Measured on the 2-core box
// (64 rows of 330 tokens, fp32): head size 32, group 2: 0.35 -> 0.20 ms a call with both fixed;
// head size 64, group 3: 1.0-1.4 -> 0.65-0.75 ms. With AVX-512 the float32 logits of whole
// 16-row runs go through dot16 (best of 7 × 30 calls, /tmp/pa_min.py): 0.213 -> 0.115 ms at
// head size 32 / group 2, 1.07 -> 0.65 ms at 64 / 3, 2.84 -> 2.63 ms at 128 / 4 (16 rows of 512).
// The value pass is left to the compiler: the same register-held accumulators written with
// intrinsics, or two sets for even and odd rows, measured slower.
template <typename T, int64_t kHeadSize, int64_t kGroup>
void attend_row(const float* qf, const T* key_cache, const T* value_cache, int64_t block_stride,
                int64_t token_stride, const int32_t* blocks, int64_t kv_len, int64_t num_kv_heads,
                int64_t group, int64_t head_size, int64_t block_size, float* logits, float* acc) {
  const int64_t D = kHeadSize > 0 ? kHeadSize : head_size;
  const int64_t G = kGroup > 0 ? kGroup : group;
  // With both fixed, a kv head's accumulators are a local array the compiler keeps in registers
  // across a block's tokens (through the pointer, it reloads and stores them per token).
  constexpr bool kFixed = kHeadSize > 0 && kGroup > 0;
  constexpr int64_t kLocal = kFixed ? kHeadSize * kGroup : 1;
  float acc_local[kLocal];
  constexpr int64_t kAhead = 2;  // blocks prefetched ahead of the one read
  const int64_t num_blocks = (kv_len + block_size - 1) / block_size;
  const auto rows_of = [&](const T* cache, int64_t b) { return cache + blocks[b] * block_stride; };
  const auto tokens_in = [&](int64_t b) { return std::min(block_size, kv_len - b * block_size); };
  // Step j of the walk: key block j, then value block j - num_blocks; nothing past the end.
  const auto walk_rows = [&](int64_t j, int64_t kvh) -> const T* {
    if (j < num_blocks) return rows_of(key_cache, j) + kvh * D;
    if (j < 2 * num_blocks) return rows_of(value_cache, j - num_blocks) + kvh * D;
    return nullptr;
  };
  const auto walk_tokens = [&](int64_t j) -> int64_t {
    return j < 2 * num_blocks ? tokens_in(j < num_blocks ? j : j - num_blocks) : 0;
  };
  for (int64_t j = 0; j < kAhead; ++j) {
    if (const T* r = walk_rows(j, 0)) {
      prefetch_rows(r, 0, walk_tokens(j), token_stride, num_kv_heads * D);
    }
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * block_size, n = tokens_in(b), ahead_n = walk_tokens(b + kAhead);
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
      const T* kb = rows_of(key_cache, b) + kvh * D;
      const T* ahead = walk_rows(b + kAhead, kvh);
      const float* q = qf + kvh * G * D;
      float* l = logits + kvh * G * kv_len + start;
      int64_t t = 0;
#if defined(__AVX512F__)
      if constexpr (kDotRows<T, kHeadSize>) {
        for (; t + 16 <= n; t += 16) {
          prefetch_rows(ahead, t, std::min(t + 16, ahead_n), token_stride, D);
          for (int64_t g = 0; g < G; ++g) {
            dot16<kHeadSize>(q + g * D, kb + t * token_stride, token_stride, l + g * kv_len + t);
          }
        }
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (kDotRows<T, kHeadSize>) {
        for (; t + 8 <= n; t += 8) {
          prefetch_rows(ahead, t, std::min(t + 8, ahead_n), token_stride, D);
          for (int64_t g = 0; g < G; ++g) {
            dot8<kHeadSize>(q + g * D, kb + t * token_stride, token_stride, l + g * kv_len + t);
          }
        }
      }
#endif
      for (; t < n; ++t) {
        prefetch_rows(ahead, t, std::min(t + 1, ahead_n), token_stride, D);
        const T* k = kb + t * token_stride;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = q + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_float(k[d]);
          l[g * kv_len + t] = dot;
        }
      }
      prefetch_rows(ahead, n, ahead_n, token_stride, D);
    }
  }
  for (int64_t h = 0; h < num_kv_heads * G; ++h) softmax_inplace(logits + h * kv_len, kv_len);
  std::fill(acc, acc + num_kv_heads * G * D, 0.f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * block_size, n = tokens_in(b);
    const int64_t ahead_n = walk_tokens(num_blocks + b + kAhead);
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
      const T* vb = rows_of(value_cache, b) + kvh * D;
      const T* ahead = walk_rows(num_blocks + b + kAhead, kvh);
      const float* l = logits + kvh * G * kv_len + start;
      float* a_all = acc + kvh * G * D;
      if constexpr (kFixed) {
        std::copy(a_all, a_all + kLocal, acc_local);
        a_all = acc_local;
      }
      for (int64_t t = 0; t < n; ++t) {
        prefetch_rows(ahead, t, std::min(t + 1, ahead_n), token_stride, D);
        const T* v = vb + t * token_stride;
        for (int64_t g = 0; g < G; ++g) {
          const float p = l[g * kv_len + t];
          float* a = a_all + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * to_float(v[d]);
        }
      }
      prefetch_rows(ahead, n, ahead_n, token_stride, D);
      if constexpr (kFixed) std::copy(acc_local, acc_local + kLocal, acc + kvh * G * D);
    }
  }
}

template <typename T>
using AttendFn = void (*)(const float*, const T*, const T*, int64_t, int64_t, const int32_t*,
                          int64_t, int64_t, int64_t, int64_t, int64_t, float*, float*);

template <typename T, int64_t kHeadSize>
AttendFn<T> pick_group(int64_t group) {
  switch (group) {
    case 1: return attend_row<T, kHeadSize, 1>;
    case 2: return attend_row<T, kHeadSize, 2>;
    case 3: return attend_row<T, kHeadSize, 3>;
    case 4: return attend_row<T, kHeadSize, 4>;
    case 8: return attend_row<T, kHeadSize, 8>;
    default: return attend_row<T, kHeadSize, 0>;
  }
}

// The compiled-in variant for (head size, GQA group): both fixed for the common shapes (head
// sizes 32, 64, 128 and groups 1, 2, 3, 4, 8), either one at run time otherwise.
template <typename T>
AttendFn<T> pick_attend(int64_t head_size, int64_t group) {
  switch (head_size) {
    case 32: return pick_group<T, 32>(group);
    case 64: return pick_group<T, 64>(group);
    case 128: return pick_group<T, 128>(group);
    default: return attend_row<T, 0, 0>;
  }
}

// One call's inputs as `paged_attention` received them: pointers into its tensors (the cache
// split into keys and values), their strides, and the shape.
template <typename T>
struct PagedStep {
  const T* q;
  int64_t q_stride_tok, q_stride_head;
  const T* key_cache;
  const T* value_cache;
  int64_t block_stride, token_stride;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* block_table;
  int64_t block_table_stride;
  T* out;
  int64_t out_stride_tok, out_stride_head;
  int64_t num_reqs, num_tokens, num_heads, num_kv_heads, head_size, block_size;
  float scale;
};

// The rows of requests whose query is shorter than min_tile_query_len (and at most
// max_query_len). Rows are taken longest first from a shared counter, as attend_tiles does its
// tiles: a static split of a decode batch left one thread up to a tenth of the call idle at the
// join (rows of 32-640 cached tokens), long enough for it to sleep. A row's KV heads stay on
// one thread: handed out separately, the heads of a token row went to different cores, whose L2
// streamers each fetched the other head's lines for nothing (25-35% slower).
template <typename T>
void attend_rows(const PagedStep<T>& step, int64_t max_query_len, int64_t min_tile_query_len) {
  const int64_t group = step.num_heads / step.num_kv_heads;
  const int64_t D = step.head_size;
  struct Row {
    int64_t tok, req, kv_len;
  };
  std::vector<Row> rows;
  rows.reserve(step.num_tokens);
  int64_t max_kv_len = 0;
  for (int64_t r = 0; r < step.num_reqs; ++r) {
    const int64_t start = step.query_start_loc[r];
    const int64_t query_len = step.query_start_loc[r + 1] - start;
    // Longer queries are the tiles' (attend_tiles) or the caller's (prefill chunks).
    if (query_len > max_query_len || query_len >= min_tile_query_len) continue;
    for (int64_t i = 0; i < query_len; ++i) {
      // Causal: this row sees every cached position up to and including its own.
      const int64_t kv_len = step.seq_lens[r] - query_len + i + 1;
      rows.push_back({start + i, r, kv_len});
      max_kv_len = std::max(max_kv_len, kv_len);
    }
  }
  if (rows.empty()) return;
  std::stable_sort(rows.begin(), rows.end(),
                   [](const Row& a, const Row& b) { return a.kv_len > b.kv_len; });
  const AttendFn<T> attend = pick_attend<T>(D, group);
  const int64_t num_rows = static_cast<int64_t>(rows.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int64_t heads = step.num_heads;
    std::vector<float> qf(heads * D), acc(heads * D), logits(heads * max_kv_len);
    for (int64_t i = next.fetch_add(1); i < num_rows; i = next.fetch_add(1)) {
      const Row& row = rows[i];
      for (int64_t h = 0; h < heads; ++h) {
        const T* qh = step.q + row.tok * step.q_stride_tok + h * step.q_stride_head;
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = to_float(qh[d]) * step.scale;
      }
      attend(qf.data(), step.key_cache, step.value_cache, step.block_stride, step.token_stride,
             step.block_table + row.req * step.block_table_stride, row.kv_len,
             step.num_kv_heads, group, D, step.block_size, logits.data(), acc.data());
      for (int64_t h = 0; h < heads; ++h) {
        T* o = step.out + row.tok * step.out_stride_tok + h * step.out_stride_head;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[h * D + d]);
      }
    }
  });
}

#if defined(__AVX512F__)
// Transposes the 16x16 tile r in place (afterwards lane i of r[j] is what lane j of r[i] was):
// pairs of rows interleaved, then pairs of pairs, then the 128-bit quarters moved across.
inline void transpose16x16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 2]), d = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
    const __m512 v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}

// Prefill rows in tiles (float32, AVX-512): kRows consecutive query rows of one request and the
// kGroup query heads that share kv head kvh, 16 or fewer query vectors in all, attend together.
// Each 16-key chunk is loaded once per tile and transposed in registers, so the tile's logits
// are kHeadSize broadcast FMAs per query vector and 16 keys, with no horizontal sums (the
// row-at-a-time walk spends 45 shuffles per 16 logits on them and loads every key row again for
// each query row). Rows see kv_len = first_kv_len + their index: the causal tail of the last
// chunk is computed and ignored (its probabilities are zero). Values: a pass per group of query
// vectors whose accumulators fit in 16 registers.
template <int64_t kHeadSize, int64_t kGroup>
struct PrefillTile {
  static constexpr int64_t kRows = std::max<int64_t>(1, 16 / kGroup);
  static constexpr int64_t kVectors = kRows * kGroup;  // query vectors in a tile
  static constexpr int64_t kChunks = kHeadSize / 16;   // 16-float pieces of a head
  static constexpr int64_t kValueVectors = std::max<int64_t>(1, 16 / kChunks);

  // `q` holds kVectors × kHeadSize scaled queries (rows past n zero), `logits` kVectors ×
  // `stride` floats; out_rows[i * kGroup + g] receives vector (i, g) for the n real rows.
  static void run(const float* q, const float* key_cache, const float* value_cache,
                  int64_t block_stride, int64_t token_stride, const int32_t* blocks,
                  int64_t block_size, int64_t first_kv_len, int64_t n, float* logits,
                  int64_t stride, float* const* out_rows) {
    const int64_t kv_max = first_kv_len + n - 1;
    // The chunk's keys transposed (kt[d] lane t = key t's element d); in L1, not registers:
    // the FMAs below keep their accumulators there.
    alignas(64) float kt[kHeadSize][16];
    for (int64_t start = 0; start < kv_max; start += 16) {
      const int64_t m = std::min<int64_t>(16, kv_max - start);
      const float* rows[16];
      for (int64_t t = 0; t < m; ++t) {
        const int64_t pos = start + t;
        rows[t] = key_cache + blocks[pos / block_size] * block_stride +
                  (pos % block_size) * token_stride;
      }
      for (int64_t c = 0; c < kChunks; ++c) {
        __m512 k[16];
        for (int64_t t = 0; t < 16; ++t) {
          k[t] = t < m ? _mm512_loadu_ps(rows[t] + 16 * c) : _mm512_setzero_ps();
        }
        transpose16x16(k);
        for (int64_t d = 0; d < 16; ++d) _mm512_store_ps(kt[16 * c + d], k[d]);
      }
      constexpr int64_t kHalf = kVectors > 8 ? (kVectors + 1) / 2 : kVectors;
      logit_rows<kHalf>(q, &kt[0][0], logits + start, stride);
      if constexpr (kVectors > kHalf) {
        logit_rows<kVectors - kHalf>(q + kHalf * kHeadSize, &kt[0][0],
                                     logits + kHalf * stride + start, stride);
      }
    }
    for (int64_t v = 0; v < kVectors; ++v) {
      float* s = logits + v * stride;
      const int64_t kv_len = std::min(first_kv_len + v / kGroup, kv_max);
      softmax_inplace(s, kv_len);
      std::fill(s + kv_len, s + kv_max, 0.f);
    }
    value_rows<0>(value_cache, block_stride, token_stride, blocks, block_size, kv_max, n,
                  logits, stride, out_rows);
  }

  // The logits of kCount query vectors (q, kHeadSize apart) against one transposed chunk kt,
  // into out (their rows stride apart).
  template <int64_t kCount>
  static void logit_rows(const float* q, const float* kt, float* out, int64_t stride) {
    __m512 acc[kCount];
    for (int64_t v = 0; v < kCount; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < kHeadSize; ++d) {
      const __m512 kd = _mm512_load_ps(kt + 16 * d);
      for (int64_t v = 0; v < kCount; ++v) {
        acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(q[v * kHeadSize + d]), kd, acc[v]);
      }
    }
    for (int64_t v = 0; v < kCount; ++v) _mm512_storeu_ps(out + v * stride, acc[v]);
  }

  // out_rows[v] = sum over t of p[v][t] * value t, for the query vectors from kFirst on that
  // belong to the n real rows, kValueVectors at a time (their accumulators in registers).
  template <int64_t kFirst>
  static void value_rows(const float* value_cache, int64_t block_stride, int64_t token_stride,
                         const int32_t* blocks, int64_t block_size, int64_t kv_max, int64_t n,
                         const float* logits, int64_t stride, float* const* out_rows) {
    constexpr int64_t kCount = std::min(kValueVectors, kVectors - kFirst);
    if (kFirst >= n * kGroup) return;
    __m512 acc[kCount][kChunks];
    for (int64_t v = 0; v < kCount; ++v) {
      for (int64_t c = 0; c < kChunks; ++c) acc[v][c] = _mm512_setzero_ps();
    }
    const float* p = logits + kFirst * stride;
    for (int64_t b = 0; b * block_size < kv_max; ++b) {
      const float* vb = value_cache + blocks[b] * block_stride;
      const int64_t end = std::min(block_size, kv_max - b * block_size);
      for (int64_t i = 0; i < end; ++i) {
        const int64_t t = b * block_size + i;
        const float* row = vb + i * token_stride;
        __m512 x[kChunks];
        for (int64_t c = 0; c < kChunks; ++c) x[c] = _mm512_loadu_ps(row + 16 * c);
        for (int64_t v = 0; v < kCount; ++v) {
          const __m512 pv = _mm512_set1_ps(p[v * stride + t]);
          for (int64_t c = 0; c < kChunks; ++c) acc[v][c] = _mm512_fmadd_ps(pv, x[c], acc[v][c]);
        }
      }
    }
    for (int64_t v = 0; v < kCount && (kFirst + v) / kGroup < n; ++v) {
      for (int64_t c = 0; c < kChunks; ++c) {
        _mm512_storeu_ps(out_rows[kFirst + v] + 16 * c, acc[v][c]);
      }
    }
    if constexpr (kFirst + kCount < kVectors) {
      value_rows<kFirst + kCount>(value_cache, block_stride, token_stride, blocks, block_size,
                                  kv_max, n, logits, stride, out_rows);
    }
  }
};

using TileFn = void (*)(const float*, const float*, const float*, int64_t, int64_t,
                        const int32_t*, int64_t, int64_t, int64_t, float*, int64_t,
                        float* const*);

struct TileShape {
  TileFn fn;
  int64_t rows;  // query rows per tile (0: no tiled variant for this shape)
};

template <int64_t kHeadSize>
TileShape tile_for_group(int64_t group) {
  switch (group) {
    case 1: return {PrefillTile<kHeadSize, 1>::run, PrefillTile<kHeadSize, 1>::kRows};
    case 2: return {PrefillTile<kHeadSize, 2>::run, PrefillTile<kHeadSize, 2>::kRows};
    case 3: return {PrefillTile<kHeadSize, 3>::run, PrefillTile<kHeadSize, 3>::kRows};
    case 4: return {PrefillTile<kHeadSize, 4>::run, PrefillTile<kHeadSize, 4>::kRows};
    case 8: return {PrefillTile<kHeadSize, 8>::run, PrefillTile<kHeadSize, 8>::kRows};
    default: return {nullptr, 0};
  }
}

TileShape pick_tile(int64_t head_size, int64_t group) {
  switch (head_size) {
    case 32: return tile_for_group<32>(group);
    case 64: return tile_for_group<64>(group);
    case 128: return tile_for_group<128>(group);
    default: return {nullptr, 0};
  }
}
#endif

// Query rows per prefill tile of a float32 step (0: no tiled variant for this shape or build).
int64_t prefill_tile_rows(int64_t head_size, int64_t group) {
#if defined(__AVX512F__)
  return pick_tile(head_size, group).rows;
#else
  return 0;
#endif
}

// The query length from which a request's rows go through the tiles rather than the row walk
// (INT64_MAX: no tiled variant for this dtype and shape): half a tile, where the tile's wasted
// rows cost less than the walk's extra work on the real ones.
template <typename T>
int64_t tile_min_query_len(int64_t head_size, int64_t group) {
  const int64_t rows = std::is_same_v<T, float> ? prefill_tile_rows(head_size, group) : 0;
  return rows == 0 ? std::numeric_limits<int64_t>::max() : std::max<int64_t>(2, rows / 2);
}

// The rows of requests whose query is [min_query_len, max_query_len] tokens long, in tiles.
// Items (tile, kv head) are taken longest first from a shared counter, so that the threads end
// together although the last tiles of a long prompt see far more keys than its first.
template <typename T>
void attend_tiles(const PagedStep<T>& step, int64_t min_query_len, int64_t max_query_len) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const int64_t group = step.num_heads / step.num_kv_heads;
    const TileShape shape = pick_tile(step.head_size, group);
    if (shape.rows == 0) return;
    struct Tile {
      int64_t req, row0, n, first_kv_len;
    };
    std::vector<Tile> tiles;
    int64_t max_kv = 0;
    for (int64_t r = 0; r < step.num_reqs; ++r) {
      const int64_t query_len = step.query_start_loc[r + 1] - step.query_start_loc[r];
      if (query_len < min_query_len || query_len > max_query_len) continue;
      const int64_t context = step.seq_lens[r] - query_len;
      for (int64_t row0 = 0; row0 < query_len; row0 += shape.rows) {
        tiles.push_back({r, row0, std::min(shape.rows, query_len - row0), context + row0 + 1});
      }
      max_kv = std::max<int64_t>(max_kv, step.seq_lens[r]);
    }
    if (tiles.empty()) return;
    std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) {
      return a.first_kv_len + a.n > b.first_kv_len + b.n;
    });
    const int64_t num_items = static_cast<int64_t>(tiles.size()) * step.num_kv_heads;
    const int64_t vectors = shape.rows * group;
    const int64_t stride = (max_kv + 15) / 16 * 16;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      std::vector<float> qt(vectors * step.head_size), logits(vectors * stride);
      std::vector<float*> out_rows(vectors);
      for (int64_t item = next.fetch_add(1); item < num_items; item = next.fetch_add(1)) {
        const Tile& tile = tiles[item / step.num_kv_heads];
        const int64_t kvh = item % step.num_kv_heads;
        std::fill(qt.begin(), qt.end(), 0.f);
        for (int64_t i = 0; i < tile.n; ++i) {
          const int64_t tok = step.query_start_loc[tile.req] + tile.row0 + i;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t head = kvh * group + g;
            const float* qh = step.q + tok * step.q_stride_tok + head * step.q_stride_head;
            float* dst = qt.data() + (i * group + g) * step.head_size;
            for (int64_t d = 0; d < step.head_size; ++d) dst[d] = qh[d] * step.scale;
            out_rows[i * group + g] =
                step.out + tok * step.out_stride_tok + head * step.out_stride_head;
          }
        }
        shape.fn(qt.data(), step.key_cache + kvh * step.head_size,
                 step.value_cache + kvh * step.head_size, step.block_stride, step.token_stride,
                 step.block_table + tile.req * step.block_table_stride, step.block_size,
                 tile.first_kv_len, tile.n, logits.data(), stride, out_rows.data());
      }
    });
  }
#endif
}

void check_common(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu(), "kv_cache must be on the CPU");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
}

// out[T, H, D] = causal attention of query[T, H, D] over the paged cache, for the rows of
// requests whose query is at most max_query_len long; other rows, and rows past
// query_start_loc[num_reqs], are left untouched.
void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_table, double scale, int64_t max_query_len,
                     at::Tensor& out) {
  check_common(kv_cache);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, H, D], D contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1, "out must be like query");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() &&
                  out.scalar_type() == kv_cache.scalar_type(),
              "query, out and kv_cache must share a dtype");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "query_start_loc and seq_lens must be contiguous int32");
  }
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table must be int32 with contiguous rows");
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1, "query_start_loc must be [num_reqs + 1]");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) >= num_reqs,
              "block_table must be [num_reqs, max_blocks]");
  const int64_t num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_size, "kv_cache head_size must equal query's");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t num_tokens = num_reqs == 0 ? 0 : query_start_loc.const_data_ptr<int32_t>()[num_reqs];
  TORCH_CHECK(num_tokens <= query.size(0), "query_start_loc goes past the query rows");
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  for (int64_t r = 0; r < num_reqs; ++r) {
    TORCH_CHECK((lens[r] + block_size - 1) / block_size <= block_table.size(1),
                "block_table is too narrow for seq_lens[", r, "] = ", lens[r]);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, query.scalar_type(), "fleetserve_cpu_paged_attention", [&] {
        const scalar_t* cache = kv_cache.const_data_ptr<scalar_t>();
        const PagedStep<scalar_t> step{
            query.const_data_ptr<scalar_t>(), query.stride(0), query.stride(1), cache,
            cache + kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            query_start_loc.const_data_ptr<int32_t>(), seq_lens.const_data_ptr<int32_t>(),
            block_table.const_data_ptr<int32_t>(), block_table.stride(0),
            out.mutable_data_ptr<scalar_t>(), out.stride(0), out.stride(1), num_reqs,
            num_tokens, num_heads, num_kv_heads, head_size, block_size,
            static_cast<float>(scale)};
        const int64_t min_tile = tile_min_query_len<scalar_t>(head_size, num_heads / num_kv_heads);
        attend_rows(step, max_query_len, min_tile);
        attend_tiles(step, min_tile, max_query_len);
      });
}

// Scatter key/value [T, Hkv, D] into the cache at slot_mapping [T] (int64, -1 = skip).
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping) {
  check_common(kv_cache);
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "key, value and kv_cache must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t row = kv_cache.size(3) * kv_cache.size(4);
  TORCH_CHECK(key.size(0) >= num_tokens && key.size(1) * key.size(2) == row &&
                  value.sizes() == key.sizes(),
              "key and value must be [T, num_kv_heads, head_size] like the cache");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "key and value rows must be contiguous");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t item = kv_cache.element_size();
  const char* k = static_cast<const char*>(key.const_data_ptr());
  const char* v = static_cast<const char*>(value.const_data_ptr());
  char* kc = static_cast<char*>(kv_cache.mutable_data_ptr());
  char* vc = kc + kv_cache.stride(0) * item;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "slot_mapping entry ", slot, " is past the cache");
    std::memcpy(kc + slot * row * item, k + t * key.stride(0) * item, row * item);
    std::memcpy(vc + slot * row * item, v + t * value.stride(0) * item, row * item);
  }
}

// Zero blocks `block_ids` (int64) of every cache in `kv_caches` (contiguous CPU tensors whose
// dim 1 indexes blocks; all of dim 0, K and V, is zeroed): the blocks a step newly allocated.
// Every id is checked before anything is written. One call for all layers instead of an
// index_put per layer; spread over threads only from kZeroGrainBytes a thread, since a
// parallel region after a pause waits for the sleeping workers (about 50 us on a VM) and a
// decode step's few blocks take less than that to zero on one core.
constexpr int64_t kZeroGrainBytes = 256 << 10;

void zero_blocks(at::TensorList kv_caches, const at::Tensor& block_ids) {
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1 &&
                  block_ids.is_contiguous() && block_ids.device().is_cpu(),
              "block_ids must be a contiguous 1-d int64 CPU tensor");
  const int64_t n = block_ids.size(0);
  const int64_t* ids = block_ids.const_data_ptr<int64_t>();
  struct Span {
    char* start;
    int64_t bytes;
  };
  std::vector<Span> spans;
  int64_t total = 0;
  for (const at::Tensor& cache : kv_caches) {
    TORCH_CHECK(cache.device().is_cpu() && cache.dim() >= 2 && cache.is_contiguous(),
                "each kv cache must be a contiguous CPU tensor of at least 2 dims");
    const int64_t num_blocks = cache.size(1), item = cache.element_size();
    const int64_t block_bytes = cache.stride(1) * item, outer_bytes = cache.stride(0) * item;
    char* base = static_cast<char*>(cache.data_ptr());
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < num_blocks, "block id ", ids[i],
                  " is outside the cache's ", num_blocks, " blocks");
      for (int64_t j = 0; j < cache.size(0); ++j) {
        spans.push_back({base + j * outer_bytes + ids[i] * block_bytes, block_bytes});
        total += block_bytes;
      }
    }
  }
  if (spans.empty()) return;
  const int64_t num_spans = static_cast<int64_t>(spans.size());
  const int64_t grain =
      std::max<int64_t>(1, kZeroGrainBytes * num_spans / std::max<int64_t>(1, total));
  at::parallel_for(0, num_spans, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memset(spans[i].start, 0, spans[i].bytes);
  });
}

}  // namespace

TORCH_LIBRARY(fleetserve_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_table, float scale, int max_query_len, Tensor(a!) out) -> ()");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("zero_blocks(Tensor(a!)[] kv_caches, Tensor block_ids) -> ()");
  // Not a tensor op: which shapes the backend may send long prefill chunks to.
  m.def("prefill_tile_rows(int head_size, int group) -> int", &prefill_tile_rows);
}

TORCH_LIBRARY_IMPL(fleetserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("zero_blocks", &zero_blocks);
}
