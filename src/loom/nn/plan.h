// Each layer's plan: which attention and MLP modules a block composes, resolved once from the
// model config and the run's choices (train.flash_attention, parallel.cp_attention, tp / sp,
// train.recompute, the precision recipe of its four linear layers). The block composes its two
// sub-layers by its plan (nn/attention.h, nn/mlp.h); no other code branches on those flags.
//
// Attention kinds (nn/attention.h), one function pair each:
//   mha      probabilities kept (B,H,T,T); MHA / GQA / MQA by n_kv_head
//   flash    FlashAttention-2: each row's log-sum-exp kept instead (Backend::flash_attention_*)
//   ring     context parallel: K/V blocks passed around the cp ring, online softmax (nn/context_parallel.h)
//   ulysses  context parallel: all-to-all from sequence shards to head shards and back
//   mla      multi-head latent attention (nn/mla.h), with its own projections
//   linear   a gated DeltaNet block's token mixer (nn/linear_attention.h; model.linear_interval):
//            linear attention with a recurrent state, its own projections, conv and gates
// A sliding window (model.attn_window) is a mask of mha and flash, not a kind of its own: the
// same kernels skip the masked keys. MLP kinds: dense (GELU / SwiGLU), moe (nn/moe.h).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/arch/config.h"
#include "loom/precision/policy.h"

