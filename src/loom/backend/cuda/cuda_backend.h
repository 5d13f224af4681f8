// The CUDA backend (built when the CUDA toolkit is found; see docs/cuda.md). make_backend("cuda")
// returns it; this header gives the parts other layers need beyond the op interface.
#pragma once
#include <cuda_runtime_api.h>

#include <memory>

#include "loom/backend/backend.h"

namespace loom {

// Throws (one line) when no CUDA device is visible.
std::unique_ptr<Backend> make_cuda_backend();
// The stream every op of a CUDA backend runs on (the NCCL communicator orders its collectives
// after it), and the device it runs on. `backend` must be a CUDA backend.
cudaStream_t cuda_stream(Backend& backend);
int cuda_device(Backend& backend);
// Bytes the backend's caching allocator holds from the device (tensors plus cached blocks).
size_t cuda_reserved_bytes(Backend& backend);
// GEMMs the backend has run in staged panels (backend/gemm_panels.h: rows not 16-byte multiples).
int64_t cuda_panel_gemms(Backend& backend);
// GEMMs the backend has run with cuBLASLt's GELU epilogues (Backend::gemm_gelu / gemm_dgelu fused).
int64_t cuda_gelu_epilogue_gemms(Backend& backend);

}  // namespace loom
