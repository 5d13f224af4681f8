// gemm_candidates: measures which CPU GEMM library Loom should use (the choice is in docs/gemm.md).
//
// What it measures: single-precision GEMM throughput (GFLOP/s, best of repeated runs, 2 threads
// by default) of each candidate library on the shapes one GPT-2 124M training step runs with
// B*T = 256 rows (forward, input-gradient and weight-gradient forms of every linear layer) and on
// a square 2048^3, plus a "GPT-2 step" row weighting each shape by how often a step runs it.
// The candidates, each loaded with dlopen(RTLD_NOW | RTLD_LOCAL) so their symbols cannot clash:
//   openblas   libopenblas.so.0 cblas_sgemm, as the system configures it (OPENBLAS_CORETYPE is
//              left alone and reported)
//   blis       libblis.so.4 cblas_sgemm as shipped (BLIS_ARCH_TYPE unset: cpuid picks the kernels)
//   blis-skx   the same library reloaded after setenv("BLIS_ARCH_TYPE", "0"), i.e. forced onto
//              its AVX-512 'skx' kernels
//   dnnl       oneDNN libdnnl.so.2 dnnl_sgemm (row-major)
//   dnnl-bf16  oneDNN dnnl_gemm_bf16bf16f32 (bf16 inputs, fp32 accumulation and output); exported
//              by oneDNN 2.6 though its dnnl.h does not declare it
// The machine's own ceiling is measured in the same run (an AVX-512 FMA loop, and a bf16 dot
// product loop), because absolute numbers on these shared machines drift from run to run.
//
// Why: every matmul of training goes through one GEMM backend; the choice must be measured on
// this hardware with these shapes, not assumed. A fast library that computes wrong results is
// worse than none, so every candidate is checked: a small odd shape in all four transpose forms
// against a naive double-precision loop, and sampled entries of every benchmark result against
// double-precision dot products (bf16 against the bf16-rounded inputs).
//
// Exit status: 0 when every loaded candidate computed correctly; 1 when any result was wrong or a
// call failed. A library that cannot be loaded shows "unavailable" in its column and the run goes on.
//
// Usage: gemm_candidates [--threads N] [--seconds S] [--rounds R]
//   defaults: 2 threads, 0.3 s per case, 1 round. Each round loads every candidate in turn and
//   measures all shapes; with R > 1 the best time per case over the rounds is reported, which
//   spreads the noise of a shared machine over all candidates.

#include <dlfcn.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <thread>
#include <vector>

