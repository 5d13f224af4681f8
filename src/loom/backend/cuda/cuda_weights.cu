// CUDA kernels of DoRA's row ops, QLoRA's NF4 dequantization and the integer-weight formats of
// post-training quantization (cuda_weights.h; contracts in backend.h, CPU twins in
// cpu/cpu_quant_ops.cpp and cpu/cpu_int_linear.cpp, formats in precision/nf4.h and
// precision/int_quant.h). Each kernel computes its CPU twin's formula in the same f32 / f64
// operations, so DoRA, NF4 and int_dequantize are bitwise equal to the CPU backend (products that
// the CPU rounds separately use __fmul_rn here, so nvcc cannot contract them into an fma).
//
// Roofline, per element of the (rows, cols) operand unless stated (H100: ~3.3 TB/s, so these are
// all memory-bound; "B" bytes through device memory, "F" floating-point operations):
//   row_norms      norms_j = f32(sqrt(sum_i x_ji^2)), the sum in double, in column order.
//                  4 B read, 2 F (f64). One warp per 8 rows, walking them in tiles of 8 x 128:
//                  each lane loads 4 columns of every row (coalesced, 32 loads in flight), the
//                  tile goes through shared memory, and lane r adds row r's 128 values in order
//                  while the next tile's loads are in flight. 128 threads (4 warps) per block,
//                  grid-stride over groups of 8 rows. The per-lane sequential f64 sum is the
//                  contract's order (its dependent adds, cols per row, bound the kernel for
//                  matrices of few rows).
//   dora_weight    out_ji = g_j merged_ji - base_ji, g_j = m_j / n_j (0 where n_j = 0).
//                  8 B read (4 without base), 4 B written, 2 F. One block per row (grid-stride),
//                  256 threads over its columns.
//   dora_backward  dm_j += f32((sum_i grad_ji merged_ji, f64 in order) / n_j) where n_j > 0;
//                  grad_ji *= g_j. 8 B read, 4 B written, 3 F. One pass: row_norms' tiling, each
//                  lane scaling the gradient it loads while the tile keeps the unscaled value.
//   nf4_dequantize out_e = values[code_e] c_{e / 64}, c_b = f32(q_b step_{b / 256} + mean) (f64).
//                  0.5 B read + 4 B (f32) or 2 B (bf16) written, 1 F (+ 1 f64 fma per 8). One
//                  thread per 8 elements (4 code bytes, one block absmax), two float4 (or one
//                  16-byte bf16) stores when the range starts at a multiple of 8 and out is
//                  16-byte aligned; grid-stride, 256 threads, grid capped at 8192 blocks.
//   int_dequantize w_oc = s_g (q_oc - z_g) (x input_scale_c). b/8 B read + 4 B written, 1-2 F.
//                  (s_g f32, or f16 widened exactly; z_g u8, or 2^(b - 1) without zeros: the
//                  compact group parameters, 2 B a group instead of 5, the same numbers.)
//                  One thread per 8 columns (8 codes, 8-byte loads for 8 and 4 bits), two
//                  float4 stores; grid-stride, 256 threads.
//   int_linear     y_no = beta y_no + sum_c x_nc v_c w_oc (+ bias_o), weight-only: per 8 columns
//                  of one group p = sum x (q - z) by f32 fma, acc += s p; W8A8: each input row
//                  quantized to q_x = rint(x v / s_x), s_x = max |x v| / 127, then
//                  y = s_x s_w sum q_x (q_w - 128) in int32 (exact).
//                  Per call: rows cols b/8 B of codes (read once per chunk of up to 8 input rows),
//                  n cols 4 B of x, n rows 4 B of y; 2 n rows cols F. A tiled decode GEMM: a
//                  block of 8 warps owns 8 output rows and a chunk of NR (1, 2, 4 or 8) input
//                  rows; per tile of 256 columns the block stages the chunk's inputs (scaled, and
//                  for W8A8 quantized) in shared memory, then each warp's lanes dequantize 8 codes
//                  each of their row in registers and multiply them with the NR staged rows (each
//                  lane loads the next tile's codes before the current tile's barrier). The
//                  32 lanes' sums meet in a fixed shuffle tree (deterministic). W8A8 first runs a
//                  row-amax kernel (one 256-thread block per input row; max is order-free).
//                  Decode (N <= 8) reads the weight once: the bound is rows cols b/8 bytes.
//                  Prefill (large N) re-reads the codes once per chunk of 8 input rows (from L2
//                  for weights that fit) and multiplies on the CUDA cores, not tensor cores.
//   bf16_weight_linear  y_no = beta y_no + sum_c x_nc w_oc (+ bias_o), w bf16 widened exactly
//                  (a shift), f32 fma. Per call: rows cols 2 B of weights (once per chunk of up
//                  to 16 input rows), n cols 4 B of x (from L1 / L2), 2 n rows cols F. A warp per
//                  output row (8 per block), each lane 8 columns per 16-byte load; the lanes'
//                  sums meet in the fixed shuffle tree. For decoding (N <= 16: the op's CUDA
//                  path; more rows take the default's widening and cuBLASLt's GEMM): bound by
//                  the weight's bytes, half of an f32 weight's.
// Under the simulator every kernel here computes the same bits as on the GPU: fmaf is explicit
// and the other products are rounded on their own (mul_gpu_rn), but see mul_gpu_rn below.
//
// Determinism: no atomics; every sum has a fixed order.

