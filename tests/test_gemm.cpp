// The CPU GEMM (backend/cpu/cpu_gemm.cpp): the same bits for any thread count, and the K-sliced
// A x B^T still the product (against a double-precision reference).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "loom/backend/cpu/cpu_gemm.h"
#include "loom/backend/gemm_panels.h"

namespace {

struct Shape {
  bool ta, tb;
  int64_t m, n, k;
};

std::vector<float> values(int64_t count, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(count));
  for (auto& x : v) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<float>(static_cast<double>(seed >> 11) / 9007199254740992.0 * 2.0 - 1.0);
  }
  return v;
}

std::vector<float> product(const Shape& s, const std::vector<float>& a, const std::vector<float>& b, int threads,
                           float beta, const std::vector<float>& c0) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  std::vector<float> c = c0;
  loom::cpu::gemm_f32(s.ta, s.tb, s.m, s.n, s.k, 0.75f, a.data(), s.ta ? s.m : s.k, b.data(), s.tb ? s.k : s.n, beta,
                      c.data(), s.n);
  omp_set_num_threads(saved);
  return c;
}

// oneDNN's sgemm alone gives other bits on one thread than on two for A x B^T at K = 1024, 1536,
// 2048, 4096, 8192 (cpu_gemm.cpp); the shapes include those, the GPT-2 ones and the other transposes.
TEST(CpuGemm, SameBitsForOneTwoAndFourThreads) {
  const Shape shapes[] = {{false, true, 512, 256, 1024}, {false, true, 64, 768, 8192}, {false, true, 256, 768, 3072},
                          {false, true, 2048, 384, 1536}, {false, true, 100, 200, 2048}, {false, true, 33, 65, 769},
                          {false, false, 256, 768, 3072}, {true, false, 768, 256, 2048}, {false, true, 256, 2304, 768}};
  for (const Shape& s : shapes) {
    const auto a = values(s.m * s.k, 1), b = values(s.k * s.n, 2), c0 = values(s.m * s.n, 3);
    for (const float beta : {0.0f, 1.0f}) {
      const auto one = product(s, a, b, 1, beta, c0);
      EXPECT_EQ(one, product(s, a, b, 2, beta, c0)) << s.m << "x" << s.n << "x" << s.k << " beta " << beta;
      EXPECT_EQ(one, product(s, a, b, 4, beta, c0)) << s.m << "x" << s.n << "x" << s.k << " beta " << beta;
    }
  }
}

// gemm_f32_tiled, the path where oneDNN runs AVX2 kernels (there its own threading gives other
// bits on 3 and 4 threads than on 1 and 2), run on every CPU: 1, 2, 3 and 4 threads give the same
// bits in all four transpose forms, with edge tiles in both dimensions, alpha and beta.
TEST(CpuGemm, TiledSameBitsForOneToFourThreads) {
  const Shape shapes[] = {{false, true, 256, 768, 3072}, {false, false, 300, 700, 500}, {true, false, 768, 256, 256},
                          {true, true, 129, 257, 100}, {false, true, 2048, 384, 1536}, {false, true, 33, 65, 769},
                          {true, false, 8200, 400, 64},    // A^T tall enough for 1024 x 384 tiles, not copied
                          {true, false, 1100, 40, 8000},   // A^T too large to copy (8.8M elements)
                          {false, false, 200, 1024, 300}, {true, false, 300, 512, 200},  // B copied padded
                          {false, false, 150, 8192, 1100}};  // B of 9.0M elements: a padded strip per tile
  for (const Shape& s : shapes) {
    const auto a = values(s.m * s.k, 7), b = values(s.k * s.n, 8), c0 = values(s.m * s.n, 9);
    for (const float beta : {0.0f, 1.0f}) {
      std::vector<std::vector<float>> runs;
      const int saved = omp_get_max_threads();
      for (const int threads : {1, 2, 3, 4}) {
        omp_set_num_threads(threads);
        std::vector<float> c = c0;
        loom::cpu::gemm_f32_tiled(s.ta, s.tb, s.m, s.n, s.k, 0.75f, a.data(), s.ta ? s.m : s.k, b.data(),
                                  s.tb ? s.k : s.n, beta, c.data(), s.n);
        runs.push_back(std::move(c));
      }
      omp_set_num_threads(saved);
      for (size_t r = 1; r < runs.size(); ++r)
        EXPECT_EQ(runs[0], runs[r]) << s.m << "x" << s.n << "x" << s.k << " beta " << beta << " run " << r;
    }
  }
}

