// The CUDA backend's model-parallel ops and per-head q/k RMSNorm: operand checks (the CPU
// backend's, shared in parallel_checks.h, plus the kernels' head_dim limit), then the launchers of
// cuda_parallel.cu on the backend's stream:
//   vocab_embedding_forward / _backward   warp-per-token copy; the backward reuses embedding_backward's
//                                         sort (cuda_kernels.h) on ids shifted into the slice
//   add_positions / positions_backward    elementwise; per-(t, c) sums over b in order (CPU bits)
//   vocab_ce_partials / _sums / _finish / _backward   block-per-row max, sum of exp, finish, gradient
//   ring_attention_merge / _finish, attention_row_dot, ring_attention_block_backward
//                                         warp per query row (merge, dq) and per key row (dk, dv)
//   copy_block                            any dtype, as bytes in the widest aligned word
//   head_rmsnorm_forward / _backward      warp per (token, head) row; dweight by fixed-order chunks
// No op synchronizes with the host or round-trips through host memory. Scratch comes from the
// backend's workspace (vocab_embedding_backward: the sort; head_rmsnorm_backward: the dweight
// partials). ring_attention_merge ignores `scratch` (the CPU's per-thread score rows): the kernel
// recomputes each score instead of storing it. ring_attention_merge and _block_backward need
// head_dim <= 256 (a warp holds a row in registers, 8 elements per lane). Order of sums: the
// per-element updates follow the CPU's order; row sums (vocab_ce_sums' "in order" sum of exps,
// the dot products of ring attention, the norms' row sums) are lane-strided partials plus a fixed
// tree, so they match the CPU within the op tests' tolerances, not bitwise; positions_backward
// and copy_block are bitwise the CPU's.
#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_parallel.h"
#include "loom/backend/parallel_checks.h"

namespace loom::cuda_backend_detail {

bool parallel_ops_complete() { return true; }
bool head_norm_ops_complete() { return true; }

using checks::dispatch_float;

namespace {

// The launchers' shape of a ring op's checked dimensions and its rank / world / owner.
// in_registers: the op's kernels hold a row per warp in registers (head_dim <= kRingMaxHeadDim),
// a limit the CPU does not have.
cuda::RingShape ring_shape(const char* op, const checks::RingOpDims& d, int rank, int world, int owner,
                           bool in_registers) {
  LOOM_CHECK(!in_registers || d.hd <= cuda::kRingMaxHeadDim, op, ": head_dim ", d.hd, " exceeds the CUDA kernels' ",
             cuda::kRingMaxHeadDim);
  return {d.B, d.Tl, d.H, d.KV, d.hd, rank, world, owner};
}

}  // namespace

// ---- The vocabulary-parallel ends

void CudaBackend::vocab_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t begin, int64_t valid,
                                          const Tensor& out) {
  const checks::VocabTokenDims dims = checks::check_vocab_embedding_forward(tokens, weight, valid, out);
  const int64_t n = dims.n, C = dims.C;
  cuda::vocab_embedding_forward(dptr<int32_t>(tokens), dptr<float>(weight), dptr<float>(out), n, C, begin, valid,
                                stream());
}

void CudaBackend::vocab_embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dweight,
                                           int64_t begin, int64_t valid) {
  const checks::VocabTokenDims dims = checks::check_vocab_embedding_backward(tokens, dout, dweight, valid);
  const int64_t n = dims.n, C = dims.C;
  if (n == 0 || valid <= 0) return;
  void* scratch = workspace(cuda::vocab_embedding_backward_scratch_bytes(n, C, valid));
  cuda::vocab_embedding_backward(dptr<int32_t>(tokens), dptr<float>(dout), dptr<float>(dweight), n, C, begin, valid,
                                 scratch, stream());
}

void CudaBackend::add_positions(const Tensor& out, const Tensor& positions, int64_t first) {
  const checks::Dims3 d = checks::check_position_rows("add_positions", out, positions, first);
  cuda::add_positions(dptr<float>(out), dptr<float>(positions) + first * d.c, d.a, d.b, d.c, stream());
}

void CudaBackend::positions_backward(const Tensor& dout, const Tensor& dpositions, int64_t first) {
  const checks::Dims3 d = checks::check_position_rows("positions_backward", dout, dpositions, first);
  cuda::positions_backward(dptr<float>(dout), dptr<float>(dpositions) + first * d.c, d.a, d.b, d.c, stream());
}

void CudaBackend::vocab_ce_partials(const Tensor& logits, const Tensor& targets, int64_t begin, int64_t valid,
                                    const Tensor& max, const Tensor& target) {
  const int64_t n = checks::check_vocab_ce_partials(logits, targets, valid, max, target);
  cuda::vocab_ce_partials(dptr<float>(logits), dptr<int32_t>(targets), dptr<float>(max), dptr<float>(target), n,
                          logits.dim(-1), begin, valid, stream());
}

void CudaBackend::vocab_ce_sums(const Tensor& logits, const Tensor& max, int64_t valid, const Tensor& sums) {
  const int64_t n = checks::check_vocab_ce_sums(logits, max, valid, sums);
  cuda::vocab_ce_sums(dptr<float>(logits), dptr<float>(max), dptr<float>(sums), n, logits.dim(-1), valid, stream());
}

void CudaBackend::vocab_ce_finish(const Tensor& targets, const Tensor& lse, const Tensor& sums, const Tensor& losses) {
  const int64_t n = checks::check_vocab_ce_finish(targets, lse, sums, losses);
  cuda::vocab_ce_finish(dptr<int32_t>(targets), dptr<float>(lse), dptr<float>(sums), dptr<float>(losses), n, stream());
}