#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)
#include "loom/backend/cuda/cuda_weights.h"

#include <cstdint>

#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_launch.h"

namespace loom::cuda {
namespace {

// (kWarp, kMaxBlocks, grid_for, thread_index / thread_count, min64, warp_sum, warp_sync:
// cuda_device.h)
constexpr int kBlock = 256;           // threads per block of the 1-D kernels
constexpr int kDoraWarps = 4;          // DoRA's row kernels: 4 warps per block,
constexpr int kDoraRows = 8;           // each owning 8 rows,
constexpr int kDoraCols = 128;         // walked in tiles of 128 columns (4 per lane)
constexpr int kLinWarps = 8;           // int_linear: output rows per block (one per warp)
constexpr int kLinTile = kWarp * 8;    // int_linear: columns per staged tile (8 per lane)
constexpr int64_t kMaxGridY = 65535;

// a b on a GPU rounded once, never contracted with a following add (cuda_device.h's mul_rn:
// __fmul_rn, or on HIP the contraction off); on the simulator a plain product, which g++ may
// contract with the following add or subtract, as this file always had it. (dora_weight is
// not one of them: the CPU's GCC contracts g * merged - base, so every build spells that fma out;
// with __fmul_rn an H200 differed from the CPU in the last bit, 2026-12-04.)
__device__ __forceinline__ float mul_gpu_rn(float a, float b) {
#ifdef LOOM_CUDA_SIM
  return a * b;
#else
  return mul_rn(a, b);
#endif
}

__device__ __forceinline__ float dora_gain(float magnitude, float norm) { return norm > 0.0f ? magnitude / norm : 0.0f; }

// bf16 bits (cuda_device.h bf16_bits) widened to a 32-bit word, for packing pairs.
__device__ __forceinline__ uint32_t bf16_word(float v) { return bf16_bits(v); }

// ---------------------------------------------------------------- DoRA
// A warp owns kDoraRows rows and walks their columns in tiles of kDoraCols: each lane loads
// columns c0 + lane + 32 j of every row (coalesced), the tile goes through shared memory, and
// lane r (< kDoraRows) adds row r's values in column order while the next tile's loads are in
// flight in registers.
using DoraRegs = float[kDoraRows][kDoraCols / kWarp];

__device__ __forceinline__ void dora_load(const float* m, int64_t r0, int nr, int64_t c0, int64_t cols, int lane,
                                          DoraRegs& v) {
#pragma unroll
  for (int r = 0; r < kDoraRows; ++r) {
#pragma unroll
    for (int j = 0; j < kDoraCols / kWarp; ++j) {
      const int64_t c = c0 + lane + kWarp * j;
      v[r][j] = r < nr && c < cols ? m[(r0 + r) * cols + c] : 0.0f;
    }
  }
}

__global__ void row_norms_kernel(const float* x, float* norms, int64_t rows, int64_t cols) {
  __shared__ float tile[kDoraWarps][kDoraRows][kDoraCols + 1];
  const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kDoraWarps * kDoraRows;
  for (int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kDoraWarps + warp) * kDoraRows; r0 < rows; r0 += stride) {
    const int nr = static_cast<int>(min64(kDoraRows, rows - r0));
    double sum = 0.0;
    DoraRegs v;
    dora_load(x, r0, nr, 0, cols, lane, v);
    for (int64_t c0 = 0; c0 < cols; c0 += kDoraCols) {
#pragma unroll
      for (int r = 0; r < kDoraRows; ++r) {
#pragma unroll
        for (int j = 0; j < kDoraCols / kWarp; ++j) tile[warp][r][lane + kWarp * j] = v[r][j];
      }
      warp_sync();
      if (c0 + kDoraCols < cols) dora_load(x, r0, nr, c0 + kDoraCols, cols, lane, v);
      if (lane < nr) {
        const int nc = static_cast<int>(min64(kDoraCols, cols - c0));
        for (int k = 0; k < nc; ++k) {
          const double e = tile[warp][lane][k];
          sum += e * e;
        }
      }
      warp_sync();
    }
    if (lane < nr) norms[r0 + lane] = static_cast<float>(::sqrt(sum));
  }
}

__global__ void dora_weight_kernel(const float* merged, const float* base, const float* magnitude, const float* norms,
                                   float* out, int64_t rows, int64_t cols) {
  for (int64_t j = blockIdx.x; j < rows; j += gridDim.x) {
    const float g = dora_gain(magnitude[j], norms[j]);
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      const int64_t k = j * cols + i;
      out[k] = fma_rn(g, merged[k], -(base != nullptr ? base[k] : 0.0f));  // the CPU's contraction
    }
  }
}

