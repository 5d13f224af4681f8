// CUDA kernels of the backend (all of cuda_kernels.h but attention, which is cuda_attention.cu;
// the cross-entropy is cuda_loss.cu).
// Every kernel computes exactly the formula of its CPU twin in cpu/cpu_kernels.h, in T (float for
// training, double for reference checks), with the same operation order where it is a formula
// (the order of a long sum differs: it is a fixed tree here, see "Determinism").
//
// Math (legend of backend.h: N rows, C channels, V vocab, T sequence, F MLP hidden):
//   fill            x[i] = value
//   cast            f32 -> bf16 round to nearest even (NaN stays a quiet NaN), bf16 -> f32 exact
//   add / scale     out[i] = a[i] + b[i];  x[i] *= factor
//   reduce_partials partial[k] = sum over i = k*256 + tid (mod 256*256) of f(x[i]), f = x or x^2, in double
//   add_bias_rows   c[r, j] += bias[j]
//   column sums     acc[j] += sum_r x[r, j]
//   embedding fwd   out[n] = table[tok[n]] (+ positions[n % T])
//   embedding bwd   dtable[tok[n]] += dout[n];  dpositions[n % T] += dout[n]
//   layernorm fwd   m = mean(x); var = mean((x - m)^2); s = 1 / sqrt(var + eps); out = (x - m) s w + b
//   layernorm bwd   xhat = (x - m) s; g = dout w; dx = s (g - mean(g) - xhat mean(g xhat));
//                   dw += sum_rows dout xhat; db += sum_rows dout
//   rmsnorm fwd     s = 1 / sqrt(mean(x^2) + eps); out = x s w
//   rmsnorm bwd     xhat = x s; g = dout w; dx = s (g - xhat mean(g xhat)); dw += sum_rows dout xhat
//   gelu fwd        y = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)
//   gelu bwd        dx = dout (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 0.044715 x^2))
//   glu fwd         out = act(gate) up: silu(g) = g sigmoid(g) (SwiGLU) or gelu_tanh(g) (GeGLU)
//   glu bwd         dgate = dout up act'(g) (silu' = sigmoid(g) (1 + g (1 - sigmoid(g)))); dup = dout act(g)
//   rope            (a, c) = (v[j], v[j + hd/2]) -> (a cos - c sin, c cos + a sin),
//                   angle = direction (pos_offset + t) theta^(-2j/hd), computed in double
//   adamw           g = grad grad_scale; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
//                   p = p (1 - lr wd) - lr (m / bias1) / (sqrt(v / bias2) + eps)
// exp, tanh and sigmoid are backend/scalar_math.h's, the CPU kernels' own functions (a Cody-Waite
// exp with a degree-7 polynomial in float; libm in double), so both backends evaluate the same one.
//
// Determinism: no floating-point atomics. Every sum has a fixed shape (fixed partition into
// threads, fixed shuffle trees, partials combined in index order), so a run is bitwise equal to
// the previous one on the same GPU. The only atomics are integer atomicMin on the "bad id" slot
// (order-independent) and the integer atomics inside the library's radix sort (CUB, or rocPRIM
// under HIP: cuda_sort.h; its output, a stable sort, is unique).

#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)
#include "loom/backend/cuda/cuda_kernels.h"

#include <algorithm>
#include <climits>
#include <cstdint>

#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/backend/cuda/cuda_sort.h"
#include "loom/backend/scalar_math.h"

namespace loom::cuda {
namespace {

// ---------------------------------------------------------------- launch shapes
// (kWarp, kMaxBlocks, grid_for, thread_index / thread_count, warp_sum, sqrt_of, log_of: cuda_device.h)
constexpr int kBlock = 256;                    // threads per block of the 1-D kernels
constexpr int kRowsPerBlock = kBlock / kWarp;  // warp-per-row kernels: 8 rows per block
// Loads each lane of a warp-per-row kernel has in flight before it adds them (in the order of the
// plain loop over c = lane, lane + 32, ...: the same bits). The plain loop waits for each load in
// turn: at 4,096 channels (128 dependent round trips) rmsnorm took 61 us a row on an H200
// (2026-12-04, ncu), 4 ms of a Llama-3-8B decode step's 14.
constexpr int kLaneLoads = 16;

// ---------------------------------------------------------------- scalar math
// exp, tanh and sigmoid: backend/scalar_math.h's, the CPU kernels' own functions.
using math::exp_t;
using math::fast_exp;
using math::sigmoid_t;
using math::tanh_t;

// ---------------------------------------------------------------- elementwise
// Grid-stride, kBlock threads, grid_for(n, kBlock) blocks.
template <typename T>
__global__ void fill_kernel(T* x, int64_t n, T value) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) x[i] = value;
}

// f32 -> bf16 of core/dtype.h (cuda_device.h bf16_bits).
__global__ void cast_f32_to_bf16_kernel(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) dst[i] = bf16_bits(src[i]);
}

// An op's output element: as computed (O = T), or rounded to bf16 bits as the cast above (O =
// uint16_t with T = float: precision.activations = bf16, the producer writing the saved field).
template <typename T>
__device__ __forceinline__ void store_out(T* p, T v) {
  *p = v;
}
__device__ __forceinline__ void store_out(uint16_t* p, float v) { *p = bf16_bits(v); }

// An op's input element as T: stored as T, or bf16 bits (S = uint16_t, T = float) widened exactly.
template <typename T, typename S>
__device__ __forceinline__ T load_in(S v) {
  if constexpr (sizeof(S) == 2) return bf16_value(v);
  else return v;
}

__global__ void cast_bf16_to_f32_kernel(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    dst[i] = bf16_value(src[i]);
  }
}

__global__ void cast_f32_to_f64_kernel(const float* src, double* dst, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) dst[i] = static_cast<double>(src[i]);
}

__global__ void cast_f64_to_f32_kernel(const double* src, float* dst, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) dst[i] = static_cast<float>(src[i]);
}

// out may alias a or b: each element is read, then written, by the same thread.
template <typename T>
__global__ void add_kernel(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) out[i] = a[i] + b[i];
}

template <typename T>
__global__ void scale_kernel(T* x, int64_t n, T factor) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) x[i] *= factor;
}

// Exactly kReducePartials blocks of kBlock threads. Thread (k, tid) sums, in double and in index
// order, the elements i = k * kBlock + tid + s * kReducePartials * kBlock; the block then folds its
// kBlock sums with a fixed halving tree. n = 0 writes zeros.
template <typename T>
__global__ void __launch_bounds__(kBlock) reduce_partials_kernel(const T* x, int64_t n, bool squares,
                                                                 double* partials) {
  __shared__ double sums[kBlock];
  double acc = 0.0;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const double v = static_cast<double>(x[i]);
    acc += squares ? v * v : v;
  }
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int half = kBlock / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = sums[0];
}