namespace {

// ---------------------------------------------------------------------------------------------
// Small utilities

double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

struct Rng {  // splitmix64: fast, deterministic
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  float uniform() {  // in [-1, 1)
    return static_cast<float>(static_cast<double>(next() >> 11) * 0x1.0p-52 - 1.0);
  }
};

uint16_t to_bf16(float f) {  // round to nearest even (inputs here are finite)
  uint32_t u = std::bit_cast<uint32_t>(f);
  u += 0x7fffU + ((u >> 16) & 1U);
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

double widen(float x) { return x; }
double widen(uint16_t x) { return from_bf16(x); }

// ---------------------------------------------------------------------------------------------
// Problems: row-major C[m x n] = op(A) * op(B), alpha = 1, beta = 0.
// A is stored m x k (or k x m when ta), B is stored k x n (or n x k when tb).

struct Problem {
  std::string name;
  bool ta = false, tb = false;
  int64_t m = 0, n = 0, k = 0;
  int per_step = 0;  // how many times one GPT-2 training step runs it (0: not part of a step)

  int64_t lda() const { return ta ? m : k; }
  int64_t ldb() const { return tb ? k : n; }
  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
  std::string op() const { return std::string(ta ? "T" : "N") + (tb ? "T" : "N"); }
};

// A linear layer y[rows x out] = x[rows x in] * W^T with W stored [out x in] (PyTorch layout)
// gives three GEMMs per step: forward, input gradient dX = dY W, weight gradient dW = dY^T X.
void add_linear(std::vector<Problem>& ps, const std::string& name, int64_t rows, int64_t out,
                int64_t in, int per_step) {
  ps.push_back({name + ".fwd", false, true, rows, out, in, per_step});
  ps.push_back({name + ".dX", false, false, rows, in, out, per_step});
  ps.push_back({name + ".dW", true, false, out, in, rows, per_step});
}

std::vector<Problem> benchmark_problems() {
  constexpr int64_t rows = 256, C = 768, layers = 12, vocab = 50257;
  std::vector<Problem> ps;
  add_linear(ps, "attn.qkv", rows, 3 * C, C, layers);
  add_linear(ps, "attn.proj", rows, C, C, layers);
  add_linear(ps, "mlp.fc", rows, 4 * C, C, layers);
  add_linear(ps, "mlp.proj", rows, C, 4 * C, layers);
  add_linear(ps, "lm_head", rows, vocab, C, 1);
  ps.push_back({"square", false, false, 2048, 2048, 2048, 0});
  return ps;
}

// Inputs for every problem are carved from one pool of random values (A from the front, B after
// it), in fp32 and rounded to bf16, so memory stays at one copy of the largest problem.
struct Pool {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  std::vector<float> c;  // output, sized for the largest C

  explicit Pool(const std::vector<Problem>& ps) {
    size_t ab = 0, cmax = 0;
    for (const Problem& p : ps) {
      ab = std::max(ab, static_cast<size_t>(p.m * p.k + p.k * p.n));
      cmax = std::max(cmax, static_cast<size_t>(p.m * p.n));
    }
    f32.resize(ab);
    bf16.resize(ab);
    c.resize(cmax);
    Rng rng{42};
    for (size_t i = 0; i < ab; ++i) {
      f32[i] = rng.uniform();
      bf16[i] = to_bf16(f32[i]);
    }
  }
};

struct Operands {
  const float* a;
  const float* b;
  const uint16_t* a16;
  const uint16_t* b16;
};

Operands operands_for(const Pool& pool, const Problem& p) {
  const size_t b_offset = static_cast<size_t>(p.m * p.k);
  return {pool.f32.data(), pool.f32.data() + b_offset, pool.bf16.data(),
          pool.bf16.data() + b_offset};
}

// ---------------------------------------------------------------------------------------------
// Reference: one entry of C in double precision.

template <typename T>
double reference_entry(const Problem& p, const T* a, const T* b, int64_t i, int64_t j) {
  double sum = 0.0;
  for (int64_t q = 0; q < p.k; ++q) {
    const T av = p.ta ? a[q * p.lda() + i] : a[i * p.lda() + q];
    const T bv = p.tb ? b[j * p.ldb() + q] : b[q * p.ldb() + j];
    sum += widen(av) * widen(bv);
  }
  return sum;
}

double reference_entry(const Problem& p, const Operands& x, bool bf16, int64_t i, int64_t j) {
  return bf16 ? reference_entry(p, x.a16, x.b16, i, j) : reference_entry(p, x.a, x.b, i, j);
}

// Normwise relative error max|C - R| / max|R| over the given entries (NaN propagates as failure).
double relative_error(const Problem& p, const Operands& x, bool bf16, const float* c,
                      const std::vector<std::pair<int64_t, int64_t>>& entries) {
  double max_diff = 0.0, max_ref = 0.0;
  for (auto [i, j] : entries) {
    const double r = reference_entry(p, x, bf16, i, j);
    const double diff = std::fabs(static_cast<double>(c[i * p.n + j]) - r);
    if (std::isnan(diff)) return std::numeric_limits<double>::quiet_NaN();
    max_diff = std::max(max_diff, diff);
    max_ref = std::max(max_ref, std::fabs(r));
  }
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}

std::vector<std::pair<int64_t, int64_t>> all_entries(const Problem& p) {
  std::vector<std::pair<int64_t, int64_t>> e;
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j) e.emplace_back(i, j);
  return e;
}

std::vector<std::pair<int64_t, int64_t>> sampled_entries(const Problem& p, int count) {
  std::vector<std::pair<int64_t, int64_t>> e = {
      {0, 0}, {0, p.n - 1}, {p.m - 1, 0}, {p.m - 1, p.n - 1}};
  Rng rng{static_cast<uint64_t>(p.m * 31 + p.n * 17 + p.k)};
  for (int s = 0; s < count; ++s)
    e.emplace_back(static_cast<int64_t>(rng.next() % static_cast<uint64_t>(p.m)),
                   static_cast<int64_t>(rng.next() % static_cast<uint64_t>(p.n)));
  return e;
}

// ---------------------------------------------------------------------------------------------
// Loading libraries

class Library {
 public:
  explicit Library(const char* soname) : soname_(soname) {
    handle_ = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (!handle_) error_ = dlerror();
  }
  ~Library() {
    if (handle_) dlclose(handle_);
  }
  Library(const Library&) = delete;
  Library& operator=(const Library&) = delete;

