// The CUDA simulator's device memory (docs/cuda.md "The simulator"): the arena and its shadow,
// allocations, pinned host memory, and the copies and sets of the CUDA Runtime API (runtime.cpp
// has the devices, errors, streams and events).
//
// Device memory is one range of the address space reserved at the first call (MAP_NORESERVE, so
// only what is used takes memory) and kept PROT_NONE: host code that dereferences a device
// pointer faults, as it does on a GPU, and the SIGSEGV handler names the allocation. The range is
// addressable only while a stream's worker runs an operation or the runtime copies on purpose
// (DeviceAccess counts them). Allocations are 256-byte aligned (cudaMalloc's guarantee) and
// followed by at least 256 bytes that belong to none, so an access one past the end lands in
// memory the shadow marks unallocated (memcheck). The shadow has one byte per device byte:
// unallocated, allocated but never written, written (initcheck).
//
// Pinned host memory (cudaMallocHost) is mapped twice: the host's address and the workers' alias.
// While an asynchronous copy into it is not yet synchronized, the host's pages are PROT_NONE; a
// host read there is the "stale-read" check (reported, then the read proceeds and sees whatever is
// there, which is what a GPU would give).
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "loom/backend/cuda/sim/sim_internal.h"
#include "loom/backend/cuda/sim/sim_runtime.h"

namespace loom::sim {

Arena g_arena;
thread_local int t_runtime_access = 0;

std::mutex g_mu;  // allocations, pinned memory, reports, device access count

void write_stderr(const char* text) {
  size_t left = std::strlen(text);
  while (left > 0) {
    const ssize_t n = ::write(2, text, left);
    if (n <= 0) return;
    text += n;
    left -= static_cast<size_t>(n);
  }
}

namespace {

constexpr size_t kAlign = 256;          // cudaMalloc's alignment
constexpr size_t kRedzone = 256;        // bytes after each allocation that belong to none
std::map<uintptr_t, size_t> g_live;     // allocation start -> bytes asked for
std::map<uintptr_t, size_t> g_free;     // free ranges (start -> bytes), coalesced
uintptr_t g_top = 0;                    // first byte never handed out
size_t g_used = 0;
int g_access = 0;                       // live DeviceAccess objects
std::once_flag g_init_once;
struct sigaction g_previous_segv;

struct Pinned {
  size_t bytes;
  char* alias;        // the workers' mapping
  int pending = 0;    // asynchronous copies into it not yet synchronized
  bool protected_ = false;
};
std::map<uintptr_t, Pinned> g_pinned;

size_t physical_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : kDeviceBytes;
}

// The pinned allocation holding [p, p + bytes), or null.
Pinned* pinned_of(const void* p, size_t bytes, uintptr_t* base_out = nullptr) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g_pinned.upper_bound(a);
  if (it == g_pinned.begin()) return nullptr;
  --it;
  if (a + bytes > it->first + it->second.bytes) return nullptr;
  if (base_out) *base_out = it->first;
  return &it->second;
}

// SIGSEGV: a host access to device memory (fatal, as on a GPU), a host read of pinned memory
// with an unsynchronized copy pending (reported, then allowed), or not ours (the previous action).
void on_segv(int sig, siginfo_t* info, void* context) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  if (in_arena(a)) {
    char line[512];
    std::string where = kernel_position();
    std::snprintf(line, sizeof line,
                  "loom-sim: host-access: host code accessed device memory at %p%s%s: device memory is not addressable "
                  "from the host (copy it with cudaMemcpy)\n",
                  info->si_addr, where.empty() ? "" : " in ", where.c_str());
    write_stderr(line);
    signal(SIGSEGV, SIG_DFL);
    return;  // the access faults again, now fatally
  }
  uintptr_t base = 0;
  if (Pinned* pin = pinned_of(info->si_addr, 1, &base); pin != nullptr && pin->protected_) {
    // (The faulting thread is in host code, never inside the runtime holding g_mu.)
    record_report("stale-read", "host read pinned memory at " + std::to_string(a - base) + " bytes into the buffer at " +
                                    std::to_string(base) + " before the asynchronous copy into it was synchronized "
                                    "(cudaStreamSynchronize / cudaEventSynchronize missing): the value read may be stale");
    mprotect(reinterpret_cast<void*>(base), pin->bytes, PROT_READ | PROT_WRITE);
    pin->protected_ = false;
    return;
  }
  if (g_previous_segv.sa_flags & SA_SIGINFO) {
    if (g_previous_segv.sa_sigaction) return g_previous_segv.sa_sigaction(sig, info, context);
  } else if (g_previous_segv.sa_handler != SIG_DFL && g_previous_segv.sa_handler != SIG_IGN) {
    return g_previous_segv.sa_handler(sig);
  }
  signal(SIGSEGV, SIG_DFL);
}

