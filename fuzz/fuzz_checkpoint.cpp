// libFuzzer target: a checkpoint's step folder (checkpoint/checkpoint.h) as `loom train --resume`,
// `loom generate` and `train.init_from` meet it: the input is a FileSet (fuzz_input.h) whose first
// file is manifest.json and whose further files are trainer.json, model.safetensors,
// optimizer.safetensors or shard_<r>_of_<N>.safetensors ("==> trainer.json <==" ...). Then
//  - checkpoint_problem(folder) must answer, "" or why not, and never throw: load_latest and
//    resolve_checkpoint fall back to an older checkpoint on its answer;
//  - is_quantized_model(folder) and checkpoint_model_config(folder) must succeed or throw
//    loom::Error (the CLI calls them on a folder with a manifest without checking it first); a
//    config it gives must validate and round-trip through model_config_json /
//    model_config_from_json to the same JSON;
//  - for a valid checkpoint whose config is small, CheckpointManager::load into a model of that
//    config (with the SGD optimizer, which has no state, or the weights alone) must succeed or
//    throw loom::Error, and on an error leave the parameters untouched ("nothing is copied unless
//    all of it fits").
// Anything else (a crash, a sanitizer report, another exception, unbounded memory) is a finding.
#include <xxhash.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_input.h"
#include "json_mutator.h"
#include "loom/arch/param_layout.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/checkpoint/model_config_json.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"

