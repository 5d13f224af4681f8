#include "loom/backend/cpu/cpu_gemm.h"

#include <oneapi/dnnl/dnnl.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "loom/core/error.h"

// Exported by oneDNN 2.x (libdnnl.so) but not declared in its dnnl.h: row-major
// C = alpha op(A) op(B) + beta C with bf16 A and B (raw 16-bit patterns), fp32 accumulation
// and output. It uses the CPU's AVX-512 BF16 dot products (vdpbf16ps) where present.
extern "C" dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M, dnnl_dim_t N, dnnl_dim_t K,
                                               float alpha, const uint16_t* A, dnnl_dim_t lda, const uint16_t* B,
                                               dnnl_dim_t ldb, float beta, float* C, dnnl_dim_t ldc);

namespace loom::cpu {

namespace {

// buffer with room for `count` floats (it grows to the largest request and stays): the per-thread
// copies below, so that a training step allocates nothing after its first.
float* sized(std::vector<float>& buffer, int64_t count) {
  if (buffer.size() < static_cast<size_t>(count)) buffer.resize(static_cast<size_t>(count));
  return buffer.data();
}

}  // namespace

void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
               const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const dnnl_status_t status = dnnl_gemm_bf16bf16f32(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b,
                                                     ldb, beta, c, ldc);
  if (status == dnnl_unimplemented) {
    // A CPU without AVX-512 (oneDNN 2.x has no bf16 GEMM for AVX2): widen A and B to fp32, which
    // is exact, and run sgemm. The products of two bf16 values are exact in fp32, so this is
    // still bf16 products accumulated in fp32; only the summation order is the library's. The
    // widened copies live in per-thread buffers that grow to the largest shape once.
    // The widening runs on the threads (one thread inside a parallel region: attention's tasks),
    // 8 values per instruction: one thread's scalar loop was 16% of a GPT-2 124M bf16 step on
    // the AVX2 machine, the other thread waiting.
    thread_local std::vector<float> wa, wb;
    auto widen = [](const uint16_t* src, int64_t rows, int64_t cols, int64_t ld, std::vector<float>& dst) {
      float* out = sized(dst, rows * ld);
#pragma omp parallel for schedule(static) if (rows * cols >= (1 << 16))
      for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* in_row = src + r * ld;
        float* out_row = out + r * ld;
        int64_t j = 0;
        for (; j + 8 <= cols; j += 8) {
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in_row + j));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_row + j), _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        for (; j < cols; ++j) {
          const uint32_t bits = static_cast<uint32_t>(in_row[j]) << 16;
          std::memcpy(out_row + j, &bits, sizeof(float));
        }
      }
    };
    widen(a, trans_a ? k : m, trans_a ? m : k, lda, wa);
    widen(b, trans_b ? n : k, trans_b ? k : n, ldb, wb);
    gemm_f32(trans_a, trans_b, m, n, k, alpha, wa.data(), lda, wb.data(), ldb, beta, c, ldc);
    return;
  }
  LOOM_CHECK(status == dnnl_success, "oneDNN bf16 gemm failed with status ", static_cast<int>(status), " for M=", m,
             " N=", n, " K=", k);
}

// oneDNN 2.6's sgemm takes another path on one thread than on several for A x B^T (trans_b
// only) when K > 768 or alpha != 1, and its last bits differ (measured: K = 1024, 1100, 1536,
// 2048, 4096, 5000, 8192 at alpha 1, and every K at alpha 0.75, differ between 1 and 2 threads;
// 2, 3 and 4 threads agree; the other transposes and the bf16 GEMM agree for every thread count).
// So that a run gives the same bits on any number of threads, such a GEMM is computed as
// T = op(A) op(B) with alpha 1 in K slices of at most 768 accumulated in order (beta 1 after the
// first slice), and C = alpha T + beta C by an elementwise pass where alpha != 1 or beta != 0
// (T in a per-thread buffer). Tested on 1, 2 and 4 threads (tests/test_gemm.cpp); neutral in
// speed on the GPT-2 shapes (0.96-1.03x per shape).
//
// That holds for oneDNN's AVX-512 kernels. On a CPU with AVX2 only (measured on an AMD Zen 3),
// its sgemm chooses between copy and no-copy kernels and splits the work by the thread count,
// and 3 or 4 threads give other bits than 1 and 2 in every transpose form, at any K. There Loom
// splits C itself (gemm_f32_tiled): fixed tiles of 128 x 256, each a whole oneDNN call on one
// thread, so each element is computed the same way whichever thread count runs the tiles.
constexpr int64_t kThreadStableK = 768;