// transpose_f32 (the A^T copy of the tiled path): every element lands where the element loop puts
// it, for shapes with and without whole 8 x 8 tiles and 64 x 64 blocks, with padded leading
// dimensions, on 1 and 2 threads; the padding of dst is left alone.
TEST(CpuGemm, TransposeMovesEveryElementToItsPlace) {
  const int64_t shapes[][2] = {{8, 8}, {1, 9}, {9, 1}, {64, 64}, {67, 131}, {130, 72}, {200, 7}, {0, 5}};
  for (const auto& shape : shapes) {
    const int64_t rows = shape[0], cols = shape[1], ld_src = cols + 3, ld_dst = rows + 5;
    const auto src = values(std::max<int64_t>(1, rows * ld_src), 21);
    for (const int threads : {1, 2}) {
      const int saved = omp_get_max_threads();
      omp_set_num_threads(threads);
      std::vector<float> dst(static_cast<size_t>(cols * ld_dst), -7.0f);
      loom::cpu::transpose_f32(src.data(), ld_src, rows, cols, dst.data(), ld_dst);
      omp_set_num_threads(saved);
      int64_t wrong = 0, padding_touched = 0;
      for (int64_t j = 0; j < cols; ++j) {
        for (int64_t p = 0; p < ld_dst; ++p) {
          const float got = dst[static_cast<size_t>(j * ld_dst + p)];
          if (p < rows) wrong += got != src[static_cast<size_t>(p * ld_src + j)];
          else padding_touched += got != -7.0f;
        }
      }
      EXPECT_EQ(wrong, 0) << rows << " x " << cols << " on " << threads << " threads";
      EXPECT_EQ(padding_touched, 0) << rows << " x " << cols << " on " << threads << " threads";
    }
  }
}

// The tiled product is the product in every transpose form: against double precision, within
// the fp32 bound K u (|alpha| max|a||b| K + |beta c|) per element.
TEST(CpuGemm, TiledProductMatchesDoubleReference) {
  // Two tile rows (128 + 22) and columns (256 + 44) in each transpose form; then A^T with 8200
  // rows, which runs in 1024 x 384 tiles without the copy; then B copied with padded rows, whole
  // and (8.5M elements, more than the whole copy's limit) a strip per tile.
  const Shape shapes[] = {{false, false, 150, 300, 200}, {false, true, 150, 300, 200}, {true, false, 150, 300, 200},
                          {true, true, 150, 300, 200}, {true, false, 8200, 400, 64},
                          {false, false, 150, 512, 200}, {true, false, 150, 1024, 100},  // B's rows 512 / 1024 apart: padded
                          {false, false, 20, 8192, 1040}};  // B in padded strips
  for (const Shape& s : shapes) {
    const bool ta = s.ta, tb = s.tb;
    {
      const auto a = values(s.m * s.k, 10), b = values(s.k * s.n, 11), c0 = values(s.m * s.n, 12);
      std::vector<float> c = c0;
      loom::cpu::gemm_f32_tiled(ta, tb, s.m, s.n, s.k, 0.75f, a.data(), ta ? s.m : s.k, b.data(), tb ? s.k : s.n, 0.5f,
                                c.data(), s.n);
      double worst = 0.0;
      for (int64_t i = 0; i < s.m; ++i) {
        for (int64_t j = 0; j < s.n; ++j) {
          double ref = 0.5 * c0[static_cast<size_t>(i * s.n + j)];
          for (int64_t p = 0; p < s.k; ++p) {
            const double av = ta ? a[static_cast<size_t>(p * s.m + i)] : a[static_cast<size_t>(i * s.k + p)];
            const double bv = tb ? b[static_cast<size_t>(j * s.k + p)] : b[static_cast<size_t>(p * s.n + j)];
            ref += 0.75 * av * bv;
          }
          worst = std::max(worst, std::abs(ref - c[static_cast<size_t>(i * s.n + j)]));
        }
      }
      EXPECT_LT(worst, static_cast<double>(s.k) * 6e-8 * 2.0) << "ta " << ta << " tb " << tb << " m " << s.m;
      EXPECT_GT(worst, 0.0) << "ta " << ta << " tb " << tb;
    }
  }
}