__global__ void dora_backward_kernel(float* grad, const float* merged, const float* magnitude, const float* norms,
                                     float* dmagnitude, int64_t rows, int64_t cols) {
  __shared__ float tg[kDoraWarps][kDoraRows][kDoraCols + 1];
  __shared__ float tw[kDoraWarps][kDoraRows][kDoraCols + 1];
  const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kDoraWarps * kDoraRows;
  for (int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kDoraWarps + warp) * kDoraRows; r0 < rows; r0 += stride) {
    const int nr = static_cast<int>(min64(kDoraRows, rows - r0));
    float gains[kDoraRows];
#pragma unroll
    for (int r = 0; r < kDoraRows; ++r) gains[r] = r < nr ? dora_gain(magnitude[r0 + r], norms[r0 + r]) : 0.0f;
    double dot = 0.0;
    DoraRegs vg, vw;
    dora_load(grad, r0, nr, 0, cols, lane, vg);
    dora_load(merged, r0, nr, 0, cols, lane, vw);
    for (int64_t c0 = 0; c0 < cols; c0 += kDoraCols) {
      // The tile's unscaled gradient to shared memory, the scaled one back in place.
#pragma unroll
      for (int r = 0; r < kDoraRows; ++r) {
#pragma unroll
        for (int j = 0; j < kDoraCols / kWarp; ++j) {
          const int64_t c = c0 + lane + kWarp * j;
          tg[warp][r][lane + kWarp * j] = vg[r][j];
          tw[warp][r][lane + kWarp * j] = vw[r][j];
          if (r < nr && c < cols) grad[(r0 + r) * cols + c] = vg[r][j] * gains[r];
        }
      }
      warp_sync();
      if (c0 + kDoraCols < cols) {
        dora_load(grad, r0, nr, c0 + kDoraCols, cols, lane, vg);
        dora_load(merged, r0, nr, c0 + kDoraCols, cols, lane, vw);
      }
      if (lane < nr) {
        const int nc = static_cast<int>(min64(kDoraCols, cols - c0));
        for (int k = 0; k < nc; ++k) dot += static_cast<double>(tg[warp][lane][k]) * static_cast<double>(tw[warp][lane][k]);
      }
      warp_sync();
    }
    if (lane < nr) {
      const float n = norms[r0 + lane];
      if (n > 0.0f) dmagnitude[r0 + lane] += static_cast<float>(dot / static_cast<double>(n));
    }
  }
}

// ---------------------------------------------------------------- NF4
struct Nf4Values {
  float v[16];
};

// Thread t: elements [base + 8 t, base + 8 t + 8), base = first rounded down to a multiple of 8
// (one block of 64, four code bytes); only those in [first, end) are read and written.
template <bool BF16>
__global__ void nf4_dequantize_kernel(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_steps,
                                      Nf4Values values, float mean, int64_t first, int64_t end, int64_t items,
                                      void* out, bool vec) {
  const int64_t base = first & ~int64_t{7};
  for (int64_t t = thread_index(); t < items; t += thread_count()) {
    const int64_t e0 = base + 8 * t, b = e0 / 64;
    const int8_t q = static_cast<int8_t>(absmax_codes[b]);
    const float c = static_cast<float>(static_cast<double>(q) * static_cast<double>(absmax_steps[b / 256]) +
                                       static_cast<double>(mean));
    const bool full = e0 >= first && e0 + 8 <= end;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const int64_t e = e0 + j;
      const bool in = full || (e + 1 >= first && e < end);  // either element of the byte
      const uint8_t byte = in ? codes[e >> 1] : 0;
      v[j] = values.v[byte >> 4] * c;
      v[j + 1] = values.v[byte & 0x0F] * c;
    }
    if (full && vec) {
      if constexpr (BF16) {
        int4 w;
        w.x = static_cast<int>(bf16_word(v[0]) | (bf16_word(v[1]) << 16));
        w.y = static_cast<int>(bf16_word(v[2]) | (bf16_word(v[3]) << 16));
        w.z = static_cast<int>(bf16_word(v[4]) | (bf16_word(v[5]) << 16));
        w.w = static_cast<int>(bf16_word(v[6]) | (bf16_word(v[7]) << 16));
        *reinterpret_cast<int4*>(static_cast<uint16_t*>(out) + (e0 - first)) = w;
      } else {
        float* o = static_cast<float*>(out) + (e0 - first);
        *reinterpret_cast<float4*>(o) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(o + 4) = make_float4(v[4], v[5], v[6], v[7]);
      }
      continue;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t e = e0 + j;
      if (e < first || e >= end) continue;
      if constexpr (BF16) static_cast<uint16_t*>(out)[e - first] = bf16_bits(v[j]);
      else static_cast<float*>(out)[e - first] = v[j];
    }
  }
}

