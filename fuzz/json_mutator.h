// A structure-aware mutation for the fuzz targets whose input holds JSON (a safetensors header, a
// tokenizer.json): libFuzzer's byte mutations rarely keep JSON valid, so half of the mutations
// (LLVMFuzzerCustomMutator in each target) parse the JSON and change one node instead: replace it
// by a value of another type or an edge value, remove it, add a key the reader knows, or copy
// another node over it. Input that is not JSON gets libFuzzer's own mutation.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace loom_fuzz {

// The keys and strings the reader looks for (the dictionary's words, as JSON values).
struct JsonWords {
  std::vector<std::string> keys;
  std::vector<std::string> strings;
};

namespace detail {

struct Place {
  nlohmann::json* node;
  nlohmann::json* parent;  // nullptr for the root
  std::string key;         // in an object parent
  size_t index = 0;        // in an array parent
};

inline void collect(nlohmann::json& node, nlohmann::json* parent, std::string key, size_t index, std::vector<Place>& out) {
  out.push_back({&node, parent, key, index});
  if (node.is_object()) {
    for (auto it = node.begin(); it != node.end(); ++it) collect(it.value(), &node, it.key(), 0, out);
  } else if (node.is_array()) {
    for (size_t i = 0; i < node.size(); ++i) collect(node[i], &node, {}, i, out);
  }
}

inline nlohmann::json edge_value(std::mt19937_64& rng, const JsonWords& words) {
  switch (rng() % 12) {
    case 0: return nullptr;
    case 1: return rng() % 2 == 0;
    case 2: return static_cast<int64_t>(rng() % 600) - 300;
    case 3: return uint64_t{1} << (rng() % 64);
    case 4: return (uint64_t{1} << (rng() % 64)) - 1;
    case 5: return -static_cast<int64_t>(uint64_t{1} << (rng() % 63));
    case 6: return 0.5;
    case 7: return 1e300;
    case 8: return nlohmann::json::array();
    case 9: return nlohmann::json::object();
    default: return words.strings.empty() ? nlohmann::json("") : nlohmann::json(words.strings[rng() % words.strings.size()]);
  }
}

}  // namespace detail

// One structural change of `text` (JSON), or nullopt when it is not JSON or the change cannot be
// serialized.
inline std::optional<std::string> mutate_json(const std::string& text, uint64_t seed, const JsonWords& words) {
  nlohmann::json root = nlohmann::json::parse(text, nullptr, false);
  if (root.is_discarded()) return std::nullopt;
  std::mt19937_64 rng(seed);
  std::vector<detail::Place> places;
  detail::collect(root, nullptr, {}, 0, places);
  // Mutate deeper nodes more often than the root: pick among all places.
  const detail::Place p = places[rng() % places.size()];
  switch (rng() % 5) {
    case 0:  // another type or an edge value
      *p.node = detail::edge_value(rng, words);
      break;
    case 1:  // removed
      if (p.parent == nullptr) return std::nullopt;
      if (p.parent->is_object()) p.parent->erase(p.key);
      else p.parent->erase(p.index);
      break;
    case 2: {  // a key the reader knows, with an edge value or a copy of another node
      if (!p.node->is_object() || words.keys.empty()) return std::nullopt;
      nlohmann::json value = rng() % 2 == 0 ? detail::edge_value(rng, words) : *places[rng() % places.size()].node;
      (*p.node)[words.keys[rng() % words.keys.size()]] = std::move(value);
      break;
    }
    case 3:  // an array element repeated, or a number moved by one
      if (p.node->is_array() && !p.node->empty()) {
        const nlohmann::json element = (*p.node)[rng() % p.node->size()];
        p.node->push_back(element);
      } else if (p.node->is_number_integer()) {  // wrapping, in unsigned arithmetic
        const bool is_unsigned = p.node->is_number_unsigned();
        const uint64_t v = (is_unsigned ? p.node->get<uint64_t>() : static_cast<uint64_t>(p.node->get<int64_t>())) +
                           (rng() % 2 == 0 ? 1 : ~uint64_t{0});
        *p.node = is_unsigned ? nlohmann::json(v) : nlohmann::json(static_cast<int64_t>(v));
      } else {
        return std::nullopt;
      }
      break;
    default: {  // a copy of another node
      const nlohmann::json copy = *places[rng() % places.size()].node;
      *p.node = copy;
      break;
    }
  }
  try {
    return root.dump();
  } catch (const nlohmann::json::exception&) {  // a string that is not UTF-8
    return std::nullopt;
  }
}

}  // namespace loom_fuzz
