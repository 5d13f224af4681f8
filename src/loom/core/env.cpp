#include "loom/core/env.h"

#include <cerrno>
#include <cstdlib>

#include "loom/core/error.h"

namespace loom {

int64_t env_integer(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  LOOM_CHECK(errno == 0 && end != text && *end == '\0' && value >= lo && value <= hi, "environment variable ", name,
             "='", text, "': expected a whole number from ", lo, " to ", hi);
  return static_cast<int64_t>(value);
}

}  // namespace loom
