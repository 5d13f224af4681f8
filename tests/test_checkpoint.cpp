// Checkpoint manager: bitwise round trips, Hugging Face's GPT-2 layout, fall-back past corrupt
// checkpoints, crash leftovers, retention, and clear errors for a model that does not fit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/checkpoint/hf_model.h"
#include "loom/checkpoint/param_reader.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/model/transformer.h"
#include "loom/optim/optimizer.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

// A fresh folder under the system temp dir, deleted with its contents at the end of the test.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ =
        fs::temp_directory_path() / ("loom_checkpoint_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string str() const { return path_.string(); }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

// A model and its optimizer after a few AdamW steps on random gradients, so that the
// parameters, m, v and the step counter all differ from a fresh pair.
struct TrainedModel {
  TrainedModel(const ModelConfig& config, uint64_t seed, int steps) : backend(make_cpu_backend()) {
    model = std::make_unique<Transformer>(*backend, config);
    model->init_weights(seed);
    OptimConfig oc;
    oc.name = "adamw";
    optimizer = make_optimizer(*backend, model->params(), model->grads(), optim_params(model->layout(), oc.resolved()), oc);
    for (int s = 0; s < steps; ++s) {
      const Tensor g = test::random_tensor(backend->allocator(), {model->grads().numel()}, DTYPE_F32, seed * 100 + s);
      std::memcpy(model->grads().raw_data(), g.raw_data(), g.nbytes());
      optimizer->step(1e-3f);
    }
  }

  ModelState model_state() const { return {model->config(), model->params()}; }
  OptimizerState optimizer_state() const { return {optimizer->name(), optimizer->state()}; }

  CheckpointContents contents(int64_t step) const {
    CheckpointContents c;
    c.step = step;
    c.model = model_state();
    c.optimizer = optimizer_state();
    c.optimizer_steps = optimizer->steps_taken();
    c.data_state = {{"rng_seed", 1234}, {"shard", 3}, {"position", 4096 + step}};
    c.config_text = "[model]\npreset = \"tiny\"\n";
    c.extra = {{"best_loss", 2.5}, {"tokens_seen", 1 << 20}};
    return c;
  }

  std::unique_ptr<Backend> backend;
  std::unique_ptr<Transformer> model;
  std::unique_ptr<Optimizer> optimizer;
};

std::vector<char> bytes_of(const Tensor& t) {
  const char* p = static_cast<const char*>(t.raw_data());
  return std::vector<char>(p, p + t.nbytes());
}

void expect_same_state(const TrainedModel& a, const TrainedModel& b) {
  EXPECT_EQ(bytes_of(a.model->params()), bytes_of(b.model->params()));
  ASSERT_EQ(a.optimizer->state().size(), b.optimizer->state().size());
  for (size_t i = 0; i < a.optimizer->state().size(); ++i) {
    EXPECT_EQ(a.optimizer->state()[i].first, b.optimizer->state()[i].first);
    EXPECT_EQ(bytes_of(a.optimizer->state()[i].second), bytes_of(b.optimizer->state()[i].second));
  }
}

// Runs f and returns the loom::Error's message (fails the test when nothing is thrown).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a loom::Error";
  return "";
}

void flip_byte(const fs::path& file, uint64_t offset) {
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  io.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  io.seekp(static_cast<std::streamoff>(offset));
  io.write(&c, 1);
}

TEST(CheckpointTest, RoundTripIsBitwise) {
  TempDir dir;
  const TrainedModel saved(model_preset("llama-tiny"), 1, 3);
  CheckpointManager manager(dir.str());
  const std::string path = manager.save(saved.contents(42));
  EXPECT_EQ(path, (dir / "step_00000042").string());

  TrainedModel restored(model_preset("llama-tiny"), 2, 0);
  const LoadedCheckpoint loaded = manager.load(path, restored.model_state(), restored.optimizer_state());
  restored.optimizer->restore_steps_taken(loaded.optimizer_steps);

  expect_same_state(saved, restored);
  EXPECT_EQ(restored.optimizer->steps_taken(), 3);
  const CheckpointContents expected = saved.contents(42);
  EXPECT_EQ(loaded.path, path);
  EXPECT_EQ(loaded.step, 42);
  EXPECT_EQ(loaded.data_state, expected.data_state);
  EXPECT_EQ(loaded.config_text, expected.config_text);
  EXPECT_EQ(loaded.extra, expected.extra);
}

