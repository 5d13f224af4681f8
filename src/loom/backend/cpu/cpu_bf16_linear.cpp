// The CPU kernel of Backend::bf16_weight_linear (the contract in backend.h): y = beta y +
// x W^T (+ bias) with W bf16 as a checkpoint stores it. A bf16 value is the upper half of an
// f32, so widening is exact; products and sums are f32.
// - Up to kDirectRows input rows (decoding): memory-bound, so each weight row is read once and
//   multiplied with up to 4 input rows at a time (the row stays in L1 for the next 4). The weights
//   are widened without a shuffle: 16 bf16 loaded as eight 32-bit words give the even columns'
//   f32 by a 16-bit left shift and the odd columns' by masking the low half, so the input rows
//   are first copied with each 16-column chunk split into its even and odd columns
//   (split_even_odd). Each output's sum has a fixed order, so results do not depend on the
//   thread count. The short-region team (core/threads.h) splits the output rows.
//   Measured (2-core AMD EPYC, AVX-512 machine running the AVX2 kernel; GB/s of weights read,
//   one row, 2 threads): 4096 x 6144 30 -> 50, 14336 x 4096 20 -> 45; one thread 18 -> 36 and
//   10 -> 34. The widening gives 18 -> 28 and 10 -> 14 (the shuffle, vpmovzxwd, one per 8
//   weights, and its extra micro-ops left fewer loads in flight), the software prefetch the
//   rest: each row's stream is fetched kPrefetch weights (8 KiB) ahead, past the hardware
//   prefetcher's page boundaries, which also hides the L2 latency of a 14,336-column input that
//   no longer fits L1 (for which the kernel used to run 4 weight rows a pass over x).
//   One input row (a single stream's decoding step) reads 4 weight rows at a time again, each
//   fetched ahead as before (dot_weight_rows): on an AMD Zen 3 core (AVX2 only) the single
//   prefetched stream read 16-19 GB/s of weights on one thread and 28-30 on two, four streams
//   24-27 and 37-54, the f32 GEMM's rate (bench/int_linear_bench --shapes llama8b --rows 1,
//   2026-12-07); on the Zen 5 machine above this form is not yet measured.
// - More rows (prefill, evaluation): compute-bound, so tiles of kTileRows weight rows are
//   widened into an f32 buffer and multiplied by the f32 GEMM (cpu_gemm.h) into y's columns;
//   the widened copy is one tile (4 MiB at 4096 columns), never the whole weight.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "loom/backend/checks.h"
#include "loom/backend/cpu/cpu_avx2.h"
#include "loom/backend/cpu/cpu_gemm.h"
#include "loom/backend/cpu/cpu_quant_ops.h"
#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/core/threads.h"

namespace loom::cpu {
namespace {

constexpr int64_t kDirectRows = 16;
constexpr int64_t kTileRows = 256;
constexpr int64_t kChunk = 16;       // bf16 weights in one 256-bit load
constexpr int64_t kPrefetch = 4096;  // weights (8 KiB) a row's stream is fetched ahead

// 8 bf16 values -> 8 f32 (exact), in order: the tiled path's widening.
inline __m256 widen8(const uint16_t* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

// out = x's N rows of K with each whole 16-column chunk stored as its 8 even columns then its 8
// odd ones (the order the shift and mask widen a chunk of weights in); the last K % 16 columns
// as they are.
void split_even_odd(const float* x, int64_t N, int64_t K, float* out) {
  const int64_t whole = K / kChunk * kChunk;
  for (int64_t n = 0; n < N; ++n) {
    const float* src = x + n * K;
    float* dst = out + n * K;
    for (int64_t c = 0; c < whole; c += kChunk) {
      for (int64_t i = 0; i < kChunk / 2; ++i) {
        dst[c + i] = src[c + 2 * i];
        dst[c + kChunk / 2 + i] = src[c + 2 * i + 1];
      }
    }
    std::copy(src + whole, src + K, dst + whole);
  }
}

// sums[r] = sum_c x[r, c] w[c] for NR input rows (K apart, split by split_even_odd), U chunks of
// 16 columns a step. Each (row, chunk of the step, even / odd) has its own accumulator: an FMA's
// result is ready 4 cycles after it issues, so one row needs 4 independent sums (U = 2) for the
// loop to run at the load rate instead of the FMA latency; 3 or 4 rows have enough with U = 1.
// The accumulators are added in a fixed order: the result does not depend on the thread count.
template <int NR, int U>
void dot_rows(const float* xs, int64_t K, const uint16_t* w, float* sums) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 a[NR][2 * U];
  for (int r = 0; r < NR; ++r) {
    for (int u = 0; u < 2 * U; ++u) a[r][u] = _mm256_setzero_ps();
  }
  const auto step = [&](int64_t c, int u) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c));
    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    for (int r = 0; r < NR; ++r) {
      a[r][2 * u] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + r * K + c), even, a[r][2 * u]);
      a[r][2 * u + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + r * K + c + kChunk / 2), odd, a[r][2 * u + 1]);
    }
  };
  int64_t c = 0;
  for (; c + kChunk * U <= K; c += kChunk * U) {
    _mm_prefetch(reinterpret_cast<const char*>(w + c + kPrefetch), _MM_HINT_T0);  // never faults
    for (int u = 0; u < U; ++u) step(c + kChunk * u, u);
  }
  for (; c + kChunk <= K; c += kChunk) step(c, 0);
  for (int r = 0; r < NR; ++r) {
    __m256 t = a[r][0];
    for (int u = 1; u < 2 * U; ++u) t = _mm256_add_ps(t, a[r][u]);
    float s = hsum(t);
    for (int64_t k = c; k < K; ++k) s += xs[r * K + k] * bf16_to_f32(bf16{w[k]});
    sums[r] = s;
  }
}

