// Qwen3-Next's linear-attention kernels (cuda_linear_attention.h): the gated delta rule (Gated
// DeltaNet: Yang, Kautz & Hatamizadeh 2024, arXiv 2412.06464) in its recurrent form, forward and
// backward, the causal depthwise convolution with SiLU, and the gates. Semantics are backend.h's
// and the CPU's (cpu/cpu_delta_rule.cpp, cpu/cpu_linear_attention_ops.cpp); written from those
// equations, the backward the same derivative the CPU's recurrent form runs.
//
// Kernel (launch shape)                        work; device-memory bytes and FLOPs
//   delta_forward_kernel (a block of 128          per head, for t = 0 .. T-1: S <- exp(g_t) S, u = S^T k_t,
//     threads per (b, h) head; thread j owns      delta = beta_t (v_t - u), S += k_t delta^T, o_t = S^T q_t.
//     columns j, j + 128, .. of S (dk, dv))       Each column is independent given q_t and k_t (in shared
//                                                 memory), so no reduction: 6 dk dv FLOPs and two passes over
//                                                 the state (dk dv elements, from L2) per position.
//   delta_backward_kernel (same shape)           a forward sweep keeping S every `chunk` positions, then the
//                                                 chunks in reverse: recompute the chunk's states, and per
//                                                 position the reverse-time recurrence (dq_t = S_t do_t and
//                                                 dk_t by rows; d(delta), dv_t, du, dP and dS by columns;
//                                                 dbeta_t and dg_t by a fixed block tree): ~16 dk dv FLOPs and
//                                                 about six passes over a state per position.
//   delta_group_sum_kernel (grid-stride)          dq, dk = the sum of a key head's value heads' rows, in
//                                                 value-head order.
//   conv_forward_kernel / conv_backward kernels   one thread per (b, t, c): the K taps in order; d(pre) kept
//     (grid-stride)                               in scratch; dweight[c, i] by one thread per (c, i) summing
//                                                 the B T rows in order.
//   gates kernels (grid-stride; a block per       elementwise; da_log, ddt_bias by a block per head (strided
//     head for the sums)                          partial sums, then a fixed tree).
//
// Speed: a first version for correctness (the simulator checks it against the CPU; no GPU has
// run it). The recurrent form keeps the state in global memory (L2-resident for one head) and
// runs positions one after another, about T (6 dk dv) FLOPs per head on CUDA cores: the chunked
// form on tensor cores (FLA's chunk_gated_delta_rule) is what a GPU should run for prefill and
// training (docs/cuda.md, known gaps).
//
// Determinism: no atomics; every sum runs in a fixed order.
#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)
#include "loom/backend/cuda/cuda_linear_attention.h"

#include <algorithm>
#include <cstdint>

#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_launch.h"

