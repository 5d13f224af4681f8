// Reading a JSON file whole (checkpoint manifests and trainer state, Hugging Face config.json,
// tokenizer files): errors are one line naming the file.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace loom {

// The whole file parsed; a loom::Error "<path>: not valid JSON: ..." or "<path>: cannot open for reading".
nlohmann::json read_json_file(const std::string& path);

}  // namespace loom
