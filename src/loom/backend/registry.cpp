// make_backend: the config key `device` ("cpu" | "cuda") to a backend.
#include "loom/backend/backend.h"
#include "loom/core/error.h"
#ifdef LOOM_HAVE_CUDA
#include "loom/backend/cuda/cuda_backend.h"
#endif

namespace loom {

#ifdef LOOM_HAVE_CUDA
bool cuda_backend_built() { return true; }
#else
bool cuda_backend_built() { return false; }
#endif

std::unique_ptr<Backend> make_backend(std::string_view device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") {
#ifdef LOOM_HAVE_CUDA
    return make_cuda_backend();
#else
    throw Error("device = \"cuda\": this build of Loom has no CUDA backend (the CUDA toolkit was not found when "
                "cmake configured it; see docs/cuda.md)");
#endif
  }
  throw Error(str_cat("device = \"", device, "\": expected \"cpu\" or \"cuda\""));
}

std::unique_ptr<Backend> make_backend(DeviceType device) { return make_backend(enum_name(device)); }

}  // namespace loom