// Attached files (a self-contained checkpoint's tokenizer) are copied into the step folder under
// their relative names and listed in the manifest with their checksums: a changed one makes
// the checkpoint invalid, naming the file.
TEST(CheckpointTest, AttachedFilesAreCopiedInAndChecked) {
  TempDir dir;
  const TrainedModel saved(model_preset("llama-tiny"), 1, 1);
  std::ofstream(dir / "vocab.bpe") << "#version: 0.2\na b\n";
  std::ofstream(dir / "encoder.json") << "{}";
  CheckpointContents c = saved.contents(3);
  c.attached = {{"tokenizer/vocab.bpe", (dir / "vocab.bpe").string()},
                {"tokenizer/encoder.json", (dir / "encoder.json").string()}};
  const std::string path = CheckpointManager((dir / "ckpt").string()).save(c);
  std::ifstream in(fs::path(path) / "tokenizer" / "vocab.bpe");
  std::stringstream copied;
  copied << in.rdbuf();
  EXPECT_EQ(copied.str(), "#version: 0.2\na b\n");
  EXPECT_EQ(checkpoint_problem(path), "");
  std::ofstream(fs::path(path) / "tokenizer" / "vocab.bpe", std::ios::app) << "c d\n";
  EXPECT_NE(checkpoint_problem(path).find("tokenizer/vocab.bpe has"), std::string::npos) << checkpoint_problem(path);
  // Names must stay inside the step folder.
  c.attached = {{"../escape.txt", (dir / "vocab.bpe").string()}};
  EXPECT_NE(test::error_of([&] { CheckpointManager((dir / "ckpt2").string()).save(c); }).find("../escape.txt"),
            std::string::npos);
}

TEST(CheckpointTest, Gpt2IsStoredInHuggingFaceLayoutAndReloadsBitwise) {
  TempDir dir;
  const ModelConfig config = model_preset("gpt2-tiny");
  const int64_t C = config.d_model;
  const TrainedModel saved(config, 1, 2);
  CheckpointManager manager(dir.str());
  const std::string path = manager.save(saved.contents(1));

  const SafetensorsFile file = SafetensorsFile::read((fs::path(path) / "model.safetensors").string());
  EXPECT_EQ(file.metadata_value("format"), "pt");
  EXPECT_EQ(file.metadata_value("arch"), "gpt2");
  EXPECT_EQ(file.shape("h.0.attn.c_attn.weight"), (Shape{C, 3 * C}));
  EXPECT_EQ(file.shape("h.1.mlp.c_fc.weight"), (Shape{C, config.d_ff}));
  EXPECT_EQ(file.shape("h.1.mlp.c_proj.weight"), (Shape{config.d_ff, C}));
  EXPECT_EQ(file.shape("wte.weight"), (Shape{config.vocab_size, C}));  // Embeddings are not Conv1D.
  // Stored (in, out): element [i][o] is Loom's (out, in) element [o][i].
  const Tensor stored = file.tensor("h.0.attn.c_attn.weight", saved.backend->allocator(), MEM_WORKSPACE);
  const Tensor live = saved.model->param("h.0.attn.c_attn.weight");
  EXPECT_EQ(stored.data<float>()[5 * 3 * C + 7], live.data<float>()[7 * C + 5]);

  TrainedModel restored(config, 2, 0);
  manager.load(path, restored.model_state(), restored.optimizer_state());
  expect_same_state(saved, restored);
}

TEST(CheckpointTest, Gpt2WithoutHfLayoutKeepsLoomShapes) {
  TempDir dir;
  const ModelConfig config = model_preset("gpt2-tiny");
  const TrainedModel saved(config, 1, 1);
  CheckpointManager manager(dir.str(), CheckpointOptions{.keep_last = 3, .hf_layout = false});
  const std::string path = manager.save(saved.contents(1));

  const SafetensorsFile file = SafetensorsFile::read((fs::path(path) / "model.safetensors").string());
  EXPECT_EQ(file.shape("h.0.attn.c_attn.weight"), (Shape{3 * config.d_model, config.d_model}));
  TrainedModel restored(config, 2, 0);
  manager.load(path, restored.model_state(), restored.optimizer_state());
  expect_same_state(saved, restored);
}

