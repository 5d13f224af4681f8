// What the two sub-layers of a block (nn/attention.h, nn/mlp.h) share: the pre-norm, the
// links to the model-parallel groups and buffers a layout gives them, the activation-gradient
// scratch of a backward pass, the split of a backward into input and weight passes, and the
// description of an activation record's size.
//
// Each sub-layer is pre-norm and residual: x -> x + f(norm(x)). It keeps what its backward
// needs in its own Saved record and runs forward, backward (whole, or an input and a weight
// pass) and, where it supports activation checkpointing, a recompute of what it did not keep.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "loom/arch/config.h"
#include "loom/backend/backend.h"
#include "loom/core/error.h"
#include "loom/comm/communicator.h"
#include "loom/nn/context_parallel.h"
#include "loom/nn/linear.h"
#include "loom/nn/lora.h"
#include "loom/nn/plan.h"

namespace loom {

// A pre-norm's output and statistics: out (B,T,C), mean (B,T) (LayerNorm only), rstd (B,T).
struct NormSaved {
  Tensor out, mean, rstd;
};

// Normalisation of the configured kind (LayerNorm or RMSNorm) over the last dim.
void norm_forward(Backend& backend, const ModelConfig& config, const Tensor& x, const Tensor& weight,
                  const Tensor& bias, const Tensor& out, const Tensor& mean, const Tensor& rstd);
// dx16: undefined, or dx's final values rounded to bf16 (Backend::layernorm_backward's).
void norm_backward(Backend& backend, const ModelConfig& config, const Tensor& dout, const Tensor& x,
                   const Tensor& weight, const Tensor& mean, const Tensor& rstd, const Tensor& dx,
                   const Tensor& dweight, const Tensor& dbias, bool accumulate = false, const Tensor& dx16 = Tensor{});

// Which part of a backward to run: all of it, the input gradient (and the norms' and biases'
// gradients) keeping the linear layers' output gradients, or the linear layers' weight
// gradients from those (Qi et al., "Zero Bubble Pipeline Parallelism", 2024: B and W).
enum BackwardPart : uint8_t { BACKWARD_ALL, BACKWARD_INPUT, BACKWARD_WEIGHT };

// A sub-layer's input gradient pass (BACKWARD_ALL or BACKWARD_INPUT): in a split input pass the
// linear layers' weight gradients are left out (dw gives no tensor) and their output gradients
// kept for the weight pass (keep copies them into the record).
struct InputPass {
  Backend& backend;
  bool split = false;
  Tensor dw(const Tensor& grad) const { return split ? Tensor{} : grad; }
  void keep(const Tensor& dy, const Tensor& into) const {
    if (split) backend.copy(dy, into);
  }
};
// Checks that a split pass (input or weight) has the record's kept output gradients (`kept`:
// one of them), naming what is missing.
InputPass input_pass(Backend& backend, BackwardPart part, const Tensor& kept);

// The size of one block's activation record. seq_len: the positions this rank computes
// attention and the MLP over (context parallel: its share of the sequence). seq_shards > 1
// (sequence parallel): the residual stream and the norms hold seq_len / seq_shards positions.
// split_backward: the linear layers' output gradients are kept for a weight pass. keep: which
// fields activation checkpointing keeps (nn/plan.h). ep: the MoE's expert-parallel group size.
struct SavedShape {
  int64_t batch = 0, seq_len = 0;
  int64_t seq_shards = 1;
  bool split_backward = false;
  RecomputePolicy keep = RECOMPUTE_NONE;
  int ep = 1;
  MemCategory category = MEM_ACTIVATIONS;
};

// Called once for each field a record allocates, with its shape and dtype (fp32, or bf16 for
// the fields LayerPlan::saved_bf16 names), in allocation order; allocation and byte counting
// walk the same list.
using SavedFieldFn = std::function<void(Tensor& field, Shape shape, DType dtype)>;

// The dtype of the saved input of the block's linear layer `kind` (LayerPlan::saved_bf16).
inline DType saved_dtype(const LayerPlan& plan, LinearKind kind) {
  return plan.saved_bf16[static_cast<size_t>(kind)] ? DTYPE_BF16 : DTYPE_F32;
}

// A saved field in bf16 is written rounded by the op that produces it where the op takes a bf16
// output (the norms and activations: Backend::layernorm_forward ... glu_forward); otherwise (the
// plain attention's output) it is computed in fp32 and rounded into it: saved_target gives the
// fp32 tensor the kernel writes (the field itself when it is fp32, else the workspace's staging
// slot S viewed to its shape), store_saved rounds that into the field (nothing when it is the field).
// saved_f32 gives a field to an fp32 reader: itself, or widened into the staging slot. The slot
// holds one field at a time, between a kernel and the next store_saved (or until the reader is done).
Tensor saved_target(const Tensor& field, LinearWorkspace* ws);
void store_saved(Backend& backend, const Tensor& target, const Tensor& field);
Tensor saved_f32(Backend& backend, const Tensor& field, LinearWorkspace* ws);
// norm_forward into a record's NormSaved, whose out may be kept in bf16 (the kernel rounds it).
void norm_forward_saved(Backend& backend, const ModelConfig& config, const Tensor& x, const Tensor& weight,
                        const Tensor& bias, const NormSaved& norm);

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

// What the layout gives a sub-layer: the tensor-parallel group (nullptr: a whole layer), the
// sequence-parallel buffers (nullptr: the residual stream is whole), the context-parallel group
// and buffers (attention only), and the low-precision linear layers' shared workspace.
struct LayerLinks {
  Communicator* tp = nullptr;
  SequenceScratch* seq = nullptr;
  ContextParallel* cp = nullptr;
  LinearWorkspace* ws = nullptr;

