// The CUDA simulator's math_constants.h: the constants of CUDA's header that Loom uses.
#pragma once
#include <limits>

#define CUDART_INF_F (std::numeric_limits<float>::infinity())
#define CUDART_INF (std::numeric_limits<double>::infinity())
#define CUDART_NAN_F (std::numeric_limits<float>::quiet_NaN())
#define CUDART_NAN (std::numeric_limits<double>::quiet_NaN())
