#include "loom/core/pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "loom/core/error.h"

namespace loom {

namespace {
uintptr_t page_size() { return static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE)); }
}  // namespace

void release_elements(const Tensor& t, int64_t begin, int64_t end) {
  LOOM_CHECK(t.device() == DEVICE_CPU && begin >= 0 && begin <= end && end <= t.numel(), "release_elements: range [",
             begin, ", ", end, ") outside host tensor ", t.describe());
  if (begin == end) return;
  const size_t elem = dtype_size(t.dtype());
  char* base = static_cast<char*>(t.raw_data());
  char* lo = base + static_cast<size_t>(begin) * elem;
  char* hi = base + static_cast<size_t>(end) * elem;
  const uintptr_t page = page_size();
  // Whole pages strictly inside [lo, hi); the partial pages at either end are only zeroed.
  const uintptr_t first = (reinterpret_cast<uintptr_t>(lo) + page - 1) / page * page;
  const uintptr_t last = reinterpret_cast<uintptr_t>(hi) / page * page;
  if (first >= last) {
    std::memset(lo, 0, static_cast<size_t>(hi - lo));
    return;
  }
  std::memset(lo, 0, first - reinterpret_cast<uintptr_t>(lo));
  std::memset(reinterpret_cast<char*>(last), 0, reinterpret_cast<uintptr_t>(hi) - last);
  void* whole = reinterpret_cast<void*>(first);
  // The buffer's huge-page advice is withdrawn on the released range (a no-op where THP is off).
  ::madvise(whole, last - first, MADV_NOHUGEPAGE);
  LOOM_CHECK(::madvise(whole, last - first, MADV_DONTNEED) == 0, "release_elements: madvise(MADV_DONTNEED) failed on ",
             last - first, " bytes of ", t.describe());
}

int64_t resident_bytes(const Tensor& t) {
  // Device memory is never paged out: all of it is resident. (loom train on a CUDA device failed
  // here at its first step until the CUDA simulator ran it.)
  if (t.device() != DEVICE_CPU) return static_cast<int64_t>(t.nbytes());
  if (t.nbytes() == 0) return 0;
  const uintptr_t page = page_size();
  const uintptr_t lo = reinterpret_cast<uintptr_t>(t.raw_data()) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(t.raw_data()) + t.nbytes() + page - 1) / page * page;
  std::vector<unsigned char> present((hi - lo) / page);
  LOOM_CHECK(::mincore(reinterpret_cast<void*>(lo), hi - lo, present.data()) == 0, "resident_bytes: mincore failed on ",
             t.describe());
  int64_t pages = 0;
  for (unsigned char p : present) pages += p & 1;
  return pages * static_cast<int64_t>(page);
}

}  // namespace loom