// Grid-stride over rows * cols elements.
template <typename T>
__global__ void add_bias_rows_kernel(T* c, const T* bias, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = thread_index(); i < n; i += thread_count()) c[i] += bias[i % cols];
}

__global__ void round_rows_bf16_kernel(const float* acc, const uint16_t* bias16, uint16_t* out, int64_t rows,
                                       int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    out[i] = bf16_bits(bias16 ? acc[i] + bf16_value(bias16[i % cols]) : acc[i]);
  }
}

// ---------------------------------------------------------------- deterministic column sums
// out_k[j] += sum_r f_k(r, j) for k < NV (NV = 1: bias / rmsnorm dw; NV = 2: layernorm dw and db).
// Pass 1: rows are cut into n_chunks chunks of chunk_rows (a function of `rows` only, so the
// result does not depend on the GPU). Block (32, 8) handles 32 columns of one chunk: lane = column,
// warp w sums rows r0 + w, r0 + w + 8, ... in order; warp 0 adds the 8 warp sums in order and
// writes partials[k][chunk][j]. Pass 2: one thread per column adds the chunk partials in chunk
// order and adds the total into out_k[j]. Scratch: NV * n_chunks * cols elements of T.
constexpr int kColTile = 32;           // columns per block (one per lane)
constexpr int kRowLanes = 8;           // warps per block, each a strided subset of the chunk's rows
constexpr int64_t kChunkRows = 256;    // rows per chunk, grown so there are at most kMaxChunks
constexpr int64_t kMaxChunks = 1024;

int64_t chunk_rows_for(int64_t rows) { return std::max<int64_t>(kChunkRows, (rows + kMaxChunks - 1) / kMaxChunks); }
int64_t chunks_for(int64_t rows) {
  const int64_t chunk_rows = chunk_rows_for(rows);
  return (rows + chunk_rows - 1) / chunk_rows;
}

template <typename T>
struct LoadRows {  // f(r, j) = x[r, j]
  const T* x;
  int64_t cols;
  __device__ void operator()(int64_t r, int64_t j, T* v) const { v[0] = x[r * cols + j]; }
};

struct LoadBf16Rows {  // f(r, j) = x[r, j] widened (bf16 bits)
  const uint16_t* x;
  int64_t cols;
  __device__ void operator()(int64_t r, int64_t j, float* v) const {
    v[0] = bf16_value(x[r * cols + j]);
  }
};

template <typename T>
struct LoadLayerNormGrads {  // f0 = dout (x - mean) rstd (dw), f1 = dout (db)
  const T* dout;
  const T* x;
  const T* mean;
  const T* rstd;
  int64_t cols;
  __device__ void operator()(int64_t r, int64_t j, T* v) const {
    const int64_t i = r * cols + j;
    const T g = dout[i];
    v[0] = g * (x[i] - mean[r]) * rstd[r];
    v[1] = g;
  }
};

template <typename T>
struct LoadRmsNormGrad {  // f0 = dout x rstd (dw)
  const T* dout;
  const T* x;
  const T* rstd;
  int64_t cols;
  __device__ void operator()(int64_t r, int64_t j, T* v) const {
    const int64_t i = r * cols + j;
    v[0] = dout[i] * x[i] * rstd[r];
  }
};

// Grid (ceil(cols / 32), n_chunks), block (32, 8).
template <typename T, int NV, typename F>
__global__ void __launch_bounds__(kColTile * kRowLanes) column_partials_kernel(F f, int64_t rows, int64_t cols,
                                                                               int64_t chunk_rows, T* partials) {
  __shared__ T sums[NV][kRowLanes][kColTile];
  const int lane = static_cast<int>(threadIdx.x), w = static_cast<int>(threadIdx.y);
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kColTile + lane;
  const int64_t chunk = blockIdx.y, n_chunks = gridDim.y;
  const int64_t r0 = chunk * chunk_rows, r1 = rows < r0 + chunk_rows ? rows : r0 + chunk_rows;
  T acc[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) acc[k] = T(0);
  if (j < cols) {
    for (int64_t r = r0 + w; r < r1; r += kRowLanes) {
      T v[NV];
      f(r, j, v);
#pragma unroll
      for (int k = 0; k < NV; ++k) acc[k] += v[k];
    }
  }
#pragma unroll
  for (int k = 0; k < NV; ++k) sums[k][w][lane] = acc[k];
  __syncthreads();
  if (w == 0 && j < cols) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      T s = sums[k][0][lane];
      for (int q = 1; q < kRowLanes; ++q) s += sums[k][q][lane];
      partials[(k * n_chunks + chunk) * cols + j] = s;
    }
  }
}

// One thread per column (grid-stride): out[j] += sum over chunks, in chunk order.
template <typename T>
__global__ void column_finalize_kernel(const T* partials, int64_t n_chunks, int64_t cols, T* out) {
  for (int64_t j = thread_index(); j < cols; j += thread_count()) {
    T s = partials[j];
    for (int64_t k = 1; k < n_chunks; ++k) s += partials[k * cols + j];
    out[j] += s;
  }
}

// out0 (and out1 when NV = 2) += the column sums of f; scratch holds NV * chunks_for(rows) * cols T.
template <typename T, int NV, typename F>
void column_sums(F f, int64_t rows, int64_t cols, T* scratch, T* out0, T* out1, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t chunk_rows = chunk_rows_for(rows), n_chunks = chunks_for(rows);
  const dim3 grid(static_cast<unsigned>((cols + kColTile - 1) / kColTile), static_cast<unsigned>(n_chunks));
  const dim3 block(kColTile, kRowLanes);
  launch<column_partials_kernel<T, NV, F>>(grid, block, 0, stream, f, rows, cols, chunk_rows, scratch);
  LOOM_CUDA_CHECK_LAUNCH();
  T* outs[2] = {out0, out1};
  for (int k = 0; k < NV; ++k) {
    launch<column_finalize_kernel<T>>(grid_for(cols, kBlock), kBlock, 0, stream, scratch + k * n_chunks * cols, n_chunks,
                                                                              cols, outs[k]);
    LOOM_CUDA_CHECK_LAUNCH();
  }
}

// ---------------------------------------------------------------- embedding
// One warp per token row, 8 rows per block, grid-stride over rows; lanes stride the channels.
// S: the table's element, T or bf16 bits (uint16_t) widened exactly into f32.
__device__ __forceinline__ float table_value(float v) { return v; }
__device__ __forceinline__ double table_value(double v) { return v; }
__device__ __forceinline__ float table_value(uint16_t v) { return __uint_as_float(static_cast<uint32_t>(v) << 16); }

