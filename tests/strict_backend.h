// A test backend whose memory host code may not read: the CPU backend's kernels on tensors whose
// allocator says "not host-accessible", so any Tensor::data() outside a backend throws, exactly
// as it would on a GPU. Running the models, the trainer and the checkpoints on it proves they
// reach their tensors only through the op interface and Backend::read / write, i.e. that they
// run unchanged on the CUDA backend (whose kernels the op tests check on a GPU machine).
#pragma once
#include <cstring>
#include <memory>
#include <string>

#include "loom/backend/backend.h"
#include "loom/core/error.h"

namespace loom::test {

class StrictAllocator final : public Allocator {
 public:
  DeviceType device() const override { return DEVICE_CPU; }
  bool host_accessible() const override { return false; }
  void* raw_allocate(size_t bytes) override { return host_.raw_allocate(bytes); }
  void raw_release(void* ptr, size_t bytes) override { host_.raw_release(ptr, bytes); }
  void raw_zero(void* ptr, size_t bytes) override { host_.raw_zero(ptr, bytes); }

 private:
  CpuAllocator host_;
};

class StrictBackend final : public Backend {
 public:
  std::string_view name() const override { return "strict"; }
  // What runs behind this backend of the host-computed features (backend.h BackendCapabilities).
  BackendCapabilities capabilities() const override {
    BackendCapabilities caps;
    caps.mixture_of_experts = caps.latent_attention = true;  // the MoE and MLA ops below
    caps.low_precision = true;  // the quantizers and bf16 rounding are backend ops
    caps.every_optimizer = true;  // the optimizer ops below
    caps.zero_sharding = true;  // ZeRO zeroes and scales its shard, and zeroes released ranges, through the backend
    caps.model_parallel = true;  // tp / sp / pp / cp / ep: slicing through copy / copy_block, the vocab and ring ops
    caps.dora = true;  // row_norms, dora_weight, dora_backward
    caps.bf16_attention = true;  // attention_*_bf16 below
    caps.kv_cache = true;  // kv_attention below
    return caps;
  }
  Allocator& allocator() override { return allocator_; }
  void write(const Tensor& dst, const void* host) override { std::memcpy(dst.device_ptr(), host, dst.nbytes()); }
  void read(const Tensor& src, void* host) override { std::memcpy(host, src.device_ptr(), src.nbytes()); }

