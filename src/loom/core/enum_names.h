// Names of the enums a configuration chooses from: a config string is parsed into its enum
// once, at load (train/config.cpp binds the key to the enum field), and the code inward switches
// on the enum. An enum E states its names by specialising EnumNames<E>:
//
//   template <> struct EnumNames<Compression> {
//     static constexpr std::array<std::string_view, 2> names{"none", "topk"};  // names[i] is E(i)
//   };
#pragma once
#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "loom/core/error.h"

namespace loom {

template <class E>
struct EnumNames;

template <class E>
constexpr std::string_view enum_name(E value) {
  return EnumNames<E>::names[static_cast<size_t>(value)];
}

template <class E>
std::optional<E> enum_from_name(std::string_view name) {
  const auto& names = EnumNames<E>::names;
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return static_cast<E>(i);
  }
  return std::nullopt;
}

// "a | b | c": the accepted names, for help texts and errors.
template <class E>
std::string enum_choices() {
  std::string out;
  for (const std::string_view name : EnumNames<E>::names) out += std::string(out.empty() ? "" : " | ") + std::string(name);
  return out;
}

// The enum named `name`, or an error naming the key and the accepted names.
template <class E>
E parse_enum(std::string_view name, std::string_view key) {
  const std::optional<E> value = enum_from_name<E>(name);
  LOOM_CHECK(value.has_value(), key, " must be one of ", enum_choices<E>(), ", got '", name, "'");
  return *value;
}

}  // namespace loom
