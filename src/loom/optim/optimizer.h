// The optimizer family over flat parameter buffers: SGD (plain, momentum, Nesterov), Adagrad,
// RMSprop, Adam, AdamW, Adafactor, SM3, Lion, Adam-mini, CAME, LDAdam and Muon. The exact
// update rules, defaults and state sizes are in docs/optimizers.md, with each one's paper; each is
// tested against a float64 reference (tests/test_optim_golden.cpp).
//
// An optimizer receives the flat parameter and gradient buffers and a list of OptimParam
// ranges. Elementwise rules accept any range (a ZeRO shard); factored, blockwise and
// orthogonalizing rules need whole parameters. State lives in flat f32 buffers counted as
// MEM_OPTIMIZER_STATE and is listed by name for checkpoints.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/arch/param_layout.h"

namespace loom {

// The optimizers, in docs/optimizers.md's order. OptimConfig::resolved() parses optim.name into
// one (the registry, optim/registry.cpp, is the only place that reads the names).
enum class OptimizerKind { sgd, momentum, nesterov, adagrad, rmsprop, adam, adamw, adafactor, sm3, lion, adam_mini, came, ldadam, muon };
// Muon's update scale (optim.muon_scale, parsed by resolved()).
enum class MuonScale { moonshot, keller };

// optim.* config. Negative numbers (and nesterov = -1) mean "the optimizer's published
// default"; resolve() fills them in.
struct OptimConfig {
  std::string name = "adamw";  // the config key; resolved() sets `kind` from it
  OptimizerKind kind = OptimizerKind::adamw;
  double weight_decay = -1.0;
  double beta1 = -1.0, beta2 = -1.0, beta3 = -1.0;  // beta2 is RMSprop's alpha
  double eps = -1.0, eps2 = -1.0;
  double momentum = -1.0;  // SGD, RMSprop, Muon
  double dampening = 0.0;  // SGD
  int64_t nesterov = -1;   // -1 default (name nesterov, and muon: on), 0 off, 1 on
  bool centered = false;   // RMSprop
  bool amsgrad = false;    // Adam, AdamW
  double lr_decay = 0.0;   // Adagrad
  double initial_accumulator = 0.0;  // Adagrad
  bool relative_step = true;    // Adafactor
  bool scale_parameter = true;  // Adafactor
  bool warmup_init = false;     // Adafactor
  double clip_threshold = 1.0;  // Adafactor, CAME
  double decay_rate = -0.8;     // Adafactor
  int64_t rank = 16;            // LDAdam
  double rho = 0.908;           // LDAdam
  int64_t ns_steps = 5;         // Muon
  std::string muon_scale = "moonshot";  // moonshot | keller; resolved() sets `muon_scaling` from it
  MuonScale muon_scaling = MuonScale::moonshot;
  // Parameter groups: comma-separated globs (no weight decay) and "glob=factor" lr multipliers.
  std::string no_decay = "*.bias,*ln_*,*norm*,wte.*,wpe.*,*embed_tokens*";
  std::string lr_scale = "";
  // Offload (ZeRO-Offload, Ren et al. 2021): the state lives in host memory (MEM_OFFLOADED) and
  // the update runs on the CPU. On the CPU backend that is the same RAM and the same cores: the
  // state is only accounted apart, so a device budget sees what a GPU would hold.
  bool offload = false;

  // A copy with every default filled in for `name`; throws naming the key on a bad value.
  OptimConfig resolved() const;
};

// The optimizer names, in docs/optimizers.md's order.
const std::vector<std::string>& optimizer_names();

struct OptimSegment {
  int64_t offset = 0;  // elements into the flat buffers
  int64_t rows = 1, cols = 1;
  int64_t block_rows = 1;  // Adam-mini block height
};

struct OptimParam {
  std::string name;
  int64_t offset = 0, numel = 0;
  bool matrix = false;  // 2-D: factored rules factor each segment
  bool hidden = false;  // a hidden-layer matrix: Muon orthogonalizes it, LDAdam projects it
  float weight_decay = 0.0f;
  float lr_scale = 1.0f;
  std::vector<OptimSegment> segments;
};

// The parameters of a model with their groups resolved from config.no_decay / lr_scale and
// config.weight_decay (the config must be resolved).
std::vector<OptimParam> optim_params(const ParamLayout& layout, const OptimConfig& config);

// fnmatch-style glob: '*' any run of characters (dots included), '?' one character.
bool glob_match(const std::string& pattern, const std::string& name);

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update from g = grad_scale * grads (grad_scale: the clipping coefficient) at learning
  // rate lr (each parameter multiplies it by its lr_scale). Advances the step counter.
  void step(float lr, float grad_scale = 1.0f);
  int64_t steps_taken() const { return step_; }
  void restore_steps_taken(int64_t steps) { step_ = steps; }  // with state() restored
  const std::string& name() const { return c_.name; }
  OptimizerKind kind() const { return c_.kind; }

