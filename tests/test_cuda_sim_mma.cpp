// The tensor-core MMA primitive (cuda_mma.h) and FlashAttention-2 on tensor cores
// (cuda_flash_mma.cu) on the CUDA simulator, where mma.sync is the scalar twin built from warp
// shuffles. Each property has a broken variant that the same check rejects.
//
// Tolerances:
// - One m16n8k16 product: the twin's result is bitwise the fp32 sum "C first, then the 16 exact
//   bf16 x bf16 products in k order", and within 17 u sum(|C| + |a_k b_k|) (u = 2^-24, 16
//   roundings of fp32 additions plus slack) of the exact (double) product.
// - Attention: Q, K, V, P (and dO, dS) are rounded to bf16 (relative error <= 2^-9 each, one
//   bf16 ulp is 2^-8 relative), so outputs and gradients are compared with exact attention in
//   double by max |x - ref| <= 2e-2 max |ref| per tensor (lse: absolute 2e-2; it is O(log T)).
//   A missing causal mask misses that by far.
// This file is compiled with the simulator's instrumentation (tests/CMakeLists.txt), so the
// kernels here run under memcheck, racecheck, synccheck and initcheck; each test also asserts
// that no check fired (the suite-wide listener skips CudaSim* suites).
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "loom/backend/cuda/cuda_flash_mma.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/backend/cuda/cuda_mma.h"
#include "loom/backend/cuda/sim/sim_runtime.h"
#include "loom/core/dtype.h"
#include "loom/core/error.h"