template <typename T, typename S = T>
__global__ void embedding_forward_kernel(const int32_t* tokens, const S* table, const T* positions, T* out,
                                         int64_t n_tokens, int64_t seq_len, int64_t channels, int64_t vocab,
                                         unsigned long long* bad_position) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp; n < n_tokens;
       n += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int32_t token = tokens[n];
    T* o = out + n * channels;
    if (token < 0 || token >= vocab) {  // not read: the row is written 0 and the position recorded
      if (lane == 0) atomicMin(bad_position, static_cast<unsigned long long>(n));
      for (int64_t c = lane; c < channels; c += kWarp) o[c] = T(0);
      continue;
    }
    const S* row = table + static_cast<int64_t>(token) * channels;
    if (positions) {
      const T* pos = positions + (n % seq_len) * channels;
#pragma unroll 8
      for (int64_t c = lane; c < channels; c += kWarp) o[c] = table_value(row[c]) + pos[c];
    } else {
#pragma unroll 8
      for (int64_t c = lane; c < channels; c += kWarp) o[c] = table_value(row[c]);
    }
  }
}

// embedding_backward, dtable part. A stable radix sort (cuda_sort.h) of the pairs (key = token id, or
// bad_key(vocab) for an id outside [0, vocab), value = position) puts the positions of each token id
// together, in increasing position order. A segment is a run of equal keys; its rows are summed
// and added to dtable[key] by one block per 128-column slab, so each dtable element has exactly
// one writer and a fixed summation order:
//   block (32, 8): lane owns columns slab*128 + lane + 32q (q < 4); warp w sums the segment's
//   entries s + w, s + w + 8, ...; warp 0 adds the 8 warp sums in order and adds into dtable.
// Grid (ceil(C / 128), G): block y visits sorted indices y, y + G, ... and acts on those that
// start a segment. Cost: the sort (O(N), a few passes over 8 bytes per token) + one read of dout
// + one read-modify-write of the touched dtable rows; a token id occurring k times costs its
// block k / 8 row loads per warp (k = 16384, all tokens equal, is the worst case: 2048 loads).
constexpr int kSlabLanes = 4;                       // columns per lane
constexpr int kSlab = kColTile * kSlabLanes;        // 128 columns per block
constexpr int64_t kMaxSegmentGroups = 2048;         // grid.y cap

__global__ void embedding_keys_kernel(const int32_t* tokens, int64_t n_tokens, int64_t vocab, uint32_t bad,
                                      uint32_t* keys, uint32_t* positions, unsigned long long* bad_position) {
  for (int64_t i = thread_index(); i < n_tokens; i += thread_count()) {
    const int32_t token = tokens[i];
    if (token < 0 || token >= vocab) {
      keys[i] = bad;
      atomicMin(bad_position, static_cast<unsigned long long>(i));
    } else {
      keys[i] = static_cast<uint32_t>(token);
    }
    positions[i] = static_cast<uint32_t>(i);
  }
}

template <typename T>
__global__ void __launch_bounds__(kColTile * kRowLanes) embedding_dtable_kernel(const uint32_t* keys,
                                                                                const uint32_t* positions,
                                                                                const T* dout, T* dtable,
                                                                                int64_t n_tokens, int64_t channels,
                                                                                uint32_t bad) {
  __shared__ T sums[kRowLanes][kSlab];
  const int lane = static_cast<int>(threadIdx.x), w = static_cast<int>(threadIdx.y);
  const int tid = w * kColTile + lane;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kSlab + lane;
  for (int64_t s = blockIdx.y; s < n_tokens; s += gridDim.y) {
    const uint32_t key = keys[s];
    // Block-uniform: every thread reads the same keys.
    if (key == bad || (s > 0 && keys[s - 1] == key)) continue;
    // Segment end e: count matching keys 256 at a time (the run is contiguous).
    int64_t e = s;
    for (;;) {
      const int64_t i = e + tid;
      const int matches = __syncthreads_count(i < n_tokens && keys[i] == key);
      e += matches;
      if (matches < kColTile * kRowLanes) break;
    }
    T acc[kSlabLanes];
#pragma unroll
    for (int q = 0; q < kSlabLanes; ++q) acc[q] = T(0);
#pragma unroll 4
    for (int64_t i = s + w; i < e; i += kRowLanes) {
      const T* g = dout + static_cast<int64_t>(positions[i]) * channels;
#pragma unroll
      for (int q = 0; q < kSlabLanes; ++q) {
        const int64_t c = c0 + q * kColTile;
        if (c < channels) acc[q] += g[c];
      }
    }
#pragma unroll
    for (int q = 0; q < kSlabLanes; ++q) sums[w][lane + q * kColTile] = acc[q];
    __syncthreads();
    if (w == 0) {
      T* d = dtable + static_cast<int64_t>(key) * channels;
#pragma unroll
      for (int q = 0; q < kSlabLanes; ++q) {
        const int64_t c = c0 + q * kColTile;
        if (c < channels) {
          T total = sums[0][lane + q * kColTile];
          for (int k = 1; k < kRowLanes; ++k) total += sums[k][lane + q * kColTile];
          d[c] += total;
        }
      }
    }
    __syncthreads();
  }
}

// dpositions[t, c] += dout[t, c] + dout[T + t, c] + ..., added one by one in position order (the
// CPU's order, so this part is bitwise equal to the CPU). One thread per (t, c), grid-stride.
template <typename T>
__global__ void embedding_dpositions_kernel(const T* dout, T* dpositions, int64_t n_tokens, int64_t seq_len,
                                            int64_t channels) {
  const int64_t n = seq_len * channels;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t t = i / channels, c = i % channels;
    T acc = dpositions[i];
    for (int64_t k = t; k < n_tokens; k += seq_len) acc += dout[k * channels + c];
    dpositions[i] = acc;
  }
}

// The sort key of an id outside [0, vocab): above every valid id (int32 ids are < 2^31).
int64_t bad_key(int64_t vocab) { return std::min<int64_t>(vocab, int64_t{1} << 31); }
// Sort keys need bits for the values 0..bad_key(vocab).
int key_bits(int64_t vocab) {
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) <= bad_key(vocab)) ++bits;
  return bits;
}

// Scratch layout of embedding_backward: keys_in, keys_out, positions_in, positions_out (uint32 x N
// each, 256-byte aligned), then the sort's temporary storage (the library aligns inside it itself).
struct SortLayout {
  size_t array_bytes = 0;  // one uint32 array, rounded up to 256
  size_t cub_bytes = 0;
  size_t total() const { return 4 * array_bytes + cub_bytes; }
};

SortLayout sort_layout(int64_t n_tokens, int64_t vocab) {
  SortLayout layout;
  if (n_tokens <= 0) return layout;
  LOOM_CHECK(n_tokens <= INT32_MAX, "embedding_backward: ", n_tokens, " tokens, at most ", INT32_MAX, " supported");
  layout.array_bytes = align256(static_cast<size_t>(n_tokens) * sizeof(uint32_t));
  layout.cub_bytes = radix_sort_pairs_bytes(n_tokens, key_bits(vocab));
  return layout;
}

