// Multi-head latent attention kernels (cuda_mla.h; DeepSeek-V2 §2.1): the decoupled RoPE slices,
// the probabilities-saved attention over [k_n | v] heads plus one shared RoPE key, its backward,
// and decoding over cached latents with W_uk absorbed. Semantics are backend.h's mla_* and the
// CPU's (cpu/cpu_mla_ops.cpp). B sequences of T, H heads, d_n + d_r = qk query/key dims, d_v,
// kvw = d_n + d_v, d_c latent dims, scale = score_scale / sqrt(qk).
//
// Kernel / call (launch shape)            formula; device-memory bytes and FLOPs
//   mla_rope_kernel (grid-stride over      (a, c) = (v[j], v[j + d_r/2]) -> (a cos - c sin, c cos + a sin)
//     rows x d_r/2 pairs, 256 threads)     per head slice, angle = dir (pos_offset + t) inv_freq(j) in
//                                          double: 16 B and 6 FLOPs per pair and head, cos + sin per pair.
//   forward, per sequence, cuBLAS          S_h = Q_n,h K_n,h^T (+)= Q_r,h K_r^T (K_r shared: stride 0 over
//     strided-batched over the H heads     heads), O_h = P_h V_h: 2 T^2 (qk + d_v) FLOPs per head (the
//     (fp32, no TF32)                      full square; the causal half is masked), 4 T^2 B written + read.
//   mla_softmax_kernel (warp per row,      P = softmax(scale S) over the visible keys (exp in f32, sum in
//     8 rows per block)                    double), exactly 0 elsewhere: 8 B and ~3 FLOPs + exp per element.
//   backward, per sequence, cuBLAS         dV_h += P_h^T dO_h; dP_h = dO_h V_h^T (into dS, laid out (i, h, j));
//                                          dQ_h += dS_h [K_n,h | K_r]; dK_n,h += dS_h^T Q_n,h;
//                                          dK_r += sum_h dS_h^T Q_r,h as one GEMM over k = (i, h):
//                                          2 T^2 (2 qk + 2 d_v) FLOPs per head.
//   mla_dscores_kernel (warp per row)      dS = scale P (dP - sum_j P dP) (the row dot in double):
//                                          12 B and ~4 FLOPs per element.
//   mla_latents_kernel (block per head,    q~ = W_uk^T q_n; s(j) = scale (q~ . c'(j) + q_r . k_r(j));
//     256 threads)                         p = softmax(s); ctx = sum_j p(j) c'(j); out = W_uv ctx:
//                                          reads count (d_c + d_r) x 4 B (latents, once per head from L2)
//                                          + kvw d_c x 4 B; ~2 (d_n + d_v) d_c + 4 count d_c FLOPs per head.
//
// Determinism: no atomics. cuBLAS calls are reproducible for a fixed GPU and toolkit; the row
// kernels' sums are fixed xor butterflies and fixed block trees; loops along j or k run in order.
#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)
#include "loom/backend/cuda/cuda_mla.h"

#include <algorithm>
#include <cstdint>

#include "loom/backend/cuda/cuda_blas.h"
#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/core/error.h"

