// A decoder-only transformer (GPT-2 or Llama, by config) with parameters and gradients in flat
// buffers and activations in a per-micro-batch ActivationStore.
//   tokens (B,T) -> embed (+ positions) -> L blocks -> final norm -> head -> logits (B,T,V)
//   loss = mean over B*T of cross-entropy(logits, targets)
#pragma once
#include <cstdint>
#include <array>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"
#include "loom/core/documents.h"
#include "loom/model/int_weights.h"
#include "loom/model/moe_stats.h"
#include "loom/model/frozen_base.h"
#include "loom/precision/fp8_state.h"
#include "loom/nn/block.h"

namespace loom {

// Everything one micro-batch keeps between forward and backward.
struct ActivationStore {
  int64_t batch = 0, seq_len = 0;
  Tensor tokens, targets;               // (B,T) i32
  std::vector<BlockSaved> blocks;       // [layer]
  Tensor final_input;                   // (B,T,C) output of the last block
  Tensor final_norm, final_mean, final_rstd;  // (B,T,C), (B,T), (B,T)
  Tensor final_norm_shard;              // sequence parallel: (B,T/t,C) the final norm before its gather
  Tensor logits;                        // (B,T,V); overwritten by d(logits) in backward
  Tensor losses, lse;                   // (B,T)
  // Packed documents (core/documents.h, data.document_mask): each span attends within itself and
  // its positions start at 0; empty: every row is one sequence. Set by whoever fills tokens.
  DocumentSpans docs;
  // A sequence-level objective (train/trainer.h RowObjective): row b's positions get the
  // gradient of loss_weight * row_weights[b] * (their summed cross-entropy) instead of the mean's;
  // empty: the mean over the B T positions.
  std::vector<float> row_weights;
  // The same per position (B T), for an objective whose weights vary along a row (a per-token KL term).
  std::vector<float> position_weights;
  // peft.dropout: which training pass this is (the masks' Philox counter: the trainer numbers its
  // micro-batches from 1); 0: no dropout (evaluation, decoding, a reference pass).
  uint32_t dropout_pass = 0;
  bool adapters_off = false;  // LoRA's adapters skipped: the base alone (a live reference model, train/objective.h)
  // A teacher's soft targets (Backend::soft_target_loss): the cross-entropy's gradient is weighted by
  // ce_weight, and logit_grad (B T, V), when defined, is added to d(logits) after it.
  float ce_weight = 1.0f;
  Tensor logit_grad;
  // A training pass that knows its backward's loss weight at the loss (the trainer, without an
  // objective): the loss pass writes d(logits) too (Backend::cross_entropy_loss_and_grad, into
  // dlogits: the logits in place, or the workspace's bf16 slot L for a bf16 head) and backward
  // starts from it. Consumed by the forward (0 after it); not with tensor parallelism (the
  // vocabulary-parallel loss), row / position weights or a logit gradient.
  // Where the backend keeps a loss pass's logits by columns (Backend::logits_by_columns), logits
  // and dlogits are (V, B T) for it: dlogits_by_columns says so.
  float fused_loss_weight = 0.0f;
  Tensor dlogits;
  float dlogits_weight = 0.0f;  // the loss weight dlogits was computed with
  bool dlogits_by_columns = false;
  bool last_logits = false;     // logits (B, 1, V) of each sequence's last position only (no loss)
};


// Told which parameters a forward or backward is about to read, for sharded parameters
// (ZeRO-3 gathers a unit before use and frees it after). Unit 0 is the embeddings, the final
// norm and the head (used at both ends of a pass), unit l + 1 is block l. use(unit, backward)
// runs before the unit's first read in that pass, done(unit, backward) after its last.
struct ParamUseHooks {
  std::function<void(int unit, bool backward)> use, done;
};

// What a Transformer is built for. Training (the default) allocates the gradients beside the
// parameters. An inference model (eval, generate, bench generate, serve: train/model_source.h
// open_inference_model) has none: backward and grad() refuse. lazy_params: the parameter
// buffer's pages hold memory only once written (Tensor::zeros_lazy), for a model whose linear
// weights are used in bf16 where the checkpoint holds them (set_bf16_weights) and whose f32
// elements are never written.
struct ModelUse {
  bool gradients = true;
  bool lazy_params = false;
};

class Transformer {
 public:
  Transformer(Backend& backend, const ModelConfig& config, ModelUse use = {});
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return config_; }
  Backend& backend() const { return backend_; }
  const ParamLayout& layout() const { return layout_; }
  const Tensor& params() const { return params_; }  // (P) flat, MEM_PARAMETERS
  const Tensor& params_bf16() const { return params16_; }  // their bf16 copy (precision.param = bf16), or undefined
  const Tensor& grads() const { return grads_; }    // (P) flat, MEM_GRADIENTS; undefined for inference
  bool has_gradients() const { return grads_.defined(); }
  Tensor param(const std::string& name) const;      // view into params()
  Tensor grad(const std::string& name) const;       // view into grads()

