#include "loom/core/threads.h"

#include <unistd.h>

#include <cstdlib>

namespace loom {

void use_passive_omp_waits(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "PASSIVE", 1) != 0) return;
  execv("/proc/self/exe", argv);
  // execv returned: /proc is not mounted or the binary is gone. The runtime keeps its default;
  // the variable is cleared so that child processes see what this one runs under.
  unsetenv("OMP_WAIT_POLICY");
}

std::string omp_wait_policy() {
  if (const char* policy = std::getenv("OMP_WAIT_POLICY")) return policy;
  if (const char* spins = std::getenv("GOMP_SPINCOUNT")) return std::string("GOMP_SPINCOUNT=") + spins;
  return "default";
}

}  // namespace loom