namespace loom::cuda {
namespace {

constexpr int kBlock = 256;
constexpr int kRowWarps = kBlock / kWarp;

// (grid_for, thread_index / thread_count, warp_sum, warp_max, block_fold: cuda_device.h; the
// GEMMs: cuda_blas.h.)

// ------------------------------------------------------------------------------------ RoPE
__global__ void mla_rope_kernel(float* x, int64_t rows, int64_t seq_len, int64_t width, int64_t heads, int64_t stride,
                                int64_t offset, int64_t rope_dim, RopeSpec rope, int64_t pos_offset, double direction) {
  const int64_t half = rope_dim / 2, pairs = rows * half;
  for (int64_t i = thread_index(); i < pairs; i += thread_count()) {
    const int64_t j = i % half, n = i / half;
    const double angle =
        direction * static_cast<double>(pos_offset + n % seq_len) * rope_inv_freq(rope, j, rope_dim);
    const float cs = static_cast<float>(::cos(angle) * rope.amplitude);
    const float sn = static_cast<float>(::sin(angle) * rope.amplitude);
    float* row = x + n * width + offset;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = row + h * stride;
      const float a = v[j], c = v[j + half];
      v[j] = a * cs - c * sn;
      v[j + half] = c * cs + a * sn;
    }
  }
}

// ------------------------------------------------------------------------------------ attention rows
// The first key position row i sees.
__device__ __forceinline__ int64_t first_visible(int64_t i, int64_t window) {
  return window > 0 && i - window + 1 > 0 ? i - window + 1 : 0;
}

// In place on probs (B H T rows of T, row r is query i = r % T), holding the raw scores S:
// P = exp(scale S - max) / sum over the visible keys (sum in double), 0 elsewhere.
__global__ void __launch_bounds__(kBlock)
    mla_softmax_kernel(float* __restrict__ probs, int64_t rows, int64_t seq_len, int64_t window, float scale) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kRowWarps) {  // warp-uniform
    const int64_t i = r % seq_len, j0 = first_visible(i, window);
    float* row = probs + r * seq_len;
    float mx = -CUDART_INF_F;
    for (int64_t j = j0 + lane; j <= i; j += kWarp) {
      const float s = row[j] * scale;
      mx = s > mx ? s : mx;
    }
    mx = warp_max(mx);
    double sum = 0.0;
    for (int64_t j = j0 + lane; j <= i; j += kWarp) {
      const float e = expf(row[j] * scale - mx);
      row[j] = e;
      sum += e;
    }
    sum = warp_sum(sum);
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = lane; j < seq_len; j += kWarp) row[j] = (j >= j0 && j <= i) ? row[j] * inv : 0.0f;
  }
}

// One sequence: in place on ds (T, H, T) = (query i, head h, key j) holding dP;
// dS = P (dP - sum_j P dP) scale over the visible keys (the row dot in double), 0 elsewhere.
// probs_b (H, T, T). Warp per (i, h) row.
__global__ void __launch_bounds__(kBlock)
    mla_dscores_kernel(const float* __restrict__ probs_b, float* __restrict__ ds, int64_t heads, int64_t seq_len,
                       int64_t window, float scale) {
  const int lane = threadIdx.x % kWarp;
  const int64_t rows = seq_len * heads;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kRowWarps) {  // warp-uniform
    const int64_t i = r / heads, h = r % heads, j0 = first_visible(i, window);
    const float* p = probs_b + (h * seq_len + i) * seq_len;
    float* row = ds + r * seq_len;
    double dot = 0.0;
    for (int64_t j = j0 + lane; j <= i; j += kWarp) dot += static_cast<double>(p[j]) * row[j];
    const float d = static_cast<float>(warp_sum(dot));
    for (int64_t j = lane; j < seq_len; j += kWarp) row[j] = (j >= j0 && j <= i) ? p[j] * (row[j] - d) * scale : 0.0f;
  }
}

// ------------------------------------------------------------------------------------ decoding
// Block per head. scratch per head: q~ (d_c) | scores (count) | ctx (d_c), in global memory
// (phases separated by barriers).
__global__ void __launch_bounds__(kBlock)
    mla_latents_kernel(const float* __restrict__ q, const float* __restrict__ latents, const float* __restrict__ kv_b,
                       float* __restrict__ out, float* __restrict__ scratch, int64_t nope, int64_t rope, int64_t dv,
                       int64_t dc, int64_t count, float scale) {
  __shared__ float fred[kBlock];
  __shared__ double dred[kBlock];
  const int64_t h = blockIdx.x, qk = nope + rope, kvw = nope + dv, lw = dc + rope;
  const int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const float* qn = q + h * qk;
  const float* qr = qn + nope;
  const float* wuk = kv_b + h * kvw * dc;  // (d_n, d_c)
  const float* wuv = wuk + nope * dc;      // (d_v, d_c)
  float* qt = scratch + h * (2 * dc + count);
  float* sc = qt + dc;
  float* ctx = sc + count;
  for (int64_t k = threadIdx.x; k < dc; k += kBlock) {  // q~ = W_uk^T q_n, e in order
    float acc = 0.0f;
    for (int64_t e = 0; e < nope; ++e) acc += qn[e] * wuk[e * dc + k];
    qt[k] = acc;
  }
  __syncthreads();
  float mx = -CUDART_INF_F;
  for (int64_t j = w; j < count; j += kRowWarps) {  // warp per position
    const float* lat = latents + j * lw;
    float s = 0.0f;
    for (int64_t k = lane; k < dc; k += kWarp) s += qt[k] * lat[k];
    for (int64_t e = lane; e < rope; e += kWarp) s += qr[e] * lat[dc + e];
    s = warp_sum(s) * scale;
    if (lane == 0) sc[j] = s;
    mx = s > mx ? s : mx;
  }
  mx = block_fold<kBlock>(mx, fred, [](float a, float b) { return a > b ? a : b; });
  double sum = 0.0;
  for (int64_t j = threadIdx.x; j < count; j += kBlock) {
    const float e = expf(sc[j] - mx);
    sc[j] = e;
    sum += e;
  }
  sum = block_fold<kBlock>(sum, dred, [](double a, double b) { return a + b; });
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t k = threadIdx.x; k < dc; k += kBlock) {  // ctx = sum_j p(j) c'(j), j in order
    float acc = 0.0f;
    for (int64_t j = 0; j < count; ++j) acc += sc[j] * inv * latents[j * lw + k];
    ctx[k] = acc;
  }
  __syncthreads();
  for (int64_t e = w; e < dv; e += kRowWarps) {  // out = W_uv ctx, warp per output
    float s = 0.0f;
    for (int64_t k = lane; k < dc; k += kWarp) s += wuv[e * dc + k] * ctx[k];
    s = warp_sum(s);
    if (lane == 0) out[h * dv + e] = s;
  }
}

}  // namespace