  // Normal(0, std) matrices (Philox stream = parameter index), ones for norm weights, zero biases.
  // From `from` on only (the rest is read from weights: LoRA's base), with the same values.
  void init_weights(uint64_t seed, int64_t from = 0);
  void zero_grads();

  // Allocates a micro-batch's activations (and, if needed, the shared backward scratch).
  ActivationStore allocate_store(int64_t batch, int64_t seq_len);
  // A prompt's store for generation (infer/engine.h prefill): one sequence of seq_len tokens
  // whose forward (compute_loss false) leaves only the last position's logits, store.logits
  // (1, 1, V): the head multiplies one row, and the store holds V logits instead of seq_len V
  // (5.1 GB for a 10,000-token prompt at Llama 3's vocabulary).
  ActivationStore allocate_prompt_store(int64_t seq_len);
  // Block `layer` alone, for sequential calibration (compress/calibration.h): a stage store of
  // [layer, layer + 1) (forward_stage(store, layer, layer + 1, false); the input in
  // store.blocks[layer].input, or tokens for layer 0), whose forward of the last block stops
  // after the final norm (store.final_norm): no head, no logits.
  ActivationStore allocate_block_store(int64_t batch, int64_t seq_len, int64_t layer);
  // Runs the model on store.tokens. With compute_loss, also the loss against store.targets;
  // returns the mean loss (0 otherwise).
  double forward(ActivationStore& store, bool compute_loss = true);
  // Decoding n independent sequences (infer/engine.h keeps their KV caches): allocate_rows(n)
  // is an n-row, one-position store; forward_rows feeds tokens[r] at positions[r] through every
  // layer, `cache` storing each row's keys and values and doing its attention
  // (Block::forward_rows), and leaves the next-token logits in store.logits (n, 1, V). With
  // logit_rows (increasing rows of [0, n)) only those rows' logits are computed, into rows 0, 1,
  // ... of store.logits, which allocate_rows(n, k) sizes for k rows (a prompt chunk's rows need
  // none but its last: the head's (rows, vocab) product and memory are the step's rows that sample).
  // `graph` (a cache in the backend's memory, step_graphs() true): everything after the tokens'
  // upload is one step graph (Backend::begin_step_graph, keyed by the step's rows and logit rows).
  ActivationStore allocate_rows(int64_t n, int64_t logit_rows = 0);
  void forward_rows(ActivationStore& store, const std::vector<int32_t>& tokens, const std::vector<int64_t>& positions,
                    DecodeCache& cache, const std::vector<int64_t>* logit_rows = nullptr, bool graph = false);
  // Whether a decoding step of this model can be one step graph: none of its layers waits for the
  // host mid-step (MoE's dispatch reads a flag; MLA's latent cache and gated DeltaNet's state
  // stay host memory).
  bool step_graphs() const { return config_.moe_experts == 0 && !config_.mla() && config_.linear_interval == 0; }
  // Accumulates into grads() the gradient of loss_weight * (mean loss of the last forward).
  // `ready`, if given, is told as backward proceeds that every gradient at flat offset >= its
  // argument is final (after the head and final norm, after each block, then 0): data
  // parallelism starts reducing those while backward goes on.
  void backward(ActivationStore& store, float loss_weight, const std::function<void(int64_t)>& ready = {});
  // Tensor parallelism (parallel/tensor_parallel.h): this model is one rank's slice (built from
  // tp_local_config) and holds vocabulary rows [vocab_begin, vocab_begin + vocab_valid); its
  // blocks and ends all-reduce over `tp`. nullptr: a whole model.
  // With sequence_parallel the residual stream and norms run on this rank's 1/tp of every
  // sequence (nn/sequence_parallel.h; train.seq_len a multiple of tp); the norms' and position
  // embeddings' gradients are then partial over the group, as are (with LoRA) the replicated
  // adapter matrices of the sliced layers (A of q/k/v and gate/up, B of o and down: nn/lora.h):
  // tp_partial_ranges() lists them (the trainer sums them over the group once a step).
  void set_tensor_parallel(Communicator* tp, int64_t vocab_begin, int64_t vocab_valid, bool sequence_parallel = false);
  bool sequence_parallel() const { return sp_; }
  // Context parallel (nn/context_parallel.h): this rank holds seq_len / cp positions of every
  // sequence, two zig-zag chunks; stores are allocated for the whole seq_len and hold this
  // rank's part (store.seq_len is the local length; tokens and targets are the local rows,
  // ContextSliceSource in parallel/slice_source.h); attention is ring or Ulysses over `cp`. The losses
  // and gradients of the group's ranks average to the whole sequence's (equal token counts).
  void set_context_parallel(Communicator* cp, bool ulysses);
  // Activation checkpointing (memory/recompute.h): each block's policy (empty: none), set before
  // the activation stores are allocated. Blocks that recompute keep less in every store; one
  // shared full record (and its output scratch) receives the recomputed fields in backward.
  // offload: the checkpointed blocks' kept fields are host memory (MEM_OFFLOADED).
  void set_recompute(std::vector<RecomputePolicy> plan, bool offload = false);
  // FlashAttention (train.flash_attention, Block::set_flash_attention): every block runs the
  // backend's flash attention ops and its records keep lse instead of probs. Changed only
  // before the activation stores are allocated.
  void set_flash_attention(bool on);
  bool flash_attention() const { return flash_; }
  const std::vector<RecomputePolicy>& recompute_plan() const { return recompute_; }
  // Measured seconds of recomputing each block under each policy for a (batch, seq_len)
  // micro-batch (the fastest of `repeats` runs on a scratch record; none: 0).
  std::vector<std::array<double, RECOMPUTE_COUNT>> measure_recompute_seconds(int64_t batch, int64_t seq_len,
                                                                              int repeats = 3);
  // Expert parallel (nn/moe.h): this rank computes experts [r E/ep, (r+1) E/ep) of every MoE
  // block for the tokens of the whole ep group (nullptr or one rank: all experts). Every rank
  // still holds all parameters; foreign_expert_ranges() are the flat ranges of the experts it
  // does not compute (their gradients stay zero here; the optimizer skips them), and
  // own_expert_ranges() those it does (both empty without expert parallelism).
  void set_expert_parallel(Communicator* ep);
  Communicator* expert_parallel() const { return ep_; }
  Communicator* context_parallel() const { return cp_.comm; }
  RangeSet foreign_expert_ranges() const { return expert_ranges(false); }
  // Frozen parameters (model.lora(): every base weight, the flat range before the adapters):
  // backward writes no gradient there and zero_grads() leaves it alone, so its gradient pages
  // are never touched; the optimizer skips it. Empty without LoRA.
  RangeSet frozen_ranges() const;
  // QLoRA (peft.quantize_base, docs/finetune.md; model/frozen_base.h): every block's four linear
  // weights (the frozen base's matrices) stored in NF4, dequantized on the fly by the linear
  // layers; their fp32 elements get the dequantized values, then their pages are released
  // (release_base) until materialize_base writes them again (before a checkpoint or decoding).
  // Needs LoRA, the nf4 capability, host-readable parameters, no MoE or MLA.
  void quantize_base();
  // The same, each weight read by `read` (from the weights the run starts from) and quantized in
  // turn, never in the fp32 parameters (which stay untouched, so with ModelUse::lazy_params they
  // hold no memory until materialize_base): a big model's base is never held in fp32.
  void load_quantized_base(const FrozenBase::WeightRead& read);
  // LoRA with precision.param = bf16 (FrozenBase::keeps_bf16): the block matrices and an untied
  // head are kept only in the bf16 copy the layers read (nothing computed changes), their fp32
  // pages released as QLoRA's are; sync_weight_copy leaves them alone. load_bf16_base: each read
  // by `read` straight into the copy, the fp32 elements never written. After set_precision.
  void keep_base_bf16();
  void load_bf16_base(const FrozenBase::WeightRead& read);
  void materialize_base() { base_.materialize(); }
  const FrozenBase& frozen_base() const { return base_; }  // one weight at a time: covers, materialize, release
  void release_base() { base_.release(); }
  // The NF4 weights: their element count and bytes (nf4_bytes of each); 0 without QLoRA.
  int64_t quantized_params() const { return base_.bf16() ? 0 : base_.params(); }
  int64_t quantized_bytes() const { return base_.bf16() ? 0 : base_.bytes(); }
  bool base_streamed() const { return base_.streamed(); }  // by load_quantized_base or load_bf16_base
  RangeSet own_expert_ranges() const { return expert_ranges(true); }
  std::vector<std::pair<int64_t, int64_t>> tp_partial_ranges() const;
  Communicator* tensor_parallel() const { return tp_; }
  // Each block's plan (nn/plan.h): its attention and MLP kinds, tp / sp.
  std::vector<LayerPlan> layer_plans() const;
  // Pipeline stages (parallel/pipeline.h): layers [first, last), with the embedding when
  // first == 0 and the final norm, head and loss when last == n_layer. A stage's store holds
  // only its layers' activations (and split-backward buffers for zero-bubble schedules), plus
  // its output: store.blocks[last].input, the next stage's store.blocks[last].input. Backward
  // of a stage that is not the last starts from d(output) in stage_grad() and leaves d(input)
  // there; forward() and backward() are the one-stage case.
  ActivationStore allocate_stage_store(int64_t batch, int64_t seq_len, int64_t first, int64_t last, bool split_backward);
  double forward_stage(ActivationStore& store, int64_t first, int64_t last, bool compute_loss = true);
  void backward_stage(ActivationStore& store, int64_t first, int64_t last, float loss_weight, BackwardPart part,
                      const std::function<void(int64_t)>& ready = {});
  // (B, T, C) for a store of (batch, seq_len) (store.batch, store.seq_len): the positions this
  // rank holds of the residual stream (1/tp of seq_len under sequence parallel).
  Tensor stage_grad(int64_t batch, int64_t seq_len) const;
  // Parameter use hooks of forward() and backward() (not of forward_rows); empty: none.
  void set_param_use_hooks(ParamUseHooks hooks) { hooks_ = std::move(hooks); }
  // The flat ranges [begin, end) of each unit the hooks name: [unit] -> ranges.
  const std::vector<RangeSet>& param_units() const { return units_; }