  bool ok() const { return handle_ != nullptr; }
  const std::string& error() const { return error_; }

  template <typename Fn>
  Fn symbol(const char* name) const {  // nullptr when absent
    return handle_ ? reinterpret_cast<Fn>(dlsym(handle_, name)) : nullptr;
  }

  // True while any copy of the library is mapped in this process.
  static bool is_loaded(const char* soname) {
    void* h = dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
    if (h) dlclose(h);
    return h != nullptr;
  }

 private:
  std::string soname_;
  void* handle_ = nullptr;
  std::string error_;
};

// One candidate: a GEMM entry point with everything it needs kept alive.
struct Candidate {
  std::string name;
  std::string info;         // version, kernels picked, settings
  std::string unavailable;  // why it could not be loaded; empty when usable
  bool bf16 = false;
  std::shared_ptr<Library> lib;
  std::function<int(const Problem&, const Operands&, float*)> gemm;  // 0 on success
};

Candidate unavailable_candidate(const std::string& name, const std::string& why) {
  Candidate c;
  c.name = name;
  c.unavailable = why;
  return c;
}

// CBLAS enums (the values are fixed by the CBLAS standard; headers are not included so that the
// OpenBLAS and BLIS declarations cannot clash).
constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112;
using CblasSgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                            int, float, float*, int);

std::function<int(const Problem&, const Operands&, float*)> cblas_gemm(CblasSgemm f) {
  return [f](const Problem& p, const Operands& x, float* c) {
    f(kCblasRowMajor, p.ta ? kCblasTrans : kCblasNoTrans, p.tb ? kCblasTrans : kCblasNoTrans,
      static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), 1.0f, x.a,
      static_cast<int>(p.lda()), x.b, static_cast<int>(p.ldb()), 0.0f, c, static_cast<int>(p.n));
    return 0;
  };
}

Candidate load_openblas(int threads) {
  auto lib = std::make_shared<Library>("libopenblas.so.0");
  if (!lib->ok()) return unavailable_candidate("openblas", lib->error());
  auto sgemm = lib->symbol<CblasSgemm>("cblas_sgemm");
  if (!sgemm) return unavailable_candidate("openblas", "no cblas_sgemm in libopenblas.so.0");
  if (auto set_threads = lib->symbol<void (*)(int)>("openblas_set_num_threads")) set_threads(threads);

  Candidate c;
  c.name = "openblas";
  if (auto config = lib->symbol<const char* (*)()>("openblas_get_config")) c.info = config();
  if (auto core = lib->symbol<const char* (*)()>("openblas_get_corename"))
    c.info += std::string(", core ") + core();
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  c.info += std::string(", OPENBLAS_CORETYPE=") + (coretype ? coretype : "(unset)");
  c.lib = lib;
  c.gemm = cblas_gemm(sgemm);
  return c;
}