// ---------------------------------------------------------------- norms
// Warp per row (8 rows per block, grid-stride over rows), lanes stride the channels; row sums
// in T by warp_sum. Every loop bound is warp-uniform, so all 32 lanes reach each shuffle.
// Lane loads of a warp-per-row kernel: x[c], x[c + 32], ... (kLaneLoads of them), all in flight
// before the caller adds them in that order.
template <typename T>
__device__ __forceinline__ void lane_loads(const T* x, int64_t c, T (&v)[kLaneLoads]) {
#pragma unroll
  for (int u = 0; u < kLaneLoads; ++u) v[u] = x[c + u * kWarp];
}

// A norm backward's row sums: add(dout[c], w[c], x[c]) for this lane's c = lane, lane + 32, ... in
// that order, the three operands of kLaneLoads channels loaded before they are added (one load at
// a time left each lane waiting on every load: the forward's measured fault).
template <typename T, typename Add>
__device__ __forceinline__ void lane_backward_sums(const T* g, const T* w, const T* x, int64_t channels, Add&& add) {
  int64_t c = lane_id();
  for (; c + (kLaneLoads - 1) * kWarp < channels; c += kLaneLoads * kWarp) {
    T gv[kLaneLoads], wv[kLaneLoads], xv[kLaneLoads];
    lane_loads(g, c, gv);
    lane_loads(w, c, wv);
    lane_loads(x, c, xv);
#pragma unroll
    for (int u = 0; u < kLaneLoads; ++u) add(gv[u], wv[u], xv[u]);
  }
  for (; c < channels; c += kWarp) add(g[c], w[c], x[c]);
}

template <typename T, typename O>
__global__ void layernorm_forward_kernel(const T* x, const T* w, const T* b, O* out, T* mean, T* rstd, int64_t rows,
                                         int64_t channels, T eps) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const T* xr = x + r * channels;
    T sum = 0;
    int64_t c = lane;
    for (; c + (kLaneLoads - 1) * kWarp < channels; c += kLaneLoads * kWarp) {
      T v[kLaneLoads];
      lane_loads(xr, c, v);
#pragma unroll
      for (int u = 0; u < kLaneLoads; ++u) sum += v[u];
    }
    for (; c < channels; c += kWarp) sum += xr[c];
    const T m = warp_sum(sum) / static_cast<T>(channels);
    T var = 0;
    for (c = lane; c + (kLaneLoads - 1) * kWarp < channels; c += kLaneLoads * kWarp) {
      T v[kLaneLoads];
      lane_loads(xr, c, v);
#pragma unroll
      for (int u = 0; u < kLaneLoads; ++u) var += (v[u] - m) * (v[u] - m);
    }
    for (; c < channels; c += kWarp) var += (xr[c] - m) * (xr[c] - m);
    const T s = T(1) / sqrt_of(warp_sum(var) / static_cast<T>(channels) + eps);
    O* o = out + r * channels;
#pragma unroll 8
    for (int64_t k = lane; k < channels; k += kWarp) store_out(o + k, (xr[k] - m) * s * w[k] + b[k]);
    if (lane == 0) {
      mean[r] = m;
      rstd[r] = s;
    }
  }
}

// A norm backward's dx element: v, or d + v (accumulate: the product v already rounded on its
// own), and with dx16 (f32 only) the same value rounded to bf16 bits as the cast rounds it.
template <typename T>
__device__ __forceinline__ void store_norm_dx(T* d, uint16_t* d16, T v, bool accumulate) {
  const T sum = accumulate ? *d + v : v;
  *d = sum;
  if constexpr (sizeof(T) == sizeof(float)) {
    if (d16 != nullptr) *d16 = bf16_bits(sum);
  }
}

// dx only (dw, db: column_sums). Same shape as the forward; the sums through lane_backward_sums.
// dx16: null, or dx's values rounded to bf16 (store_norm_dx).
template <typename T>
__global__ void layernorm_backward_kernel(const T* dout, const T* x, const T* w, const T* mean, const T* rstd, T* dx,
                                          uint16_t* dx16, int64_t rows, int64_t channels, bool accumulate) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const T* xr = x + r * channels;
    const T* gr = dout + r * channels;
    const T m = mean[r], s = rstd[r];
    T sum_g = 0, sum_gx = 0;
    lane_backward_sums(gr, w, xr, channels, [&](T gc, T wc, T xc) {
      const T g = gc * wc;
      sum_g += g;
      sum_gx += g * (xc - m) * s;
    });
    const T mean_g = warp_sum(sum_g) / static_cast<T>(channels);
    const T mean_gx = warp_sum(sum_gx) / static_cast<T>(channels);
    T* d = dx + r * channels;
    uint16_t* d16 = dx16 != nullptr ? dx16 + r * channels : nullptr;
    for (int64_t c = lane; c < channels; c += kWarp) {
      const T v = mul_rn(s, gr[c] * w[c] - mean_g - (xr[c] - m) * s * mean_gx);  // not contracted into the add
      store_norm_dx(d + c, d16 != nullptr ? d16 + c : nullptr, v, accumulate);
    }
  }
}

template <typename T, typename O>
__global__ void rmsnorm_forward_kernel(const T* x, const T* w, O* out, T* rstd, int64_t rows, int64_t channels,
                                       T eps) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const T* xr = x + r * channels;
    T ss = 0;
    int64_t c = lane;
    for (; c + (kLaneLoads - 1) * kWarp < channels; c += kLaneLoads * kWarp) {
      T v[kLaneLoads];
      lane_loads(xr, c, v);
#pragma unroll
      for (int u = 0; u < kLaneLoads; ++u) ss += v[u] * v[u];
    }
    for (; c < channels; c += kWarp) ss += xr[c] * xr[c];
    const T s = T(1) / sqrt_of(warp_sum(ss) / static_cast<T>(channels) + eps);
    O* o = out + r * channels;
#pragma unroll 8
    for (int64_t k = lane; k < channels; k += kWarp) store_out(o + k, xr[k] * s * w[k]);
    if (lane == 0) rstd[r] = s;
  }
}

template <typename T>
__global__ void rmsnorm_backward_kernel(const T* dout, const T* x, const T* w, const T* rstd, T* dx, uint16_t* dx16,
                                        int64_t rows, int64_t channels, bool accumulate) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const T* xr = x + r * channels;
    const T* gr = dout + r * channels;
    const T s = rstd[r];
    T sum_gx = 0;
    lane_backward_sums(gr, w, xr, channels, [&](T gc, T wc, T xc) { sum_gx += gc * wc * xc * s; });
    const T mean_gx = warp_sum(sum_gx) / static_cast<T>(channels);
    T* d = dx + r * channels;
    uint16_t* d16 = dx16 != nullptr ? dx16 + r * channels : nullptr;
    for (int64_t c = lane; c < channels; c += kWarp) {
      const T v = mul_rn(s, gr[c] * w[c] - xr[c] * s * mean_gx);  // not contracted into the add
      store_norm_dx(d + c, d16 != nullptr ? d16 + c : nullptr, v, accumulate);
    }
  }
}