namespace {

void sgemm_checked(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                   const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const dnnl_status_t status = dnnl_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  LOOM_CHECK(status == dnnl_success, "oneDNN sgemm failed with status ", static_cast<int>(status), " for M=", m,
             " N=", n, " K=", k);
}

// Whether oneDNN runs kernels of `isa` or a later one here: the CPU has them and
// DNNL_MAX_CPU_ISA does not cap them (oneDNN's ISA values are nested bit masks).
bool dnnl_runs(dnnl_cpu_isa_t isa) {
  return (static_cast<unsigned>(dnnl_get_effective_cpu_isa()) & static_cast<unsigned>(isa)) == static_cast<unsigned>(isa);
}

// Whether oneDNN runs its AVX-512 (avx512_core or later) kernels here. Fixed for the process.
bool dnnl_runs_avx512() {
  static const bool avx512 = dnnl_runs(dnnl_cpu_isa_avx512_core);
  return avx512;
}

// Tiles of C for gemm_f32_tiled: 128 x 256 kept oneDNN's AVX2 kernels within noise of its own
// threading on the GPT-2 shapes (2 threads, 256 and 2048 rows) and gives 6 or more tiles to
// spread over the threads on all but the smallest products.
constexpr int64_t kTileRows = 128, kTileCols = 256;
constexpr int64_t kTallRows = 8192;       // op(A) = A^T with at least this many rows: not copied (below)
constexpr int64_t kMaxCopy = 8 << 20;     // nor one of more elements than this (32 MiB)
constexpr int64_t kUncopiedTileRows = 1024, kUncopiedTileCols = 384;  // the tiles of an uncopied A^T
constexpr int64_t kAliasedRowFloats = 512;  // B with rows a multiple of this apart is copied padded (below)
constexpr int64_t kRowPadFloats = 16;       // by this much (64 bytes)

// dst[i][p] = src[p][i] for 8 x 8 floats (rows of src ld_src apart, of dst ld_dst apart): eight
// row loads, the 4-stage unpack / shuffle / lane-permute network of AVX (Intel's optimization
// manual, "matrix transposition" with 256-bit registers), eight row stores. A permutation, so exact.
inline void transpose_8x8(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld_src);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // a0 b0 a1 b1 | a4 b4 a5 b5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // a2 b2 a3 b3 | a6 b6 a7 b7
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);      // a0 b0 c0 d0 | a4 b4 c4 d4
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);  // a1 b1 c1 d1 | a5 b5 c5 d5
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ld_dst, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ld_dst, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// dst = src, `rows` rows of `cols` floats (src's rows ld_src apart, dst's ld_dst): the padded
// copies of an aliasing B. On the threads, or on this one (inside a tile or a parallel region).
void copy_rows(const float* src, int64_t ld_src, int64_t rows, int64_t cols, float* dst, int64_t ld_dst, bool threads) {
#pragma omp parallel for schedule(static) if (threads)
  for (int64_t p = 0; p < rows; ++p) std::memcpy(dst + p * ld_dst, src + p * ld_src, static_cast<size_t>(cols) * sizeof(float));
}

// Whether op(B) = B (k x n, rows ldb apart) has rows a multiple of 512 floats apart, which
// oneDNN's single-threaded AVX2 sgemm runs at half the rate or less (gemm_f32_tiled).
bool b_rows_alias(bool trans_b, int64_t k, int64_t ldb) { return !trans_b && k > 0 && ldb % kAliasedRowFloats == 0; }

// Such a B of at most kMaxCopy elements with its padding: copied into `buffer` with its rows
// kRowPadFloats further apart (on the threads or on this one), and b, ldb then name the copy.
// Returns whether it copied.
bool copy_aliasing_b(bool trans_b, int64_t k, int64_t n, const float*& b, int64_t& ldb, std::vector<float>& buffer,
                     bool threads) {
  const int64_t ld = n + kRowPadFloats;
  if (!b_rows_alias(trans_b, k, ldb) || k * ld > kMaxCopy) return false;
  float* dst = sized(buffer, k * ld);
  copy_rows(b, ldb, k, n, dst, ld, threads);
  b = dst;
  ldb = ld;
  return true;
}

}  // namespace

// The revision of the CPU GEMM path, part of gemm_kernels() and so of the GEMM peak cache's key:
// raised whenever a change here may change its speed. r2: the A^T copy in register tiles and the
// bf16 fallback's widening on the threads; r3: B with aliasing rows copied padded (2026-11-29);
// r4: such a B also when larger than kMaxCopy (a strip per tile) and inside parallel regions.
constexpr int kGemmRevision = 4;

