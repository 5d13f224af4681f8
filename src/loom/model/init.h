// A model's initial parameters over its flat buffer (Transformer::init_weights), and the Philox
// normal fill they and the recompute timing's scratch input (model/recompute_timing.h) draw.
#pragma once
#include <cstdint>

#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"
#include "loom/backend/backend.h"

namespace loom {

// t (f32, any backend) = Philox normals (seed, stream `stream`, mean 0, `std`): in place when host
// code may write it, else drawn into host memory and written through the backend.
void fill_normal(Backend& backend, const Tensor& t, uint64_t seed, uint32_t stream, float std);

// Each parameter of `layout` in params by its init kind: Normal(0, init_std) matrices (Philox
// stream = parameter index), ones for norm weights, zero biases; then DoRA's magnitudes. With
// `from` > 0 only the parameters at or after that offset (the same values; no magnitudes): LoRA's
// adapters, whose base the caller reads from weights.
void init_params(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
                 uint64_t seed, int64_t from = 0);

}  // namespace loom