// arch_type: nullptr loads BLIS as shipped (BLIS_ARCH_TYPE unset, cpuid decides); otherwise
// BLIS_ARCH_TYPE is set to it before dlopen. BLIS reads the variable once per load, so an
// earlier copy must have been unloaded first.
Candidate load_blis(const std::string& name, const char* arch_type, int threads) {
  constexpr const char* soname = "libblis.so.4";
  if (Library::is_loaded(soname))
    return unavailable_candidate(name, "an earlier copy of BLIS is still loaded");
  if (arch_type)
    setenv("BLIS_ARCH_TYPE", arch_type, 1);
  else
    unsetenv("BLIS_ARCH_TYPE");
  auto lib = std::make_shared<Library>(soname);
  if (!lib->ok()) return unavailable_candidate(name, lib->error());
  auto sgemm = lib->symbol<CblasSgemm>("cblas_sgemm");
  if (!sgemm) return unavailable_candidate(name, "no cblas_sgemm in libblis.so.4");
  if (auto init = lib->symbol<void (*)()>("bli_init")) init();  // before querying the arch
  if (auto set_threads = lib->symbol<void (*)(int64_t)>("bli_thread_set_num_threads"))
    set_threads(threads);

  Candidate c;
  c.name = name;
  if (auto version = lib->symbol<const char* (*)()>("bli_info_get_version_str"))
    c.info = std::string("BLIS ") + version();
  auto arch_id = lib->symbol<int64_t (*)()>("bli_arch_query_id");
  auto arch_string = lib->symbol<const char* (*)(int64_t)>("bli_arch_string");
  if (arch_id && arch_string) c.info += std::string(", kernels '") + arch_string(arch_id()) + "'";
  c.info += std::string(", BLIS_ARCH_TYPE=") + (arch_type ? arch_type : "(unset)");
  if (arch_type) c.info += " via setenv before dlopen";
  unsetenv("BLIS_ARCH_TYPE");
  c.lib = lib;
  c.gemm = cblas_gemm(sgemm);
  return c;
}

struct DnnlVersion {
  int major, minor, patch;
  const char* hash;
  unsigned cpu_runtime, gpu_runtime;
};

std::string dnnl_isa_name(int isa) {
  switch (isa) {
    case 0x7: return "avx2";
    case 0x27: return "avx512_core";
    case 0x67: return "avx512_core_vnni";
    case 0xe7: return "avx512_core_bf16";
    case 0x3e7: return "avx512_core_amx";
    default: {
      char hex[16];
      std::snprintf(hex, sizeof hex, "0x%x", static_cast<unsigned>(isa));
      return hex;
    }
  }
}

std::string dnnl_info(const Library& lib, const char* entry_point) {
  std::string info = "oneDNN";
  if (auto version = lib.symbol<const DnnlVersion* (*)()>("dnnl_version")) {
    const DnnlVersion* v = version();
    char text[48];
    std::snprintf(text, sizeof text, " %d.%d.%d", v->major, v->minor, v->patch);
    info += text;
  }
  info += " ";
  info += entry_point;
  if (auto isa = lib.symbol<int (*)()>("dnnl_get_effective_cpu_isa")) {
    info += ", isa ";
    info += dnnl_isa_name(isa());
  }
  return info + ", threads from OpenMP";
}

using DnnlSgemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t);
using DnnlGemmBf16 = int (*)(char, char, int64_t, int64_t, int64_t, float, const uint16_t*,
                             int64_t, const uint16_t*, int64_t, float, float*, int64_t);

Candidate load_dnnl(bool bf16) {
  const std::string name = bf16 ? "dnnl-bf16" : "dnnl";
  const char* entry_point = bf16 ? "dnnl_gemm_bf16bf16f32" : "dnnl_sgemm";
  auto lib = std::make_shared<Library>("libdnnl.so.2");
  if (!lib->ok()) return unavailable_candidate(name, lib->error());

  Candidate c;
  c.name = name;
  c.bf16 = bf16;
  c.lib = lib;
  c.info = dnnl_info(*lib, entry_point);
  if (bf16) {
    auto f = lib->symbol<DnnlGemmBf16>(entry_point);
    if (!f) return unavailable_candidate(name, std::string("no ") + entry_point + " in libdnnl.so.2");
    c.gemm = [f](const Problem& p, const Operands& x, float* out) {
      return f(p.ta ? 'T' : 'N', p.tb ? 'T' : 'N', p.m, p.n, p.k, 1.0f, x.a16, p.lda(), x.b16,
               p.ldb(), 0.0f, out, p.n);
    };
  } else {
    auto f = lib->symbol<DnnlSgemm>(entry_point);
    if (!f) return unavailable_candidate(name, std::string("no ") + entry_point + " in libdnnl.so.2");
    c.gemm = [f](const Problem& p, const Operands& x, float* out) {
      return f(p.ta ? 'T' : 'N', p.tb ? 'T' : 'N', p.m, p.n, p.k, 1.0f, x.a, p.lda(), x.b,
               p.ldb(), 0.0f, out, p.n);
    };
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// The machine's ceiling: independent AVX-512 FMA (fp32) and VDPBF16PS (bf16) chains on every
// thread, no memory traffic. 16 accumulators cover latency x throughput of two FMA pipes.

constexpr int kChains = 16;
constexpr int64_t kPeakIterations = 20'000'000;

// (_mm512_reduce_add_ps would trip g++ 12's -Wuninitialized inside its own header.)
__attribute__((target("avx512f"))) float sum_chains(const __m512 (&acc)[kChains]) {
  float lanes[16];
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  _mm512_storeu_ps(lanes, sum);
  float total = 0.0f;
  for (float v : lanes) total += v;
  return total;
}

__attribute__((target("avx512f"))) float fma_chains() {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < kPeakIterations; ++it) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], x, y);
  }
  return sum_chains(acc);
}