// ---------------------------------------------------------------- activations
constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kGeluCubic = 0.044715;

// Grid-stride, kBlock threads.
template <typename T, typename O, typename S>
__global__ void gelu_forward_kernel(const S* x, O* out, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const T v = load_in<T>(x[i]);
    const T u = T(kGeluScale) * (v + T(kGeluCubic) * v * v * v);
    store_out(out + i, T(0.5) * v * (T(1) + tanh_t<T>(u)));
  }
}

template <typename T, typename O, typename S>
__global__ void gelu_backward_kernel(const S* x, const T* dout, O* dx, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const T v = load_in<T>(x[i]);
    const T u = T(kGeluScale) * (v + T(kGeluCubic) * v * v * v);
    const T t = tanh_t<T>(u);
    const T du = T(kGeluScale) * (T(1) + T(3 * kGeluCubic) * v * v);
    store_out(dx + i, dout[i] * (T(0.5) * (T(1) + t) + T(0.5) * v * (T(1) - t * t) * du));
  }
}

// The gate activation and its derivative (silu: SwiGLU, gelu_tanh: GeGLU, sigmoid: a plain gate), as the CPU's.
template <typename T>
__device__ T gate_act(GateActivation act, T g) {
  if (act == GateActivation::silu) return g * sigmoid_t<T>(g);
  if (act == GateActivation::sigmoid) return sigmoid_t<T>(g);
  if (act == GateActivation::swiglu_oai) {
    const T c = g < T(kSwigluOaiLimit) ? g : T(kSwigluOaiLimit);
    return c * sigmoid_t<T>(T(kSwigluOaiAlpha) * c);
  }
  const T u = T(kGeluScale) * (g + T(kGeluCubic) * g * g * g);
  return T(0.5) * g * (T(1) + tanh_t<T>(u));
}
template <typename T>
__device__ T gate_act_grad(GateActivation act, T g) {
  if (act == GateActivation::silu) {
    const T sg = sigmoid_t<T>(g);
    return sg * (T(1) + g * (T(1) - sg));
  }
  if (act == GateActivation::sigmoid) {
    const T sg = sigmoid_t<T>(g);
    return sg * (T(1) - sg);
  }
  if (act == GateActivation::swiglu_oai) {
    if (g > T(kSwigluOaiLimit)) return T(0);
    const T sg = sigmoid_t<T>(T(kSwigluOaiAlpha) * g);
    return sg * (T(1) + T(kSwigluOaiAlpha) * g * (T(1) - sg));
  }
  const T u = T(kGeluScale) * (g + T(kGeluCubic) * g * g * g);
  const T t = tanh_t<T>(u);
  const T du = T(kGeluScale) * (T(1) + T(3 * kGeluCubic) * g * g);
  return T(0.5) * (T(1) + t) + T(0.5) * g * (T(1) - t * t) * du;
}

// The up operand and its derivative (swiglu_oai: clamp(u, -7, 7) + 1), as the CPU's.
template <typename T>
__device__ T glu_up(GateActivation act, T u) {
  if (act != GateActivation::swiglu_oai) return u;
  const T l = T(kSwigluOaiLimit);
  return (u < -l ? -l : (u > l ? l : u)) + T(1);
}
template <typename T>
__device__ T glu_up_grad(GateActivation act, T u) {
  if (act != GateActivation::swiglu_oai) return T(1);
  return u >= -T(kSwigluOaiLimit) && u <= T(kSwigluOaiLimit) ? T(1) : T(0);
}

// Grid-stride over rows * hidden outputs.
template <typename T, typename O, typename S>
__global__ void glu_forward_kernel(const S* x, O* out, int64_t rows, int64_t hidden, GateActivation act) {
  const int64_t n = rows * hidden;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t r = i / hidden, j = i % hidden;
    const T gate = load_in<T>(x[r * 2 * hidden + j]);
    const T up = load_in<T>(x[r * 2 * hidden + hidden + j]);
    store_out(out + i, gate_act<T>(act, gate) * glu_up<T>(act, up));
  }
}

template <typename T, typename O, typename S>
__global__ void glu_backward_kernel(const S* x, const T* dout, O* dx, int64_t rows, int64_t hidden, GateActivation act) {
  const int64_t n = rows * hidden;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t r = i / hidden, j = i % hidden;
    const T gate = load_in<T>(x[r * 2 * hidden + j]);
    const T up = load_in<T>(x[r * 2 * hidden + hidden + j]);
    const T g = dout[i];
    store_out(dx + r * 2 * hidden + j, g * glu_up<T>(act, up) * gate_act_grad<T>(act, gate));
    store_out(dx + r * 2 * hidden + hidden + j, g * gate_act<T>(act, gate) * glu_up_grad<T>(act, up));
  }
}

// One thread per (b, t, j < hd/2, group of heads), grid-stride: the angle in double (pow, cos,
// sin as the CPU), then the pair (j, j + hd/2) of each head of its group in row (b, t) rotated
// in T. Few rows (decoding) split the heads into groups, each recomputing the angle, so that a
// token's rotation is not 64 threads walking 32 heads (20 us a call on an H200, 2026-12-04).
// The pair (j, j + half) of heads [h0, h1) of one row rotated by `angle` (cos and sin in double,
// times the spec's amplitude, then rounded to T): rope_kernel's and rope_rows_kernel's step.
template <typename T>
__device__ __forceinline__ void rope_rotate_pair(T* row, int64_t j, int64_t half, int64_t h0, int64_t h1, int64_t head_dim,
                                                 double angle, double amplitude) {
  const T cs = static_cast<T>(::cos(angle) * amplitude), sn = static_cast<T>(::sin(angle) * amplitude);
  for (int64_t h = h0; h < h1; ++h) {
    T* v = row + h * head_dim;
    const T a = v[j], c = v[j + half];
    v[j] = a * cs - c * sn;
    v[j + half] = c * cs + a * sn;
  }
}

template <typename T>
__global__ void rope_kernel(T* x, int64_t batch, int64_t seq_len, int64_t width, int64_t head_dim, int64_t n_heads,
                            int64_t heads_per_group, RopeSpec rope, int64_t pos_offset, double direction) {
  const int64_t rotary = rope_rotary_dim(rope, head_dim), half = rotary / 2;
  const int64_t groups = (n_heads + heads_per_group - 1) / heads_per_group;
  const int64_t n = batch * seq_len * half * groups;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t j = i % half, group = (i / half) % groups, bt = i / (half * groups), t = bt % seq_len;
    const double angle = direction * static_cast<double>(pos_offset + t) * rope_inv_freq(rope, j, rotary);
    rope_rotate_pair(x + bt * width, j, half, group * heads_per_group, min64(n_heads, (group + 1) * heads_per_group),
                     head_dim, angle, rope.amplitude);
  }
}

