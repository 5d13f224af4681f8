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
#pragma once

#include <string>

namespace loom {

// Call first in main(). Returns only if no re-execution was needed or it failed (then the
// process goes on with the runtime's default policy).
void use_passive_omp_waits(char** argv);

// "PASSIVE", "ACTIVE", "GOMP_SPINCOUNT=N" or "default": the policy this process runs under, for
// the benchmarks' records.
std::string omp_wait_policy();

}  // namespace loom
