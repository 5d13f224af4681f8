// The CUDA backend's class (make_cuda_backend in backend.h), shared by the files that define its
// ops: cuda_backend.cpp (memory, the core ops of a transformer and AdamW), cuda_gemm.cpp (the
// GEMMs), cuda_id_checks.cpp (the bad-id flags and their deferred checks) and one op file per family (cuda_*_ops.cpp, each with its kernels in a .cu file and
// their launchers in a .h), as the CPU backend's cpu_backend_internal.h. Every op validates with the checks every backend
// shares (backend/checks.h), then enqueues its kernels on the backend's one stream. Not for callers.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/backend/block_cache.h"
#include "loom/backend/checks.h"
#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/gemm_panels.h"
#include "loom/core/error.h"

#define LOOM_CUBLAS_STATUS(expr)                                                                             \
  do {                                                                                                      \
    const cublasStatus_t loom_cublas_status_ = (expr);                                                      \
    if (loom_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                                     \
      throw ::loom::Error(::loom::str_cat("cuBLAS error ", static_cast<int>(loom_cublas_status_), " (",     \
                                          cublasGetStatusName(loom_cublas_status_), ") in ", #expr, " (",   \
                                          __FILE__, ":", __LINE__, ")"));                                   \
    }                                                                                                       \
  } while (0)

namespace loom::cuda_backend_detail {

constexpr const char* kBackend = "CUDA";  // in dtype errors

template <typename T>
T* dptr(const Tensor& t) {
  return static_cast<T*>(t.device_ptr());
}
// dptr of an optional operand: null where the tensor is undefined.
template <typename T>
T* dptr_or_null(const Tensor& t) {
  return t.defined() ? dptr<T>(t) : nullptr;
}

// Whether an op file implements every op of its capability (each defined in its file).
bool optim_ops_complete();           // cuda_optim_ops.cpp      } every_optimizer
bool optim_factored_ops_complete();  // cuda_optim_factored_ops.cpp }
bool parallel_ops_complete();        // cuda_parallel_ops.cpp   model_parallel
bool head_norm_ops_complete();       // cuda_parallel_ops.cpp   head_norm
bool moe_ops_complete();             // cuda_moe_ops.cpp        mixture_of_experts
bool mla_ops_complete();             // cuda_mla_ops.cpp        latent_attention
bool quant_ops_complete();           // cuda_quant_ops.cpp      low_precision
bool bf16_attention_ops_complete();  // cuda_quant_ops.cpp      bf16_attention
bool compress_ops_complete();        // cuda_compress_ops.cpp   gradient_compression
bool dora_ops_complete();            // cuda_weight_ops.cpp     dora
bool nf4_ops_complete();             // cuda_weight_ops.cpp     nf4
bool int_weight_ops_complete();      // cuda_weight_ops.cpp     int_weights
bool decode_ops_complete();          // cuda_decode_ops.cpp     kv_cache

// Page-locked host memory for an op's small host -> device tables (kv_attention's plan), kept and
// grown across calls. acquire() first waits for the previous copy out of the buffer (an event, not
// the stream), so the host never rewrites a buffer an enqueued copy still reads; upload() enqueues
// the copy on the stream and records the event. While a step graph is recorded (begin_graph ..
// end_graph) neither waits nor records: each acquire() takes a new region of an arena that stays
// untouched until the graph has run (the next begin_graph waits for the event recorded after its
// launch), and upload() enqueues only the copy, which the graph repeats from that region.
// Defined in cuda_decode_ops.cpp.
class PinnedStaging {
 public:
  PinnedStaging() = default;
  ~PinnedStaging();
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;
  void* acquire(size_t bytes);
  void upload(void* device, size_t bytes, cudaStream_t stream);
  void begin_graph();                          // before the capture begins (it may wait)
  void end_graph();                            // after the capture ends
  void graph_launched(cudaStream_t stream);    // after the launch: the arena's event

