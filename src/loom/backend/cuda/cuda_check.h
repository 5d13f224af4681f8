// LOOM_CUDA_CHECK: turns a failed CUDA runtime call into a
// loom::Error naming the call, the file:line and CUDA's own message.
#pragma once
#include <cuda_runtime_api.h>

#include "loom/core/error.h"

#define LOOM_CUDA_CHECK(expr)                                                                              \
  do {                                                                                                     \
    const cudaError_t loom_cuda_status_ = (expr);                                                          \
    if (loom_cuda_status_ != cudaSuccess) {                                                                \
      throw ::loom::Error(::loom::str_cat("CUDA error in ", #expr, " (", __FILE__, ":", __LINE__, "): ",   \
                                          cudaGetErrorString(loom_cuda_status_)));                         \
    }                                                                                                      \
  } while (0)

// After a kernel launch: a bad configuration (grid, shared memory) shows up here.
#define LOOM_CUDA_CHECK_LAUNCH() LOOM_CUDA_CHECK(cudaGetLastError())