// Decoding's rows, each at its own position (rows.pos): rope_kernel's arithmetic with seq_len 1
// and pos_offset = the row's position, for up to kRopeRows rows in one launch.
template <typename T>
__global__ void rope_rows_kernel(T* x, RopeRows rows, int64_t width, int64_t head_dim, int64_t n_heads,
                                 int64_t heads_per_group, RopeSpec rope) {
  const int64_t rotary = rope_rotary_dim(rope, head_dim), half = rotary / 2;
  const int64_t groups = (n_heads + heads_per_group - 1) / heads_per_group;
  const int64_t n = rows.n * half * groups;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const int64_t j = i % half, group = (i / half) % groups, r = i / (half * groups);
    const double angle = static_cast<double>(rows.pos[r]) * rope_inv_freq(rope, j, rotary);  // direction 1
    rope_rotate_pair(x + r * width, j, half, group * heads_per_group, min64(n_heads, (group + 1) * heads_per_group),
                     head_dim, angle, rope.amplitude);
  }
}

// ---------------------------------------------------------------- optimizer
// Grid-stride; decay = 1 - lr * weight_decay and the other constants are computed in T on the host.
template <typename T>
__global__ void adamw_kernel(T* p, const T* grad, T* m, T* v, int64_t n, T lr, T beta1, T beta2, T eps, T decay,
                             T grad_scale, T bias1, T bias2) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const T g = grad[i] * grad_scale;
    const T mi = beta1 * m[i] + (T(1) - beta1) * g;
    const T vi = beta2 * v[i] + (T(1) - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const T mhat = mi / bias1;
    const T vhat = vi / bias2;
    p[i] = p[i] * decay - lr * mhat / (sqrt_of(vhat) + eps);
  }
}

}  // namespace

// ================================================================ launchers

template <typename T>
void fill(T* x, int64_t n, double value, cudaStream_t stream) {
  if (n <= 0) return;
  launch<fill_kernel<T>>(grid_for(n, kBlock), kBlock, 0, stream, x, n, static_cast<T>(value));
  LOOM_CUDA_CHECK_LAUNCH();
}

