// The CUDA simulator's runtime (docs/cuda.md "The simulator"): devices, device memory, streams,
// events, copies and errors of the CUDA Runtime API, on the CPU.
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
// Streams: a worker thread each, running its operations in order; the host returns at once.
// The legacy default stream (0) waits for the blocking streams and they for it, as CUDA's does.
// Errors: a launch or argument error is the calling thread's (cudaGetLastError clears it); a
// fault inside an operation is sticky, as a GPU's illegal address is: every later call returns
// it until cudaDeviceReset.
//
// Pinned host memory (cudaMallocHost) is mapped twice: the host's address and the workers' alias.
// While an asynchronous copy into it is not yet synchronized, the host's pages are PROT_NONE; a
// host read there is the "stale-read" check (reported, then the read proceeds and sees whatever is
// there, which is what a GPU would give).
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "loom/backend/cuda/sim/sim_internal.h"
#include "loom/backend/cuda/sim/sim_runtime.h"

struct CUstream_st;
struct CUevent_st;

namespace loom::sim {

Arena g_arena;
thread_local int t_runtime_access = 0;

namespace {

constexpr size_t kAlign = 256;          // cudaMalloc's alignment
constexpr size_t kRedzone = 256;        // bytes after each allocation that belong to none
constexpr size_t kDeviceBytes = size_t{80} << 30;  // an H100 SXM's 80 GB
constexpr int kDeviceCount = 8;         // an HGX H100 node; each process has its own memory

std::mutex g_mu;  // allocations, pinned memory, reports, device access count
std::map<uintptr_t, size_t> g_live;     // allocation start -> bytes asked for
std::map<uintptr_t, size_t> g_free;     // free ranges (start -> bytes), coalesced
uintptr_t g_top = 0;                    // first byte never handed out
size_t g_used = 0;
int g_access = 0;                       // live DeviceAccess objects
std::string g_last_report, g_last_check;
std::atomic<int> g_sticky{cudaSuccess};
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local int t_device = 0;
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

void write_stderr(const char* text) {
  size_t left = std::strlen(text);
  while (left > 0) {
    const ssize_t n = ::write(2, text, left);
    if (n <= 0) return;
    text += n;
    left -= static_cast<size_t>(n);
  }
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

void record_report(const char* check, const std::string& report) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_last_check = check;
    g_last_report = report;
  }
  write_stderr(("loom-sim: " + std::string(check) + ": " + report + "\n").c_str());
}
void set_sticky(cudaError_t error) {
  int expected = cudaSuccess;
  g_sticky.compare_exchange_strong(expected, error);
}
cudaError_t sticky_error() { return static_cast<cudaError_t>(g_sticky.load()); }
void set_last_error(cudaError_t error) { t_last_error = error; }

std::string last_report() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_last_report;
}
std::string last_check() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_last_check;
}
void clear_error() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_last_report.clear();
  g_last_check.clear();
  g_sticky.store(cudaSuccess);
  t_last_error = cudaSuccess;
}

void fail(cudaError_t error, const std::string& report) {
  record_report("library", report);
  set_sticky(error);
}

namespace {
std::atomic<uint64_t>& seed_slot() {
  static std::atomic<uint64_t> seed{[] {
    const char* s = std::getenv("LOOM_SIM_SEED");
    return s ? std::strtoull(s, nullptr, 10) : uint64_t{1};
  }()};
  return seed;
}
}  // namespace
uint64_t block_order_seed() { return seed_slot().load(); }
void set_block_order_seed(uint64_t seed) { seed_slot().store(seed); }

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

// ---------------------------------------------------------------- streams
namespace {

struct Task {
  std::function<void()> work;
  const char* what;
  bool always = false;  // runs after a sticky error too (event records and waits: waiters must wake)
};

}  // namespace
}  // namespace loom::sim