namespace loom {
namespace {

using cuda::launch;
namespace mma = cuda::mma;

float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// ---------------------------------------------------------------- device memory helpers
class DeviceBuffers {
 public:
  ~DeviceBuffers() {
    for (void* p : ptrs_) (void)cudaFree(p);
  }
  float* floats(size_t n, const std::vector<float>* init = nullptr) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(float)), cudaSuccess);
    ptrs_.push_back(p);
    if (init) {
      EXPECT_EQ(cudaMemcpy(p, init->data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    } else {
      EXPECT_EQ(cudaMemset(p, 0xff, n * sizeof(float)), cudaSuccess);  // NaN: every output must be written
    }
    return static_cast<float*>(p);
  }
  static std::vector<float> read(const float* p, size_t n) {
    std::vector<float> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }

 private:
  std::vector<void*> ptrs_;
};

void expect_no_report() {
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << sim::last_report();
  EXPECT_EQ(sim::last_report(), "");
}

// ---------------------------------------------------------------- the primitive
// One warp: loads A (16 x 16, row-major), B (16 x 8, row-major k x n) and C (16 x 8) into
// fragments per the PTX layout (through cuda_mma.h's index math), runs the MMA, stores D.
// The broken variant swaps A's registers 1 and 2 (taking a[1] for the columns + 8 rather than
// the rows + 8).
template <bool kBroken>
__global__ void mma_tile_kernel(const float* a, const float* b, const float* c, float* d) {
  const int lane = static_cast<int>(threadIdx.x);
  uint32_t af[4], bf[2];
  float cf[4], df[4];
  for (int j = 0; j < 4; ++j) {
    const int src = kBroken && (j == 1 || j == 2) ? 3 - j : j;  // register src's elements
    const int r = mma::a_row(lane, 2 * src), col = mma::a_col(lane, 2 * src);
    af[j] = mma::pack_bf16x2(a[r * 16 + col], a[r * 16 + col + 1]);
  }
  for (int j = 0; j < 2; ++j) {
    const int n = mma::b_col(lane, 2 * j);
    bf[j] = mma::pack_bf16x2(b[mma::b_row(lane, 2 * j) * 8 + n], b[mma::b_row(lane, 2 * j + 1) * 8 + n]);
  }
  for (int i = 0; i < 4; ++i) cf[i] = c[mma::c_row(lane, i) * 8 + mma::c_col(lane, i)];
  mma::mma_m16n8k16_bf16(df, af, bf, cf);
  for (int i = 0; i < 4; ++i) d[mma::c_row(lane, i) * 8 + mma::c_col(lane, i)] = df[i];
}

struct MmaCase {
  std::vector<float> a, b, c;
};

MmaCase random_mma_case(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  MmaCase m;
  for (int i = 0; i < 16 * 16; ++i) m.a.push_back(round_bf16(u(rng)));
  for (int i = 0; i < 16 * 8; ++i) m.b.push_back(round_bf16(u(rng)));
  for (int i = 0; i < 16 * 8; ++i) m.c.push_back(u(rng));
  return m;
}

template <bool kBroken>
std::vector<float> run_mma(const MmaCase& m) {
  DeviceBuffers buf;
  float* a = buf.floats(m.a.size(), &m.a);
  float* b = buf.floats(m.b.size(), &m.b);
  float* c = buf.floats(m.c.size(), &m.c);
  float* d = buf.floats(16 * 8);
  launch<mma_tile_kernel<kBroken>>(1, 32, 0, nullptr, a, b, c, d);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  expect_no_report();
  return DeviceBuffers::read(d, 16 * 8);
}

TEST(CudaSimMma, PackRoundsToNearestEven) {
  // 1 + 2^-8 is halfway between bf16 1 and 1 + 2^-7: to even (1); 1 + 3 2^-8: to even (1 + 2^-6).
  const uint32_t r = mma::pack_bf16x2(1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f);
  EXPECT_EQ(r & 0xffffu, 0x3f80u);
  EXPECT_EQ(r >> 16, 0x3f82u);
  EXPECT_EQ(mma::bf16_lo(r), 1.0f);
  EXPECT_EQ(mma::bf16_hi(r), 1.0f + 0x1p-6f);
  EXPECT_EQ(mma::pack_bf16x2(-2.5f, 3.0e38f), (uint32_t{0x7f62} << 16) | 0xc020u);
}

TEST(CudaSimMma, FragmentLayoutsGiveTheProduct) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    const MmaCase m = random_mma_case(seed);
    const std::vector<float> d = run_mma<false>(m);
    double worst = 0.0;
    for (int i = 0; i < 16; ++i) {
      for (int n = 0; n < 8; ++n) {
        double exact = m.c[i * 8 + n], bound = std::fabs(m.c[i * 8 + n]);
        float ordered = m.c[i * 8 + n];  // the twin's definition: C first, k in order, fp32
        for (int k = 0; k < 16; ++k) {
          const double p = static_cast<double>(m.a[i * 16 + k]) * m.b[k * 8 + n];
          exact += p;
          bound += std::fabs(p);
          ordered += m.a[i * 16 + k] * m.b[k * 8 + n];
        }
        const float got = d[i * 8 + n];
        EXPECT_EQ(got, ordered) << "D[" << i << "][" << n << "] seed " << seed;
        EXPECT_LE(std::fabs(got - exact), 17.0 * 0x1p-24 * bound) << "D[" << i << "][" << n << "]";
        worst = std::max(worst, std::fabs(got - exact) / bound);
      }
    }
    EXPECT_LT(worst, 17.0 * 0x1p-24);
  }
}

TEST(CudaSimMma, ASwappedFragmentRegisterIsCaught) {
  const MmaCase m = random_mma_case(4);
  const std::vector<float> d = run_mma<true>(m);
  double worst = 0.0, scale = 0.0;
  for (int i = 0; i < 16; ++i) {
    for (int n = 0; n < 8; ++n) {
      double exact = m.c[i * 8 + n];
      for (int k = 0; k < 16; ++k) exact += static_cast<double>(m.a[i * 16 + k]) * m.b[k * 8 + n];
      worst = std::max(worst, std::fabs(d[i * 8 + n] - exact));
      scale = std::max(scale, std::fabs(exact));
    }
  }
  EXPECT_GT(worst, 0.1 * scale);  // far outside 17 u sum |terms| (about 1e-4 here)
}