std::string gemm_kernels(bool bf16) {
  const bool avx512 = dnnl_runs_avx512();
  const std::string path = avx512 ? "oneDNN's AVX-512 kernels, its own threads" : "oneDNN's AVX2 kernels in 128 x 256 tiles";
  std::string s;
  if (!bf16) {
    s = "oneDNN sgemm, " + path;
  } else if (avx512) {
    s = dnnl_runs(dnnl_cpu_isa_avx512_core_bf16) ? "oneDNN bf16 GEMM on AVX-512 BF16 dot products" : "oneDNN bf16 GEMM, AVX-512 without BF16 instructions (emulated)";
  } else {
    s = "bf16 widened to fp32 for oneDNN sgemm (no bf16 GEMM without AVX-512: bf16 numerics at fp32 speed), " + path;
  }
  return s + " (cpu gemm r" + std::to_string(kGemmRevision) + ")";
}

void transpose_f32(const float* src, int64_t ld_src, int64_t rows, int64_t cols, float* dst, int64_t ld_dst) {
  // Blocks of 64 x 64 (16 KiB in, 16 KiB out: both in L1 while the block is transposed) in 8 x 8
  // register tiles; the edges of a block not a multiple of 8 element by element. Measured on
  // the AVX2 machine (2 threads): 2048 x 1152 in 0.9 ms against 2.5 ms for an element loop.
  constexpr int64_t kBlock = 64;
#pragma omp parallel for schedule(static)
  for (int64_t j0 = 0; j0 < cols; j0 += kBlock) {
    const int64_t j1 = std::min(cols, j0 + kBlock);
    for (int64_t p0 = 0; p0 < rows; p0 += kBlock) {
      const int64_t p1 = std::min(rows, p0 + kBlock);
      int64_t j = j0;
      for (; j + 8 <= j1; j += 8) {
        int64_t p = p0;
        for (; p + 8 <= p1; p += 8) transpose_8x8(src + p * ld_src + j, ld_src, dst + j * ld_dst + p, ld_dst);
        for (; p < p1; ++p) {
          for (int64_t jj = j; jj < j + 8; ++jj) dst[jj * ld_dst + p] = src[p * ld_src + jj];
        }
      }
      for (; j < j1; ++j) {
        for (int64_t p = p0; p < p1; ++p) dst[j * ld_dst + p] = src[p * ld_src + j];
      }
    }
  }
}

void gemm_f32_tiled(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                    int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  // op(A) = A^T: A is copied transposed first (an exact copy), so the tiles multiply N x op(B).
  // On oneDNN's AVX2 kernels a tile of A^T x B takes its slow no-copy path (half the rate at
  // 3072 x 768 x 256); the copy costs O(m k) against the product's O(m n k). Its buffer is the
  // calling thread's and grows to the largest A once (no allocation in a training step after
  // the first).
  // Where A^T has many rows (the head's weight gradient: a row per token of the vocabulary),
  // the copy would be the size of the logits; there A^T x B runs in tiles of 1024 x 384 instead,
  // large enough that oneDNN takes its copy-based kernels for them (as fast as its own threading
  // on 50257 x 384 x 2048 and 50257 x 768 x 256). So does an A larger than kMaxCopy elements,
  // which would otherwise stay held by the thread's buffer for the rest of the run.
  const bool copy_a = trans_a && k > 0 && m < kTallRows && m * k <= kMaxCopy;
  const bool uncopied_a_t = trans_a && !copy_a;
  const int64_t tile_rows = uncopied_a_t ? kUncopiedTileRows : kTileRows;
  const int64_t tile_cols = uncopied_a_t ? kUncopiedTileCols : kTileCols;
  thread_local std::vector<float> a_t;
  if (copy_a) {
    float* dst = sized(a_t, m * k);  // the calling thread's buffer (a_t names another one in each worker)
    transpose_f32(a, lda, k, m, dst, k);
    a = dst;
    lda = k;
    trans_a = false;
  }
  // op(B) = B with rows a multiple of 512 floats (2 KiB) apart: a tile's single-threaded call then
  // reads a 256-column strip of B whose rows fall into the same few L1 sets, and runs at half the
  // rate or less (measured on the AVX2 machine, 2048 x n x 2048 A x B: n = 1024, 2048, 3072, 4096
  // at 80-83 GFLOP/s against 148-174 with the rows 16 floats further apart; n = 1536 121 against
  // 167; GPT-2 124M's input gradient of the MLP's down projection, 256 x 3072 x 768, 77 against
  // 149). Such a B is copied with its rows padded by 16 floats first (O(k n) against O(m n k); the
  // calling thread's buffer, as for A^T). A B of more than kMaxCopy elements (a Llama-size
  // layer's weight: 4096 x 14336) is copied a strip at a time instead, by the thread that runs
  // the tile, into its own buffer of k x 272 floats (up to kMaxCopy elements, so k <= 30840); the
  // tiles then go strip by strip, so that a thread's next tile mostly reads the strip it already
  // holds (2048 x 4096 x 4096: 138 GFLOP/s uncopied against 164 with padded rows).
  thread_local std::vector<float> b_padded;
  const int64_t ld_strip = tile_cols + kRowPadFloats;
  const bool aliasing = b_rows_alias(trans_b, k, ldb);
  const bool copied_b = copy_aliasing_b(trans_b, k, n, b, ldb, b_padded, true);  // whole, where it fits
  const bool strips_b = aliasing && !copied_b && k * ld_strip <= kMaxCopy;
  const int64_t tiles_m = (m + tile_rows - 1) / tile_rows, tiles_n = (n + tile_cols - 1) / tile_cols;
  int worst = dnnl_success;  // the largest status of any tile (oneDNN's errors are positive)
#pragma omp parallel reduction(max : worst)
  {
    float* strip = strips_b ? sized(b_padded, k * ld_strip) : nullptr;  // this thread's b_padded
    int64_t held = -1;                                                   // the strip of B it holds
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tiles_m * tiles_n; ++t) {
      // Row by row of tiles, or strip by strip where each strip is copied.
      const int64_t ti = strips_b ? t % tiles_m : t / tiles_n, tj = strips_b ? t / tiles_m : t % tiles_n;
      const int64_t i0 = ti * tile_rows, j0 = tj * tile_cols;
      const int64_t rows = std::min(tile_rows, m - i0), cols = std::min(tile_cols, n - j0);
      const float* at = trans_a ? a + i0 : a + i0 * lda;
      const float* bt = trans_b ? b + j0 * ldb : b + j0;
      int64_t ldbt = ldb;
      if (strips_b) {
        if (held != tj) copy_rows(bt, ldb, k, cols, strip, ld_strip, false);
        held = tj;
        bt = strip;
        ldbt = ld_strip;
      }
      const dnnl_status_t status = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', rows, cols, k, alpha, at, lda,
                                              bt, ldbt, beta, c + i0 * ldc + j0, ldc);
      worst = std::max(worst, static_cast<int>(status));
    }
  }
  LOOM_CHECK(worst == dnnl_success, "oneDNN sgemm failed with status ", worst, " for M=", m, " N=",
             n, " K=", k);
}

