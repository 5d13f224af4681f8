// The CUDA simulator's CUB (docs/cuda.md "The simulator"): cub::DeviceRadixSort::SortPairs on the
// CPU, behind include/cub/device/device_radix_sort.cuh.
//
// The contract follows CUB's documentation of DeviceRadixSort (cub/device/device_radix_sort.cuh,
// "SortPairs" and the class overview):
//   - a call with d_temp_storage == nullptr only writes the required temp_storage_bytes;
//   - the sort is a stable LSD radix sort of the key bits [begin_bit, end_bit);
//   - signed and floating-point keys are sorted through a bit flip that makes their unsigned order
//     the numeric order; -0.0 and +0.0 are equal keys;
//   - the output ranges shall not overlap the input ranges;
//   - a temp_storage_bytes smaller than the query's answer is cudaErrorInvalidValue (CUB's own
//     check when it carves its temporaries out of the storage).
// What the GPU would do with memory it cannot address (an illegal address) becomes a sticky
// cudaErrorIllegalAddress with a report, as a kernel of the real library would raise.
#include <algorithm>
#include <cstring>
#include <cub/device/device_radix_sort.cuh>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "loom/backend/cuda/sim/sim_runtime.h"

namespace loom::sim::cub_detail {
namespace {

constexpr const char* kWhat = "cub::DeviceRadixSort::SortPairs";

size_t round_up_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The temporary storage the real CUB needs for this overload: an alternate buffer for keys and
// one for values, plus room for its per-digit histograms.
size_t required_temp_bytes(size_t num_items, size_t key_bytes, size_t value_bytes) {
  return 4096 + round_up_256(num_items * key_bytes) + round_up_256(num_items * value_bytes);
}

// The key as an unsigned integer whose order is the key order (the bit flips CUB documents).
uint64_t radix_key(const unsigned char* key, size_t key_bytes, KeyKind kind) {
  uint64_t bits = 0;
  std::memcpy(&bits, key, key_bytes);  // little-endian: the low key_bytes bytes
  const int width = static_cast<int>(key_bytes * 8);
  const uint64_t sign = uint64_t{1} << (width - 1);
  const uint64_t all = width == 64 ? ~uint64_t{0} : (uint64_t{1} << width) - 1;
  switch (kind) {
    case KeyKind::kUnsigned:
      return bits;
    case KeyKind::kSigned:
      return bits ^ sign;
    case KeyKind::kFloat:
      // -0.0 sorts as +0.0; negatives (sign set) reversed below the positives.
      if (bits == sign) bits = 0;
      return (bits & sign) ? (~bits & all) : (bits | sign);
  }
  return bits;
}

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

std::string pointer_text(const void* p) {
  std::ostringstream out;
  out << p;
  return out.str();
}

// The stable order of items by bits [begin_bit, end_bit) of their keys: least significant 8-bit
// digit first, each pass a counting sort that keeps the order of equal digits.
std::vector<size_t> radix_order(const std::vector<uint64_t>& keys, int begin_bit, int end_bit) {
  std::vector<size_t> order(keys.size()), next(keys.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  for (int shift = begin_bit; shift < end_bit; shift += 8) {
    const int digit_bits = std::min(8, end_bit - shift);
    const uint64_t mask = (uint64_t{1} << digit_bits) - 1;
    size_t start[257] = {};  // start[d + 1] counts digit d, then prefix sums give each digit's first slot
    for (size_t i : order) ++start[((keys[i] >> shift) & mask) + 1];
    for (int d = 0; d < 256; ++d) start[d + 1] += start[d];
    for (size_t i : order) next[start[(keys[i] >> shift) & mask]++] = i;
    order.swap(next);
  }
  return order;
}

}  // namespace

cudaError_t radix_sort_pairs(void* d_temp_storage, size_t& temp_storage_bytes, const void* d_keys_in, void* d_keys_out,
                             size_t key_bytes, KeyKind key_kind, const void* d_values_in, void* d_values_out,
                             size_t value_bytes, long long num_items, int begin_bit, int end_bit, cudaStream_t stream) {
  if (num_items < 0) return cudaErrorInvalidValue;
  const size_t n = static_cast<size_t>(num_items);
  const size_t required = required_temp_bytes(n, key_bytes, value_bytes);
  if (d_temp_storage == nullptr) {  // the size query: nothing else happens
    temp_storage_bytes = required;
    return cudaSuccess;
  }
  if (temp_storage_bytes < required) return cudaErrorInvalidValue;
  const int key_bits = static_cast<int>(key_bytes * 8);
  if (begin_bit < 0 || end_bit > key_bits || begin_bit > end_bit) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;

  const size_t keys_size = n * key_bytes, values_size = n * value_bytes;
  struct Range {
    const char* name;
    const void* p;
    size_t bytes;
  };
  const Range ranges[] = {{"d_temp_storage", d_temp_storage, required},
                          {"d_keys_in", d_keys_in, keys_size},
                          {"d_keys_out", d_keys_out, keys_size},
                          {"d_values_in", d_values_in, values_size},
                          {"d_values_out", d_values_out, values_size}};
  for (const Range& r : ranges) {
    if (!is_device_range(r.p, r.bytes)) {
      const void* last = static_cast<const char*>(r.p) + (r.bytes - 1);
      const std::string where = is_device_pointer(r.p)
                                    ? "it leaves its allocation: its last byte's " + describe_address(last)
                                    : describe_address(r.p);
      fail(cudaErrorIllegalAddress, std::string(kWhat) + ": " + r.name + " (" + std::to_string(r.bytes) + " bytes at " +
                                        pointer_text(r.p) + "): " + where);
      return cudaErrorIllegalAddress;
    }
  }
  // Every pair of buffers the sort reads and writes concurrently must be disjoint (CUB: "the
  // output ranges shall not overlap the input ranges"; the temporary storage is CUB's own).
  for (size_t i = 0; i < std::size(ranges); ++i) {
    for (size_t j = i + 1; j < std::size(ranges); ++j) {
      const bool both_inputs = (i == 1 || i == 3) && (j == 1 || j == 3);  // reading one array twice is fine
      if (!both_inputs && overlaps(ranges[i].p, ranges[i].bytes, ranges[j].p, ranges[j].bytes)) {
        fail(cudaErrorInvalidValue, std::string(kWhat) + ": " + ranges[i].name + " (" +
                                        std::to_string(ranges[i].bytes) + " bytes at " + pointer_text(ranges[i].p) +
                                        ") overlaps " + ranges[j].name + " (" + std::to_string(ranges[j].bytes) +
                                        " bytes at " + pointer_text(ranges[j].p) + ")");
        return cudaErrorInvalidValue;
      }
    }
  }

  const auto* keys_in = static_cast<const unsigned char*>(d_keys_in);
  const auto* values_in = static_cast<const unsigned char*>(d_values_in);
  auto* keys_out = static_cast<unsigned char*>(d_keys_out);
  auto* values_out = static_cast<unsigned char*>(d_values_out);
  auto* temp = static_cast<unsigned char*>(d_temp_storage);
  enqueue(stream, kWhat, [=] {
    check_initialized(keys_in, keys_size, "cub::DeviceRadixSort::SortPairs d_keys_in");
    check_initialized(values_in, values_size, "cub::DeviceRadixSort::SortPairs d_values_in");
    std::vector<uint64_t> keys(n);
    for (size_t i = 0; i < n; ++i) keys[i] = radix_key(keys_in + i * key_bytes, key_bytes, key_kind);
    const std::vector<size_t> order = radix_order(keys, begin_bit, end_bit);
    for (size_t i = 0; i < n; ++i) {
      std::memcpy(keys_out + i * key_bytes, keys_in + order[i] * key_bytes, key_bytes);
      std::memcpy(values_out + i * value_bytes, values_in + order[i] * value_bytes, value_bytes);
    }
    mark_written(keys_out, keys_size);
    mark_written(values_out, values_size);
    // The real CUB leaves its alternate buffers in the temporary storage: nothing there survives.
    std::memset(temp, 0xA5, required);
    mark_written(temp, required);
  });
  return cudaSuccess;
}

}  // namespace loom::sim::cub_detail