namespace loom {

// Activation checkpointing (memory/recompute.h): which fields of its BlockSaved a block keeps
// from its forward to its backward; the rest are recomputed (Block::recompute) into a shared
// full record just before the backward.
//   none: all; selective: input, qkv, attn, mid, fc (the residual stream and GEMM outputs),
//   and with FlashAttention lse (B,H,T), so that the attention is not run again;
//   full: input only.
enum RecomputePolicy : uint8_t { RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, RECOMPUTE_FULL, RECOMPUTE_COUNT };

enum class AttentionKind : uint8_t { mha, flash, ring, ulysses, mla, linear };
enum class MlpKind : uint8_t { dense, moe };

struct LayerPlan {
  AttentionKind attention = AttentionKind::mha;
  MlpKind mlp = MlpKind::dense;
  int64_t window = 0;              // model.attn_window: keys older than the window are masked (window_pattern: 0 on global blocks)
  bool rope = true;                // queries and keys rotated (false: gpt2's learned positions, NoPE layers)
  RopeSpec rope_spec;              // their RoPE (ModelConfig::rope(layer): Gemma's local blocks their own base)
  bool tensor_parallel = false;    // heads and MLP width sliced over the tp group
  bool sequence_parallel = false;  // the residual stream on sequence shards (with tensor_parallel)
  RecomputePolicy recompute = RECOMPUTE_NONE;
  // The recipes of the block's linear layers (precision.attn_qkv, attn_out, mlp_in, mlp_out;
  // LinearKind order) and the weights' QAT format (precision.qat).
  std::array<LinearRecipe, 4> linears{RECIPE_F32, RECIPE_F32, RECIPE_F32, RECIPE_F32};
  QatFormat qat = QAT_NONE;
  // Saved activations kept in bf16 (precision.activations = bf16), by the linear layer (LinearKind
  // order) whose input they are: attn_qkv norm1's output, attn_out the attention output, mlp_in
  // norm2's output, mlp_out the activation. Each is true where that layer's recipe is bf16 and
  // nothing else reads the field in fp32: the bf16 recipe rounds its input to bf16 in the forward
  // and again for the weight gradient, so the bf16 copy is what the layer reads in both. Not with
  // LoRA adapters on the layer (they read x in fp32), sequence parallelism (the norms' outputs are
  // gathered in fp32), MLA or MoE (their own projections read the norm's output); the attention
  // output for mha, and for flash with attention_bf16 (no sinks), whose backward then reads O in
  // bf16 for D = rowsum(dO o O), as autocast's attention does (ring attention, and flash in fp32,
  // keep it fp32). The norms, activations and the bf16 flash kernels write these fields rounded
  // themselves; the plain attention writes fp32 into a staging buffer, rounded into the field
  // after (nn/layer.h saved_target / store_saved).
  std::array<bool, 4> saved_bf16{false, false, false, false};
  // The MLP activation's backward writes the first MLP layer's output gradient in bf16, which that
  // layer's bf16 GEMMs read as it is (and its bias gradient sums, as autocast's): with
  // precision.activations = bf16 where mlp_in's recipe is bf16, the MLP dense and no LoRA adapter
  // on it (which reads the gradient in fp32). Not in a split backward (zero-bubble keeps it fp32).
  bool mlp_in_dy_bf16 = false;
  // The MLP's first layer writes its output (fc: the activation's input, kept for its backward)
  // in bf16, as autocast's linear returns it, and the activation reads it widened: with
  // precision.outputs = bf16 where mlp_in's recipe is bf16, the MLP dense and no LoRA adapter on it
  // (which adds its term to an fp32 output). Decoding's records keep it fp32.
  bool fc_bf16 = false;
  // The MLP's GELU inside its GEMMs (Backend::gemm_gelu / gemm_dgelu: cuBLASLt's GELU_AUX_BIAS and
  // DGELU epilogues on CUDA; elsewhere the GEMM, then the GELU op, as before). fc_gelu: fc's GEMM
  // writes its output (the GELU's input, kept) and the activation at once; with a GELU MLP (not
  // gated), fc_bf16 and the activation saved in bf16, not under selective recompute (which takes
  // the activation again from fc's kept output with gelu_forward: the forward takes it so too,
  // where a device's epilogue takes it of the unrounded sum). fc2_dgelu: fc2's input-gradient GEMM writes
  // the GELU input's gradient (mlp_in_dy_bf16) at once, reading fc's output as kept; with a GELU
  // MLP, fc_bf16, mlp_in_dy_bf16 and fc2 in bf16 without a LoRA adapter (its term adds to d(act)).
  bool fc_gelu = false;
  bool fc2_dgelu = false;
  // The same for the QKV projection: the bf16 flash attention's backward writes d(qkv) in bf16
  // (flash with attention_bf16, activations bf16, attn_qkv's recipe bf16, no LoRA on it), where
  // nothing rewrites d(qkv) between them: no RoPE (GPT-2's learned positions, NoPE layers), q/k
  // norms, sinks or output gate. Not in a split backward.
  bool qkv_dy_bf16 = false;
  // The record keeps qkv in bf16, which the bf16 flash kernels read as it is (the bits they would
  // round an fp32 qkv to): with precision.outputs = bf16, flash with attention_bf16. The QKV
  // projection writes it so, as autocast's linear returns it, where nothing rewrites qkv before
  // the attention; under RoPE, q/k norms or a LoRA adapter on qkv the projection, the norms and
  // RoPE run on an fp32 staging of its output, rounded into the record after (nn/attention.cpp).
  // Decoding's and inference's records keep it fp32 (the KV cache stores from them).
  bool qkv_bf16 = false;
  // The output projection's backward writes the attention output's gradient dO in bf16 (autocast's
  // d(input) of a bf16 linear), which the bf16 flash backward reads as it is (D = rowsum(dO o O)
  // of the bf16 dO): with precision.outputs = bf16, flash with attention_bf16, attn_out's recipe
  // bf16, no LoRA on it (its term adds to an fp32 gradient), no sinks or output gate (they rewrite
  // dO). Not in a split backward.
  bool attn_dy_bf16 = false;
  // The output gradients of the output projection (proj_dy_bf16) and of the MLP's second layer
  // (fc2_dy_bf16) are the residual stream's gradient, kept fp32; the norm backward that finalises
  // it (accumulating into the stream) also writes it rounded to bf16 (Backend::layernorm_backward's
  // dx16: the bits the cast gives), which the layer's bf16 GEMMs read instead of a cast of their
  // own; its bias gradient still sums the fp32 one, so no bit changes. proj's comes from norm2's
  // backward in the same block, fc2's from the next block's norm1 backward or the final norm's.
  // With precision.activations = bf16 where the layer's recipe is bf16, no output norms
  // (post_norms: its gradient is the norm's), no sequence parallelism (it is gathered in fp32), no
  // LoRA adapter on it, a dense MLP. Not in a split backward. The flag of the layer that reads it
  // decides; the norm before writes where it says (nn/layer.h residual_dy16).
  bool proj_dy_bf16 = false;
  bool fc2_dy_bf16 = false;
  // precision.attention = bf16 on the plain or flash attention without a window (Backend::
  // attention_forward_bf16 / _backward_bf16, flash_attention_forward_bf16 / _backward_bf16);
  // windowed, context-parallel and MLA attention keep their fp32 GEMMs.
  bool attention_bf16 = false;
  // model.attn_output_gate: the heads' outputs gated by sigmoid(x W_gate) before o_proj.
  bool output_gate = false;
  // model.attn_sinks (GPT-OSS): flash attention's output scaled by sigmoid(lse - sink) per head
  // (Backend::attention_sink_*).
  bool sinks = false;
  // A linear-attention block under context parallelism: its recurrent state relayed from rank to
  // rank in sequence order, each of this rank's two chunks a span of its own (nn/linear_attention.h).
  bool context_parallel = false;
};

const char* attention_kind_name(AttentionKind kind);
const char* mlp_kind_name(MlpKind kind);

// The run's choices a plan is resolved from.
struct PlanChoices {
  bool flash = false;  // train.flash_attention
  enum Context : uint8_t { NONE, RING, ULYSSES } context = NONE;  // parallel.cp > 1 and its algorithm
  bool tensor_parallel = false, sequence_parallel = false;
  RecomputePolicy recompute = RECOMPUTE_NONE;
  std::array<LinearRecipe, 4> linears{RECIPE_F32, RECIPE_F32, RECIPE_F32, RECIPE_F32};  // the precision policy's
  QatFormat qat = QAT_NONE;
  bool activations_bf16 = false;  // precision.activations = bf16
  bool outputs_bf16 = false;      // precision.outputs = bf16
  bool attention_bf16 = false;    // precision.attention = bf16
};

// The precision policy's part of the choices: the block linears' recipes, QAT, saved activations.
void choose_precision(PlanChoices& choices, const PrecisionPolicy& policy);

// The plan of `layer`; throws naming the keys for a combination no module implements (the
// layout's compatibility table, train/layout.h, refuses those first for a whole run).
LayerPlan resolve_layer_plan(const ModelConfig& config, int64_t layer, const PlanChoices& choices);

// "6 x attention flash + mlp dense" style summary of a model's plans, for the run header.
std::string describe_plans(const std::vector<LayerPlan>& plans);

}  // namespace loom