// check_finite_param names the first non-finite element, f32 or bf16, wherever it falls among
// the blocks it scans (the first, a later one, the last element); finite values pass.
TEST(CheckpointTest, NonFiniteParameterIsNamedAtItsFirstElement) {
  for (const size_t n : {size_t{1}, size_t{4095}, size_t{4096}, size_t{10001}}) {
    std::vector<float> f(n, 0.5f);
    std::vector<bf16> b(n, f32_to_bf16(0.5f));
    check_finite_param("p", "w", f);
    check_finite_param("p", "w", b);
    for (const size_t at : {size_t{0}, n / 2, n - 1}) {
      std::fill(f.begin(), f.end(), 0.5f);
      std::fill(b.begin(), b.end(), f32_to_bf16(0.5f));
      f[at] = NAN, b[at] = f32_to_bf16(INFINITY);
      if (at + 1 < n) f[n - 1] = NAN, b[n - 1] = f32_to_bf16(NAN);  // a later one is not the one named
      const std::string want = " at element " + std::to_string(at) + " (a diverged or corrupted model)";
      EXPECT_NE(test::error_of([&] { check_finite_param("p", "w", f); }).find("p: weight w holds nan" + want),
                std::string::npos) << n << " " << at;
      EXPECT_NE(test::error_of([&] { check_finite_param("p", "w", b); }).find("p: weight w holds inf" + want),
                std::string::npos) << n << " " << at;
    }
  }
}

TEST(CheckpointTest, ModelConfigIsReadBackFromTheCheckpoint) {
  TempDir dir;
  const ModelConfig config = model_preset("llama-tiny");
  const TrainedModel saved(config, 1, 0);
  const std::string path = CheckpointManager(dir.str()).save(saved.contents(1));
  const ModelConfig read = checkpoint_model_config(path);
  EXPECT_EQ(read.arch, config.arch);
  EXPECT_EQ(read.vocab_size, config.vocab_size);
  EXPECT_EQ(read.n_layer, config.n_layer);
  EXPECT_EQ(read.n_kv_head, config.n_kv_head);
  EXPECT_EQ(read.d_ff, config.d_ff);
  EXPECT_EQ(read.norm_eps, config.norm_eps);
  EXPECT_EQ(read.rope_theta, config.rope_theta);
  EXPECT_EQ(read.attn_window, 0);
}

TEST(CheckpointTest, AttentionWindowIsReadBackFromTheCheckpoint) {
  TempDir dir;
  ModelConfig config = model_preset("llama-tiny");
  config.attn_window = 5;
  const TrainedModel saved(config, 1, 0);
  const std::string path = CheckpointManager(dir.str()).save(saved.contents(1));
  EXPECT_EQ(checkpoint_model_config(path).attn_window, 5);
}

TEST(CheckpointTest, MlaDimensionsAreReadBackFromTheCheckpoint) {
  TempDir dir;
  ModelConfig config = model_preset("llama-tiny");
  config.n_kv_head = config.n_head;
  config.mla_kv_rank = 16, config.mla_rope_dim = 4, config.mla_nope_dim = 6, config.mla_v_dim = 10, config.mla_q_rank = 12;
  const TrainedModel saved(config, 1, 0);
  const ModelConfig read = checkpoint_model_config(CheckpointManager(dir.str()).save(saved.contents(1)));
  EXPECT_EQ(read.mla_kv_rank, 16);
  EXPECT_EQ(read.mla_rope_dim, 4);
  EXPECT_EQ(read.mla_nope_dim, 6);
  EXPECT_EQ(read.mla_v_dim, 10);
  EXPECT_EQ(read.mla_q_rank, 12);
}

