// printf formatting into a std::string: for the printed lines whose digits are part of their
// contract ("loss 2.3026", "%.1f%%"), where str_cat's shortest round-trip form would not do.
#pragma once
#include <cstdio>
#include <string>

namespace loom {

template <typename... Args>
std::string str_printf(const char* pattern, Args... args) {
  const int n = std::snprintf(nullptr, 0, pattern, args...);
  if (n <= 0) return {};
  std::string s(static_cast<size_t>(n), '\0');
  std::snprintf(s.data(), s.size() + 1, pattern, args...);
  return s;
}

}  // namespace loom
