// A transformer block with explicit forward and backward (llm.c style; no autograd tape).
//   x (B,T,C) -> mid = x + proj(attention(rope(qkv(norm1(x)))))
//             -> out = mid + fc2(act(fc(norm2(mid))))
// norm is LayerNorm or RMSNorm, act is GELU or SwiGLU, rope only for RoPE models (ModelConfig).
// What the backward needs is kept in an explicit BlockSaved record, one per micro-batch.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"
#include "loom/nn/context_parallel.h"
#include "loom/nn/linear.h"
#include "loom/nn/mla.h"
#include "loom/nn/moe.h"
#include "loom/nn/plan.h"

namespace loom {

// One block's parameters (or their gradients) as views into a flat buffer. Derived once from
// the layout, so forward and backward use the same offsets. Biases and norm biases are
// undefined tensors for bias-free architectures. An MLA block (model.mla_kv_rank > 0) has mla's
// projections in place of qkv.
struct BlockParams {
  Tensor norm1_w, norm1_b;  // (C)
  Tensor qkv_w, qkv_b;      // ((H + 2 KV) hd, C), ((H + 2 KV) hd)
  MlaParams mla;            // MLA: queries, latent, decoupled RoPE key and up-projections (nn/mla.h)
  Tensor proj_w, proj_b;    // (C, H hd), (C); MLA: (C, H d_v)
  Tensor norm2_w, norm2_b;  // (C)
  Tensor fc_w, fc_b;        // (F or 2F, C), (F or 2F)
  Tensor fc2_w, fc2_b;      // (C, F), (C)
  MoeParams moe;            // an MoE block (model.moe_*): its router and experts in place of fc, fc2
};

BlockParams block_params_view(const ModelConfig& config, const ParamLayout& layout, const Tensor& flat, int64_t layer);

// Activations one block keeps for its backward, for one micro-batch.
struct BlockSaved {
  Tensor input;                  // (B,T,C) residual stream entering the block
  Tensor norm1, mean1, rstd1;    // (B,T,C), (B,T), (B,T); mean1 unused for RMSNorm
  Tensor qkv;                    // (B,T,(H+2KV)hd), after RoPE; not for MLA
  // MLA (nn/mla.h) in place of qkv: the query latent and its norm (d_q > 0), the queries after
  // RoPE, the KV latent and its norm, the decoupled RoPE key, the per-head [k_n | v].
  Tensor mla_qa, mla_qa_norm, mla_qa_rstd;  // (B,T,d_q), (B,T,d_q), (B,T)
  Tensor mla_q;                             // (B,T,H (d_n + d_r))
  Tensor mla_c, mla_c_norm, mla_c_rstd;     // (B,T,d_c), (B,T,d_c), (B,T)
  Tensor mla_kr;                            // (B,T,d_r)
  Tensor mla_kv;                            // (B,T,H (d_n + d_v))
  Tensor probs;                  // (B,H,T,T); not kept with FlashAttention or context parallel (lse)
  Tensor attn;                   // (B,T,H hd); MLA: (B,T,H d_v)
  Tensor mid;                    // (B,T,C) residual after attention
  Tensor norm2, mean2, rstd2;    // (B,T,C), (B,T), (B,T)
  Tensor fc;                     // (B,T,F or 2F) pre-activation
  Tensor act;                    // (B,T,F)
  // Only for a backward split into input and weight gradients (zero-bubble pipelines): the
  // output gradients of the four linear layers, kept from the input pass for the weight pass.
  Tensor dy_fc2, dy_fc, dy_proj, dy_qkv;  // (B,T,C), (B,T,F or 2F), (B,T,C), (B,T,(H+2KV)hd)
  // The attention rows' log-sum-exp (B,H,T), kept instead of probs by FlashAttention
  // (Block::set_flash_attention) and by context parallel ring attention (T is then this rank's
  // T/cp positions); Ulysses keeps its own record.
  Tensor lse;
  UlyssesSaved ulysses;
  MoeSaved moe;  // an MoE block: its routing and experts' activations (fc, act unused)
};

// A whole record for a block that keeps only `policy`'s fields: kept's tensors where it has them
// (input; selective also qkv, attn, mid, fc, and lse with flash), the shared record's elsewhere. The forward writes
// through it (the unkept fields land in the shared record, overwritten by the next block).
BlockSaved with_kept(const BlockSaved& shared, const BlockSaved& kept, RecomputePolicy policy);

// Which part of a block's backward to run: all of it, the input gradient (and the norms' and
// biases' gradients) keeping the linear layers' output gradients, or the linear layers'
// weight gradients from those (Qi et al., "Zero Bubble Pipeline Parallelism", 2024: B and W).
enum BackwardPart : uint8_t { BACKWARD_ALL, BACKWARD_INPUT, BACKWARD_WEIGHT };

// seq_shards > 1 (sequence parallel): the residual stream and the norms (input, norm1/2,
// their statistics, mid) hold seq_len / seq_shards positions; the rest the whole sequence.
// context_parallel: seq_len is this rank's share; ring attention's lse instead of probs.
// moe: an MoE block (its routing and experts' buffers, allocate_moe_saved over an expert-parallel
// group of ep ranks, instead of fc and act).
// flash: FlashAttention (Block::set_flash_attention): lse (B,H,T) instead of probs (B,H,T,T).
BlockSaved allocate_block_saved(Allocator& allocator, const ModelConfig& config, int64_t batch, int64_t seq_len,
                                bool split_backward = false, int64_t seq_shards = 1, bool context_parallel = false,
                                bool moe = false, RecomputePolicy keep = RECOMPUTE_NONE,
                                MemCategory category = MEM_ACTIVATIONS, int ep = 1, bool flash = false);
// The bytes allocate_block_saved allocates for the same arguments, without allocating: the
// allocation and this count walk one list of fields (memory/estimate.h plans real sizes with it).
int64_t block_saved_bytes(const ModelConfig& config, int64_t batch, int64_t seq_len, bool split_backward = false,
                          int64_t seq_shards = 1, bool context_parallel = false, bool moe = false,
                          RecomputePolicy keep = RECOMPUTE_NONE, int ep = 1, bool flash = false);

// Whole-sequence (B,T,C) buffers a sequence-parallel block gathers into (shared by the blocks).
struct SequenceScratch {
  Tensor full, staging;
};

// Context parallel (nn/context_parallel.h): the group, the attention algorithm, this rank's
// global positions (zig-zag chunks), and split q/k/v buffers shared by the blocks.
struct ContextParallel {
  Communicator* comm = nullptr;
  bool ulysses = false;                // else ring attention
  std::vector<int64_t> chunk_starts;   // global position of each of this rank's 2 chunks
  Tensor q, k, v, dq, dk, dv, chunk;   // (B,T/cp,H hd), (B,T/cp,KV hd) x2, same, chunk (B,T/2cp,W)
  CpWorkspace work;                    // the attention calls' buffers (allocated with the store)
};

// Activation-gradient scratch shared by all blocks of a backward pass (overwritten each use).
struct BlockScratch {
  Tensor d_norm;  // (B,T,C)
  Tensor d_tmp;   // (B,T,C)
  Tensor d_qkv;   // (B,T,(H+2KV)hd); MLA: (B,T,w) holding mla_backward's scratch
  Tensor d_attn;  // (B,T,H hd); MLA: (B,T,H d_v)
  Tensor d_fc;    // (B,T,F or 2F)
  Tensor d_act;   // (B,T,F)
};

BlockScratch allocate_block_scratch(Allocator& allocator, const ModelConfig& config, int64_t batch, int64_t seq_len);

// Normalisation of the configured kind (LayerNorm or RMSNorm) over the last dim.
void norm_forward(Backend& backend, const ModelConfig& config, const Tensor& x, const Tensor& weight,
                  const Tensor& bias, const Tensor& out, const Tensor& mean, const Tensor& rstd);
void norm_backward(Backend& backend, const ModelConfig& config, const Tensor& dout, const Tensor& x,
                   const Tensor& weight, const Tensor& mean, const Tensor& rstd, const Tensor& dx,
                   const Tensor& dweight, const Tensor& dbias);

// The KV caches of the sequences a decoding step runs (Block::forward_rows), kept by the caller
// (infer/engine.h), one row per sequence.
class DecodeCache {
 public:
  virtual ~DecodeCache() = default;
  // MHA / GQA / MQA: stores row r's key and value (n_kv_head x head_dim each, after RoPE) as the
  // newest position of its sequence in `layer`, and writes the attention of q (n_head x
  // head_dim) over the sequence's visible positions (model.attn_window) to out (n_head x head_dim).
  virtual void attend(int64_t layer, int64_t row, const float* q, const float* k, const float* v, float* out) = 0;
  // MLA: stores row r's compressed latent [c' | k_r] (nn/mla.h: the normed latent and the RoPE
  // key at the row's position) (the cache's k_width floats) as the newest position of
  // its sequence in `layer` and returns every position's latent of the sequence, (*count,
  // k_width), dequantized, valid until the next call (the block applies model.attn_window).
  virtual const float* latent(int64_t layer, int64_t row, const float* latent, int64_t* count) = 0;