__attribute__((target("avx512f,avx512bf16"))) float bf16_dot_chains() {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  for (int64_t it = 0; it < kPeakIterations; ++it) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], x, x);
  }
  return sum_chains(acc);
}

// Best of a few runs of `chains` on `threads` threads; flops_per_op counts one lane-op per
// vector instruction (FMA: 2 flops x 16 lanes; VDPBF16PS: 4 flops x 16 lanes).
double peak_gflops(float (*chains)(), double flops_per_op, int threads) {
  double best = 0.0;
  volatile float sink = 0.0f;
  for (int run = 0; run < 3; ++run) {
    const double t0 = now_seconds();
#pragma omp parallel num_threads(threads)
    {
      const float r = chains();
#pragma omp critical
      sink = sink + r;
    }
    const double dt = now_seconds() - t0;
    const double flops = flops_per_op * 16.0 * kChains * static_cast<double>(kPeakIterations) * threads;
    best = std::max(best, flops / dt * 1e-9);
  }
  return best;
}

// ---------------------------------------------------------------------------------------------
// Measuring

// Warm-up call, then repeat until `budget` seconds (at least 3 timed calls); the best call wins.
double best_seconds(const std::function<void()>& call, double budget) {
  call();
  double best = std::numeric_limits<double>::infinity(), total = 0.0;
  for (int reps = 0; total < budget || reps < 3; ++reps) {
    const double t0 = now_seconds();
    call();
    const double dt = now_seconds() - t0;
    best = std::min(best, dt);
    total += dt;
  }
  return best;
}

// NaN-propagating max: a NaN error must never be hidden by a later finite one.
double worse(double a, double b) {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b);
}

constexpr double kTolerance = 1e-4;  // fp32 accumulation over K <= 50257 stays far below this
constexpr int kSamples = 256;

// The small odd shape in all four transpose forms against a full naive reference.
double small_shape_error(const Candidate& cand, bool& failed) {
  double worst = 0.0;
  for (int form = 0; form < 4; ++form) {
    const Problem p{"small", (form & 1) != 0, (form & 2) != 0, 37, 53, 71, 0};
    const Pool pool({p});
    const Operands x = operands_for(pool, p);
    std::vector<float> c(static_cast<size_t>(p.m * p.n), std::nanf(""));
    if (cand.gemm(p, x, c.data()) != 0) failed = true;
    worst = worse(worst, relative_error(p, x, cand.bf16, c.data(), all_entries(p)));
  }
  return worst;
}

struct Result {
  double seconds = std::numeric_limits<double>::infinity();  // best call
  double error = 0.0;                                        // relative error of sampled entries
  bool failed = false;                                       // a call returned an error
};

Result measure(const Candidate& cand, const Problem& p, Pool& pool, double budget) {
  Result r;
  const Operands x = operands_for(pool, p);
  float* c = pool.c.data();
  std::fill(c, c + p.m * p.n, std::nanf(""));
  int status = 0;
  r.seconds = best_seconds([&] { status |= cand.gemm(p, x, c); }, budget);
  r.failed = status != 0;
  r.error = relative_error(p, x, cand.bf16, c, sampled_entries(p, kSamples));
  return r;
}

// One column of the table: a candidate, loaded afresh each round, and its results so far
// (best time and worst error over the rounds).
struct Column {
  explicit Column(std::function<Candidate()> loader) : load(std::move(loader)) {}

  std::function<Candidate()> load;
  std::string name, info, unavailable;
  bool bf16 = false;
  std::vector<Result> results;  // one per problem; empty when never measured
  double small_error = 0.0;
  bool failed = false;