struct CUstream_st {
  explicit CUstream_st(unsigned f) : flags(f) { worker = std::thread([this] { run(); }); }
  void push(loom::sim::Task task) {
    std::lock_guard<std::mutex> lock(mu);
    queue.push_back(std::move(task));
    ++enqueued;
    cv.notify_all();
  }
  // Waits until the operations enqueued before the call have run.
  void wait_for(uint64_t count) {
    std::unique_lock<std::mutex> lock(mu);
    done_cv.wait(lock, [&] { return done >= count; });
  }
  uint64_t position() {
    std::lock_guard<std::mutex> lock(mu);
    return enqueued;
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
      cv.notify_all();
    }
    worker.join();
  }
  void run() {
    std::unique_ptr<loom::sim::DeviceAccess> access;  // held while the queue is not empty
    for (;;) {
      loom::sim::Task task;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;
        task = std::move(queue.front());
        queue.pop_front();
      }
      if (!access) access = std::make_unique<loom::sim::DeviceAccess>();
      if (task.always || loom::sim::sticky_error() == cudaSuccess) {
        try {
          task.work();
        } catch (const std::exception& e) {
          loom::sim::record_report("library", std::string(task.what) + ": " + e.what());
          loom::sim::set_sticky(cudaErrorLaunchFailure);
        }
      }
      std::lock_guard<std::mutex> lock(mu);
      if (queue.empty()) access.reset();  // before the host can see the work done
      ++done;
      done_cv.notify_all();
    }
  }

  unsigned flags;
  std::mutex mu;
  std::condition_variable cv, done_cv;
  std::deque<loom::sim::Task> queue;
  uint64_t enqueued = 0, done = 0;
  bool stopping = false;
  std::thread worker;
};

// An event's state lives as long as the operations that record or wait on it: CUDA lets a
// program destroy an event whose record or wait is still queued (the NCCL communicator does).
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0, completed = 0;   // generations
  std::chrono::steady_clock::time_point at;
  bool timing = true;
};
struct CUevent_st {
  std::shared_ptr<EventState> state = std::make_shared<EventState>();
};

namespace loom::sim {
namespace {

std::mutex g_streams_mu;
std::vector<CUstream_st*> g_streams;  // the blocking ones (for the legacy stream's ordering)

CUstream_st* legacy_stream() {
  static CUstream_st* s = new CUstream_st(cudaStreamDefault);  // lives until exit
  return s;
}

CUstream_st* stream_of(cudaStream_t s) { return s == nullptr ? legacy_stream() : s; }

// Enqueues on s with CUDA's legacy-stream ordering: work on the legacy stream waits for every
// blocking stream's earlier work, and work on a blocking stream waits for the legacy stream's.
void enqueue_ordered(cudaStream_t s, Task task) {
  ensure_init();
  CUstream_st* target = stream_of(s);
  std::vector<std::pair<CUstream_st*, uint64_t>> waits;
  if (target == legacy_stream()) {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    for (CUstream_st* other : g_streams) waits.emplace_back(other, other->position());
  } else if (!(target->flags & cudaStreamNonBlocking)) {
    waits.emplace_back(legacy_stream(), legacy_stream()->position());
  }
  if (!waits.empty()) {
    auto work = std::move(task.work);
    task.work = [waits, work = std::move(work)] {
      for (auto& [stream, count] : waits) stream->wait_for(count);
      work();
    };
  }
  target->push(std::move(task));
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

cudaError_t result_of(cudaError_t error) {
  if (error != cudaSuccess) t_last_error = error;
  return error;
}

cudaError_t sticky_or(cudaError_t otherwise) {
  const cudaError_t s = sticky_error();
  return result_of(s != cudaSuccess ? s : otherwise);
}

}  // namespace

void enqueue(cudaStream_t stream, const char* what, std::function<void()> work) {
  enqueue_ordered(stream, Task{std::move(work), what});
}
void enqueue_always(cudaStream_t stream, const char* what, std::function<void()> work) {
  enqueue_ordered(stream, Task{std::move(work), what, true});
}

void drain(cudaStream_t stream) {
  CUstream_st* s = stream_of(stream);
  s->wait_for(s->position());
}

void with_device_access(const std::function<void()>& work) {
  ensure_init();
  DeviceAccess access;
  work();
}

}  // namespace loom::sim

// ---------------------------------------------------------------- the CUDA Runtime API
using namespace loom::sim;

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return result_of(cudaErrorInvalidValue);
  *count = kDeviceCount;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= kDeviceCount) return result_of(cudaErrorInvalidDevice);
  ensure_init();
  t_device = device;
  return sticky_or(cudaSuccess);
}
cudaError_t cudaGetDevice(int* device) {
  if (!device) return result_of(cudaErrorInvalidValue);
  *device = t_device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (!prop) return result_of(cudaErrorInvalidValue);
  if (device < 0 || device >= kDeviceCount) return result_of(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "NVIDIA H100 80GB HBM3 (Loom simulator)");
  prop->totalGlobalMem = kDeviceBytes;
  prop->sharedMemPerBlock = 48 * 1024;
  prop->sharedMemPerBlockOptin = 227 * 1024;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 2147483647;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->clockRate = 1980000;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->memoryBusWidth = 5120;
  prop->l2CacheSize = 50 * 1024 * 1024;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  ensure_init();
  std::vector<CUstream_st*> all;
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    all = g_streams;
  }
  all.push_back(legacy_stream());
  for (CUstream_st* s : all) s->wait_for(s->position());
  settle_pinned();
  return sticky_or(cudaSuccess);
}

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

