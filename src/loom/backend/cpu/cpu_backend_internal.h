// The CPU backend's class (make_cpu_backend in backend.h), shared by the files that define its
// overrides: the ones with a body of their own are cpu_backend.cpp's and, for attention,
// cpu_backend_attention.cpp's; the one-line overrides that forward to the op files
// (cpu_compress.cpp, cpu_parallel_ops.cpp, ...) are here. Not for callers.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "loom/backend/backend.h"
#include "loom/backend/checks.h"
#include "loom/backend/cpu/cpu_compress.h"
#include "loom/backend/cpu/cpu_gemm.h"
#include "loom/backend/cpu/cpu_moe_ops.h"
#include "loom/backend/cpu/cpu_optim_ops.h"
#include "loom/backend/cpu/cpu_parallel_ops.h"
#include "loom/backend/cpu/cpu_quant_ops.h"

namespace loom::cpu_backend_detail {

using checks::check_attention;
using checks::check_attention_backward;
using checks::check_cross_entropy;
using checks::check_loss_and_grad;
using checks::check_elementwise;
using checks::check_embedding;
using checks::check_output;
using checks::check_row_op;
using checks::dispatch_float;
using checks::expect_dtype;
using checks::expect_numel;
using checks::rows_of;

constexpr const char* kBackend = "CPU";  // in dtype errors

// A bf16 tensor's elements as the bits the kernels write (cpu_math.h round_to_bf16_bits).
inline uint16_t* bf16_bits(const Tensor& t) { return reinterpret_cast<uint16_t*>(t.data<bf16>()); }

class CpuBackend final : public Backend {
 public:
  std::string_view name() const override { return "cpu"; }
  // Host code reads CPU memory directly: every feature runs.
  BackendCapabilities capabilities() const override { return kEveryCapability; }
  std::string gemm_kernels(DType dtype) const override { return cpu::gemm_kernels(dtype == DTYPE_BF16); }
  Allocator& allocator() override { return allocator_; }

  void write(const Tensor& dst, const void* host) override { std::memcpy(dst.raw_data(), host, dst.nbytes()); }
  void read(const Tensor& src, void* host) override { std::memcpy(host, src.raw_data(), src.nbytes()); }