// sums[j] = sum_c x[c] w_j[c] for R weight rows (K apart) against one input row (split by
// split_even_odd): one input row reads R weight streams at once. On a CPU whose one core keeps
// too few of one stream's cache misses in flight (AMD Zen 3, AVX2) one stream reads 16-19 GB/s of
// weights a core, four 24-27 (the f32 GEMM's rate); each row is still fetched kPrefetch ahead,
// which is what a Zen 5 core needed (see the top of the file) and changed nothing here.
template <int R>
void dot_weight_rows(const float* xs, int64_t K, const uint16_t* w, float* sums) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 a[R][2];  // even and odd columns: 2R chains of FMAs, enough at R = 4 (4 accumulators a row spill)
  for (int j = 0; j < R; ++j) a[j][0] = a[j][1] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + kChunk <= K; c += kChunk) {
    if (c % (2 * kChunk) == 0) {  // one 64-byte line of each row per two chunks
      for (int j = 0; j < R; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * K + c + kPrefetch), _MM_HINT_T0);
    }
    const __m256 xe = _mm256_loadu_ps(xs + c), xo = _mm256_loadu_ps(xs + c + kChunk / 2);
    for (int j = 0; j < R; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + c));
      a[j][0] = _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), a[j][0]);
      a[j][1] = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(v, high)), a[j][1]);
    }
  }
  for (int j = 0; j < R; ++j) {
    float s = hsum(_mm256_add_ps(a[j][0], a[j][1]));
    for (int64_t k = c; k < K; ++k) s += xs[k] * bf16_to_f32(bf16{w[j * K + k]});
    sums[j] = s;
  }
}

void direct(const float* x, const uint16_t* w, float* y, int64_t N, int64_t O, int64_t K, float beta, const float* bias) {
  thread_local std::vector<float> split;  // the calling thread's; the team reads it
  split.resize(static_cast<size_t>(N * K));
  split_even_odd(x, N, K, split.data());
  const float* xs = split.data();
  const auto store = [&](int64_t n, int64_t o, float sum) {
    const float out = bias != nullptr ? sum + bias[o] : sum;
    float& dst = y[n * O + o];
    dst = beta == 0.0f ? out : beta * dst + out;
  };
  if (N == 1) {  // four weight rows a pass (dot_weight_rows)
    short_region(O, [&](int64_t begin, int64_t end) {
      float sums[4];
      int64_t o = begin;
      for (; o + 4 <= end; o += 4) {
        dot_weight_rows<4>(xs, K, w + o * K, sums);
        for (int j = 0; j < 4; ++j) store(0, o + j, sums[j]);
      }
      for (; o < end; ++o) {
        dot_weight_rows<1>(xs, K, w + o * K, sums);
        store(0, o, sums[0]);
      }
    });
    return;
  }
  short_region(O, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint16_t* row = w + o * K;
      for (int64_t n0 = 0; n0 < N; n0 += 4) {
        float sums[4];
        const int64_t nr = std::min<int64_t>(4, N - n0);
        const float* xr = xs + n0 * K;
        if (nr == 4) dot_rows<4, 1>(xr, K, row, sums);
        else if (nr == 3) dot_rows<3, 1>(xr, K, row, sums);
        else if (nr == 2) dot_rows<2, 2>(xr, K, row, sums);
        else dot_rows<1, 2>(xr, K, row, sums);
        for (int64_t r = 0; r < nr; ++r) store(n0 + r, o, sums[r]);
      }
    }
  });
}

void tiled(const float* x, const uint16_t* w, float* y, int64_t N, int64_t O, int64_t K, float beta, const float* bias) {
  std::vector<float> tile(static_cast<size_t>(std::min(kTileRows, O) * K));
  for (int64_t o0 = 0; o0 < O; o0 += kTileRows) {
    const int64_t rows = std::min(kTileRows, O - o0);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* src = w + (o0 + r) * K;
      float* dst = tile.data() + r * K;
      int64_t c = 0;
      for (; c + 8 <= K; c += 8) _mm256_storeu_ps(dst + c, widen8(src + c));
      for (; c < K; ++c) dst[c] = bf16_to_f32(bf16{src[c]});
    }
    gemm_f32(false, true, N, rows, K, 1.0f, x, K, tile.data(), K, beta, y + o0, O);
  }
  if (bias == nullptr) return;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < O; ++o) y[n * O + o] += bias[o];
  }
}

}  // namespace

void bf16_weight_linear(const Tensor& x, const Tensor& w, const Tensor& y, float beta, const Tensor* bias) {
  const int64_t N = checks::check_bf16_weight_linear(x, w, y, bias);
  const int64_t O = w.dim(0), K = w.dim(1);
  if (N == 0 || O == 0) return;
  const float* b = bias != nullptr ? bias->data<float>() : nullptr;
  const uint16_t* wp = static_cast<const uint16_t*>(w.raw_data());
  if (N <= kDirectRows) direct(x.data<float>(), wp, y.data<float>(), N, O, K, beta, b);
  else tiled(x.data<float>(), wp, y.data<float>(), N, O, K, beta, b);
}

}  // namespace loom::cpu
