// Memory accounting: every allocation carries a category; current and peak bytes are kept per
// category and in total. A tracker is owned by whoever owns the allocator (no global state).
#pragma once
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace loom {

enum MemCategory : uint8_t {
  MEM_PARAMETERS,
  MEM_GRADIENTS,
  MEM_OPTIMIZER_STATE,
  MEM_ACTIVATIONS,
  MEM_KV_CACHE,
  MEM_COMMUNICATION,
  MEM_WORKSPACE,
  MEM_OFFLOADED,  // state kept in host memory (ZeRO-Offload; on the CPU backend the same RAM, counted apart)
  MEM_CATEGORY_COUNT
};

std::string_view mem_category_name(MemCategory category);  // "parameters", ...

// The machine's available memory in bytes (/proc/meminfo MemAvailable, capped by a cgroup
// memory limit when one is set); 0 when unknown.
int64_t available_memory_bytes();
// The file pages this process maps that are resident, in bytes (/proc/self/status RssFile: a
// model's memory-mapped weights, which MemAvailable counts as reclaimable cache); 0 when unknown.
int64_t resident_file_bytes();

class MemoryTracker {
 public:
  void on_allocate(MemCategory category, size_t bytes);
  void on_release(MemCategory category, size_t bytes);
  void on_move(MemCategory from, MemCategory to, size_t bytes);  // bytes accounted elsewhere: no allocation

  size_t current(MemCategory category) const { return current_[category].load(); }
  size_t peak(MemCategory category) const { return peak_[category].load(); }
  size_t current_total() const { return current_total_.load(); }
  size_t peak_total() const { return peak_total_.load(); }
  // Allocations recorded so far (on_allocate calls): a phase that should allocate nothing (a
  // training step after the first) leaves it unchanged.
  size_t allocations() const { return allocations_.load(); }
  void reset_peaks();  // peaks := current, to measure one phase (e.g. a training step)

  std::string report() const;  // one line per category: current and peak bytes

 private:
  void account(MemCategory category, size_t bytes);  // current and peak grow by bytes
  std::array<std::atomic<size_t>, MEM_CATEGORY_COUNT> current_{};  // [category]
  std::array<std::atomic<size_t>, MEM_CATEGORY_COUNT> peak_{};     // [category]
  std::atomic<size_t> current_total_{0};
  std::atomic<size_t> peak_total_{0};
  std::atomic<size_t> allocations_{0};
};

std::string format_bytes(size_t bytes);  // "12.3 MiB"
// "8GiB", "8G", "512MiB", "1.5GiB", "4096": bytes (K, M, G, T are powers of 1024, with or without
// "iB" or "B"); an Error naming `what` for anything else, or a value below 1 byte.
int64_t parse_bytes(const std::string& text, const std::string& what);

}  // namespace loom
