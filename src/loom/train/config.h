// The whole run configuration, typed: parsed once from TOML (configs/*.toml) plus
// `--set key=value` overrides, validated at load, and written back resolved into the run
// folder. Every key is declared once in the schema (config.cpp); an unknown key or a value of
// the wrong type is an error naming the file and key.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/infer/sampler.h"
#include "loom/arch/config.h"
#include "loom/parallel/compress.h"
#include "loom/parallel/pipeline_schedule.h"
#include "loom/data/sft.h"
#include "loom/train/dpo.h"
#include "loom/train/grpo.h"
#include "loom/train/distill.h"
#include "loom/train/kto.h"
#include "loom/train/orpo.h"
#include "loom/train/trainer.h"

namespace loom {

struct DataConfig {
  std::string dir = "data/fortunes";  // token shards written by `loom prepare`
  std::string tokenizer = "gpt2";     // gpt2 | byte | bpe:N (learned by prepare) | a directory with encoder.json + vocab.bpe
  std::string input = "";             // text for `loom prepare`; empty = the default corpus
  SftFormat format = SftFormat::text;  // what data.input holds (data/sft.h): text | chat-jsonl | jsonl
  // Packed documents (core/documents.h): attention within each document (ended by the
  // tokenizer's end-of-text token) and positions restarted at its start.
  bool document_mask = false;
  double val_fraction = 0.05;
};

struct LoopConfig {
  uint64_t seed = 1337;          // init and data order
  int64_t eval_every = 100;      // steps; 0 = only at the end
  int64_t eval_batches = 8;
  int64_t checkpoint_every = 0;  // steps; 0 = only at the end
  // false: no checkpoint at all (benchmarks, throwaway runs: HF Trainer's save_strategy = "no");
  // a stopped or preempted run then ends without one and cannot resume.
  bool save_checkpoints = true;
  int64_t keep_checkpoints = 3;
  int64_t log_every = 10;        // progress lines when stdout is not a terminal
  // train.init_from: start from these weights (a Loom checkpoint or a Hugging Face model folder,
  // checkpoint/weights.h) instead of a random initialisation; the optimizer, schedule and data
  // position start fresh. The model is the weights' (model.* keys are replaced).
  std::string init_from;
  // peft.adapter: a PEFT LoRA adapter folder (checkpoint/peft.h) loaded onto the weights; its
  // adapter_config.json sets the peft.* keys.
  std::string peft_adapter;
  // What a step minimises: a row of the objectives' registry (train/objective.h), which names
  // them; "lm" is the mean next-token loss over the counted targets.
  std::string objective = "lm";
  // Checkpoints written by a background thread from a host snapshot taken at the step boundary
  // (at most one in flight; each complete and durable before the next begins).
  bool async_checkpoint = false;
  // A failed checkpoint save (a full disk): stop the run (true) or report it and keep training.
  bool stop_on_save_error = true;
  // > 0: a step that makes no progress for this many seconds (a rank stopped or hung in a
  // collective) ends the job, naming the ranks that fell silent. 0 = no watchdog.
  double watchdog_seconds = 600.0;
  // Refuse a run whose estimated memory exceeds the machine's available memory (CPU backend).
  bool memory_check = true;
  // A Chrome / Perfetto trace per rank: <run>/trace/rank<N>.json.
  bool trace = false;
};

struct RunConfig {
  std::string dir = "runs";  // parent of run folders
  std::string name = "default";
};

struct SampleConfig {
  std::string prompt = "The";
  int64_t max_new_tokens = 120;
  SamplingConfig sampling{0.8f, 40, 0.95f, 1337};
};

// parallel.cp_attention: how attention sees the whole sequence under context parallelism.
enum class CpAttention { ring, ulysses };
template <>
struct EnumNames<CpAttention> {
  static constexpr std::array<std::string_view, 2> names{"ring", "ulysses"};
};

// Multi-process training (`mpirun -np N loom train`): data parallel over the N ranks;
// train.batch_size is each rank's micro-batch, so the global batch is batch_size * grad_accum * N.
struct ParallelConfig {
  int64_t dp = 0;  // data-parallel ranks (0: all the ranks the model-parallel sizes leave)
  int64_t tp = 1, pp = 1, cp = 1;  // tensor, pipeline, context parallel sizes (comm/device_mesh.h)
  int64_t ep = 1;  // expert parallel: MoE experts split over ep of the dp ranks (nn/moe.h)
  bool sequence_parallel = false;  // with tp > 1: norms and the residual stream on sequence shards
  CpAttention cp_attention = CpAttention::ring;  // with cp > 1
  PipeScheduleKind schedule = PipeScheduleKind::one_f_one_b;  // with pp > 1 (micro-batches: train.grad_accum)
  int64_t virtual_stages = 1;         // model chunks per pipeline rank (interleaved: >= 2)
  double bucket_mb = 25.0;  // DDP gradient bucket size (PyTorch's bucket_cap_mb)
  bool overlap = true;      // start each bucket's all-reduce during backward
  int64_t zero_stage = 0;   // 0: DDP; 1, 2, 3: ZeRO (optimizer state; + gradients; + parameters sharded)
  Compression compression = Compression::none;  // hook on the DDP path (parallel/compress.h)
  double topk_ratio = 0.01;          // Top-K's and DGC's (final) density
  int64_t qsgd_levels = 127;
  int64_t powersgd_rank = 4;
  double dgc_momentum = 0.9;         // DGC's momentum correction (use optim.name = sgd with it)
  double dgc_clip = 0.0;             // DGC's local gradient clipping threshold (<= 0: off)
  int64_t dgc_warmup_steps = 0;      // DGC's sparsity warm-up, in steps
  int64_t compression_warmup = 0;    // steps of plain all-reduce before parallel.compression takes over
};

struct LoomConfig {
  DeviceType device = DEVICE_CPU;  // the backend: cpu | cuda (backend/backend.h make_backend)
  ModelConfig model;
  ParallelConfig parallel;
  TrainConfig train;
  LoopConfig loop;
  DataConfig data;
  RunConfig run;
  SampleConfig sample;
  DpoConfig dpo;
  GrpoConfig grpo;
  DistillConfig distill;
  OrpoConfig orpo;
  KtoConfig kto;