 private:
  void* host_ = nullptr;
  size_t capacity_ = 0;
  cudaEvent_t copied_ = nullptr;
  // The step graph's arena: chunks of page-locked memory, regions handed out in order.
  bool graph_ = false;
  std::vector<std::pair<char*, size_t>> chunks_;
  size_t chunk_ = 0, used_ = 0;  // the chunk being filled, and its bytes handed out
  void* region_ = nullptr;       // the last region acquire() gave (what upload() copies)
  cudaEvent_t arena_done_ = nullptr;
  bool arena_pending_ = false;   // arena_done_ recorded since the last begin_graph
};

// Device memory through the block cache; zeroing runs on the backend's stream.
class CudaAllocator final : public Allocator {
 public:
  CudaAllocator(int device, cudaStream_t stream);
  DeviceType device() const override { return DEVICE_CUDA; }
  void* raw_allocate(size_t bytes) override { return cache_.allocate(bytes); }
  void raw_release(void* ptr, size_t bytes) override { cache_.release(ptr, bytes); }
  void raw_zero(void* ptr, size_t bytes) override {
    if (bytes > 0) LOOM_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream_));
  }
  size_t reserved_bytes() const { return cache_.reserved_bytes(); }

 private:
  cudaStream_t stream_;
  BlockCache cache_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device);
  ~CudaBackend() override;

  std::string_view name() const override { return "cuda"; }
  // A capability is stated when every op it needs has its CUDA implementation (the op files'
  // *_ops_complete() below); until then the layout refuses the feature on CUDA, naming the key.
  BackendCapabilities capabilities() const override;
  Allocator& allocator() override { return *allocator_; }
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  size_t reserved_bytes() const { return allocator_->reserved_bytes(); }
  // GEMMs run in staged panels so far (gemm_panels.h), for the tests.
  int64_t panel_gemms() const { return panel_gemms_; }
  // GEMMs run with a GELU epilogue so far (gemm_gelu, gemm_dgelu), for the tests.
  int64_t gelu_epilogue_gemms() const { return gelu_epilogue_gemms_; }
  void write(const Tensor& dst, const void* host) override;
  void read(const Tensor& src, void* host) override;
  void synchronize() override;
  void gemm(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec, const Tensor* bias) override;
  void gemm_gelu(const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& act, const GemmSpec& spec,
                 const Tensor* bias) override;
  void gemm_dgelu(const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& scratch, const Tensor& dx,
                  const GemmSpec& spec) override;
  void fill(const Tensor& x, double value) override;
  void copy(const Tensor& src, const Tensor& dst) override;
  void cast(const Tensor& src, const Tensor& dst) override;
  void add(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void add_inplace(const Tensor& acc, const Tensor& x) override { add(acc, x, acc); }
  void scale_inplace(const Tensor& x, double factor) override;
  double sum_squares(const Tensor& x) override { return reduce(x, true, "sum_squares"); }
  double sum(const Tensor& x) override { return reduce(x, false, "sum"); }
  void bias_backward(const Tensor& dout, const Tensor& dbias) override;
  void embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor* positions,
                         const Tensor& out) override;
  void embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable,
                          const Tensor* dpositions) override;
  void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
                         const Tensor& mean, const Tensor& rstd, float eps) override;
  void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& mean,
                          const Tensor& rstd, const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                          bool accumulate = false, const Tensor& dx16 = Tensor{}) override;
  void rmsnorm_forward(const Tensor& x, const Tensor& weight, const Tensor& out, const Tensor& rstd,
                       float eps) override;
  void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                        const Tensor& dx, const Tensor& dweight, bool accumulate = false,
                        const Tensor& dx16 = Tensor{}) override;
  void gelu_forward(const Tensor& x, const Tensor& out) override;
  void gelu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx) override;
  void glu_forward(const Tensor& x, const Tensor& out, GateActivation act) override;
  void glu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx, GateActivation act) override;
  void rope_forward(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                    int64_t pos_offset) override;
  void rope_backward(const Tensor& dx, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                     int64_t pos_offset) override;
  void rope_rows_forward(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                         const std::vector<int64_t>& positions) override;
  void attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                         int64_t n_kv_head, int64_t window) override;
  void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                          const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) override;
  void flash_attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& lse, int64_t n_head,
                               int64_t n_kv_head, int64_t window) override;
  void flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                                const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) override;
  void attention_sink_forward(const Tensor& out, const Tensor& lse, const Tensor& sinks, int64_t n_head) override;
  void attention_sink_backward(const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& sinks,
                               const Tensor& dsinks, int64_t n_head) override;
  // On tensor cores for head_dim 64 and 128 (cuda_flash_mma.cu); otherwise Backend's default.
  void flash_attention_forward_bf16(const Tensor& qkv, const Tensor& out, const Tensor& lse, int64_t n_head,
                                    int64_t n_kv_head) override;
  void flash_attention_backward_bf16(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                                     const Tensor& dqkv, int64_t n_head, int64_t n_kv_head) override;
  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                             const Tensor& lse) override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, float dloss,
                              const Tensor& dlogits) override;
  // One kernel reading the logits once (cuda_loss.cu), bitwise the two ops and the cast.
  void cross_entropy_loss_and_grad(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                   const Tensor& lse, float dloss, const Tensor& dlogits) override;
  // By columns where the vocabulary's rows are not 16-byte multiples in bf16 and the positions'
  // are: the head's GEMMs then run on aligned operands, without staged panels (gemm_panels.h).
  bool logits_by_columns(int64_t rows, int64_t vocab) const override;
  void cross_entropy_loss_and_grad_columns(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                           const Tensor& lse, float dloss, const Tensor& dlogits) override;
  // Either of the two: the shared checks, the layout's kernel, the deferred target check.
  void loss_and_grad(const char* op, bool by_columns, const Tensor& logits, const Tensor& targets,
                     const Tensor& losses, const Tensor& lse, float dloss, const Tensor& dlogits);
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const AdamWHyper& h) override;

  // ---- cuda_optim_ops.cpp: the elementwise optimizers, Muon's steps and the soft-target loss (cuda_optim.cu)
  void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, const OptimHyper& hyper) override;
  void adagrad_step(const Tensor& param, const Tensor& grad, const Tensor& sum, const OptimHyper& hyper) override;
  void rmsprop_step(const Tensor& param, const Tensor& grad, const Tensor& square, const Tensor& avg, const Tensor& buf, const OptimHyper& hyper) override;
  void adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& vmax, const OptimHyper& hyper) override;
  void lion_step(const Tensor& param, const Tensor& grad, const Tensor& m, const OptimHyper& hyper) override;
  void adam_mini_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const OptimHyper& hyper) override;
  void scale_transpose(const Tensor& src, const Tensor& dst, float scale, bool transpose) override;
  void axpy(const Tensor& y, const Tensor& x, float alpha) override;
  void soft_target_loss(const Tensor& logits, const Tensor& teacher, float temperature, float grad_scale, const Tensor& losses, const Tensor& grad) override;
  void muon_momentum(const Tensor& grad, const Tensor& buf, const Tensor& u, const OptimHyper& hyper) override;
  void newton_schulz_normalize(const Tensor& u, const Tensor& x) override;
  void decayed_update(const Tensor& param, const Tensor& u, float decay, float step) override;
  // ---- cuda_optim_factored_ops.cpp: Adafactor, SM3, CAME and LDAdam (cuda_optim_factored.cu)
  void adafactor_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m, const Tensor& u, const OptimHyper& hyper) override;
  void sm3_step(const Tensor& param, const Tensor& grad, const Tensor& acc, const OptimHyper& hyper) override;
  void came_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m, const Tensor& res, const Tensor& u, const OptimHyper& hyper) override;
  void leading_eigenvectors(const Tensor& s, const Tensor& p) override;
  void gram_schmidt(const Tensor& y, const Tensor& fallback, const Tensor& p) override;
  void ldadam_rotate(const Tensor& p, const Tensor& prev, const Tensor& m, const Tensor& v, const Tensor& mt, const Tensor& vt, const OptimHyper& hyper) override;
  void ldadam_adam(const Tensor& m, const Tensor& v, const Tensor& mt, const Tensor& vt, const Tensor& gh, const OptimHyper& hyper) override;
  void ldadam_apply(const Tensor& param, const Tensor& grad, const Tensor& d, const Tensor& e, bool transpose, const OptimHyper& hyper) override;
  // ---- cuda_parallel_ops.cpp: the model-parallel ops and q/k norm (cuda_parallel.cu)
  void vocab_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t begin, int64_t valid, const Tensor& out) override;
  void vocab_embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dweight, int64_t begin, int64_t valid) override;
  void add_positions(const Tensor& out, const Tensor& positions, int64_t first) override;
  void positions_backward(const Tensor& dout, const Tensor& dpositions, int64_t first) override;
  void vocab_ce_partials(const Tensor& logits, const Tensor& targets, int64_t begin, int64_t valid, const Tensor& max, const Tensor& target) override;
  void vocab_ce_sums(const Tensor& logits, const Tensor& max, int64_t valid, const Tensor& sums) override;
  void vocab_ce_finish(const Tensor& targets, const Tensor& lse, const Tensor& sums, const Tensor& losses) override;
  void vocab_ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t begin, int64_t valid, float scale, const Tensor& dlogits) override;
  void ring_attention_merge(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& m, const Tensor& l, const Tensor& scratch, const RingBlock& block) override;
  void ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head) override;
  void attention_row_dot(const Tensor& dout, const Tensor& out, const Tensor& D, int64_t n_head) override;
  void ring_attention_block_backward(const Tensor& q, const Tensor& dout, const Tensor& lse, const Tensor& D, const Tensor& k, const Tensor& v, const Tensor& dq, const Tensor& dk, const Tensor& dv, const RingBlock& block) override;
  void copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& block) override;
  void head_rmsnorm_forward(const Tensor& x, const Tensor& weight, int64_t first, int64_t n, int64_t hd, float eps, const Tensor& in, const Tensor& rstd) override;
  void head_rmsnorm_backward(const Tensor& dx, const Tensor& in, const Tensor& weight, const Tensor& rstd, int64_t first, int64_t n, int64_t hd, const Tensor& dweight) override;
  // ---- cuda_moe_ops.cpp: mixture-of-experts routing, dispatch and combine (cuda_moe.cu)
  void moe_route(const Tensor& logits, const Tensor& bias, const Tensor& scores, const Tensor& expert, const Tensor& gates, const Tensor& scratch, const MoeRouting& routing) override;
  void moe_assign(const Tensor& expert, int64_t capacity, const Tensor& row, const Tensor& token, const Tensor& counts) override;
  void moe_dispatch(const Tensor& x, const Tensor& token, const Tensor& rows) override;
  void moe_combine(const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out) override;
  void moe_combine_backward(const Tensor& dout, const Tensor& row, const Tensor& gates, const Tensor& drows) override;
  void moe_balance_stats(const Tensor& logits, const Tensor& scores, const Tensor& expert, const Tensor& counts, const Tensor& stats, const Tensor& scratch, const MoeRouting& routing) override;
  void moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& expert, const Tensor& row, const Tensor& ye, const Tensor& dy, const Tensor& counts, const Tensor& dlogits, const Tensor& scratch, const MoeRouting& routing) override;
  // ---- cuda_linear_attention_ops.cpp: Qwen3-Next's gated delta rule, conv and gates (cuda_linear_attention.cu)
  void delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& initial_state, const Tensor& out, const Tensor& final_state, DeltaRuleForm form, int64_t chunk) override;
  void delta_rule_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& initial_state, const Tensor& dout, const Tensor& dfinal_state, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dbeta, const Tensor& dinitial_state, DeltaRuleForm form, int64_t chunk) override;
  void causal_conv1d_silu_forward(const Tensor& x, const Tensor& weight, const Tensor& initial, const Tensor& y, const Tensor& final_state) override;
  void causal_conv1d_silu_backward(const Tensor& x, const Tensor& weight, const Tensor& initial, const Tensor& dy, const Tensor& dx, const Tensor& dweight, const Tensor& dinitial) override;
  void delta_gates_forward(const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& g, const Tensor& beta) override;
  void delta_gates_backward(const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& dg, const Tensor& dbeta, const Tensor& dba, const Tensor& da_log, const Tensor& ddt_bias) override;
  // ---- cuda_mla_ops.cpp: multi-head latent attention (cuda_mla.cu)
  void mla_rope(const Tensor& x, int64_t heads, int64_t stride, int64_t offset, int64_t rope_dim, const RopeSpec& rope, int64_t pos_offset, bool inverse) override;
  void mla_attention_forward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs, const Tensor& out, const MlaDims& dims) override;
  void mla_attention_backward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs, const Tensor& dout, const Tensor& dq, const Tensor& dkv, const Tensor& dkr, const Tensor& dp_row, const MlaDims& dims) override;
  void mla_attend_latents(const Tensor& q, const Tensor& latents, const Tensor& kv_b, const Tensor& out, const MlaDims& dims) override;
  // ---- cuda_quant_ops.cpp: the low-precision quantizers, rounding, dropout and bf16 attention (cuda_quant.cu)
  float amax(const Tensor& x) override;
  void fake_quant(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale, float post) override;
  void quant_codes_bf16(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale) override;
  void fake_quant_blocks(const Tensor& x, const Tensor& out, const NumberGrid& grid, int64_t block_rows, int64_t block_cols) override;
  void fake_quant_mxfp4(const Tensor& x, const Tensor& out) override;
  void fake_quant_nvfp4(const Tensor& x, const Tensor& out) override;
  void round_bf16(const Tensor& x, bool stochastic, const RoundingDraw& draw) override;
  void dropout(const Tensor& x, const Tensor& out, float p, const RoundingDraw& draw) override;
  void attention_forward_bf16(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head, int64_t n_kv_head) override;
  void attention_backward_bf16(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs, const Tensor& dqkv, int64_t n_head, int64_t n_kv_head) override;
  // ---- cuda_compress_ops.cpp: gradient compression (cuda_compress.cu)
  void topk_extract(const Tensor& acc, const Tensor& idx, const Tensor& val, const Tensor& scratch) override;
  void scatter_add(const Tensor& idx, const Tensor& val, const Tensor& out) override;
  void scatter_zero(const Tensor& idx, const Tensor& x) override;
  void dgc_accumulate(const Tensor& g, const Tensor& u, const Tensor& v, float momentum, double clip) override;
  void onebit_encode(const Tensor& acc, const Tensor& words, const Tensor& scale) override;
  void onebit_decode_add(const Tensor& words, const Tensor& scales, const Tensor& out) override;
  void qsgd_encode(const Tensor& g, const Tensor& codes, const Tensor& norm, const QsgdSpec& spec) override;
  void qsgd_decode_add(const Tensor& codes, const Tensor& norms, int levels, const Tensor& out) override;
  void lowrank_project(const Tensor& m, const Tensor& q, const Tensor& out, bool transpose) override;
  void orthonormalize_columns(const Tensor& p) override;
  void lowrank_expand(const Tensor& p, const Tensor& q, const Tensor& out, float alpha, float beta) override;
  // ---- cuda_weight_ops.cpp: DoRA's row ops, NF4 and the integer-weight kernels (cuda_weights.cu)
  void row_norms(const Tensor& x, const Tensor& norms) override;
  void dora_weight(const Tensor& merged, const Tensor& base, const Tensor& magnitude, const Tensor& norms, const Tensor& out) override;
  void dora_backward(const Tensor& grad, const Tensor& merged, const Tensor& magnitude, const Tensor& norms, const Tensor& dmagnitude) override;
  void nf4_dequantize(const Tensor& codes, const Tensor& absmax_codes, const Tensor& absmax_steps, const Nf4Spec& spec, int64_t first, const Tensor& out) override;
  void int_linear(const Tensor& x, const Tensor& codes, const Tensor& scales, const Tensor& zeros, const IntWeightSpec& spec, const Tensor* input_scale, const Tensor& y, float beta, const Tensor* bias) override;
  void bf16_weight_linear(const Tensor& x, const Tensor& w, const Tensor& y, float beta, const Tensor* bias) override;
  void int_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& zeros, const IntWeightSpec& spec, const Tensor* input_scale, const Tensor& out) override;
  // ---- cuda_decode_ops.cpp: decode attention over a paged, quantized KV cache (cuda_decode.cu)
  void kv_attention(const KvAttendPlan& plan, const Tensor& q, const Tensor& pool, const Tensor& rings, const Tensor& out) override;
  void kv_store(const KvStorePlan& plan, const std::vector<Tensor>& sources, const Tensor& pool, const Tensor& rings,
                const Tensor& status) override;
  void argmax_rows(const Tensor& x, const Tensor& out) override;
  void sample_rows(const Tensor& logits, const std::vector<RowSampling>& rows, const std::vector<SamplePenalty>& penalties,
                   const Tensor& out) override;
  // ---- cuda_graph_ops.cpp: a decoding step as one CUDA graph (stream capture, cudaGraphExecUpdate)
  bool begin_step_graph() override;
  void end_step_graph(int64_t key) override;
  void abort_step_graph() override;
  StepGraphCounts step_graph_counts() const override { return graph_counts_; }

  // ---- For the op files: the libraries' handles, scratch, fixed-order sums, the bad-id flag.
  cublasHandle_t cublas() const { return cublas_; }
  cublasLtHandle_t cublas_lt() const { return lt_; }
  // Scratch of at least `bytes`, kept and grown across calls (steady-state steps allocate nothing).
  // One buffer per backend: a later call may move it.
  void* workspace(size_t bytes);
  // Fixed-order sum: kReducePartials partials on the device, added here in index order.
  double reduce(const Tensor& x, bool squares, const char* op);
  // The bad-index flags: kFlagSlots words, each the lowest bad index a kernel saw (ULLONG_MAX:
  // none). Slot 0 is for the ops that check on the spot (flag(): reset before the kernel, read
  // after, which waits for the stream). An id check (embedding, cross-entropy) claims another
  // slot instead (claim_flag) and defers its check (defer_check): the pending checks are read
  // together, in one copy, at the next host synchronisation (read, write, synchronize, and the
  // ops that return a host value, which read) or when the slots run out, and the first bad one
  // throws the op's one-line error there. So an id check costs no wait inside a step (the
  // kernels skip a bad id's row, so nothing after them reads out of bounds meanwhile).
  unsigned long long* flag() { return static_cast<unsigned long long*>(flags_.device_ptr()); }
  void reset_flag();
  unsigned long long* claim_flag();
  // The check of the op just enqueued with the slot the last claim_flag gave: "op: what ID at
  // where POS outside vocab [0, limit)" where ids[POS] = ID. ids must stay unchanged until it is
  // read (write() checks first).
  void defer_check(const char* op, const char* what, const char* where, const Tensor& ids, int64_t limit);
  void check_pending();  // reads the pending checks now (a wait), and throws the first bad one

 private:
  // x as the tensor-core flash kernels read it beside a bf16 input: itself where bf16 and 16-byte
  // aligned, else a bf16 copy in workspace memory (cuda_backend.cpp).
  Tensor flash_input_bf16(const Tensor& x);
  static constexpr int64_t kLtWorkspaceBytes = int64_t{32} << 20;  // cuBLAS(Lt)'s split-K and Hopper kernels

  // One f32 or bf16 x bf16 -> f32 GEMM on raw operands, row-major as Backend::gemm (A (m, k), or
  // (k, m) stored when trans_a; B (k, n), or (n, k) when trans_b; C (m, n)) with explicit leading
  // dimensions in elements, so a panel may be a view or a padded copy.
  struct GemmCall {
    const void* a = nullptr;
    const void* b = nullptr;
    void* c = nullptr;
    int64_t m = 0, n = 0, k = 0;
    int64_t lda = 0, ldb = 0, ldc = 0;
    int64_t batch = 1, stride_a = 0, stride_b = 0, stride_c = 0;
    bool trans_a = false, trans_b = false;
    float alpha = 1.0f, beta = 0.0f;
    cudaDataType_t in_type = CUDA_R_32F;
    cudaDataType_t out_type = CUDA_R_32F;  // or CUDA_R_16BF: bf16 A and B, beta 0
    const void* c_in = nullptr;            // where beta's C is read (GemmSpec::c_in; null: c)
    // cuBLASLt's GELU epilogues (Backend::gemm_gelu / gemm_dgelu): forward writes aux = the sum
    // (+ bias) and C = its GELU (GELU_AUX(_BIAS)); backward reads aux and writes C = the sum times
    // GELU'(aux) (DGELU). aux is laid out as C (ldc), of C's type.
    enum class Gelu : uint8_t { none, forward, backward } gelu = Gelu::none;
    const void* aux = nullptr;
  };
  static GemmCall gemm_call(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec,
                            const checks::GemmDims& d);
  // cuBLASLt (see the file comment for the row-major mapping). Returns whether the bias (of C's
  // type) went into the GEMM's epilogue (else the caller adds it). Where the heuristic declines the
  // shapes: cublasGemmStridedBatchedEx, or (ex_fallback false) nothing, and `declined` is set.
  bool gemm_lt(const GemmCall& g, const void* bias, bool ex_fallback = true, bool* declined = nullptr);
  // A bf16 C (Backend::gemm's autocast-style output): cuBLASLt writes it, the bias rounded to bf16
  // in its epilogue; shapes it declines or that need panels take the fp32 product in row chunks
  // through the workspace, then round_rows_bf16.
  void gemm_bf16_out(const GemmCall& g, const Tensor* bias);
  // The same product through cublasGemmStridedBatchedEx (fp32 accumulation, no TF32): for shapes
  // cuBLASLt's heuristic declines (leading dimensions that are not multiples of 16 bytes).
  void gemm_ex(const GemmCall& g);
  // A large GEMM with misaligned rows, in panels staged through padded rows (gemm_panels.h).
  void gemm_panels(const GemmCall& g, const GemmPanels& p);
  void gemm_f64(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec, const checks::GemmDims& d);
  // gemm_gelu's / gemm_dgelu's product with the GELU in cuBLASLt's epilogue, when A, B, C and aux
  // are bf16, one matrix, no panels and the heuristic has an algorithm; false (nothing run) otherwise.
  // d: the dimensions check_gemm_gelu found (C's shape is d.m x d.n).
  bool gemm_gelu_epilogue(const Tensor& a, const Tensor& b, const Tensor& aux, const Tensor& c, const GemmSpec& spec,
                          const checks::GemmDims& d, const Tensor* bias, GemmCall::Gelu gelu);

  void rope(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec, int64_t pos_offset, double direction,
            const char* op);


  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<CudaAllocator> allocator_;
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  Tensor lt_workspace_, flags_, partials_, workspace_;
  static constexpr int kFlagSlots = 8;  // flags_: slot 0 on the spot, the others deferred
  struct PendingCheck {
    const char *op, *what, *where;
    Tensor ids;
    int64_t limit;
    int slot;
  };
  std::vector<PendingCheck> pending_;  // in enqueue order, on slots 1 .. size
  // The pending checks' flags (slots 1 .. size) copied into bad[0 .. size) on the stream (false: none);
  // after the caller's wait, throw_pending(bad) clears them and throws the first bad one.
  bool enqueue_pending_flags(unsigned long long* bad);
  void throw_pending(const unsigned long long* bad);
  // LOOM_CUDA_GEMM_PANEL_BYTES / LOOM_CUDA_GEMM_PANEL_MIN_FLOPS override the defaults (read once).
  GemmPanelLimits panel_limits_;
  int64_t panel_gemms_ = 0;
  int64_t gelu_epilogue_gemms_ = 0;
  PinnedStaging kv_staging_;  // kv_attention's plan table on its way to the workspace
  PinnedStaging kv_store_staging_;  // kv_store's plan table on its way to the workspace
  PinnedStaging sample_staging_;  // sample_rows' settings table on its way to the workspace
  // Step graphs: the executable graph of each key (a step's shape), and what they did.
  std::vector<std::pair<int64_t, cudaGraphExec_t>> graphs_;
  bool capturing_ = false;
  StepGraphCounts graph_counts_;
  void destroy_graphs();
};

}  // namespace loom::cuda_backend_detail