void init() {
  const size_t bytes = std::min(kDeviceBytes, physical_bytes() / 2) / kAlign * kAlign;
  void* base = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  void* shadow = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED || shadow == MAP_FAILED) {
    write_stderr("loom-sim: cannot reserve the simulated device memory\n");
    std::abort();
  }
  g_arena.base = reinterpret_cast<uintptr_t>(base);
  g_arena.size = bytes;
  g_arena.shadow = static_cast<uint8_t*>(shadow);
  g_top = g_arena.base;
  struct sigaction sa {};
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_previous_segv);
}

}  // namespace

void ensure_init() { std::call_once(g_init_once, init); }

DeviceAccess::DeviceAccess() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_access++ == 0) mprotect(reinterpret_cast<void*>(g_arena.base), g_arena.size, PROT_READ | PROT_WRITE);
  ++t_runtime_access;
}
DeviceAccess::~DeviceAccess() {
  std::lock_guard<std::mutex> lock(g_mu);
  --t_runtime_access;
  if (--g_access == 0) mprotect(reinterpret_cast<void*>(g_arena.base), g_arena.size, PROT_NONE);
}

// ---------------------------------------------------------------- memory registry
namespace {
// The live allocation containing a, or g_live.end().
std::map<uintptr_t, size_t>::iterator allocation_of(uintptr_t a) {
  auto it = g_live.upper_bound(a);
  if (it == g_live.begin()) return g_live.end();
  --it;
  return a < it->first + std::max<size_t>(it->second, 1) ? it : g_live.end();
}
}  // namespace

bool is_device_range(const void* p, size_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = allocation_of(a);
  return it != g_live.end() && a + bytes <= it->first + it->second;
}
bool is_device_pointer(const void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  return allocation_of(reinterpret_cast<uintptr_t>(p)) != g_live.end();
}

std::string describe_address(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::ostringstream out;
  out << "address " << p;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!in_arena(a)) {
    out << " is not device memory (a host address?)";
    return out.str();
  }
  auto it = allocation_of(a);
  if (it != g_live.end()) {
    out << " is " << (a - it->first) << " bytes into the allocation at " << reinterpret_cast<void*>(it->first) << " of "
        << it->second << " bytes";
    return out.str();
  }
  // The nearest allocation below and above.
  auto above = g_live.upper_bound(a);
  if (above != g_live.begin()) {
    auto below = std::prev(above);
    out << " is " << (a - (below->first + below->second)) << " bytes past the end of the allocation at "
        << reinterpret_cast<void*>(below->first) << " of " << below->second << " bytes";
  } else if (above != g_live.end()) {
    out << " is " << (above->first - a) << " bytes before the allocation at " << reinterpret_cast<void*>(above->first)
        << " of " << above->second << " bytes";
  } else {
    out << " is in no allocation (freed or never allocated)";
  }
  return out.str();
}

void mark_written(const void* p, size_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (bytes == 0 || !in_arena(a)) return;
  std::memset(shadow_of(a), kWritten, bytes);
}

