#include "loom/backend/block_cache.h"

#include "loom/core/error.h"
#include "loom/core/memory.h"

namespace loom {

BlockCache::BlockCache(std::string device_name, RawAllocate raw_allocate, RawRelease raw_release)
    : device_name_(std::move(device_name)), raw_allocate_(std::move(raw_allocate)), raw_release_(std::move(raw_release)) {}

BlockCache::~BlockCache() { empty_cache(); }

size_t BlockCache::rounded(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = size_t{2} << 20, kSmallLimit = size_t{1} << 20;
  if (bytes == 0) return 0;
  const size_t granule = bytes <= kSmallLimit ? kSmall : kLarge;
  return (bytes + granule - 1) / granule * granule;
}

void* BlockCache::allocate(size_t bytes) {
  const size_t size = rounded(bytes);
  if (size == 0) return nullptr;
  if (auto it = free_.find(size); it != free_.end()) {
    void* ptr = it->second;
    free_.erase(it);
    cached_ -= size;
    live_ += size;
    return ptr;
  }
  void* ptr = raw_allocate_(size);
  if (ptr == nullptr && cached_ > 0) {  // give the cache back and try once more
    empty_cache();
    ptr = raw_allocate_(size);
  }
  LOOM_CHECK(ptr != nullptr, device_name_, " out of memory: allocating ", format_bytes(size), " with ",
             format_bytes(live_), " in use by tensors (loom memory estimates a run before it starts)");
  ++device_allocations_;
  live_ += size;
  return ptr;
}

void BlockCache::release(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  const size_t size = rounded(bytes);
  live_ -= size;
  cached_ += size;
  free_.emplace(size, ptr);
}

void BlockCache::empty_cache() {
  for (const auto& [size, ptr] : free_) raw_release_(ptr);
  free_.clear();
  cached_ = 0;
}

}  // namespace loom
