#include "loom/train/throughput.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/json_file.h"

namespace loom {

namespace {

// Cycles per second of one core: a chain of dependent integer adds retires one per cycle on
// every x86 core since the Pentium Pro (latency 1), so the chain's length over its time is the
// clock the core runs at now (turbo included), which /proc/cpuinfo does not report in a VM.
double measure_clock_ghz() {
  double best = 0.0;
  for (int rep = 0; rep < 5; ++rep) {
    uint64_t x = static_cast<uint64_t>(rep) + 1;
    const int64_t n = 50'000'000;
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n; ++i) {
#if defined(__x86_64__)
      asm volatile("add $1, %0" : "+r"(x));  // one add per iteration; the loop's own inc/cmp/jmp run beside it
#else
      x += 1;
      asm volatile("" : "+r"(x));
#endif
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (x == 0) return 0.0;  // keeps x live
    best = std::max(best, static_cast<double>(n) / seconds / 1e9);
  }
  return best;
}

int flops_per_cycle(DType dtype) {
#if defined(__x86_64__)
  if (dtype == DTYPE_BF16 && __builtin_cpu_supports("avx512bf16")) return 128;  // 2 units x 32 pairs x 2
  if (__builtin_cpu_supports("avx512f")) return 64;                             // 2 units x 16 lanes x 2
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 32;
#endif
  return 0;
}

// The value of the first CPU's /proc/cpuinfo line that starts with `field` ("model name: AMD
// EPYC" -> "AMD EPYC"), blanks after the colon removed; "" where there is none.
std::string cpuinfo_field(std::string_view field) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (line.rfind(field, 0) == 0 && colon != std::string::npos) {
      const size_t start = line.find_first_not_of(" \t", colon + 1);
      return start == std::string::npos ? "" : line.substr(start);
    }
  }
  return "";
}

std::string cpu_model_name() {
  const std::string name = cpuinfo_field("model name");
  return name.empty() ? "unknown cpu" : name;
}

// The clock the kernel states for the first CPU ("cpu MHz"), in GHz; 0 where not stated. In a VM
// the nominal clock; on bare metal the current one.
double stated_cpu_ghz() { return std::atof(cpuinfo_field("cpu MHz").c_str()) / 1000.0; }

}  // namespace

bool peak_measured_on_a_busy_machine(double measured_gflops, double datasheet_gflops) {
  return datasheet_gflops > 0.0 && measured_gflops < 0.5 * datasheet_gflops;
}

namespace {

// Seconds of the best of `reps` n x n x n GEMMs after a warm-up.
double best_gemm_seconds(Backend& backend, DType dtype, int64_t n, int reps) {
  Allocator& alloc = backend.allocator();
  Tensor a32 = Tensor::empty(alloc, {n, n}, DTYPE_F32, MEM_WORKSPACE);
  Tensor b32 = Tensor::empty(alloc, {n, n}, DTYPE_F32, MEM_WORKSPACE);
  Tensor c = Tensor::empty(alloc, {n, n}, DTYPE_F32, MEM_WORKSPACE);
  backend.fill(a32, 0.5);
  backend.fill(b32, 0.25);
  Tensor a = a32, b = b32;
  if (dtype == DTYPE_BF16) {
    a = Tensor::empty(alloc, {n, n}, DTYPE_BF16, MEM_WORKSPACE);
    b = Tensor::empty(alloc, {n, n}, DTYPE_BF16, MEM_WORKSPACE);
    backend.cast(a32, a);
    backend.cast(b32, b);
  }
  backend.synchronize();
  double best = 0.0;
  for (int rep = 0; rep <= reps; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    backend.gemm(a, b, c, GemmSpec{});
    backend.synchronize();  // a device queues the GEMM: time its completion
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rep > 0) best = best == 0.0 ? seconds : std::min(best, seconds);
  }
  return best;
}

}  // namespace

double measure_gemm_peak_gflops(Backend& backend, DType dtype) {
  LOOM_CHECK(dtype == DTYPE_F32 || dtype == DTYPE_BF16, "measure_gemm_peak_gflops: dtype ", dtype_name(dtype),
             " (expected f32 or bf16)");
  // 2048^3, the best of 9 after a warm-up (it is cached, so it may take 0.5 s), unless a 256^3
  // probe says that would take minutes: the CUDA simulator runs GEMMs at a few GFLOP/s, and its
  // peak (of a simulated device) is measured at 256^3.
  const double probe = best_gemm_seconds(backend, dtype, 256, 1);
  const int64_t n = probe * 512.0 > 2.0 ? 256 : 2048;
  const double seconds = n == 256 ? probe : best_gemm_seconds(backend, dtype, n, 9);
  return 2.0 * static_cast<double>(n * n * n) / seconds / 1e9;
}

std::string default_peak_cache_dir() {
  if (const char* dir = std::getenv("LOOM_CACHE_DIR"); dir != nullptr && *dir != '\0') return dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') return std::string(xdg) + "/loom";
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') return std::string(home) + "/.cache/loom";
  return "";
}

DType mfu_dtype(const PrecisionPolicy& policy) {
  const LinearRecipe r = policy.recipe[LINEAR_MLP_IN];
  return r == RECIPE_BF16 || is_fp8(r) ? DTYPE_BF16 : DTYPE_F32;
}