  // The precision policy (precision/policy.h): each linear layer's recipe, and the weights'
  // bf16 copy when policy.param_bf16 (allocated here; sync_weight_copy() refreshes it and must
  // run after the weights change: the trainer does, every step). Default: all fp32.
  void set_precision(const PrecisionPolicy& policy);
  const PrecisionPolicy& precision() const { return policy_; }
  void sync_weight_copy();
  // Once per optimizer step: FP8 delayed scaling moves this step's amaxes into the history.
  void end_step();
  // Off during evaluation: forward passes do not record FP8 amaxes.
  void set_recording(bool on);
  bool recording() const { return recording_; }
  // FP8 delayed scaling state of every layer using it (per layer x, w, dy: the amax history,
  // then the amax in use), packed into one flat f32 tensor for checkpoints; undefined when no
  // layer uses delayed scaling. pack_scaling_state() refreshes the tensor from the layers,
  // unpack_scaling_state() puts a loaded tensor back into them (precision/fp8_state.h).
  const Tensor& pack_scaling_state();
  void unpack_scaling_state();
  // Mixture of experts, once per step after the update: the routing statistics of the step's
  // forwards summed over `group` (the data-parallel ranks; nullptr: this process), the
  // auxiliary-loss-free bias update (model.moe_bias_gamma > 0), counters reset (model/moe_stats.h).
  void moe_end_step(Communicator* group);
  const std::vector<MoeLayerStats>& moe_stats() const { return moe_stats_.stats(); }
  // Every linear layer (blocks in order: attn_qkv, attn_out, mlp_in, mlp_out; then the head).
  std::vector<LinearLayer*> linear_layers();
  // The same with each one's weight: its ParamLayout name and its view into params() (the
  // embedding's for a tied head). Dense blocks only (no MoE or MLA).
  using LinearWeight = loom::LinearWeight;  // model/int_weights.h
  std::vector<LinearWeight> linear_weights() {
    return collect_linear_weights(config_, layout_, params_, blocks_, head_, head_w);
  }
  // Post-training-quantized weights (loom quantize, precision/int_quant.h), by parameter name:
  // each named linear layer multiplies with its integer weight from now on (forward and
  // decoding; backward refuses), and the fp32 elements' pages are released (not a tied head's:
  // the embedding still looks tokens up). A name that is not a linear weight, or a shape that
  // differs from the parameter's, is an error naming it (model/int_weights.h).
  void set_int_weights(std::map<std::string, IntWeight> weights);
  // bf16 weights used where they lie (a bf16 checkpoint's, loaded by train/model_source.h
  // open_inference_model), by parameter name: each named linear layer multiplies with its tensor
  // through Backend::bf16_weight_linear from now on (forward and decoding; backward refuses), and
  // the token embedding, when named, is looked up in bf16 (a tied head multiplies with it). The
  // tensors are bf16 of the parameter's shape on this model's backend; the f32 elements are left
  // as they are (never written, on a lazy_params model). A name that is neither, or a shape that
  // differs from the parameter's, is an error naming it.
  void set_bf16_weights(std::map<std::string, Tensor> weights);
  int64_t bf16_weight_params() const;  // elements multiplied in bf16
  int64_t int_weight_params() const { return int_weights_.params(); }  // elements replaced
  // Their stored bytes (codes, scales, zeros, input scales).
  int64_t int_weight_bytes() const { return int_weights_.bytes(); }

