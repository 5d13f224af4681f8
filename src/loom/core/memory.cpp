#include "loom/core/memory.h"

#include <cstdio>

namespace loom {

namespace {
constexpr std::string_view kCategoryNames[] = {"parameters",    "gradients",     "optimizer_state", "activations",
                                               "kv_cache",      "communication", "workspace",       "offloaded"};
static_assert(sizeof(kCategoryNames) / sizeof(kCategoryNames[0]) == MEM_CATEGORY_COUNT);

void raise_to(std::atomic<size_t>& peak, size_t value) {
  size_t seen = peak.load();
  while (value > seen && !peak.compare_exchange_weak(seen, value)) {
  }
}
}  // namespace

std::string_view mem_category_name(MemCategory category) { return kCategoryNames[category]; }

void MemoryTracker::on_allocate(MemCategory category, size_t bytes) {
  allocations_.fetch_add(1);
  account(category, bytes);
}

void MemoryTracker::on_move(MemCategory from, MemCategory to, size_t bytes) {
  on_release(from, bytes);
  account(to, bytes);
}

void MemoryTracker::account(MemCategory category, size_t bytes) {
  raise_to(peak_[category], current_[category].fetch_add(bytes) + bytes);
  raise_to(peak_total_, current_total_.fetch_add(bytes) + bytes);
}

void MemoryTracker::on_release(MemCategory category, size_t bytes) {
  current_[category].fetch_sub(bytes);
  current_total_.fetch_sub(bytes);
}

void MemoryTracker::reset_peaks() {
  for (int c = 0; c < MEM_CATEGORY_COUNT; ++c) peak_[c].store(current_[c].load());
  peak_total_.store(current_total_.load());
}

std::string format_bytes(size_t bytes) {
  char buffer[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) std::snprintf(buffer, sizeof buffer, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024) std::snprintf(buffer, sizeof buffer, "%.2f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0) std::snprintf(buffer, sizeof buffer, "%.2f KiB", b / 1024.0);
  else std::snprintf(buffer, sizeof buffer, "%zu B", bytes);
  return buffer;
}

std::string MemoryTracker::report() const {
  std::string out;
  for (int c = 0; c < MEM_CATEGORY_COUNT; ++c) {
    const auto category = static_cast<MemCategory>(c);
    out += std::string(mem_category_name(category)) + ": current " + format_bytes(current(category)) + ", peak " +
           format_bytes(peak(category)) + "\n";
  }
  out += "total: current " + format_bytes(current_total()) + ", peak " + format_bytes(peak_total()) + "\n";
  return out;
}

}  // namespace loom