std::string GemmPeak::describe() const {
  std::string s = str_cat(dtype_name(dtype), " GEMM peak: ", static_cast<int64_t>(measured_gflops + 0.5),
                          " GFLOP/s measured");
  if (cached) s += str_cat(" (cached in ", cache_file, ")");
  if (busy) s += " (on a busy machine, not cached)";
  if (datasheet_gflops > 0.0) {
    char clock[32];
    std::snprintf(clock, sizeof clock, "%.2f", clock_ghz);
    s += str_cat(", ", static_cast<int64_t>(datasheet_gflops + 0.5), " datasheet-style (", threads, " thread",
                 threads == 1 ? "" : "s", " x ", clock, " GHz x ", flops_per_cycle, " FLOP/cycle)");
  }
  if (!kernels.empty()) s += str_cat("; kernels: ", kernels);
  return s;
}

std::string GemmPeak::above_peak_warning(double mfu) const {
  if (!cached || !(mfu > 1.0)) return "";
  return str_cat("MFU ", static_cast<int64_t>(100.0 * mfu + 0.5), "% is above the cached ", dtype_name(dtype),
                 " GEMM peak (", static_cast<int64_t>(measured_gflops + 0.5), " GFLOP/s in ", cache_file,
                 "), which was measured while this machine was slower; delete that file to measure it again");
}

GemmPeak gemm_peak(Backend& backend, DType dtype, const std::string& cache_dir) {
  GemmPeak peak;
  peak.dtype = dtype;
  peak.kernels = backend.gemm_kernels(dtype);
  const bool cpu = backend.name() == "cpu";
  if (cpu) {
    peak.threads = omp_get_max_threads();
    peak.flops_per_cycle = flops_per_cycle(dtype);
  }
  auto set_clock = [&peak](double ghz) {
    peak.clock_ghz = ghz;
    peak.datasheet_gflops = peak.threads * ghz * peak.flops_per_cycle;
  };
  const std::string key = str_cat(backend.name(), " | ", cpu_model_name(), " | ", peak.threads, " threads | ",
                                  dtype_name(dtype), peak.kernels.empty() ? "" : " | ", peak.kernels);
  const std::string file = cache_dir.empty() || !cpu ? "" : cache_dir + "/gemm_peak.json";
  nlohmann::json cache = nlohmann::json::object();
  if (!file.empty() && std::filesystem::exists(file)) {
    try {
      cache = read_json_file(file);
      if (!cache.is_object()) cache = nlohmann::json::object();
      const auto it = cache.find(key);
      if (it != cache.end() && it->is_object() && it->contains("gflops") && (*it)["gflops"].is_number()) {
        const double gflops = (*it)["gflops"].get<double>();
        const double ghz = it->contains("clock_ghz") && (*it)["clock_ghz"].is_number() ? (*it)["clock_ghz"].get<double>() : 0.0;
        if (gflops > 0.0 && gflops < 1e9 && ghz > 0.0 && ghz < 100.0) {
          peak.measured_gflops = gflops;
          set_clock(ghz);
          peak.cached = true;
          peak.cache_file = file;
          return peak;
        }
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "loom: warning: %s; the GEMM peak is measured again\n", e.what());
      cache = nlohmann::json::object();
    }
  }
  // The clock: the highest of the loop before and after the GEMM and the clock the CPU states.
  // On the shared VM the loop read 1.4-1.6 GHz in about half the runs and 3.1-3.2 in the others
  // (stated 2.45) while the GEMM ran at 143-152 GFLOP/s in both: the loop shares its core's
  // integer units with whatever else runs there, so alone it can understate the clock 2x.
  const char* check = std::getenv("LOOM_PEAK_BUSY_CHECK");  // "0": cache it anyway (throughput.h)
  const bool check_off = check != nullptr && std::string(check) == "0";
  const double clock_before = cpu ? measure_clock_ghz() : 0.0;
  peak.measured_gflops = measure_gemm_peak_gflops(backend, dtype);
  if (cpu) set_clock(std::max({clock_before, measure_clock_ghz(), stated_cpu_ghz()}));
  // A peak measured while other work held the cores would be kept for every later run, and their
  // MFU overstated by as much: seen on the shared VM, 59 GFLOP/s, 29% of the datasheet-style 202,
  // against 144-166 idle. Such a measurement serves this run only.
  if (!file.empty() && !check_off && peak_measured_on_a_busy_machine(peak.measured_gflops, peak.datasheet_gflops)) {
    std::fprintf(stderr, "loom: warning: the machine looked busy while the %s GEMM peak was measured (%.0f GFLOP/s, "
                 "%.0f%% of the datasheet-style %.0f): it is used for this run's MFU and not cached in %s "
                 "(LOOM_PEAK_BUSY_CHECK=0 caches it)\n",
                 std::string(dtype_name(dtype)).c_str(), peak.measured_gflops,
                 100.0 * peak.measured_gflops / peak.datasheet_gflops, peak.datasheet_gflops, file.c_str());
    peak.busy = true;
  } else if (!file.empty()) {
    try {
      std::filesystem::create_directories(cache_dir);
      cache[key] = {{"gflops", peak.measured_gflops}, {"gemm", "2048^3, best of 9 after a warm-up"},
                    {"clock_ghz", peak.clock_ghz}};
      write_file_atomic(file, cache.dump(2) + "\n");
      peak.cache_file = file;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "loom: warning: cannot cache the GEMM peak in %s: %s\n", file.c_str(), e.what());
    }
  }
  return peak;
}

}  // namespace loom
