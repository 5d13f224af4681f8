// The CUDA entry points of a program linked with the CUDA backend, the nvcc build's or the
// simulator's (the same sources: docs/cuda.md).
#include "loom/backend/backend.h"
#include "loom/backend/cuda/cuda_backend.h"
#include "loom/comm/cuda_device_group.h"
#include "loom/comm/nccl_communicator.h"

namespace loom {

bool cuda_backend_built() { return true; }

std::unique_ptr<Communicator> make_cuda_device_group(Communicator& world, Backend& backend) {
  return make_routing_communicator(world.split(0, world.rank()),
                                   make_nccl_communicator(world, cuda_device(backend), cuda_stream(backend)));
}

}  // namespace loom
