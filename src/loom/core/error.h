// Errors a user can act on: one line naming the file/key/rank and what was expected.
// Code throws loom::Error; the CLI prints what() on one line and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace loom {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Concatenates any streamable values into one string: str_cat("key ", name, " = ", 3).
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

}  // namespace loom

// LOOM_CHECK(cond, parts...): throws loom::Error with the concatenated parts when cond is false.
#define LOOM_CHECK(cond, ...)                                   \
  do {                                                          \
    if (!(cond)) throw ::loom::Error(::loom::str_cat(__VA_ARGS__)); \
  } while (0)

// LOOM_REFUSED(cond, parts...): a combination the compatibility table (train/layout.cpp, the one
// owner of such refusals) refuses by name before anything is built, asserted again where it would
// go wrong. Reaching it means a component was built without the table (a test, a library caller);
// it throws like LOOM_CHECK, naming the table.
#define LOOM_REFUSED(cond, ...) \
  LOOM_CHECK(cond, __VA_ARGS__, " (refused first by the layout table, train/layout.cpp)")