namespace loom::cuda {
namespace {

constexpr int kBlock = 256;       // the elementwise kernels
constexpr int kHeadThreads = 128;  // a delta-rule head's block
constexpr int64_t kMaxDim = 256;   // dk, dv at most (the ops check)

template <typename T>
__device__ __forceinline__ T sigmoid_of(T x) {
  return T(1) / (T(1) + exp_of(-x));
}
// torch's F.softplus (threshold 20), as the CPU's softplus_of / softplus_grad.
template <typename T>
__device__ __forceinline__ T softplus_of(T x) {
  return x > T(20) ? x : log1p_of(exp_of(x));
}
template <typename T>
__device__ __forceinline__ T softplus_grad(T x) {
  return x > T(20) ? T(1) : sigmoid_of(x);
}

// A head's rows: (b, t, h) of v / g / beta / out and (b, t, key head) of q / k.
struct HeadRows {
  int64_t b, h, hk;
  __device__ int64_t qk(const DeltaRuleShape& s, int64_t t) const { return ((b * s.T + t) * s.Hk + hk) * s.dk; }
  __device__ int64_t vo(const DeltaRuleShape& s, int64_t t) const { return ((b * s.T + t) * s.Hv + h) * s.dv; }
  __device__ int64_t gb(const DeltaRuleShape& s, int64_t t) const { return (b * s.T + t) * s.Hv + h; }
};
__device__ HeadRows head_rows(const DeltaRuleShape& s) {
  const int64_t bh = blockIdx.x, b = bh / s.Hv, h = bh % s.Hv;
  return HeadRows{b, h, h / (s.Hv / s.Hk)};
}

// One recurrent step on the block's state S (dk, dv) row-major: S <- a S; u = S^T k; delta =
// beta (v - u); S += k delta^T; o = S^T q (written when o is not null). Thread j's columns only:
// q and k in shared memory, read after the caller's barrier.
template <typename T>
__device__ void recurrent_step(T* S, const T* q, const T* k, const T* v, T a, T beta, T* o, const DeltaRuleShape& s) {
  for (int64_t j = threadIdx.x; j < s.dv; j += blockDim.x) {
    T u = 0;
    for (int64_t i = 0; i < s.dk; ++i) {
      const T p = S[i * s.dv + j] * a;
      S[i * s.dv + j] = p;
      u += k[i] * p;
    }
    const T delta = beta * (v[j] - u);
    T acc = 0;
    for (int64_t i = 0; i < s.dk; ++i) {
      const T x = S[i * s.dv + j] + k[i] * delta;
      S[i * s.dv + j] = x;
      acc += q[i] * x;
    }
    if (o != nullptr) o[j] = acc;
  }
}

template <typename T>
__device__ void load_rows(T* dst, const T* src, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// The head's operands (one block's) and position t's step on S: a barrier (the last step's
// readers of sq / sk, and any element-wise copy of S before this call, are done), q_t and k_t
// into shared memory, a barrier, then recurrent_step (o_t written when out is not null).
template <typename T>
struct HeadInputs {
  const T *q, *k, *v, *g, *beta;
};
template <typename T>
__device__ void step_at(T* S, T* sq, T* sk, const HeadInputs<T>& in, const HeadRows& r, int64_t t, T* out,
                        const DeltaRuleShape& s) {
  __syncthreads();
  load_rows(sq, in.q + r.qk(s, t), s.dk);
  load_rows(sk, in.k + r.qk(s, t), s.dk);
  __syncthreads();
  recurrent_step(S, sq, sk, in.v + r.vo(s, t), exp_of(in.g[r.gb(s, t)]), in.beta[r.gb(s, t)],
                 out == nullptr ? nullptr : out + r.vo(s, t), s);
}

template <typename T>
__global__ void __launch_bounds__(kHeadThreads)
    delta_forward_kernel(const T* q, const T* k, const T* v, const T* g, const T* beta, const T* initial, T* out,
                         T* states, DeltaRuleShape s) {
  __shared__ T sq[kMaxDim], sk[kMaxDim];
  const HeadRows r = head_rows(s);
  const int64_t n = s.dk * s.dv;
  T* S = states + blockIdx.x * n;
  const T* S0 = initial == nullptr ? nullptr : initial + blockIdx.x * n;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) S[e] = S0 == nullptr ? T(0) : S0[e];
  const HeadInputs<T> in{q, k, v, g, beta};
  for (int64_t t = 0; t < s.T; ++t) step_at(S, sq, sk, in, r, t, out, s);
}

// The backward's scratch, per head: checkpoints (ceil(T / chunk) states), the chunk's states
// (chunk + 1), dS; then dq / dk per value head (B, T, Hv, dk) each.
struct BackwardScratch {
  int64_t cap;       // positions between checkpoints: min(chunk, max(T, 1)), as the CPU's
  int64_t chunks;    // checkpoints
  int64_t per_head;  // elements
  __host__ __device__ static BackwardScratch of(const DeltaRuleShape& s) {
    const int64_t cap = s.chunk < s.T ? s.chunk : (s.T > 0 ? s.T : 1);
    const int64_t chunks = (s.T + cap - 1) / cap;
    return BackwardScratch{cap, chunks, (chunks + cap + 2) * s.dk * s.dv};
  }
};

template <typename T>
__global__ void __launch_bounds__(kHeadThreads)
    delta_backward_kernel(const T* q, const T* k, const T* v, const T* g, const T* beta, const T* initial,
                          const T* dout, const T* dfinal, T* dq_part, T* dk_part, T* dv, T* dg, T* dbeta,
                          T* dinitial, T* scratch, DeltaRuleShape s) {
  __shared__ T sq[kMaxDim], sk[kMaxDim], sdo[kMaxDim], svmu[kMaxDim], sdu[kMaxDim], red[kHeadThreads];
  const HeadRows r = head_rows(s);
  const int64_t n = s.dk * s.dv, dvn = s.dv, dkn = s.dk;
  const BackwardScratch layout = BackwardScratch::of(s);
  const int64_t cap = layout.cap;
  T* ckpt = scratch + blockIdx.x * layout.per_head;
  T* states = ckpt + layout.chunks * n;  // (cap + 1) states
  T* dS = states + (cap + 1) * n;
  const int64_t head = blockIdx.x * n;

  // Forward sweep: S at the start of every chunk.
  const HeadInputs<T> in{q, k, v, g, beta};
  T* S = states;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) S[e] = initial == nullptr ? T(0) : initial[head + e];
  for (int64_t t = 0; t < s.T; ++t) {
    __syncthreads();  // the last step's column writes are done (a copy reads across columns)
    if (t % cap == 0) {
      T* c = ckpt + (t / cap) * n;
      for (int64_t e = threadIdx.x; e < n; e += blockDim.x) c[e] = S[e];
    }
    step_at(S, sq, sk, in, r, t, static_cast<T*>(nullptr), s);
  }
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) dS[e] = dfinal == nullptr ? T(0) : dfinal[head + e];

