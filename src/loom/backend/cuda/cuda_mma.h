// The warp-wide tensor-core product
//
//   mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32  D (16x8 f32) = A (16x16 bf16) B (16x8 bf16) + C
//
// for kernels of the CUDA backend, with the fragment index math and bf16 packing it needs.
//
// Fragments (PTX ISA 9.2, section 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating
// point type": the .f16 / .bf16 multiplicands and the .f32 accumulators; figure 79 is A's).
// With groupID g = laneid >> 2 and threadID_in_group t = laneid % 4, each lane holds
//   A: 4 .b32 registers of two bf16 each (the lower-index element in the low 16 bits):
//        a[0] = A[g    ][2t, 2t+1]     a[1] = A[g + 8][2t, 2t+1]
//        a[2] = A[g    ][2t+8, 2t+9]   a[3] = A[g + 8][2t+8, 2t+9]
//      (element ai: row g for i < 2 or 4 <= i < 6, else g + 8; col 2t + (i & 1), + 8 for i >= 4)
//   B: 2 .b32 registers (B is K x N = 16 x 8, "col": a register pairs two k of one column):
//        b[0] = B[2t, 2t+1][g]         b[1] = B[2t+8, 2t+9][g]
//      (element bi: row 2t + (i & 1), + 8 for i >= 2; col g)
//   C, D: 4 f32 registers:
//        c[0] = C[g][2t]  c[1] = C[g][2t+1]  c[2] = C[g+8][2t]  c[3] = C[g+8][2t+1]
//      (element ci: row g for i < 2, else g + 8; col 2t + (i & 1))
// A useful consequence (FlashAttention-2's register reuse): the C fragments of two adjacent 16x8
// tiles (columns [16 kk, 16 kk + 8) and [16 kk + 8, 16 kk + 16)), packed to bf16 pairwise, are
// exactly the A fragment of the 16x16 block of k-step kk: a[0] = pack(c0[0], c0[1]), a[1] =
// pack(c0[2], c0[3]), a[2] = pack(c1[0], c1[1]), a[3] = pack(c1[2], c1[3]) (acc_to_a below).
//
// nvcc build: the inline PTX instruction (sm_80 and later; the backend builds for sm_90).
// Simulator build (LOOM_CUDA_SIM) and HIP (LOOM_CUDA_HIP, cuda_device.h: correct, not fast; an
// MFMA path, __builtin_amdgcn_mfma_f32_16x16x16bf16_1k, is the port's next step,
// docs/accelerators.md): a scalar twin. Each lane gathers, with 16 full-warp shuffles
// (cuda_device.h's shfl; 64-bit: two registers per exchange), the A rows g and g + 8 from lanes
// 4g..4g+3 and the B columns 2t and 2t + 1 from lanes 8t..8t+7, then computes each of its four D elements as
// d = C; d += float(a_k) float(b_k) for k = 0..15 in order, in fp32. Every bf16 x bf16 product is
// exact in fp32, so only the 16 additions round. The hardware's adder tree sums in another order
// (and may keep other intermediate precision): tolerances, not bits, compare a GPU with this
// twin. All 32 lanes of the warp must call it together (it is warp-collective on both builds).
#pragma once
#include <cstdint>

#include "loom/backend/cuda/cuda_device.h"

