// The CUDA entry points of a program linked without a CUDA backend (the toolkit was not found
// at configure time, or LOOM_CUDA=OFF): device = "cuda" is a one-line error.
#include "loom/backend/backend.h"
#include "loom/comm/cuda_device_group.h"
#include "loom/core/error.h"

namespace loom {

bool cuda_backend_built() { return false; }

std::unique_ptr<Backend> make_cuda_backend() {
  throw Error("device = \"cuda\": this build of Loom has no CUDA backend (the CUDA toolkit was not found when "
              "cmake configured it; see docs/cuda.md)");
}

std::unique_ptr<Communicator> make_cuda_device_group(Communicator&, Backend&) {
  throw Error("device = \"cuda\": this build of Loom has no CUDA backend, so no NCCL communicator");
}

}  // namespace loom
