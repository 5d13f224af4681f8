// What the progress line and the benchmarks report against: the machine's GEMM peak in the
// compute dtype of the run, and the model FLOPs utilisation (MFU) it implies.
//
// Two peaks are stated side by side:
//   measured     the best GFLOP/s of a 2048^3 GEMM in the dtype through the backend (the library
//                the engine uses), the figure MFU divides by. Measured once per machine and kept
//                in a cache file (below), so a run does not spend a second on it and every run of
//                a machine states its MFU against the same number.
//   datasheet    threads x clock x FLOPs per cycle and core: the clock measured with a chain of
//                dependent integer adds (one per cycle) before and after the GEMM, or the clock
//                /proc/cpuinfo states where that is higher, the FLOPs per cycle from the instruction
//                set: AVX-512 fp32 FMA 2 units x 16 lanes x 2 = 64, AVX-512 BF16 dot products
//                (VDPBF16PS) 2 x 32 x 2 = 128; AVX2 32 and (bf16 widened to fp32) 32. Two FMA
//                units per core is an assumption (Zen 4 / Zen 5, Xeon Gold / Platinum).
#pragma once
#include <string>

#include "loom/backend/backend.h"
#include "loom/core/dtype.h"
#include "loom/precision/policy.h"

namespace loom {

struct GemmPeak {
  DType dtype = DTYPE_F32;        // f32 or bf16: the dtype of the GEMMs' inputs
  double measured_gflops = 0.0;   // see above
  double datasheet_gflops = 0.0;  // 0 where not known (a GPU backend)
  double clock_ghz = 0.0;         // measured
  int flops_per_cycle = 0;        // per core
  int threads = 0;
  std::string kernels;            // the backend's gemm_kernels(dtype): which kernels were measured
  bool cached = false;            // measured_gflops came from the cache file
  bool busy = false;              // measured now, on a machine that looked busy: not cached (below)
  std::string cache_file;         // where it is kept ("" = not cached)
  // "bf16 GEMM peak: 912 GFLOP/s measured (cached in F), 950 datasheet-style (2 threads x 3.71 GHz x
  // 128 FLOP/cycle); kernels: ..."
  std::string describe() const;
  // Where a run's MFU against a cached peak is above 1, the peak was measured while the machine
  // was slower than it is now (a shared VM's host was busy; the busy check only refuses a GEMM
  // under half the datasheet-style peak): a one-line warning naming the cache file to delete so
  // that the next run measures again. "" otherwise (MFU <= 1, or a peak measured by this run).
  std::string above_peak_warning(double mfu) const;
};

// Best GFLOP/s of a 2048^3 GEMM with inputs of `dtype` (f32, or bf16 into f32) through the
// backend, the best of 9 repetitions after a warm-up. About half a second on a 2-core CPU.
double measure_gemm_peak_gflops(Backend& backend, DType dtype = DTYPE_F32);

// The peak of `dtype` on this machine: the measured one (and the clock the datasheet-style peak
// uses) from cache_dir/gemm_peak.json when it holds this machine's key (backend, CPU model,
// thread count, dtype, the backend's gemm_kernels(dtype)), else measured and added to it (written
// to a temporary name and renamed) unless the machine looked busy (peak_measured_on_a_busy_machine:
// a warning, and the next run measures again; LOOM_PEAK_BUSY_CHECK=0 caches it anyway). An empty cache_dir measures every time; so does a
// GPU backend (its key would need the device's name). A cache that cannot be read or written is
// ignored with a warning on stderr, never an error.
GemmPeak gemm_peak(Backend& backend, DType dtype, const std::string& cache_dir);

// Whether a measurement looks taken beside other work: the GEMM ran below half the datasheet-style
// peak (0 = not known). oneDNN reached 72-93% of it on every CPU measured (docs/performance.md); a
// CPU with one FMA unit per core would look busy on every run (LOOM_PEAK_BUSY_CHECK=0).
// gemm_peak then does not cache it.
bool peak_measured_on_a_busy_machine(double measured_gflops, double datasheet_gflops);

// $LOOM_CACHE_DIR, else $XDG_CACHE_HOME/loom, else $HOME/.cache/loom, else "" (no cache).
std::string default_peak_cache_dir();

// The dtype whose peak a run's MFU is stated against: that of the GEMMs of the MLP's first linear
// layer (the largest of a block): bf16 for the bf16 and fp8 recipes (fp8 codes multiply as bf16,
// exactly), f32 for f32 and fp16 (emulated in fp32 GEMMs on the CPU).
DType mfu_dtype(const PrecisionPolicy& policy);

}  // namespace loom
