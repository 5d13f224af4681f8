// The CUDA simulator's runtime (docs/cuda.md "The simulator"): devices, streams, events and
// errors of the CUDA Runtime API, on the CPU (device memory, its copies and pinned host memory
// are runtime_memory.cpp's).
//
// Streams: a worker thread each, running its operations in order; the host returns at once.
// The legacy default stream (0) waits for the blocking streams and they for it, as CUDA's does.
// Errors: a launch or argument error is the calling thread's (cudaGetLastError clears it); a
// fault inside an operation is sticky, as a GPU's illegal address is: every later call returns
// it until cudaDeviceReset.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "loom/backend/cuda/sim/sim_internal.h"
#include "loom/backend/cuda/sim/sim_runtime.h"
#include "loom/core/env.h"

struct CUstream_st;
struct CUevent_st;

namespace loom::sim {

namespace {

constexpr int kDeviceCount = 8;  // an HGX H100 node; each process has its own memory
std::string g_last_report, g_last_check;
std::atomic<int> g_sticky{cudaSuccess};
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local int t_device = 0;

}  // namespace

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
  static std::atomic<uint64_t> seed{static_cast<uint64_t>(
      env_integer("LOOM_SIM_SEED", 1, 0, std::numeric_limits<int64_t>::max()))};
  return seed;
}
}  // namespace
uint64_t block_order_seed() { return seed_slot().load(); }
void set_block_order_seed(uint64_t seed) { seed_slot().store(seed); }

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
  // Stream capture (cudaStreamBeginCapture .. cudaStreamEndCapture): the operations enqueued
  // meanwhile are recorded here instead of run; `invalid` once a call the capture forbids came.
  struct Capture {
    std::vector<loom::sim::Task> tasks;
    bool invalid = false;
  };
  std::unique_ptr<Capture> capture;  // guarded by mu
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
// A captured graph and its executable form: the capture's operations in their order (a stream
// capture of one stream is a chain), each run again by every launch.
struct CUgraph_st {
  std::vector<loom::sim::Task> tasks;
};
struct CUgraphExec_st {
  std::vector<loom::sim::Task> tasks;
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
  {
    std::lock_guard<std::mutex> lock(target->mu);
    if (target->capture) {  // recorded, run by each launch of the graph
      if (!target->capture->invalid) target->capture->tasks.push_back(std::move(task));
      return;
    }
  }
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

}  // namespace

cudaError_t result_of(cudaError_t error) {
  if (error != cudaSuccess) t_last_error = error;
  return error;
}

cudaError_t sticky_or(cudaError_t otherwise) {
  const cudaError_t s = sticky_error();
  return result_of(s != cudaSuccess ? s : otherwise);
}

void enqueue(cudaStream_t stream, const char* what, std::function<void()> work) {
  enqueue_ordered(stream, Task{std::move(work), what});
}
void enqueue_always(cudaStream_t stream, const char* what, std::function<void()> work) {
  enqueue_ordered(stream, Task{std::move(work), what, true});
}

bool capturing(cudaStream_t stream) {
  CUstream_st* s = stream_of(stream);
  std::lock_guard<std::mutex> lock(s->mu);
  return s->capture != nullptr;
}

cudaError_t refuse_in_capture(cudaStream_t stream, const std::string& what) {
  CUstream_st* s = stream_of(stream);
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->capture) s->capture->invalid = true;
  }
  record_report("capture", what + " while the stream is capturing a graph: CUDA refuses it "
                                  "(cudaErrorStreamCaptureUnsupported) and the capture is invalidated");
  return result_of(cudaErrorStreamCaptureUnsupported);
}

bool any_capturing() {
  std::vector<CUstream_st*> all;
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    all = g_streams;
  }
  return std::any_of(all.begin(), all.end(), [](CUstream_st* s) { return capturing(s); });
}

std::atomic<uint64_t> g_host_waits{0};

