// The stable radix sort of (uint32 key, uint32 value) pairs that the embedding backward
// (cuda_kernels.cu), Top-K and scatter-add (cuda_compress.cu) and the MoE capacity
// (cuda_moe.cu) build on, behind one interface (cuda_sort.cu): CUB's DeviceRadixSort::SortPairs
// in the nvcc build and on the simulator (sim/cub.cpp), rocPRIM's radix_sort_pairs under hipcc.
// Both are LSD radix sorts over the key bits [0, end_bit), stable: equal keys keep their values'
// input order, which the callers' determinism rests on.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace loom::cuda {

// Temporary storage for sorting n pairs by key bits [0, end_bit) (n <= INT32_MAX).
size_t radix_sort_pairs_bytes(int64_t n, int end_bit);

// keys_out / values_out = the n pairs sorted by keys_in's bits [0, end_bit), stably, enqueued on
// `stream`; temp holds temp_bytes >= radix_sort_pairs_bytes(n, end_bit). A refused call throws
// (LOOM_CUDA_CHECK).
void radix_sort_pairs(void* temp, size_t temp_bytes, const uint32_t* keys_in, uint32_t* keys_out,
                      const uint32_t* values_in, uint32_t* values_out, int64_t n, int end_bit, cudaStream_t stream);

}  // namespace loom::cuda
