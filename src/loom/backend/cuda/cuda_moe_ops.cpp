// The CUDA backend's mixture-of-experts routing, dispatch and combine (cuda_moe.cu).
// STUB: each op still forwards to Backend's default, which throws one line naming the op.
#include "loom/backend/cuda/cuda_backend_internal.h"

namespace loom::cuda_backend_detail {

bool moe_ops_complete() { return false; }

void CudaBackend::moe_route(const Tensor& logits, const Tensor& bias, const Tensor& scores, const Tensor& expert, const Tensor& gates, const Tensor& scratch, const MoeRouting& routing) { Backend::moe_route(logits, bias, scores, expert, gates, scratch, routing); }
void CudaBackend::moe_assign(const Tensor& expert, int64_t capacity, const Tensor& row, const Tensor& token, const Tensor& counts) { Backend::moe_assign(expert, capacity, row, token, counts); }
void CudaBackend::moe_dispatch(const Tensor& x, const Tensor& token, const Tensor& rows) { Backend::moe_dispatch(x, token, rows); }
void CudaBackend::moe_combine(const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out) { Backend::moe_combine(rows, row, gates, out); }
void CudaBackend::moe_combine_backward(const Tensor& dout, const Tensor& row, const Tensor& gates, const Tensor& drows) { Backend::moe_combine_backward(dout, row, gates, drows); }
void CudaBackend::moe_balance_stats(const Tensor& logits, const Tensor& scores, const Tensor& expert, const Tensor& counts, const Tensor& stats, const Tensor& scratch, const MoeRouting& routing) { Backend::moe_balance_stats(logits, scores, expert, counts, stats, scratch, routing); }
void CudaBackend::moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& expert, const Tensor& row, const Tensor& ye, const Tensor& dy, const Tensor& counts, const Tensor& dlogits, const Tensor& scratch, const MoeRouting& routing) { Backend::moe_router_backward(logits, scores, expert, row, ye, dy, counts, dlogits, scratch, routing); }

}  // namespace loom::cuda_backend_detail