// gemm_bf16 in every transpose form, with padded leading dimensions and row lengths that are not
// a multiple of 8 (the AVX2 fallback widens 8 values at a time, on the threads from 64Ki values
// on): the products of the bf16 values accumulated in fp32, against double precision within
// K u max|a||b| per element (the products are exact in fp32; only the sums round).
TEST(CpuGemm, Bf16ProductIsTheProductOfTheBf16Values) {
  const Shape shapes[] = {{false, false, 37, 29, 83}, {false, true, 37, 29, 83}, {true, false, 37, 29, 83},
                          {true, true, 37, 29, 83}, {false, true, 300, 260, 301}, {true, false, 301, 260, 300}};
  auto to_bf16 = [](const std::vector<float>& v) {
    std::vector<uint16_t> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, &v[i], sizeof bits);
      out[i] = static_cast<uint16_t>(bits >> 16);  // truncation: any bf16 values will do
    }
    return out;
  };
  auto value = [](uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return static_cast<double>(f);
  };
  for (const Shape& s : shapes) {
    const int64_t a_rows = s.ta ? s.k : s.m, a_cols = s.ta ? s.m : s.k;
    const int64_t b_rows = s.tb ? s.n : s.k, b_cols = s.tb ? s.k : s.n;
    const int64_t lda = a_cols + 5, ldb = b_cols + 3, ldc = s.n + 2;
    const auto a = to_bf16(values(a_rows * lda, 31)), b = to_bf16(values(b_rows * ldb, 32));
    std::vector<float> c(static_cast<size_t>(s.m * ldc), 0.0f);
    loom::cpu::gemm_bf16(s.ta, s.tb, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), ldc);
    double worst = 0.0;
    for (int64_t i = 0; i < s.m; ++i) {
      for (int64_t j = 0; j < s.n; ++j) {
        double ref = 0.0;
        for (int64_t p = 0; p < s.k; ++p) {
          const double av = value(s.ta ? a[static_cast<size_t>(p * lda + i)] : a[static_cast<size_t>(i * lda + p)]);
          const double bv = value(s.tb ? b[static_cast<size_t>(j * ldb + p)] : b[static_cast<size_t>(p * ldb + j)]);
          ref += av * bv;
        }
        worst = std::max(worst, std::abs(ref - c[static_cast<size_t>(i * ldc + j)]));
      }
    }
    EXPECT_LT(worst, static_cast<double>(s.k) * 6e-8) << s.ta << s.tb << " " << s.m << "x" << s.n << "x" << s.k;
    EXPECT_GT(worst, 0.0) << s.ta << s.tb << " " << s.m << "x" << s.n << "x" << s.k;
  }
}

