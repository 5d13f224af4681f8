#include "loom/core/json_file.h"

#include "loom/core/error.h"
#include "loom/core/file_io.h"

namespace loom {

nlohmann::json read_json_file(const std::string& path) {
  const std::string text = read_text_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(path, ": not valid JSON: ", e.what()));
  }
}

}  // namespace loom
