// Launchers of the mixture-of-experts kernels (cuda_moe.cu): plain device pointers and sizes in,
// work enqueued on `stream`, nothing synchronized. The op file (cuda_moe_ops.cpp) validates the
// operands with the CPU's checks, then calls these; the semantics are backend.h's moe_* and the
// CPU's (cpu/cpu_moe_ops.cpp). f32 only (the ops' contract). No floating-point atomics: every sum
// has a fixed order, so two runs are bitwise equal.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace loom::cuda {

// backend.h's MoeRouting as plain values (kernels take it by value).
struct MoeRoute {
  int64_t experts = 1, top_k = 1, groups = 1, topk_groups = 1, seq_len = 1;
  bool sigmoid = false, renorm = true;
  float route_scale = 1.0f, aux_alpha = 0.0f, seq_aux_alpha = 0.0f, z_alpha = 0.0f, loss_weight = 1.0f;
};

// Router: scores (N, E), expert (N, k), gates (N, k) from logits (N, E) and bias (E). Scratch:
// moe_route_scratch_bytes (0 while E + 2G fits the kernel's shared memory).
size_t moe_route_scratch_bytes(int64_t tokens, const MoeRoute& r);
void moe_route(const float* logits, const float* bias, float* scores, int32_t* expert, float* gates, void* scratch,
               int64_t tokens, const MoeRoute& r, cudaStream_t stream);

// Capacity: row (N, k), token (token_len entries), counts (3E + 1). Expert ids outside [0, E)
// record the lowest assignment index a = t k + j with atomicMin into *bad; a token array too
// short for the kept rows records N k + (rows kept) there (the caller sets *bad = ULLONG_MAX
// before and reads it after). Scratch: moe_assign_scratch_bytes.
size_t moe_assign_scratch_bytes(int64_t tokens, int64_t top_k, int64_t experts);
void moe_assign(const int32_t* expert, int64_t tokens, int64_t top_k, int64_t experts, int64_t capacity, int32_t* row,
                int32_t* token, int64_t token_len, int32_t* counts, void* scratch, unsigned long long* bad,
                cudaStream_t stream);

// rows[r] = x[token[r]] (R rows of C); tokens outside [0, N) record the lowest r in *bad (its row
// is not written).
void moe_dispatch(const float* x, const int32_t* token, float* rows, int64_t n_rows, int64_t tokens, int64_t channels,
                  unsigned long long* bad, cudaStream_t stream);
// out[t] += sum_j gates[t,j] rows[row[t,j]] (gates null: weight 1), kept rows (0 <= row < n_rows) only.
void moe_combine(const float* rows, const int32_t* row, const float* gates, float* out, int64_t tokens, int64_t top_k,
                 int64_t n_rows, int64_t channels, cudaStream_t stream);
// drows[row[t,j]] = gates[t,j] dout[t] for the kept (t, j).
void moe_combine_backward(const float* dout, const int32_t* row, const float* gates, float* drows, int64_t tokens,
                          int64_t top_k, int64_t n_rows, int64_t channels, cudaStream_t stream);

// stats (4) f64 = [aux, seq_aux, z, entropy]; counts: moe_assign's. Scratch: moe_balance_stats_scratch_bytes.
size_t moe_balance_stats_scratch_bytes(int64_t tokens, const MoeRoute& r);
void moe_balance_stats(const float* logits, const float* scores, const int32_t* expert, const int32_t* counts,
                       double* stats, void* scratch, int64_t tokens, const MoeRoute& r, cudaStream_t stream);

// dlogits (N, E) overwritten. ye (R, C), dy (N, C). Scratch: moe_router_backward_scratch_bytes.
size_t moe_router_backward_scratch_bytes(int64_t tokens, const MoeRoute& r);
void moe_router_backward(const float* logits, const float* scores, const int32_t* expert, const int32_t* row,
                         const float* ye, const float* dy, const int32_t* counts, float* dlogits, void* scratch,
                         int64_t tokens, int64_t channels, const MoeRoute& r, cudaStream_t stream);

}  // namespace loom::cuda
