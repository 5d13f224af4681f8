// A caching allocator's bookkeeping, independent of the device: blocks released by tensors are
// kept by their rounded size and handed out again to the next request of that size, so a
// training loop that allocates the same shapes every step calls the device allocator (cudaMalloc,
// which synchronizes the GPU) only in its first step. When the device is out of memory, every
// cached block is returned and the request retried once; then a one-line error gives the request
// and the bytes live and cached. Stream ordering makes reuse safe: the CUDA backend runs every
// kernel on one stream, so a block released by the host and reused by a later kernel is written
// only after the kernels queued before the release have finished with it.
#pragma once
#include <cstddef>
#include <functional>
#include <map>
#include <string>

namespace loom {

class BlockCache {
 public:
  using RawAllocate = std::function<void*(size_t bytes)>;  // nullptr when out of memory
  using RawRelease = std::function<void(void* ptr)>;

  BlockCache(std::string device_name, RawAllocate raw_allocate, RawRelease raw_release);
  ~BlockCache();  // returns the cached blocks (live ones belong to their tensors)
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // Requests are rounded up: to 512 bytes below 1 MiB, to 2 MiB above (granules that repeat
  // from step to step, and 256-byte alignment for vectorized kernels). 0 bytes -> nullptr.
  static size_t rounded(size_t bytes);
  void* allocate(size_t bytes);
  void release(void* ptr, size_t bytes);  // bytes as requested
  void empty_cache();                     // returns every cached block to the device

  size_t reserved_bytes() const { return live_ + cached_; }  // obtained from the device
  size_t cached_bytes() const { return cached_; }
  size_t device_allocations() const { return device_allocations_; }  // raw calls, for tests

 private:
  std::string device_name_;
  RawAllocate raw_allocate_;
  RawRelease raw_release_;
  std::multimap<size_t, void*> free_;  // [rounded size] -> cached block
  size_t live_ = 0, cached_ = 0, device_allocations_ = 0;
};

}  // namespace loom
