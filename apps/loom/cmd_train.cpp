// loom train: the training loop a user runs. Composes the model, the data loaders, the
// trainer, checkpoints, evaluation, the progress line, metrics and the final sample.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "commands.h"
#include "loom/comm/communicator.h"
#ifdef LOOM_HAVE_CUDA
#include "loom/backend/cuda/cuda_backend.h"
#include "loom/comm/nccl_communicator.h"
#endif
#include "loom/comm/device_mesh.h"
#include "loom/parallel/pipeline.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/core/error.h"
#include "loom/core/pages.h"
#include "loom/core/file_io.h"
#include "loom/data/loader.h"
#include "loom/data/shard.h"
#include "loom/infer/generate.h"
#include "loom/train/throughput.h"

namespace loom::cli {

namespace fs = std::filesystem;

namespace {

const char* kHelp =
    "usage: loom train [--config FILE] [--set key=value,...] [--resume] [--stop-at-step N] [--dry-run]\n"
    "\n"
    "Trains the model described by configs/default.toml, then FILE, then the --set overrides\n"
    "(comma-separated or repeated). With no arguments it trains the default small GPT-2 on the\n"
    "default corpus (preparing it first if data/fortunes is missing). Writes runs/<run.name>/:\n"
    "config.toml (resolved), metrics.jsonl, checkpoints/step_N/, samples.txt.\n"
    "--resume continues from the newest valid checkpoint of the run (corrupt ones are skipped with\n"
    "a message), bitwise identical to an uninterrupted run. --dry-run builds the model, data and\n"
    "optimizer, prints the memory by category and the optimizer state per parameter (measured and\n"
    "by formula), and takes no step.\n";

// The one-line status of a step, and its JSON metrics record.
struct StepReport {
  StepStats stats;
  double tokens_per_s = 0.0;
  double mfu = 0.0;
  size_t memory_bytes = 0;
  double eta_seconds = 0.0;
};

void print_progress(const StepReport& r, int64_t total, bool terminal, bool force_line) {
  char line[256];
  std::snprintf(line, sizeof line, "step %lld/%lld | loss %.4f | lr %.2e | %.0f tok/s | MFU %.1f%% | mem %s | ETA %s",
                static_cast<long long>(r.stats.step + 1), static_cast<long long>(total), r.stats.loss, r.stats.lr,
                r.tokens_per_s, 100.0 * r.mfu, format_bytes(r.memory_bytes).c_str(), format_duration(r.eta_seconds).c_str());
  if (terminal) std::printf("\r%-110s%s", line, force_line ? "\n" : "");
  else if (force_line) std::printf("%s\n", line);
  std::fflush(stdout);
}

class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path) : out_(path, std::ios::app) {
    LOOM_CHECK(out_, path, ": cannot open for appending");
  }
  void write(const nlohmann::json& record) {
    out_ << record.dump() << "\n";
    out_.flush();
  }

 private:
  std::ofstream out_;
};

// Bytes per collective this rank sent and received so far (comm/communicator.h's ring volumes).
nlohmann::json ledger_json(const ByteLedger& ledger) {
  nlohmann::json j = nlohmann::json::object();
  for (int c = 0; c < COLL_COUNT; ++c) {
    if (ledger.calls[c] == 0) continue;
    j[collective_name(static_cast<Collective>(c))] = {{"calls", ledger.calls[c]}, {"sent", ledger.sent[c]},
                                                      {"received", ledger.received[c]}};
  }
  return j;
}

// Each MoE layer's routing over the step (nn/moe.h): the expert load histogram, its max
// violation (max / mean - 1), the router entropy, dropped assignments and the auxiliary losses.
nlohmann::json moe_json(const std::vector<MoeLayerStats>& stats) {
  nlohmann::json j = nlohmann::json::array();
  for (const MoeLayerStats& s : stats) {
    j.push_back({{"layer", s.layer}, {"load", s.load}, {"max_violation", s.max_violation}, {"entropy", s.entropy},
                 {"tokens", s.tokens}, {"dropped", s.dropped}, {"aux", s.aux}, {"seq_aux", s.seq_aux}, {"z", s.z}});
  }
  return j;
}

nlohmann::json memory_json(const MemoryTracker& mem) {
  nlohmann::json j;
  for (int c = 0; c < MEM_CATEGORY_COUNT; ++c) {
    const auto cat = static_cast<MemCategory>(c);
    j[std::string(mem_category_name(cat))] = {{"current", mem.current(cat)}, {"peak", mem.peak(cat)}};
  }
  return j;
}