// ---------------------------------------------------------------- integer weights
__host__ __device__ __forceinline__ int64_t row_bytes(int bits, int64_t cols) {
  return bits == 8 ? cols : (bits == 4 ? cols / 2 : cols / 8 * 3);
}

// The packed bytes of columns [c0, c0 + 8) (c0 a multiple of 8) of a row (precision/int_quant.h):
// 8 bits, the 8 bytes of the columns; 4 bits, the chunk of 32 columns in 16 bytes holds column p
// of the chunk in byte p mod 16 (low nibble below 16, high from 16), so 8 consecutive bytes;
// 3 bits, 3 bytes (24 bits, in lo). `aligned`: the row is 8-byte aligned, so 8 and 4 bits read
// their 8 bytes in one load.
struct Packed8 {
  uint32_t lo = 0, hi = 0;
};

template <int BITS>
__device__ __forceinline__ Packed8 load8(const uint8_t* row, int64_t c0, bool aligned) {
  Packed8 r;
  if constexpr (BITS == 3) {
    const uint8_t* p = row + c0 / 8 * 3;
    r.lo = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16);
  } else {
    const uint8_t* p = BITS == 8 ? row + c0 : row + c0 / 32 * 16 + (c0 % 32 & 15);
    if (aligned) {
      const int2 w = *reinterpret_cast<const int2*>(p);
      r.lo = static_cast<uint32_t>(w.x), r.hi = static_cast<uint32_t>(w.y);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        r.lo |= static_cast<uint32_t>(p[j]) << (8 * j);
        r.hi |= static_cast<uint32_t>(p[j + 4]) << (8 * j);
      }
    }
  }
  return r;
}

// The 8 codes of load8's bytes (c0 as given to load8).
template <int BITS>
__device__ __forceinline__ void unpack8(Packed8 b, int64_t c0, int q[8]) {
  if constexpr (BITS == 3) {
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = static_cast<int>((b.lo >> (3 * j)) & 7u);
  } else {
    const int shift = BITS == 8 ? 0 : (c0 % 32 >= 16 ? 4 : 0);
    const uint32_t mask = BITS == 8 ? 0xFFu : 0x0Fu;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      q[j] = static_cast<int>(((b.lo >> (8 * j)) >> shift) & mask);
      q[j + 4] = static_cast<int>(((b.hi >> (8 * j)) >> shift) & mask);
    }
  }
}

// A group's scale and zero point (IntGroups): an f16 scale widened exactly (every f16 value is
// an f32 one), a missing zero point 2^(BITS - 1); so a compact weight gives the widened one's
// numbers bit for bit.
struct GroupParams {
  const void* scales;
  const uint8_t* zeros;
  bool f16;
  float symmetric_zero;
  __device__ __forceinline__ float scale(int64_t i) const {
    return f16 ? f16_value(static_cast<const uint16_t*>(scales)[i]) : static_cast<const float*>(scales)[i];
  }
  __device__ __forceinline__ float zero(int64_t i) const {
    return zeros != nullptr ? static_cast<float>(zeros[i]) : symmetric_zero;
  }
};
GroupParams group_params(IntGroups g, int bits) {
  return {g.scales, g.zeros, g.f16, static_cast<float>(1 << (bits - 1))};
}

