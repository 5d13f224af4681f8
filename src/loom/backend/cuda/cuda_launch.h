// The one place where the CUDA backend launches a kernel (the only `<<<...>>>` of the backend):
//
//   launch<kernel>(grid, block, shared_bytes, stream, args...)
//
// is kernel<<<grid, block, shared_bytes, stream>>>(args...) in the nvcc build. In the simulator
// build (-DLOOM_CUDA=SIM, or the cuda_sim tests; docs/cuda.md "The simulator") the same call runs
// the kernel on the CPU through loom::sim::launch, which checks the launch as a GPU does and names
// the kernel (with its template arguments) in every report. Under hipcc the same triple-chevron
// launch is hip-clang's (HIP Programming Guide, "Kernel launch"; <cuda_runtime.h> is then
// hip/include/'s, which includes cuda_device.h). Either way a failed launch surfaces through
// cudaGetLastError (LOOM_CUDA_CHECK_LAUNCH).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#ifdef LOOM_CUDA_SIM
#include "loom/backend/cuda/sim/sim_launch.h"
#endif

namespace loom::cuda {

template <auto Kernel, typename... Args>
void launch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, Args&&... args) {
#ifdef LOOM_CUDA_SIM
  ::loom::sim::launch<Kernel>(grid, block, shared_bytes, stream, std::forward<Args>(args)...);
#else
  Kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
#endif
}

}  // namespace loom::cuda