// The validation loss: with context parallelism each rank evaluates its positions of the same
// batches, and the mean over the group is the whole sequences' mean (equal token counts).
double validation_loss(Trainer& trainer, TokenLoader& val, BatchSource& source, int64_t batches, Communicator* cp,
                       Allocator& allocator) {
  val.rewind();
  const double loss = trainer.evaluate(source, batches);
  if (cp == nullptr) return loss;
  Tensor sum = Tensor::zeros(allocator, {1}, DTYPE_F64, MEM_WORKSPACE);
  sum.data<double>()[0] = loss;
  cp->all_reduce(sum);
  return sum.data<double>()[0] / cp->size();
}

}  // namespace

int train_main(int argc, char** argv) {
  const Args args(argc, argv, "train", kHelp,
                  {{"config", "FILE", "a TOML config applied after configs/default.toml"},
                   {"set", "KEY=VALUE,...", "config overrides, applied last (comma-separated; repeatable)"},
                   {"resume", "", "continue from the newest valid checkpoint of the run"},
                   {"stop-at-step", "N", "checkpoint and stop after step N, as an interrupted run would"},
                   {"dry-run", "", "build everything, print the memory and optimizer state, take no step"}},
                  config_keys_help());
  LoomConfig config = load_config(args);
  config.train.optim = config.train.optim.resolved();  // the written config names every default
  const int64_t stop_at = args.get_int("stop-at-step", -1);

  const bool default_data = config.data.input.empty() && config.data.dir == DataConfig{}.dir;
  if (!fs::exists(config.data.dir) && default_data) {
    std::printf("preparing the default corpus into %s (first run)\n", config.data.dir.c_str());
    const std::vector<std::string> documents = default_corpus_documents();
    prepare_dataset(documents, *prepare_tokenizer(config.data.tokenizer, documents, config.data.dir), config.data.dir,
                    config.data.val_fraction);
  }
  TokenDataset data = open_dataset(config.data.dir);
  config.data.tokenizer = data.tokenizer;  // the tokenizer the shards were made with (e.g. DIR/tokenizer for bpe:N)
  if (config.model.vocab_size == 0) config.model.vocab_size = static_cast<int64_t>(data.vocab_size);
  LOOM_CHECK(config.model.vocab_size == static_cast<int64_t>(data.vocab_size), "model.vocab_size (", config.model.vocab_size,
             ") differs from the dataset's vocabulary (", data.vocab_size, ", ", config.data.dir,
             "/meta.json); set model.vocab_size = 0 to follow the data");
  config.validate();

  // Under mpirun: data parallel over every rank. Rank 0 writes the run folder and prints; the
  // other ranks print into <run>/logs/rank<N>.log and keep their metrics beside it.
  const std::unique_ptr<Communicator> comm = launched_by_mpirun() ? make_mpi_communicator() : make_local_communicator();
  const bool lead = comm->rank() == 0;
  const DeviceMesh mesh = training_mesh(comm->size(), static_cast<int>(config.parallel.dp), static_cast<int>(config.parallel.tp),
                                        static_cast<int>(config.parallel.pp), static_cast<int>(config.parallel.cp),
                                        static_cast<int>(config.parallel.ep));
  const std::string dir = run_dir(config);
  fs::create_directories(dir);
  if (!lead) {
    fs::create_directories(fs::path(dir) / "logs");
    const std::string log = (fs::path(dir) / "logs" / ("rank" + std::to_string(comm->rank()) + ".log")).string();
    LOOM_CHECK(std::freopen(log.c_str(), "w", stdout) != nullptr, "rank ", comm->rank(), ": cannot write ", log);
  }
  const std::string config_text = config_to_toml(config);
  if (lead) write_file_atomic((fs::path(dir) / "config.toml").string(), config_text);

  // Tensor parallel (parallel.tp > 1): each rank trains its slice of the model inside its tp
  // group, data parallel across groups. Every rank also keeps the whole model: its init is
  // sliced (identical to a one-process run), checkpoints are staged in it (the same files a
  // one-process run writes), and it samples at the end.
  const int tp_size = mesh.size("tp"), cp_size = mesh.size("cp"), pp_size = mesh.size("pp");
  // Context parallel (parallel.cp > 1): each rank holds 1/cp of every sequence; the gradients
  // are averaged over dp x cp, the tokens counted over dp.
  std::unique_ptr<Communicator> tp_comm, dp_comm, cp_comm, reduce_comm, pp_comm, ep_comm, owners_comm;
  const int ep_size = static_cast<int>(config.parallel.ep);
  Communicator* dp = comm.get();
  Communicator* reduce = comm.get();
  if (tp_size > 1) tp_comm = mesh_group(*comm, mesh, "tp");
  if (tp_size > 1 || cp_size > 1 || pp_size > 1) {
    dp_comm = mesh_group(*comm, mesh, data_parallel_dims(mesh));
    dp = reduce = dp_comm.get();
  }
  if (ep_size > 1) ep_comm = mesh_group(*comm, mesh, "ep");  // experts split over these dp ranks
  if (pp_size > 1) pp_comm = mesh_group(*comm, mesh, "pp");  // each rank runs and updates its stages (parallel/pipeline.h)
  if (cp_size > 1) {
    LOOM_CHECK(config.parallel.cp_attention == "ring" || config.parallel.cp_attention == "ulysses",
               "parallel.cp_attention must be ring or ulysses, got '", config.parallel.cp_attention, "'");
    cp_comm = mesh_group(*comm, mesh, "cp");
    std::vector<std::string> dims = data_parallel_dims(mesh);
    dims.push_back("cp");
    reduce_comm = mesh_group(*comm, mesh, dims);
    reduce = reduce_comm.get();
  }
  // The backend (`device`). A GPU runs data parallelism (DDP, ZeRO) so far: its gradients go
  // over NCCL, host values (losses, norms) over MPI.
  auto backend = make_backend(config.device);
  LOOM_CHECK(config.device == "cpu" || (tp_size == 1 && pp_size == 1 && cp_size == 1 && ep_size == 1), "device = \"",
             config.device, "\" runs data parallelism only so far: parallel.tp, pp, cp and ep must be 1");
  std::unique_ptr<Communicator> device_comm;
#ifdef LOOM_HAVE_CUDA
  if (config.device == "cuda" && comm->size() > 1) {
    device_comm = make_routing_communicator(comm->split(0, comm->rank()),
                                            make_nccl_communicator(*comm, cuda_device(*backend), cuda_stream(*backend)));
    dp = reduce = device_comm.get();
  }
#endif
  const ModelConfig local_config = tp_size > 1 ? tp_local_config(config.model, tp_size) : config.model;
  Transformer model(*backend, local_config);
  std::unique_ptr<Transformer> whole;
  if (tp_size > 1) {
    whole = std::make_unique<Transformer>(*backend, config.model);
    whole->init_weights(config.loop.seed);
    tp_copy(config.model, whole->params(), local_config, model.params(), tp_comm->rank(), tp_size, true);
    const VocabRange vocab = tp_vocab_range(config.model, tp_comm->rank(), tp_size);
    model.set_tensor_parallel(tp_comm.get(), vocab.begin, vocab.valid, config.parallel.sequence_parallel);
  } else {
    model.init_weights(config.loop.seed);
  }
  if (cp_size > 1) model.set_context_parallel(cp_comm.get(), config.parallel.cp_attention == "ulysses");
  if (ep_size > 1) model.set_expert_parallel(ep_comm.get());
  // Pipeline stages and expert-parallel ranks each update their own part of the flat buffers:
  // their owners group (pp x ep) puts the parts together for checkpoints and sampling.
  if (pp_size > 1 || ep_size > 1) {
    std::vector<std::string> dims;
    if (pp_size > 1) dims.push_back("pp");
    if (ep_size > 1) dims.push_back("ep");
    owners_comm = mesh_group(*comm, mesh, dims);
  }
  // Slice -> whole (on every rank of the group, summed) and whole -> slice.
  auto to_whole = [&](const Tensor& local, const Tensor& whole_buffer) {
    whole_buffer.zero_();
    tp_copy(config.model, whole_buffer, local_config, local, tp_comm->rank(), tp_size, false, tp_comm->rank() == 0);
    tp_comm->all_reduce(whole_buffer);
  };
  auto to_local = [&](const Tensor& whole_buffer, const Tensor& local) {
    tp_copy(config.model, whole_buffer, local_config, local, tp_comm->rank(), tp_size, true);
  };
  DdpConfig ddp;
  ddp.bucket_bytes = static_cast<int64_t>(config.parallel.bucket_mb * (1 << 20));
  ddp.overlap = config.parallel.overlap;
  ddp.zero_stage = config.parallel.zero_stage;
  ddp.compression = config.parallel.compression;
  ddp.topk_ratio = config.parallel.topk_ratio;
  ddp.qsgd_levels = static_cast<int>(config.parallel.qsgd_levels);
  ddp.powersgd_rank = static_cast<int>(config.parallel.powersgd_rank);
  ddp.dgc.momentum = config.parallel.dgc_momentum;
  ddp.dgc.clip_norm = config.parallel.dgc_clip;
  ddp.dgc.warmup_steps = config.parallel.dgc_warmup_steps;
  std::unique_ptr<PipelineRunner> pipeline;
  if (pp_size > 1) {
    pipeline = std::make_unique<PipelineRunner>(
        model, *pp_comm,
        make_pipe_schedule(config.parallel.schedule, pp_size, static_cast<int>(config.train.grad_accum),
                           static_cast<int>(config.parallel.virtual_stages)),
        config.train.batch_size, config.train.seq_len);
  }
  Trainer trainer(*backend, model, config.train, reduce, ddp, pipeline.get());
  // Pipeline and expert parallel: every rank updates its domain (its stages, less the experts
  // other ep ranks compute). Each element is counted by one rank of the owners group: a stage's
  // own elements (a tied embedding once, by the first stage), the shared (non-expert) ones by ep
  // rank 0, each expert by its ep rank. Whole parameters and optimizer state are the sums over
  // the group of what each rank counts.
  const bool partial = pp_size > 1 || ep_size > 1;
  std::vector<std::pair<int64_t, int64_t>> counted;  // flat ranges this rank contributes
  if (partial) {
    const std::vector<std::pair<int64_t, int64_t>> base =
        pipeline ? pipeline->norm_ranges() : std::vector<std::pair<int64_t, int64_t>>{{0, model.layout().total}};
    // ep rank 0 counts its whole domain (the shared weights and its experts), the others their experts.
    std::vector<std::pair<int64_t, int64_t>> mine;
    if (ep_size > 1 && ep_comm->rank() != 0) {
      mine = model.own_expert_ranges();
    } else {
      for (const FlatRange& r : trainer.domain()) mine.emplace_back(r.begin, r.end);
    }
    for (const auto& [b, e] : base) {
      for (const auto& [mb, me] : mine) {
        const int64_t lo = std::max(b, mb), hi = std::min(e, me);
        if (lo < hi) counted.emplace_back(lo, hi);
      }
    }
  }
  auto owners_whole_params = [&]() {
    const Tensor& g = model.params();
    int64_t at = 0;
    for (const auto& [b, e] : counted) {
      if (b > at) g.view(at, {b - at}).zero_();
      at = e;
    }
    if (at < g.numel()) g.view(at, {g.numel() - at}).zero_();
    owners_comm->all_reduce(g);
  };
  auto owners_state_whole = [&](const Tensor& owned, const Tensor& full) {
    full.zero_();
    int64_t cursor = 0;
    for (const FlatRange& r : trainer.domain()) {
      for (const auto& [nb, ne] : counted) {  // each element once
        const int64_t lo = std::max(r.begin, nb), hi = std::min(r.end, ne);
        if (lo < hi) backend->copy(owned.view(cursor + lo - r.begin, {hi - lo}), full.view(lo, {hi - lo}));
      }
      cursor += r.end - r.begin;
    }
    owners_comm->all_reduce(full);
  };
  auto owners_state_owned = [&](const Tensor& full, const Tensor& owned) {
    int64_t cursor = 0;
    for (const FlatRange& r : trainer.domain()) {
      backend->copy(full.view(r.begin, {r.end - r.begin}), owned.view(cursor, {r.end - r.begin}));
      cursor += r.end - r.begin;
    }
  };
  TokenLoader train_data(std::move(data.train), config.train.seq_len, config.loop.seed);
  // Each rank trains on its rows of the global batch the loader draws (all ranks draw the same).
  RankSliceSource rank_data(train_data, backend->allocator(), dp->rank(), dp->size(), config.train.batch_size,
                            config.train.seq_len);
  TokenLoader val_data(std::move(data.val), config.train.seq_len, config.loop.seed, LOADER_ORDER_SEQUENTIAL);
  std::unique_ptr<ContextSliceSource> cp_train, cp_val;  // context parallel: this rank's positions
  if (cp_size > 1) {
    cp_train = std::make_unique<ContextSliceSource>(rank_data, backend->allocator(), cp_comm->rank(), cp_size,
                                                    config.train.batch_size, config.train.seq_len);
    cp_val = std::make_unique<ContextSliceSource>(val_data, backend->allocator(), cp_comm->rank(), cp_size,
                                                  config.train.batch_size, config.train.seq_len);
  }
  BatchSource& train_source = cp_train ? static_cast<BatchSource&>(*cp_train) : rank_data;
  BatchSource& val_source = cp_val ? static_cast<BatchSource&>(*cp_val) : val_data;

  CheckpointOptions ckpt_options;
  ckpt_options.keep_last = static_cast<int>(config.loop.keep_checkpoints);
  ckpt_options.backend = backend.get();  // a GPU's tensors are saved and loaded through host copies
  CheckpointManager checkpoints((fs::path(dir) / "checkpoints").string(), ckpt_options);
  const ModelState model_state{config.model, whole ? whole->params() : model.params()};
  OptimizerState optimizer_state{trainer.optimizer().name(), trainer.optimizer().state()};
  // The optimizer state is staged into the one-process layout through each dimension that cuts
  // it, innermost first: ZeRO's shard -> its domain (gathered over the ZeRO group), a pipeline
  // rank's stages -> the flat buffer (summed over pp), a tensor slice -> the whole model.
  ZeroSharding* zero = trainer.zero();
  const bool staged = partial || whole;  // the checkpoint is written whole (else ZeRO writes it sharded)
  std::vector<std::pair<Tensor, Tensor>> zero_state;  // ZeRO under tp/pp: (this rank's shard, its domain)
  if (zero != nullptr && staged) {
    for (auto& [name, shard] : optimizer_state.tensors) {
      LOOM_CHECK(shard.numel() == zero->range().end - zero->range().begin, "ZeRO: optimizer state ", name, " of ",
                 shard.numel(), " elements is not a shard of the parameters");
      Tensor domain = Tensor::zeros(backend->allocator(), {zero->domain_size()}, DTYPE_F32, MEM_WORKSPACE);
      zero_state.emplace_back(shard, domain);
      shard = domain;
    }
  }
  auto zero_state_whole = [&](const Tensor& shard, const Tensor& domain) {
    backend->copy(shard, domain.view(zero->range().begin, {shard.numel()}));
    reduce->all_gather_v_async(domain, shard_counts(0, domain.numel(), domain.numel(), reduce->size()))->wait();
  };
  std::vector<std::pair<Tensor, Tensor>> pp_state;  // pipeline / expert parallel: (this rank's domain's state, flat)
  if (partial) {
    for (auto& [name, owned] : optimizer_state.tensors) {
      Tensor full = Tensor::zeros(backend->allocator(), {model.layout().total}, DTYPE_F32, MEM_WORKSPACE);
      pp_state.emplace_back(owned, full);
      owned = full;
    }
  }
  std::vector<std::pair<Tensor, Tensor>> tp_state;  // tensor parallel: (this slice's state, whole)
  if (whole) {
    for (auto& [name, local] : optimizer_state.tensors) {
      Tensor w = Tensor::zeros(backend->allocator(), {whole->layout().total}, DTYPE_F32, MEM_WORKSPACE);
      tp_state.emplace_back(local, w);
      local = w;
    }
  }
  // ZeRO alone: each rank holds a shard of the flat state and writes it to its own file of a
  // sharded checkpoint (checkpoint/checkpoint.h); any number of ranks can resume it.
  if (zero != nullptr && !staged) {
    optimizer_state.flat_begin = zero->range().begin;
    for (const auto& [name, shard] : optimizer_state.tensors) {
      LOOM_CHECK(shard.numel() == zero->range().end - zero->range().begin, "ZeRO: optimizer state ", name, " of ",
                 shard.numel(), " elements is not a shard of the parameters");
    }
  }
  const std::vector<std::pair<std::string, Tensor>> flat_state = optimizer_state.tensors;
  // FP8 delayed scaling's amax histories resume with the optimizer (a bitwise-identical resume).
  const Tensor& fp8 = model.pack_scaling_state();
  if (fp8.defined()) optimizer_state.tensors.emplace_back("fp8_amax_history", fp8);
  auto contents = [&] {
    model.pack_scaling_state();
    CheckpointContents c;
    c.step = trainer.step();
    c.model = model_state;
    c.optimizer = optimizer_state;
    c.optimizer_steps = trainer.optimizer().steps_taken();
    c.data_state = train_data.state();
    c.config_text = config_text;
    if (const DynamicLossScaler* ls = trainer.loss_scaler()) {
      c.extra["loss_scaler"] = {{"scale", ls->state().scale}, {"growth_tracker", ls->state().growth_tracker},
                                {"hysteresis_tracker", ls->state().hysteresis_tracker}};
    }
    return c;
  };
  auto save = [&]() -> std::string {
    if (zero == nullptr || staged) {
      if (zero != nullptr && zero->stage() == 3) trainer.gather_params();  // under tp: the slice whole on each dp rank
      for (auto& [shard, domain] : zero_state) zero_state_whole(shard, domain);
      if (partial) {  // every rank of every owners group takes part
        owners_whole_params();
        for (auto& [owned, full] : pp_state) owners_state_whole(owned, full);
      }
      if (whole) {  // every rank of every tp group takes part in staging the whole state
        to_whole(model.params(), whole->params());
        for (auto& [local, w] : tp_state) to_whole(local, w);
      }
      std::string path = lead ? checkpoints.save(contents()) : "(written by rank 0)";  // dp ranks hold identical state
      trainer.params_loaded();  // ZeRO-3: back to this rank's shard
      return path;
    }
    const CheckpointContents c = contents();
    ShardContents shard;
    shard.rank = comm->rank(), shard.world = comm->size();
    shard.begin = zero->range().begin, shard.end = zero->range().end;
    shard.config = config.model;
    shard.params = model.params().view(shard.begin, {shard.end - shard.begin});
    shard.optimizer = c.optimizer.name;
    shard.optimizer_steps = c.optimizer_steps;
    shard.flat = flat_state;
    if (fp8.defined()) shard.whole.emplace_back("fp8_amax_history", fp8);
    if (lead) checkpoints.begin_sharded(c.step);
    comm->barrier();
    checkpoints.write_shard(c.step, shard);
    comm->barrier();
    std::string path = lead ? checkpoints.commit_sharded(c, comm->size()) : "(committed by rank 0)";
    comm->barrier();
    return path;
  };
  if (args.has("resume")) {
    const auto loaded = checkpoints.load_latest(model_state, optimizer_state, [](const std::string& line) {
      std::fprintf(stderr, "loom train: %s\n", line.c_str());
    });
    if (loaded) {
      trainer.restore(loaded->step, loaded->optimizer_steps);
      if (whole) {
        to_local(whole->params(), model.params());
        for (auto& [local, w] : tp_state) to_local(w, local);
      }
      for (auto& [owned, full] : pp_state) owners_state_owned(full, owned);
      for (auto& [shard, domain] : zero_state) backend->copy(domain.view(zero->range().begin, {shard.numel()}), shard);
      trainer.params_loaded();
      model.unpack_scaling_state();
      train_data.restore(loaded->data_state.get<LoaderState>());
      if (DynamicLossScaler* ls = trainer.loss_scaler(); ls != nullptr && loaded->extra.contains("loss_scaler")) {
        const nlohmann::json& j = loaded->extra["loss_scaler"];
        ls->restore({j.at("scale").get<float>(), j.at("growth_tracker").get<int64_t>(), j.at("hysteresis_tracker").get<int64_t>()});
      }
      std::printf("resumed from %s (step %lld)\n", loaded->path.c_str(), static_cast<long long>(loaded->step));
    } else {
      std::printf("no checkpoint in %s/checkpoints; starting from scratch\n", dir.c_str());
    }
  }

  const MemoryTracker& mem = backend->allocator().tracker();
  const int64_t n_params = param_count(config.model);
  const int64_t state_bytes = trainer.optimizer().state_bytes();
  const double state_per_param = static_cast<double>(state_bytes) / static_cast<double>(n_params);
  if (args.has("dry-run")) {
    const int64_t formula = optimizer_state_bytes(trainer.optim_params(), config.train.optim);
    int64_t decayed = 0;
    for (const OptimParam& q : trainer.optim_params()) decayed += q.weight_decay > 0.0f ? q.numel : 0;
    std::printf("dry run %s: %s, %lld parameters (%lld with weight decay %g), optimizer %s, schedule %s\n", dir.c_str(),
                std::string(arch_name(config.model.arch)).c_str(), static_cast<long long>(n_params),
                static_cast<long long>(decayed), config.train.optim.weight_decay, trainer.optimizer().name().c_str(),
                config.train.schedule.kind.c_str());
    std::printf("optimizer state: %lld bytes = %.3f bytes/parameter (formula: %lld bytes, %.3f bytes/parameter)\n",
                static_cast<long long>(state_bytes), state_per_param, static_cast<long long>(formula),
                static_cast<double>(formula) / static_cast<double>(n_params));
    for (int c = 0; c < MEM_CATEGORY_COUNT; ++c) {
      const auto cat = static_cast<MemCategory>(c);
      std::printf("  %-18s %s\n", std::string(mem_category_name(cat)).c_str(), format_bytes(mem.current(cat)).c_str());
    }
    std::printf("  %-18s %s\n", "total", format_bytes(mem.current_total()).c_str());
    return 0;
  }

  const double peak_gflops = measure_gemm_peak_gflops(*backend);
  const double flops_per_token = train_flops_per_token(config.model, config.train.seq_len);
  std::printf("run %s: %s, %lld parameters, %.1f MFLOP/token; GEMM peak %.0f GFLOP/s (measured, fp32)\n", dir.c_str(),
              std::string(arch_name(config.model.arch)).c_str(), static_cast<long long>(n_params), flops_per_token / 1e6,
              peak_gflops);
  std::printf("optimizer %s: state %s (%.2f bytes/parameter); schedule %s, lr %.2e\n", trainer.optimizer().name().c_str(),
              format_bytes(static_cast<size_t>(state_bytes)).c_str(), state_per_param, config.train.schedule.kind.c_str(),
              config.train.schedule.max_lr);
  std::printf("precision: %s%s\n", model.precision().describe().c_str(), config.train.loss_scaling ? ", dynamic loss scaling" : "");
  if (config.train.recompute != "none") {  // activation checkpointing (memory/recompute.h)
    const Trainer::RecomputeReport& rc = trainer.recompute();
    std::string plan;
    for (RecomputePolicy p : rc.plan) plan += std::string(plan.empty() ? "" : " ") + std::string(recompute_name(p));
    std::printf("recompute %s: blocks %s; kept activations %s of %s per micro-batch%s\n", config.train.recompute.c_str(),
                plan.c_str(), format_bytes(static_cast<size_t>(rc.kept_bytes)).c_str(),
                format_bytes(static_cast<size_t>(rc.no_recompute_bytes)).c_str(),
                rc.seconds > 0 ? str_cat(", measured recompute ", rc.seconds * 1e3, " ms per micro-batch").c_str() : "");
  }
  MetricsLog metrics(lead ? (fs::path(dir) / "metrics.jsonl").string()
                          : (fs::path(dir) / "logs" / ("metrics.rank" + std::to_string(comm->rank()) + ".jsonl")).string());
  if (comm->size() > 1) {
    std::printf("mesh %s; data parallel: %d ranks (MPI), %lld sequences per rank per micro-batch, global batch %lld x %lld tokens\n",
                mesh.describe().c_str(), dp->size(), static_cast<long long>(config.train.batch_size),
                static_cast<long long>(config.train.batch_size * config.train.grad_accum * dp->size()),
                static_cast<long long>(config.train.seq_len));
  }
  if (zero != nullptr) {
    std::printf("ZeRO-%d over %d ranks: this rank keeps the optimizer state of %lld of the %lld parameters it %s\n",
                zero->stage(), reduce->size(), static_cast<long long>(zero->range().end - zero->range().begin),
                static_cast<long long>(zero->domain_size()), pipeline ? "updates (its pipeline stages)" : "holds");
  }
  metrics.write({{"optimizer", trainer.optimizer().name()}, {"parameters", n_params}, {"optimizer_state_bytes", state_bytes},
                 {"state_bytes_per_param", state_per_param}, {"schedule", config.train.schedule.kind},
                 {"precision", model.precision().describe()}, {"loss_scaling", config.train.loss_scaling}});
  const bool terminal = stdout_is_terminal();
  double seconds_sum = 0.0;
  int64_t steps_timed = 0;
  double last_val = NAN;
  int64_t last_resident_params = 0, last_resident_grads = 0;

  while (trainer.step() < config.train.steps) {
    const StepStats stats = trainer.train_step(train_source);
    last_resident_params = resident_bytes(model.params());
    last_resident_grads = resident_bytes(model.grads());
    seconds_sum += stats.seconds;
    ++steps_timed;
    StepReport r{stats};
    r.tokens_per_s = static_cast<double>(stats.tokens * dp->size()) / stats.seconds;  // all data-parallel ranks
    r.mfu = r.tokens_per_s * flops_per_token / (peak_gflops * 1e9 * comm->size());    // peak measured per rank
    r.memory_bytes = mem.current_total();
    r.eta_seconds = seconds_sum / static_cast<double>(steps_timed) * static_cast<double>(config.train.steps - trainer.step());
    metrics.write({{"step", stats.step + 1}, {"loss", stats.loss}, {"lr", stats.lr}, {"grad_norm", stats.grad_norm},
                   {"tokens", stats.tokens}, {"seconds", stats.seconds}, {"loss_scale", stats.loss_scale}, {"skipped", stats.skipped}, {"tokens_per_s", r.tokens_per_s}, {"mfu", r.mfu},
                   {"memory_bytes", r.memory_bytes}, {"ranks", comm->size()},
                   {"comm_bytes_sent", comm->ledger().total_sent()}, {"comm_bytes_received", comm->ledger().total_received()},
                   {"comm", ledger_json(comm->ledger())},
                   // Measured residency (core/pages.h): under ZeRO-2/3 less than the buffers' size.
                   {"resident_bytes", {{"parameters", last_resident_params}, {"gradients", last_resident_grads}}},
                   {"moe", moe_json(model.moe_stats())}});
    const int64_t done = trainer.step();
    const bool eval_now = config.loop.eval_every > 0 && done % config.loop.eval_every == 0;
    print_progress(r, config.train.steps, terminal, eval_now || done % config.loop.log_every == 0 || done == config.train.steps);
    if (eval_now || done == config.train.steps) {
      last_val = validation_loss(trainer, val_data, val_source, config.loop.eval_batches, cp_comm.get(), backend->allocator());
      metrics.write({{"step", done}, {"val_loss", last_val}, {"memory", memory_json(mem)}});
      std::printf("step %lld: validation loss %.4f (perplexity %.1f)\n", static_cast<long long>(done), last_val, std::exp(last_val));
    }
    if ((config.loop.checkpoint_every > 0 && done % config.loop.checkpoint_every == 0) || done == stop_at ||
        done == config.train.steps) {
      const std::string path = save();
      if (done == stop_at && done < config.train.steps) {
        std::printf("stopped after step %lld (--stop-at-step); checkpoint %s; continue with --resume\n",
                    static_cast<long long>(done), path.c_str());
        return 0;
      }
    }
  }

  trainer.gather_params();  // ZeRO-3: the whole model on every rank, to sample
  if (partial) owners_whole_params();  // pipeline / expert parallel: every stage's and expert's parameters
  if (ep_size > 1) model.set_expert_parallel(nullptr);  // sampling computes every expert locally
  if (whole) to_whole(model.params(), whole->params());  // tensor parallel: the slices put together
  const auto tokenizer = load_tokenizer(config.data.tokenizer);
  std::vector<int32_t> prompt = tokenizer->encode(config.sample.prompt);
  if (prompt.empty()) prompt.push_back(tokenizer->eot_token());
  GenerateOptions options;
  options.max_new_tokens = config.sample.max_new_tokens;
  options.stop_token = tokenizer->eot_token();
  std::unique_ptr<Backend> host_backend;  // a GPU run samples on the CPU (the KV cache is host code)
  std::unique_ptr<Transformer> host_model;
  if (!model.params().host_accessible()) {
    host_backend = make_cpu_backend();
    host_model = std::make_unique<Transformer>(*host_backend, config.model);
    backend->read(model.params(), host_model->params().raw_data());
  }
  std::vector<int32_t> sample =
      generate(host_model ? *host_model : whole ? *whole : model, prompt, config.sample.sampling, options);
  if (!sample.empty() && sample.back() == tokenizer->eot_token()) sample.pop_back();
  const std::string text = printable_utf8(config.sample.prompt + tokenizer->decode(sample));
  if (lead) write_file_atomic((fs::path(dir) / "samples.txt").string(), text + "\n");
  std::printf("\nsample (temperature %.2f, top-k %lld, top-p %.2f):\n%s\n\n", config.sample.sampling.temperature,
              static_cast<long long>(config.sample.sampling.top_k), config.sample.sampling.top_p, text.c_str());
  std::printf("done: %lld steps, final validation loss %.4f; peak memory %s (parameters %s, gradients %s, optimizer %s, "
              "activations %s%s)\n",
              static_cast<long long>(trainer.step()), last_val, format_bytes(mem.peak_total()).c_str(),
              format_bytes(mem.peak(MEM_PARAMETERS)).c_str(), format_bytes(mem.peak(MEM_GRADIENTS)).c_str(),
              format_bytes(mem.peak(MEM_OPTIMIZER_STATE)).c_str(), format_bytes(mem.peak(MEM_ACTIVATIONS)).c_str(),
              mem.peak(MEM_OFFLOADED) > 0 ? (", offloaded optimizer state " + format_bytes(mem.peak(MEM_OFFLOADED))).c_str() : "");
  for (const MoeLayerStats& st : model.moe_stats()) {  // the last step's routing
    std::printf("MoE layer %lld, last step: max violation %.3f, router entropy %.3f nats, %lld of %lld assignments dropped, "
                "aux %.3g, seq aux %.3g, z %.3g\n", static_cast<long long>(st.layer), st.max_violation, st.entropy,
                static_cast<long long>(st.dropped), static_cast<long long>(st.tokens * config.model.moe_top_k), st.aux,
                st.seq_aux, st.z);
  }
  if (zero != nullptr) {
    std::printf("ZeRO-%d: this rank owns %lld of %lld parameters; resident after the last step: parameters %s, "
                "gradients %s (the buffers above are address space; the rest was returned to the OS)\n",
                zero->stage(), static_cast<long long>(zero->range().end - zero->range().begin),
                static_cast<long long>(model.layout().total), format_bytes(static_cast<size_t>(last_resident_params)).c_str(),
                format_bytes(static_cast<size_t>(last_resident_grads)).c_str());
  }
  return 0;
}

}  // namespace loom::cli