bool check_initialized(const void* p, size_t bytes, const char* what) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (bytes == 0 || !in_arena(a)) return true;
  const uint8_t* s = shadow_of(a);
  for (size_t i = 0; i < bytes; ++i) {
    if (s[i] != kWritten) {
      record_report("initcheck", std::string(what) + " reads device memory never written: " +
                                     describe_address(reinterpret_cast<const void*>(a + i)));
      set_sticky(cudaErrorIllegalAddress);
      return false;
    }
  }
  return true;
}

// Host synchronization covering `s` up to now: pinned buffers whose copies are done unprotect.
void settle_pinned() {
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto& [base, pin] : g_pinned) {
    if (pin.pending == 0 && pin.protected_) {
      mprotect(reinterpret_cast<void*>(base), pin.bytes, PROT_READ | PROT_WRITE);
      pin.protected_ = false;
    }
  }
}

// ---------------------------------------------------------------- copies and sets
namespace {

enum class Side { kHost, kPinned, kDevice, kInvalid };

// What [p, p + bytes) is: device memory (one allocation), pinned host memory, other host memory,
// or a range that starts in device memory and leaves its allocation (invalid).
Side side_of(const void* p, size_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (in_arena(a)) return is_device_range(p, bytes) ? Side::kDevice : Side::kInvalid;
  std::lock_guard<std::mutex> lock(g_mu);
  return pinned_of(p, bytes) ? Side::kPinned : Side::kHost;
}

char* worker_view(void* p, size_t bytes) {  // pinned memory as the workers address it
  std::lock_guard<std::mutex> lock(g_mu);
  uintptr_t base = 0;
  Pinned* pin = pinned_of(p, bytes, &base);
  return pin ? pin->alias + (reinterpret_cast<uintptr_t>(p) - base) : static_cast<char*>(p);
}

// Host to device: a pageable source is staged now (the caller may reuse it on return); a pinned
// one is read when the copy runs.
void copy_to_device(void* dst, const void* src, size_t bytes, Side source, cudaStream_t stream, const char* what) {
  std::shared_ptr<std::vector<char>> staged;
  const char* from = nullptr;
  if (source == Side::kPinned) {
    from = worker_view(const_cast<void*>(src), bytes);
  } else {
    staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
  }
  enqueue(stream, what, [dst, from, staged, bytes] {
    std::memcpy(dst, staged ? staged->data() : from, bytes);
    mark_written(dst, bytes);
  });
}

// Device to host: into pageable memory the call returns once the copy is done (CUDA's API sync
// behaviour); into pinned memory an asynchronous copy returns at once, and the host's pages stay
// PROT_NONE until a synchronization covers it (the stale-read check).
void copy_to_host(void* dst, const void* src, size_t bytes, Side destination, cudaStream_t stream, bool async,
                  const char* what) {
  const bool pending = destination == Side::kPinned && async;
  char* to = destination == Side::kPinned ? worker_view(dst, bytes) : static_cast<char*>(dst);
  if (pending) {
    std::lock_guard<std::mutex> lock(g_mu);
    uintptr_t base = 0;
    Pinned* pin = pinned_of(dst, bytes, &base);
    ++pin->pending;
    if (!pin->protected_) {
      mprotect(reinterpret_cast<void*>(base), pin->bytes, PROT_NONE);
      pin->protected_ = true;
    }
  }
  enqueue(stream, what, [to, src, bytes, pending, dst] {
    check_initialized(src, bytes, "cudaMemcpy device to host");
    std::memcpy(to, src, bytes);
    if (pending) {
      std::lock_guard<std::mutex> lock(g_mu);
      if (Pinned* pin = pinned_of(dst, bytes)) --pin->pending;
    }
  });
  if (!pending) {
    drain(stream);
    settle_pinned();
  }
}

// Device to device: the bytes and their shadow (a copy of never-written memory stays so).
void copy_on_device(void* dst, const void* src, size_t bytes, cudaStream_t stream, const char* what) {
  enqueue(stream, what, [dst, src, bytes] {
    std::memmove(dst, src, bytes);
    std::memmove(shadow_of(reinterpret_cast<uintptr_t>(dst)), shadow_of(reinterpret_cast<uintptr_t>(src)), bytes);
  });
}

cudaError_t copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream, bool async) {
  ensure_init();
  if (sticky_error() != cudaSuccess) return sticky_or(cudaSuccess);
  if (bytes == 0) return cudaSuccess;
  if (!dst || !src) return result_of(cudaErrorInvalidValue);
  const char* what = async ? "cudaMemcpyAsync" : "cudaMemcpy";
  const Side ds = side_of(dst, bytes), ss = side_of(src, bytes);
  const bool dst_device = ds == Side::kDevice, src_device = ss == Side::kDevice;
  if (ds == Side::kInvalid || ss == Side::kInvalid) {
    record_report("memcheck", std::string(what) + " of " + std::to_string(bytes) + " bytes: the " +
                                  (ds == Side::kInvalid ? "destination " + describe_address(dst)
                                                        : "source " + describe_address(src)) +
                                  " and the range leaves it");
    return result_of(cudaErrorInvalidValue);
  }
  // The kind must match the pointers (cudaMemcpyDefault infers it, as with unified addressing).
  const bool ok = kind == cudaMemcpyDefault || (kind == cudaMemcpyHostToDevice && dst_device && !src_device) ||
                  (kind == cudaMemcpyDeviceToHost && src_device && !dst_device) ||
                  (kind == cudaMemcpyDeviceToDevice && src_device && dst_device) ||
                  (kind == cudaMemcpyHostToHost && !src_device && !dst_device);
  if (!ok) {
    record_report("memcheck", std::string(what) + ": kind " + std::to_string(static_cast<int>(kind)) +
                                  " does not match the pointers (" + (dst_device ? "device" : "host") + " destination, " +
                                  (src_device ? "device" : "host") + " source)");
    return result_of(cudaErrorInvalidValue);
  }
  if (!dst_device && !src_device) {
    std::memmove(dst, src, bytes);
    return cudaSuccess;
  }
  // In a capture: host-to-device copies from pinned memory (read when the graph runs) and copies
  // on the device. CUDA also refuses pageable memory and synchronous copies there; a copy to the
  // host, which CUDA would capture, the simulator's graphs do not hold (Loom's need none).
  if (capturing(stream) && (!async || ss == Side::kHost || !dst_device)) {
    return refuse_in_capture(stream, std::string(what) + (!async ? "" : !dst_device ? " to the host" : " from pageable memory"));
  }
  if (dst_device && !src_device) copy_to_device(dst, src, bytes, ss, stream, what);
  else if (!dst_device) copy_to_host(dst, src, bytes, ds, stream, async, what);
  else copy_on_device(dst, src, bytes, stream, what);
  if (!async) {
    count_host_wait();
    drain(stream);
  }
  return sticky_or(cudaSuccess);
}