  // The whole sequence (B, T, C) of a sequence shard (B, T/t, C), gathered into seq->full; the
  // shard itself without sequence parallelism.
  Tensor whole(Backend& backend, const Tensor& shard, int64_t seq_len) const;
  // A row-parallel layer's partial output summed over the tp group into `into`: all-reduce in
  // place, or (sequence parallel) reduce-scatter of `partial` onto this rank's shard.
  void reduce(Backend& backend, const Tensor& partial, const Tensor& into) const;
};

// out = residual + layer(x) for the block's row-parallel output layers (attention's proj, the
// MLP's fc2), x (B,T,in). Under tensor parallelism each rank's partial product is summed over the
// group (g: all-reduce, or under sequence parallelism reduce-scatter onto this rank's shard of
// out) and the bias added once, by rank 0. w16: the weight's bf16 copy or undefined. lora: the
// layer's LoRA adapters, whose term is added to the layer's output before the sum (each rank's
// input slice gives its partial term: nn/lora.h).
void residual_linear_forward(Backend& backend, const LayerLinks& links, LinearLayer& layer, const Tensor& x,
                             const Tensor& w, const Tensor& w16, const Tensor& b, const Tensor& residual,
                             const Tensor& out, const LoraTerm& lora = {});

// A linear layer with its LoRA adapters (nn/lora.h): y = layer(x) + their term. With DoRA and
// no dropout the layer runs on lora_layer_weight's merged weight and the adapters add nothing.
void adapted_linear_forward(Backend& backend, LinearLayer& layer, const Tensor& x, const Tensor& w, const Tensor& w16,
                            const Tensor& b, const Tensor& y, const LoraTerm& lora, LinearWorkspace* ws);
// Its backward: dx = dy (the weight the forward used) plus the adapters' part, dw (undefined when
// frozen) and db as LinearLayer::backward, and the adapters' gradients into `grads`. dy16: dy
// already rounded to bf16 for the layer's GEMMs, or undefined (LinearLayer::backward). gelu: dx
// is that GELU's input gradient instead (LinearLayer::backward; a layer without adapters only).
void adapted_linear_backward(Backend& backend, LinearLayer& layer, const Tensor& x, const Tensor& w, const Tensor& w16,
                             const Tensor& dy, const Tensor& dx, const Tensor& dw, const Tensor& db,
                             const LoraTerm& lora, const LoraAdapters& grads, LinearWorkspace* ws,
                             const Tensor& dy16 = Tensor{}, const GeluBackward* gelu = nullptr);

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

// The residual stream's gradient in bf16 for the block output layer `kind` (LINEAR_ATTN_OUT: proj,
// LINEAR_MLP_OUT: fc2) of a block of plan `reader`, whose output gradient it is
// (LayerPlan::proj_dy_bf16 / fc2_dy_bf16): workspace slot O viewed to `shape`, where the norm
// backward that finalises the gradient writes its rounding (norm2's for proj, the next block's norm1
// or the final norm's for fc2); undefined where the layer rounds its dy itself (its flag off, a
// split backward, no workspace). The one decision both ends follow: the writer asks it with the
// reader's plan (Block::backward, Transformer::backward_stage) and hands the tensor to the reader.
Tensor residual_dy16(const LayerPlan& reader, LinearKind kind, BackwardPart part, LinearWorkspace* ws,
                     const Shape& shape);

// A sub-layer backward's residual gradient in bf16 (residual_dy16): `in`, d_residual on entry
// rounded (written by the norm backward before; its output layer reads it as its dy; undefined:
// the layer rounds dy itself), and `out`, where the sub-layer's own norm backward writes d_residual's
// rounding on exit (undefined: none wanted).
struct ResidualDy16 {
  Tensor in, out;
};

// A sub-layer's pre-norm backward and residual: the gradient w.r.t. the norm's output, in
// k.d_norm, through the norm, added to d_residual (which then holds the gradient w.r.t. the
// sub-layer's input x). `partial`: k.d_norm holds this rank's heads' or hidden slice's partial
// gradient, first summed over the tp group (f: all-reduce) or reduced onto the shard
// (reduce-scatter). d_residual16: undefined, or where d_residual's final values are also written
// rounded to bf16 (ResidualDy16::out).
void norm_residual_backward(Backend& backend, const ModelConfig& config, const LayerLinks& links, BlockScratch& k,
                            bool partial, const Tensor& d_residual, const Tensor& x, const Tensor& weight,
                            const NormSaved& norm, const Tensor& dweight, const Tensor& dbias,
                            const Tensor& d_residual16 = Tensor{});

// A sub-layer's post-norm (model.post_norm, OLMo 2): out = norm(y) + residual, the norm's
// statistics in `norm` (its input y kept by the caller for the backward). out must not alias
// residual.
void post_norm_residual(Backend& backend, const ModelConfig& config, const Tensor& y, const Tensor& weight,
                        const Tensor& bias, const NormSaved& norm, const Tensor& residual, const Tensor& out);

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
  // attend() for rows 0 .. n - 1 of a step, in order: host rows qkv (n, width) holding each row's
  // q at column 0, k at k_col and v at v_col; out (n, out_width). A cache may run rows that do
  // not depend on each other side by side (the engine: a prompt chunk's rows).
  virtual void attend_host_rows(int64_t layer, int64_t n, const float* qkv, int64_t width, int64_t k_col, int64_t v_col,
                                float* out, int64_t out_width) {
    for (int64_t r = 0; r < n; ++r) {
      const float* row = qkv + r * width;
      attend(layer, r, row, row + k_col, row + v_col, out + r * out_width);
    }
  }