TEST(CheckpointTest, LoadWithoutOptimizerFillsOnlyTheModel) {
  TempDir dir;
  const TrainedModel saved(model_preset("gpt2-tiny"), 1, 2);
  CheckpointManager manager(dir.str());
  const std::string path = manager.save(saved.contents(7));
  TrainedModel restored(model_preset("gpt2-tiny"), 2, 0);
  const LoadedCheckpoint loaded = manager.load(path, restored.model_state(), OptimizerState{});
  EXPECT_EQ(bytes_of(restored.model->params()), bytes_of(saved.model->params()));
  EXPECT_EQ(loaded.step, 7);
}

TEST(CheckpointTest, LoadLatestReturnsTheNewest) {
  TempDir dir;
  CheckpointManager manager(dir.str());
  manager.save(TrainedModel(model_preset("gpt2-tiny"), 1, 1).contents(10));
  const TrainedModel newest(model_preset("gpt2-tiny"), 2, 2);
  manager.save(newest.contents(20));

  TrainedModel restored(model_preset("gpt2-tiny"), 3, 0);
  std::vector<std::string> warnings;
  const auto loaded = manager.load_latest(restored.model_state(), restored.optimizer_state(),
                                          [&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 20);
  EXPECT_TRUE(warnings.empty());
  expect_same_state(newest, restored);
}

TEST(CheckpointTest, LoadLatestInAnEmptyFolderFindsNothing) {
  TempDir dir;
  CheckpointManager manager((dir / "never_written").string());
  TrainedModel model(model_preset("gpt2-tiny"), 1, 0);
  std::vector<std::string> warnings;
  EXPECT_FALSE(manager
                   .load_latest(model.model_state(), model.optimizer_state(),
                                [&](const std::string& w) { warnings.push_back(w); })
                   .has_value());
  EXPECT_TRUE(warnings.empty());
}

// Saves steps 1 and 2, damages step 2 with `damage`, and expects load_latest to load step 1
// and report step 2 in one line that contains `reason`.
void expect_fall_back_past(const std::function<void(const fs::path&)>& damage, const std::string& reason) {
  TempDir dir;
  CheckpointManager manager(dir.str());
  const TrainedModel older(model_preset("gpt2-tiny"), 1, 1);
  const std::string older_path = manager.save(older.contents(1));
  const std::string newer_path = manager.save(TrainedModel(model_preset("gpt2-tiny"), 2, 2).contents(2));
  damage(fs::path(newer_path));

  TrainedModel restored(model_preset("gpt2-tiny"), 3, 0);
  std::vector<std::string> warnings;
  const auto loaded = manager.load_latest(restored.model_state(), restored.optimizer_state(),
                                          [&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 1);
  EXPECT_EQ(loaded->path, older_path);
  expect_same_state(older, restored);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0].find("checkpoint " + newer_path + " is corrupt ("), 0u) << warnings[0];
  EXPECT_NE(warnings[0].find(reason), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("); falling back to " + older_path), std::string::npos) << warnings[0];
  EXPECT_EQ(warnings[0].find('\n'), std::string::npos) << warnings[0];
}

TEST(CheckpointTest, FlippedByteFallsBackToThePreviousCheckpoint) {
  expect_fall_back_past(
      [](const fs::path& p) { flip_byte(p / "model.safetensors", fs::file_size(p / "model.safetensors") / 2); },
      "model.safetensors has XXH64");
}

TEST(CheckpointTest, TruncatedFileFallsBackToThePreviousCheckpoint) {
  expect_fall_back_past(
      [](const fs::path& p) {
        fs::resize_file(p / "optimizer.safetensors", fs::file_size(p / "optimizer.safetensors") - 10);
      },
      "optimizer.safetensors has");
}

TEST(CheckpointTest, MissingManifestFallsBackToThePreviousCheckpoint) {
  expect_fall_back_past([](const fs::path& p) { fs::remove(p / "manifest.json"); }, "manifest.json is missing");
}

TEST(CheckpointTest, DamagedTrainerStateFallsBackToThePreviousCheckpoint) {
  expect_fall_back_past([](const fs::path& p) { flip_byte(p / "trainer.json", 3); }, "trainer.json has XXH64");
}

