// The CPU kernels' scalar math: backend/scalar_math.h's (shared with the CUDA kernels).
#pragma once
#include <cmath>

#include "loom/backend/scalar_math.h"

namespace loom::cpu {

using math::exp_t;
using math::fast_exp;
using math::sigmoid_t;
using math::tanh_t;

}  // namespace loom::cpu
