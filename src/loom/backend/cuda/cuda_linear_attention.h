// Launchers of Qwen3-Next's linear-attention kernels (cuda_linear_attention.cu): the gated delta
// rule (Backend::delta_rule_forward / _backward), the causal depthwise convolution with SiLU and
// the delta rule's gates. Plain device pointers and sizes in, work enqueued on `stream`, nothing
// synchronized; the op file (cuda_linear_attention_ops.cpp) validates the operands with the CPU's
// checks. The semantics are backend.h's and the CPU's (cpu/cpu_delta_rule.cpp,
// cpu/cpu_linear_attention_ops.cpp). T is float or double.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace loom::cuda {

// One gated-delta-rule call: B sequences of T positions, Hv value heads over Hk query/key heads,
// states of dk x dv, the backward's checkpoint interval `chunk` (>= 1).
struct DeltaRuleShape {
  int64_t B = 0, T = 0, Hv = 1, Hk = 1, dk = 1, dv = 1, chunk = 1;
};

// The recurrent form on every (b, h) head, a thread block each (whatever the caller's form: the
// forms agree to rounding, backend.h). initial / final: (B, Hv, dk, dv) or null. Scratch:
// delta_rule_forward_scratch_bytes (the heads' states when final is null).
size_t delta_rule_forward_scratch_bytes(const DeltaRuleShape& s, size_t elem_bytes);
template <typename T>
void delta_rule_forward(const T* q, const T* k, const T* v, const T* g, const T* beta, const T* initial, T* out,
                        T* final_state, void* scratch, const DeltaRuleShape& s, cudaStream_t stream);

// The reverse-time recurrence from checkpoints every `chunk` positions (the CPU's recurrent
// backward): dq, dk, dv, dg, dbeta overwritten, dinitial too where not null; dfinal null: zeros.
// dq / dk sum over a key head's value heads in value-head order (a second kernel).
size_t delta_rule_backward_scratch_bytes(const DeltaRuleShape& s, size_t elem_bytes);
template <typename T>
void delta_rule_backward(const T* q, const T* k, const T* v, const T* g, const T* beta, const T* initial,
                         const T* dout, const T* dfinal, T* dq, T* dk, T* dv, T* dg, T* dbeta, T* dinitial,
                         void* scratch, const DeltaRuleShape& s, cudaStream_t stream);

// x (B, T, C), weight (C, K), initial / final (B, K-1, C) or null; y overwritten.
template <typename T>
void causal_conv1d_silu_forward(const T* x, const T* weight, const T* initial, T* y, T* final_state, int64_t B,
                                int64_t Tn, int64_t C, int64_t K, cudaStream_t stream);
// dx (and dinitial where not null) overwritten, dweight accumulated. Scratch:
// causal_conv1d_silu_backward_scratch_bytes (d of the pre-activation).
size_t causal_conv1d_silu_backward_scratch_bytes(int64_t B, int64_t Tn, int64_t C, size_t elem_bytes);
template <typename T>
void causal_conv1d_silu_backward(const T* x, const T* weight, const T* initial, const T* dy, T* dx, T* dweight,
                                 T* dinitial, void* scratch, int64_t B, int64_t Tn, int64_t C, int64_t K,
                                 cudaStream_t stream);

// ba (N, 2H) = [b | a]; g, beta (N, H) overwritten.
template <typename T>
void delta_gates_forward(const T* ba, const T* a_log, const T* dt_bias, T* g, T* beta, int64_t N, int64_t H,
                         cudaStream_t stream);
// dba overwritten; da_log, ddt_bias accumulated (a block per head, a fixed order).
template <typename T>
void delta_gates_backward(const T* ba, const T* a_log, const T* dt_bias, const T* dg, const T* dbeta, T* dba,
                          T* da_log, T* ddt_bias, int64_t N, int64_t H, cudaStream_t stream);

}  // namespace loom::cuda