  // Host staging of Block::forward_rows (MHA / GQA / MQA), reused across layers and steps: the
  // step's (n, qkv_width) rows read from the backend in one Backend::read, and the (n, n_head x
  // head_dim) attention outputs written back in one Backend::write, so the caches run on host
  // rows whatever memory the backend's tensors live in.
  std::vector<float> host_qkv, host_attn;
};

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
  // Parameter gradients accumulate.
  void backward(Backend& backend, const BlockSaved& saved, const Tensor& d_residual, BlockScratch& scratch,
                BackwardPart part = BACKWARD_ALL);
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
  std::array<LinearLayer*, 4> linears() { return {&qkv_, &proj_, &fc_, &fc2_}; }

  // Mixture of experts (nn/moe.h): this block's MLP is an MoE layer (its experts and router
  // compute in fp32 whatever the precision policy). The scratch is shared by the blocks; the
  // loss weight scales the auxiliary losses' gradients in backward (the cross-entropy's).
  bool is_moe() const { return params_.moe.defined(); }
  void set_moe_scratch(MoeScratch* scratch) { moe_scratch_ = scratch; }
  // Expert parallel (nn/moe.h): this rank computes its share of the experts for the group's tokens.
  void set_expert_parallel(Communicator* ep) { ep_ = ep; }
  void set_loss_weight(float w) { loss_weight_ = w; }
  // Routing statistics accumulated over the forwards since the last reset (while recording).
  struct MoeStats {
    std::vector<double> load;  // [expert] assignments
    int64_t tokens = 0, dropped = 0, micro_batches = 0, dispatched = 0;
    double aux = 0, seq_aux = 0, z = 0, entropy = 0;  // sums over micro-batches
    void reset() {  // to no micro-batches, keeping load's capacity
      std::vector<double> kept = std::move(load);
      kept.clear();
      *this = MoeStats{};
      load = std::move(kept);
    }
  };
  MoeStats& moe_stats() { return moe_stats_; }
  void set_recording(bool on) { recording_ = on; }
  const Tensor& moe_bias() const { return params_.moe.bias; }

