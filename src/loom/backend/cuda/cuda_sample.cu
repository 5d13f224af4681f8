// Backend::sample_rows: the sampling rule (backend/sampling_rule.h) on the GPU, the token the host
// reference (backend/sampling.cpp) draws, bit for bit: the probabilities by the same fast_exp with
// no contraction (-fmad=false: CMakeLists.txt LOOM_NO_CONTRACT_CUDA), integer weights whose sums
// are exact in any order, the draw's double products rounded once on both sides.
//
//   penalty_kernel       OpenAI's presence and frequency penalties subtracted from the logits in
//                        place, a thread per (row, token) entry (the host's float subtraction).
//   sample_keys_kernel   a block of 256 per row: the row's largest logit (NaN ignored), then each
//                        token's key (~bits of p: ascending keys are descending p) and value
//                        (row x V + token), and the row's weight sum. Reads V logits, writes 8 V bytes.
//   radix_sort_pairs     (cuda_sort.h) by the keys' 31 low bits, stably: the values in p order,
//                        ties in token order; then the values by their row (value / V), stably:
//                        each row's tokens in the rule's order, rows apart. Two CUB / rocPRIM sorts
//                        of rows x V pairs.
//   sample_draw_kernel   a block of 512 per row: greedy rows take the first largest logit; the
//                        others sum the top_k's weights, find the nucleus (the first prefix sum
//                        >= top_p x that sum) and the draw (the first prefix sum > u x the kept
//                        sum) by block scans over chunks of 4096 of the order, each stopping at
//                        the chunk that holds the answer. Reads 4 + 4 bytes (order, gathered
//                        logit) per token scanned, writes 4 bytes a row.
//
// Cost at a 128k vocabulary (roofline, unmeasured): the two sorts of rows x V pairs dominate,
// about 10 passes of 16 bytes an element (sorting 2M pairs at batch 16 reads and writes about
// 0.3 GB: ~0.1 ms at 3.35 TB/s, more with CUB's launch overhead at batch 1: ~50 us); the host
// sampler took 1.7 ms a row on a 2-core EPYC, which this replaces, and the logits stay on the device.
#include "loom/backend/cuda/cuda_device.h"
// cuda_device.h first: under HIP it makes the rule's functions host and device.
#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/backend/cuda/cuda_philox.h"
#include "loom/backend/cuda/cuda_sample.h"
#include "loom/backend/cuda/cuda_sort.h"

#include <climits>

namespace loom::cuda {
namespace {

constexpr int kKeyThreads = 256;
constexpr int kDrawThreads = 512;
constexpr int kPerThread = 8;
constexpr int64_t kChunk = int64_t{kDrawThreads} * kPerThread;
constexpr int kDrawWarps = kDrawThreads / kWarp;

int key_bits(uint64_t largest) {
  int bits = 1;
  while (bits < 32 && (largest >> bits) != 0) ++bits;
  return bits;
}

__device__ __forceinline__ float philox_uniform(uint32_t bits) {
  return (static_cast<float>(bits >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

__global__ void __launch_bounds__(kKeyThreads)
    sample_keys_kernel(const float* __restrict__ logits, int64_t V, const RowSampling* __restrict__ rows,
                       float* __restrict__ row_max, unsigned long long* __restrict__ sums, uint32_t* __restrict__ keys,
                       uint32_t* __restrict__ vals) {
  __shared__ float best[kKeyThreads];
  __shared__ unsigned long long part[kKeyThreads];
  const int64_t r = blockIdx.x;
  const float* row = logits + r * V;
  const float T = rows[r].temperature;
  float m = -CUDART_INF_F;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) m = sampling::max_ignoring_nan(m, row[i]);
  best[threadIdx.x] = m;
  __syncthreads();
  for (int half = kKeyThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) {
      best[threadIdx.x] = sampling::max_ignoring_nan(best[threadIdx.x], best[threadIdx.x + half]);
    }
    __syncthreads();
  }
  m = best[0];
  unsigned long long sum = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float p = sampling::probability(row[i], m, T);
    keys[r * V + i] = sampling::order_key(p);
    vals[r * V + i] = static_cast<uint32_t>(r * V + i);
    sum += sampling::weight(p);
  }
  part[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kKeyThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) row_max[r] = m, sums[r] = part[0];
}

// OpenAI's penalties, one thread per (row, token) entry: logit -= amount, as the host subtracts it.
__global__ void penalty_kernel(float* __restrict__ logits, int64_t V, const SamplePenalty* __restrict__ penalties,
                               int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const SamplePenalty p = penalties[i];
    logits[static_cast<int64_t>(p.row) * V + p.token] -= p.amount;
  }
}

__global__ void row_of_kernel(const uint32_t* __restrict__ vals, int64_t n, uint32_t V, uint32_t* __restrict__ keys) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) keys[i] = vals[i] / V;
}