  bool measured() const { return !results.empty(); }
  double gflops(const Problem& p, size_t i) const { return p.flops() / results[i].seconds * 1e-9; }
  double worst_error() const {
    double worst = small_error;
    for (const Result& r : results) worst = worse(worst, r.error);
    return worst;
  }
  bool correct() const {
    const double e = worst_error();
    return !failed && !std::isnan(e) && e <= kTolerance;
  }
};

void run_round(Column& col, const std::vector<Problem>& ps, Pool& pool, double budget, int round) {
  Candidate cand = col.load();
  col.name = cand.name;
  col.info = cand.info;
  col.unavailable = cand.unavailable;
  col.bf16 = cand.bf16;
  if (!cand.unavailable.empty()) return;
  std::fprintf(stderr, "round %d: measuring %s ...\n", round, cand.name.c_str());
  col.small_error = worse(col.small_error, small_shape_error(cand, col.failed));
  col.results.resize(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    const Result r = measure(cand, ps[i], pool, budget);
    Result& best = col.results[i];
    best.seconds = std::min(best.seconds, r.seconds);
    best.error = worse(best.error, r.error);
    best.failed |= r.failed;
    col.failed |= r.failed;
  }
  cand = Candidate{};  // unloads it: BLIS must be gone before it is reloaded with other settings
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let its worker threads go idle
}

// Throughput of all GEMMs of one GPT-2 step: total flops over total time, each shape weighted.
double step_gflops(const std::vector<Problem>& ps, const std::vector<Result>& rs) {
  double flops = 0.0, seconds = 0.0;
  for (size_t i = 0; i < ps.size(); ++i) {
    flops += ps[i].per_step * ps[i].flops();
    seconds += ps[i].per_step * rs[i].seconds;
  }
  return seconds > 0.0 ? flops / seconds * 1e-9 : 0.0;
}

// ---------------------------------------------------------------------------------------------
// Report

struct Ceiling {  // the machine's ceiling, measured before and after the candidates
  double fp32 = 0.0, bf16 = 0.0;
};

Ceiling measure_ceiling(int threads) {
  Ceiling c;
  if (__builtin_cpu_supports("avx512f")) c.fp32 = peak_gflops(fma_chains, 2.0, threads);
  if (__builtin_cpu_supports("avx512bf16")) c.bf16 = peak_gflops(bf16_dot_chains, 4.0, threads);
  return c;
}

std::string load_average() {
  char text[64] = "?";
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (!std::fgets(text, sizeof text, f)) text[0] = '\0';
    std::fclose(f);
  }
  std::string s = text;
  return s.substr(0, s.find(' '));  // 1-minute load average
}

struct Options {
  int threads = 2;
  double seconds = 0.3;
  int rounds = 1;
};

void print_header(const std::vector<Column>& cols, const Options& opt, const Ceiling& before,
                  const Ceiling& after, const std::string& load_before) {
  std::printf("GEMM candidates: row-major C = op(A) op(B), %d threads, best call of >= %.2f s per case, "
              "%d round(s)\n", opt.threads, opt.seconds, opt.rounds);
  auto value = [](double v) { return v > 0.0 ? std::to_string(static_cast<int>(v)) : std::string("n/a"); };
  std::printf("machine ceiling (GFLOP/s, before/after): fp32 AVX-512 FMA loop %s/%s, "
              "bf16 VDPBF16PS loop %s/%s; load average before/after %s/%s\n",
              value(before.fp32).c_str(), value(after.fp32).c_str(), value(before.bf16).c_str(),
              value(after.bf16).c_str(), load_before.c_str(), load_average().c_str());
  for (const Column& c : cols)
    std::printf("  %-10s %s\n", c.name.c_str(),
                c.unavailable.empty() ? c.info.c_str() : ("unavailable: " + c.unavailable).c_str());
  std::printf("\n");
}

// One summary row: label, then one cell per column (or `missing` when not measured).
void print_row(const char* label, const std::vector<Column>& cols,
               const std::function<void(const Column&)>& cell) {
  std::printf("%-38s", label);
  for (const Column& c : cols) {
    if (c.measured())
      cell(c);
    else
      std::printf(" %10s", "-");
  }
  std::printf("\n");
}

