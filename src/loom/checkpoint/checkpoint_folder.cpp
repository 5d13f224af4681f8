// A checkpoint folder's parts whatever it holds (a training save, its shards, a quantized
// model): trainer.json written and read, the attached files, the manifest written over every
// file (manifest_json) and checked (checkpoint_problem), the atomic commit of a .tmp folder
// (commit_folder), and the checks of the caller's tensors and of metadata integers that every
// reader and writer shares.
#include "loom/checkpoint/checkpoint_internal.h"

#include <algorithm>
#include <iomanip>
#include <sstream>

#include "loom/core/file_io.h"
#include "loom/core/json_file.h"

namespace loom {

namespace fs = std::filesystem;
using namespace ckpt;

namespace ckpt {

namespace {

constexpr const char* kManifestFormat = "loom-checkpoint";
constexpr int64_t kManifestVersion = 1;

nlohmann::json trainer_json(const CheckpointContents& c) {
  return {{"step", c.step}, {"data_state", c.data_state}, {"config_text", c.config_text}, {"extra", c.extra}};
}

// A relative path inside a checkpoint: "model.safetensors", "tokenizer/vocab.bpe"; no empty,
// "." or ".." component, not absolute.
bool is_inside_name(const std::string& name) {
  if (name.empty() || name.front() == '/') return false;
  size_t begin = 0;
  while (begin <= name.size()) {
    const size_t end = std::min(name.find('/', begin), name.size());
    const std::string part = name.substr(begin, end - begin);
    if (part.empty() || part == "." || part == "..") return false;
    begin = end + 1;
  }
  return true;
}

// Copies each attached file into dir/<name>, synced.
void copy_attached(const fs::path& dir, const std::vector<std::pair<std::string, std::string>>& attached) {
  for (const auto& [name, source] : attached) {
    LOOM_CHECK(is_inside_name(name), "checkpoint: attached file name '", name, "' is not a path inside the checkpoint");
    const std::string bytes = read_text_file(source, kDefaultReadLimit, "the limit of a file attached to a checkpoint");
    fs::create_directories((dir / name).parent_path());
    write_text_synced((dir / name).string(), bytes);
    fsync_directory((dir / name).parent_path().string());
  }
}

// The files a checkpoint must hold besides the manifest: unsharded (shards = 0) or N shards; a
// quantized model folder (kind "quantized") has no optimizer state.
std::vector<std::string> required_files(int64_t shards, const std::string& kind = "") {
  if (kind == kQuantizedKind) return {kModelFile, kTrainerFile};
  if (shards == 0) return {kModelFile, kOptimizerFile, kTrainerFile};
  std::vector<std::string> files{kTrainerFile};
  for (int64_t r = 0; r < shards; ++r) files.push_back(shard_file_name(static_cast<int>(r), static_cast<int>(shards)));
  return files;
}

nlohmann::json manifest_json(const fs::path& dir, int64_t step, int64_t shards,
                             const std::vector<std::pair<std::string, std::string>>& attached, const std::string& kind = "") {
  std::vector<std::string> names = required_files(shards, kind);
  for (const auto& [name, source] : attached) names.push_back(name);
  nlohmann::json files = nlohmann::json::object();
  for (const std::string& name : names) {
    const FileDigest d = digest_file((dir / name).string());
    files[name] = {{"bytes", d.bytes}, {"xxh64", hex64(d.xxh64)}};
  }
  nlohmann::json m = {{"format", kManifestFormat}, {"version", kManifestVersion}, {"step", step}, {"files", files}};
  if (shards > 0) m["shards"] = shards;
  if (!kind.empty()) m["kind"] = kind;
  return m;
}

}  // namespace

void check_flat_f32(const Tensor& t, int64_t numel, const std::string& where, const char* what) {
  LOOM_CHECK(t.defined(), where, ": ", what, " is undefined, expected f32(", numel, ") in host memory");
  LOOM_CHECK(t.dtype() == DTYPE_F32 && t.numel() == numel && t.device() == DEVICE_CPU, where, ": ", what, " is ",
             t.describe(), (t.device() == DEVICE_CPU ? "" : " on a device"), ", expected f32(", numel,
             ") in host memory");
}

std::string shard_file_name(int rank, int world) {
  std::ostringstream out;
  out << "shard_" << std::setw(5) << std::setfill('0') << rank << "_of_" << std::setw(5) << std::setfill('0') << world
      << ".safetensors";
  return out.str();
}

void commit_folder(const fs::path& tmp_dir, const fs::path& final_dir, const CheckpointContents& contents, int64_t shards,
                   const std::string& kind) {
  std::error_code ec;
  try {
    write_text_synced((tmp_dir / kTrainerFile).string(), trainer_json(contents).dump(2));
    copy_attached(tmp_dir, contents.attached);
    write_text_synced((tmp_dir / kManifestFile).string(),
                      manifest_json(tmp_dir, contents.step, shards, contents.attached, kind).dump(2));
    fsync_directory(tmp_dir.string());
    if (fs::exists(final_dir, ec)) remove_tree(final_dir);  // an older save of the same step, e.g. before a fall-back
    fs::rename(tmp_dir, final_dir, ec);
    LOOM_CHECK(!ec, final_dir.string(), ": rename from ", tmp_dir.string(), " failed: ", ec.message());
    fsync_directory(final_dir.parent_path().empty() ? "." : final_dir.parent_path().string());
  } catch (...) {
    fs::remove_all(tmp_dir, ec);
    throw;
  }
}

int64_t parse_int(const std::string& text, const std::string& path, const std::string& key) {
  try {
    size_t used = 0;
    const int64_t v = std::stoll(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  throw Error(str_cat(path, ": metadata '", key, "' is '", text, "', expected an integer"));
}

LoadedCheckpoint read_trainer_file(const std::string& dir) {
  const std::string trainer_path = (fs::path(dir) / kTrainerFile).string();
  const nlohmann::json trainer = read_json_file(trainer_path);
  LoadedCheckpoint loaded;
  loaded.path = dir;
  try {
    // nlohmann casts a float such as 1e300 to the integer, undefined beyond its range.
    LOOM_CHECK(trainer.at("step").is_number_integer(), trainer_path, ": step is ", trainer.at("step").dump(),
               ", expected an integer");
    loaded.step = trainer.at("step").get<int64_t>();
    loaded.data_state = trainer.at("data_state");
    loaded.config_text = trainer.at("config_text").get<std::string>();
    loaded.extra = trainer.at("extra");
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(trainer_path, ": expected step, data_state, config_text and extra (", e.what(), ")"));
  }
  return loaded;
}

}  // namespace ckpt

std::string checkpoint_problem(const std::string& path) {
  const fs::path dir(path);
  const fs::path manifest_path = dir / kManifestFile;
  std::error_code ec;
  if (!fs::is_regular_file(manifest_path, ec)) return str_cat(kManifestFile, " is missing");
  nlohmann::json manifest;
  try {
    manifest = read_json_file(manifest_path.string());
  } catch (const Error&) {
    return str_cat(kManifestFile, " is not valid JSON");
  }
  try {
    if (manifest.at("format").get<std::string>() != kManifestFormat || !manifest.at("files").is_object()) {
      return str_cat(kManifestFile, " is not a Loom checkpoint manifest");
    }
    if (!manifest.at("version").is_number_integer() || manifest.at("version").get<int64_t>() != kManifestVersion) {
      return str_cat(kManifestFile, " has version ", manifest.at("version").dump(), ", expected ", kManifestVersion);
    }
  } catch (const nlohmann::json::exception&) {
    return str_cat(kManifestFile, " is not a Loom checkpoint manifest");
  }
  const nlohmann::json& files = manifest["files"];
  const nlohmann::json shards = manifest.value("shards", nlohmann::json(0));
  if (!shards.is_number_integer() || shards.get<int64_t>() < 0 || shards.get<int64_t>() > (1 << 20)) {
    return str_cat(kManifestFile, " has shards = ", shards.dump(), ", expected a count of ranks");
  }
  const nlohmann::json kind = manifest.value("kind", nlohmann::json(""));
  if (!kind.is_string() || (kind.get<std::string>() != "" && kind.get<std::string>() != kQuantizedKind)) {
    return str_cat(kManifestFile, " has kind ", kind.dump(), ", expected none or \"quantized\"");
  }
  for (const std::string& name : required_files(shards.get<int64_t>(), kind.get<std::string>())) {
    if (!files.contains(name)) return str_cat(kManifestFile, " does not list ", name);
  }
  for (const auto& [name, entry] : files.items()) {
    if (!is_inside_name(name)) {
      return str_cat(kManifestFile, " lists '", name, "', expected a file name inside the checkpoint");
    }
    if (!entry.is_object() || !entry.contains("bytes") || !entry["bytes"].is_number_unsigned() ||
        !entry.contains("xxh64") || !entry["xxh64"].is_string()) {
      return str_cat(kManifestFile, " entry for ", name, " needs bytes and xxh64");
    }
    const fs::path file = dir / name;
    if (!fs::is_regular_file(file, ec)) return str_cat(name, " is missing");
    const uint64_t expected_bytes = entry["bytes"].get<uint64_t>();
    const uint64_t bytes = fs::file_size(file, ec);
    if (ec) return str_cat(name, " cannot be read (", ec.message(), ")");
    if (bytes != expected_bytes) return str_cat(name, " has ", bytes, " bytes, the manifest says ", expected_bytes);
    FileDigest digest;
    try {
      digest = digest_file(file.string());
    } catch (const Error& e) {
      return e.what();
    }
    const std::string& expected_hash = entry["xxh64"].get_ref<const std::string&>();
    if (hex64(digest.xxh64) != expected_hash) {
      return str_cat(name, " has XXH64 ", hex64(digest.xxh64), ", the manifest says ", expected_hash);
    }
  }
  return "";
}

}  // namespace loom
