#include "loom/train/state_gather.h"

#include <cstring>
#include <filesystem>

#include "loom/core/error.h"
#include "loom/data/tokenizer_files.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/parallel/zero.h"

namespace loom {

namespace {

// A view of each tensor of `state` replaced by a new zeroed f32 buffer of `numel` elements:
// returns (the rank's tensor, the buffer the checkpoint sees).
std::vector<std::pair<Tensor, Tensor>> stage_through(OptimizerState& state, Allocator& allocator, int64_t numel) {
  std::vector<std::pair<Tensor, Tensor>> out;
  for (auto& [name, t] : state.tensors) {
    Tensor staged = Tensor::zeros(allocator, {numel}, DTYPE_F32, MEM_WORKSPACE);
    out.emplace_back(t, staged);
    t = staged;
  }
  return out;
}

}  // namespace

TrainingState::TrainingState(Backend& backend, const LoomConfig& config, const ParallelLayout& layout,
                             TrainingModel& parts, const std::string& dir, std::string config_text)
    : backend_(backend),
      config_(config),
      layout_(layout),
      parts_(parts),
      config_text_(std::move(config_text)),
      checkpoints_(dir, [&] {
        CheckpointOptions o;
        o.keep_last = static_cast<int>(config.loop.keep_checkpoints);
        o.backend = &backend;  // a GPU's tensors are saved and loaded through host copies
        return o;
      }()) {
  Transformer& model = *parts_.model;
  Trainer& trainer = *parts_.trainer;
  zero_ = trainer.zero();
  partial_ = layout_.owners_group() != nullptr;
  // A frozen base (LoRA): the optimizer state is the adapters' (one process's form), not a shard of
  // the flat buffer, so ZeRO's shards are put together too instead of written as flat shards.
  staged_ = partial_ || parts_.whole != nullptr || !model.frozen_ranges().empty();
  // Pipeline and expert parallel: every element is counted by one rank of the owners group: a
  // stage's own elements (a tied embedding once, by the first stage), the shared (non-expert)
  // ones by ep rank 0, each expert by its ep rank.
  if (partial_) {
    const RangeSet base = parts_.pipeline ? parts_.pipeline->norm_ranges() : RangeSet::span(0, model.layout().total);
    const Communicator* ep = layout_.group(Axis::ep);
    // (A frozen base, LoRA's, is outside the trainer's domain but its stage's parameters count.)
    const RangeSet mine = ep != nullptr && ep->rank() != 0 ? model.own_expert_ranges()
                                                          : trainer.domain().unite(model.frozen_ranges());
    counted_ = base.intersect(mine);
  }
  model_state_ = ModelState{config.model, parts_.whole ? parts_.whole->params() : model.params()};
  const FrozenBase& base = model.frozen_base();
  if (base.params() > 0 && model.params().host_accessible() && !parts_.whole) {
    // QLoRA: a save dequantizes one block matrix at a time into the buffer and releases it after
    // writing; a load skips them (the NF4 base is the initial weights', quantized again).
    model_state_.pages = ParamPages{[&base](int64_t offset) { return base.covers(offset); },
                                    [&base](int64_t offset) { base.materialize(offset); },
                                    [&base](int64_t offset) { base.release(offset); }};
  }
  optimizer_state_ = OptimizerState{trainer.optimizer().name(), trainer.optimizer().state()};
  Allocator& allocator = backend_.allocator();
  if (zero_ != nullptr) {
    for (const auto& [name, shard] : optimizer_state_.tensors) {
      LOOM_CHECK(shard.numel() == zero_->state_counts()[static_cast<size_t>(layout_.reduce_group().rank())],
                 "ZeRO: optimizer state ", name, " of ", shard.numel(), " elements is not a shard of the parameters");
    }
  }
  if (zero_ != nullptr && staged_) zero_state_ = stage_through(optimizer_state_, allocator, zero_->state_size());
  if (partial_) pp_state_ = stage_through(optimizer_state_, allocator, model.layout().total);
  if (parts_.whole) tp_state_ = stage_through(optimizer_state_, allocator, parts_.whole->layout().total);
  // ZeRO alone: each rank holds a shard of the flat state and writes it to its own file of a
  // sharded checkpoint; any number of ranks can resume it.
  if (zero_ != nullptr && !staged_) optimizer_state_.flat_begin = zero_->range().begin;
  flat_state_ = optimizer_state_.tensors;
  // A frozen base (LoRA): one process's optimizer state covers the adapters only, [frozen_end,
  // P) of the whole layout; a pipeline's or tensor-parallel slices' flat staging buffers are
  // saved and loaded as that view, so the checkpoint resumes on any layout.
  if (config.model.lora() && (partial_ || parts_.whole != nullptr)) {
    const ParamLayout whole = build_param_layout(config.model);
    const int64_t frozen = lora_begin(config.model, whole);
    for (auto& [name, t] : optimizer_state_.tensors) {
      if (t.numel() == whole.total) t = t.view(frozen, {whole.total - frozen});
    }
  }
  fp8_ = model.pack_scaling_state();
  if (fp8_.defined()) optimizer_state_.tensors.emplace_back("fp8_amax_history", fp8_);
}

// ---- The owners group (pp x ep): parts of one flat buffer, summed --------------------------

void TrainingState::owners_whole_params() {
  const Tensor& g = parts_.model->params();
  for (const Range& r : RangeSet::span(0, g.numel()).subtract(counted_)) g.view(r.begin, {r.size()}).zero_();
  layout_.owners_group()->all_reduce(g);
}

void TrainingState::owners_state_whole(const Tensor& owned, const Tensor& full) {
  full.zero_();
  int64_t cursor = 0;
  for (const Range& r : parts_.trainer->domain()) {
    for (const Range& piece : RangeSet{r}.intersect(counted_)) {  // each element once
      backend_.copy(owned.view(cursor + piece.begin - r.begin, {piece.size()}), full.view(piece.begin, {piece.size()}));
    }
    cursor += r.size();
  }
  layout_.owners_group()->all_reduce(full);
}

void TrainingState::owners_state_owned(const Tensor& full, const Tensor& owned) {
  int64_t cursor = 0;
  for (const Range& r : parts_.trainer->domain()) {
    backend_.copy(full.view(r.begin, {r.size()}), owned.view(cursor, {r.size()}));
    cursor += r.size();
  }
}

// ---- The tp group: slices of the whole model ------------------------------------------------

void TrainingState::tp_whole(const Tensor& local, const Tensor& whole) {
  Communicator& tp = *layout_.group(Axis::tp);
  whole.zero_();
  tp_copy(backend_, config_.model, whole, parts_.local_config, local, tp.rank(), tp.size(), false, tp.rank() == 0);
  tp.all_reduce(whole);
}

// A slice's optimizer state: flat (the slice's layout), or with a frozen base the adapters only,
// [frozen_end, P) of the slice's layout, put in a flat buffer to be copied as the parameters are.
void TrainingState::tp_state_whole(const Tensor& local, const Tensor& whole) {
  const int64_t total = parts_.model->layout().total;
  if (local.numel() == total) return tp_whole(local, whole);
  const int64_t frozen = total - local.numel();
  Tensor flat = Tensor::zeros(backend_.allocator(), {total}, DTYPE_F32, MEM_WORKSPACE);
  backend_.copy(local, flat.view(frozen, {local.numel()}));
  tp_whole(flat, whole);
}

void TrainingState::tp_state_local(const Tensor& whole, const Tensor& local) {
  const int64_t total = parts_.model->layout().total;
  if (local.numel() == total) return tp_local(whole, local);
  Tensor flat = Tensor::zeros(backend_.allocator(), {total}, DTYPE_F32, MEM_WORKSPACE);
  tp_local(whole, flat);
  backend_.copy(flat.view(total - local.numel(), {local.numel()}), local);
}

void TrainingState::tp_local(const Tensor& whole, const Tensor& local) {
  const Communicator& tp = *layout_.group(Axis::tp);
  tp_copy(backend_, config_.model, whole, parts_.local_config, local, tp.rank(), tp.size(), true);
}

// ---- Save and resume -------------------------------------------------------------------------

CheckpointContents TrainingState::contents() {
  parts_.model->pack_scaling_state();
  CheckpointContents c;
  c.step = parts_.trainer->step();
  c.model = model_state_;
  c.optimizer = optimizer_state_;
  c.optimizer_steps = parts_.trainer->optimizer().steps_taken();
  c.data_state = data_state_;
  c.config_text = config_text_;
  c.attached = tokenizer_attachments(config_.data.tokenizer);  // self-contained: the tokenizer goes along
  if (const DynamicLossScaler* ls = parts_.trainer->loss_scaler()) {
    c.extra["loss_scaler"] = {{"scale", ls->state().scale}, {"growth_tracker", ls->state().growth_tracker},
                              {"hysteresis_tracker", ls->state().hysteresis_tracker}};
  }
  return c;
}

std::string TrainingState::save(const nlohmann::json& data_state, bool async) {
  wait_for_save();  // one in flight at most, and durable before the next begins
  data_state_ = data_state;
  if (zero_ != nullptr && !staged_) return save_sharded(data_state);
  Trainer& trainer = *parts_.trainer;
  if (zero_ != nullptr && zero_->stage() == 3) trainer.gather_params();  // under tp: the slice whole on each dp rank
  for (auto& [shard, domain] : zero_state_) {
    backend_.copy(shard, domain.view(zero_->state_offset(), {shard.numel()}));
    layout_.reduce_group().all_gather_v_async(domain, zero_->state_counts())->wait();
  }
  if (partial_) {  // every rank of every owners group takes part
    owners_whole_params();
    for (auto& [owned, full] : pp_state_) owners_state_whole(owned, full);
  }
  if (parts_.whole) {  // every rank of every tp group takes part in staging the whole state
    tp_whole(parts_.model->params(), parts_.whole->params());
    for (auto& [local, w] : tp_state_) tp_state_whole(local, w);
  }
  const bool lead = layout_.world().rank() == 0;
  std::string path = "(written by rank 0)";  // dp ranks hold identical state
  if (lead && async && !model_state_.pages) {  // (QLoRA's paged base: a snapshot would hold it whole)
    CheckpointContents c = contents();
    // The snapshot: host copies of every tensor the checkpoint reads, allocated by the first save.
    std::vector<Tensor*> live = {&c.model.params};
    for (auto& [name, t] : c.optimizer.tensors) live.push_back(&t);
    if (snapshot_.empty()) {
      for (Tensor* t : live) snapshot_.push_back(Tensor::empty(snapshot_host_, t->shape(), t->dtype(), MEM_WORKSPACE));
    }
    for (size_t i = 0; i < live.size(); ++i) {
      if (live[i]->host_accessible()) std::memcpy(snapshot_[i].raw_data(), live[i]->raw_data(), live[i]->nbytes());
      else backend_.read(*live[i], snapshot_[i].raw_data());
      *live[i] = snapshot_[i];
    }
    path = (std::filesystem::path(checkpoints_.dir()) / checkpoint_dir_name(c.step)).string();
    in_flight_ = std::async(std::launch::async, [this, c = std::move(c)] {
      const TraceSpan span(tracer_, "checkpoint write", "checkpoint", 1);
      return checkpoints_.save(c);
    });
  } else if (lead) {
    path = checkpoints_.save(contents());
  }
  trainer.params_loaded();  // ZeRO-3: back to this rank's shard
  return path;
}

std::string TrainingState::wait_for_save() {
  if (!in_flight_.valid()) return "";
  return in_flight_.get();  // (rethrows the writer's error; the future is then spent)
}

TrainingState::~TrainingState() {
  if (!in_flight_.valid()) return;
  try {
    in_flight_.get();  // a checkpoint is never abandoned half-written by an exit
  } catch (const std::exception&) {  // (reported by the caller's own wait, or lost with the run's error)
  }
}

std::string TrainingState::save_sharded(const nlohmann::json& data_state) {
  Communicator& world = layout_.world();
  const CheckpointContents c = contents();
  ShardContents shard;
  shard.rank = world.rank(), shard.world = world.size();
  shard.begin = zero_->range().begin, shard.end = zero_->range().end;
  shard.config = config_.model;
  shard.params = parts_.model->params().view(shard.begin, {shard.end - shard.begin});
  shard.optimizer = c.optimizer.name;
  shard.optimizer_steps = c.optimizer_steps;
  shard.flat = flat_state_;
  if (fp8_.defined()) shard.whole.emplace_back("fp8_amax_history", fp8_);
  const bool lead = world.rank() == 0;
  if (lead) checkpoints_.begin_sharded(c.step);
  world.barrier();
  checkpoints_.write_shard(c.step, shard);
  world.barrier();
  std::string path = lead ? checkpoints_.commit_sharded(c, world.size()) : "(committed by rank 0)";
  world.barrier();
  return path;
}

std::optional<LoadedCheckpoint> TrainingState::resume(const CheckpointWarning& warn, const std::string& path) {
  wait_for_save();
  std::optional<LoadedCheckpoint> loaded = path.empty() ? checkpoints_.load_latest(model_state_, optimizer_state_, warn)
                                                        : checkpoints_.load(path, model_state_, optimizer_state_);
  if (!loaded) return loaded;
  Trainer& trainer = *parts_.trainer;
  trainer.restore(loaded->step, loaded->optimizer_steps);
  if (parts_.whole) {
    tp_local(parts_.whole->params(), parts_.model->params());
    for (auto& [local, w] : tp_state_) tp_state_local(w, local);
  }
  for (auto& [owned, full] : pp_state_) owners_state_owned(full, owned);
  for (auto& [shard, domain] : zero_state_) backend_.copy(domain.view(zero_->state_offset(), {shard.numel()}), shard);
  trainer.params_loaded();
  parts_.model->unpack_scaling_state();
  if (DynamicLossScaler* ls = trainer.loss_scaler(); ls != nullptr && loaded->extra.contains("loss_scaler")) {
    const nlohmann::json& j = loaded->extra["loss_scaler"];
    ls->restore({j.at("scale").get<float>(), j.at("growth_tracker").get<int64_t>(), j.at("hysteresis_tracker").get<int64_t>()});
  }
  return loaded;
}

Transformer& TrainingState::gather_for_sampling() {
  parts_.trainer->gather_params();          // ZeRO-3: the whole model on every rank
  if (partial_) owners_whole_params();      // pipeline / expert parallel: every stage's and expert's parameters
  if (layout_.group(Axis::ep) != nullptr) parts_.model->set_expert_parallel(nullptr);  // sampling computes every expert
  if (!parts_.whole) return *parts_.model;
  tp_whole(parts_.model->params(), parts_.whole->params());  // tensor parallel: the slices put together
  return *parts_.whole;
}

}  // namespace loom
