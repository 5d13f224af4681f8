// make_backend: the config key `device` ("cpu" | "cuda") to a backend. The CUDA backend is the
// one this program was linked with (backend.h: cuda_backend_built).
#include "loom/backend/backend.h"
#include "loom/core/error.h"

namespace loom {

std::unique_ptr<Backend> make_backend(std::string_view device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") return make_cuda_backend();
  throw Error(str_cat("device = \"", device, "\": expected \"cpu\" or \"cuda\""));
}

std::unique_ptr<Backend> make_backend(DeviceType device) { return make_backend(enum_name(device)); }

}  // namespace loom