  void validate() const;
  // train.objective against data.format and its keys (validate() runs it too; `loom train` runs
  // it first, before opening any data).
  void validate_objective() const;
};

// A config file's size limit (a config is a few KiB; this stops a wrong path early).
inline constexpr uintmax_t kMaxConfigBytes = 1 << 20;
// Applies a TOML file on top of `config` (keys not in the file keep their values). A path that is
// not a regular file (a directory, /dev/zero) or is over kMaxConfigBytes is an error naming it.
void apply_config_file(LoomConfig& config, const std::string& path);
// Applies TOML text (e.g. the resolved config a checkpoint carries); origin names it in errors.
void apply_config_text(LoomConfig& config, const std::string& text, const std::string& origin);
// Applies "a.b=1,c.d=x" (values parsed as TOML; bare words are strings). origin names the source in errors.
void apply_overrides(LoomConfig& config, const std::string& assignments, const std::string& origin = "--set");
// The resolved configuration as TOML text (every key, in schema order).
std::string config_to_toml(const LoomConfig& config);
// Every key the schema knows, "section.key", in order.
std::vector<std::string> config_keys();

// One key of the schema: its type, its default and what it means.
struct ConfigKey {
  std::string key;            // "section.key" ("device": top level)
  std::string type;           // int | uint | float | string | bool | arch | tri-bool
  std::string default_value;  // as TOML text, from a default-constructed LoomConfig (the code's
                              // default; configs/default.toml is applied on top for real runs)
  std::string meaning;        // one line; string keys name their accepted values
};
// Every key's row, in schema order (config_keys()'s).
std::vector<ConfigKey> config_schema();
// "model" for "model.arch", "" for a top-level key.
std::string config_key_section(const std::string& key);
// docs/config.md: one table per section (key, type, default, meaning) from config_schema().
// Regenerate with `build/bin/loom config --markdown > docs/config.md`.
std::string config_markdown();

}  // namespace loom