void print_table(const std::vector<Column>& cols, const std::vector<Problem>& ps, const Ceiling& ceiling) {
  std::printf("%-14s %-2s %6s %6s %6s", "shape", "op", "M", "N", "K");
  for (const Column& c : cols) std::printf(" %10s", c.name.c_str());
  std::printf("   (GFLOP/s)\n");
  for (size_t i = 0; i < ps.size(); ++i) {
    const Problem& p = ps[i];
    std::printf("%-14s %-2s %6lld %6lld %6lld", p.name.c_str(), p.op().c_str(),
                static_cast<long long>(p.m), static_cast<long long>(p.n), static_cast<long long>(p.k));
    for (const Column& c : cols) {
      if (c.measured())
        std::printf(" %10.1f", c.gflops(p, i));
      else
        std::printf(" %10s", "unavail");
    }
    std::printf("\n");
  }
  print_row("GPT-2 step (weighted)", cols,
            [&](const Column& c) { std::printf(" %10.1f", step_gflops(ps, c.results)); });
  print_row("  % of ceiling (fp32 or bf16 loop)", cols, [&](const Column& c) {
    const double peak = c.bf16 ? ceiling.bf16 : ceiling.fp32;
    if (peak > 0.0)
      std::printf(" %9.0f%%", 100.0 * step_gflops(ps, c.results) / peak);
    else
      std::printf(" %10s", "-");
  });
  print_row("max rel err (vs double reference)", cols,
            [](const Column& c) { std::printf(" %10.1e", c.worst_error()); });
  print_row("check", cols,
            [](const Column& c) { std::printf(" %10s", c.correct() ? "ok" : "WRONG"); });
}

bool parse_options(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--threads" && i + 1 < argc)
      o.threads = std::atoi(argv[++i]);
    else if (arg == "--seconds" && i + 1 < argc)
      o.seconds = std::atof(argv[++i]);
    else if (arg == "--rounds" && i + 1 < argc)
      o.rounds = std::atoi(argv[++i]);
    else
      return false;
  }
  return o.threads > 0 && o.seconds > 0.0 && o.rounds > 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  if (!parse_options(argc, argv, opt)) {
    std::fprintf(stderr, "usage: %s [--threads N] [--seconds S] [--rounds R]\n", argv[0]);
    return 2;
  }
  omp_set_num_threads(opt.threads);  // oneDNN and BLIS share this process's OpenMP runtime
  if (static_cast<int>(std::thread::hardware_concurrency()) < opt.threads)
    std::fprintf(stderr, "warning: %d threads requested, %u hardware threads\n", opt.threads,
                 std::thread::hardware_concurrency());

  const std::string load_before = load_average();
  const Ceiling before = measure_ceiling(opt.threads);
  const std::vector<Problem> problems = benchmark_problems();
  Pool pool(problems);

  // One library at a time, so no two thread pools compete for the cores; each is loaded only
  // for its turn, because the second BLIS needs the first unloaded. Several rounds spread the
  // noise of a shared machine over all candidates (best time per case wins).
  const int t = opt.threads;
  std::vector<Column> cols;
  cols.emplace_back([t] { return load_openblas(t); });
  cols.emplace_back([t] { return load_blis("blis", nullptr, t); });
  cols.emplace_back([t] { return load_blis("blis-skx", "0", t); });
  cols.emplace_back([] { return load_dnnl(false); });
  cols.emplace_back([] { return load_dnnl(true); });
  for (int round = 1; round <= opt.rounds; ++round)
    for (Column& c : cols) run_round(c, problems, pool, opt.seconds, round);

  const Ceiling after = measure_ceiling(opt.threads);
  print_header(cols, opt, before, after, load_before);
  // Noise only ever lowers the ceiling, so the higher of the two measurements is the machine's.
  const Ceiling ceiling{std::max(before.fp32, after.fp32), std::max(before.bf16, after.bf16)};
  print_table(cols, problems, ceiling);

  bool all_correct = true;
  for (const Column& c : cols) {
    if (!c.measured() || c.correct()) continue;
    all_correct = false;
    std::fprintf(stderr, "error: %s computed wrong results (max rel err %.1e, tolerance %.0e%s)\n",
                 c.name.c_str(), c.worst_error(), kTolerance,
                 c.failed ? ", and a call returned an error" : "");
  }
  return all_correct ? 0 : 1;
}
