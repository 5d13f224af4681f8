// Shape and dtype validation shared by every backend, so a bad call fails with the same one-line
// message on the CPU and on a GPU. Each check throws loom::Error naming the op and the operand.
#pragma once
#include <cstdint>
#include <vector>
#include <initializer_list>

#include "loom/backend/backend.h"
#include "loom/core/error.h"

namespace loom::checks {

// Calls fn.template operator()<T>() with T = float or double according to dtype; any other dtype
// throws naming the op and the backend ("CPU", "CUDA").
template <typename Fn>
void dispatch_float(DType dtype, const char* op, const char* backend, Fn&& fn) {
  if (dtype == DTYPE_F32) fn.template operator()<float>();
  else if (dtype == DTYPE_F64) fn.template operator()<double>();
  else throw Error(str_cat(op, ": not supported for dtype ", dtype_name(dtype), " on the ", backend, " backend (f32, f64)"));
}

void expect_dtype(const Tensor& t, DType dtype, const char* op, const char* what);
void expect_numel(const Tensor& t, int64_t numel, const char* op, const char* what);
// Rows of a tensor viewed as (rows, last dim).
int64_t rows_of(const Tensor& t);

// A GEMM's problem: C[b] (m, n) = op(A[b]) (m, k) @ op(B[b]) (k, n); lda/ldb are A's and B's
// row lengths, a_rows/b_rows their row counts per batch entry.
struct GemmDims {
  int64_t m, n, k, a_rows, a_cols, b_rows, b_cols;
};
GemmDims check_gemm(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec, const Tensor* bias);
// Backend::gemm_gelu's operands (scratch null: pre is the GEMM's C, other the activation of its
// size) or gemm_dgelu's (the f32 scratch is the GEMM's C, other is dx, pre of its size): beta 0.
GemmDims check_gemm_gelu(const char* op, const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& other,
                         const GemmSpec& spec, const Tensor* bias, const Tensor* scratch);
// Backend::bf16_weight_linear's operands; returns N, the input rows.
int64_t check_bf16_weight_linear(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor* bias);

// `others` share x's dtype and numel.
void check_elementwise(const char* op, const Tensor& x, std::initializer_list<const Tensor*> others);
// A forward op's output `out` of numel elements: x's dtype, or bf16 when x is f32 (the op rounds
// its output to nearest even: precision.activations = bf16's saved fields). Returns whether bf16.
bool check_output(const char* op, const Tensor& x, const Tensor& out, int64_t numel);
// A norm backward's dx16 (Backend::layernorm_backward): undefined, or bf16 of dx's numel for an
// f32 x (dx's values rounded to nearest even). Returns whether defined.
bool check_rounded_copy(const char* op, const Tensor& x, const Tensor& dx, const Tensor& dx16);
// bias_backward's dout (.., N) and dbias (N): one float dtype, or a bf16 dout with an f32 dbias
// (a gradient the op before wrote in bf16). Returns whether dout is bf16.
bool check_bias_backward(const Tensor& dout, const Tensor& dbias);
// x (N, C); `same` are (N, C); `per_channel` are (C); `per_row` are (N).
void check_row_op(const char* op, const Tensor& x, std::initializer_list<const Tensor*> same,
                  std::initializer_list<const Tensor*> per_channel, std::initializer_list<const Tensor*> per_row);

struct Dims3 {
  int64_t a, b, c;
};
// tokens (B, T) i32, table (V, C), positions (Tmax >= T, C) or null, activations (B, T, C):
// returns {B*T, T, C}.
Dims3 check_embedding(const char* op, const Tensor& tokens, const Tensor& table, const Tensor* positions,
                      const Tensor& activations);
// x (N, 2F), out (N, F): the shapes only.
void check_glu_shapes(const char* op, const Tensor& x, const Tensor& out);
// An activation's (gelu_*, glu_*) x, out (numel elements) and, for a backward, dout (dout_numel):
// one float dtype, or f32 and bf16 mixed: x bf16 (a bf16 GEMM output, widened exactly; dout then
// f32), out bf16 (rounded to nearest even). Shapes are the caller's to check.
struct ActivationIo {
  bool x_bf16 = false, out_bf16 = false;
  bool mixed() const { return x_bf16 || out_bf16; }
};
ActivationIo check_activation(const char* op, const Tensor& x, const Tensor& out, int64_t numel,
                              const Tensor* dout = nullptr, int64_t dout_numel = 0);
// x (B, T, W) with n_heads heads of an even head_dim in its first columns.
void check_rope(const char* op, const Tensor& x, int64_t head_dim, int64_t n_heads);
// rope_rows_forward: x (n, 1, W) with n = positions, each position >= 0, and check_rope's heads.
void check_rope_rows(const Tensor& x, int64_t head_dim, int64_t n_heads, const std::vector<int64_t>& positions);
// head_rmsnorm_*: x (..., W) holds heads [first, first + n) of hd; in (..., n hd) and rstd
// (..., n) its rows; weight (hd); all of x's dtype.
void check_head_rows(const char* op, const Tensor& x, const Tensor& weight, int64_t first, int64_t n, int64_t hd,
                     const Tensor& in, const Tensor& rstd);
// The dtype attention computes in: qkv's, or f32 for a bf16 qkv given to the bf16 ops
// (flash_attention_*_bf16, bf16_ops: qkv as the producing GEMM wrote it).
DType attention_compute_dtype(const Tensor& qkv, bool bf16_ops);
// qkv (B, T, (H + 2KV) hd), out (B, T, H hd), and `saved`: probs (B, H, T, T) when flash is
// false, lse (B, H, T) when true; window >= 0. With bf16_out (flash_attention_*_bf16) qkv may
// be bf16; the compute dtype (attention_compute_dtype) is then f32. out and saved have the
// compute dtype, or out is bf16 where that is f32 and bf16_out (O kept in bf16). Returns {B, T, hd}.
Dims3 check_attention(const char* op, const Tensor& qkv, const Tensor& out, const Tensor& saved, int64_t n_head,
                      int64_t n_kv_head, int64_t window, bool flash, bool bf16_out = false);
// The backward's operands: check_attention's, plus dout shaped as out and dqkv as qkv, each in
// the compute dtype, or bf16 where that is f32 and bf16_out (dout as the producing GEMM wrote it,
// dqkv rounded as stored).
Dims3 check_attention_backward(const char* op, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                               const Tensor& saved, const Tensor& dqkv, int64_t n_head, int64_t n_kv_head,
                               int64_t window, bool flash, bool bf16_out = false);
// Attention sinks (Backend::attention_sink_forward / _backward): out (B, T, H hd), lse (B, H, T),
// sinks (H), one dtype; with `dout` (out's shape) and `dsinks` (H) for the backward where given.
// Returns {B, T, hd}.
Dims3 check_attention_sinks(const char* op, const Tensor& out, const Tensor& lse, const Tensor& sinks, int64_t n_head,
                            const Tensor* dout = nullptr, const Tensor* dsinks = nullptr);
// logits (N, V), targets (N) i32, lse (N); the target values are checked by the backend.
void check_cross_entropy(const char* op, const Tensor& logits, const Tensor& targets, const Tensor& lse);
// The loss and its gradient in one op (Backend::cross_entropy_loss_and_grad, _columns): logits
// (N, V), or (V, N) `by_columns`; targets (N) i32; losses and lse (N) of the logits' dtype (f32 for
// bf16 logits); dlogits the logits themselves (in place) or a bf16 tensor of their shape for f32
// logits. Returns how the gradient is written.
enum class LossGradOut { in_place, to_bf16, bf16_in_place };
LossGradOut check_loss_and_grad(const char* op, const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                const Tensor& lse, const Tensor& dlogits, bool by_columns);

// The gated delta rule (Backend::delta_rule_forward): q, k (B, T, Hk, d_k), v and out (B, T, Hv,
// d_v) with Hv a multiple of Hk, g and beta (B, T, Hv), initial_state and final_state (B, Hv, d_k,
// d_v) where defined, all of q's dtype; chunk >= 1. The dtype itself is the backend's
// (dispatch_float).
struct DeltaRuleDims {
  int64_t B, T, H, dk, dv;  // H: the value heads (Hv; v, g, beta, out, the states)
  int64_t Hk;               // the query / key heads; value head h reads key head h / (H / Hk)
};
DeltaRuleDims check_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                               const Tensor& initial_state, const Tensor& out, const Tensor& final_state,
                               int64_t chunk);