// Inside a parallel region (attention's tasks) each thread runs its product alone; an A x B with
// B's rows a multiple of 512 floats apart reads a padded copy of B. The copy changes where B's
// values are, not the arithmetic: the same bits as with B stored compactly, and within the fp32
// bound of a double reference.
TEST(CpuGemm, InParallelRegionAliasedBSameBitsAsCompactB) {
  const int64_t m = 64, n = 100, k = 300, ldb = 1024;
  const auto a = values(m * k, 13), b_wide = values(k * ldb, 14);
  std::vector<float> b(static_cast<size_t>(k * n));
  for (int64_t p = 0; p < k; ++p)
    std::memcpy(b.data() + p * n, b_wide.data() + p * ldb, static_cast<size_t>(n) * sizeof(float));
  std::vector<float> c_wide(static_cast<size_t>(2 * m * n)), c(static_cast<size_t>(2 * m * n));
#pragma omp parallel for num_threads(2) schedule(static)
  for (int t = 0; t < 2; ++t) {
    loom::cpu::gemm_f32(false, false, m, n, k, 0.75f, a.data(), k, b_wide.data(), ldb, 0.0f, c_wide.data() + t * m * n, n);
    loom::cpu::gemm_f32(false, false, m, n, k, 0.75f, a.data(), k, b.data(), n, 0.0f, c.data() + t * m * n, n);
  }
  EXPECT_EQ(c_wide, c);
  double worst = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0.0;
      for (int64_t p = 0; p < k; ++p) ref += 0.75 * a[static_cast<size_t>(i * k + p)] * b[static_cast<size_t>(p * n + j)];
      worst = std::max(worst, std::abs(ref - c_wide[static_cast<size_t>(i * n + j)]));
      worst = std::max(worst, std::abs(ref - c_wide[static_cast<size_t>(m * n + i * n + j)]));
    }
  }
  EXPECT_LT(worst, static_cast<double>(k) * 6e-8 * 2.0);
  EXPECT_GT(worst, 0.0);
}

// The sliced product is the product: against double precision, fp32 GEMM error bounds (K u max|a||b|).
TEST(CpuGemm, SlicedProductMatchesDoubleReference) {
  const Shape s{false, true, 37, 29, 2000};  // three slices of 768, 768, 464
  const auto a = values(s.m * s.k, 4), b = values(s.k * s.n, 5), c0 = values(s.m * s.n, 6);
  const auto c = product(s, a, b, 2, 0.5f, c0);
  double worst = 0.0;
  for (int64_t i = 0; i < s.m; ++i) {
    for (int64_t j = 0; j < s.n; ++j) {
      double ref = 0.5 * c0[static_cast<size_t>(i * s.n + j)];
      for (int64_t p = 0; p < s.k; ++p) ref += 0.75 * a[static_cast<size_t>(i * s.k + p)] * b[static_cast<size_t>(j * s.k + p)];
      worst = std::max(worst, std::abs(ref - c[static_cast<size_t>(i * s.n + j)]));
    }
  }
  EXPECT_LT(worst, 2000 * 6e-8 * 2.0);  // K x unit roundoff x (|alpha a b| <= 0.75, plus C): a bound, not a fit
  EXPECT_GT(worst, 0.0);                // fp32 arithmetic, not the double reference
}

}  // namespace

// ---------------------------------------------------------------- gemm_panels.h's plan

namespace {

using loom::GemmPanelLimits;
using loom::GemmPanels;
using loom::GemmPanelShape;
using loom::plan_gemm_panels;

// GPT-2 124M's head at B 16, T 1024: N = 16384 rows, d = 768, V = 50257; bf16 inputs, f32 logits.
constexpr int64_t kRows = 16384, kWidth = 768, kVocab = 50257;

}  // namespace

TEST(GemmPanels, PaddedRowsAreTheSmallest16ByteMultiples) {
  EXPECT_TRUE(loom::row_aligned(8, 2));
  EXPECT_FALSE(loom::row_aligned(50257, 2));
  EXPECT_EQ(loom::padded_row(50257, 2), 50264);
  EXPECT_EQ(loom::padded_row(50257, 4), 50260);
  EXPECT_EQ(loom::padded_row(768, 4), 768);
  EXPECT_EQ(loom::padded_row(1, 8), 2);
}