namespace {

// Models the harness builds and loads: every size bounded before build_param_layout, so a
// fuzzed config of a billion layers is not built (that is memory planning's business, not the
// reader's); 1M parameters at most.
bool small(const loom::ModelConfig& c) {
  for (const int64_t v : {c.vocab_size, c.max_seq_len, c.d_model, c.d_ff, c.head_size, c.moe_d_ff, c.mla_kv_rank,
                          c.mla_q_rank, c.mla_rope_dim, c.mla_nope_dim, c.mla_v_dim})
    if (v > 4096) return false;
  return c.n_layer <= 16 && c.n_head <= 64 && c.n_kv_head <= 64 && c.moe_experts <= 16 && c.moe_shared <= 4 &&
         c.lora_rank <= 64;
}
constexpr int64_t kMaxParams = int64_t{1} << 20;

// A safetensors file as its header (JSON) and data bytes, to change the header and rewrite its
// length (the safetensors format: an 8-byte little-endian header length, the header, the data).
struct Safetensors {
  nlohmann::json header;
  std::string data;
};
std::optional<Safetensors> parse_safetensors(const std::string& bytes) {
  if (bytes.size() < 8) return std::nullopt;
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  if (n > bytes.size() - 8) return std::nullopt;
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n), nullptr, false);
  if (header.is_discarded()) return std::nullopt;
  return Safetensors{std::move(header), bytes.substr(8 + n)};
}
std::optional<std::string> write_safetensors(const Safetensors& s) {
  std::string text;
  try {
    text = s.header.dump();
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
  text.resize((text.size() + 7) / 8 * 8, ' ');
  const uint64_t n = text.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + text + s.data;
}

// manifest.json's entries made to agree with the files (their sizes and XXH64), so that
// mutations of the other files get past checkpoint_problem to the readers behind it.
std::optional<std::string> sync_manifest(const loom_fuzz::FileSet& files) {
  nlohmann::json manifest = nlohmann::json::parse(files[0].bytes, nullptr, false);
  if (!manifest.is_object() || !manifest.contains("files") || !manifest["files"].is_object()) return std::nullopt;
  for (size_t i = 1; i < files.size(); ++i) {
    const std::string& b = files[i].bytes;
    manifest["files"][files[i].name] = {{"bytes", b.size()}, {"xxh64", loom::hex64(XXH64(b.data(), b.size(), 0))}};
  }
  try {
    return manifest.dump(1);
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

// The load into a model of the checkpoint's config, with the SGD optimizer (no state: the resume
// path reads the optimizer file's name and step) where there is an optimizer file, else of the
// weights alone (OptimizerState's empty name: what train.init_from and generate do, and what
// reads a sharded checkpoint's parameters whatever its optimizer); an error must leave the
// parameters as they were. One load per input: each reads every file again.
void check_load(const std::string& dir, const loom::ModelConfig& config, bool optimizer_file) {
  const loom::ParamLayout layout = loom::build_param_layout(config);
  if (layout.total > kMaxParams) return;
  loom::CpuAllocator alloc;
  const loom::Tensor params = loom::Tensor::empty(alloc, {layout.total}, loom::DTYPE_F32, loom::MEM_PARAMETERS);
  float* p = params.data<float>();
  for (int64_t i = 0; i < layout.total; ++i) p[i] = -static_cast<float>(i);
  try {
    loom::CheckpointManager manager(dir);
    const loom::LoadedCheckpoint loaded = manager.load(dir, loom::ModelState{config, params},
                                                       loom::OptimizerState{optimizer_file ? "sgd" : "", {}, 0});
    loom_fuzz::require(loaded.path == dir, "load names the folder it read");
  } catch (const loom::Error&) {
    for (int64_t i = 0; i < layout.total; ++i)
      loom_fuzz::require(p[i] == -static_cast<float>(i), "a load that fails leaves the parameters untouched");
  }
}

}  // namespace

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

// Half of the mutations change one file of the set: a JSON file as JSON (json_mutator.h), a
// safetensors file's header as JSON or its "model_config" metadata (JSON in a string) as JSON,
// or any file's bytes by libFuzzer; then, mostly, the manifest is made to agree with the files.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  static const loom_fuzz::JsonWords words{
      {"format", "version", "step", "files", "bytes", "xxh64", "shards", "kind", "data_state", "config_text", "extra",
       "__metadata__", "dtype", "shape", "data_offsets", "arch", "hf_layout", "model_config", "optimizer", "rank",
       "world", "begin", "end", "flat", "vocab_size", "max_seq_len", "n_layer", "n_head", "n_kv_head", "d_model",
       "d_ff", "norm_eps", "rope_theta", "init_std", "head_size", "attn_window", "qkv_bias", "tie_embeddings",
       "qk_norm", "rope_scaling", "type", "factor", "mla", "kv_rank", "rope_dim", "moe", "experts", "top_k", "peft",
       "method", "alpha", "targets"},
      {"loom-checkpoint", "quantized", "model.safetensors", "optimizer.safetensors", "trainer.json",
       "shard_00000_of_00001.safetensors", "shard_00000_of_00002.safetensors", "shard_00001_of_00002.safetensors",
       "../x", "a//b", "F32", "BF16", "I64", "gpt2", "llama", "true", "false", "sgd", "adamw", "params", "1", "-1",
       "x", "yarn", "llama3", "lora", "none", "0123456789abcdef"}};
  if (seed % 2 == 0) {
    std::mt19937_64 rng(seed / 2);
    loom_fuzz::FileSet files = loom_fuzz::split_files({reinterpret_cast<const char*>(data), size}, "manifest.json");
    loom_fuzz::NamedFile& f = files[rng() % files.size()];
    const uint64_t how = rng() % 3;
    std::optional<std::string> changed;
    if (f.name.ends_with(".json")) {
      changed = loom_fuzz::mutate_json(f.bytes, rng(), words);
    } else if (std::optional<Safetensors> st = parse_safetensors(f.bytes); st && st->header.is_object() && how < 2) {
      const auto meta = st->header.find("__metadata__");
      if (how == 0 && meta != st->header.end() && meta->is_object() && meta->contains("model_config") &&
          (*meta)["model_config"].is_string()) {
        const std::string config = (*meta)["model_config"].get<std::string>();
        if (std::optional<std::string> changed_config = loom_fuzz::mutate_json(config, rng(), words))
          (*meta)["model_config"] = *changed_config;
      } else if (std::optional<std::string> header = loom_fuzz::mutate_json(st->header.dump(), rng(), words)) {
        st->header = nlohmann::json::parse(*header, nullptr, false);
      }
      changed = write_safetensors(*st);
    } else {
      std::vector<uint8_t> buffer(f.bytes.begin(), f.bytes.end());
      buffer.resize(std::max<size_t>(buffer.size() * 2, 128));
      buffer.resize(LLVMFuzzerMutate(buffer.data(), f.bytes.size(), buffer.size()));
      changed = std::string(buffer.begin(), buffer.end());
    }
    if (changed) f.bytes = std::move(*changed);
    if (rng() % 4 != 0) {
      if (std::optional<std::string> manifest = sync_manifest(files)) files[0].bytes = std::move(*manifest);
    }
    if (const size_t n = loom_fuzz::emit(loom_fuzz::join_files(files), data, max_size)) return n;
  }
  return LLVMFuzzerMutate(data, size, max_size);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const loom_fuzz::ScratchDir scratch;
  const std::string dir = scratch.path();
  const loom_fuzz::FileSet files = loom_fuzz::split_files({reinterpret_cast<const char*>(data), size}, "manifest.json");
  loom_fuzz::write_files(scratch, files);
  std::string problem;
  try {
    problem = loom::checkpoint_problem(dir);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    loom_fuzz::require(false, "checkpoint_problem reports a corrupt checkpoint, it does not throw");
  }
  try {
    (void)loom::is_quantized_model(dir);
  } catch (const loom::Error&) {
  }
  std::optional<loom::ModelConfig> config;
  try {
    config = loom::checkpoint_model_config(dir);
  } catch (const loom::Error&) {
  }
  if (config) {
    try {
      config->validate();
      const std::string json = loom::model_config_json(*config).dump();
      const loom::ModelConfig back = loom::model_config_from_json(json, "model_config_json");
      loom_fuzz::require(loom::model_config_json(back).dump() == json, "model_config_json reads back to the same JSON");
    } catch (const loom::Error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      loom_fuzz::require(false, "checkpoint_model_config's config validates and reads back from model_config_json");
    }
  }
  if (problem.empty() && config && small(*config)) {
    bool optimizer_file = false;
    for (const loom_fuzz::NamedFile& f : files) optimizer_file = optimizer_file || f.name == "optimizer.safetensors";
    check_load(dir, *config, optimizer_file);
  }
  return 0;
}