// The backward's: the forward's with dout as out and dfinal_state as final_state, then dq, dk,
// dv, dg, dbeta shaped as q, k, v, g, beta and dinitial_state (where defined) as a state.
DeltaRuleDims check_delta_rule_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                        const Tensor& beta, const Tensor& initial_state, const Tensor& dout,
                                        const Tensor& dfinal_state, const Tensor& dq, const Tensor& dk,
                                        const Tensor& dv, const Tensor& dg, const Tensor& dbeta,
                                        const Tensor& dinitial_state, int64_t chunk);

// Backend::causal_conv1d_silu_*: x (B, T, C), weight (C, K >= 1), initial / final (B, K-1, C)
// where defined, y (B, T, C), all of x's dtype. The backward passes dy as y, and checks dx as x,
// dweight as weight and dinitial (where defined) as initial with check_causal_conv1d_grads.
struct ConvDims {
  int64_t B, T, C, K;
};
ConvDims check_causal_conv1d(const char* op, const Tensor& x, const Tensor& weight, const Tensor& initial,
                             const Tensor& y, const char* y_name, const Tensor& final_state);
void check_causal_conv1d_grads(const char* op, const ConvDims& d, const Tensor& x, const Tensor& dx,
                               const Tensor& dweight, const Tensor& dinitial);
// Backend::delta_gates_*: ba (..., 2H), a_log and dt_bias (H), g and beta (..., H) (ba's leading
// dimensions), all of ba's dtype. Returns {N = ba's rows, H}. The backward passes dg, dbeta as g,
// beta, and checks dba as ba, da_log, ddt_bias as a_log with check_delta_gates_grads.
struct GateDims {
  int64_t N, H;
};
GateDims check_delta_gates(const char* op, const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias,
                           const Tensor& g, const char* g_name, const Tensor& beta, const char* beta_name);
void check_delta_gates_grads(const char* op, const Tensor& ba, const Tensor& a_log, const Tensor& dba,
                             const Tensor& da_log, const Tensor& ddt_bias);

}  // namespace loom::checks