 private:
  ModelConfig config_;
  BlockParams params_;
  BlockParams grads_;
  BlockParams params16_;
  LinearLayer qkv_, proj_, fc_, fc2_;
  LinearWorkspace* ws_ = nullptr;
  Communicator* tp_ = nullptr;
  SequenceScratch* seq_ = nullptr;  // set: sequence parallel
  ContextParallel* cp_ = nullptr;   // set: context parallel
  int64_t layer_ = 0;
  PlanChoices choices_;  // what the setters chose; plan_ is resolved from them
  LayerPlan plan_;
  void replan(const PlanChoices& choices);
  MoeScratch* moe_scratch_ = nullptr;
  Communicator* ep_ = nullptr;
  float loss_weight_ = 1.0f;
  MoeStats moe_stats_;
  bool recording_ = true;
  void rope(Backend& backend, const Tensor& qkv, bool backward) const;
  // MLA's activations as views of a record.
  static MlaActivations mla_activations(const BlockSaved& s);
  // MLA decoding (T = 1): the projections at each row's position, the row's [c' | k_r] stored
  // (cache.latent) and its attention over the visible latents (the window's) into saved.attn.
  void mla_rows(Backend& backend, BlockSaved& s, const std::vector<int64_t>& positions, DecodeCache& cache,
                int64_t layer) const;
  // The whole sequence of a shard (B, T/t, C), gathered into seq_->full as (B, T, C).
  Tensor gathered(Backend& backend, const Tensor& shard, int64_t seq_len) const;
};

}  // namespace loom