namespace {

void gemm_f32_library_threads(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                              const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                              int64_t ldc) {
  if (trans_a || !trans_b || k == 0) {
    sgemm_checked(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  // A x B^T: the product with alpha 1 in slices of K, into C itself or into T.
  const bool direct = alpha == 1.0f && beta == 0.0f;
  thread_local std::vector<float> scratch;
  float* t = direct ? c : sized(scratch, m * n);
  const int64_t ldt = direct ? ldc : n;
  for (int64_t k0 = 0; k0 < k; k0 += kThreadStableK) {
    sgemm_checked('N', 'T', m, n, std::min(kThreadStableK, k - k0), 1.0f, a + k0, lda, b + k0, ldb,
                  k0 == 0 ? 0.0f : 1.0f, t, ldt);
  }
  if (direct) return;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    const float* ti = t + i * ldt;
    if (beta == 0.0f) {
      for (int64_t j = 0; j < n; ++j) ci[j] = alpha * ti[j];
    } else {
      for (int64_t j = 0; j < n; ++j) ci[j] = alpha * ti[j] + beta * ci[j];
    }
  }
}

}  // namespace

void gemm_f32(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (dnnl_runs_avx512()) {
    gemm_f32_library_threads(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else if (omp_in_parallel()) {
    // Inside a parallel region (attention's tasks) oneDNN runs the whole product on this
    // thread, the same bits whatever the thread count; tiles would only add calls. An A x B
    // whose B rows alias (P V with V's rows 4096 or 6144 floats apart in a Llama-size qkv:
    // 64 x 128 x 512 at 76 GFLOP/s against 89 padded) reads B from a padded copy on this thread.
    thread_local std::vector<float> b_padded;
    if (!trans_a) copy_aliasing_b(trans_b, k, n, b, ldb, b_padded, false);
    sgemm_checked(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    gemm_f32_tiled(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

void gemm_f64(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
              int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = trans_a ? a[p * lda + i] : a[i * lda + p];
        const double bv = trans_b ? b[j * ldb + p] : b[p * ldb + j];
        acc += av * bv;
      }
      c[i * ldc + j] = alpha * acc + (beta == 0.0 ? 0.0 : beta * c[i * ldc + j]);
    }
  }
}

}  // namespace loom::cpu
