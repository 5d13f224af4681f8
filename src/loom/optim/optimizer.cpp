#include "loom/optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <fnmatch.h>

#include "loom/core/error.h"
#include "loom/optim/rules.h"

namespace loom {

namespace {

void check_unit(double v, const char* key, bool allow_zero = true) {
  LOOM_CHECK(v < 1.0 && (allow_zero ? v >= 0.0 : v > 0.0), key, " must be in ", allow_zero ? "[0, 1)" : "(0, 1)",
             ", got ", v);
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(start, end - start);
    const size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    if (a != std::string::npos) out.push_back(item.substr(a, b - a + 1));
    start = end + 1;
  }
  return out;
}

}  // namespace

OptimConfig OptimConfig::resolved() const {
  OptimConfig c = *this;
  c.kind = optimizer_row(c.name).kind;  // the one parse of optim.name; throws naming the known optimizers
  optimizer_row(c.kind).defaults(c);
  // Keys the chosen rule does not read keep a harmless value.
  for (auto [field, value] : {std::pair{&c.beta1, 0.9}, {&c.beta2, 0.999}, {&c.beta3, 0.9999}, {&c.eps, 1e-8},
                              {&c.eps2, 1e-3}, {&c.momentum, 0.0}}) {
    if (*field < 0.0) *field = value;
  }
  if (c.nesterov < 0) c.nesterov = 0;

  check_unit(c.beta1, "optim.beta1");
  check_unit(c.beta2, "optim.beta2");
  check_unit(c.beta3, "optim.beta3");
  check_unit(c.momentum, "optim.momentum");
  check_unit(c.rho, "optim.rho");
  LOOM_CHECK(c.eps >= 0.0 && c.eps2 >= 0.0, "optim.eps and optim.eps2 must be >= 0, got ", c.eps, ", ", c.eps2);
  LOOM_CHECK(c.dampening >= 0.0 && c.dampening <= 1.0, "optim.dampening must be in [0, 1], got ", c.dampening);
  LOOM_CHECK(c.nesterov <= 1, "optim.nesterov must be true or false");
  const bool sgd = c.kind == OptimizerKind::sgd || c.kind == OptimizerKind::momentum || c.kind == OptimizerKind::nesterov;
  LOOM_CHECK(!(c.nesterov == 1 && sgd && (c.momentum <= 0.0 || c.dampening != 0.0)),
             "optim.nesterov needs optim.momentum > 0 and optim.dampening = 0 (as torch.optim.SGD)");
  LOOM_CHECK(c.weight_decay >= 0.0, "optim.weight_decay must be >= 0 (or -1 for the default), got ", c.weight_decay);
  LOOM_CHECK(c.lr_decay >= 0.0 && c.initial_accumulator >= 0.0, "optim.lr_decay and optim.initial_accumulator must be >= 0");
  LOOM_CHECK(c.clip_threshold > 0.0, "optim.clip_threshold must be > 0, got ", c.clip_threshold);
  LOOM_CHECK(c.decay_rate < 0.0, "optim.decay_rate must be < 0 (Adafactor's beta2_t = 1 - t^decay_rate), got ", c.decay_rate);
  LOOM_CHECK(c.rank >= 1, "optim.rank must be >= 1, got ", c.rank);
  LOOM_CHECK(c.ns_steps >= 1, "optim.ns_steps must be >= 1, got ", c.ns_steps);
  LOOM_CHECK(c.muon_scale == "moonshot" || c.muon_scale == "keller", "optim.muon_scale must be moonshot or keller, got '",
             c.muon_scale, "'");
  c.muon_scaling = c.muon_scale == "keller" ? MuonScale::keller : MuonScale::moonshot;
  for (const std::string& rule : split_list(c.lr_scale)) {
    const size_t eq = rule.find('=');
    LOOM_CHECK(eq != std::string::npos && eq > 0, "optim.lr_scale: '", rule, "' is not glob=factor");
    char* end = nullptr;
    const double f = std::strtod(rule.c_str() + eq + 1, &end);
    LOOM_CHECK(end != rule.c_str() + eq + 1 && *end == '\0' && f >= 0.0 && std::isfinite(f), "optim.lr_scale: '", rule,
               "' needs a factor >= 0 after '='");
  }
  return c;
}