  // Memory, GEMM, elementwise ops, norms, embeddings, activations, RoPE: cpu_backend.cpp.
  void gemm(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec, const Tensor* bias) override;
  void fill(const Tensor& x, double value) override;
  void copy(const Tensor& src, const Tensor& dst) override;
  void cast(const Tensor& src, const Tensor& dst) override;
  void add(const Tensor& a, const Tensor& b, const Tensor& out) override;
  void add_inplace(const Tensor& acc, const Tensor& x) override;
  void scale_inplace(const Tensor& x, double factor) override;
  double sum_squares(const Tensor& x) override;
  double sum(const Tensor& x) override;
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
  void head_rmsnorm_forward(const Tensor& x, const Tensor& weight, int64_t first, int64_t n, int64_t hd, float eps,
                            const Tensor& in, const Tensor& rstd) override;
  void head_rmsnorm_backward(const Tensor& dx, const Tensor& in, const Tensor& weight, const Tensor& rstd,
                             int64_t first, int64_t n, int64_t hd, const Tensor& dweight) override;
  void gelu_forward(const Tensor& x, const Tensor& out) override;
  void gelu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx) override;
  void glu_forward(const Tensor& x, const Tensor& out, GateActivation act) override;
  void glu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx, GateActivation act) override;
  // The gated delta rule: cpu_delta_rule.cpp.
  void delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& initial_state, const Tensor& out, const Tensor& final_state,
                          DeltaRuleForm form, int64_t chunk) override;
  void delta_rule_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                           const Tensor& initial_state, const Tensor& dout, const Tensor& dfinal_state,
                           const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dbeta,
                           const Tensor& dinitial_state, DeltaRuleForm form, int64_t chunk) override;
  // Qwen3-Next's causal depthwise convolution + SiLU and the delta rule's gates:
  // cpu_linear_attention_ops.cpp.
  void causal_conv1d_silu_forward(const Tensor& x, const Tensor& weight, const Tensor& initial, const Tensor& y,
                                  const Tensor& final_state) override;
  void causal_conv1d_silu_backward(const Tensor& x, const Tensor& weight, const Tensor& initial, const Tensor& dy,
                                   const Tensor& dx, const Tensor& dweight, const Tensor& dinitial) override;
  void delta_gates_forward(const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& g,
                           const Tensor& beta) override;
  void delta_gates_backward(const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& dg,
                            const Tensor& dbeta, const Tensor& dba, const Tensor& da_log,
                            const Tensor& ddt_bias) override;
  // Attention sinks: cpu_attention_sinks.cpp.
  void attention_sink_forward(const Tensor& out, const Tensor& lse, const Tensor& sinks, int64_t n_head) override;
  void attention_sink_backward(const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& sinks,
                               const Tensor& dsinks, int64_t n_head) override;
  void rope_forward(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                    int64_t pos_offset) override;
  void rope_backward(const Tensor& dx, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                     int64_t pos_offset) override;

  // Attention and FlashAttention: cpu_backend_attention.cpp.
  void attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                         int64_t n_kv_head, int64_t window) override;
  void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                          const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) override;
  void attention_forward_bf16(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                              int64_t n_kv_head) override;
  void attention_backward_bf16(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                               const Tensor& dqkv, int64_t n_head, int64_t n_kv_head) override;
  void flash_attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& lse, int64_t n_head,
                               int64_t n_kv_head, int64_t window) override;
  void flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                                const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) override;

  // Cross-entropy: cpu_backend.cpp.
  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                             const Tensor& lse) override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, float dloss,
                              const Tensor& dlogits) override;
  void cross_entropy_loss_and_grad(const Tensor& logits, const Tensor& targets, const Tensor& losses, const Tensor& lse,
                                   float dloss, const Tensor& dlogits) override;
  void cross_entropy_loss_and_grad_columns(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                           const Tensor& lse, float dloss, const Tensor& dlogits) override;
  // Either of the two: the shared checks, the targets' range, the layout's kernel.
  void loss_and_grad(const char* op, bool by_columns, const Tensor& logits, const Tensor& targets,
                     const Tensor& losses, const Tensor& lse, float dloss, const Tensor& dlogits);

  // Gradient compression: cpu_compress.cpp.
  void topk_extract(const Tensor& acc, const Tensor& idx, const Tensor& val, const Tensor& scratch) override {
    cpu::topk_extract(acc, idx, val, scratch);
  }
  void scatter_add(const Tensor& idx, const Tensor& val, const Tensor& out) override { cpu::scatter_add(idx, val, out); }
  void scatter_zero(const Tensor& idx, const Tensor& x) override { cpu::scatter_zero(idx, x); }
  void dgc_accumulate(const Tensor& g, const Tensor& u, const Tensor& v, float momentum, double clip) override {
    cpu::dgc_accumulate(g, u, v, momentum, clip);
  }
  void onebit_encode(const Tensor& acc, const Tensor& words, const Tensor& scale) override {
    cpu::onebit_encode(acc, words, scale);
  }
  void onebit_decode_add(const Tensor& words, const Tensor& scales, const Tensor& out) override {
    cpu::onebit_decode_add(words, scales, out);
  }
  void qsgd_encode(const Tensor& g, const Tensor& codes, const Tensor& norm, const QsgdSpec& spec) override {
    cpu::qsgd_encode(g, codes, norm, spec);
  }
  void qsgd_decode_add(const Tensor& codes, const Tensor& norms, int levels, const Tensor& out) override {
    cpu::qsgd_decode_add(codes, norms, levels, out);
  }
  void lowrank_project(const Tensor& m, const Tensor& q, const Tensor& out, bool transpose) override {
    cpu::lowrank_project(m, q, out, transpose);
  }
  void orthonormalize_columns(const Tensor& p) override { cpu::orthonormalize_columns(p); }
  void lowrank_expand(const Tensor& p, const Tensor& q, const Tensor& out, float alpha, float beta) override {
    cpu::lowrank_expand(p, q, out, alpha, beta);
  }

  // Model parallelism: cpu_parallel_ops.cpp.
  void vocab_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t begin, int64_t valid,
                               const Tensor& out) override {
    cpu::vocab_embedding_forward(tokens, weight, begin, valid, out);
  }
  void vocab_embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dweight, int64_t begin,
                                int64_t valid) override {
    cpu::vocab_embedding_backward(tokens, dout, dweight, begin, valid);
  }
  void add_positions(const Tensor& out, const Tensor& positions, int64_t first) override {
    cpu::add_positions(out, positions, first);
  }
  void positions_backward(const Tensor& dout, const Tensor& dpositions, int64_t first) override {
    cpu::positions_backward(dout, dpositions, first);
  }
  void vocab_ce_partials(const Tensor& logits, const Tensor& targets, int64_t begin, int64_t valid,
                         const Tensor& max, const Tensor& target) override {
    cpu::vocab_ce_partials(logits, targets, begin, valid, max, target);
  }
  void vocab_ce_sums(const Tensor& logits, const Tensor& max, int64_t valid, const Tensor& sums) override {
    cpu::vocab_ce_sums(logits, max, valid, sums);
  }
  void vocab_ce_finish(const Tensor& targets, const Tensor& lse, const Tensor& sums, const Tensor& losses) override {
    cpu::vocab_ce_finish(targets, lse, sums, losses);
  }
  void vocab_ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t begin, int64_t valid,
                         float scale, const Tensor& dlogits) override {
    cpu::vocab_ce_backward(logits, targets, lse, begin, valid, scale, dlogits);
  }
  void ring_attention_merge(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& m,
                            const Tensor& l, const Tensor& scratch, const RingBlock& block) override {
    cpu::ring_attention_merge(q, k, v, out, m, l, scratch, block);
  }
  void ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head) override {
    cpu::ring_attention_finish(out, lse, l, n_head);
  }
  void attention_row_dot(const Tensor& dout, const Tensor& out, const Tensor& D, int64_t n_head) override {
    cpu::attention_row_dot(dout, out, D, n_head);
  }
  void ring_attention_block_backward(const Tensor& q, const Tensor& dout, const Tensor& lse, const Tensor& D,
                                     const Tensor& k, const Tensor& v, const Tensor& dq, const Tensor& dk,
                                     const Tensor& dv, const RingBlock& block) override {
    cpu::ring_attention_block_backward(q, dout, lse, D, k, v, dq, dk, dv, block);
  }
  // Model-parallel slicing (cpu_parallel_ops.cpp).
  void copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& block) override {
    cpu::copy_block(src, dst, block);
  }

  // Mixture of experts and latent attention: cpu_moe_ops.cpp, cpu_mla_ops.cpp.
  void moe_route(const Tensor& logits, const Tensor& bias, const Tensor& scores, const Tensor& expert,
                 const Tensor& gates, const Tensor& scratch, const MoeRouting& routing) override {
    cpu::moe_route(logits, bias, scores, expert, gates, scratch, routing);
  }
  void moe_assign(const Tensor& expert, int64_t capacity, const Tensor& row, const Tensor& token,
                  const Tensor& counts) override {
    cpu::moe_assign(expert, capacity, row, token, counts);
  }
  void moe_dispatch(const Tensor& x, const Tensor& token, const Tensor& rows) override {
    cpu::moe_dispatch(x, token, rows);
  }
  void moe_combine(const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out) override {
    cpu::moe_combine(rows, row, gates, out);
  }
  void moe_combine_backward(const Tensor& dout, const Tensor& row, const Tensor& gates, const Tensor& drows) override {
    cpu::moe_combine_backward(dout, row, gates, drows);
  }
  void moe_balance_stats(const Tensor& logits, const Tensor& scores, const Tensor& expert, const Tensor& counts,
                         const Tensor& stats, const Tensor& scratch, const MoeRouting& routing) override {
    cpu::moe_balance_stats(logits, scores, expert, counts, stats, scratch, routing);
  }
  void moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& expert, const Tensor& row,
                           const Tensor& ye, const Tensor& dy, const Tensor& counts, const Tensor& dlogits,
                           const Tensor& scratch, const MoeRouting& routing) override {
    cpu::moe_router_backward(logits, scores, expert, row, ye, dy, counts, dlogits, scratch, routing);
  }
  void mla_rope(const Tensor& x, int64_t heads, int64_t stride, int64_t offset, int64_t rope_dim, const RopeSpec& rope_spec,
                int64_t pos_offset, bool inverse) override {
    cpu::mla_rope(x, heads, stride, offset, rope_dim, rope_spec, pos_offset, inverse);
  }
  void mla_attention_forward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                             const Tensor& out, const MlaDims& dims) override {
    cpu::mla_attention_forward(q, kr, kv, probs, out, dims);
  }
  void mla_attention_backward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                              const Tensor& dout, const Tensor& dq, const Tensor& dkv, const Tensor& dkr,
                              const Tensor& dp_row, const MlaDims& dims) override {
    cpu::mla_attention_backward(q, kr, kv, probs, dout, dq, dkv, dkr, dp_row, dims);
  }
  void mla_attend_latents(const Tensor& q, const Tensor& latents, const Tensor& kv_b, const Tensor& out,
                          const MlaDims& dims) override {
    cpu::mla_attend_latents(q, latents, kv_b, out, dims);
  }
  // Optimizers: cpu_optim_ops.cpp, cpu_optim_factored.cpp.
  void sgd_step(const Tensor& p, const Tensor& g, const Tensor& buf, const OptimHyper& h) override { cpu::sgd_step(p, g, buf, h); }
  void adagrad_step(const Tensor& p, const Tensor& g, const Tensor& sum, const OptimHyper& h) override {
    cpu::adagrad_step(p, g, sum, h);
  }
  void rmsprop_step(const Tensor& p, const Tensor& g, const Tensor& square, const Tensor& avg, const Tensor& buf,
                    const OptimHyper& h) override {
    cpu::rmsprop_step(p, g, square, avg, buf, h);
  }
  void adam_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const Tensor& vmax,
                 const OptimHyper& h) override {
    cpu::adam_step(p, g, m, v, vmax, h);
  }
  void lion_step(const Tensor& p, const Tensor& g, const Tensor& m, const OptimHyper& h) override { cpu::lion_step(p, g, m, h); }
  void adam_mini_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const OptimHyper& h) override {
    cpu::adam_mini_step(p, g, m, v, h);
  }
  void adafactor_step(const Tensor& p, const Tensor& g, const Tensor& state, const Tensor& m, const Tensor& u,
                      const OptimHyper& h) override {
    cpu::adafactor_step(p, g, state, m, u, h);
  }
  void sm3_step(const Tensor& p, const Tensor& g, const Tensor& acc, const OptimHyper& h) override { cpu::sm3_step(p, g, acc, h); }
  void came_step(const Tensor& p, const Tensor& g, const Tensor& state, const Tensor& m, const Tensor& res, const Tensor& u,
                 const OptimHyper& h) override {
    cpu::came_step(p, g, state, m, res, u, h);
  }
  void scale_transpose(const Tensor& src, const Tensor& dst, float scale, bool transpose) override {
    cpu::scale_transpose(src, dst, scale, transpose);
  }
  void axpy(const Tensor& y, const Tensor& x, float alpha) override { cpu::axpy(y, x, alpha); }
  void muon_momentum(const Tensor& g, const Tensor& buf, const Tensor& u, const OptimHyper& h) override {
    cpu::muon_momentum(g, buf, u, h);
  }
  void newton_schulz_normalize(const Tensor& u, const Tensor& x) override { cpu::newton_schulz_normalize(u, x); }
  void decayed_update(const Tensor& p, const Tensor& u, float decay, float step) override {
    cpu::decayed_update(p, u, decay, step);
  }
  void leading_eigenvectors(const Tensor& s, const Tensor& p) override { cpu::leading_eigenvectors(s, p); }
  void gram_schmidt(const Tensor& y, const Tensor& fallback, const Tensor& p) override { cpu::gram_schmidt(y, fallback, p); }
  void ldadam_rotate(const Tensor& p, const Tensor& prev, const Tensor& m, const Tensor& v, const Tensor& mt,
                     const Tensor& vt, const OptimHyper& h) override {
    cpu::ldadam_rotate(p, prev, m, v, mt, vt, h);
  }
  void ldadam_adam(const Tensor& m, const Tensor& v, const Tensor& mt, const Tensor& vt, const Tensor& gh,
                   const OptimHyper& h) override {
    cpu::ldadam_adam(m, v, mt, vt, gh, h);
  }
  void ldadam_apply(const Tensor& p, const Tensor& g, const Tensor& d, const Tensor& e, bool transpose,
                    const OptimHyper& h) override {
    cpu::ldadam_apply(p, g, d, e, transpose, h);
  }

  // AdamW: cpu_backend.cpp.
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const AdamWHyper& h) override;

  // Low precision: cpu_quant_ops.cpp.
  float amax(const Tensor& x) override { return cpu::amax(x); }
  void fake_quant(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale, float post) override {
    cpu::fake_quant(x, out, grid, scale, post);
  }
  void quant_codes_bf16(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale) override {
    cpu::quant_codes_bf16(x, out, grid, scale);
  }
  void fake_quant_blocks(const Tensor& x, const Tensor& out, const NumberGrid& grid, int64_t block_rows,
                         int64_t block_cols) override {
    cpu::fake_quant_blocks(x, out, grid, block_rows, block_cols);
  }
  void fake_quant_mxfp4(const Tensor& x, const Tensor& out) override { cpu::fake_quant_mxfp4(x, out); }
  void fake_quant_nvfp4(const Tensor& x, const Tensor& out) override { cpu::fake_quant_nvfp4(x, out); }
  void nf4_dequantize(const Tensor& codes, const Tensor& absmax_codes, const Tensor& absmax_steps, const Nf4Spec& spec,
                      int64_t first, const Tensor& out) override {
    cpu::nf4_dequantize(codes, absmax_codes, absmax_steps, spec, first, out);
  }
  void soft_target_loss(const Tensor& logits, const Tensor& teacher, float temperature, float grad_scale, const Tensor& losses,
                        const Tensor& grad) override {
    cpu::soft_target_loss(logits, teacher, temperature, grad_scale, losses, grad);
  }
  void kv_attention(const KvAttendPlan& plan, const Tensor& q, const Tensor& pool, const Tensor& rings,
                    const Tensor& out) override {
    check_kv_attention(plan, q, pool, rings, out);
    kv_attention_host(plan, q.data<float>(), pool.data<uint8_t>(), rings.defined() ? rings.data<float>() : nullptr,
                      plan.sinks.defined() ? plan.sinks.data<float>() : nullptr, out.data<float>());
  }
  void argmax_rows(const Tensor& x, const Tensor& out) override {
    check_argmax_rows(x, out);
    const int64_t n = x.dim(0), V = x.dim(1);
    const float* p = x.data<float>();
    int32_t* o = out.data<int32_t>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<int32_t>(std::max_element(p + i * V, p + (i + 1) * V) - (p + i * V));
  }
  void sample_rows(const Tensor& logits, const std::vector<RowSampling>& rows, const std::vector<SamplePenalty>& penalties,
                   const Tensor& out) override {
    check_sample_rows(logits, rows, penalties, out);
    const int64_t n = logits.dim(0), V = logits.dim(1);
    apply_penalties(logits.data<float>(), V, penalties);
    const float* p = logits.data<float>();
    int32_t* o = out.data<int32_t>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      thread_local SampleCandidates scratch;
      o[i] = sample_row(p + i * V, V, rows[static_cast<size_t>(i)], scratch);
    }
  }
  void kv_store(const KvStorePlan& plan, const std::vector<Tensor>& sources, const Tensor& pool, const Tensor& rings,
                const Tensor& status) override {
    check_kv_store(plan, sources, pool, rings, status);
    std::vector<const float*> from;
    for (const Tensor& t : sources) from.push_back(t.data<float>());
    kv_store_host(plan, from, pool.data<uint8_t>(), rings.defined() ? rings.data<float>() : nullptr,
                  status.data<int32_t>());
  }
  void int_linear(const Tensor& x, const Tensor& codes, const Tensor& scales, const Tensor& zeros,
                  const IntWeightSpec& spec, const Tensor* input_scale, const Tensor& y, float beta, const Tensor* bias) override {
    cpu::int_linear(x, codes, scales, zeros, spec, input_scale, y, beta, bias);
  }
  void int_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& zeros, const IntWeightSpec& spec,
                      const Tensor* input_scale, const Tensor& out) override {
    cpu::int_dequantize(codes, scales, zeros, spec, input_scale, out);
  }
  void bf16_weight_linear(const Tensor& x, const Tensor& w, const Tensor& y, float beta, const Tensor* bias) override {
    cpu::bf16_weight_linear(x, w, y, beta, bias);
  }
  void dropout(const Tensor& x, const Tensor& out, float p, const RoundingDraw& draw) override {
    cpu::dropout(x, out, p, draw);
  }
  void round_bf16(const Tensor& x, bool stochastic, const RoundingDraw& draw) override {
    cpu::round_bf16(x, stochastic, draw);
  }
  void row_norms(const Tensor& x, const Tensor& norms) override { cpu::row_norms(x, norms); }
  void dora_weight(const Tensor& merged, const Tensor& base, const Tensor& magnitude, const Tensor& norms,
                   const Tensor& out) override {
    cpu::dora_weight(merged, base, magnitude, norms, out);
  }
  void dora_backward(const Tensor& grad, const Tensor& merged, const Tensor& magnitude, const Tensor& norms,
                     const Tensor& dmagnitude) override {
    cpu::dora_backward(grad, merged, magnitude, norms, dmagnitude);
  }

 private:
  template <typename T>
  static void add_bias_rows(T* c, const T* bias, int64_t rows, int64_t cols);
  void gemm_bf16_out(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec,
                     const checks::GemmDims& d, const Tensor* bias);
  std::unique_ptr<float[]> gemm_out_;  // gemm_bf16_out's fp32 panel (at most 16 MB)
  int64_t gemm_out_floats_ = 0;
  template <typename F>
  double reduce_fixed_order(const Tensor& x, const char* op, F f);
  static void check_token_range(const char* op, const Tensor& tokens, int64_t vocab);
  void rope(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec, int64_t pos_offset,
            double direction, const char* op);
  static void check_target_range(const char* op, int64_t vocab, const Tensor& targets);
  Tensor workspace(int64_t count, DType dtype);
  CpuAllocator allocator_;
  Tensor workspace_;  // see workspace()
};

}  // namespace loom::cpu_backend_detail