// ---------------------------------------------------------------- ldmatrix
// One warp loads a 16 x 40 tile of distinct 16-bit patterns into shared memory (rows of 80
// bytes), then per lane: an A fragment (quad_row, rows 0-15, columns 8-23), the B fragments of
// two k-steps of the n-tile whose columns are rows 8-15 (strip_row from column 0), and with
// .trans the B fragments of n-tiles 16 and 24 over k rows 0-15 (quad_row); 12 registers a lane.
// The broken variant gives quad_row the lane of the other half-warp's row (lane ^ 8).
constexpr int kLdRows = 16, kLdCols = 40;
template <bool kBroken>
__global__ void ldmatrix_kernel(const uint16_t* src, uint32_t* regs) {
  __shared__ __align__(16) uint32_t tile[kLdRows][kLdCols / 2];  // stored a word (two elements) per thread
  const int lane = static_cast<int>(threadIdx.x);
  for (int i = lane; i < kLdRows * kLdCols / 2; i += 32) {
    tile[i / (kLdCols / 2)][i % (kLdCols / 2)] = mma::pair_bf16(src[2 * i], src[2 * i + 1]);
  }
  __syncthreads();
  const int quad_lane = kBroken ? lane ^ 8 : lane;
  uint32_t a[4], b[4], bt[4];
  mma::ldmatrix_x4<false>(a, mma::quad_row(tile, 2 * kLdCols, 0, 8, quad_lane));
  mma::ldmatrix_x4<false>(b, mma::strip_row(tile, 2 * kLdCols, 8, 0, lane));
  mma::ldmatrix_x4<true>(bt, mma::quad_row(tile, 2 * kLdCols, 0, 16, quad_lane));
  for (int j = 0; j < 4; ++j) {
    regs[lane * 12 + j] = a[j];
    regs[lane * 12 + 4 + j] = b[j];
    regs[lane * 12 + 8 + j] = bt[j];
  }
}

// The registers that disagree with the fragment layouts (cuda_mma.h's index math) of A(m, k) =
// T[m][8 + k], B_h(k, n) = T[8 + n][16 h + k] and B'_h(k, n) = T[k][16 + 8 h + n].
template <bool kBroken>
int ldmatrix_mismatches(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint16_t> t(kLdRows * kLdCols);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint16_t>((rng() & 0xfc00u) | i);  // distinct
  uint16_t* src = nullptr;
  uint32_t* regs = nullptr;
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&src), t.size() * 2), cudaSuccess);
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&regs), 32 * 12 * 4), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(src, t.data(), t.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  launch<ldmatrix_kernel<kBroken>>(1, 32, 0, nullptr, src, regs);
  std::vector<uint32_t> got(32 * 12);
  EXPECT_EQ(cudaMemcpy(got.data(), regs, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  expect_no_report();
  (void)cudaFree(src);
  (void)cudaFree(regs);
  const auto T = [&](int r, int c) { return static_cast<uint32_t>(t[r * kLdCols + c]); };
  int bad = 0;
  for (int l = 0; l < 32; ++l) {
    for (int j = 0; j < 4; ++j) {  // A: register j holds elements 2j, 2j + 1
      const uint32_t want = mma::pair_bf16(T(mma::a_row(l, 2 * j), 8 + mma::a_col(l, 2 * j)),
                                           T(mma::a_row(l, 2 * j + 1), 8 + mma::a_col(l, 2 * j + 1)));
      bad += got[l * 12 + j] != want;
    }
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 2; ++j) {  // B fragment h, register j: elements 2j, 2j + 1
        const int n = mma::b_col(l, 2 * j), k0 = mma::b_row(l, 2 * j), k1 = mma::b_row(l, 2 * j + 1);
        bad += got[l * 12 + 4 + 2 * h + j] != mma::pair_bf16(T(8 + n, 16 * h + k0), T(8 + n, 16 * h + k1));
        bad += got[l * 12 + 8 + 2 * h + j] != mma::pair_bf16(T(k0, 16 + 8 * h + n), T(k1, 16 + 8 * h + n));
      }
    }
  }
  return bad;
}

