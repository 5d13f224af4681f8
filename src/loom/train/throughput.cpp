#include "loom/train/throughput.h"

#include <algorithm>
#include <chrono>

namespace loom {

double measure_gemm_peak_gflops(Backend& backend) {
  const int64_t n = 2048;
  Allocator& alloc = backend.allocator();
  Tensor a = Tensor::empty(alloc, {n, n}, DTYPE_F32, MEM_WORKSPACE);
  Tensor b = Tensor::empty(alloc, {n, n}, DTYPE_F32, MEM_WORKSPACE);
  Tensor c = Tensor::empty(alloc, {n, n}, DTYPE_F32, MEM_WORKSPACE);
  backend.fill(a, 0.5);
  backend.fill(b, 0.25);
  backend.synchronize();
  double best = 0.0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    backend.gemm(a, b, c, GemmSpec{});
    backend.synchronize();  // a device queues the GEMM: time its completion
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rep > 0) best = std::max(best, 2.0 * n * n * n / seconds / 1e9);
  }
  return best;
}

}  // namespace loom