// ------------------------------------------------------------------------------------ launchers
void mla_rope(float* x, int64_t rows, int64_t seq_len, int64_t width, int64_t heads, int64_t stride, int64_t offset,
              int64_t rope_dim, const RopeSpec& rope, int64_t pos_offset, double direction, cudaStream_t stream) {
  const int64_t pairs = rows * (rope_dim / 2);
  if (pairs <= 0) return;
  launch<mla_rope_kernel>(grid_for(pairs, kBlock), kBlock, 0, stream, x, rows, seq_len, width, heads, stride, offset,
                          rope_dim, rope, pos_offset, direction);
  LOOM_CUDA_CHECK_LAUNCH();
}

void mla_attention_forward(cublasHandle_t cublas, const float* q, const float* kr, const float* kv, float* probs,
                           float* out, const MlaShape& s, cudaStream_t stream) {
  if (s.B == 0 || s.T == 0) return;
  const BlasHostScalars host_scalars(cublas);
  const int64_t T = s.T, H = s.H, qk = s.dn + s.dr, kvw = s.dn + s.dv, TT = T * T;
  for (int64_t b = 0; b < s.B; ++b) {
    const float* qb = q + b * T * H * qk;
    const float* kvb = kv + b * T * H * kvw;
    float* pb = probs + b * H * TT;
    if (s.dn > 0) {  // S_h (T, T) = Q_n,h (T, d_n; ld H qk) K_n,h (T, d_n; ld H kvw)^T
      gemm_rm(cublas, false, true, T, T, s.dn, 1.0f, qb, H * qk, qk, kvb, H * kvw, kvw, 0.0f, pb, T, TT, H,
              "mla_attention_forward: S = Q_n K_n^T");
    }
    if (s.dr > 0) {  // S_h += Q_r,h (T, d_r; ld H qk) K_r (T, d_r; ld d_r, shared by the heads)^T
      gemm_rm(cublas, false, true, T, T, s.dr, 1.0f, qb + s.dn, H * qk, qk, kr + b * T * s.dr, s.dr, 0,
              s.dn > 0 ? 1.0f : 0.0f, pb, T, TT, H, "mla_attention_forward: S += Q_r K_r^T");
    }
  }
  const int64_t rows = s.B * H * T;
  launch<mla_softmax_kernel>(grid_for(rows, kRowWarps), kBlock, 0, stream, probs, rows, T, s.window, s.scale);
  LOOM_CUDA_CHECK_LAUNCH();
  for (int64_t b = 0; b < s.B; ++b) {  // O_h (T, d_v; ld H d_v) = P_h (T, T) V_h (T, d_v; ld H kvw)
    gemm_rm(cublas, false, false, T, s.dv, T, 1.0f, probs + b * H * TT, T, TT, kv + b * T * H * kvw + s.dn, H * kvw,
            kvw, 0.0f, out + b * T * H * s.dv, H * s.dv, s.dv, H, "mla_attention_forward: O = P V");
  }
}