void CudaBackend::vocab_ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t begin,
                                    int64_t valid, float scale, const Tensor& dlogits) {
  const int64_t n = checks::check_vocab_ce_backward(logits, targets, lse, valid, dlogits);
  cuda::vocab_ce_backward(dptr<float>(logits), dptr<int32_t>(targets), dptr<float>(lse), dptr<float>(dlogits), n,
                          logits.dim(-1), begin, valid, scale, stream());
}

// ---- Ring attention

void CudaBackend::ring_attention_merge(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                       const Tensor& m, const Tensor& l, const Tensor& scratch,
                                       const RingBlock& block) {
  const char* op = "ring_attention_merge";
  const cuda::RingShape s = ring_shape(op, checks::check_ring_attention_merge(q, k, v, out, m, l, block), block.rank,
                                       block.world, block.owner, true);
  (void)scratch;  // the CPU's per-thread score rows; the kernel recomputes the scores instead
  dispatch_float(q.dtype(), op, kBackend, [&]<typename T>() {
    cuda::ring_attention_merge<T>(dptr<T>(q), dptr<T>(k), dptr<T>(v), dptr<T>(out), dptr<T>(m), dptr<T>(l), s,
                                  stream());
  });
}

void CudaBackend::ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head) {
  const char* op = "ring_attention_finish";
  const cuda::RingShape s = ring_shape(op, checks::check_ring_attention_finish(out, lse, l, n_head), 0, 1, 0, false);
  dispatch_float(out.dtype(), op, kBackend, [&]<typename T>() {
    cuda::ring_attention_finish<T>(dptr<T>(out), dptr<T>(lse), dptr<T>(l), s.B, s.Tl, s.H, s.hd, stream());
  });
}

void CudaBackend::attention_row_dot(const Tensor& dout, const Tensor& out, const Tensor& D, int64_t n_head) {
  const char* op = "attention_row_dot";
  const cuda::RingShape s = ring_shape(op, checks::check_attention_row_dot(dout, out, D, n_head), 0, 1, 0, false);
  dispatch_float(out.dtype(), op, kBackend, [&]<typename T>() {
    cuda::attention_row_dot<T>(dptr<T>(dout), dptr<T>(out), dptr<T>(D), s.B, s.Tl, s.H, s.hd, stream());
  });
}

void CudaBackend::ring_attention_block_backward(const Tensor& q, const Tensor& dout, const Tensor& lse,
                                                const Tensor& D, const Tensor& k, const Tensor& v, const Tensor& dq,
                                                const Tensor& dk, const Tensor& dv, const RingBlock& block) {
  const char* op = "ring_attention_block_backward";
  const cuda::RingShape s =
      ring_shape(op, checks::check_ring_attention_block_backward(q, dout, lse, D, k, v, dq, dk, dv, block),
                 block.rank, block.world, block.owner, true);
  dispatch_float(q.dtype(), op, kBackend, [&]<typename T>() {
    cuda::ring_attention_block_backward<T>(dptr<T>(q), dptr<T>(dout), dptr<T>(lse), dptr<T>(D), dptr<T>(k),
                                           dptr<T>(v), dptr<T>(dq), dptr<T>(dk), dptr<T>(dv), s, stream());
  });
}

// ---- Model-parallel slicing

void CudaBackend::copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& b) {
  checks::check_copy_block(src, dst, b);
  if (b.rows == 0 || b.cols == 0) return;
  const int64_t elem = static_cast<int64_t>(dtype_size(src.dtype()));
  const char* s = static_cast<const char*>(src.device_ptr()) + (b.src_row * b.src_stride + b.src_col) * elem;
  char* d = static_cast<char*>(dst.device_ptr()) + (b.dst_row * b.dst_stride + b.dst_col) * elem;
  cuda::copy_block(s, d, b.rows, b.cols * elem, b.src_stride * elem, b.dst_stride * elem, stream());
}

// ---- Per-head RMSNorm (q/k norm)

void CudaBackend::head_rmsnorm_forward(const Tensor& x, const Tensor& weight, int64_t first, int64_t n, int64_t hd,
                                       float eps, const Tensor& in, const Tensor& rstd) {
  const char* op = "head_rmsnorm_forward";
  const int64_t rows = checks::check_head_rmsnorm_forward(x, weight, first, n, hd, in, rstd);
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cuda::head_rmsnorm_forward<T>(dptr<T>(x), dptr<T>(weight), dptr<T>(in), dptr<T>(rstd), rows, x.dim(-1),
                                  first, n, hd, eps, stream());
  });
}

void CudaBackend::head_rmsnorm_backward(const Tensor& dx, const Tensor& in, const Tensor& weight, const Tensor& rstd,
                                        int64_t first, int64_t n, int64_t hd, const Tensor& dweight) {
  const char* op = "head_rmsnorm_backward";
  const int64_t rows = checks::check_head_rmsnorm_backward(dx, in, weight, rstd, first, n, hd, dweight);
  dispatch_float(dx.dtype(), op, kBackend, [&]<typename T>() {
    void* scratch = workspace(cuda::head_rmsnorm_backward_scratch_bytes(rows, n, hd, sizeof(T)));
    cuda::head_rmsnorm_backward<T>(dptr<T>(dx), dptr<T>(in), dptr<T>(weight), dptr<T>(rstd), dptr<T>(dweight), rows,
                                   dx.dim(-1), first, n, hd, scratch, stream());
  });
}

}  // namespace loom::cuda_backend_detail