void drain(cudaStream_t stream) {
  CUstream_st* s = stream_of(stream);
  s->wait_for(s->position());
}

void count_host_wait() { g_host_waits.fetch_add(1, std::memory_order_relaxed); }
uint64_t host_waits() { return g_host_waits.load(std::memory_order_relaxed); }

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
  if (any_capturing()) return refuse_in_capture(nullptr, "cudaDeviceSynchronize");
  count_host_wait();
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
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorGraphExecUpdateFailure: return "cudaErrorGraphExecUpdateFailure";
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
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorGraphExecUpdateFailure: return "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update";
    default: return "unknown error";
  }
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
  if (capturing(stream)) return refuse_in_capture(stream, "cudaStreamSynchronize");
  count_host_wait();
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
  // (CUDA records an event node; the simulator's graphs hold none, and Loom's captures need none.)
  if (capturing(stream)) return refuse_in_capture(stream, "cudaEventRecord");
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
  count_host_wait();
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
  if (capturing(stream)) return refuse_in_capture(stream, "cudaStreamWaitEvent");
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

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  ensure_init();
  if (stream == nullptr || mode > cudaStreamCaptureModeRelaxed) return result_of(cudaErrorInvalidValue);  // not the legacy stream
  std::lock_guard<std::mutex> lock(stream->mu);
  if (stream->capture) return result_of(cudaErrorInvalidValue);
  stream->capture = std::make_unique<CUstream_st::Capture>();
  return sticky_or(cudaSuccess);
}
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (stream == nullptr || graph == nullptr) return result_of(cudaErrorInvalidValue);
  std::unique_ptr<CUstream_st::Capture> capture;
  {
    std::lock_guard<std::mutex> lock(stream->mu);
    capture = std::move(stream->capture);
  }
  *graph = nullptr;
  if (!capture) return result_of(cudaErrorInvalidValue);  // not capturing
  if (capture->invalid) return result_of(cudaErrorStreamCaptureInvalidated);
  *graph = new CUgraph_st{std::move(capture->tasks)};
  return sticky_or(cudaSuccess);
}
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* status) {
  if (status == nullptr) return result_of(cudaErrorInvalidValue);
  CUstream_st* s = stream_of(stream);
  std::lock_guard<std::mutex> lock(s->mu);
  *status = !s->capture ? cudaStreamCaptureStatusNone
                        : (s->capture->invalid ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive);
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (exec == nullptr || graph == nullptr) return result_of(cudaErrorInvalidValue);
  *exec = new CUgraphExec_st{graph->tasks};
  return sticky_or(cudaSuccess);
}
// The update keeps the executable's topology and takes the new graph's parameters: the same
// number of operations of the same kinds in the same order (a kernel, a copy, a library call).
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph, cudaGraphExecUpdateResultInfo* info) {
  if (exec == nullptr || graph == nullptr || info == nullptr) return result_of(cudaErrorInvalidValue);
  *info = cudaGraphExecUpdateResultInfo{cudaGraphExecUpdateSuccess, nullptr, nullptr};
  if (exec->tasks.size() != graph->tasks.size()) {
    info->result = cudaGraphExecUpdateErrorTopologyChanged;
    return result_of(cudaErrorGraphExecUpdateFailure);
  }
  for (size_t i = 0; i < exec->tasks.size(); ++i) {
    if (std::strcmp(exec->tasks[i].what, graph->tasks[i].what) != 0) {
      info->result = cudaGraphExecUpdateErrorNodeTypeChanged;
      return result_of(cudaErrorGraphExecUpdateFailure);
    }
  }
  exec->tasks = graph->tasks;
  return sticky_or(cudaSuccess);
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (exec == nullptr) return result_of(cudaErrorInvalidResourceHandle);
  ensure_init();
  for (const Task& task : exec->tasks) enqueue_ordered(stream, task);
  return sticky_or(cudaSuccess);
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;  // a launch already enqueued keeps its own copies of the operations
  return cudaSuccess;
}

}  // extern "C"