void cast_f32_to_bf16(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch<cast_f32_to_bf16_kernel>(grid_for(n, kBlock), kBlock, 0, stream, src, dst, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

void round_rows_bf16(const float* acc, const uint16_t* bias16, uint16_t* out, int64_t rows, int64_t cols,
                     cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  launch<round_rows_bf16_kernel>(grid_for(rows * cols, kBlock), kBlock, 0, stream, acc, bias16, out, rows, cols);
  LOOM_CUDA_CHECK_LAUNCH();
}

void cast_bf16_to_f32(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch<cast_bf16_to_f32_kernel>(grid_for(n, kBlock), kBlock, 0, stream, src, dst, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

void cast_f32_to_f64(const float* src, double* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch<cast_f32_to_f64_kernel>(grid_for(n, kBlock), kBlock, 0, stream, src, dst, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

void cast_f64_to_f32(const double* src, float* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch<cast_f64_to_f32_kernel>(grid_for(n, kBlock), kBlock, 0, stream, src, dst, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void add(const T* a, const T* b, T* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch<add_kernel<T>>(grid_for(n, kBlock), kBlock, 0, stream, a, b, out, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void scale(T* x, int64_t n, double factor, cudaStream_t stream) {
  if (n <= 0) return;
  launch<scale_kernel<T>>(grid_for(n, kBlock), kBlock, 0, stream, x, n, static_cast<T>(factor));
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void reduce_partials(const T* x, int64_t n, bool squares, double* partials, cudaStream_t stream) {
  launch<reduce_partials_kernel<T>>(kReducePartials, kBlock, 0, stream, x, std::max<int64_t>(n, 0), squares, partials);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void add_bias_rows(T* c, const T* bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  launch<add_bias_rows_kernel<T>>(grid_for(rows * cols, kBlock), kBlock, 0, stream, c, bias, rows, cols);
  LOOM_CUDA_CHECK_LAUNCH();
}

// chunks_for(rows) * cols partial sums of T (see column_sums above).
size_t column_sums_scratch_bytes(int64_t rows, int64_t cols, size_t elem_bytes) {
  if (rows <= 0 || cols <= 0) return 0;
  return static_cast<size_t>(chunks_for(rows)) * static_cast<size_t>(cols) * elem_bytes;
}

template <typename T>
void column_sums_accumulate(const T* x, int64_t rows, int64_t cols, T* acc, void* scratch, cudaStream_t stream) {
  column_sums<T, 1>(LoadRows<T>{x, cols}, rows, cols, static_cast<T*>(scratch), acc, nullptr, stream);
}

void column_sums_accumulate_bf16(const uint16_t* x, int64_t rows, int64_t cols, float* acc, void* scratch,
                                 cudaStream_t stream) {
  column_sums<float, 1>(LoadBf16Rows{x, cols}, rows, cols, static_cast<float*>(scratch), acc, nullptr, stream);
}

template <typename T>
void embedding_forward(const int32_t* tokens, const T* table, const T* positions, T* out, int64_t n_tokens,
                       int64_t seq_len, int64_t channels, int64_t vocab, unsigned long long* bad_position,
                       cudaStream_t stream) {
  if (n_tokens <= 0) return;
  launch<embedding_forward_kernel<T>>(grid_for(n_tokens, kRowsPerBlock), kBlock, 0, stream,
      tokens, table, positions, out, n_tokens, seq_len, channels, vocab, bad_position);
  LOOM_CUDA_CHECK_LAUNCH();
}

void embedding_forward_bf16(const int32_t* tokens, const uint16_t* table, const float* positions, float* out,
                            int64_t n_tokens, int64_t seq_len, int64_t channels, int64_t vocab,
                            unsigned long long* bad_position, cudaStream_t stream) {
  if (n_tokens <= 0) return;
  launch<embedding_forward_kernel<float, uint16_t>>(grid_for(n_tokens, kRowsPerBlock), kBlock, 0, stream,
      tokens, table, positions, out, n_tokens, seq_len, channels, vocab, bad_position);
  LOOM_CUDA_CHECK_LAUNCH();
}

// 4 uint32 arrays of n_tokens (sort keys and positions, in and out), each rounded up to 256 bytes,
// plus the radix sort's temporary storage for n_tokens pairs of key_bits(vocab) bits. dpositions
// needs none. Independent of channels and of the element size.
size_t embedding_backward_scratch_bytes(int64_t n_tokens, int64_t seq_len, int64_t channels, int64_t vocab,
                                        size_t elem_bytes) {
  (void)seq_len;
  (void)channels;
  (void)elem_bytes;
  return sort_layout(n_tokens, vocab).total();
}

template <typename T>
void embedding_backward(const int32_t* tokens, const T* dout, T* dtable, T* dpositions, int64_t n_tokens,
                        int64_t seq_len, int64_t channels, int64_t vocab, void* scratch,
                        unsigned long long* bad_position, cudaStream_t stream) {
  if (n_tokens <= 0) return;
  const SortLayout layout = sort_layout(n_tokens, vocab);
  char* base = static_cast<char*>(scratch);
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(base);
  uint32_t* keys_out = reinterpret_cast<uint32_t*>(base + layout.array_bytes);
  uint32_t* pos_in = reinterpret_cast<uint32_t*>(base + 2 * layout.array_bytes);
  uint32_t* pos_out = reinterpret_cast<uint32_t*>(base + 3 * layout.array_bytes);
  void* cub_temp = base + 4 * layout.array_bytes;

  const uint32_t bad = static_cast<uint32_t>(bad_key(vocab));
  launch<embedding_keys_kernel>(grid_for(n_tokens, kBlock), kBlock, 0, stream, tokens, n_tokens, vocab, bad, keys_in,
                                                                           pos_in, bad_position);
  LOOM_CUDA_CHECK_LAUNCH();
  if (channels <= 0) return;

  radix_sort_pairs(cub_temp, layout.cub_bytes, keys_in, keys_out, pos_in, pos_out, n_tokens, key_bits(vocab), stream);
  LOOM_CUDA_CHECK_LAUNCH();

  const dim3 grid(static_cast<unsigned>((channels + kSlab - 1) / kSlab),
                  static_cast<unsigned>(std::min<int64_t>(n_tokens, kMaxSegmentGroups)));
  launch<embedding_dtable_kernel<T>>(grid, dim3(kColTile, kRowLanes), 0, stream, keys_out, pos_out, dout, dtable,
                                                                             n_tokens, channels, bad);
  LOOM_CUDA_CHECK_LAUNCH();

  if (dpositions && seq_len > 0) {
    launch<embedding_dpositions_kernel<T>>(grid_for(seq_len * channels, kBlock), kBlock, 0, stream,
        dout, dpositions, n_tokens, seq_len, channels);
    LOOM_CUDA_CHECK_LAUNCH();
  }
}

template <typename T, typename O>
void layernorm_forward(const T* x, const T* w, const T* b, O* out, T* mean, T* rstd, int64_t rows, int64_t channels,
                       double eps, cudaStream_t stream) {
  if (rows <= 0) return;
  launch<layernorm_forward_kernel<T, O>>(grid_for(rows, kRowsPerBlock), kBlock, 0, stream, x, w, b, out, mean, rstd, rows,
                                                                                    channels, static_cast<T>(eps));
  LOOM_CUDA_CHECK_LAUNCH();
}

// Two partial arrays (dweight, dbias) of chunks_for(rows) * channels T; rmsnorm uses the first.
size_t norm_backward_scratch_bytes(int64_t rows, int64_t channels, size_t elem_bytes) {
  return 2 * column_sums_scratch_bytes(rows, channels, elem_bytes);
}

// dw, db first (they read dout), then dx: so dx may even alias dout.
template <typename T>
void layernorm_backward(const T* dout, const T* x, const T* w, const T* mean, const T* rstd, T* dx, uint16_t* dx16,
                        T* dw, T* db, int64_t rows, int64_t channels, void* scratch, bool accumulate,
                        cudaStream_t stream) {
  if (rows <= 0 || channels <= 0) return;
  column_sums<T, 2>(LoadLayerNormGrads<T>{dout, x, mean, rstd, channels}, rows, channels, static_cast<T*>(scratch),
                    dw, db, stream);
  launch<layernorm_backward_kernel<T>>(grid_for(rows, kRowsPerBlock), kBlock, 0, stream, dout, x, w, mean, rstd, dx, dx16,
                                       rows, channels, accumulate);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T, typename O>
void rmsnorm_forward(const T* x, const T* w, O* out, T* rstd, int64_t rows, int64_t channels, double eps,
                     cudaStream_t stream) {
  if (rows <= 0) return;
  launch<rmsnorm_forward_kernel<T, O>>(grid_for(rows, kRowsPerBlock), kBlock, 0, stream, x, w, out, rstd, rows, channels,
                                                                                  static_cast<T>(eps));
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void rmsnorm_backward(const T* dout, const T* x, const T* w, const T* rstd, T* dx, uint16_t* dx16, T* dw, int64_t rows,
                      int64_t channels, void* scratch, bool accumulate, cudaStream_t stream) {
  if (rows <= 0 || channels <= 0) return;
  column_sums<T, 1>(LoadRmsNormGrad<T>{dout, x, rstd, channels}, rows, channels, static_cast<T*>(scratch), dw,
                    nullptr, stream);
  launch<rmsnorm_backward_kernel<T>>(grid_for(rows, kRowsPerBlock), kBlock, 0, stream, dout, x, w, rstd, dx, dx16, rows,
                                     channels, accumulate);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T, typename O, typename S>
void gelu_forward(const S* x, O* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch<gelu_forward_kernel<T, O, S>>(grid_for(n, kBlock), kBlock, 0, stream, x, out, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T, typename O, typename S>
void gelu_backward(const S* x, const T* dout, O* dx, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch<gelu_backward_kernel<T, O, S>>(grid_for(n, kBlock), kBlock, 0, stream, x, dout, dx, n);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T, typename O, typename S>
void glu_forward(const S* x, O* out, int64_t rows, int64_t hidden, GateActivation act, cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return;
  launch<glu_forward_kernel<T, O, S>>(grid_for(rows * hidden, kBlock), kBlock, 0, stream, x, out, rows, hidden, act);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T, typename O, typename S>
void glu_backward(const S* x, const T* dout, O* dx, int64_t rows, int64_t hidden, GateActivation act,
                  cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return;
  launch<glu_backward_kernel<T, O, S>>(grid_for(rows * hidden, kBlock), kBlock, 0, stream, x, dout, dx, rows, hidden, act);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void rope_rotate(T* x, int64_t batch, int64_t seq_len, int64_t width, int64_t head_dim, int64_t n_heads, const RopeSpec& rope,
                 int64_t pos_offset, double direction, cudaStream_t stream) {
  const int64_t pairs = batch * seq_len * (head_dim / 2);
  if (pairs <= 0 || n_heads <= 0) return;
  // Heads per thread: all of them once there are enough pairs to fill the GPU (one angle each),
  // else as few as it takes to reach ~16k threads.
  constexpr int64_t kRopeThreads = 16384;
  const int64_t groups = std::clamp<int64_t>(kRopeThreads / pairs, 1, n_heads);
  const int64_t per_group = (n_heads + groups - 1) / groups;
  const int64_t threads = pairs * ((n_heads + per_group - 1) / per_group);
  launch<rope_kernel<T>>(grid_for(threads, kBlock), kBlock, 0, stream, x, batch, seq_len, width, head_dim, n_heads,
                         per_group, rope, pos_offset, direction);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void rope_rows(T* x, const RopeRows& rows, int64_t width, int64_t head_dim, int64_t n_heads, const RopeSpec& rope,
               cudaStream_t stream) {
  const int64_t pairs = rows.n * (head_dim / 2);
  if (pairs <= 0 || n_heads <= 0) return;
  constexpr int64_t kRopeThreads = 16384;  // as rope_rotate: heads split into groups while the rows are few
  const int64_t groups = std::clamp<int64_t>(kRopeThreads / pairs, 1, n_heads);
  const int64_t per_group = (n_heads + groups - 1) / groups;
  const int64_t threads = pairs * ((n_heads + per_group - 1) / per_group);
  launch<rope_rows_kernel<T>>(grid_for(threads, kBlock), kBlock, 0, stream, x, rows, width, head_dim, n_heads,
                              per_group, rope);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void adamw_step(T* p, const T* grad, T* m, T* v, int64_t n, double lr, double beta1, double beta2, double eps,
                double weight_decay, double grad_scale, double bias1, double bias2, cudaStream_t stream) {
  if (n <= 0) return;
  const T lr_t = static_cast<T>(lr);
  const T decay = T(1) - lr_t * static_cast<T>(weight_decay);  // as the CPU kernel, in T
  launch<adamw_kernel<T>>(grid_for(n, kBlock), kBlock, 0, stream,
      p, grad, m, v, n, lr_t, static_cast<T>(beta1), static_cast<T>(beta2), static_cast<T>(eps), decay,
      static_cast<T>(grad_scale), static_cast<T>(bias1), static_cast<T>(bias2));
  LOOM_CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------- explicit instantiations
#define LOOM_CUDA_KERNELS_INSTANTIATE(T)                                                                              \
  template void fill<T>(T*, int64_t, double, cudaStream_t);                                                          \
  template void add<T>(const T*, const T*, T*, int64_t, cudaStream_t);                                               \
  template void scale<T>(T*, int64_t, double, cudaStream_t);                                                         \
  template void reduce_partials<T>(const T*, int64_t, bool, double*, cudaStream_t);                                  \
  template void add_bias_rows<T>(T*, const T*, int64_t, int64_t, cudaStream_t);                                      \
  template void column_sums_accumulate<T>(const T*, int64_t, int64_t, T*, void*, cudaStream_t);                      \
  template void embedding_forward<T>(const int32_t*, const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t,     \
                                     unsigned long long*, cudaStream_t);                                             \
  template void embedding_backward<T>(const int32_t*, const T*, T*, T*, int64_t, int64_t, int64_t, int64_t, void*,   \
                                      unsigned long long*, cudaStream_t);                                            \
  template void layernorm_forward<T, T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, double,          \
                                        cudaStream_t);                                                               \
  template void layernorm_backward<T>(const T*, const T*, const T*, const T*, const T*, T*, uint16_t*, T*, T*,      \
                                      int64_t, int64_t, void*, bool, cudaStream_t);                                  \
  template void rmsnorm_forward<T, T>(const T*, const T*, T*, T*, int64_t, int64_t, double, cudaStream_t);           \
  template void rmsnorm_backward<T>(const T*, const T*, const T*, const T*, T*, uint16_t*, T*, int64_t, int64_t,    \
                                    void*, bool, cudaStream_t);                                                      \
  template void gelu_forward<T, T>(const T*, T*, int64_t, cudaStream_t);                                             \
  template void gelu_backward<T, T>(const T*, const T*, T*, int64_t, cudaStream_t);                                  \
  template void glu_forward<T, T>(const T*, T*, int64_t, int64_t, GateActivation, cudaStream_t);                    \
  template void glu_backward<T, T>(const T*, const T*, T*, int64_t, int64_t, GateActivation, cudaStream_t);         \
  template void rope_rotate<T>(T*, int64_t, int64_t, int64_t, int64_t, int64_t, const RopeSpec&, int64_t, double, \
                               cudaStream_t);                                                                        \
  template void rope_rows<T>(T*, const RopeRows&, int64_t, int64_t, int64_t, const RopeSpec&, cudaStream_t);         \
  template void adamw_step<T>(T*, const T*, T*, T*, int64_t, double, double, double, double, double, double, double, \
                              double, cudaStream_t);

LOOM_CUDA_KERNELS_INSTANTIATE(float)
LOOM_CUDA_KERNELS_INSTANTIATE(double)

// The forward ops' bf16 outputs (precision.activations = bf16: the saved fields written rounded).
template void layernorm_forward<float, uint16_t>(const float*, const float*, const float*, uint16_t*, float*, float*,
                                                 int64_t, int64_t, double, cudaStream_t);
template void rmsnorm_forward<float, uint16_t>(const float*, const float*, uint16_t*, float*, int64_t, int64_t, double,
                                               cudaStream_t);
template void gelu_forward<float, uint16_t>(const float*, uint16_t*, int64_t, cudaStream_t);
template void glu_forward<float, uint16_t>(const float*, uint16_t*, int64_t, int64_t, GateActivation, cudaStream_t);
// ... and the activations' input gradients in bf16 (the MLP's first GEMM reads them so).
template void gelu_backward<float, uint16_t>(const float*, const float*, uint16_t*, int64_t, cudaStream_t);
template void glu_backward<float, uint16_t>(const float*, const float*, uint16_t*, int64_t, int64_t, GateActivation,
                                            cudaStream_t);

#undef LOOM_CUDA_KERNELS_INSTANTIATE

// A bf16 x (a bf16 GEMM output, LayerPlan::fc_bf16), into f32 or bf16.
template void gelu_forward<float, uint16_t, uint16_t>(const uint16_t*, uint16_t*, int64_t, cudaStream_t);
template void gelu_forward<float, float, uint16_t>(const uint16_t*, float*, int64_t, cudaStream_t);
template void gelu_backward<float, uint16_t, uint16_t>(const uint16_t*, const float*, uint16_t*, int64_t, cudaStream_t);
template void gelu_backward<float, float, uint16_t>(const uint16_t*, const float*, float*, int64_t, cudaStream_t);
template void glu_forward<float, uint16_t, uint16_t>(const uint16_t*, uint16_t*, int64_t, int64_t, GateActivation,
                                                     cudaStream_t);
template void glu_forward<float, float, uint16_t>(const uint16_t*, float*, int64_t, int64_t, GateActivation, cudaStream_t);
template void glu_backward<float, uint16_t, uint16_t>(const uint16_t*, const float*, uint16_t*, int64_t, int64_t,
                                                      GateActivation, cudaStream_t);
template void glu_backward<float, float, uint16_t>(const uint16_t*, const float*, float*, int64_t, int64_t,
                                                   GateActivation, cudaStream_t);

}  // namespace loom::cuda
