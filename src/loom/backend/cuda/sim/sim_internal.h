// Shared between the simulator's runtime (runtime.cpp: devices, streams, events, errors;
// runtime_memory.cpp: memory, copies) and its kernel execution (exec.cpp: fibers, barriers,
// shuffles; exec_checks.cpp: the access checks). Not for callers.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

namespace loom::sim {

// Device memory: one reserved range of the address space (PROT_NONE for the host), and one
// shadow byte per device byte for memcheck and initcheck.
enum Shadow : uint8_t { kUnallocated = 0, kUninitialized = 1, kWritten = 2 };
struct Arena {
  uintptr_t base = 0;
  size_t size = 0;
  uint8_t* shadow = nullptr;
};
extern Arena g_arena;
inline bool in_arena(uintptr_t a) { return a - g_arena.base < g_arena.size; }
inline uint8_t* shadow_of(uintptr_t a) { return g_arena.shadow + (a - g_arena.base); }

// What cudaGetDeviceProperties reports as the device's memory; the arena reserves at most this.
constexpr size_t kDeviceBytes = size_t{80} << 30;  // an H100 SXM's 80 GB
// Guards the allocations, pinned memory, reports and the device access count.
extern std::mutex g_mu;
// Writes all of `text` to stderr with write(2), which the SIGSEGV handler may call.
void write_stderr(const char* text);

void ensure_init();

// Device memory is addressable while at least one DeviceAccess lives (a stream's operation, the
// runtime's own copy); the host's accesses outside are faults (the SIGSEGV handler reports them).
struct DeviceAccess {
  DeviceAccess();
  ~DeviceAccess();
  DeviceAccess(const DeviceAccess&) = delete;
  DeviceAccess& operator=(const DeviceAccess&) = delete;
};
// > 0 while this thread is inside the runtime or a library touching device memory on purpose.
extern thread_local int t_runtime_access;

// A check fired: prints "loom-sim: <check>: <report>" to stderr, keeps it for last_report().
void record_report(const char* check, const std::string& report);
void set_sticky(cudaError_t error);
cudaError_t sticky_error();
void set_last_error(cudaError_t error);
// An API call's result: an error also becomes the thread's last error (cudaGetLastError).
cudaError_t result_of(cudaError_t error);
// The sticky error, once there is one, else `otherwise` (through result_of).
cudaError_t sticky_or(cudaError_t otherwise);
// A host synchronization: pinned buffers whose asynchronous copies are done become readable.
void settle_pinned();

// enqueue() for operations that must run after a sticky error too (event records and waits).
void enqueue_always(cudaStream_t stream, const char* what, std::function<void()> work);
// Stream capture: whether `stream` is capturing a graph, and the refusal of a call a capture
// forbids (a synchronization, a copy to or from pageable memory): reports it ("capture"),
// invalidates the capture and returns cudaErrorStreamCaptureUnsupported (as the thread's error).
bool capturing(cudaStream_t stream);
cudaError_t refuse_in_capture(cudaStream_t stream, const std::string& what);

// The running kernel and thread ("kernel K, block (x,y,z), thread (x,y,z)"), "" outside kernels.
std::string kernel_position();
// Runs one enqueued grid (exec.cpp). Returns false (and has reported) when a check fired.
struct GridLaunch;
void run_grid(GridLaunch& launch);

}  // namespace loom::sim
