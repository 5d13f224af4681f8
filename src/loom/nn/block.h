// A transformer block with explicit forward and backward (llm.c style; no autograd tape):
//   x (B,T,C) -> mid = x + proj(attention(rope(qkv(norm1(x)))))      the attention sub-layer (nn/attention.h)
//             -> out = mid + fc2(act(fc(norm2(mid))))  or  + MoE(...)  the MLP sub-layer (nn/mlp.h)
// norm is LayerNorm or RMSNorm, act is GELU or SwiGLU, rope only for RoPE models (ModelConfig).
// The block resolves its plan (nn/plan.h) from the config and the layout's choices and composes
// the two sub-layers, each with its own Saved record, one per micro-batch.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"
#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/nn/attention.h"
#include "loom/nn/layer.h"
#include "loom/nn/linear.h"
#include "loom/nn/linear_attention.h"
#include "loom/nn/mlp.h"
#include "loom/nn/plan.h"

namespace loom {

// One block's parameters (or their gradients) as views into a flat buffer, by sub-layer.
// Derived once from the layout, so forward and backward use the same offsets.
struct BlockParams {
  AttentionParams attention;  // not of a linear-attention block
  GatedDeltaNetParams linear;  // a linear-attention block's token mixer (model.linear_interval)
  MlpParams mlp;
};

BlockParams block_params_view(const ModelConfig& config, const ParamLayout& layout, const Tensor& flat, int64_t layer);

// Activations one block keeps for its backward, for one micro-batch: its input, the residual
// stream between the sub-layers, and each sub-layer's record.
struct BlockSaved {
  Tensor input;  // (B,Ts,C) residual stream entering the block
  AttentionSaved attention;
  GatedDeltaNetSaved linear;  // a linear-attention block's, in place of attention's
  Tensor mid;    // (B,Ts,C) residual after attention
  MlpSaved mlp;
};

// The inputs of the block's four linear layers in a forward's record, in LinearKind order
// (attn_qkv, attn_out, mlp_in, mlp_out): the input norms' outputs, or with model.post_norm (OLMo 2)
// the residual stream the projections read (the block input, mid). Calibration reads them.
std::array<Tensor, 4> block_linear_inputs(const ModelConfig& config, const BlockSaved& saved);

// A whole record for a block that keeps only `policy`'s fields: kept's tensors where it has them
// (input; selective also qkv, attn, mid, fc, and lse with flash), the shared record's elsewhere. The forward writes
// through it (the unkept fields land in the shared record, overwritten by the next block).
BlockSaved with_kept(const BlockSaved& shared, const BlockSaved& kept, RecomputePolicy policy);

// The record of a block of `plan` for `shape` (nn/layer.h): the input, each sub-layer's fields,
// mid (activation checkpointing: only the fields shape.keep keeps).
BlockSaved allocate_block_saved(Allocator& allocator, const ModelConfig& config, const LayerPlan& plan,
                                const SavedShape& shape);
// The bytes allocate_block_saved allocates for the same arguments, without allocating: the
// allocation and this count walk one list of fields (memory/estimate.h plans real sizes with it).
int64_t block_saved_bytes(const ModelConfig& config, const LayerPlan& plan, const SavedShape& shape);

class Block {
 public:
  // `layer`: the block's index (its plan's MLP kind: model.moe_dense_layers).
  Block(const ModelConfig& config, int64_t layer, BlockParams params, BlockParams grads);
  // Which attention and MLP modules this block runs (nn/plan.h), resolved from the model config
  // and the setters below whenever one of them changes.
  const LayerPlan& plan() const { return plan_; }