template <int BITS>
__global__ void int_dequantize_kernel(const uint8_t* codes, GroupParams params, int64_t group,
                                      int64_t rows, int64_t cols, const float* input_scale, float* out, bool aligned,
                                      bool vec) {
  const int64_t per_row = cols / 8, groups = cols / group, rb = row_bytes(BITS, cols);
  for (int64_t i = thread_index(); i < rows * per_row; i += thread_count()) {
    const int64_t o = i / per_row, c0 = (i - o * per_row) * 8;
    int q[8];
    unpack8<BITS>(load8<BITS>(codes + o * rb, c0, aligned), c0, q);
    const float s = params.scale(o * groups + c0 / group), z = params.zero(o * groups + c0 / group);
    float w[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      w[j] = s * (static_cast<float>(q[j]) - z);
      if (input_scale != nullptr) w[j] = w[j] * input_scale[c0 + j];
    }
    float* dst = out + o * cols + c0;
    if (vec) {
      *reinterpret_cast<float4*>(dst) = make_float4(w[0], w[1], w[2], w[3]);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(w[4], w[5], w[6], w[7]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[j] = w[j];
    }
  }
}

// W8A8's per-row input scale: s_x = max_c |x_c v_c| / 127 (1 for an all-zero row). One block per
// row (grid-stride), a shared-memory max tree.
__global__ void act_scale_kernel(const float* x, const float* input_scale, float* sx, int64_t n, int64_t cols) {
  __shared__ float part[kBlock];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    float m = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float v = x[r * cols + c];
      if (input_scale != nullptr) v = v * input_scale[c];
      m = fmaxf(m, fabsf(v));
    }
    part[threadIdx.x] = m;
    __syncthreads();
    for (int h = kBlock / 2; h > 0; h >>= 1) {
      if (static_cast<int>(threadIdx.x) < h) part[threadIdx.x] = fmaxf(part[threadIdx.x], part[threadIdx.x + h]);
      __syncthreads();
    }
    if (threadIdx.x == 0) sx[r] = part[0] > 0.0f ? part[0] / 127.0f : 1.0f;
    __syncthreads();  // part is rewritten by the next row
  }
}

// Blocks own 8 output rows (one per warp) x chunks of NR input rows (grid-stride in both).
// Shared tile: NR rows x 256 columns of the input (f32 bits, or W8A8's int8 codes as ints).
template <int BITS, int NR, bool INT8>
__global__ void int_linear_kernel(const float* x, const uint8_t* codes, GroupParams params, int64_t group,
                      int64_t rows, int64_t cols, const float* input_scale, const float* sx, float* y, int64_t n,
                      float beta, const float* bias, bool aligned) {
  __shared__ int tile[NR][kLinTile];
  const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t groups = cols / group, rb = row_bytes(BITS, cols);
  for (int64_t ob = blockIdx.x; ob * kLinWarps < rows; ob += gridDim.x) {
    const int64_t o = ob * kLinWarps + warp;
    const bool active = o < rows;
    for (int64_t n0 = static_cast<int64_t>(blockIdx.y) * NR; n0 < n; n0 += static_cast<int64_t>(gridDim.y) * NR) {
      const int nrows = static_cast<int>(min64(NR, n - n0));
      float facc[NR];
      int iacc[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) facc[r] = 0.0f, iacc[r] = 0;
      // The codes (and group scale, zero) of this lane's 8 columns of the next tile are loaded
      // before the current tile is staged and multiplied: two tiles' loads in flight per lane.
      const int l0 = lane * 8;
      const uint8_t* row = codes + o * rb;
      Packed8 cur;
      float s_cur = 0.0f, z_cur = 0.0f;
      if (active && l0 < cols) {
        cur = load8<BITS>(row, l0, aligned);
        if constexpr (!INT8) s_cur = params.scale(o * groups + l0 / group), z_cur = params.zero(o * groups + l0 / group);
      }
      for (int64_t t0 = 0; t0 < cols; t0 += kLinTile) {
        const int width = static_cast<int>(min64(kLinTile, cols - t0));
        const int64_t c0 = t0 + l0, c1 = c0 + kLinTile;
        Packed8 next;
        float s_next = 0.0f, z_next = 0.0f;
        if (active && c1 < cols) {
          next = load8<BITS>(row, c1, aligned);
          if constexpr (!INT8) s_next = params.scale(o * groups + c1 / group), z_next = params.zero(o * groups + c1 / group);
        }
        __syncthreads();  // the previous tile's readers are done
        for (int k = static_cast<int>(threadIdx.x); k < NR * kLinTile; k += kLinWarps * kWarp) {
          const int r = k / kLinTile, c = k % kLinTile;
          if (r >= nrows || c >= width) continue;
          float v = x[(n0 + r) * cols + t0 + c];
          if (input_scale != nullptr) v = v * input_scale[t0 + c];
          if constexpr (INT8) {
            const float qv = rintf(v / sx[n0 + r]);
            tile[r][c] = static_cast<int>(qv < -127.0f ? -127.0f : (qv > 127.0f ? 127.0f : qv));
          } else {
            tile[r][c] = __float_as_int(v);
          }
        }
        __syncthreads();
        if (active && l0 < width) {
          int q[8];
          unpack8<BITS>(cur, c0, q);
          if constexpr (INT8) {
#pragma unroll
            for (int r = 0; r < NR; ++r) {
              if (r >= nrows) continue;  // not break: a fully unrolled loop has one exit (hip-clang)
              int d = 0;
#pragma unroll
              for (int j = 0; j < 8; ++j) d += tile[r][l0 + j] * (q[j] - 128);
              iacc[r] += d;
            }
          } else {
            float w[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) w[j] = static_cast<float>(q[j]) - z_cur;  // exact
#pragma unroll
            for (int r = 0; r < NR; ++r) {
              if (r >= nrows) continue;
              float p = 0.0f;
#pragma unroll
              for (int j = 0; j < 8; ++j) p = fmaf(__int_as_float(tile[r][l0 + j]), w[j], p);
              facc[r] = fmaf(s_cur, p, facc[r]);
            }
          }
        }
        cur = next, s_cur = s_next, z_cur = z_next;
      }
      // Every lane of every warp takes part in the shuffles; lane r stores input row n0 + r.
      float out = 0.0f;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        float v;
        if constexpr (INT8) {
          const int d = warp_sum(iacc[r]);
          v = active && r < nrows ? mul_gpu_rn(mul_gpu_rn(sx[n0 + r], params.scale(o)), static_cast<float>(d)) : 0.0f;
        } else {
          v = warp_sum(facc[r]);
        }
        if (lane == r) out = v;
      }
      if (active && lane < nrows) {
        if (bias != nullptr) out = out + bias[o];
        float* dst = y + (n0 + lane) * rows + o;
        *dst = beta == 0.0f ? out : mul_gpu_rn(beta, *dst) + out;
      }
    }
  }
}

