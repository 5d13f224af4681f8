// UTF-8 checks for text that leaves Loom (generated text printed, JSON strings, streamed
// deltas): RFC 3629's definition, strictly (no overlong forms, no surrogates, nothing above
// U+10FFFF).
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace loom {

// Length of the valid UTF-8 character starting at bytes[i], or 0 when the bytes there are not
// one (invalid, or cut off by the end).
size_t utf8_char_length(std::string_view bytes, size_t i);
// `bytes` with each byte that does not start a valid character replaced by U+FFFD.
std::string valid_utf8(std::string_view bytes);
// The longest prefix that does not end inside a character that more bytes could complete: a
// stream of generated tokens may stop in the middle of a character and finish it later.
size_t complete_utf8_prefix(std::string_view bytes);

}  // namespace loom
