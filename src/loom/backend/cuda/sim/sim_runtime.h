// The CUDA simulator's internal interface (docs/cuda.md "The simulator"): what its libraries
// (cuBLAS, cuBLASLt, cub, NCCL: sim/*.cpp) and its own tests use beyond the CUDA API itself.
//
// The model: device memory is one arena of this process's address space that host code cannot
// address (PROT_NONE) except while a stream's worker runs an operation (a kernel, a copy, a
// library call) or the runtime itself touches it. Each stream is a worker thread that runs its
// operations in order. Every check that fires writes a report that names the check, the
// operation (kernel name, block, thread) and the memory, makes the device's error sticky (as a
// GPU's illegal address is) and is kept for last_report().
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace loom::sim {

// Runs `work` on `stream`'s worker after everything enqueued before it; `what` names the
// operation in reports ("cublasLtMatmul"). Returns at once (the work is asynchronous). Device
// memory is addressable inside `work`. An exception thrown by `work` becomes a sticky error
// with its message as the report.
void enqueue(cudaStream_t stream, const char* what, std::function<void()> work);
// Waits until `stream` has run everything enqueued so far (cudaStreamSynchronize without
// the sticky-error return).
void drain(cudaStream_t stream);
// How many times host code has waited for the device so far (cudaStreamSynchronize,
// cudaDeviceSynchronize, cudaEventSynchronize, a synchronous cudaMemcpy or cudaMemset), over
// all threads: a test counts the waits inside a training step with it.
uint64_t host_waits();
void count_host_wait();  // (the runtime's own)
// Runs `work` on the calling thread with device memory addressable (the runtime's own access,
// e.g. NCCL's MPI transfers after drain()).
void with_device_access(const std::function<void()>& work);

// Device memory checks for library calls (inside enqueued work or with_device_access):
// whether [p, p + bytes) lies inside one live device allocation.
bool is_device_range(const void* p, size_t bytes);
// Whether p is inside a live device allocation at all (the start of a range).
bool is_device_pointer(const void* p);
// The report fragment "N bytes after the allocation at 0x... of M bytes" for p.
std::string describe_address(const void* p);
// initcheck's shadow: bytes written by a library or copy, and a read that must find them written
// (false, with an initcheck report naming `what`, when a byte was never written).
void mark_written(const void* p, size_t bytes);
bool check_initialized(const void* p, size_t bytes, const char* what);

// Records a failure of a library call running on a stream: the report is printed (one line
// per fact, "loom-sim: " first) and the device's error becomes sticky.
void fail(cudaError_t error, const std::string& report);

// The last report any check wrote ("" when none since the last reset), and its check's name
// ("memcheck", "racecheck", "synccheck", "initcheck", "launch", "host-access", "stale-read",
// "library").
std::string last_report();
std::string last_check();
// Clears the sticky error and the last report (cudaDeviceReset does this and frees memory).
void clear_error();

// The seed of the block order (LOOM_SIM_SEED, default 1): blocks of a grid run in a random
// permutation drawn from it, so a kernel that depends on the order of its blocks differs between
// seeds.
uint64_t block_order_seed();
void set_block_order_seed(uint64_t seed);  // for the launches after the call

}  // namespace loom::sim