cudaError_t cudaGetLastError(void) {
  const cudaError_t s = sticky_error();
  if (s != cudaSuccess) return s;
  const cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) {
  const cudaError_t s = sticky_error();
  return s != cudaSuccess ? s : t_last_error;
}

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorIllegalInstruction: return "cudaErrorIllegalInstruction";
    case cudaErrorMisalignedAddress: return "cudaErrorMisalignedAddress";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    default: return "cudaErrorUnknown";
  }
}

// CUDA's own texts.
const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorIllegalInstruction: return "an illegal instruction was encountered";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    default: return "unknown error";
  }
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

}  // extern "C"

namespace loom::sim {
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
  if (dst_device && !src_device) copy_to_device(dst, src, bytes, ss, stream, what);
  else if (!dst_device) copy_to_host(dst, src, bytes, ds, stream, async, what);
  else copy_on_device(dst, src, bytes, stream, what);
  if (!async) drain(stream);
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
  if (!async) drain(stream);
  return sticky_or(cudaSuccess);
}

}  // namespace
}  // namespace loom::sim

extern "C" {

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

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (!stream || flags > cudaStreamNonBlocking) return result_of(cudaErrorInvalidValue);
  ensure_init();
  auto* s = new CUstream_st(flags);
  if (!(flags & cudaStreamNonBlocking)) {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    g_streams.push_back(s);
  }
  *stream = s;
  return sticky_or(cudaSuccess);
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (!stream) return result_of(cudaErrorInvalidResourceHandle);
  drain(stream);
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    g_streams.erase(std::remove(g_streams.begin(), g_streams.end(), stream), g_streams.end());
  }
  stream->stop();
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  ensure_init();
  drain(stream);
  settle_pinned();
  return sticky_or(cudaSuccess);
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  ensure_init();
  CUstream_st* s = stream_of(stream);
  std::lock_guard<std::mutex> lock(s->mu);
  return s->done >= s->enqueued ? sticky_or(cudaSuccess) : cudaErrorNotReady;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (!event || flags > (cudaEventBlockingSync | cudaEventDisableTiming)) return result_of(cudaErrorInvalidValue);
  *event = new CUevent_st;
  (*event)->state->timing = !(flags & cudaEventDisableTiming);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (!event) return result_of(cudaErrorInvalidResourceHandle);
  delete event;  // queued records and waits keep its state
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!event) return result_of(cudaErrorInvalidResourceHandle);
  std::shared_ptr<EventState> e = event->state;
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    generation = ++e->recorded;
  }
  // Runs even after a sticky error, so waiters are released.
  enqueue_always(stream, "cudaEventRecord", [e, generation] {
    std::lock_guard<std::mutex> lock(e->mu);
    e->completed = std::max(e->completed, generation);
    e->at = std::chrono::steady_clock::now();
    e->cv.notify_all();
  });
  return sticky_or(cudaSuccess);
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!event) return result_of(cudaErrorInvalidResourceHandle);
  EventState& e = *event->state;
  std::unique_lock<std::mutex> lock(e.mu);
  const uint64_t target = e.recorded;
  e.cv.wait(lock, [&] { return e.completed >= target; });
  lock.unlock();
  settle_pinned();
  return sticky_or(cudaSuccess);
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (!event) return result_of(cudaErrorInvalidResourceHandle);
  EventState& e = *event->state;
  std::lock_guard<std::mutex> lock(e.mu);
  return e.completed >= e.recorded ? sticky_or(cudaSuccess) : cudaErrorNotReady;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!ms || !start || !end) return result_of(cudaErrorInvalidValue);
  if (!start->state->timing || !end->state->timing) return result_of(cudaErrorInvalidResourceHandle);
  *ms = std::chrono::duration<float, std::milli>(end->state->at - start->state->at).count();
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  if (!event) return result_of(cudaErrorInvalidResourceHandle);
  std::shared_ptr<EventState> e = event->state;
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    target = e->recorded;  // an event never recorded is complete
  }
  enqueue_always(stream, "cudaStreamWaitEvent", [e, target] {
    std::unique_lock<std::mutex> lock(e->mu);
    e->cv.wait(lock, [&] { return e->completed >= target; });
  });
  return sticky_or(cudaSuccess);
}

}  // extern "C"