namespace loom::cuda::mma {

// ---------------------------------------------------------------- fragment index math
__host__ __device__ __forceinline__ int group_id(int lane) { return lane >> 2; }
__host__ __device__ __forceinline__ int thread_in_group(int lane) { return lane & 3; }

// Element i (0..7) of a lane's A fragment: register i / 2, half i % 2.
__host__ __device__ __forceinline__ int a_row(int lane, int i) { return group_id(lane) + (((i >> 1) & 1) ? 8 : 0); }
__host__ __device__ __forceinline__ int a_col(int lane, int i) {
  return 2 * thread_in_group(lane) + (i & 1) + (i >= 4 ? 8 : 0);
}
// Element i (0..3) of a lane's B fragment (B is 16 x 8, k x n).
__host__ __device__ __forceinline__ int b_row(int lane, int i) {
  return 2 * thread_in_group(lane) + (i & 1) + (i >= 2 ? 8 : 0);
}
__host__ __device__ __forceinline__ int b_col(int lane, int /*i*/) { return group_id(lane); }
// Element i (0..3) of a lane's C / D fragment (16 x 8).
__host__ __device__ __forceinline__ int c_row(int lane, int i) { return group_id(lane) + (i >= 2 ? 8 : 0); }
__host__ __device__ __forceinline__ int c_col(int lane, int i) { return 2 * thread_in_group(lane) + (i & 1); }

// ---------------------------------------------------------------- bf16 packing
// Two floats to one bf16x2 register, each rounded to nearest even (__float22bfloat162_rn): lo
// in bits 0-15, hi in bits 16-31.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
#if defined(LOOM_CUDA_SIM) || defined(LOOM_CUDA_HIP)
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
#else
  const __nv_bfloat162 v = __float22bfloat162_rn(make_float2(lo, hi));
  return *reinterpret_cast<const uint32_t*>(&v);
#endif
}
// The bf16 in the low / high half of a register, widened exactly.
__device__ __forceinline__ float bf16_lo(uint32_t r) { return __uint_as_float(r << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t r) { return __uint_as_float(r & 0xffff0000u); }
// Two bf16 bit patterns (low, high) into one register.
__host__ __device__ __forceinline__ uint32_t pair_bf16(uint32_t lo_bits, uint32_t hi_bits) {
  return (lo_bits & 0xffffu) | (hi_bits << 16);
}

// C fragments of tiles 2 kk and 2 kk + 1 (16 x 8 each) -> the A fragment of k-step kk (above).
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack_bf16x2(c0[0], c0[1]);
  a[1] = pack_bf16x2(c0[2], c0[3]);
  a[2] = pack_bf16x2(c1[0], c1[1]);
  a[3] = pack_bf16x2(c1[2], c1[3]);
}

// ---------------------------------------------------------------- fragments from shared memory
// ldmatrix (PTX ISA 9.2, section 9.7.14.5.15 "Warp-level matrix load instruction: ldmatrix"):
//   ldmatrix.sync.aligned.m8n8.x{2,4}{,.trans}.shared.b16
// loads kN 8 x 8 matrices of 16-bit elements from shared memory, matrix i's eight rows at the
// 16-byte aligned addresses given by lanes 8 i .. 8 i + 7 (`row`: the lane's row, 8 contiguous
// elements). Lane l receives, in register i,
//   without .trans: matrix i's row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1;
//   with .trans:    matrix i's elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4) (a column pair),
// the lower-index element in the low half. So a matrix of rows n and columns k is a B fragment
// register (b[j] = B[2t, 2t+1][g]: row g of the stored B^T) without .trans, and a matrix of
// rows k and columns n is one with .trans; four matrices at rows (m, m + 8) x columns (k, k + 8)
// are an A fragment. The simulator's and HIP's twin: each lane fetches the row addresses it needs
// from their lanes by shuffles and reads the words itself (every lane must call it together).
namespace detail {
__device__ __forceinline__ int twin_lane() {
#if defined(LOOM_CUDA_SIM)
  return ::loom::sim::lane_id();
#elif defined(LOOM_CUDA_HIP)
  return static_cast<int>(__lane_id() & 31u);  // the lane in the logical 32-lane warp
#else
  return 0;
#endif
}
template <int kN, bool kTrans>
__device__ __forceinline__ void ldmatrix_twin(uint32_t (&r)[kN], const void* row) {
  const int lane = twin_lane();
  const uint64_t mine = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(row));
  for (int i = 0; i < kN; ++i) {
    if constexpr (kTrans) {  // rows 2 (l % 4) and 2 (l % 4) + 1 of matrix i, column l / 4
      const auto* lo = reinterpret_cast<const uint16_t*>(
          static_cast<uintptr_t>(::loom::cuda::shfl(mine, 8 * i + 2 * (lane & 3))));
      const auto* hi = reinterpret_cast<const uint16_t*>(
          static_cast<uintptr_t>(::loom::cuda::shfl(mine, 8 * i + 2 * (lane & 3) + 1)));
      r[i] = pair_bf16(lo[lane >> 2], hi[lane >> 2]);
    } else {  // row l / 4 of matrix i, its word l % 4
      const auto* words = reinterpret_cast<const uint32_t*>(
          static_cast<uintptr_t>(::loom::cuda::shfl(mine, 8 * i + (lane >> 2))));
      r[i] = words[lane & 3];
    }
  }
}
}  // namespace detail

template <bool kTrans = false>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(LOOM_CUDA_SIM) || defined(LOOM_CUDA_HIP)
  detail::ldmatrix_twin<4, kTrans>(r, row);
#else
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#endif
}