TEST(CheckpointTest, NoValidCheckpointFindsNothingAndReportsEach) {
  TempDir dir;
  CheckpointManager manager(dir.str());
  const TrainedModel model(model_preset("gpt2-tiny"), 1, 1);
  const std::string first = manager.save(model.contents(1));
  const std::string second = manager.save(model.contents(2));
  fs::remove(fs::path(first) / "manifest.json");
  fs::remove(fs::path(second) / "trainer.json");

  TrainedModel restored(model_preset("gpt2-tiny"), 3, 0);
  std::vector<std::string> warnings;
  EXPECT_FALSE(manager
                   .load_latest(restored.model_state(), restored.optimizer_state(),
                                [&](const std::string& w) { warnings.push_back(w); })
                   .has_value());
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_NE(warnings[0].find(second + " is corrupt (trainer.json is missing); falling back to " + first),
            std::string::npos)
      << warnings[0];
  EXPECT_NE(warnings[1].find(first + " is corrupt (manifest.json is missing); falling back to no checkpoint"),
            std::string::npos)
      << warnings[1];
}

TEST(CheckpointTest, LoadOfACorruptCheckpointIsAnErrorNamingIt) {
  TempDir dir;
  CheckpointManager manager(dir.str());
  TrainedModel model(model_preset("gpt2-tiny"), 1, 1);
  const std::string path = manager.save(model.contents(1));
  flip_byte(fs::path(path) / "optimizer.safetensors", 100);
  const std::string message = error_of([&] { manager.load(path, model.model_state(), model.optimizer_state()); });
  EXPECT_NE(message.find("checkpoint " + path + " is corrupt (optimizer.safetensors has XXH64"), std::string::npos)
      << message;
}

