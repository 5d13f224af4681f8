#include "loom/core/threads.h"

#include <unistd.h>

#include <cstdlib>

#include "loom/core/signals.h"

namespace loom {

void use_passive_omp_waits(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "PASSIVE", 1) != 0) return;
  keep_original_signal_mask_across_exec();  // blocked signals stay pending through the exec
  execv("/proc/self/exe", argv);
  // execv returned: /proc is not mounted or the binary is gone. The runtime keeps its default;
  // the variables are cleared so that child processes see what this one runs under.
  unsetenv("OMP_WAIT_POLICY");
  unsetenv("LOOM_ORIGINAL_SIGMASK");
}

std::string omp_wait_policy() {
  if (const char* policy = std::getenv("OMP_WAIT_POLICY")) return policy;
  if (const char* spins = std::getenv("GOMP_SPINCOUNT")) return std::string("GOMP_SPINCOUNT=") + spins;
  return "default";
}

}  // namespace loom