// 8 bf16 (16 bytes: two to a word, the lower column in the low half) widened to f32.
__device__ __forceinline__ void widen_bf16x8(int4 v, float out[8]) {
  const uint32_t words[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                             static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[2 * k] = __uint_as_float(words[k] << 16);
    out[2 * k + 1] = __uint_as_float(words[k] & 0xFFFF0000u);
  }
}

// vec: cols a multiple of 8, w and x 16-byte aligned, so each lane loads 8 columns at once (of
// the weight, 16 bytes; of each input row, two float4), kBf16Loads weight loads in flight: one at
// a time, the decode kernel read an H200's memory at 20-45% of its bandwidth (2026-12-04, ncu).
constexpr int kBf16Loads = 4;
template <int NR>
__global__ void bf16_weight_linear_kernel(const float* x, const uint16_t* w, int64_t rows, int64_t cols, float* y,
                                          int64_t n, float beta, const float* bias, bool vec) {
  const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  for (int64_t ob = blockIdx.x; ob * kLinWarps < rows; ob += gridDim.x) {
    const int64_t o = ob * kLinWarps + warp;
    const bool active = o < rows;
    for (int64_t n0 = static_cast<int64_t>(blockIdx.y) * NR; n0 < n; n0 += static_cast<int64_t>(gridDim.y) * NR) {
      const int nrows = static_cast<int>(min64(NR, n - n0));
      const float* xs = x + n0 * cols;
      float acc[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
      if (active && vec) {
        const uint16_t* row = w + o * cols;
        // Each lane's 8 columns c..c+7 of every input row, in column order (the same bits
        // whatever the loads in flight).
        auto add = [&](int64_t c, int4 packed) {
          float wv[8];
          widen_bf16x8(packed, wv);
#pragma unroll
          for (int r = 0; r < NR; ++r) {
            if (r >= nrows) continue;  // not break: a fully unrolled loop has one exit (hip-clang)
            const float4 x0 = *reinterpret_cast<const float4*>(xs + r * cols + c);
            const float4 x1 = *reinterpret_cast<const float4*>(xs + r * cols + c + 4);
            const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[r] = fmaf(xv[j], wv[j], acc[r]);
          }
        };
        constexpr int64_t kStep = kWarp * 8;
        int64_t c = static_cast<int64_t>(lane) * 8;
        for (; c + (kBf16Loads - 1) * kStep < cols; c += kBf16Loads * kStep) {
          int4 packed[kBf16Loads];  // the weight's loads in flight together
#pragma unroll
          for (int u = 0; u < kBf16Loads; ++u) packed[u] = *reinterpret_cast<const int4*>(row + c + u * kStep);
#pragma unroll
          for (int u = 0; u < kBf16Loads; ++u) add(c + u * kStep, packed[u]);
        }
        for (; c < cols; c += kStep) add(c, *reinterpret_cast<const int4*>(row + c));
      } else if (active) {
        const uint16_t* row = w + o * cols;
        for (int64_t c = lane; c < cols; c += kWarp) {
          const float wv = __uint_as_float(static_cast<uint32_t>(row[c]) << 16);
#pragma unroll
          for (int r = 0; r < NR; ++r) {
            if (r >= nrows) continue;
            acc[r] = fmaf(xs[r * cols + c], wv, acc[r]);
          }
        }
      }
      // Every lane of every warp takes part in the shuffles; lane r stores input row n0 + r.
      float out = 0.0f;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == r) out = v;
      }
      if (active && lane < nrows) {
        if (bias != nullptr) out = out + bias[o];
        float* dst = y + (n0 + lane) * rows + o;
        *dst = beta == 0.0f ? out : mul_gpu_rn(beta, *dst) + out;
      }
    }
  }
}

