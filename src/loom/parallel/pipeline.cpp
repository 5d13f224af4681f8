#include "loom/parallel/pipeline.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <limits>

#include "loom/core/error.h"

namespace loom {

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

std::vector<std::pair<int64_t, int64_t>> pipeline_layer_split(int64_t layers, int stages, double layer_cost,
                                                              double first_cost, double last_cost) {
  LOOM_CHECK(stages >= 1 && layers >= stages, "parallel.pp x parallel.virtual_stages = ", stages,
             " model stages need at least as many layers; the model has model.n_layer = ", layers);
  // best[s][n]: the smallest possible largest cost when stages 0..s-1 hold the first n layers.
  const auto S = static_cast<size_t>(stages), L = static_cast<size_t>(layers);
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(S + 1, std::vector<double>(L + 1, inf));
  std::vector<std::vector<size_t>> cut(S + 1, std::vector<size_t>(L + 1, 0));
  best[0][0] = 0.0;
  for (size_t s = 1; s <= S; ++s) {
    for (size_t n = s; n + (S - s) <= L; ++n) {
      for (size_t k = n; k-- > s - 1;) {  // stage s-1 holds layers [k, n); ties: more layers early
        const double cost = static_cast<double>(n - k) * layer_cost + (s == 1 ? first_cost : 0.0) +
                            (s == S ? last_cost : 0.0);
        const double worst = std::max(best[s - 1][k], cost);
        if (worst < best[s][n] - 1e-12 * std::max(1.0, worst)) best[s][n] = worst, cut[s][n] = k;
      }
    }
  }
  std::vector<std::pair<int64_t, int64_t>> out(S);
  for (size_t s = S, n = L; s >= 1; --s) {
    out[s - 1] = {static_cast<int64_t>(cut[s][n]), static_cast<int64_t>(n)};
    n = cut[s][n];
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> pipeline_stage_split(const ModelConfig& c, int stages, int64_t seq_len) {
  const double C = static_cast<double>(c.d_model), hd = static_cast<double>(c.head_dim());
  const double gemm = 2.0 * (C * static_cast<double>(c.qkv_width()) + static_cast<double>(c.n_head) * hd * C +
                             C * static_cast<double>(c.mlp_in_width()) + static_cast<double>(c.d_ff) * C);
  const double attention = 4.0 * static_cast<double>(seq_len) * static_cast<double>(c.n_head) * hd;  // QK^T and PV
  return pipeline_layer_split(c.n_layer, stages, gemm + attention, 0.0, 2.0 * static_cast<double>(c.vocab_size) * C);
}

RangeSet pipeline_owned_ranges(const ModelConfig& config, const ParamLayout& layout, const PipeSchedule& schedule,
                               int rank, const std::vector<std::pair<int64_t, int64_t>>& layers, bool norm) {
  const std::vector<RangeSet> units = layout_units(config, layout);  // [0]: embeddings and final norm / head; [l + 1]: block l
  std::vector<Range> owned;
  for (int c = 0; c < schedule.virtual_chunks; ++c) {
    const auto [first, last] = layers[static_cast<size_t>(schedule.stage_of(rank, c))];
    for (int64_t l = first; l < last; ++l) {
      for (const Range& r : units[static_cast<size_t>(l + 1)]) owned.push_back(r);
    }
    if (first == 0) owned.push_back(units[0].ranges()[0]);                   // embeddings
    if (last == config.n_layer) owned.push_back(units[0].ranges()[1]);  // final norm (+ untied head)
  }
  if (!norm && config.tied_head() && schedule.rank_of(schedule.model_stages() - 1) == rank) {
    const ParamSpec& wte = layout.find(embedding_param_name(config));
    owned.push_back({wte.offset, wte.offset + wte.numel});
  }
  return RangeSet(std::move(owned));
}

PipelineRunner::PipelineRunner(Transformer& model, Communicator& pp, PipeSchedule schedule, int64_t batch,
                               int64_t seq_len)
    : model_(model), pp_(pp), schedule_(std::move(schedule)) {
  validate_pipe_schedule(schedule_);
  LOOM_CHECK(schedule_.stages == pp.size(), "pipeline schedule for parallel.pp = ", schedule_.stages, " on a group of ",
             pp.size(), " ranks");
  const int S = schedule_.model_stages(), rank = pp.rank(), v = schedule_.virtual_chunks, m = schedule_.micro;
  layers_ = pipeline_stage_split(model.config(), S, seq_len);
  plan_ = std::move(plan_pipe_messages(schedule_)[static_cast<size_t>(rank)]);
  // Each chunk keeps as many activation stores as the schedule ever has micro-batches live on it
  // (from F to B, or to W when the backward is split): GPipe m, 1F1B at most p - rank.
  const std::vector<int> peak = pipe_live_peak(schedule_, rank);
  stores_.resize(static_cast<size_t>(v));
  grad_out_.resize(static_cast<size_t>(v));
  slot_.assign(static_cast<size_t>(v), std::vector<int>(static_cast<size_t>(m), -1));
  pending_.resize(static_cast<size_t>(v));
  for (int c = 0; c < v; ++c) {
    const auto [first, last] = layers_[static_cast<size_t>(schedule_.stage_of(rank, c))];
    for (int k = 0; k < std::max(1, peak[c]); ++k) {
      stores_[c].push_back(model.allocate_stage_store(batch, seq_len, first, last, schedule_.split_backward));
      pending_[c].emplace_back();
    }
    const ActivationStore& store = stores_[c].back();
    for (int i = 0; i < m; ++i) {
      // d(stage input) has the stage gradient's shape (1/tp of the sequence under sequence parallel).
      grad_out_[c].push_back(first > 0 ? Tensor::empty(model.backend().allocator(),
                                                       model.stage_grad(store.batch, store.seq_len).shape(), DTYPE_F32,
                                                       MEM_COMMUNICATION)
                                       : Tensor{});
    }
    if (c == 0) {  // every micro-batch's tokens and targets, drawn at the start of a step
      for (int i = 0; i < m; ++i) {
        tokens_.push_back(Tensor::empty(model.backend().allocator(), store.tokens.shape(), DTYPE_I32, MEM_WORKSPACE));
        targets_.push_back(Tensor::empty(model.backend().allocator(), store.targets.shape(), DTYPE_I32, MEM_WORKSPACE));
      }
      if (!tokens_[0].host_accessible()) {  // batch sources write host memory
        host_tokens_ = Tensor::empty(host_, store.tokens.shape(), DTYPE_I32, MEM_WORKSPACE);
        host_targets_ = Tensor::empty(host_, store.targets.shape(), DTYPE_I32, MEM_WORKSPACE);
      }
    }
  }
  norm_ranges_ = pipeline_owned_ranges(model.config(), model.layout(), schedule_, rank, layers_, true);
  owned_ = pipeline_owned_ranges(model.config(), model.layout(), schedule_, rank, layers_, false);
  if (model.config().tied_head()) {
    const ParamSpec& wte = model.layout().find(embedding_param_name(model.config()));
    tied_ = {wte.offset, wte.offset + wte.numel};
  }
  loss_ = Tensor::zeros(model.backend().allocator(), {1}, DTYPE_F64, MEM_WORKSPACE);
}

int PipelineRunner::acquire(int chunk, int micro, int slot) {
  const std::vector<int>& live = slot_[chunk];  // the plan's store: one no live micro-batch holds
  LOOM_CHECK(slot >= 0 && slot < static_cast<int>(stores_[chunk].size()) &&
                 std::find(live.begin(), live.end(), slot) == live.end(),
             "pipeline: activation store ", slot, " on chunk ", chunk, " is not free for micro-batch ", micro);
  if (pending_[chunk][slot]) pending_[chunk][slot]->wait();  // its last output has left
  pending_[chunk][slot].reset();
  slot_[chunk][micro] = slot;
  return slot;
}

ActivationStore& PipelineRunner::store_of(int chunk, int micro) {
  const int slot = slot_[chunk][micro];
  LOOM_CHECK(slot >= 0, "pipeline: micro-batch ", micro, " has no activations on chunk ", chunk);
  return stores_[chunk][slot];
}

void PipelineRunner::forward(const PipeAction& a, const PipeMessagePlan& plan) {
  const int rank = pp_.rank(), s = schedule_.stage_of(rank, a.chunk);
  const auto [first, last] = layers_[static_cast<size_t>(s)];
  const int slot = acquire(a.chunk, a.micro, plan.slot);
  ActivationStore& store = stores_[a.chunk][slot];
  model_.backend().copy(tokens_[a.micro], store.tokens);
  model_.backend().copy(targets_[a.micro], store.targets);
  store.docs = docs_[static_cast<size_t>(a.micro)];
  store.dropout_pass = first_pass_ > 0 ? first_pass_ + static_cast<uint32_t>(a.micro) : 0;
  if (s > 0) {  // the previous stage's output
    const int from = schedule_.rank_of(s - 1);
    if (from == rank) {
      model_.backend().copy(store_of(schedule_.chunk_of(s - 1), a.micro).blocks[first].input, store.blocks[first].input);
    } else {
      const double t = now();
      pp_.recv(store.blocks[first].input, from, plan.recv_round);
      idle_ += now() - t;
    }
  }
  const double t = now();
  const double loss = model_.forward_stage(store, first, last);
  busy_ += now() - t;
  if (last == model_.config().n_layer) loss_sum_ += loss;
  if (s + 1 < schedule_.model_stages() && schedule_.rank_of(s + 1) != rank) {
    pending_[a.chunk][slot] = pp_.send_async(store.blocks[last].input, schedule_.rank_of(s + 1), plan.send_round);
  }
}

void PipelineRunner::release(int chunk, int micro) { slot_[chunk][micro] = -1; }

void PipelineRunner::backward(const PipeAction& a, const PipeMessagePlan& plan) {
  const int rank = pp_.rank(), s = schedule_.stage_of(rank, a.chunk);
  const auto [first, last] = layers_[static_cast<size_t>(s)];
  ActivationStore& store = store_of(a.chunk, a.micro);
  const Tensor grad = model_.stage_grad(store.batch, store.seq_len);
  if (a.op == PIPE_W) {
    const double t = now();
    model_.backward_stage(store, first, last, loss_weight_, BACKWARD_WEIGHT);
    busy_ += now() - t;
    release(a.chunk, a.micro);
    return;
  }
  if (s + 1 < schedule_.model_stages()) {  // d(output) from the next stage
    const int from = schedule_.rank_of(s + 1);
    if (from == rank) {
      model_.backend().copy(grad_out_[schedule_.chunk_of(s + 1)][a.micro], grad);
    } else {
      const double t = now();
      pp_.recv(grad, from, plan.recv_round);
      idle_ += now() - t;
    }
  }
  const double t = now();
  model_.backward_stage(store, first, last, loss_weight_, schedule_.split_backward ? BACKWARD_INPUT : BACKWARD_ALL);
  busy_ += now() - t;
  if (s > 0) {  // d(input) to the previous stage, from a buffer of its own (grad is reused)
    const Tensor& out = grad_out_[a.chunk][a.micro];
    model_.backend().copy(grad, out);
    if (schedule_.rank_of(s - 1) != rank) sends_.push_back(pp_.send_async(out, schedule_.rank_of(s - 1), plan.send_round));
  }
  if (!schedule_.split_backward) release(a.chunk, a.micro);
}

void PipelineRunner::wait_sends() {
  for (auto& w : sends_) w->wait();
  sends_.clear();
  for (auto& chunk : pending_) {
    for (auto& w : chunk) {
      if (w) w->wait();
      w.reset();
    }
  }
}

double PipelineRunner::evaluate(BatchSource& data, int64_t batches) {
  const int rank = pp_.rank(), S = schedule_.model_stages();
  double sum = 0.0;
  loss_sum_ = 0.0;
  valid_ = positions_ = 0;
  first_pass_ = 0;  // no dropout in evaluation
  for (int64_t i = 0; i < batches; ++i) {
    fill_micro(data, 0);
    for (int s = 0; s < S; ++s) {
      // A chain through the stages: stage s receives in round s and sends in round s + 1.
      if (schedule_.rank_of(s) == rank) forward(PipeAction{schedule_.chunk_of(s), 0, PIPE_F}, PipeMessagePlan{0, s, s + 1});
    }
    for (int s = 0; s < S; ++s) {
      if (schedule_.rank_of(s) == rank) release(schedule_.chunk_of(s), 0);
    }
    wait_sends();
  }
  sum = loss_sum_;
  loss_sum_ = 0.0;
  sum = reduce_loss(sum);
  if (valid_ != positions_) {  // loss masks: the mean over the counted positions (every rank drew the same batches)
    return valid_ > 0 ? sum * static_cast<double>(positions_) / static_cast<double>(batches * valid_) : NAN;
  }
  return batches > 0 ? sum / static_cast<double>(batches) : 0.0;
}

double PipelineRunner::run(BatchSource& data, float loss_weight, uint32_t first_pass) {
  loss_weight_ = loss_weight;
  first_pass_ = first_pass;
  loss_sum_ = busy_ = idle_ = 0.0;
  valid_ = positions_ = 0;
  for (int i = 0; i < schedule_.micro; ++i) fill_micro(data, i);  // in the one-process order
  const std::vector<PipeAction>& actions = schedule_.per_rank[static_cast<size_t>(pp_.rank())];
  for (size_t i = 0; i < actions.size(); ++i) {
    if (actions[i].op == PIPE_F) forward(actions[i], plan_[i]);
    else backward(actions[i], plan_[i]);
  }
  const double t = now();
  wait_sends();
  if (tied_.second > tied_.first && pp_.size() > 1) {  // the embedding's and the head's gradient parts
    pp_.all_reduce(model_.grads().view(tied_.first, {tied_.second - tied_.first}));
  }
  const double loss = reduce_loss(loss_sum_);
  idle_ += now() - t;
  return loss;
}

void PipelineRunner::fill_micro(BatchSource& data, int micro) {
  const Tensor& tokens = tokens_[static_cast<size_t>(micro)];
  const Tensor& targets = targets_[static_cast<size_t>(micro)];
  const Tensor& host = host_tokens_.defined() ? host_targets_ : targets;
  if (!host_tokens_.defined()) {
    data.fill(tokens, targets);
  } else {
    data.fill(host_tokens_, host_targets_);
    model_.backend().write(tokens, host_tokens_.raw_data());
    model_.backend().write(targets, host_targets_.raw_data());
  }
  valid_ += counted_targets(host.data<int32_t>(), host.numel());  // loss masks: kIgnoreTarget is not counted
  positions_ += host.numel();
  const Tensor& host_tokens = host_tokens_.defined() ? host_tokens_ : tokens;
  docs_.resize(static_cast<size_t>(schedule_.micro));
  docs_[static_cast<size_t>(micro)] = data.document_end() >= 0 ? document_spans(host_tokens.data<int32_t>(), host_tokens.dim(0),
                                                                                host_tokens.dim(1), data.document_end())
                                                               : DocumentSpans{};
}

double PipelineRunner::reduce_loss(double local) {
  Backend& backend = model_.backend();  // loss_ is backend memory: written and read through it
  backend.write(loss_, &local);
  pp_.all_reduce(loss_);  // only the last stage's rank holds the losses
  double sum = 0.0;
  backend.read(loss_, &sum);
  return sum;
}

}  // namespace loom