  for (int64_t c = layout.chunks - 1; c >= 0; --c) {
    const int64_t t0 = c * cap, len = min64(cap, s.T - t0);
    // The chunk's states S_{t0-1} .. S_{t0+len-1}: copies by element, steps by column, a barrier
    // between them.
    __syncthreads();  // the last chunk's readers of the states and writers of dS are done
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x) states[e] = ckpt[c * n + e];
    for (int64_t i = 0; i < len; ++i) {
      T* next = states + (i + 1) * n;
      __syncthreads();
      for (int64_t e = threadIdx.x; e < n; e += blockDim.x) next[e] = states[i * n + e];
      step_at(next, sq, sk, in, r, t0 + i, static_cast<T*>(nullptr), s);
    }
    for (int64_t i = len - 1; i >= 0; --i) {
      const int64_t t = t0 + i;
      const T* prev = states + i * n;
      const T* cur = states + (i + 1) * n;
      const T a = exp_of(g[r.gb(s, t)]), bt = beta[r.gb(s, t)];
      __syncthreads();  // every reader of the shared rows and of dS is done
      load_rows(sq, q + r.qk(s, t), dkn);
      load_rows(sk, k + r.qk(s, t), dkn);
      load_rows(sdo, dout + r.vo(s, t), dvn);
      __syncthreads();
      // Columns: dS += q do^T; u = P^T k with P = a S_{t-1}; v - u.
      const T* vt = v + r.vo(s, t);
      for (int64_t j = threadIdx.x; j < dvn; j += blockDim.x) {
        T u = 0;
        for (int64_t x = 0; x < dkn; ++x) {
          dS[x * dvn + j] += sq[x] * sdo[j];
          u += sk[x] * prev[x * dvn + j];
        }
        svmu[j] = vt[j] - a * u;
      }
      __syncthreads();
      // Rows: dq_t = S_t do; dk_t = beta dS (v - u). Columns: d(delta) = dS^T k, dv_t, du, dbeta.
      T* dq_row = dq_part + r.vo(s, t) / dvn * dkn;  // (b, t, h) row of the (B, T, Hv, dk) scratch
      T* dk_row = dk_part + r.vo(s, t) / dvn * dkn;
      for (int64_t x = threadIdx.x; x < dkn; x += blockDim.x) {
        T aq = 0, ak = 0;
        for (int64_t j = 0; j < dvn; ++j) {
          aq += cur[x * dvn + j] * sdo[j];
          ak += dS[x * dvn + j] * svmu[j];
        }
        dq_row[x] = aq;
        dk_row[x] = bt * ak;
      }
      T* dv_row = dv + r.vo(s, t);
      T db = 0;
      for (int64_t j = threadIdx.x; j < dvn; j += blockDim.x) {
        T dd = 0;
        for (int64_t x = 0; x < dkn; ++x) dd += dS[x * dvn + j] * sk[x];
        dv_row[j] = bt * dd;
        sdu[j] = -bt * dd;
        db += dd * svmu[j];
      }
      db = block_fold<kHeadThreads>(db, red, [](T p, T q2) { return p + q2; });  // barriers inside
      if (threadIdx.x == 0) dbeta[r.gb(s, t)] = db;
      // Rows: dk_t += a P^T du... as the CPU: dk += a S_{t-1} du. Columns: dP = dS + k du^T;
      // dg = <dP, S_{t-1}>; dS <- a dP.
      for (int64_t x = threadIdx.x; x < dkn; x += blockDim.x) {
        T acc = 0;
        for (int64_t j = 0; j < dvn; ++j) acc += prev[x * dvn + j] * sdu[j];
        dk_row[x] += a * acc;
      }
      __syncthreads();  // the rows' reads of dS (dk above) are done before the columns change it
      T dgp = 0;
      for (int64_t j = threadIdx.x; j < dvn; j += blockDim.x) {
        for (int64_t x = 0; x < dkn; ++x) {
          const T p = dS[x * dvn + j] + sk[x] * sdu[j];
          dgp += p * prev[x * dvn + j];
          dS[x * dvn + j] = a * p;
        }
      }
      dgp = block_fold<kHeadThreads>(dgp, red, [](T p, T q2) { return p + q2; });
      if (threadIdx.x == 0) dg[r.gb(s, t)] = a * dgp;
    }
  }
  __syncthreads();
  if (dinitial != nullptr) {
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x) dinitial[head + e] = dS[e];
  }
}