  // Every tensor a resumed run needs, by name: the optimizer state and, when the optimizer
  // keeps state in it (LDAdam's error feedback), the gradient buffer.
  const std::vector<std::pair<std::string, Tensor>>& state() const { return state_; }
  // Bytes of MEM_OPTIMIZER_STATE this optimizer allocated.
  int64_t state_bytes() const { return state_bytes_; }
  // True when the gradient buffer carries state between steps: the trainer must add the next
  // backward into it instead of zeroing it (the optimizer leaves it zero otherwise).
  virtual bool keeps_gradients() const { return false; }

 protected:
  // `config` must be resolved.
  Optimizer(const OptimConfig& config, Backend& backend, const Tensor& params, const Tensor& grads, std::vector<OptimParam> list);
  virtual void update(float lr, float grad_scale) = 0;  // step_ is already the 1-based step
  // A zeroed f32 state buffer of n elements, listed in state() under `state_name`.
  Tensor add_state(const std::string& state_name, int64_t n, float fill = 0.0f);
  // The op hyper-parameters of parameter q at this step: its rate lr * q.lr_scale, its weight
  // decay, grad_scale and the config's betas, eps, momentum, dampening and nesterov.
  OptimHyper hyper(const OptimParam& q, float lr, float grad_scale) const;
  // Parameter k's elements of a state buffer of one value per element; undefined if state is.
  Tensor slice(const Tensor& state, size_t k, const OptimParam& q) const {
    return state.defined() ? state.view(element_offsets_[k], {q.numel}) : Tensor();
  }
  // AdamW (the backend's fused kernel, betas and eps from the config) on flat elements
  // [offset, offset + n) of the parameters, with moments m, v from element m_offset of the
  // state buffers. The rule of `adamw`, and the fallback of Muon and LDAdam.
  void adamw(int64_t offset, int64_t n, const Tensor& m, const Tensor& v, int64_t m_offset, float lr, float weight_decay,
             float grad_scale) const;

  const OptimConfig c_;  // resolved
  Backend& backend_;
  Tensor params_, grads_;
  std::vector<OptimParam> list_;
  // Where each parameter starts in a state buffer of one value per element (numel_total_ long).
  std::vector<int64_t> element_offsets_;
  int64_t numel_total_ = 0;
  int64_t step_ = 0;
  std::vector<std::pair<std::string, Tensor>> state_;
  int64_t state_bytes_ = 0;
};

// The optimizer registry (optim/registry.cpp): one row per optimizer, read by config resolution,
// make_optimizer, the state-size formula, ZeRO and the layout's compatibility table.
struct OptimizerRow {
  const char* name;
  OptimizerKind kind;
  // The update of each element reads only that element's state, so ZeRO, tensor, pipeline and
  // expert parallelism may cut the parameters anywhere.
  bool elementwise;
  // Error feedback lives in the gradient buffer (LDAdam): data parallelism and loss scaling
  // would average or rescale it.
  bool keeps_gradients;
  void (*defaults)(OptimConfig& config);  // fills the keys left at -1 (config.kind is set)
  std::unique_ptr<Optimizer> (*make)(Backend& backend, const Tensor& params, const Tensor& grads,
                                     std::vector<OptimParam> list, const OptimConfig& config);
  int64_t (*state_floats)(const OptimParam& param, const OptimConfig& config);  // per parameter
};
const std::vector<OptimizerRow>& optimizer_rows();
const OptimizerRow& optimizer_row(const std::string& name);  // parses optim.name; throws listing the names
const OptimizerRow& optimizer_row(OptimizerKind kind);
// True for the optimizers whose update is element-wise (their row's `elementwise`).
bool elementwise_optimizer(OptimizerKind kind);

// True for plain AdamW (no AMSGrad), the one rule a backend without capabilities().every_optimizer
// runs (Backend::adamw_step); `config` resolved or not.
bool fused_adamw_only(const OptimConfig& config);

// Builds config.name (resolved) over `list`.
std::unique_ptr<Optimizer> make_optimizer(Backend& backend, const Tensor& params, const Tensor& grads,
                                          std::vector<OptimParam> list, const OptimConfig& config);

// Optimizer-state bytes by docs/optimizers.md's formula, without allocating: what `loom
// train --dry-run` reports and what the tests hold the allocations to.
int64_t optimizer_state_bytes(const std::vector<OptimParam>& list, const OptimConfig& config);

// Global L2 norm of the gradients, summed in a fixed order (bitwise reproducible).
double grad_norm(Backend& backend, const Tensor& grads);
// The factor that brings the norm to at most max_norm: min(1, max_norm / (norm + 1e-6)), as
// torch.nn.utils.clip_grad_norm_. max_norm <= 0 disables clipping (factor 1). The optimizer
// applies it while it reads the gradients, saving a pass over them.
float clip_coefficient(double norm, double max_norm);

}  // namespace loom