template <int NR>
void launch_bf16_weight_linear(const float* x, const uint16_t* w, int64_t rows, int64_t cols, float* y, int64_t n,
                               float beta, const float* bias, bool vec, cudaStream_t stream) {
  const int64_t chunks = (n + NR - 1) / NR;
  const dim3 grid(grid_for(rows, kLinWarps), static_cast<unsigned>(chunks < kMaxGridY ? chunks : kMaxGridY));
  launch<bf16_weight_linear_kernel<NR>>(grid, dim3(kLinWarps * kWarp), 0, stream, x, w, rows, cols, y, n, beta, bias,
                                        vec);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <int BITS, int NR, bool INT8>
void launch_int_linear(const float* x, const uint8_t* codes, GroupParams params, int64_t group,
                       int64_t rows, int64_t cols, const float* input_scale, const float* sx, float* y, int64_t n,
                       float beta, const float* bias, bool aligned, cudaStream_t stream) {
  const int64_t chunks = (n + NR - 1) / NR;
  const dim3 grid(grid_for(rows, kLinWarps), static_cast<unsigned>(chunks < kMaxGridY ? chunks : kMaxGridY));
  launch<int_linear_kernel<BITS, NR, INT8>>(grid, dim3(kLinWarps * kWarp), 0, stream, x, codes, params, group,
                                            rows, cols, input_scale, sx, y, n, beta, bias, aligned);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <int BITS, bool INT8>
void int_linear_rows(int64_t n, const float* x, const uint8_t* codes, GroupParams params,
                     int64_t group, int64_t rows, int64_t cols, const float* input_scale, const float* sx, float* y,
                     float beta, const float* bias, bool aligned, cudaStream_t stream) {
  if (n == 1) launch_int_linear<BITS, 1, INT8>(x, codes, params, group, rows, cols, input_scale, sx, y, n, beta, bias, aligned, stream);
  else if (n == 2) launch_int_linear<BITS, 2, INT8>(x, codes, params, group, rows, cols, input_scale, sx, y, n, beta, bias, aligned, stream);
  else if (n <= 4) launch_int_linear<BITS, 4, INT8>(x, codes, params, group, rows, cols, input_scale, sx, y, n, beta, bias, aligned, stream);
  else launch_int_linear<BITS, 8, INT8>(x, codes, params, group, rows, cols, input_scale, sx, y, n, beta, bias, aligned, stream);
}

bool aligned_to(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

void row_norms(const float* x, float* norms, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0) return;
  launch<row_norms_kernel>(grid_for(rows, kDoraWarps * kDoraRows), dim3(kDoraWarps * kWarp), 0, stream, x, norms, rows, cols);
  LOOM_CUDA_CHECK_LAUNCH();
}

void dora_weight(const float* merged, const float* base, const float* magnitude, const float* norms, float* out,
                 int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  launch<dora_weight_kernel>(grid_for(rows, 1), dim3(kBlock), 0, stream, merged, base, magnitude, norms, out, rows, cols);
  LOOM_CUDA_CHECK_LAUNCH();
}

void dora_backward(float* grad, const float* merged, const float* magnitude, const float* norms, float* dmagnitude,
                   int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0) return;
  launch<dora_backward_kernel>(grid_for(rows, kDoraWarps * kDoraRows), dim3(kDoraWarps * kWarp), 0, stream, grad, merged,
                               magnitude, norms, dmagnitude, rows, cols);
  LOOM_CUDA_CHECK_LAUNCH();
}

void nf4_dequantize(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_steps,
                    const float* values, float absmax_mean, int64_t first, int64_t n, void* out, bool bf16,
                    cudaStream_t stream) {
  if (n <= 0) return;
  Nf4Values table;
  for (int k = 0; k < 16; ++k) table.v[k] = values[k];
  const int64_t end = first + n, items = (end - (first & ~int64_t{7}) + 7) / 8;
  const bool vec = first % 8 == 0 && aligned_to(out, 16);
  if (bf16) {
    launch<nf4_dequantize_kernel<true>>(grid_for(items, kBlock), dim3(kBlock), 0, stream, codes, absmax_codes,
                                        absmax_steps, table, absmax_mean, first, end, items, out, vec);
  } else {
    launch<nf4_dequantize_kernel<false>>(grid_for(items, kBlock), dim3(kBlock), 0, stream, codes, absmax_codes,
                                         absmax_steps, table, absmax_mean, first, end, items, out, vec);
  }
  LOOM_CUDA_CHECK_LAUNCH();
}

void int_dequantize(const uint8_t* codes, IntGroups groups, int bits, int64_t group, int64_t rows, int64_t cols,
                    const float* input_scale, float* out, cudaStream_t stream) {
  const GroupParams params = group_params(groups, bits);
  const int64_t items = rows * (cols / 8);
  if (items == 0) return;
  const bool aligned = aligned_to(codes, 8), vec = aligned_to(out, 16);
  const dim3 grid(grid_for(items, kBlock)), block(kBlock);
  if (bits == 8) launch<int_dequantize_kernel<8>>(grid, block, 0, stream, codes, params, group, rows, cols, input_scale, out, aligned, vec);
  else if (bits == 4) launch<int_dequantize_kernel<4>>(grid, block, 0, stream, codes, params, group, rows, cols, input_scale, out, aligned, vec);
  else launch<int_dequantize_kernel<3>>(grid, block, 0, stream, codes, params, group, rows, cols, input_scale, out, aligned, vec);
  LOOM_CUDA_CHECK_LAUNCH();
}

size_t int_linear_scratch_bytes(int64_t n, bool act_int8) {
  return act_int8 ? static_cast<size_t>(n) * sizeof(float) : 0;
}

void int_linear(const float* x, const uint8_t* codes, IntGroups groups, int bits, int64_t group, int64_t rows,
                int64_t cols, bool act_int8, const float* input_scale, float* y, int64_t n, float beta,
                const float* bias, void* scratch, cudaStream_t stream) {
  if (n == 0 || rows == 0) return;
  const GroupParams params = group_params(groups, bits);
  const bool aligned = aligned_to(codes, 8);
  if (act_int8) {
    float* sx = static_cast<float*>(scratch);
    launch<act_scale_kernel>(grid_for(n, 1), dim3(kBlock), 0, stream, x, input_scale, sx, n, cols);
    LOOM_CUDA_CHECK_LAUNCH();
    int_linear_rows<8, true>(n, x, codes, params, group, rows, cols, input_scale, sx, y, beta, bias, aligned, stream);
    return;
  }
  if (bits == 8) int_linear_rows<8, false>(n, x, codes, params, group, rows, cols, input_scale, nullptr, y, beta, bias, aligned, stream);
  else if (bits == 4) int_linear_rows<4, false>(n, x, codes, params, group, rows, cols, input_scale, nullptr, y, beta, bias, aligned, stream);
  else int_linear_rows<3, false>(n, x, codes, params, group, rows, cols, input_scale, nullptr, y, beta, bias, aligned, stream);
}

void bf16_weight_linear(const float* x, const uint16_t* w, int64_t rows, int64_t cols, float* y, int64_t n, float beta,
                        const float* bias, cudaStream_t stream) {
  if (n == 0 || rows == 0) return;
  const bool vec = cols % 8 == 0 && aligned_to(w, 16) && aligned_to(x, 16);
  if (n == 1) launch_bf16_weight_linear<1>(x, w, rows, cols, y, n, beta, bias, vec, stream);
  else if (n == 2) launch_bf16_weight_linear<2>(x, w, rows, cols, y, n, beta, bias, vec, stream);
  else if (n <= 4) launch_bf16_weight_linear<4>(x, w, rows, cols, y, n, beta, bias, vec, stream);
  else if (n <= 8) launch_bf16_weight_linear<8>(x, w, rows, cols, y, n, beta, bias, vec, stream);
  else launch_bf16_weight_linear<16>(x, w, rows, cols, y, n, beta, bias, vec, stream);
}

}  // namespace loom::cuda