// The block's exclusive prefix of each thread's s, and the block's total (every thread calls).
__device__ unsigned long long block_exclusive_scan(unsigned long long s, unsigned long long* warp_sums,
                                                   unsigned long long& total) {
  const int lane = lane_id(), warp = static_cast<int>(threadIdx.x) / kWarp;
  unsigned long long v = s;
  for (int d = 1; d < kWarp; d *= 2) {
    const unsigned long long t = shfl(v, lane >= d ? lane - d : 0);
    if (lane >= d) v += t;
  }
  if (lane == kWarp - 1) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    unsigned long long w = lane < kDrawWarps ? warp_sums[lane] : 0;
    for (int d = 1; d < kWarp; d *= 2) {
      const unsigned long long t = shfl(w, lane >= d ? lane - d : 0);
      if (lane >= d) w += t;
    }
    if (lane < kDrawWarps) warp_sums[lane] = w;  // inclusive over the warps
  }
  __syncthreads();
  total = warp_sums[kDrawWarps - 1];
  const unsigned long long before = warp > 0 ? warp_sums[warp - 1] : 0;
  __syncthreads();  // warp_sums is free again
  return before + v - s;
}

// The smallest v of the block's threads, to every thread (a tree of xor shuffles per warp, then
// the warps' minima through shared memory; no shared-memory atomics).
__device__ int block_min(int v) {
  __shared__ int warp_min[kDrawWarps];
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v = min(v, shfl_xor(v, offset));
  if (lane_id() == 0) warp_min[threadIdx.x / kWarp] = v;
  __syncthreads();
  int m = INT_MAX;
  for (int w = 0; w < kDrawWarps; ++w) m = min(m, warp_min[w]);
  __syncthreads();  // warp_min is free again
  return m;
}

struct DrawRow {
  const float* row;      // the row's logits
  const uint32_t* order; // the row's values in the rule's order (row x V + token)
  uint32_t base;         // row x V
  float m, T;
};

__device__ __forceinline__ uint64_t weight_at(const DrawRow& d, int64_t i) {
  return sampling::weight(sampling::probability(d.row[d.order[i] - d.base], d.m, d.T));
}

struct Found {
  int64_t index;  // -1: none
  unsigned long long prefix;
};

// The first i < keep whose inclusive prefix sum of weights is > x (strict) or >= x; every thread
// of the block calls and gets the same answer.
__device__ Found first_prefix(const DrawRow& d, int64_t keep, double x, bool strict) {
  __shared__ unsigned long long warp_sums[kDrawWarps];
  __shared__ unsigned long long found_prefix;
  unsigned long long carry = 0;
  for (int64_t base = 0; base < keep; base += kChunk) {
    const int64_t first = base + static_cast<int64_t>(threadIdx.x) * kPerThread;
    uint64_t w[kPerThread];
    unsigned long long s = 0;
    for (int j = 0; j < kPerThread; ++j) {
      w[j] = first + j < keep ? weight_at(d, first + j) : 0;
      s += w[j];
    }
    unsigned long long chunk = 0;
    const unsigned long long before = carry + block_exclusive_scan(s, warp_sums, chunk);
    unsigned long long pre = before;
    int mine = INT_MAX;  // this thread's first index meeting the condition, in the chunk
    for (int j = 0; j < kPerThread && first + j < keep; ++j) {
      pre += w[j];
      const double p = static_cast<double>(pre);
      if (strict ? p > x : p >= x) {
        mine = static_cast<int>(first - base + j);
        break;
      }
    }
    const int f = block_min(mine);
    if (f != INT_MAX) {
      if (f / kPerThread == static_cast<int>(threadIdx.x)) {
        unsigned long long at = before;
        for (int j = 0; j <= f % kPerThread; ++j) at += w[j];
        found_prefix = at;
      }
      __syncthreads();
      return Found{base + f, found_prefix};
    }
    carry += chunk;
  }
  return Found{-1, 0};
}

