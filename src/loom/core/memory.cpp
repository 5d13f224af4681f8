#include "loom/core/memory.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include "loom/core/error.h"

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

int64_t available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0, available = 0;
  std::string unit;
  while (meminfo >> key >> kib) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") available = kib * 1024;
  }
  // A cgroup v2 limit (a container's) below the machine's memory is the real bound.
  std::ifstream max_file("/sys/fs/cgroup/memory.max"), current_file("/sys/fs/cgroup/memory.current");
  std::string max_text;
  int64_t current = 0;
  if (max_file >> max_text && max_text != "max" && current_file >> current) {
    const int64_t limit = std::stoll(max_text);
    if (available == 0 || limit - current < available) available = std::max<int64_t>(0, limit - current);
  }
  return available;
}

int64_t resident_file_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "RssFile:") {
      int64_t kib = 0;
      status >> kib;
      return kib * 1024;
    }
    std::getline(status, key);
  }
  return 0;
}

int64_t parse_bytes(const std::string& text, const std::string& what) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = text.substr(used);
  if (unit.size() >= 2 && unit.substr(unit.size() - 2) == "iB") unit.resize(unit.size() - 2);
  else if (!unit.empty() && unit.back() == 'B') unit.pop_back();
  const std::string units = "KMGT";
  const size_t power = unit.empty() ? 0 : (unit.size() == 1 ? units.find(unit[0]) + 1 : 0);
  const bool ok = used > 0 && (unit.empty() || power > 0) && value >= 1 && value < 1e18;
  if (!ok) throw Error(str_cat(what, ": '", text, "' is not a size in bytes (expected e.g. 8GiB, 512M or 4096)"));
  return static_cast<int64_t>(value * static_cast<double>(int64_t{1} << (10 * power)));
}

}  // namespace loom