  // saved.input must hold the block input; writes out (B,T,C) and the rest of `saved`.
  void forward(Backend& backend, BlockSaved& saved, const Tensor& out);
  // One position of each of n independent sequences (saved: an n-row, T = 1 record): row r at
  // position positions[r]. After the norm, the QKV projection and RoPE at each row's position,
  // the rows go to the host (cache.host_qkv) and cache.attend(layer, r, q, k, v, out) stores row
  // r's key and value and writes its attention output over the row's sequence (the caller keeps
  // the caches, in host memory: infer/); the outputs go back to the backend. Then as forward().
  // MLA: cache.latent(layer, r, [c' | k_r], &count) stores the row's latent and returns the
  // visible ones; the attention is computed from them with W_uk absorbed (nn/mla.h).
  void forward_rows(Backend& backend, BlockSaved& saved, const Tensor& out, const std::vector<int64_t>& positions,
                    DecodeCache& cache, int64_t layer) const;
  // d_residual (B,T,C): gradient w.r.t. the block output on entry, w.r.t. its input on exit.
  // Parameter gradients accumulate. r16 (nn/layer.h ResidualDy16): `in`, d(output) rounded to bf16
  // for fc2 (LayerPlan::fc2_dy_bf16; written by the norm backward after this block), `out`, where
  // norm1's backward writes d(input)'s rounding for the block before's fc2 (residual_dy16 of its plan).
  void backward(Backend& backend, const BlockSaved& saved, const Tensor& d_residual, BlockScratch& scratch,
                BackwardPart part = BACKWARD_ALL, const ResidualDy16& r16 = {});
  // The precision policy's recipes for the four linear layers. params16 holds views into the
  // weights' bf16 copy when the policy keeps one (precision.param = bf16), else is empty.
  void set_precision(const PrecisionPolicy& policy, BlockParams params16, LinearWorkspace* workspace);
  // Tensor parallel (Megatron): this block is one rank's slice of heads and MLP width; the
  // row-parallel outputs are all-reduced over `tp` in forward (g) and the column-parallel
  // inputs' gradients in backward (f). nullptr: a whole block.
  // With `sequence` (sequence parallel, Korthikanti et al. 2022) the block's residual stream is
  // this rank's sequence shard, gathered into sequence->full around the tensor-parallel layers.
  void set_tensor_parallel(Communicator* tp, SequenceScratch* sequence = nullptr);
  // Context parallel: attention across the cp group's sequence shards (ring or Ulysses); RoPE at
  // this rank's global positions.
  void set_context_parallel(ContextParallel* cp);
  // FlashAttention (train.flash_attention; Dao 2023): the attention runs the backend's
  // flash_attention_forward / flash_attention_backward and the record keeps lse (B,H,T) instead
  // of probs (B,H,T,T) (allocate_block_saved with flash). Not with MLA or context parallelism,
  // which compute their own attention (nn/mla.h, nn/context_parallel.h).
  void set_flash_attention(bool on);
  // Activation checkpointing: what this block keeps of its forward (memory/recompute.h).
  void set_recompute(RecomputePolicy policy);
  bool flash_attention() const { return plan_.attention == AttentionKind::flash; }
  // Activation checkpointing: `kept` holds what `policy` kept of this block's forward; fills
  // `full` (a whole record: its fields, or views of kept's where kept has them) with every field
  // the backward reads, by running again the forward pieces that made the missing ones (the
  // whole forward for RECOMPUTE_FULL, writing its output into out_scratch). Same ops, same
  // inputs: the values are bitwise those of the first forward.
  void recompute(Backend& backend, const BlockSaved& kept, RecomputePolicy policy, BlockSaved& full,
                 const Tensor& out_scratch);
  // attn_qkv, attn_out, mlp_in, mlp_out.
  std::array<LinearLayer*, 4> linears() { return {attention_.qkv(), attention_.proj(), mlp_.fc(), mlp_.fc2()}; }

  // Mixture of experts (nn/mlp.h, nn/moe.h): this block's MLP is an MoE layer. The scratch is
  // shared by the blocks; the loss weight scales the auxiliary losses' gradients in backward.
  bool is_moe() const { return mlp_.is_moe(); }
  void set_moe_scratch(MoeScratch* scratch) { mlp_.set_moe_scratch(scratch); }
  // Expert parallel (nn/moe.h): this rank computes its share of the experts for the group's tokens.
  void set_expert_parallel(Communicator* ep) { mlp_.set_expert_parallel(ep); }
  void set_loss_weight(float w) { mlp_.set_loss_weight(w); }
  using MoeStats = MlpLayer::MoeStats;
  MoeStats& moe_stats() { return mlp_.moe_stats(); }
  void set_recording(bool on) { mlp_.set_recording(on); }
  const Tensor& moe_bias() const { return mlp_.moe_bias(); }

 private:
  ModelConfig config_;
  int64_t layer_ = 0;
  PlanChoices choices_;  // what the setters chose; plan_ is resolved from them
  LayerPlan plan_;
  LayerLinks links_;     // the layout's groups and buffers, given to both sub-layers
  AttentionLayer attention_;
  std::shared_ptr<GatedDeltaNet> linear_;  // a linear-attention block's mixer (attention_ unused)
  MlpLayer mlp_;
  void replan(const PlanChoices& choices);
  void relink(const LayerLinks& links);
};

}  // namespace loom