TEST(CheckpointTest, TmpFolderFromACrashIsIgnoredAndCleanedUpByTheNextSave) {
  TempDir dir;
  CheckpointManager manager(dir.str());
  const TrainedModel model(model_preset("gpt2-tiny"), 1, 1);
  manager.save(model.contents(1));
  // A crash during save(2): everything written but the rename.
  const std::string crashed = manager.save(model.contents(2));
  fs::rename(crashed, crashed + ".tmp");

  EXPECT_EQ(manager.list(), std::vector<std::string>{(dir / "step_00000001").string()});
  TrainedModel restored(model_preset("gpt2-tiny"), 3, 0);
  std::vector<std::string> warnings;
  const auto loaded = manager.load_latest(restored.model_state(), restored.optimizer_state(),
                                          [&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 1);
  EXPECT_TRUE(warnings.empty());

  manager.save(model.contents(3));
  EXPECT_FALSE(fs::exists(crashed + ".tmp"));
}

TEST(CheckpointTest, KeepLastDeletesTheOldest) {
  TempDir dir;
  CheckpointManager manager(dir.str(), CheckpointOptions{.keep_last = 2});
  const TrainedModel model(model_preset("gpt2-tiny"), 1, 1);
  for (int64_t step : {100, 200, 300}) manager.save(model.contents(step));
  EXPECT_EQ(manager.list(),
            (std::vector<std::string>{(dir / "step_00000300").string(), (dir / "step_00000200").string()}));
}

TEST(CheckpointTest, KeepLastCountsOnlyValidCheckpoints) {
  TempDir dir;
  CheckpointManager manager(dir.str(), CheckpointOptions{.keep_last = 2});
  const TrainedModel model(model_preset("gpt2-tiny"), 1, 1);
  manager.save(model.contents(1));
  const std::string broken = manager.save(model.contents(2));
  fs::remove(fs::path(broken) / "manifest.json");
  CheckpointManager fresh(dir.str(), CheckpointOptions{.keep_last = 2});  // verifies what is on disk
  fresh.save(model.contents(3));
  EXPECT_EQ(fresh.list(),
            (std::vector<std::string>{(dir / "step_00000003").string(), (dir / "step_00000001").string()}));
}

TEST(CheckpointTest, SavingAStepAgainReplacesIt) {
  TempDir dir;
  CheckpointManager manager(dir.str());
  manager.save(TrainedModel(model_preset("gpt2-tiny"), 1, 1).contents(5));
  const TrainedModel second(model_preset("gpt2-tiny"), 2, 2);
  const std::string path = manager.save(second.contents(5));

  TrainedModel restored(model_preset("gpt2-tiny"), 3, 0);
  manager.load(path, restored.model_state(), restored.optimizer_state());
  expect_same_state(second, restored);
}

TEST(CheckpointTest, MismatchedModelConfigIsAnErrorNamingFileAndTensor) {
  TempDir dir;
  CheckpointManager manager(dir.str());
  const std::string path = manager.save(TrainedModel(model_preset("gpt2-tiny"), 1, 1).contents(1));
  ModelConfig wider = model_preset("gpt2-tiny");
  wider.d_model = 64;
  TrainedModel other(wider, 2, 0);
  const std::vector<char> before = bytes_of(other.model->params());

  const std::string message = error_of([&] { manager.load(path, other.model_state(), other.optimizer_state()); });
  EXPECT_NE(message.find((fs::path(path) / "model.safetensors").string()), std::string::npos) << message;
  EXPECT_NE(message.find("tensor 'wte.weight' is f32(97, 32), the model expects f32(97, 64)"), std::string::npos)
      << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  EXPECT_EQ(bytes_of(other.model->params()), before);  // nothing copied
}

TEST(CheckpointTest, ExtraLayersAreAnErrorNamingTheTensor) {
  TempDir dir;
  CheckpointManager manager(dir.str());
  const std::string path = manager.save(TrainedModel(model_preset("gpt2-tiny"), 1, 1).contents(1));
  ModelConfig shallower = model_preset("gpt2-tiny");
  shallower.n_layer = 1;
  TrainedModel other(shallower, 2, 0);
  const std::string message = error_of([&] { manager.load(path, other.model_state(), other.optimizer_state()); });
  EXPECT_NE(message.find("tensor 'h.1."), std::string::npos) << message;
  EXPECT_NE(message.find("is not a parameter of this model"), std::string::npos) << message;
}

TEST(CheckpointTest, MismatchedArchIsAnErrorNamingBoth) {
  TempDir dir;
  CheckpointManager manager(dir.str());
  const std::string path = manager.save(TrainedModel(model_preset("gpt2-tiny"), 1, 1).contents(1));
  TrainedModel llama(model_preset("llama-tiny"), 2, 0);
  std::vector<std::string> warnings;
  const std::string message = error_of([&] {
    manager.load_latest(llama.model_state(), llama.optimizer_state(),
                        [&](const std::string& w) { warnings.push_back(w); });
  });
  EXPECT_NE(message.find("model.safetensors: checkpoint arch is 'gpt2', the model is 'llama'"), std::string::npos)
      << message;
  EXPECT_TRUE(warnings.empty());  // a valid checkpoint that does not fit is not skipped
}

// ---- Hugging Face folders whose config.json does not fit their tensors (issue 41) ----

// A Hugging Face folder of `config` (random weights) in `dir`, its config.json edited by `edit`.
void write_hf_folder(const fs::path& dir, const ModelConfig& config, const std::function<void(nlohmann::json&)>& edit) {
  TrainedModel model(config, 3, 0);
  save_hf_model(dir.string(), model.model_state());
  nlohmann::json j;
  std::ifstream(dir / "config.json") >> j;
  edit(j);
  std::ofstream(dir / "config.json") << j.dump(2);
}

// Layer and expert counts beyond the tensors present are refused when the config is read, before
// a model of that size (or its parameter layout) is allocated, naming the first missing tensor.
TEST(HfImport, CountsBeyondTheTensorsAreRefusedNamingTheMissingTensor) {
  TempDir dir;
  struct Case {
    std::string name;
    ModelConfig config;
    std::function<void(nlohmann::json&)> edit;
    std::string expected;
  };
  ModelConfig mixtral = model_preset("llama-tiny");
  mixtral.moe_experts = 4, mixtral.moe_top_k = 2, mixtral.moe_renorm = true;
  const Case cases[] = {
      {"llama", model_preset("llama-tiny"), [](nlohmann::json& j) { j["num_hidden_layers"] = 4000; },
       "tensor 'model.layers.2.input_layernorm.weight' is missing from the safetensors files in DIR, which hold 2 layers; "
       "DIR/config.json says num_hidden_layers 4000"},
      {"gpt2", model_preset("gpt2-tiny"), [](nlohmann::json& j) { j["n_layer"] = 4096; },
       "tensor 'h.2.ln_1.weight' is missing from the safetensors files in DIR, which hold 2 layers; DIR/config.json says "
       "n_layer 4096"},
      {"mixtral", mixtral, [](nlohmann::json& j) { j["num_local_experts"] = 4096; },
       "tensor 'model.layers.0.block_sparse_moe.experts.4.w1.weight' is missing from the safetensors files in DIR, which "
       "hold 4 experts per layer; DIR/config.json says num_local_experts 4096"},
      // Past the counts any model is described with, the config itself is refused (ModelConfig::validate).
      {"llama-1e9", model_preset("llama-tiny"), [](nlohmann::json& j) { j["num_hidden_layers"] = 1e9; },
       "DIR/config.json: model.n_layer must be <= 4096, got 1000000000"},
      {"mixtral-1e6", mixtral, [](nlohmann::json& j) { j["num_local_experts"] = 1000000; },
       "DIR/config.json: model.moe_experts must be <= 4096, got 1000000"},
      {"width", model_preset("llama-tiny"), [](nlohmann::json& j) { j["intermediate_size"] = 100000; },
       "tensor 'model.layers.0.mlp.gate_proj.weight' has shape (80, 48), expected (100000, 48) (from DIR/config.json)"},
  };
  for (const Case& c : cases) {
    const fs::path folder = dir / c.name;
    write_hf_folder(folder, c.config, c.edit);
    std::string expected = c.expected;
    for (size_t at; (at = expected.find("DIR")) != std::string::npos;) expected.replace(at, 3, folder.string());
    const auto start = std::chrono::steady_clock::now();
    const std::string message = error_of([&] { hf_model_config(folder.string()); });
    EXPECT_NE(message.find(expected), std::string::npos) << c.name << ": " << message;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 2.0) << c.name;
  }
  // The folders as written load.
  const fs::path good = dir / "good";
  write_hf_folder(good, mixtral, [](nlohmann::json&) {});
  EXPECT_EQ(hf_model_config(good.string()).moe_experts, 4);
}

