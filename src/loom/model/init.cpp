#include "loom/model/init.h"

#include <vector>

#include "loom/core/philox.h"
#include "loom/nn/lora.h"

namespace loom {

void fill_normal(Backend& backend, const Tensor& t, uint64_t seed, uint32_t stream, float std) {
  if (t.host_accessible()) {
    philox_fill_normal(t.data<float>(), t.numel(), seed, stream, 0, 0.0f, std);
    return;
  }
  std::vector<float> host(static_cast<size_t>(t.numel()));
  philox_fill_normal(host.data(), t.numel(), seed, stream, 0, 0.0f, std);
  backend.write(t, host.data());
}

void init_params(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
                 uint64_t seed, int64_t from) {
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const ParamSpec& spec = layout.params[i];
    if (spec.offset < from) continue;  // read from weights by the caller
    const Tensor t = params.view(spec.offset, spec.shape);
    switch (spec.init) {
      case INIT_NORMAL: fill_normal(backend, t, seed, static_cast<uint32_t>(i), spec.init_std); break;
      case INIT_ONES: backend.fill(t, 1.0); break;
      case INIT_ZEROS: backend.fill(t, 0.0); break;
      case INIT_COUNT: break;
    }
  }
  if (from == 0) dora_init_magnitudes(backend, config, params);  // DoRA: m = the initialised base rows' norms
}

}  // namespace loom
