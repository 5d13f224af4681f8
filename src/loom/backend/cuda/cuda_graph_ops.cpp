// Backend::begin_step_graph / end_step_graph: a decoding step's kernels, copies and library calls
// recorded by stream capture (CUDA Runtime API, "Graph Management"; CUDA C++ Programming Guide,
// "CUDA Graphs") and launched as one graph, so the GPU runs the ~500 kernels of an 8B step back
// to back instead of waiting for the host's launches (docs/cuda.md "Decoding a Llama-3-8B-shaped model").
//
// Each step is captured anew (its parameters change: positions, the KV plans' tables, split-KV
// grids) and applied to the executable graph kept for its key by cudaGraphExecUpdate, which keeps
// the executable when the captured operations have the same kinds in the same order and only
// their parameters changed; otherwise (a new step shape, a kernel that launched differently) the
// executable is made anew. The capture is relaxed (cudaStreamCaptureModeRelaxed): the caching
// allocator may grow the workspace mid-step (cudaMalloc; no cudaFree, released blocks go back to
// the cache), and PinnedStaging hands out arena regions instead of waiting on its event. What
// a capture forbids (a wait for the device, a copy from pageable memory or to the host) the
// simulator refuses too, so the decode tests on the simulated backend prove a step capturable.
#include <algorithm>

#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_check.h"

namespace loom::cuda_backend_detail {

bool CudaBackend::begin_step_graph() {
  LOOM_CHECK(!capturing_, "begin_step_graph: a step graph is being recorded already");
  check_pending();  // the id checks read now: a full slot table would read them mid-capture
  kv_staging_.begin_graph();
  kv_store_staging_.begin_graph();
  LOOM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
  capturing_ = true;
  return true;
}

void CudaBackend::end_step_graph(int64_t key) {
  LOOM_CHECK(capturing_, "end_step_graph: no step graph is being recorded");
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
  kv_staging_.end_graph();
  kv_store_staging_.end_graph();
  LOOM_CUDA_CHECK(ended);
  auto it = std::find_if(graphs_.begin(), graphs_.end(), [key](const auto& g) { return g.first == key; });
  if (it == graphs_.end()) it = graphs_.insert(graphs_.end(), {key, nullptr});
  cudaGraphExec_t& exec = it->second;
  if (exec != nullptr) {
    cudaGraphExecUpdateResultInfo info{};
    if (cudaGraphExecUpdate(exec, graph, &info) == cudaSuccess) {
      ++graph_counts_.updated;
    } else {
      (void)cudaGetLastError();  // not an error: the step's shape changed
      (void)cudaGraphExecDestroy(exec);
      exec = nullptr;
    }
  }
  if (exec == nullptr) {
    const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
    if (made != cudaSuccess) (void)cudaGraphDestroy(graph);
    LOOM_CUDA_CHECK(made);
    ++graph_counts_.made;
  }
  (void)cudaGraphDestroy(graph);
  LOOM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
  ++graph_counts_.launched;
  kv_staging_.graph_launched(stream_);
  kv_store_staging_.graph_launched(stream_);
}

void CudaBackend::abort_step_graph() {
  if (!capturing_) return;
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  (void)cudaStreamEndCapture(stream_, &graph);
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  kv_staging_.end_graph();
  kv_store_staging_.end_graph();
}

void CudaBackend::destroy_graphs() {
  for (auto& [key, exec] : graphs_) {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
  }
  graphs_.clear();
}

}  // namespace loom::cuda_backend_detail
