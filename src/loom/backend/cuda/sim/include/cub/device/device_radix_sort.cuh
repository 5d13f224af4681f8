// The CUDA simulator's cub/device/device_radix_sort.cuh (docs/cuda.md "The simulator"): CUB's
// cub::DeviceRadixSort::SortPairs (the non-DoubleBuffer overload), run on the CPU. The template
// only classifies the key type; the work is done by loom::sim::cub_detail::radix_sort_pairs in
// sim/cub.cpp.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace loom::sim::cub_detail {

// How a key's bits are ordered: CUB sorts signed and floating-point keys by first flipping bits
// so that the unsigned order of the result is the key order.
enum class KeyKind { kUnsigned, kSigned, kFloat };

// SortPairs for keys of `key_bytes` bytes (1, 2, 4 or 8) of kind `key_kind` and values of
// `value_bytes` bytes (copied as bytes). Same arguments and results as the template below.
cudaError_t radix_sort_pairs(void* d_temp_storage, size_t& temp_storage_bytes, const void* d_keys_in, void* d_keys_out,
                             size_t key_bytes, KeyKind key_kind, const void* d_values_in, void* d_values_out,
                             size_t value_bytes, long long num_items, int begin_bit, int end_bit, cudaStream_t stream);

}  // namespace loom::sim::cub_detail

namespace cub {

struct DeviceRadixSort {
  // CUB's documented contract (DeviceRadixSort::SortPairs): with d_temp_storage == nullptr, only
  // sets temp_storage_bytes. Otherwise sorts the num_items (key, value) pairs by the key bits
  // [begin_bit, end_bit), stably, into d_keys_out / d_values_out, asynchronously on `stream`.
  // The output ranges must not overlap the input ranges; the temporary storage is clobbered.
  // Returns cudaErrorInvalidValue when temp_storage_bytes is smaller than the query gave (or
  // the bit range or num_items is invalid); pointers outside device memory fail as a kernel's
  // illegal address would (cudaErrorIllegalAddress, sticky).
  template <typename KeyT, typename ValueT, typename NumItemsT>
  static cudaError_t SortPairs(void* d_temp_storage, size_t& temp_storage_bytes, const KeyT* d_keys_in,
                               KeyT* d_keys_out, const ValueT* d_values_in, ValueT* d_values_out, NumItemsT num_items,
                               int begin_bit = 0, int end_bit = sizeof(KeyT) * 8, cudaStream_t stream = 0) {
    static_assert(std::is_arithmetic_v<KeyT> && !std::is_same_v<KeyT, bool>,
                  "the simulator's SortPairs takes integer and floating-point keys");
    static_assert(sizeof(KeyT) == 1 || sizeof(KeyT) == 2 || sizeof(KeyT) == 4 || sizeof(KeyT) == 8);
    static_assert(std::is_integral_v<NumItemsT>, "num_items must be an integer");
    static_assert(std::is_trivially_copyable_v<ValueT>);
    using loom::sim::cub_detail::KeyKind;
    const KeyKind kind = std::is_floating_point_v<KeyT> ? KeyKind::kFloat
                         : std::is_signed_v<KeyT>       ? KeyKind::kSigned
                                                        : KeyKind::kUnsigned;
    return loom::sim::cub_detail::radix_sort_pairs(d_temp_storage, temp_storage_bytes, d_keys_in, d_keys_out,
                                                   sizeof(KeyT), kind, d_values_in, d_values_out, sizeof(ValueT),
                                                   static_cast<long long>(num_items), begin_bit, end_bit, stream);
  }
};

}  // namespace cub
