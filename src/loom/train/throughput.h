// What the progress line and the benchmarks report against: the machine's measured GEMM peak
// and the model FLOPs utilisation (MFU) it implies.
#pragma once
#include "loom/backend/backend.h"

namespace loom {

// Best GFLOP/s of a 2048^3 f32 GEMM through the backend (the library the engine uses), over
// a few repetitions after a warm-up. Takes about a second on a 2-core CPU.
double measure_gemm_peak_gflops(Backend& backend);

}  // namespace loom