  // A cache in the backend's memory (infer/kv_cache.h "Memory") takes a step's rows where they are:
  // Block::forward_rows (MHA / GQA / MQA) then calls attend_all once a layer instead of attend per
  // row: qkv (n, qkv_width) the rows' q, k, v after RoPE; out (n, n_head x head_dim) the attention.
  virtual bool in_backend_memory() const { return false; }
  virtual void attend_all(Backend& backend, int64_t layer, const Tensor& qkv, const Tensor& out) {
    throw Error("attend_all needs a KV cache in the backend's memory");
  }

  // Linear-attention blocks (nn/linear_attention.h): row r's sequence's recurrent state in
  // `layer`, model.linear_state_floats() host floats [conv (K-1, channels) | delta (H_v, d_k, d_v)],
  // zeros at the sequence's start; the block reads it and writes the state after the row in
  // place. Rows of one sequence come in position order.
  virtual float* linear_state(int64_t layer, int64_t row) {
    throw Error(str_cat("layer ", layer, " is a linear-attention layer: this decoder keeps no recurrent state"));
  }

  // Host staging of Block::forward_rows (MHA / GQA / MQA), reused across layers and steps: the
  // step's (n, qkv_width) rows read from the backend in one Backend::read, and the (n, n_head x
  // head_dim) attention outputs written back in one Backend::write, so the caches run on host
  // rows whatever memory the backend's tensors live in.
  std::vector<float> host_qkv, host_attn;

  // The attending layer's attention-sink logits (model.attn_sinks, GPT-OSS), set by
  // AttentionLayer::forward_rows before it attends, for a layer without sinks undefined / empty:
  // the parameter itself for attend_all (the backend reads it where it is: no copy to the host
  // inside a step), and n_head floats read to the host for the host attends above. Every attend
  // takes them into its softmax's normalizer (backend/attend_rows.h).
  Tensor sink_logits;
  std::vector<float> sinks;
  const float* layer_sinks() const { return sinks.empty() ? nullptr : sinks.data(); }
};

}  // namespace loom