TEST(CudaSimMma, LdmatrixGivesTheFragmentLayouts) {
  for (uint32_t seed : {5u, 6u}) EXPECT_EQ(ldmatrix_mismatches<false>(seed), 0) << "seed " << seed;
  EXPECT_GT(ldmatrix_mismatches<true>(7), 100);  // half of the A and .trans registers move
}

// ---------------------------------------------------------------- attention references (double)
struct Shape {
  int B, T, H, KV, hd;
  int W() const { return (H + 2 * KV) * hd; }
  int OW() const { return H * hd; }
};

struct Reference {
  std::vector<double> out, lse, dqkv;
};

// Exact causal (or full) attention and its gradients, from the unrounded fp32 inputs.
Reference attention_reference(const Shape& s, const std::vector<float>& qkv, const std::vector<float>& dout,
                              bool causal) {
  Reference r;
  r.out.assign(static_cast<size_t>(s.B) * s.T * s.OW(), 0.0);
  r.lse.assign(static_cast<size_t>(s.B) * s.H * s.T, 0.0);
  r.dqkv.assign(static_cast<size_t>(s.B) * s.T * s.W(), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.hd));
  const int G = s.H / s.KV;
  auto at = [&](int b, int i, int col) { return static_cast<size_t>(b * s.T + i) * s.W() + col; };
  std::vector<double> p(s.T), dp(s.T);
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.H; ++h) {
      const int qc = h * s.hd, kc = (s.H + h / G) * s.hd, vc = (s.H + s.KV + h / G) * s.hd;
      for (int i = 0; i < s.T; ++i) {
        const int n = causal ? i + 1 : s.T;
        double mx = -INFINITY;
        for (int j = 0; j < n; ++j) {
          double acc = 0.0;
          for (int d = 0; d < s.hd; ++d) acc += static_cast<double>(qkv[at(b, i, qc + d)]) * qkv[at(b, j, kc + d)];
          p[j] = acc * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0.0;
        for (int j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - mx));
        for (int j = 0; j < n; ++j) p[j] /= sum;
        r.lse[static_cast<size_t>(b * s.H + h) * s.T + i] = mx + std::log(sum);
        const size_t orow = static_cast<size_t>(b * s.T + i) * s.OW() + qc;
        for (int j = 0; j < n; ++j) {
          for (int d = 0; d < s.hd; ++d) r.out[orow + d] += p[j] * qkv[at(b, j, vc + d)];
        }
        // Gradients: dP_j = dO . V_j, D = sum_j P_j dP_j, dS_j = scale P_j (dP_j - D).
        double dsum = 0.0;
        for (int j = 0; j < n; ++j) {
          double acc = 0.0;
          for (int d = 0; d < s.hd; ++d) acc += static_cast<double>(dout[orow + d]) * qkv[at(b, j, vc + d)];
          dp[j] = acc;
          dsum += p[j] * acc;
        }
        for (int j = 0; j < n; ++j) {
          const double ds = scale * p[j] * (dp[j] - dsum);
          for (int d = 0; d < s.hd; ++d) {
            r.dqkv[at(b, i, qc + d)] += ds * qkv[at(b, j, kc + d)];
            r.dqkv[at(b, j, kc + d)] += ds * qkv[at(b, i, qc + d)];
            r.dqkv[at(b, j, vc + d)] += p[j] * dout[orow + d];
          }
        }
      }
    }
  }
  return r;
}

// max |got - ref| / max |ref| over the elements for which keep(index) holds; NaN -> infinity.
template <typename Keep>
double relative_error(const std::vector<float>& got, const std::vector<double>& ref, Keep keep) {
  double err = 0.0, mag = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!keep(i)) continue;
    if (!std::isfinite(got[i])) return INFINITY;
    err = std::max(err, std::fabs(got[i] - ref[i]));
    mag = std::max(mag, std::fabs(ref[i]));
  }
  return err / mag;
}
double relative_error(const std::vector<float>& got, const std::vector<double>& ref) {
  return relative_error(got, ref, [](size_t) { return true; });
}
double max_abs_error(const std::vector<float>& got, const std::vector<double>& ref) {
  double err = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    err = std::max(err, std::fabs(got[i] - ref[i]));
  }
  return err;
}