cudaError_t set(void* ptr, int value, size_t bytes, cudaStream_t stream, bool async) {
  ensure_init();
  if (sticky_error() != cudaSuccess) return sticky_or(cudaSuccess);
  if (bytes == 0) return cudaSuccess;
  if (side_of(ptr, bytes) != Side::kDevice) {
    record_report("memcheck", std::string(async ? "cudaMemsetAsync" : "cudaMemset") + " of " + std::to_string(bytes) +
                                  " bytes: " + describe_address(ptr) + " and the range is not inside one allocation");
    return result_of(cudaErrorInvalidValue);
  }
  enqueue(stream, async ? "cudaMemsetAsync" : "cudaMemset", [ptr, value, bytes] {
    std::memset(ptr, value, bytes);
    mark_written(ptr, bytes);
  });
  if (!async) {
    count_host_wait();
    drain(stream);
  }
  return sticky_or(cudaSuccess);
}

}  // namespace
}  // namespace loom::sim

using namespace loom::sim;

extern "C" {

cudaError_t cudaDeviceReset(void) {
  (void)cudaDeviceSynchronize();
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& [base, bytes] : g_live) std::memset(shadow_of(base), kUnallocated, bytes);
    g_live.clear();
    g_free.clear();
    g_top = g_arena.base;
    g_used = 0;
  }
  clear_error();
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  if (!ptr) return result_of(cudaErrorInvalidValue);
  ensure_init();
  if (sticky_error() != cudaSuccess) return sticky_or(cudaSuccess);
  const size_t want = std::max<size_t>(bytes, 1);
  const size_t span = (want + kAlign - 1) / kAlign * kAlign + kRedzone;
  std::lock_guard<std::mutex> lock(g_mu);
  uintptr_t at = 0;
  for (auto it = g_free.begin(); it != g_free.end(); ++it) {  // first fit
    if (it->second >= span) {
      at = it->first;
      const size_t rest = it->second - span;
      g_free.erase(it);
      if (rest > 0) g_free.emplace(at + span, rest);
      break;
    }
  }
  if (at == 0) {
    if (g_top + span > g_arena.base + g_arena.size) {
      *ptr = nullptr;
      return result_of(cudaErrorMemoryAllocation);
    }
    at = g_top;
    g_top += span;
  }
  g_live.emplace(at, bytes);
  g_used += span;
  std::memset(shadow_of(at), kUninitialized, bytes);
  *ptr = reinterpret_cast<void*>(at);
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (!ptr) return cudaSuccess;
  ensure_init();
  (void)cudaDeviceSynchronize();  // cudaFree synchronizes the device
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_live.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == g_live.end()) return result_of(cudaErrorInvalidValue);
  const uintptr_t at = it->first;
  const size_t span = (std::max<size_t>(it->second, 1) + kAlign - 1) / kAlign * kAlign + kRedzone;
  std::memset(shadow_of(at), kUnallocated, it->second);
  g_live.erase(it);
  g_used -= span;
  if (span >= (size_t{1} << 20)) madvise(ptr, span / 4096 * 4096, MADV_DONTNEED);  // give large blocks back
  // Coalesce with the neighbours.
  uintptr_t start = at;
  size_t len = span;
  auto next = g_free.lower_bound(at);
  if (next != g_free.end() && next->first == at + span) {
    len += next->second;
    next = g_free.erase(next);
  }
  if (next != g_free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      len += prev->second;
      g_free.erase(prev);
    }
  }
  g_free.emplace(start, len);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  ensure_init();
  std::lock_guard<std::mutex> lock(g_mu);
  if (free_bytes) *free_bytes = g_arena.size - g_used;
  if (total_bytes) *total_bytes = g_arena.size;
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) { return cudaHostAlloc(ptr, bytes, cudaHostAllocDefault); }

cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int) {
  if (!ptr) return result_of(cudaErrorInvalidValue);
  ensure_init();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t len = (std::max<size_t>(bytes, 1) + page - 1) / page * page;
  const int fd = memfd_create("loom-sim-pinned", 0);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(len)) != 0) {
    if (fd >= 0) close(fd);
    return result_of(cudaErrorMemoryAllocation);
  }
  void* host = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  void* alias = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (host == MAP_FAILED || alias == MAP_FAILED) return result_of(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(g_mu);
  g_pinned.emplace(reinterpret_cast<uintptr_t>(host), Pinned{len, static_cast<char*>(alias)});
  *ptr = host;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  if (!ptr) return cudaSuccess;
  (void)cudaDeviceSynchronize();
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_pinned.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == g_pinned.end()) return result_of(cudaErrorInvalidValue);
  munmap(ptr, it->second.bytes);
  munmap(it->second.alias, it->second.bytes);
  g_pinned.erase(it);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return copy(dst, src, bytes, kind, nullptr, false);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  return copy(dst, src, bytes, kind, stream, true);
}
cudaError_t cudaMemset(void* ptr, int value, size_t bytes) { return set(ptr, value, bytes, nullptr, false); }
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  return set(ptr, value, bytes, stream, true);
}

}  // extern "C"
