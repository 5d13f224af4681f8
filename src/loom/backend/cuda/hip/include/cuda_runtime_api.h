// Under hipcc only (the HIP target's include path, CMakeLists.txt "LOOM_HIP"): the launcher
// headers' and cuda_check.h's <cuda_runtime_api.h> is the portability layer, which maps the CUDA
// runtime names they use (cudaStream_t, cudaError_t, cudaGetErrorString, ...) to HIP's
// (docs/accelerators.md). The nvcc build reads the toolkit's header, the simulator sim/include/'s.
#pragma once
#include "loom/backend/cuda/cuda_device.h"
