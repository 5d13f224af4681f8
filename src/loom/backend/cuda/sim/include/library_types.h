// The CUDA simulator's library_types.h: the data types shared by cuBLAS, cuBLASLt and NCCL's
// callers, with CUDA 13's values (docs/cuda.md "The simulator").
#pragma once

typedef enum cudaDataType_t {
  CUDA_R_32F = 0,
  CUDA_R_64F = 1,
  CUDA_R_16F = 2,
  CUDA_R_8I = 3,
  CUDA_R_32I = 10,
  CUDA_R_16BF = 14,
  CUDA_R_8F_E4M3 = 28,
  CUDA_R_8F_E5M2 = 29,
} cudaDataType;
