// The CPU kernel of Backend::bf16_weight_linear (the contract in backend.h): y = beta y +
// x W^T (+ bias) with W bf16 as a checkpoint stores it. A bf16 value is the upper half of an
// f32, so widening is a 16-bit shift (exact); products and sums are f32.
// - Up to kDirectRows input rows (decoding): memory-bound, so each weight row is read once,
//   widened in registers (AVX2: 8 at a time) and multiplied with up to 4 input rows at a time
//   (the row stays in L1 for the next 4), 2 to 4 accumulators per input row (dot_rows). Each output's sum has
//   a fixed order, so results do not depend on the thread count. OpenMP splits the output rows.
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

namespace loom::cpu {
namespace {

constexpr int64_t kDirectRows = 16;
constexpr int64_t kTileRows = 256;
constexpr int64_t kWideRow = 6144;  // columns (24 KiB of f32 input) above which decoding runs dot_4_rows

// 8 bf16 values -> 8 f32 (exact).
inline __m256 widen8(const uint16_t* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

// sums[r] = sum_c x[r, c] w[c] for NR input rows (K apart), U blocks of 8 columns a step, one
// accumulator per (row, block). An FMA's result is ready 4 cycles after it issues, so one row
// needs 4 independent sums (U = 4) for the loop to run at the load rate instead of the FMA
// latency (measured on an 8B model's decode: 2 sums per row read 16.5 GB/s on one core). The
// blocks are added in a fixed order: the result does not depend on the thread count.
template <int NR, int U>
void dot_rows(const float* x, int64_t K, const uint16_t* w, float* sums) {
  __m256 a[NR][U];
  for (int r = 0; r < NR; ++r) {
    for (int u = 0; u < U; ++u) a[r][u] = _mm256_setzero_ps();
  }
  int64_t c = 0;
  for (; c + 8 * U <= K; c += 8 * U) {
    __m256 wv[U];
    for (int u = 0; u < U; ++u) wv[u] = widen8(w + c + 8 * u);
    for (int r = 0; r < NR; ++r) {
      for (int u = 0; u < U; ++u) a[r][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + c + 8 * u), wv[u], a[r][u]);
    }
  }
  for (; c + 8 <= K; c += 8) {
    const __m256 w0 = widen8(w + c);
    for (int r = 0; r < NR; ++r) a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + c), w0, a[r][0]);
  }
  for (int r = 0; r < NR; ++r) {
    __m256 t = a[r][0];
    for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, a[r][u]);
    float s = hsum(t);
    for (int64_t k = c; k < K; ++k) s += x[r * K + k] * bf16_to_f32(bf16{w[k]});
    sums[r] = s;
  }
}

// sums[j] = sum_c x[c] w[j K + c] for 4 weight rows and one input row: each 8 columns of x are
// loaded once for the 4 rows, and the 4 rows' sums are the 4 independent accumulators the FMA
// latency needs. For wide rows only (kWideRow): one row at a time read x from L2 once it no
// longer fit L1 beside the weights (Llama-3-8B's down projection, 14,336 columns, one core:
// 11.7 GB/s of weights, 21 this way), while at 4,096 columns one row at a time reads 29 GB/s
// and this 19 (int_linear_bench --shapes llama8b, 2-core AMD EPYC).
void dot_4_rows(const float* x, int64_t K, const uint16_t* w, float* sums) {
  __m256 a[4];
  for (int j = 0; j < 4; ++j) a[j] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= K; c += 8) {
    const __m256 xv = _mm256_loadu_ps(x + c);
    for (int j = 0; j < 4; ++j) a[j] = _mm256_fmadd_ps(xv, widen8(w + j * K + c), a[j]);
  }
  for (int j = 0; j < 4; ++j) {
    float t = hsum(a[j]);
    for (int64_t k = c; k < K; ++k) t += x[k] * bf16_to_f32(bf16{w[j * K + k]});
    sums[j] = t;
  }
}

void direct(const float* x, const uint16_t* w, float* y, int64_t N, int64_t O, int64_t K, float beta, const float* bias) {
  const auto store = [&](int64_t n, int64_t o, float sum) {
    const float out = bias != nullptr ? sum + bias[o] : sum;
    float& dst = y[n * O + o];
    dst = beta == 0.0f ? out : beta * dst + out;
  };
  if (N == 1 && K > kWideRow) {  // decoding one row of a wide input: 4 weight rows a pass over x
#pragma omp parallel for schedule(static)
    for (int64_t o4 = 0; o4 < O / 4; ++o4) {
      float sums[4];
      dot_4_rows(x, K, w + 4 * o4 * K, sums);
      for (int j = 0; j < 4; ++j) store(0, 4 * o4 + j, sums[j]);
    }
    for (int64_t o = O / 4 * 4; o < O; ++o) {
      float sum;
      dot_rows<1, 4>(x, K, w + o * K, &sum);
      store(0, o, sum);
    }
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < O; ++o) {
    const uint16_t* row = w + o * K;
    for (int64_t n0 = 0; n0 < N; n0 += 4) {
      float sums[4];
      const int64_t nr = std::min<int64_t>(4, N - n0);
      const float* xr = x + n0 * K;
      if (nr == 4) dot_rows<4, 2>(xr, K, row, sums);
      else if (nr == 3) dot_rows<3, 2>(xr, K, row, sums);
      else if (nr == 2) dot_rows<2, 4>(xr, K, row, sums);
      else dot_rows<1, 4>(xr, K, row, sums);
      for (int64_t r = 0; r < nr; ++r) store(n0 + r, o, sums[r]);
    }
  }
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
