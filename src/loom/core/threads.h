// How Loom's OpenMP threads wait between parallel regions.
//
// libgomp (GCC's OpenMP runtime, which oneDNN shares) reads its wait policy from the environment
// once, when the library is loaded, so a process cannot change it after start. Its default spins
// a waiting thread for up to 300,000 iterations before sleeping. On an idle machine that saves a
// wake-up per region; beside another busy process it takes the cores that process needs and the
// threads that do the work wait for theirs: measured here, GPT-2 124M (B=4, T=64) on 2 threads
// with a spinning loop pinned to one core ran at 0.30x its idle speed spinning and 0.60x with
// passive waits (PyTorch with passive waits: 0.49x). Bounded spins (GOMP_SPINCOUNT 10k, 100k)
// were no better than the default under load. With one parallel region per op call
// (docs/performance.md), passive waits cost ~2% of an idle step.
//
// So Loom's programs start with OMP_WAIT_POLICY=PASSIVE unless the user chose a policy: when
// neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set, use_passive_omp_waits sets
// OMP_WAIT_POLICY=PASSIVE and re-executes the program (/proc/self/exe, same arguments, same pid,
// so mpirun and signals see the same process) before anything else runs. OMP_WAIT_POLICY=ACTIVE
// keeps the spinning, for a machine the run has to itself.
//
// A decoding step is the exception: at batch 1 it is ~130 short regions back to back (the linear
// layers' matrix-vector products, 2 ms each at 8B), and a passive wait costs a wake at the start
// of each and another at its end, where the master sleeps for the last thread. So the decoding
// kernels run their rows on a team of their own (run_short_region), whose threads spin for the
// next region for at most LOOM_SPIN_US microseconds (default kDefaultSpinMicros) after their
// last one and then sleep, and whose caller spins for its team as long; llama.cpp's threads do
// the same within a graph. A step's gaps (a norm, RoPE, one row's attention) are far shorter, so
// the team stays awake through a step and sleeps between requests. LOOM_SPIN_US=0 sleeps at once.
// Beside another busy process spinning is what costs (the 1.5B model beside a loop on one core:
// 6.5 tokens/s spinning, 14.7 sleeping at once), so while more threads are runnable on the machine
// than the process has CPUs (/proc/loadavg, sampled every 10 ms) the team's waits sleep at once.
// (In a container whose /proc/loadavg is the host's, a busy host keeps the team from spinning: it
// then waits as OpenMP's passive threads do.)
// Only under passive OpenMP waits: where OpenMP's threads spin, its regions wake no one and a
// second set of threads would take the cores the spinning ones hold, so the regions are OpenMP's.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

namespace loom {

// Call first in main(). Returns only if no re-execution was needed or it failed (then the
// process goes on with the runtime's default policy).
void use_passive_omp_waits(char** argv);

// "PASSIVE", "ACTIVE", "GOMP_SPINCOUNT=N" or "default": the policy this process runs under, for
// the benchmarks' records.
std::string omp_wait_policy();

constexpr int64_t kDefaultSpinMicros = 1000;

// fn(ctx, begin, end) over [0, count) split into omp_get_max_threads() contiguous parts as
// schedule(static) splits, each part on its own thread of the short-region team, the caller
// running the first. fn must not throw. Runs as an OpenMP region instead where OpenMP's waits are
// not passive or while another thread runs the team, and on the calling thread alone inside a
// parallel region or with one thread.
using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end);
void run_short_region(int64_t count, RangeFn fn, void* ctx);

template <class Body>
void short_region(int64_t count, Body&& body) {
  using B = std::remove_reference_t<Body>;
  run_short_region(count, [](void* ctx, int64_t begin, int64_t end) { (*static_cast<B*>(ctx))(begin, end); },
                   const_cast<void*>(static_cast<const void*>(&body)));
}

// LOOM_SPIN_US (kDefaultSpinMicros when unset); throws naming it when it is not a whole number of
// microseconds from 0 to 10^7. The programs check it before they start work.
int64_t short_region_spin_micros();

// How many times this process started a team's worker thread (for tests).
int64_t short_region_threads_started();

// The runnable threads /proc/loadavg's text states (its fourth field, "runnable/existing"), or -1
// where the text has no such field. The team does not spin while this exceeds the process's CPUs.
int runnable_threads(const char* loadavg);

}  // namespace loom