bool glob_match(const std::string& pattern, const std::string& name) {
  return fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

std::vector<OptimParam> optim_params(const ParamLayout& layout, const OptimConfig& config) {
  LOOM_CHECK(config.weight_decay >= 0.0, "optim_params needs a resolved OptimConfig");
  const std::vector<std::string> no_decay = split_list(config.no_decay);
  std::vector<std::pair<std::string, float>> scales;
  for (const std::string& rule : split_list(config.lr_scale)) {
    const size_t eq = rule.find('=');
    LOOM_CHECK(eq != std::string::npos, "optim.lr_scale: '", rule, "' is not glob=factor");
    scales.emplace_back(rule.substr(0, eq), std::stof(rule.substr(eq + 1)));
  }
  std::vector<OptimParam> out;
  for (const ParamSpec& spec : layout.params) {
    OptimParam q;
    q.name = spec.name;
    q.offset = spec.offset;
    q.numel = spec.numel;
    q.matrix = spec.shape.size() == 2;
    q.hidden = q.matrix && spec.role == ROLE_HIDDEN;
    const bool decays = std::none_of(no_decay.begin(), no_decay.end(), [&](const std::string& g) { return glob_match(g, spec.name); });
    q.weight_decay = decays ? static_cast<float>(config.weight_decay) : 0.0f;
    for (const auto& [glob, factor] : scales) {
      if (glob_match(glob, spec.name)) {
        q.lr_scale = factor;
        break;
      }
    }
    if (spec.role == ROLE_BUFFER) {  // not trained (nn/moe.h updates the routing bias): a zero step, whatever
      q.lr_scale = 0.0f;             // the rule (kept in the list so that every flat layout stays whole)
      q.weight_decay = 0.0f;
    }
    const int64_t cols = q.matrix ? spec.shape[1] : spec.numel;
    int64_t row = 0;
    for (const ParamSegment& s : spec.segments) {
      q.segments.push_back({spec.offset + row * cols, s.rows, cols, s.block_rows});
      row += s.rows;
    }
    LOOM_CHECK(row * cols == spec.numel, "parameter ", spec.name, ": segments cover ", row * cols, " of ", spec.numel,
               " elements");
    out.push_back(std::move(q));
  }
  return out;
}

Optimizer::Optimizer(const OptimConfig& config, Backend& backend, const Tensor& params, const Tensor& grads,
                     std::vector<OptimParam> list)
    : c_(config), backend_(backend), params_(params), grads_(grads), list_(std::move(list)) {
  LOOM_CHECK(params.dtype() == DTYPE_F32 && grads.dtype() == DTYPE_F32 && params.numel() == grads.numel(),
             "optimizer ", c_.name, ": parameters and gradients must be f32 buffers of one size, got ", params.describe(),
             " and ", grads.describe());
  for (const OptimParam& q : list_) {
    LOOM_CHECK(q.offset >= 0 && q.numel > 0 && q.offset + q.numel <= params.numel(), "optimizer ", c_.name, ": parameter ",
               q.name, " [", q.offset, ", ", q.offset + q.numel, ") lies outside the buffer of ", params.numel());
    int64_t covered = 0;
    for (const OptimSegment& s : q.segments) {
      LOOM_CHECK(s.rows > 0 && s.cols > 0 && s.block_rows > 0 && s.rows % s.block_rows == 0, "optimizer ", c_.name,
                 ": parameter ", q.name, " has a segment of ", s.rows, "x", s.cols, " with blocks of ", s.block_rows, " rows");
      covered += s.rows * s.cols;
    }
    LOOM_CHECK(covered == q.numel, "optimizer ", c_.name, ": the segments of ", q.name, " cover ", covered, " of ", q.numel,
               " elements");
    element_offsets_.push_back(numel_total_);
    numel_total_ += q.numel;
  }
}

void Optimizer::adamw(int64_t offset, int64_t n, const Tensor& m, const Tensor& v, int64_t m_offset, float lr,
                      float weight_decay, float grad_scale) const {
  AdamWHyper h;
  h.lr = lr;
  h.beta1 = static_cast<float>(c_.beta1);
  h.beta2 = static_cast<float>(c_.beta2);
  h.eps = static_cast<float>(c_.eps);
  h.weight_decay = weight_decay;
  h.grad_scale = grad_scale;
  h.step = step_;
  backend_.adamw_step(params_.view(offset, {n}), grads_.view(offset, {n}), m.view(m_offset, {n}), v.view(m_offset, {n}), h);
}

OptimHyper Optimizer::hyper(const OptimParam& q, float lr, float grad_scale) const {
  OptimHyper h;
  h.lr = lr * q.lr_scale;
  h.weight_decay = q.weight_decay;
  h.grad_scale = grad_scale;
  h.step = step_;
  h.beta1 = c_.beta1;
  h.beta2 = c_.beta2;
  h.beta3 = c_.beta3;
  h.eps = c_.eps;
  h.eps2 = c_.eps2;
  h.momentum = c_.momentum;
  h.dampening = c_.dampening;
  h.clip_threshold = c_.clip_threshold;
  h.nesterov = c_.nesterov == 1;
  h.scale_parameter = c_.scale_parameter;
  return h;
}

void Optimizer::step(float lr, float grad_scale) {
  ++step_;
  update(lr, grad_scale);
}

Tensor Optimizer::add_state(const std::string& state_name, int64_t n, float fill_value) {
  // n = 0: a rank that updates nothing (its ZeRO-2/3 shard all frozen: LoRA's base) still lists
  // its (empty) buffers, as every rank of a checkpoint's all-gather must.
  LOOM_CHECK(n >= 0, "optimizer ", c_.name, ": state buffer '", state_name, "' of ", n, " elements");
  Tensor t = Tensor::zeros(backend_.allocator(), {n}, DTYPE_F32, c_.offload ? MEM_OFFLOADED : MEM_OPTIMIZER_STATE);
  if (fill_value != 0.0f) backend_.fill(t, fill_value);
  state_.emplace_back(state_name, t);
  state_bytes_ += static_cast<int64_t>(t.nbytes());
  return t;
}

std::unique_ptr<Optimizer> make_optimizer(Backend& backend, const Tensor& params, const Tensor& grads,
                                          std::vector<OptimParam> list, const OptimConfig& config) {
  const OptimConfig c = config.resolved();
  // Every update runs through backend ops; a backend without the optimizer ops (their defaults
  // throw) has only plain AdamW (Backend::adamw_step).
  LOOM_CHECK(params.host_accessible() || backend.capabilities().every_optimizer || fused_adamw_only(c),
             "optim.name = ", c.name, " is not supported on the ", backend.name(), " backend yet (its update runs on the host): use adamw");
  return optimizer_row(c.kind).make(backend, params, grads, std::move(list), c);
}

bool fused_adamw_only(const OptimConfig& config) {
  return optimizer_row(config.name).kind == OptimizerKind::adamw && !config.amsgrad;
}

int64_t optimizer_state_bytes(const std::vector<OptimParam>& list, const OptimConfig& config) {
  const OptimConfig c = config.resolved();
  const OptimizerRow& row = optimizer_row(c.kind);
  int64_t floats = 0;
  for (const OptimParam& q : list) floats += row.state_floats(q, c);
  return floats * static_cast<int64_t>(sizeof(float));
}

double grad_norm(Backend& backend, const Tensor& grads) { return std::sqrt(backend.sum_squares(grads)); }

float clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  return static_cast<float>(std::min(1.0, max_norm / (norm + 1e-6)));
}

}  // namespace loom
