#include "loom/core/utf8.h"

#include <cstdint>

namespace loom {

namespace {
size_t lead_length(unsigned char c) { return c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0; }
bool continuation(unsigned char c) { return (c >> 6) == 0x2; }
}  // namespace

size_t utf8_char_length(std::string_view bytes, size_t i) {
  const auto c = static_cast<unsigned char>(bytes[i]);
  const size_t len = lead_length(c);
  if (len == 0 || i + len > bytes.size()) return 0;
  for (size_t k = 1; k < len; ++k) {
    if (!continuation(static_cast<unsigned char>(bytes[i + k]))) return 0;
  }
  if (len == 1) return 1;
  uint32_t cp = c & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(bytes[i + k]) & 0x3F);
  const bool ok = cp >= (len == 2 ? 0x80u : len == 3 ? 0x800u : 0x10000u) && cp <= 0x10FFFF && (cp < 0xD800 || cp > 0xDFFF);
  return ok ? len : 0;
}

std::string valid_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const size_t len = utf8_char_length(bytes, i);
    if (len > 0) {
      out.append(bytes.substr(i, len));
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

size_t complete_utf8_prefix(std::string_view bytes) {
  // Look back at most 3 bytes for the lead byte of a character still missing continuation bytes.
  const size_t n = bytes.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(bytes[n - back]);
    if (continuation(c)) continue;
    const size_t len = lead_length(c);
    return len > back ? n - back : n;  // a lead byte whose character is cut off: hold it back
  }
  return n;
}

}  // namespace loom
