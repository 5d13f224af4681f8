// The CUDA backend's mixture-of-experts ops (backend.h: moe_route ... moe_router_backward): each
// validates its operands with the CPU's checks (moe_checks.h, same one-line errors), then runs
// the kernels of cuda_moe.cu on the backend's stream:
//   moe_route            moe_route_kernel (warp per token: scores, group and top-k selection, gates);
//   moe_assign           keys in priority order, cub's stable radix sort by expert, the counts,
//                        the rows and tokens (rank within an expert = position - its start);
//   moe_dispatch         a row gather (float4 when C % 4 == 0);
//   moe_combine(_backward) per-token weighted sums / scatters of rows, choices in order;
//   moe_balance_stats    per-chunk partials, then one block for the four statistics;
//   moe_router_backward  sequence counts (integer atomics), then a warp per token.
// The CPU-sized `scratch` operands (per OpenMP thread) are not used: scratch is the backend's
// workspace(). Host synchronization: moe_assign and moe_dispatch read the bad-index flag (8
// bytes) to throw the CPU's errors for expert ids or tokens out of range and for a token array
// too short for the kept rows; the MoE layer reads moe_assign's counts right after it anyway
// (nn/moe.cpp), so the stream is already drained there. The other ops do not synchronize.
#include <climits>

#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_moe.h"
#include "loom/backend/moe_checks.h"

namespace loom::cuda_backend_detail {

namespace {

// The kernels' 32-bit token, choice and expert indices (CUDA only).
void check_router_indices(const char* op, int64_t N, const MoeRouting& r) {
  LOOM_CHECK(N <= INT_MAX / r.top_k && r.experts < INT_MAX, op, ": ", N, " tokens of ", r.top_k, " choices over ",
             r.experts, " experts exceed the kernels' 32-bit indices");
}

cuda::MoeRoute route_of(const MoeRouting& r) {
  cuda::MoeRoute m;
  m.experts = r.experts, m.top_k = r.top_k, m.groups = r.groups, m.topk_groups = r.topk_groups;
  m.seq_len = r.seq_len, m.sigmoid = r.sigmoid, m.renorm = r.renorm, m.route_scale = r.route_scale;
  m.aux_alpha = r.aux_alpha, m.seq_aux_alpha = r.seq_aux_alpha, m.z_alpha = r.z_alpha;
  m.loss_weight = r.loss_weight;
  return m;
}

// The backend's bad-index slot, read back (synchronizes the stream); ULLONG_MAX: none.
unsigned long long read_flag(CudaBackend& be) {
  unsigned long long bad = 0;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&bad, be.flag(), sizeof(bad), cudaMemcpyDeviceToHost, be.stream()));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(be.stream()));
  return bad;
}

}  // namespace

bool moe_ops_complete() { return true; }

void CudaBackend::moe_route(const Tensor& logits, const Tensor& bias, const Tensor& scores, const Tensor& expert,
                            const Tensor& gates, const Tensor& scratch, const MoeRouting& routing) {
  // scratch is sized for the CPU's threads; unused here.
  const int64_t N = checks::check_moe_route(logits, bias, scores, expert, gates, scratch, routing);
  check_router_indices("moe_route", N, routing);
  const cuda::MoeRoute r = route_of(routing);
  const size_t bytes = cuda::moe_route_scratch_bytes(N, r);
  cuda::moe_route(dptr<float>(logits), dptr<float>(bias), dptr<float>(scores), dptr<int32_t>(expert),
                  dptr<float>(gates), bytes > 0 ? workspace(bytes) : nullptr, N, r, stream());
}