// The lane's row address for four matrices at rows (r0, r0 + 8) x columns (c0, c0 + 8) of a
// row-major tile of 16-bit elements (`stride` bytes a row, 16-byte aligned), in the order
// (r0, c0), (r0 + 8, c0), (r0, c0 + 8), (r0 + 8, c0 + 8): an A fragment of the 16 x 16 block
// without .trans, the B fragments of the n-tiles c0 and c0 + 8 (k rows r0..r0 + 15) with it.
__device__ __forceinline__ const void* quad_row(const void* tile, int stride, int r0, int c0, int lane) {
  const int r = r0 + (lane & 7) + ((lane >> 3) & 1) * 8, c = c0 + (lane >> 4) * 8;
  return static_cast<const char*>(tile) + static_cast<int64_t>(r) * stride + 2 * c;
}
// The lane's row address for four matrices at rows r0 x columns c0, c0 + 8, c0 + 16, c0 + 24:
// without .trans, the B fragments of k-steps c0 and c0 + 16 of the n-tile whose 8 columns
// are the tile's rows r0..r0 + 7 (B(k, n) = tile[r0 + n][c0 + k]).
__device__ __forceinline__ const void* strip_row(const void* tile, int stride, int r0, int c0, int lane) {
  const int r = r0 + (lane & 7), c = c0 + (lane >> 3) * 8;
  return static_cast<const char*>(tile) + static_cast<int64_t>(r) * stride + 2 * c;
}

// ---------------------------------------------------------------- the product
// d = a b + c (d may alias c).
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
#if defined(LOOM_CUDA_SIM) || defined(LOOM_CUDA_HIP)
#if defined(LOOM_CUDA_SIM)
  const int lane = ::loom::sim::lane_id();
#else
  const int lane = static_cast<int>(__lane_id() & 31u);  // the lane in the logical 32-lane warp
#endif
  const int g = group_id(lane), t = thread_in_group(lane);
  const uint64_t mine_a01 = static_cast<uint64_t>(a[0]) | (static_cast<uint64_t>(a[1]) << 32);
  const uint64_t mine_a23 = static_cast<uint64_t>(a[2]) | (static_cast<uint64_t>(a[3]) << 32);
  const uint64_t mine_b = static_cast<uint64_t>(b[0]) | (static_cast<uint64_t>(b[1]) << 32);
  // arow[r][k]: A[g + 8 r][k]; bcol[n][k]: B[k][2t + n].
  float arow[2][16], bcol[2][16];
  for (int s = 0; s < 4; ++s) {  // lane 4g + s holds A[g (+8)][2s, 2s+1] and [2s+8, 2s+9]
    const uint64_t x01 = ::loom::cuda::shfl(mine_a01, 4 * g + s);
    const uint64_t x23 = ::loom::cuda::shfl(mine_a23, 4 * g + s);
    const uint32_t r0 = static_cast<uint32_t>(x01), r1 = static_cast<uint32_t>(x01 >> 32);
    const uint32_t r2 = static_cast<uint32_t>(x23), r3 = static_cast<uint32_t>(x23 >> 32);
    arow[0][2 * s] = bf16_lo(r0), arow[0][2 * s + 1] = bf16_hi(r0);
    arow[1][2 * s] = bf16_lo(r1), arow[1][2 * s + 1] = bf16_hi(r1);
    arow[0][2 * s + 8] = bf16_lo(r2), arow[0][2 * s + 9] = bf16_hi(r2);
    arow[1][2 * s + 8] = bf16_lo(r3), arow[1][2 * s + 9] = bf16_hi(r3);
  }
  for (int n = 0; n < 2; ++n) {
    for (int s = 0; s < 4; ++s) {  // lane 4 (2t + n) + s holds B[2s, 2s+1][2t + n] and [2s+8, 2s+9]
      const uint64_t x = ::loom::cuda::shfl(mine_b, 4 * (2 * t + n) + s);
      const uint32_t r0 = static_cast<uint32_t>(x), r1 = static_cast<uint32_t>(x >> 32);
      bcol[n][2 * s] = bf16_lo(r0), bcol[n][2 * s + 1] = bf16_hi(r0);
      bcol[n][2 * s + 8] = bf16_lo(r1), bcol[n][2 * s + 9] = bf16_hi(r1);
    }
  }
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const float* ar = arow[i >> 1];
    const float* bc = bcol[i & 1];
    float acc = c[i];
    for (int k = 0; k < 16; ++k) {
      const float prod = ar[k] * bc[k];  // exact: 8-bit by 8-bit significands
      acc += prod;
    }
    out[i] = acc;
  }
  for (int i = 0; i < 4; ++i) d[i] = out[i];
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
#endif
}

}  // namespace loom::cuda::mma