size_t mla_attention_backward_scratch_bytes(const MlaShape& s) {
  return static_cast<size_t>(s.T * s.H * s.T) * sizeof(float);
}

void mla_attention_backward(cublasHandle_t cublas, const float* q, const float* kr, const float* kv,
                            const float* probs, const float* dout, float* dq, float* dkv, float* dkr, void* scratch,
                            const MlaShape& s, cudaStream_t stream) {
  if (s.B == 0 || s.T == 0) return;
  const BlasHostScalars host_scalars(cublas);
  const int64_t T = s.T, H = s.H, qk = s.dn + s.dr, kvw = s.dn + s.dv, TT = T * T, HT = H * T;
  float* ds = static_cast<float*>(scratch);  // (T, H, T): row (i, h) at (i H + h) T
  for (int64_t b = 0; b < s.B; ++b) {
    const float* qb = q + b * T * H * qk;
    const float* kvb = kv + b * T * H * kvw;
    const float* krb = kr + b * T * s.dr;
    const float* pb = probs + b * H * TT;
    const float* dob = dout + b * T * H * s.dv;
    float* dqb = dq + b * T * H * qk;
    float* dkvb = dkv + b * T * H * kvw;
    // dV_h (T, d_v; ld H kvw) += P_h^T dO_h (T, d_v; ld H d_v)
    gemm_rm(cublas, true, false, T, s.dv, T, 1.0f, pb, T, TT, dob, H * s.dv, s.dv, 1.0f, dkvb + s.dn, H * kvw, kvw, H,
            "mla_attention_backward: dV += P^T dO");
    // dP_h (T, T; ld H T) = dO_h V_h^T
    gemm_rm(cublas, false, true, T, T, s.dv, 1.0f, dob, H * s.dv, s.dv, kvb + s.dn, H * kvw, kvw, 0.0f, ds, HT, T, H,
            "mla_attention_backward: dP = dO V^T");
    launch<mla_dscores_kernel>(grid_for(HT, kRowWarps), kBlock, 0, stream, pb, ds, H, T, s.window, s.scale);
    LOOM_CUDA_CHECK_LAUNCH();
    if (s.dn > 0) {
      // dQ_n,h (ld H qk) += dS_h (T, T; ld H T) K_n,h;  dK_n,h (ld H kvw) += dS_h^T Q_n,h
      gemm_rm(cublas, false, false, T, s.dn, T, 1.0f, ds, HT, T, kvb, H * kvw, kvw, 1.0f, dqb, H * qk, qk, H,
              "mla_attention_backward: dQ_n += dS K_n");
      gemm_rm(cublas, true, false, T, s.dn, T, 1.0f, ds, HT, T, qb, H * qk, qk, 1.0f, dkvb, H * kvw, kvw, H,
              "mla_attention_backward: dK_n += dS^T Q_n");
    }
    if (s.dr > 0) {
      // dQ_r,h += dS_h K_r;  dK_r (T, d_r) += sum_h dS_h^T Q_r,h = dS'^T Q_r' with dS' (T H, T; ld T)
      // and Q_r' (T H, d_r; ld qk), both with rows (i, h): one GEMM over k = T H.
      gemm_rm(cublas, false, false, T, s.dr, T, 1.0f, ds, HT, T, krb, s.dr, 0, 1.0f, dqb + s.dn, H * qk, qk, H,
              "mla_attention_backward: dQ_r += dS K_r");
      gemm_rm(cublas, true, false, T, s.dr, HT, 1.0f, ds, T, 0, qb + s.dn, qk, 0, 1.0f, dkr + b * T * s.dr, s.dr, 0, 1,
              "mla_attention_backward: dK_r += sum_h dS^T Q_r");
    }
  }
}

size_t mla_attend_latents_scratch_bytes(int64_t heads, int64_t latent, int64_t count) {
  return static_cast<size_t>(heads * (2 * latent + count)) * sizeof(float);
}

void mla_attend_latents(const float* q, const float* latents, const float* kv_b, float* out, int64_t heads,
                        int64_t nope, int64_t rope, int64_t v, int64_t latent, int64_t count, float scale,
                        void* scratch, cudaStream_t stream) {
  launch<mla_latents_kernel>(dim3(static_cast<unsigned>(heads)), dim3(kBlock), 0, stream, q, latents, kv_b, out,
                             static_cast<float*>(scratch), nope, rope, v, latent, count, scale);
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace loom::cuda