// dq / dk (B, T, Hk, dk) = the sums of each key head's value heads' rows, in value-head order.
template <typename T>
__global__ void __launch_bounds__(kBlock)
    delta_group_sum_kernel(const T* dq_part, const T* dk_part, T* dq, T* dk, DeltaRuleShape s) {
  const int64_t per = s.Hv / s.Hk, total = s.B * s.T * s.Hk * s.dk;
  for (int64_t e = thread_index(); e < total; e += thread_count()) {
    const int64_t x = e % s.dk, row = e / s.dk, hk = row % s.Hk, bt = row / s.Hk;
    T aq = 0, ak = 0;
    for (int64_t h = hk * per; h < (hk + 1) * per; ++h) {
      const int64_t at = (bt * s.Hv + h) * s.dk + x;
      aq += dq_part[at];
      ak += dk_part[at];
    }
    dq[e] = aq;
    dk[e] = ak;
  }
}

// ---------------------------------------------------------------- causal conv1d + SiLU
// x' row p of batch row b (p in [0, T + K - 1)): initial's row p (p < K - 1; zeros when null) or
// x's row p - K + 1.
template <typename T>
__device__ __forceinline__ T conv_input(const T* x, const T* initial, int64_t b, int64_t p, int64_t c, int64_t Tn,
                                        int64_t C, int64_t K) {
  if (p >= K - 1) return x[(b * Tn + p - K + 1) * C + c];
  return initial == nullptr ? T(0) : initial[(b * (K - 1) + p) * C + c];
}