TEST(GemmPanels, TheHeadsThreeGemmsAreStagedAlongTheirMisalignedRows) {
  const GemmPanelLimits limits;  // 128 MiB panels
  // Forward: logits (N, V) = x (N, d) W^T, W (V, d): C's rows are odd -> panels of C's rows.
  const GemmPanels fwd = plan_gemm_panels({kRows, kVocab, kWidth, false, true, 1, 2, 4}, limits);
  EXPECT_EQ(fwd.dim, GemmPanels::M);
  EXPECT_FALSE(fwd.stage_a);
  EXPECT_TRUE(fwd.stage_c);
  EXPECT_EQ(fwd.ldc_padded, 50260);
  EXPECT_EQ(fwd.rows % GemmPanels::kPanelQuantum, 0);
  EXPECT_LE(fwd.c_scratch_bytes, limits.panel_bytes);
  EXPECT_EQ(fwd.count, (kRows + fwd.rows - 1) / fwd.rows);
  EXPECT_EQ(fwd.rows, 640);  // 128 MiB / (50260 x 4 bytes) = 667 rows, down to a multiple of 64
  // dx (N, d) = dlogits (N, V) W (V, d): A's rows -> panels of A's (and C's) rows, A copied.
  const GemmPanels dx = plan_gemm_panels({kRows, kWidth, kVocab, false, false, 1, 2, 4}, limits);
  EXPECT_EQ(dx.dim, GemmPanels::M);
  EXPECT_TRUE(dx.stage_a);
  EXPECT_FALSE(dx.stage_c);
  EXPECT_EQ(dx.lda_padded, 50264);
  EXPECT_EQ(dx.ldc_padded, kWidth);
  // dW (V, d) = dlogits^T (V, N) x (N, d): A stored (N, V) -> panels along the reduction.
  const GemmPanels dw = plan_gemm_panels({kVocab, kWidth, kRows, true, false, 1, 2, 4}, limits);
  EXPECT_EQ(dw.dim, GemmPanels::K);
  EXPECT_TRUE(dw.stage_a);
  EXPECT_FALSE(dw.stage_c);
  EXPECT_EQ(dw.rows, 1280);  // 128 MiB / (50264 x 2 bytes)
  EXPECT_EQ(dw.count, 13);
}

TEST(GemmPanels, AlignedSmallBatchedOrUnstageableGemmsRunAsTheyAre) {
  const GemmPanelLimits limits;
  // Every row a 16-byte multiple.
  EXPECT_EQ(plan_gemm_panels({kRows, 3072, kWidth, false, true, 1, 2, 4}, limits).dim, GemmPanels::NONE);
  // Decoding's head: one row, too few FLOPs for the copies to pay.
  EXPECT_EQ(plan_gemm_panels({1, kVocab, kWidth, false, true, 1, 2, 4}, limits).dim, GemmPanels::NONE);
  // A batch (attention's strided GEMMs) is not cut.
  EXPECT_EQ(plan_gemm_panels({kRows, kVocab, kWidth, false, true, 2, 2, 4}, limits).dim, GemmPanels::NONE);
  // B's rows odd (a head with an odd width): not staged.
  EXPECT_EQ(plan_gemm_panels({kRows, 4096, 769, false, true, 1, 2, 4}, limits).dim, GemmPanels::NONE);
  // A (k, m) odd while C is odd too: the panels would cut two dimensions.
  EXPECT_EQ(plan_gemm_panels({kVocab, kVocab, kRows, true, false, 1, 2, 4}, limits).dim, GemmPanels::NONE);
  // Few FLOPs per staged byte: k = 8 against C's 4-byte rows.
  EXPECT_EQ(plan_gemm_panels({kRows, kVocab, 8, false, true, 1, 2, 4}, GemmPanelLimits{.min_flops = 0}).dim,
            GemmPanels::NONE);
  // A panel is at least kPanelQuantum rows even when the limit is smaller.
  const GemmPanels tiny = plan_gemm_panels({kRows, kVocab, kWidth, false, true, 1, 2, 4},
                                           GemmPanelLimits{.panel_bytes = 1, .min_flops = 0});
  EXPECT_EQ(tiny.rows, GemmPanels::kPanelQuantum);
  EXPECT_EQ(tiny.count, kRows / GemmPanels::kPanelQuantum);
}