__global__ void __launch_bounds__(kDrawThreads)
    sample_draw_kernel(const float* __restrict__ logits, int64_t V, const RowSampling* __restrict__ rows,
                       const float* __restrict__ row_max, const unsigned long long* __restrict__ sums,
                       const uint32_t* __restrict__ order, int32_t* __restrict__ out) {
  __shared__ unsigned long long part[kDrawThreads];
  const int64_t r = blockIdx.x;
  const RowSampling rs = rows[r];
  DrawRow d{logits + r * V, order + r * V, static_cast<uint32_t>(r * V), row_max[r], rs.temperature};
  if (rs.temperature == 0.0f) {  // greedy: the first largest logit (0 when every logit is NaN)
    int mine = INT_MAX;
    for (int64_t i = threadIdx.x; i < V && mine == INT_MAX; i += blockDim.x) {
      if (d.row[i] == d.m) mine = static_cast<int>(i);
    }
    const int first_max = block_min(mine);
    if (threadIdx.x == 0) out[r] = first_max == INT_MAX ? 0 : first_max;
    return;
  }
  int64_t keep = rs.top_k > 0 && rs.top_k < V ? rs.top_k : V;
  unsigned long long total = sums[r];
  if (keep < V) {
    unsigned long long s = 0;
    for (int64_t i = threadIdx.x; i < keep; i += blockDim.x) s += weight_at(d, i);
    part[threadIdx.x] = s;
    __syncthreads();
    for (int half = kDrawThreads / 2; half > 0; half /= 2) {
      if (static_cast<int>(threadIdx.x) < half) part[threadIdx.x] += part[threadIdx.x + half];
      __syncthreads();
    }
    total = part[0];
  }
  if (rs.top_p < 1.0f) {
    const Found nucleus = first_prefix(d, keep, static_cast<double>(rs.top_p) * static_cast<double>(total), false);
    if (nucleus.index >= 0) keep = nucleus.index + 1, total = nucleus.prefix;
  }
  const Philox4 bits = philox4x32_10(static_cast<uint32_t>(rs.draw), static_cast<uint32_t>(rs.draw >> 32), 1, 0,
                                     static_cast<uint32_t>(rs.seed), static_cast<uint32_t>(rs.seed >> 32));
  const double x = static_cast<double>(philox_uniform(bits.v[0])) * static_cast<double>(total);
  const Found token = first_prefix(d, keep, x, true);
  if (threadIdx.x == 0) out[r] = static_cast<int32_t>(d.order[token.index >= 0 ? token.index : 0] - d.base);
}

}  // namespace

SampleLayout sample_layout(int64_t rows, int64_t V, int64_t penalties) {
  const int64_t n = rows * V;
  SampleLayout at;
  size_t off = 0;
  const auto take = [&](size_t bytes) {
    const size_t at_ = off;
    off += align256(bytes);
    return at_;
  };
  at.rows_at = off;
  at.penalties_at = at.rows_at + align256(static_cast<size_t>(rows) * sizeof(RowSampling));
  off = at.penalties_at;
  take(static_cast<size_t>(penalties) * sizeof(SamplePenalty));
  at.max_at = take(static_cast<size_t>(rows) * sizeof(float));
  at.sums_at = take(static_cast<size_t>(rows) * sizeof(unsigned long long));
  at.keys_a = take(static_cast<size_t>(n) * 4);
  at.vals_a = take(static_cast<size_t>(n) * 4);
  at.keys_b = take(static_cast<size_t>(n) * 4);
  at.vals_b = take(static_cast<size_t>(n) * 4);
  at.temp_bytes = std::max(radix_sort_pairs_bytes(n, 31), radix_sort_pairs_bytes(n, key_bits(static_cast<uint64_t>(rows - 1))));
  at.temp_at = take(at.temp_bytes);
  at.bytes = off;
  return at;
}

void sample_rows(void* ws, const SampleLayout& at, float* logits, int64_t rows, int64_t V, int64_t penalties,
                 int32_t* out, cudaStream_t stream) {
  char* w = static_cast<char*>(ws);
  const auto* table = reinterpret_cast<const RowSampling*>(w + at.rows_at);
  if (penalties > 0) {
    launch<penalty_kernel>(dim3(grid_for(penalties, 256)), 256, 0, stream, logits, V,
                           reinterpret_cast<const SamplePenalty*>(w + at.penalties_at), penalties);
    LOOM_CUDA_CHECK_LAUNCH();
  }
  auto* row_max = reinterpret_cast<float*>(w + at.max_at);
  auto* sums = reinterpret_cast<unsigned long long*>(w + at.sums_at);
  auto* keys_a = reinterpret_cast<uint32_t*>(w + at.keys_a);
  auto* vals_a = reinterpret_cast<uint32_t*>(w + at.vals_a);
  auto* keys_b = reinterpret_cast<uint32_t*>(w + at.keys_b);
  auto* vals_b = reinterpret_cast<uint32_t*>(w + at.vals_b);
  void* temp = w + at.temp_at;
  const int64_t n = rows * V;
  const dim3 grid(static_cast<unsigned>(rows));
  launch<sample_keys_kernel>(grid, kKeyThreads, 0, stream, logits, V, table, row_max, sums, keys_a, vals_a);
  LOOM_CUDA_CHECK_LAUNCH();
  radix_sort_pairs(temp, at.temp_bytes, keys_a, keys_b, vals_a, vals_b, n, 31, stream);
  const uint32_t* order = vals_b;
  if (rows > 1) {
    launch<row_of_kernel>(dim3(grid_for(n, 256)), 256, 0, stream, vals_b, n, static_cast<uint32_t>(V), keys_a);
    LOOM_CUDA_CHECK_LAUNCH();
    radix_sort_pairs(temp, at.temp_bytes, keys_a, keys_b, vals_b, vals_a, n, key_bits(static_cast<uint64_t>(rows - 1)),
                     stream);
    order = vals_a;
  }
  launch<sample_draw_kernel>(grid, kDrawThreads, 0, stream, logits, V, table, row_max, sums, order, out);
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace loom::cuda