// The pre-activation of (b, t, c): sum_i w[c, i] x'[t + i], i ascending (the CPU's order).
template <typename T>
__device__ __forceinline__ T conv_pre(const T* x, const T* w, const T* initial, int64_t b, int64_t t, int64_t c,
                                      int64_t Tn, int64_t C, int64_t K) {
  T pre = 0;
  for (int64_t i = 0; i < K; ++i) pre += w[c * K + i] * conv_input(x, initial, b, t + i, c, Tn, C, K);
  return pre;
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    conv_forward_kernel(const T* x, const T* w, const T* initial, T* y, int64_t B, int64_t Tn, int64_t C, int64_t K) {
  for (int64_t e = thread_index(); e < B * Tn * C; e += thread_count()) {
    const int64_t c = e % C, t = (e / C) % Tn, b = e / (C * Tn);
    const T z = conv_pre(x, w, initial, b, t, c, Tn, C, K);
    y[e] = z * sigmoid_of(z);
  }
}

// final row j = x' row T + j (j < K - 1), a thread per (b, c) walking j upwards, so final may be
// initial itself (row T + j > j is read before it is overwritten, as the CPU's order).
template <typename T>
__global__ void __launch_bounds__(kBlock)
    conv_final_kernel(const T* x, const T* initial, T* final_state, int64_t B, int64_t Tn, int64_t C, int64_t K) {
  for (int64_t e = thread_index(); e < B * C; e += thread_count()) {
    const int64_t c = e % C, b = e / C;
    for (int64_t j = 0; j < K - 1; ++j) {
      final_state[(b * (K - 1) + j) * C + c] = conv_input(x, initial, b, Tn + j, c, Tn, C, K);
    }
  }
}

// d(pre) = dy silu'(pre), silu'(z) = s (1 + z (1 - s)).
template <typename T>
__global__ void __launch_bounds__(kBlock) conv_dpre_kernel(const T* x, const T* w, const T* initial, const T* dy,
                                                           T* dpre, int64_t B, int64_t Tn, int64_t C, int64_t K) {
  for (int64_t e = thread_index(); e < B * Tn * C; e += thread_count()) {
    const int64_t c = e % C, t = (e / C) % Tn, b = e / (C * Tn);
    const T z = conv_pre(x, w, initial, b, t, c, Tn, C, K), sg = sigmoid_of(z);
    dpre[e] = dy[e] * sg * (T(1) + z * (T(1) - sg));
  }
}

// d x'[p] = sum_i w[c, i] dpre[p - i] over the outputs reading x' row p: into dx (p >= K - 1) or
// dinitial (p < K - 1, where not null).
template <typename T>
__global__ void __launch_bounds__(kBlock) conv_dx_kernel(const T* w, const T* dpre, T* dx, T* dinitial, int64_t B,
                                                         int64_t Tn, int64_t C, int64_t K) {
  const int64_t span = Tn + K - 1;
  for (int64_t e = thread_index(); e < B * span * C; e += thread_count()) {
    const int64_t c = e % C, p = (e / C) % span, b = e / (C * span);
    T* dst = p >= K - 1 ? dx + (b * Tn + p - K + 1) * C + c
                        : (dinitial == nullptr ? nullptr : dinitial + (b * (K - 1) + p) * C + c);
    if (dst == nullptr) continue;
    T acc = 0;
    for (int64_t i = 0; i < K; ++i) {
      const int64_t t = p - i;  // the output whose tap i reads x' row p
      if (t < 0 || t >= Tn) continue;
      acc += w[c * K + i] * dpre[(b * Tn + t) * C + c];
    }
    *dst = acc;
  }
}

// dweight[c, i] += sum over (b, t) in order of dpre[b, t, c] x'[b, t + i, c]: a thread per (c, i).
template <typename T>
__global__ void __launch_bounds__(kBlock) conv_dweight_kernel(const T* x, const T* initial, const T* dpre, T* dweight,
                                                              int64_t B, int64_t Tn, int64_t C, int64_t K) {
  for (int64_t e = thread_index(); e < C * K; e += thread_count()) {
    const int64_t c = e / K, i = e % K;
    T acc = 0;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < Tn; ++t) acc += dpre[(b * Tn + t) * C + c] * conv_input(x, initial, b, t + i, c, Tn, C, K);
    }
    dweight[e] += acc;
  }
}

