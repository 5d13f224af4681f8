// cuda_sort.h: the library's radix sort. The sort's kernels are the library's own templates
// (CUB, rocPRIM), instantiated here, so this is the one .cu file that includes a device library.
// rocPRIM (Debian's librocprim-dev 5.3) compiles with ROCm 5.2's hipcc; its radix_sort_pairs takes
// CUB's arguments in the same order (rocPRIM documentation, "Device-wide primitives: radix sort").
#include "loom/backend/cuda/cuda_device.h"
#include "loom/backend/cuda/cuda_sort.h"

#if defined(LOOM_CUDA_HIP)
#include <rocprim/device/device_radix_sort.hpp>
#else
#include <cub/device/device_radix_sort.cuh>
#endif

#include "loom/backend/cuda/cuda_check.h"

namespace loom::cuda {
namespace {

// The one call of both libraries: with temp == nullptr it only sets temp_bytes.
cudaError_t sort_pairs(void* temp, size_t& temp_bytes, const uint32_t* keys_in, uint32_t* keys_out,
                       const uint32_t* values_in, uint32_t* values_out, int64_t n, int end_bit, cudaStream_t stream) {
#if defined(LOOM_CUDA_HIP)
  return rocprim::radix_sort_pairs(temp, temp_bytes, keys_in, keys_out, values_in, values_out,
                                   static_cast<unsigned>(n), 0u, static_cast<unsigned>(end_bit), stream);
#else
  return cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, values_in, values_out,
                                         static_cast<int>(n), 0, end_bit, stream);
#endif
}

}  // namespace

size_t radix_sort_pairs_bytes(int64_t n, int end_bit) {
  size_t bytes = 0;
  LOOM_CUDA_CHECK(sort_pairs(nullptr, bytes, nullptr, nullptr, nullptr, nullptr, n, end_bit, nullptr));
  return bytes;
}

void radix_sort_pairs(void* temp, size_t temp_bytes, const uint32_t* keys_in, uint32_t* keys_out,
                      const uint32_t* values_in, uint32_t* values_out, int64_t n, int end_bit, cudaStream_t stream) {
  LOOM_CUDA_CHECK(sort_pairs(temp, temp_bytes, keys_in, keys_out, values_in, values_out, n, end_bit, stream));
}

}  // namespace loom::cuda
