// The CUDA backend's bad-id flags (cuda_backend_internal.h): slot 0 for the ops that check on the
// spot (reset_flag before the kernel, a read after), and the deferred checks of the embedding and
// the cross-entropy: each claims a slot (claim_flag), records what to say (defer_check), and all
// are read together with the next host read, in its one wait (enqueue_pending_flags, then
// throw_pending once the caller has waited; check_pending waits itself), so an id check costs no
// wait inside a training step. The first op that saw a bad id throws its one-line error.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_check.h"
#include "loom/core/error.h"

namespace loom::cuda_backend_detail {

void CudaBackend::reset_flag() { LOOM_CUDA_CHECK(cudaMemsetAsync(flags_.device_ptr(), 0xFF, sizeof(unsigned long long), stream_)); }

unsigned long long* CudaBackend::claim_flag() {
  if (pending_.size() + 1 >= static_cast<size_t>(kFlagSlots)) check_pending();  // out of slots: read them now
  unsigned long long* slot = flag() + pending_.size() + 1;
  LOOM_CUDA_CHECK(cudaMemsetAsync(slot, 0xFF, sizeof(unsigned long long), stream_));
  return slot;
}

void CudaBackend::defer_check(const char* op, const char* what, const char* where, const Tensor& ids, int64_t limit) {
  pending_.push_back({op, what, where, ids, limit, static_cast<int>(pending_.size()) + 1});
}

bool CudaBackend::enqueue_pending_flags(unsigned long long* bad) {
  if (pending_.empty()) return false;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(bad, flag() + 1, pending_.size() * sizeof(unsigned long long),  // slots 1 .. size
                                  cudaMemcpyDeviceToHost, stream_));
  return true;
}

void CudaBackend::check_pending() {
  unsigned long long bad[kFlagSlots];
  if (!enqueue_pending_flags(bad)) return;
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  throw_pending(bad);
}

void CudaBackend::throw_pending(const unsigned long long* bad) {
  const std::vector<PendingCheck> checks = std::move(pending_);
  pending_.clear();  // read once: a throw below leaves none pending
  for (const PendingCheck& c : checks) {  // the first op that saw a bad id
    const unsigned long long at = bad[c.slot - 1];
    if (at == ~0ull) continue;
    int32_t id = 0;
    read(c.ids.view(static_cast<int64_t>(at), {1}), &id);
    throw Error(str_cat(c.op, ": ", c.what, " ", id, " at ", c.where, " ", at, " outside vocab [0, ", c.limit, ")"));
  }
}

}  // namespace loom::cuda_backend_detail