struct FlashRun {
  std::vector<float> out, lse, dqkv;
};

struct FlashInputs {
  std::vector<float> qkv, dout;
};

FlashInputs random_inputs(const Shape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> qk(-2.0f, 2.0f), v(-1.0f, 1.0f);
  FlashInputs in;
  in.qkv.resize(static_cast<size_t>(s.B) * s.T * s.W());
  for (size_t idx = 0; idx < in.qkv.size(); ++idx) {
    const int col = static_cast<int>(idx % s.W());
    in.qkv[idx] = col < (s.H + s.KV) * s.hd ? qk(rng) : v(rng);  // q, k wider: a peaked softmax
  }
  in.dout.resize(static_cast<size_t>(s.B) * s.T * s.OW());
  for (float& x : in.dout) x = v(rng);
  return in;
}

FlashRun run_flash(const Shape& s, const FlashInputs& in, bool causal, bool backward) {
  DeviceBuffers buf;
  const size_t n_out = static_cast<size_t>(s.B) * s.T * s.OW(), n_lse = static_cast<size_t>(s.B) * s.H * s.T;
  float* qkv = buf.floats(in.qkv.size(), &in.qkv);
  float* out = buf.floats(n_out);
  float* lse = buf.floats(n_lse);
  cuda::flash_mma_attention_forward(qkv, out, lse, s.B, s.T, s.H, s.KV, s.hd, 0, nullptr, causal);
  FlashRun r;
  if (backward) {
    float* dout = buf.floats(in.dout.size(), &in.dout);
    float* dqkv = buf.floats(in.qkv.size());
    const size_t scratch = cuda::flash_mma_attention_backward_scratch_bytes(s.B, s.T, s.H, s.KV, s.hd);
    float* ds = buf.floats(scratch / sizeof(float));
    cuda::flash_mma_attention_backward(dout, qkv, out, lse, dqkv, ds, s.B, s.T, s.H, s.KV, s.hd, 0, nullptr, causal);
    r.dqkv = DeviceBuffers::read(dqkv, in.qkv.size());
  }
  r.out = DeviceBuffers::read(out, n_out);
  r.lse = DeviceBuffers::read(lse, n_lse);
  expect_no_report();
  return r;
}

// Which third of a qkv row an index is in: 0 = Q, 1 = K, 2 = V.
int qkv_part(const Shape& s, size_t idx) {
  const int col = static_cast<int>(idx % s.W());
  return col < s.H * s.hd ? 0 : col < (s.H + s.KV) * s.hd ? 1 : 2;
}

constexpr double kTol = 2e-2;

void check_against_exact(const Shape& s, uint32_t seed) {
  const FlashInputs in = random_inputs(s, seed);
  const Reference ref = attention_reference(s, in.qkv, in.dout, true);
  const FlashRun run = run_flash(s, in, true, true);
  const std::string what = "B " + std::to_string(s.B) + " T " + std::to_string(s.T) + " H " + std::to_string(s.H) +
                           " KV " + std::to_string(s.KV) + " hd " + std::to_string(s.hd);
  const double e_out = relative_error(run.out, ref.out), e_lse = max_abs_error(run.lse, ref.lse);
  const double e_dq = relative_error(run.dqkv, ref.dqkv, [&](size_t i) { return qkv_part(s, i) == 0; });
  const double e_dk = relative_error(run.dqkv, ref.dqkv, [&](size_t i) { return qkv_part(s, i) == 1; });
  const double e_dv = relative_error(run.dqkv, ref.dqkv, [&](size_t i) { return qkv_part(s, i) == 2; });
  EXPECT_LE(e_out, kTol) << what;
  EXPECT_LE(e_lse, kTol) << what;
  EXPECT_LE(e_dq, kTol) << what;
  EXPECT_LE(e_dk, kTol) << what;
  EXPECT_LE(e_dv, kTol) << what;
  std::printf("[ flash mma ] %s: out %.2e lse %.2e dQ %.2e dK %.2e dV %.2e\n", what.c_str(), e_out, e_lse, e_dq, e_dk,
              e_dv);
}

