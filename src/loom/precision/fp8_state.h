// FP8 delayed scaling's state in checkpoints: the amax histories and the amaxes in use of a
// model's DelayedScaling objects (policy.h), packed into one flat f32 tensor of backend memory
// (MEM_OPTIMIZER_STATE), and put back from a loaded one. The histories live on the host (the
// FP8 scales are host scalars), so both directions go through the backend's read and write.
#pragma once
#include <cstdint>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/precision/policy.h"

namespace loom {

class Fp8ScalingState {
 public:
  // Per DelayedScaling of `scalings` in order (each of `history` steps): its history, then the
  // amax in use. Allocated on the first pack with any; none: the tensor stays as it is
  // (undefined unless packed before).
  const Tensor& pack(Backend& backend, const std::vector<DelayedScaling*>& scalings, int64_t history);
  // The tensor (filled by a checkpoint load) back into `scalings`, the same list pack was
  // given; nothing when it was never packed.
  void unpack(Backend& backend, const std::vector<DelayedScaling*>& scalings, int64_t history) const;

 private:
  Tensor state_;
};

}  // namespace loom