// ---------------------------------------------------------------- the gates
template <typename T>
__global__ void __launch_bounds__(kBlock) gates_forward_kernel(const T* ba, const T* a_log, const T* dt_bias, T* g,
                                                               T* beta, int64_t N, int64_t H) {
  for (int64_t e = thread_index(); e < N * H; e += thread_count()) {
    const int64_t h = e % H, row = e / H;
    beta[e] = sigmoid_of(ba[row * 2 * H + h]);
    g[e] = -exp_of(a_log[h]) * softplus_of(ba[row * 2 * H + H + h] + dt_bias[h]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlock) gates_backward_kernel(const T* ba, const T* a_log, const T* dt_bias,
                                                                const T* dg, const T* dbeta, T* dba, int64_t N,
                                                                int64_t H) {
  for (int64_t e = thread_index(); e < N * H; e += thread_count()) {
    const int64_t h = e % H, row = e / H;
    const T sb = sigmoid_of(ba[row * 2 * H + h]);
    dba[row * 2 * H + h] = dbeta[e] * sb * (T(1) - sb);
    dba[row * 2 * H + H + h] = -dg[e] * exp_of(a_log[h]) * softplus_grad(ba[row * 2 * H + H + h] + dt_bias[h]);
  }
}

// A block per head h: da_log[h] += sum_n dg g, ddt_bias[h] += sum_n d(a) (strided partial sums,
// then a fixed tree).
template <typename T>
__global__ void __launch_bounds__(kBlock) gates_sums_kernel(const T* ba, const T* a_log, const T* dt_bias, const T* dg,
                                                            const T* dba, T* da_log, T* ddt_bias, int64_t N, int64_t H) {
  __shared__ T red[kBlock];
  const int64_t h = blockIdx.x;
  const T A = exp_of(a_log[h]);
  T sa = 0, sb = 0;
  for (int64_t row = threadIdx.x; row < N; row += kBlock) {
    sa += dg[row * H + h] * (-A * softplus_of(ba[row * 2 * H + H + h] + dt_bias[h]));
    sb += dba[row * 2 * H + H + h];
  }
  sa = block_fold<kBlock>(sa, red, [](T p, T q) { return p + q; });
  sb = block_fold<kBlock>(sb, red, [](T p, T q) { return p + q; });
  if (threadIdx.x == 0) {
    da_log[h] += sa;
    ddt_bias[h] += sb;
  }
}

}  // namespace

size_t delta_rule_forward_scratch_bytes(const DeltaRuleShape& s, size_t elem_bytes) {
  return align256(static_cast<size_t>(s.B * s.Hv * s.dk * s.dv) * elem_bytes);
}

template <typename T>
void delta_rule_forward(const T* q, const T* k, const T* v, const T* g, const T* beta, const T* initial, T* out,
                        T* final_state, void* scratch, const DeltaRuleShape& s, cudaStream_t stream) {
  if (s.B * s.Hv == 0) return;
  T* states = final_state != nullptr ? final_state : static_cast<T*>(scratch);
  launch<delta_forward_kernel<T>>(static_cast<unsigned>(s.B * s.Hv), kHeadThreads, 0, stream, q, k, v, g, beta,
                                  initial, out, states, s);
  LOOM_CUDA_CHECK_LAUNCH();
}

size_t delta_rule_backward_scratch_bytes(const DeltaRuleShape& s, size_t elem_bytes) {
  const BackwardScratch b = BackwardScratch::of(s);
  return align256(static_cast<size_t>(s.B * s.Hv * b.per_head) * elem_bytes) +
         2 * align256(static_cast<size_t>(s.B * s.T * s.Hv * s.dk) * elem_bytes);
}

template <typename T>
void delta_rule_backward(const T* q, const T* k, const T* v, const T* g, const T* beta, const T* initial,
                         const T* dout, const T* dfinal, T* dq, T* dk, T* dv, T* dg, T* dbeta, T* dinitial,
                         void* scratch, const DeltaRuleShape& s, cudaStream_t stream) {
  if (s.B * s.Hv == 0) return;
  const BackwardScratch b = BackwardScratch::of(s);
  char* base = static_cast<char*>(scratch);
  T* heads = reinterpret_cast<T*>(base);
  base += align256(static_cast<size_t>(s.B * s.Hv * b.per_head) * sizeof(T));
  T* dq_part = reinterpret_cast<T*>(base);
  base += align256(static_cast<size_t>(s.B * s.T * s.Hv * s.dk) * sizeof(T));
  T* dk_part = reinterpret_cast<T*>(base);
  launch<delta_backward_kernel<T>>(static_cast<unsigned>(s.B * s.Hv), kHeadThreads, 0, stream, q, k, v, g, beta,
                                   initial, dout, dfinal, dq_part, dk_part, dv, dg, dbeta, dinitial, heads, s);
  LOOM_CUDA_CHECK_LAUNCH();
  launch<delta_group_sum_kernel<T>>(grid_for(s.B * s.T * s.Hk * s.dk, kBlock), kBlock, 0, stream, dq_part, dk_part,
                                    dq, dk, s);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void causal_conv1d_silu_forward(const T* x, const T* weight, const T* initial, T* y, T* final_state, int64_t B,
                                int64_t Tn, int64_t C, int64_t K, cudaStream_t stream) {
  if (B * Tn * C > 0) {
    launch<conv_forward_kernel<T>>(grid_for(B * Tn * C, kBlock), kBlock, 0, stream, x, weight, initial, y, B, Tn, C, K);
    LOOM_CUDA_CHECK_LAUNCH();
  }
  if (final_state != nullptr && K > 1 && B * C > 0) {
    launch<conv_final_kernel<T>>(grid_for(B * C, kBlock), kBlock, 0, stream, x, initial, final_state, B, Tn, C, K);
    LOOM_CUDA_CHECK_LAUNCH();
  }
}

size_t causal_conv1d_silu_backward_scratch_bytes(int64_t B, int64_t Tn, int64_t C, size_t elem_bytes) {
  return align256(static_cast<size_t>(std::max<int64_t>(B * Tn * C, 1)) * elem_bytes);
}

template <typename T>
void causal_conv1d_silu_backward(const T* x, const T* weight, const T* initial, const T* dy, T* dx, T* dweight,
                                 T* dinitial, void* scratch, int64_t B, int64_t Tn, int64_t C, int64_t K,
                                 cudaStream_t stream) {
  T* dpre = static_cast<T*>(scratch);
  if (B * Tn * C > 0) {
    launch<conv_dpre_kernel<T>>(grid_for(B * Tn * C, kBlock), kBlock, 0, stream, x, weight, initial, dy, dpre, B, Tn,
                                C, K);
    LOOM_CUDA_CHECK_LAUNCH();
  }
  if (B * (Tn + K - 1) * C > 0) {
    launch<conv_dx_kernel<T>>(grid_for(B * (Tn + K - 1) * C, kBlock), kBlock, 0, stream, weight, dpre, dx, dinitial,
                              B, Tn, C, K);
    LOOM_CUDA_CHECK_LAUNCH();
  }
  if (C * K > 0) {
    launch<conv_dweight_kernel<T>>(grid_for(C * K, kBlock), kBlock, 0, stream, x, initial, dpre, dweight, B, Tn, C, K);
    LOOM_CUDA_CHECK_LAUNCH();
  }
}

template <typename T>
void delta_gates_forward(const T* ba, const T* a_log, const T* dt_bias, T* g, T* beta, int64_t N, int64_t H,
                         cudaStream_t stream) {
  if (N * H == 0) return;
  launch<gates_forward_kernel<T>>(grid_for(N * H, kBlock), kBlock, 0, stream, ba, a_log, dt_bias, g, beta, N, H);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void delta_gates_backward(const T* ba, const T* a_log, const T* dt_bias, const T* dg, const T* dbeta, T* dba,
                          T* da_log, T* ddt_bias, int64_t N, int64_t H, cudaStream_t stream) {
  if (H == 0) return;
  if (N > 0) {
    launch<gates_backward_kernel<T>>(grid_for(N * H, kBlock), kBlock, 0, stream, ba, a_log, dt_bias, dg, dbeta, dba,
                                     N, H);
    LOOM_CUDA_CHECK_LAUNCH();
  }
  launch<gates_sums_kernel<T>>(static_cast<unsigned>(H), kBlock, 0, stream, ba, a_log, dt_bias, dg, dba, da_log,
                               ddt_bias, N, H);
  LOOM_CUDA_CHECK_LAUNCH();
}

#define LOOM_LINEAR_ATTENTION_INSTANTIATE(T)                                                                        \
  template void delta_rule_forward<T>(const T*, const T*, const T*, const T*, const T*, const T*, T*, T*, void*,    \
                                      const DeltaRuleShape&, cudaStream_t);                                         \
  template void delta_rule_backward<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*,        \
                                       const T*, T*, T*, T*, T*, T*, T*, void*, const DeltaRuleShape&, cudaStream_t); \
  template void causal_conv1d_silu_forward<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t, int64_t,      \
                                              int64_t, cudaStream_t);                                               \
  template void causal_conv1d_silu_backward<T>(const T*, const T*, const T*, const T*, T*, T*, T*, void*, int64_t,  \
                                               int64_t, int64_t, int64_t, cudaStream_t);                            \
  template void delta_gates_forward<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t, cudaStream_t);       \
  template void delta_gates_backward<T>(const T*, const T*, const T*, const T*, const T*, T*, T*, T*, int64_t,      \
                                        int64_t, cudaStream_t);
LOOM_LINEAR_ATTENTION_INSTANTIATE(float)
LOOM_LINEAR_ATTENTION_INSTANTIATE(double)
#undef LOOM_LINEAR_ATTENTION_INSTANTIATE

}  // namespace loom::cuda
