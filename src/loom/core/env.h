// Integer settings read from the environment (LOOM_SPIN_US, the CUDA GEMM panel knobs, launcher
// ranks): one strict parser, so a malformed or out-of-range value is the same one-line error
// everywhere, never a silent 0 or a wrapped number.
#pragma once
#include <cstdint>

namespace loom {

// The largest rank count a launcher's variables may name (OMPI_COMM_WORLD_SIZE, SLURM_LOCALID, ...).
inline constexpr int64_t kMaxLaunchRanks = int64_t{1} << 24;

// The value of environment variable `name` as a whole number in [lo, hi], or `fallback` where it
// is unset or empty. Anything else (a sign where lo >= 0, a unit, a fraction, a value that does
// not fit) throws loom::Error: "environment variable NAME='TEXT': expected a whole number from LO
// to HI".
int64_t env_integer(const char* name, int64_t fallback, int64_t lo, int64_t hi);

}  // namespace loom