  void gemm(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec, const Tensor* bias) override {
    const Tensor hb = bias ? h(*bias) : Tensor(), hc = spec.c_in ? h(*spec.c_in) : Tensor();
    GemmSpec host = spec;
    if (spec.c_in) host.c_in = &hc;
    cpu_->gemm(h(a), h(b), h(c), host, bias ? &hb : nullptr);
  }
  void fill(const Tensor& x, double value) override { cpu_->fill(h(x), value); }
  void copy(const Tensor& src, const Tensor& dst) override { cpu_->copy(h(src), h(dst)); }
  void cast(const Tensor& src, const Tensor& dst) override { cpu_->cast(h(src), h(dst)); }
  void bf16_weight_linear(const Tensor& x, const Tensor& w, const Tensor& y, float beta, const Tensor* bias) override {
    const Tensor hb = bias != nullptr ? h(*bias) : Tensor{};
    cpu_->bf16_weight_linear(h(x), h(w), h(y), beta, bias != nullptr ? &hb : nullptr);
  }
  void add(const Tensor& a, const Tensor& b, const Tensor& out) override { cpu_->add(h(a), h(b), h(out)); }
  void add_inplace(const Tensor& acc, const Tensor& x) override { cpu_->add_inplace(h(acc), h(x)); }
  void scale_inplace(const Tensor& x, double factor) override { cpu_->scale_inplace(h(x), factor); }
  double sum_squares(const Tensor& x) override { return cpu_->sum_squares(h(x)); }
  double sum(const Tensor& x) override { return cpu_->sum(h(x)); }
  void bias_backward(const Tensor& dout, const Tensor& dbias) override { cpu_->bias_backward(h(dout), h(dbias)); }
  void embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor* positions,
                         const Tensor& out) override {
    const Tensor hp = positions ? h(*positions) : Tensor();
    cpu_->embedding_forward(h(tokens), h(table), positions ? &hp : nullptr, h(out));
  }
  void embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable,
                          const Tensor* dpositions) override {
    const Tensor hp = dpositions ? h(*dpositions) : Tensor();
    cpu_->embedding_backward(h(tokens), h(dout), h(dtable), dpositions ? &hp : nullptr);
  }
  void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
                         const Tensor& mean, const Tensor& rstd, float eps) override {
    cpu_->layernorm_forward(h(x), h(weight), h(bias), h(out), h(mean), h(rstd), eps);
  }
  void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& mean,
                          const Tensor& rstd, const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                          bool accumulate = false, const Tensor& dx16 = Tensor{}) override {
    cpu_->layernorm_backward(h(dout), h(x), h(weight), h(mean), h(rstd), h(dx), h(dweight), h(dbias), accumulate,
                             h(dx16));
  }
  void rmsnorm_forward(const Tensor& x, const Tensor& weight, const Tensor& out, const Tensor& rstd,
                       float eps) override {
    cpu_->rmsnorm_forward(h(x), h(weight), h(out), h(rstd), eps);
  }
  void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                        const Tensor& dx, const Tensor& dweight, bool accumulate = false,
                        const Tensor& dx16 = Tensor{}) override {
    cpu_->rmsnorm_backward(h(dout), h(x), h(weight), h(rstd), h(dx), h(dweight), accumulate, h(dx16));
  }
  void gelu_forward(const Tensor& x, const Tensor& out) override { cpu_->gelu_forward(h(x), h(out)); }
  void gelu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx) override {
    cpu_->gelu_backward(h(x), h(dout), h(dx));
  }
  void glu_forward(const Tensor& x, const Tensor& out, GateActivation act) override { cpu_->glu_forward(h(x), h(out), act); }
  void glu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx, GateActivation act) override {
    cpu_->glu_backward(h(x), h(dout), h(dx), act);
  }
  void head_rmsnorm_forward(const Tensor& x, const Tensor& weight, int64_t first, int64_t n, int64_t hd, float eps,
                            const Tensor& in, const Tensor& rstd) override {
    cpu_->head_rmsnorm_forward(h(x), h(weight), first, n, hd, eps, h(in), h(rstd));
  }
  void head_rmsnorm_backward(const Tensor& dx, const Tensor& in, const Tensor& weight, const Tensor& rstd, int64_t first,
                             int64_t n, int64_t hd, const Tensor& dweight) override {
    cpu_->head_rmsnorm_backward(h(dx), h(in), h(weight), h(rstd), first, n, hd, h(dweight));
  }
  void delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& initial_state, const Tensor& out, const Tensor& final_state,
                          DeltaRuleForm form, int64_t chunk) override {
    cpu_->delta_rule_forward(h(q), h(k), h(v), h(g), h(beta), h(initial_state), h(out), h(final_state), form, chunk);
  }
  void delta_rule_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                           const Tensor& initial_state, const Tensor& dout, const Tensor& dfinal_state,
                           const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dbeta,
                           const Tensor& dinitial_state, DeltaRuleForm form, int64_t chunk) override {
    cpu_->delta_rule_backward(h(q), h(k), h(v), h(g), h(beta), h(initial_state), h(dout), h(dfinal_state), h(dq),
                              h(dk), h(dv), h(dg), h(dbeta), h(dinitial_state), form, chunk);
  }
  void causal_conv1d_silu_forward(const Tensor& x, const Tensor& weight, const Tensor& initial, const Tensor& y,
                                  const Tensor& final_state) override {
    cpu_->causal_conv1d_silu_forward(h(x), h(weight), h(initial), h(y), h(final_state));
  }
  void causal_conv1d_silu_backward(const Tensor& x, const Tensor& weight, const Tensor& initial, const Tensor& dy,
                                   const Tensor& dx, const Tensor& dweight, const Tensor& dinitial) override {
    cpu_->causal_conv1d_silu_backward(h(x), h(weight), h(initial), h(dy), h(dx), h(dweight), h(dinitial));
  }
  void delta_gates_forward(const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& g,
                           const Tensor& beta) override {
    cpu_->delta_gates_forward(h(ba), h(a_log), h(dt_bias), h(g), h(beta));
  }
  void delta_gates_backward(const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& dg,
                            const Tensor& dbeta, const Tensor& dba, const Tensor& da_log,
                            const Tensor& ddt_bias) override {
    cpu_->delta_gates_backward(h(ba), h(a_log), h(dt_bias), h(dg), h(dbeta), h(dba), h(da_log), h(ddt_bias));
  }
  void rope_forward(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope,
                    int64_t pos_offset) override {
    cpu_->rope_forward(h(x), head_dim, n_heads, rope, pos_offset);
  }
  void rope_backward(const Tensor& dx, int64_t head_dim, int64_t n_heads, const RopeSpec& rope,
                     int64_t pos_offset) override {
    cpu_->rope_backward(h(dx), head_dim, n_heads, rope, pos_offset);
  }
  void attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head, int64_t n_kv_head,
                         int64_t window) override {
    cpu_->attention_forward(h(qkv), h(out), h(probs), n_head, n_kv_head, window);
  }
  void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                          const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) override {
    cpu_->attention_backward(h(dout), h(qkv), h(out), h(probs), h(dqkv), n_head, n_kv_head, window);
  }
  void flash_attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& lse, int64_t n_head,
                               int64_t n_kv_head, int64_t window) override {
    cpu_->flash_attention_forward(h(qkv), h(out), h(lse), n_head, n_kv_head, window);
  }
  void flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                                const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) override {
    cpu_->flash_attention_backward(h(dout), h(qkv), h(out), h(lse), h(dqkv), n_head, n_kv_head, window);
  }
  void attention_sink_forward(const Tensor& out, const Tensor& lse, const Tensor& sinks, int64_t n_head) override {
    cpu_->attention_sink_forward(h(out), h(lse), h(sinks), n_head);
  }
  void attention_sink_backward(const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& sinks,
                               const Tensor& dsinks, int64_t n_head) override {
    cpu_->attention_sink_backward(h(dout), h(out), h(lse), h(sinks), h(dsinks), n_head);
  }
  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                             const Tensor& lse) override {
    cpu_->cross_entropy_forward(h(logits), h(targets), h(losses), h(lse));
  }
  void attention_forward_bf16(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                              int64_t n_kv_head) override {
    cpu_->attention_forward_bf16(h(qkv), h(out), h(probs), n_head, n_kv_head);
  }
  void attention_backward_bf16(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                               const Tensor& dqkv, int64_t n_head, int64_t n_kv_head) override {
    cpu_->attention_backward_bf16(h(dout), h(qkv), h(out), h(probs), h(dqkv), n_head, n_kv_head);
  }
  void cross_entropy_loss_and_grad(const Tensor& logits, const Tensor& targets, const Tensor& losses, const Tensor& lse,
                                   float dloss, const Tensor& dlogits) override {
    cpu_->cross_entropy_loss_and_grad(h(logits), h(targets), h(losses), h(lse), dloss, h(dlogits));
  }
  void cross_entropy_loss_and_grad_columns(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                           const Tensor& lse, float dloss, const Tensor& dlogits) override {
    ++columns_calls;
    cpu_->cross_entropy_loss_and_grad_columns(h(logits), h(targets), h(losses), h(lse), dloss, h(dlogits));
  }
  // Logits kept by columns where a test asks (columns_logits): the model's column path on the CPU kernels.
  bool logits_by_columns(int64_t, int64_t) const override { return columns_logits; }
  bool columns_logits = false;
  int64_t columns_calls = 0;
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, float dloss,
                              const Tensor& dlogits) override {
    cpu_->cross_entropy_backward(h(logits), h(targets), h(lse), dloss, h(dlogits));
  }
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const AdamWHyper& hyper) override {
    cpu_->adamw_step(h(param), h(grad), h(m), h(v), hyper);
  }

  void topk_extract(const Tensor& acc, const Tensor& idx, const Tensor& val, const Tensor& scratch) override {
    cpu_->topk_extract(h(acc), h(idx), h(val), h(scratch));
  }
  void scatter_add(const Tensor& idx, const Tensor& val, const Tensor& out) override { cpu_->scatter_add(h(idx), h(val), h(out)); }
  void scatter_zero(const Tensor& idx, const Tensor& x) override { cpu_->scatter_zero(h(idx), h(x)); }
  void dgc_accumulate(const Tensor& g, const Tensor& u, const Tensor& v, float momentum, double clip) override {
    cpu_->dgc_accumulate(h(g), h(u), h(v), momentum, clip);
  }
  void onebit_encode(const Tensor& acc, const Tensor& words, const Tensor& scale) override {
    cpu_->onebit_encode(h(acc), h(words), h(scale));
  }
  void onebit_decode_add(const Tensor& words, const Tensor& scales, const Tensor& out) override {
    cpu_->onebit_decode_add(h(words), h(scales), h(out));
  }
  void qsgd_encode(const Tensor& g, const Tensor& codes, const Tensor& norm, const QsgdSpec& spec) override {
    cpu_->qsgd_encode(h(g), h(codes), h(norm), spec);
  }
  void qsgd_decode_add(const Tensor& codes, const Tensor& norms, int levels, const Tensor& out) override {
    cpu_->qsgd_decode_add(h(codes), h(norms), levels, h(out));
  }
  void lowrank_project(const Tensor& m, const Tensor& q, const Tensor& out, bool transpose) override {
    cpu_->lowrank_project(h(m), h(q), h(out), transpose);
  }
  void orthonormalize_columns(const Tensor& p) override { cpu_->orthonormalize_columns(h(p)); }
  void lowrank_expand(const Tensor& p, const Tensor& q, const Tensor& out, float alpha, float beta) override {
    cpu_->lowrank_expand(h(p), h(q), h(out), alpha, beta);
  }

  void vocab_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t begin, int64_t valid,
                               const Tensor& out) override {
    cpu_->vocab_embedding_forward(h(tokens), h(weight), begin, valid, h(out));
  }
  void vocab_embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dweight, int64_t begin,
                                int64_t valid) override {
    cpu_->vocab_embedding_backward(h(tokens), h(dout), h(dweight), begin, valid);
  }
  void add_positions(const Tensor& out, const Tensor& positions, int64_t first) override {
    cpu_->add_positions(h(out), h(positions), first);
  }
  void positions_backward(const Tensor& dout, const Tensor& dpositions, int64_t first) override {
    cpu_->positions_backward(h(dout), h(dpositions), first);
  }
  void vocab_ce_partials(const Tensor& logits, const Tensor& targets, int64_t begin, int64_t valid,
                         const Tensor& max, const Tensor& target) override {
    cpu_->vocab_ce_partials(h(logits), h(targets), begin, valid, h(max), h(target));
  }
  void vocab_ce_sums(const Tensor& logits, const Tensor& max, int64_t valid, const Tensor& sums) override {
    cpu_->vocab_ce_sums(h(logits), h(max), valid, h(sums));
  }
  void vocab_ce_finish(const Tensor& targets, const Tensor& lse, const Tensor& sums, const Tensor& losses) override {
    cpu_->vocab_ce_finish(h(targets), h(lse), h(sums), h(losses));
  }
  void vocab_ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t begin, int64_t valid,
                         float scale, const Tensor& dlogits) override {
    cpu_->vocab_ce_backward(h(logits), h(targets), h(lse), begin, valid, scale, h(dlogits));
  }
  void ring_attention_merge(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& m,
                            const Tensor& l, const Tensor& scratch, const RingBlock& block) override {
    cpu_->ring_attention_merge(h(q), h(k), h(v), h(out), h(m), h(l), h(scratch), block);
  }
  void ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head) override {
    cpu_->ring_attention_finish(h(out), h(lse), h(l), n_head);
  }
  void attention_row_dot(const Tensor& dout, const Tensor& out, const Tensor& D, int64_t n_head) override {
    cpu_->attention_row_dot(h(dout), h(out), h(D), n_head);
  }
  void ring_attention_block_backward(const Tensor& q, const Tensor& dout, const Tensor& lse, const Tensor& D,
                                     const Tensor& k, const Tensor& v, const Tensor& dq, const Tensor& dk,
                                     const Tensor& dv, const RingBlock& block) override {
    cpu_->ring_attention_block_backward(h(q), h(dout), h(lse), h(D), h(k), h(v), h(dq), h(dk), h(dv), block);
  }
  // Model-parallel slicing.
  void copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& block) override {
    cpu_->copy_block(h(src), h(dst), block);
  }

  // Mixture of experts and latent attention.
  void moe_route(const Tensor& logits, const Tensor& bias, const Tensor& scores, const Tensor& expert,
                 const Tensor& gates, const Tensor& scratch, const MoeRouting& routing) override {
    cpu_->moe_route(h(logits), h(bias), h(scores), h(expert), h(gates), h(scratch), routing);
  }
  void moe_assign(const Tensor& expert, int64_t capacity, const Tensor& row, const Tensor& token,
                  const Tensor& counts) override {
    cpu_->moe_assign(h(expert), capacity, h(row), h(token), h(counts));
  }
  void moe_dispatch(const Tensor& x, const Tensor& token, const Tensor& rows) override {
    cpu_->moe_dispatch(h(x), h(token), h(rows));
  }
  void moe_combine(const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out) override {
    cpu_->moe_combine(h(rows), h(row), h(gates), h(out));
  }
  void moe_combine_backward(const Tensor& dout, const Tensor& row, const Tensor& gates, const Tensor& drows) override {
    cpu_->moe_combine_backward(h(dout), h(row), h(gates), h(drows));
  }
  void moe_balance_stats(const Tensor& logits, const Tensor& scores, const Tensor& expert, const Tensor& counts,
                         const Tensor& stats, const Tensor& scratch, const MoeRouting& routing) override {
    cpu_->moe_balance_stats(h(logits), h(scores), h(expert), h(counts), h(stats), h(scratch), routing);
  }
  void moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& expert, const Tensor& row,
                           const Tensor& ye, const Tensor& dy, const Tensor& counts, const Tensor& dlogits,
                           const Tensor& scratch, const MoeRouting& routing) override {
    cpu_->moe_router_backward(h(logits), h(scores), h(expert), h(row), h(ye), h(dy), h(counts), h(dlogits), h(scratch),
                              routing);
  }
  void mla_rope(const Tensor& x, int64_t heads, int64_t stride, int64_t offset, int64_t rope_dim,
                const RopeSpec& rope, int64_t pos_offset, bool inverse) override {
    cpu_->mla_rope(h(x), heads, stride, offset, rope_dim, rope, pos_offset, inverse);
  }
  void mla_attention_forward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                             const Tensor& out, const MlaDims& dims) override {
    cpu_->mla_attention_forward(h(q), h(kr), h(kv), h(probs), h(out), dims);
  }
  void mla_attention_backward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                              const Tensor& dout, const Tensor& dq, const Tensor& dkv, const Tensor& dkr,
                              const Tensor& dp_row, const MlaDims& dims) override {
    cpu_->mla_attention_backward(h(q), h(kr), h(kv), h(probs), h(dout), h(dq), h(dkv), h(dkr), h(dp_row), dims);
  }
  void mla_attend_latents(const Tensor& q, const Tensor& latents, const Tensor& kv_b, const Tensor& out,
                          const MlaDims& dims) override {
    cpu_->mla_attend_latents(h(q), h(latents), h(kv_b), h(out), dims);
  }
  // Low precision.
  float amax(const Tensor& x) override { return cpu_->amax(h(x)); }
  void fake_quant(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale, float post) override {
    cpu_->fake_quant(h(x), h(out), grid, scale, post);
  }
  void quant_codes_bf16(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale) override {
    cpu_->quant_codes_bf16(h(x), h(out), grid, scale);
  }
  void fake_quant_blocks(const Tensor& x, const Tensor& out, const NumberGrid& grid, int64_t block_rows,
                         int64_t block_cols) override {
    cpu_->fake_quant_blocks(h(x), h(out), grid, block_rows, block_cols);
  }
  void fake_quant_mxfp4(const Tensor& x, const Tensor& out) override { cpu_->fake_quant_mxfp4(h(x), h(out)); }
  void fake_quant_nvfp4(const Tensor& x, const Tensor& out) override { cpu_->fake_quant_nvfp4(h(x), h(out)); }
  void nf4_dequantize(const Tensor& codes, const Tensor& absmax_codes, const Tensor& absmax_steps, const Nf4Spec& spec,
                      int64_t first, const Tensor& out) override {
    cpu_->nf4_dequantize(h(codes), h(absmax_codes), h(absmax_steps), spec, first, h(out));
  }
  void dropout(const Tensor& x, const Tensor& out, float p, const RoundingDraw& draw) override {
    cpu_->dropout(h(x), h(out), p, draw);
  }
  void round_bf16(const Tensor& x, bool stochastic, const RoundingDraw& draw) override {
    cpu_->round_bf16(h(x), stochastic, draw);
  }
  void row_norms(const Tensor& x, const Tensor& norms) override { cpu_->row_norms(h(x), h(norms)); }
  void kv_attention(const KvAttendPlan& plan, const Tensor& q, const Tensor& pool, const Tensor& rings,
                    const Tensor& out) override {
    KvAttendPlan host_plan = plan;
    if (plan.sinks.defined()) host_plan.sinks = h(plan.sinks);
    cpu_->kv_attention(host_plan, h(q), h(pool), rings.defined() ? h(rings) : Tensor{}, h(out));
  }
  void argmax_rows(const Tensor& x, const Tensor& out) override { cpu_->argmax_rows(h(x), h(out)); }
  void sample_rows(const Tensor& logits, const std::vector<RowSampling>& rows, const std::vector<SamplePenalty>& penalties,
                   const Tensor& out) override {
    cpu_->sample_rows(h(logits), rows, penalties, h(out));
  }
  void kv_store(const KvStorePlan& plan, const std::vector<Tensor>& sources, const Tensor& pool, const Tensor& rings,
                const Tensor& status) override {
    std::vector<Tensor> from;
    for (const Tensor& t : sources) from.push_back(h(t));
    cpu_->kv_store(plan, from, h(pool), rings.defined() ? h(rings) : Tensor{}, h(status));
  }
  void soft_target_loss(const Tensor& logits, const Tensor& teacher, float temperature, float grad_scale,
                        const Tensor& losses, const Tensor& grad) override {
    cpu_->soft_target_loss(h(logits), h(teacher), temperature, grad_scale, h(losses), h(grad));
  }
  void dora_weight(const Tensor& merged, const Tensor& base, const Tensor& magnitude, const Tensor& norms,
                   const Tensor& out) override {
    cpu_->dora_weight(h(merged), h(base), h(magnitude), h(norms), h(out));
  }
  void dora_backward(const Tensor& grad, const Tensor& merged, const Tensor& magnitude, const Tensor& norms,
                     const Tensor& dmagnitude) override {
    cpu_->dora_backward(h(grad), h(merged), h(magnitude), h(norms), h(dmagnitude));
  }
  // ---- optimizer ops
  void sgd_step(const Tensor& p, const Tensor& g, const Tensor& buf, const OptimHyper& hy) override {
    cpu_->sgd_step(h(p), h(g), h(buf), hy);
  }
  void adagrad_step(const Tensor& p, const Tensor& g, const Tensor& sum, const OptimHyper& hy) override {
    cpu_->adagrad_step(h(p), h(g), h(sum), hy);
  }
  void rmsprop_step(const Tensor& p, const Tensor& g, const Tensor& square, const Tensor& avg, const Tensor& buf,
                    const OptimHyper& hy) override {
    cpu_->rmsprop_step(h(p), h(g), h(square), h(avg), h(buf), hy);
  }
  void adam_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const Tensor& vmax,
                 const OptimHyper& hy) override {
    cpu_->adam_step(h(p), h(g), h(m), h(v), h(vmax), hy);
  }
  void lion_step(const Tensor& p, const Tensor& g, const Tensor& m, const OptimHyper& hy) override {
    cpu_->lion_step(h(p), h(g), h(m), hy);
  }
  void adam_mini_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const OptimHyper& hy) override {
    cpu_->adam_mini_step(h(p), h(g), h(m), h(v), hy);
  }
  void adafactor_step(const Tensor& p, const Tensor& g, const Tensor& state, const Tensor& m, const Tensor& u,
                      const OptimHyper& hy) override {
    cpu_->adafactor_step(h(p), h(g), h(state), h(m), h(u), hy);
  }
  void sm3_step(const Tensor& p, const Tensor& g, const Tensor& acc, const OptimHyper& hy) override {
    cpu_->sm3_step(h(p), h(g), h(acc), hy);
  }
  void came_step(const Tensor& p, const Tensor& g, const Tensor& state, const Tensor& m, const Tensor& res, const Tensor& u,
                 const OptimHyper& hy) override {
    cpu_->came_step(h(p), h(g), h(state), h(m), h(res), h(u), hy);
  }
  void scale_transpose(const Tensor& src, const Tensor& dst, float scale, bool transpose) override {
    cpu_->scale_transpose(h(src), h(dst), scale, transpose);
  }
  void axpy(const Tensor& y, const Tensor& x, float alpha) override { cpu_->axpy(h(y), h(x), alpha); }
  void muon_momentum(const Tensor& g, const Tensor& buf, const Tensor& u, const OptimHyper& hy) override {
    cpu_->muon_momentum(h(g), h(buf), h(u), hy);
  }
  void newton_schulz_normalize(const Tensor& u, const Tensor& x) override { cpu_->newton_schulz_normalize(h(u), h(x)); }
  void decayed_update(const Tensor& p, const Tensor& u, float decay, float step) override {
    cpu_->decayed_update(h(p), h(u), decay, step);
  }
  void leading_eigenvectors(const Tensor& s, const Tensor& p) override { cpu_->leading_eigenvectors(h(s), h(p)); }
  void gram_schmidt(const Tensor& y, const Tensor& fallback, const Tensor& p) override {
    cpu_->gram_schmidt(h(y), h(fallback), h(p));
  }
  void ldadam_rotate(const Tensor& p, const Tensor& prev, const Tensor& m, const Tensor& v, const Tensor& mt,
                     const Tensor& vt, const OptimHyper& hy) override {
    cpu_->ldadam_rotate(h(p), h(prev), h(m), h(v), h(mt), h(vt), hy);
  }
  void ldadam_adam(const Tensor& m, const Tensor& v, const Tensor& mt, const Tensor& vt, const Tensor& gh,
                   const OptimHyper& hy) override {
    cpu_->ldadam_adam(h(m), h(v), h(mt), h(vt), h(gh), hy);
  }
  void ldadam_apply(const Tensor& p, const Tensor& g, const Tensor& d, const Tensor& e, bool transpose,
                    const OptimHyper& hy) override {
    cpu_->ldadam_apply(h(p), h(g), h(d), h(e), transpose, hy);
  }

 private:
  static Tensor h(const Tensor& t) { return t.defined() ? t.host_alias() : t; }

  StrictAllocator allocator_;
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
};

// The backend an op test runs on: "strict", or the named one where this build and machine have
// it and it states `capability`; otherwise null, with the reason in *skip.
inline std::unique_ptr<Backend> op_test_backend(const std::string& name, bool BackendCapabilities::*capability,
                                                std::string* skip) {
  if (name == "strict") return std::make_unique<StrictBackend>();
  if (!cuda_backend_built()) {
    *skip = "this build has no CUDA backend";
    return nullptr;
  }
  std::unique_ptr<Backend> backend;
  try {
    backend = make_backend(name);
  } catch (const Error& e) {
    *skip = e.what();
    return nullptr;
  }
  if (backend->capabilities().*capability) return backend;
  *skip = std::string(backend->name()) + " lacks the capability under test";
  return nullptr;
}

}  // namespace loom::test
