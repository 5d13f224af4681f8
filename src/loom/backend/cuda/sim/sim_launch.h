// The simulator's kernel launch (docs/cuda.md "The simulator"), reached only through
// loom::cuda::launch (backend/cuda/cuda_launch.h): binds the arguments as the kernel's own
// parameter types, names the kernel from its template argument, and hands both to the runtime,
// which checks the launch as a GPU does and enqueues the grid on the stream (sim/exec.cpp).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

namespace loom::sim {

struct LaunchSpec {
  const void* kernel;          // the kernel's address (cudaFuncSetAttribute's key)
  std::string_view name;       // "loom::cuda::{anonymous}::fill_kernel<float>"
  dim3 grid, block;
  size_t shared_bytes;         // dynamic shared memory
  cudaStream_t stream;
};
// Validates the launch (a failure is cudaGetLastError's, as on a GPU) and enqueues the grid:
// run(args) is one thread's execution of the kernel.
void launch_erased(const LaunchSpec& spec, std::shared_ptr<void> args, void (*run)(void* args));

// The kernel's name from GCC's __PRETTY_FUNCTION__ of this function: "... [with auto Kernel = NAME]".
template <auto Kernel>
std::string_view kernel_name() {
  std::string_view s = __PRETTY_FUNCTION__;
  const size_t at = s.find("Kernel = ");
  if (at == std::string_view::npos) return s;
  s.remove_prefix(at + 9);
  return s.substr(0, std::min(s.find(';'), s.rfind(']')));
}

template <typename Fn>
struct KernelParams;
template <typename... Params>
struct KernelParams<void (*)(Params...)> {
  using Tuple = std::tuple<std::decay_t<Params>...>;
};

template <auto Kernel, typename... Args>
void launch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, Args&&... args) {
  using Tuple = typename KernelParams<decltype(Kernel)>::Tuple;
  auto bound = std::make_shared<Tuple>(std::forward<Args>(args)...);
  launch_erased(LaunchSpec{reinterpret_cast<const void*>(Kernel), kernel_name<Kernel>(), grid, block, shared_bytes, stream},
                std::move(bound), [](void* p) { std::apply(Kernel, *static_cast<Tuple*>(p)); });
}

}  // namespace loom::sim