void CudaBackend::moe_assign(const Tensor& expert, int64_t capacity, const Tensor& row, const Tensor& token,
                             const Tensor& counts) {
  const char* op = "moe_assign";
  const checks::MoeAssignDims d = checks::check_moe_assign(expert, capacity, row, token, counts);
  const int64_t E = d.E, N = d.N, K = d.K;
  LOOM_CHECK(N * K <= INT_MAX && E < INT_MAX, op, ": ", N * K, " assignments exceed the kernels' 32-bit indices");
  reset_flag();
  cuda::moe_assign(dptr<int32_t>(expert), N, K, E, capacity, dptr<int32_t>(row), dptr<int32_t>(token),
                   token.numel(), dptr<int32_t>(counts), workspace(cuda::moe_assign_scratch_bytes(N, K, E)), flag(),
                   stream());
  const unsigned long long bad = read_flag(*this);
  if (bad == ~0ull) return;
  if (bad < static_cast<unsigned long long>(N * K)) {
    int32_t id = 0;
    read(expert.view(static_cast<int64_t>(bad), {1}), &id);
    throw Error(str_cat(op, ": expert ", id, " outside [0, ", E, ")"));
  }
  const int64_t kept = static_cast<int64_t>(bad) - N * K;
  throw Error(str_cat(op, ": token is ", token.describe(), ", needs at least ", kept, " elements"));
}

void CudaBackend::moe_dispatch(const Tensor& x, const Tensor& token, const Tensor& rows) {
  const char* op = "moe_dispatch";
  const checks::MoeDispatchDims d = checks::check_moe_dispatch(x, token, rows);
  const int64_t R = d.R, C = d.C, N = d.N;
  if (R == 0) return;
  reset_flag();
  cuda::moe_dispatch(dptr<float>(x), dptr<int32_t>(token), dptr<float>(rows), R, N, C, flag(), stream());
  const unsigned long long bad = read_flag(*this);
  if (bad == ~0ull) return;
  int32_t id = 0;
  read(token.view(static_cast<int64_t>(bad), {1}), &id);
  throw Error(str_cat(op, ": token ", id, " outside [0, ", N, ")"));
}

void CudaBackend::moe_combine(const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out) {
  const checks::MoeCombineDims d = checks::check_moe_combine(rows, row, gates, out);
  const int64_t N = d.N, C = d.C, K = d.K;
  cuda::moe_combine(dptr<float>(rows), dptr<int32_t>(row), dptr_or_null<float>(gates),
                    dptr<float>(out), N, K, checks::rows_of(rows), C, stream());
}

void CudaBackend::moe_combine_backward(const Tensor& dout, const Tensor& row, const Tensor& gates,
                                       const Tensor& drows) {
  const checks::MoeCombineDims d = checks::check_moe_combine_backward(dout, row, gates, drows);
  const int64_t N = d.N, C = d.C, K = d.K;
  cuda::moe_combine_backward(dptr<float>(dout), dptr<int32_t>(row), dptr<float>(gates), dptr<float>(drows), N, K,
                             checks::rows_of(drows), C, stream());
}

void CudaBackend::moe_balance_stats(const Tensor& logits, const Tensor& scores, const Tensor& expert,
                                    const Tensor& counts, const Tensor& stats, const Tensor& scratch,
                                    const MoeRouting& routing) {
  // scratch is the CPU's; unused here.
  const int64_t N = checks::check_moe_balance_stats(logits, scores, expert, counts, stats, scratch, routing);
  check_router_indices("moe_balance_stats", N, routing);
  const cuda::MoeRoute r = route_of(routing);
  cuda::moe_balance_stats(dptr<float>(logits), dptr<float>(scores), dptr<int32_t>(expert), dptr<int32_t>(counts),
                          dptr<double>(stats), workspace(cuda::moe_balance_stats_scratch_bytes(N, r)), N, r, stream());
}

void CudaBackend::moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& expert,
                                      const Tensor& row, const Tensor& ye, const Tensor& dy, const Tensor& counts,
                                      const Tensor& dlogits, const Tensor& scratch, const MoeRouting& routing) {
  // scratch is the CPU's; unused here.
  const checks::MoeRouterBackwardDims d =
      checks::check_moe_router_backward(logits, scores, expert, row, ye, dy, counts, dlogits, scratch, routing);
  const int64_t N = d.N, C = d.C;
  check_router_indices("moe_router_backward", N, routing);
  const cuda::MoeRoute r = route_of(routing);
  cuda::moe_router_backward(dptr<float>(logits), dptr<float>(scores), dptr<int32_t>(expert), dptr<int32_t>(row),
                            dptr<float>(ye), dptr<float>(dy), dptr<int32_t>(counts), dptr<float>(dlogits),
                            workspace(cuda::moe_router_backward_scratch_bytes(N, r)), N, C, r, stream());
}

}  // namespace loom::cuda_backend_detail