// An integer key of config.json refuses a fraction (64.5 was read as 64) and other types, naming
// the key; a float key a value its type cannot hold.
TEST(HfImport, IntegerKeysRefuseFractionsNamingTheKey) {
  TempDir dir;
  const std::pair<std::function<void(nlohmann::json&)>, std::string> cases[] = {
      {[](nlohmann::json& j) { j["hidden_size"] = 64.5; }, "config.json: key 'hidden_size' must be an integer, got 64.5"},
      {[](nlohmann::json& j) { j["num_attention_heads"] = true; }, "config.json: key 'num_attention_heads' has the wrong type (true)"},
      {[](nlohmann::json& j) { j["vocab_size"] = 1e30; }, "config.json: key 'vocab_size' = 1e+30 is out of range"},
      {[](nlohmann::json& j) {
         j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                              {"original_max_position_embeddings", 8192.5}};
       },
       "config.json: rope_scaling.original_max_position_embeddings must be an integer, got 8192.5"},
      {[](nlohmann::json& j) { j["rms_norm_eps"] = 1e300; }, "config.json: key 'rms_norm_eps' = 1e+300 is not a finite number"},
  };
  int i = 0;
  for (const auto& [edit, expected] : cases) {
    const fs::path folder = dir / ("case" + std::to_string(i++));
    write_hf_folder(folder, model_preset("llama-tiny"), edit);
    const std::string message = error_of([&] { hf_model_config(folder.string()); });
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  }
  // An integral value written as a float is that integer.
  const fs::path folder = dir / "float";
  write_hf_folder(folder, model_preset("llama-tiny"), [](nlohmann::json& j) { j["num_hidden_layers"] = 2.0; });
  EXPECT_EQ(hf_model_config(folder.string()).n_layer, 2);
}

}  // namespace
}  // namespace loom
