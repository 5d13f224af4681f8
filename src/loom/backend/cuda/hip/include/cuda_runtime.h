// Under hipcc only (the HIP target's include path, CMakeLists.txt "LOOM_HIP"): cuda_launch.h's
// <cuda_runtime.h> is the portability layer, which maps the CUDA names to HIP's
// (docs/accelerators.md). The nvcc build reads the toolkit's header, the simulator sim/include/'s.
#pragma once
#include "loom/backend/cuda/cuda_device.h"