 private:
  Backend& backend_;
  ModelConfig config_;
  ParamLayout layout_;
  Tensor params_, grads_;
  std::vector<Block> blocks_;        // [layer]
  std::vector<RangeSet> units_;  // layout_units
  std::vector<int64_t> block_offset_;  // [layer] smallest flat offset of the block's parameters
  int64_t final_offset_ = 0;         // smallest flat offset of the final norm and (untied) head
  Tensor embed_w, pos_w;             // (V,C), (Tmax,C) or undefined
  Tensor final_w, final_b;           // (C), (C) or undefined
  Tensor head_w;                     // (V,C): the embedding when tied
  Tensor d_embed_w, d_pos_w, d_final_w, d_final_b, d_head_w;
  BlockScratch scratch_;             // shared by all micro-batches' backward
  Tensor d_residual_;                // (B,T,C)
  int64_t scratch_tokens_ = 0;       // B*T the scratch is sized for
  PrecisionPolicy policy_;
  Tensor params16_, head16_;         // bf16 copy of params_ (policy_.param_bf16 only), head's view
  LinearLayer head_;
  LinearWorkspace ws_;               // low-precision operands of every linear layer
  Fp8ScalingState scaling_state_;    // see pack_scaling_state()
  std::vector<DelayedScaling*> delayed_scalings();  // of the fp8-delayed linear layers, in their order
  double head_and_loss(ActivationStore& s, bool compute_loss);  // forward_stage's end on the last stage
  // backward_stage's start on the last stage: d(logits) (logits_backward), the head's backward
  // into k.d_norm, then the final norm's into d_res (rounded into d_res16 too where defined: the
  // last block's fc2 reads it, nn/layer.h residual_dy16).
  void head_and_loss_backward(ActivationStore& s, float loss_weight, BlockScratch& k, const Tensor& d_res,
                              const Tensor& d_res16);
  // d(logits) over the logits from the loss and its weights (or the loss pass's, as it left it);
  // returns the tensor that holds it.
  Tensor logits_backward(ActivationStore& s, float loss_weight);
  // backward_stage's end on the first stage: the embedding's and learned positions' gradients
  // from d_res = d(x0) (scaled by embed_scale in place first).
  void embedding_backward(ActivationStore& s, const Tensor& d_res);
  ParamUseHooks hooks_;
  Communicator* tp_ = nullptr;
  struct {
    int64_t begin = 0, valid = 0;
  } vocab_;                          // this slice's vocabulary rows (tensor parallel)
  Tensor ce_sums_;                   // (B*T) scratch of the vocabulary-parallel cross-entropy
  bool sp_ = false;                  // sequence parallel
  SequenceScratch seq_;              // its whole-sequence buffers
  ContextParallel cp_;               // context parallel (cp_.comm set)
  std::vector<RecomputePolicy> recompute_;  // [layer] (empty: none)
  bool recompute_offload_ = false;          // kept fields in MEM_OFFLOADED
  bool flash_ = false;                      // FlashAttention in every block
  BlockSaved recompute_record_;      // the shared full record recomputation fills (activations)
  Tensor recompute_out_;             // (B, T, max(C, H hd)) scratch of the recomputed forward
  MoeScratch moe_scratch_;           // shared by the MoE blocks
  Communicator* ep_ = nullptr;       // expert parallel
  int ep_size() const { return ep_ != nullptr ? ep_->size() : 1; }
  RangeSet expert_ranges(bool own) const;
  int64_t moe_scratch_tokens_ = 0;
  MoeStepStats moe_stats_;           // moe_end_step's
  int64_t shards() const { return sp_ ? tp_->size() : 1; }
  int64_t frozen_end_ = 0;           // [0, frozen_end_) frozen (LoRA's base)
  bool recording_ = true;            // set_recording's
  FrozenBase base_;                  // LoRA's compact frozen base (quantize_base, keep_base_bf16)
  IntWeights int_weights_;           // set_int_weights
  std::map<std::string, Tensor> bf16_weights_;  // set_bf16_weights: the layers read them
  Tensor sink_w_, sink_b_;           // where frozen norms' gradients go (never read)
  static Tensor sink(const Tensor& grad, const Tensor& sink);
  BlockParams frozen_grads(BlockParams g) const;
  // The plan of the full records recomputation fills: a dense block's (MLA's sizes with MLA).
  LayerPlan recompute_record_plan() const;
  // rows: a store of decoding's one-position rows (forward_rows reads its records in fp32).
  // logit_rows > 0: logits for that many rows (allocate_rows) instead of every one.
  ActivationStore allocate_store_for(int64_t batch, int64_t seq_len, int64_t first, int64_t last, bool split_backward,
                                     bool context_parallel, bool recompute = true, bool rows = false,
                                     bool last_logits = false, bool head = true, int64_t logit_rows = 0);
  // Context parallel: f(rows (1, chunk, C) of one sequence, their first global position) for
  // each of x's (B, T/cp, C) two chunks of every sequence.
  void for_each_chunk(const Tensor& x, const std::function<void(const Tensor&, int64_t)>& f) const;
  // f on x (B,T,C) whole, or on each packed document's positions of it (1, L, C).
  void for_each_document(const ActivationStore& s, const Tensor& x, const std::function<void(const Tensor&)>& f) const;
  // Points the blocks [first, last) records of s at s.docs (nullptr when empty) and gives them
  // this pass's LoRA dropout (s.dropout_pass).
  void set_documents(ActivationStore& s, int64_t first, int64_t last);
};

}  // namespace loom
