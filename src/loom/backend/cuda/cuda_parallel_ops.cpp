// The CUDA backend's model-parallel ops and q/k norm (cuda_parallel.cu).
// STUB: each op still forwards to Backend's default, which throws one line naming the op.
#include "loom/backend/cuda/cuda_backend_internal.h"

namespace loom::cuda_backend_detail {

bool parallel_ops_complete() { return false; }
bool head_norm_ops_complete() { return false; }

void CudaBackend::vocab_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t begin, int64_t valid, const Tensor& out) { Backend::vocab_embedding_forward(tokens, weight, begin, valid, out); }
void CudaBackend::vocab_embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dweight, int64_t begin, int64_t valid) { Backend::vocab_embedding_backward(tokens, dout, dweight, begin, valid); }
void CudaBackend::add_positions(const Tensor& out, const Tensor& positions, int64_t first) { Backend::add_positions(out, positions, first); }
void CudaBackend::positions_backward(const Tensor& dout, const Tensor& dpositions, int64_t first) { Backend::positions_backward(dout, dpositions, first); }
void CudaBackend::vocab_ce_partials(const Tensor& logits, const Tensor& targets, int64_t begin, int64_t valid, const Tensor& max, const Tensor& target) { Backend::vocab_ce_partials(logits, targets, begin, valid, max, target); }
void CudaBackend::vocab_ce_sums(const Tensor& logits, const Tensor& max, int64_t valid, const Tensor& sums) { Backend::vocab_ce_sums(logits, max, valid, sums); }
void CudaBackend::vocab_ce_finish(const Tensor& targets, const Tensor& lse, const Tensor& sums, const Tensor& losses) { Backend::vocab_ce_finish(targets, lse, sums, losses); }
void CudaBackend::vocab_ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t begin, int64_t valid, float scale, const Tensor& dlogits) { Backend::vocab_ce_backward(logits, targets, lse, begin, valid, scale, dlogits); }
void CudaBackend::ring_attention_merge(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& m, const Tensor& l, const Tensor& scratch, const RingBlock& block) { Backend::ring_attention_merge(q, k, v, out, m, l, scratch, block); }
void CudaBackend::ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head) { Backend::ring_attention_finish(out, lse, l, n_head); }
void CudaBackend::attention_row_dot(const Tensor& dout, const Tensor& out, const Tensor& D, int64_t n_head) { Backend::attention_row_dot(dout, out, D, n_head); }
void CudaBackend::ring_attention_block_backward(const Tensor& q, const Tensor& dout, const Tensor& lse, const Tensor& D, const Tensor& k, const Tensor& v, const Tensor& dq, const Tensor& dk, const Tensor& dv, const RingBlock& block) { Backend::ring_attention_block_backward(q, dout, lse, D, k, v, dq, dk, dv, block); }
void CudaBackend::copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& block) { Backend::copy_block(src, dst, block); }
void CudaBackend::head_rmsnorm_forward(const Tensor& x, const Tensor& weight, int64_t first, int64_t n, int64_t hd, float eps, const Tensor& in, const Tensor& rstd) { Backend::head_rmsnorm_forward(x, weight, first, n, hd, eps, in, rstd); }
void CudaBackend::head_rmsnorm_backward(const Tensor& dx, const Tensor& in, const Tensor& weight, const Tensor& rstd, int64_t first, int64_t n, int64_t hd, const Tensor& dweight) { Backend::head_rmsnorm_backward(dx, in, weight, rstd, first, n, hd, dweight); }

}  // namespace loom::cuda_backend_detail
