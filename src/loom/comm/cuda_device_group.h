// The communicator of a data-parallel group on the CUDA backend: device tensors over NCCL, host
// values (losses, norms) over the world's MPI (comm/nccl_communicator.h). Defined with the CUDA
// backend the program is linked with (backend/cuda/cuda_link.cpp), or refusing (backend/cuda_none.cpp).
#pragma once
#include <memory>

#include "loom/comm/communicator.h"

namespace loom {

class Backend;

std::unique_ptr<Communicator> make_cuda_device_group(Communicator& world, Backend& backend);

}  // namespace loom