TEST(CudaSimMma, FlashAttentionMatchesExactAttentionHd64Gqa) {
  check_against_exact(Shape{1, 80, 2, 1, 64}, 11);  // partial last tile, G = 2
}

TEST(CudaSimMma, FlashAttentionMatchesExactAttentionTwoBatches) {
  check_against_exact(Shape{2, 37, 4, 2, 64}, 12);  // one partial tile, G = 2
}

TEST(CudaSimMma, FlashAttentionMatchesExactAttentionHd128) {
  check_against_exact(Shape{1, 48, 2, 2, 128}, 13);
}

TEST(CudaSimMma, FlashAttentionMatchesExactAttentionHd128ThreeTiles) {
  check_against_exact(Shape{1, 130, 4, 2, 128}, 16);  // three query and key tiles, G = 2
}

TEST(CudaSimMma, FlashAttentionMatchesExactAttentionTinySequence) {
  check_against_exact(Shape{2, 5, 2, 2, 64}, 18);  // one partial tile of 5 rows
}

TEST(CudaSimMma, FullAttentionMatchesExactAttention) {  // causal = false: every key
  const Shape s{1, 70, 2, 1, 64};
  const FlashInputs in = random_inputs(s, 17);
  const Reference full = attention_reference(s, in.qkv, in.dout, false);
  const FlashRun run = run_flash(s, in, false, true);
  EXPECT_LE(relative_error(run.out, full.out), kTol);
  EXPECT_LE(max_abs_error(run.lse, full.lse), kTol);
  EXPECT_LE(relative_error(run.dqkv, full.dqkv), kTol);
}

TEST(CudaSimMma, AMissingCausalMaskIsCaught) {
  const Shape s{1, 40, 2, 1, 64};
  const FlashInputs in = random_inputs(s, 14);
  const Reference causal = attention_reference(s, in.qkv, in.dout, true);
  const Reference full = attention_reference(s, in.qkv, in.dout, false);
  const FlashRun run = run_flash(s, in, false, false);  // the kernels without the mask
  EXPECT_LE(relative_error(run.out, full.out), kTol);   // they compute full attention correctly,
  EXPECT_GT(relative_error(run.out, causal.out), 10 * kTol);  // which the causal check rejects
}

TEST(CudaSimMma, BlockOrderDoesNotChangeTheBits) {
  const Shape s{1, 40, 2, 1, 64};
  const FlashInputs in = random_inputs(s, 15);
  const FlashRun first = run_flash(s, in, true, true);
  const uint64_t seed = sim::block_order_seed();
  sim::set_block_order_seed(seed + 6);
  const FlashRun second = run_flash(s, in, true, true);
  sim::set_block_order_seed(seed);
  EXPECT_EQ(std::memcmp(first.out.data(), second.out.data(), first.out.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(first.dqkv.data(), second.dqkv.data(), first.dqkv.size() * sizeof(float)), 0);
}

TEST(CudaSimMma, UnsupportedShapesAreRefusedWithOneLine) {
  try {
    cuda::flash_mma_attention_forward(nullptr, nullptr, nullptr, 1, 16, 2, 1, 96, 0, nullptr);
    ADD_FAILURE() << "head_dim 96 accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "flash_mma_attention_forward: head_dim 96 is not supported by the tensor-core kernels (64 or 128)");
  }
  try {
    cuda::flash_mma_attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 16, 2, 1, 64, 8,
                                       nullptr);
    ADD_FAILURE() << "window 8 accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "flash_mma_attention_backward: a sliding window (window = 8) is not supported by the tensor-core "
                 "kernels");
  }
}

}  // namespace
}  // namespace loom
