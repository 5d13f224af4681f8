// The CUDA backend's model-parallel ops and per-head q/k RMSNorm: operand checks (the CPU
// backend's, with the same one-line errors naming the op and the operand), then the launchers of
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
#include <algorithm>
#include <initializer_list>
#include <utility>

#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_parallel.h"

namespace loom::cuda_backend_detail {

bool parallel_ops_complete() { return true; }
bool head_norm_ops_complete() { return true; }

using checks::dispatch_float;
using checks::expect_dtype;
using checks::expect_numel;
using checks::rows_of;

namespace {

void expect_f32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_F32, op, what); }

using NamedRows = std::initializer_list<std::pair<const char*, const Tensor*>>;

void expect_rows(const char* op, int64_t n, NamedRows rows) {
  for (const auto& [what, t] : rows) {
    expect_f32(*t, op, what);
    expect_numel(*t, n, op, what);
  }
}

// logits (N, Vs) f32 with valid <= Vs, targets (N) i32 when given, the f32 rows (N): returns N.
int64_t check_ce_rows(const char* op, const Tensor& logits, const Tensor* targets, int64_t valid, NamedRows rows) {
  expect_f32(logits, op, "logits");
  const int64_t n = rows_of(logits), V = logits.dim(-1);
  LOOM_CHECK(valid <= V, op, ": valid ", valid, " exceeds the ", V, " columns of ", logits.describe());
  if (targets != nullptr) {
    expect_dtype(*targets, DTYPE_I32, op, "targets");
    expect_numel(*targets, n, op, "targets");
  }
  expect_rows(op, n, rows);
  return n;
}

void expect_activations(const Tensor& t, const char* op, const char* what) {
  expect_f32(t, op, what);
  LOOM_CHECK(t.ndim() == 3, op, ": ", what, " is ", t.describe(), ", expected (B, T, C)");
}

void check_position_rows(const char* op, const Tensor& act, const Tensor& positions, int64_t first) {
  expect_activations(act, op, "activations");
  expect_f32(positions, op, "positions");
  LOOM_CHECK(positions.ndim() == 2 && positions.dim(1) == act.dim(2) && first >= 0 &&
                 first + act.dim(1) <= positions.dim(0),
             op, ": positions ", positions.describe(), " has no rows ", first, " .. ", first + act.dim(1) - 1,
             " of width ", act.dim(2));
}

// q (B, Tl, H hd) of a ring op, with the rank / world / owner of `block`: the launchers' shape.
// in_registers: the op's kernels hold a row per warp in registers (head_dim <= kRingMaxHeadDim).
cuda::RingShape ring_shape(const char* op, const Tensor& q, int64_t n_head, int64_t n_kv_head, int rank, int world,
                           int owner, bool in_registers) {
  LOOM_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0, op, ": n_head ", n_head,
             " must be a positive multiple of n_kv_head ", n_kv_head);
  LOOM_CHECK(q.ndim() == 3 && q.dim(2) % n_head == 0 && q.dim(1) % 2 == 0, op, ": q is ", q.describe(),
             ", expected (B, Tl, n_head * head_dim) with n_head ", n_head, " and an even Tl");
  LOOM_CHECK(world >= 1 && rank >= 0 && rank < world, op, ": rank ", rank, " outside [0, ", world, ")");
  const int64_t hd = q.dim(2) / n_head;
  LOOM_CHECK(!in_registers || hd <= cuda::kRingMaxHeadDim, op, ": head_dim ", hd, " exceeds the CUDA kernels' ",
             cuda::kRingMaxHeadDim);
  cuda::RingShape s;
  s.B = q.dim(0);
  s.Tl = q.dim(1);
  s.H = n_head;
  s.KV = n_kv_head;
  s.hd = hd;
  s.rank = rank;
  s.world = world;
  s.owner = owner;
  return s;
}

void expect_like(const char* op, const char* what, const Tensor& t, const Tensor& like, const Shape& shape) {
  LOOM_CHECK(t.shape() == shape && t.dtype() == like.dtype(), op, ": ", what, " is ", t.describe(), ", expected ",
             dtype_name(like.dtype()), shape_str(shape));
}

cuda::RingShape check_block(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const RingBlock& block) {
  const cuda::RingShape s =
      ring_shape(op, q, block.n_head, block.n_kv_head, block.rank, block.world, block.owner, true);
  LOOM_CHECK(block.owner >= 0 && block.owner < block.world, op, ": owner ", block.owner, " outside [0, ", block.world,
             ")");
  expect_like(op, "k", k, q, {s.B, s.Tl, s.KV * s.hd});
  expect_like(op, "v", v, q, {s.B, s.Tl, s.KV * s.hd});
  return s;
}

// The block's extent on one side fits in t: the last row ends within its numel.
void check_block_side(const char* what, const Tensor& t, int64_t row, int64_t col, int64_t stride, const BlockCopy& b) {
  LOOM_CHECK(t.defined(), "copy_block: ", what, " is undefined");
  LOOM_CHECK(row >= 0 && col >= 0 && col + b.cols <= stride &&
                 (b.rows == 0 || (row + b.rows - 1) * stride + col + b.cols <= t.numel()),
             "copy_block: ", b.rows, " x ", b.cols, " block at (", row, ", ", col, ") with row stride ", stride,
             " is outside ", what, " ", t.describe());
}

}  // namespace

// ---- The vocabulary-parallel ends

void CudaBackend::vocab_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t begin, int64_t valid,
                                          const Tensor& out) {
  const char* op = "vocab_embedding_forward";
  expect_dtype(tokens, DTYPE_I32, op, "tokens");
  expect_f32(weight, op, "weight");
  expect_f32(out, op, "out");
  const int64_t n = tokens.numel(), C = weight.dim(1);
  LOOM_CHECK(weight.ndim() == 2 && out.numel() == n * C && valid <= weight.dim(0), "vocab-parallel embedding: out ",
             out.describe(), " and table ", weight.describe(), " do not fit ", n, " tokens");
  cuda::vocab_embedding_forward(dptr<int32_t>(tokens), dptr<float>(weight), dptr<float>(out), n, C, begin, valid,
                                stream());
}

void CudaBackend::vocab_embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dweight,
                                           int64_t begin, int64_t valid) {
  const char* op = "vocab_embedding_backward";
  expect_dtype(tokens, DTYPE_I32, op, "tokens");
  expect_f32(dout, op, "dout");
  expect_f32(dweight, op, "dweight");
  const int64_t n = tokens.numel(), C = dweight.dim(1);
  LOOM_CHECK(dweight.ndim() == 2 && dout.numel() == n * C && valid <= dweight.dim(0), op, ": dout ",
             dout.describe(), " and dweight ", dweight.describe(), " do not fit ", n, " tokens");
  if (n == 0 || valid <= 0) return;
  void* scratch = workspace(cuda::vocab_embedding_backward_scratch_bytes(n, C, valid));
  cuda::vocab_embedding_backward(dptr<int32_t>(tokens), dptr<float>(dout), dptr<float>(dweight), n, C, begin, valid,
                                 scratch, stream());
}

void CudaBackend::add_positions(const Tensor& out, const Tensor& positions, int64_t first) {
  check_position_rows("add_positions", out, positions, first);
  const int64_t B = out.dim(0), T = out.dim(1), C = out.dim(2);
  cuda::add_positions(dptr<float>(out), dptr<float>(positions) + first * C, B, T, C, stream());
}

void CudaBackend::positions_backward(const Tensor& dout, const Tensor& dpositions, int64_t first) {
  check_position_rows("positions_backward", dout, dpositions, first);
  const int64_t B = dout.dim(0), T = dout.dim(1), C = dout.dim(2);
  cuda::positions_backward(dptr<float>(dout), dptr<float>(dpositions) + first * C, B, T, C, stream());
}

void CudaBackend::vocab_ce_partials(const Tensor& logits, const Tensor& targets, int64_t begin, int64_t valid,
                                    const Tensor& max, const Tensor& target) {
  const int64_t n = check_ce_rows("vocab_ce_partials", logits, &targets, valid, {{"max", &max}, {"target", &target}});
  cuda::vocab_ce_partials(dptr<float>(logits), dptr<int32_t>(targets), dptr<float>(max), dptr<float>(target), n,
                          logits.dim(-1), begin, valid, stream());
}

void CudaBackend::vocab_ce_sums(const Tensor& logits, const Tensor& max, int64_t valid, const Tensor& sums) {
  const int64_t n = check_ce_rows("vocab_ce_sums", logits, nullptr, valid, {{"max", &max}, {"sums", &sums}});
  cuda::vocab_ce_sums(dptr<float>(logits), dptr<float>(max), dptr<float>(sums), n, logits.dim(-1), valid, stream());
}

void CudaBackend::vocab_ce_finish(const Tensor& targets, const Tensor& lse, const Tensor& sums, const Tensor& losses) {
  const int64_t n = lse.numel();
  expect_rows("vocab_ce_finish", n, {{"lse", &lse}, {"sums", &sums}, {"losses", &losses}});
  expect_dtype(targets, DTYPE_I32, "vocab_ce_finish", "targets");
  expect_numel(targets, n, "vocab_ce_finish", "targets");
  cuda::vocab_ce_finish(dptr<int32_t>(targets), dptr<float>(lse), dptr<float>(sums), dptr<float>(losses), n, stream());
}

void CudaBackend::vocab_ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t begin,
                                    int64_t valid, float scale, const Tensor& dlogits) {
  const char* op = "vocab_ce_backward";
  const int64_t n = check_ce_rows(op, logits, &targets, valid, {{"lse", &lse}});
  expect_f32(dlogits, op, "dlogits");
  expect_numel(dlogits, logits.numel(), op, "dlogits");
  cuda::vocab_ce_backward(dptr<float>(logits), dptr<int32_t>(targets), dptr<float>(lse), dptr<float>(dlogits), n,
                          logits.dim(-1), begin, valid, scale, stream());
}

// ---- Ring attention

void CudaBackend::ring_attention_merge(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                       const Tensor& m, const Tensor& l, const Tensor& scratch,
                                       const RingBlock& block) {
  const char* op = "ring_attention_merge";
  const cuda::RingShape s = check_block(op, q, k, v, block);
  expect_like(op, "out", out, q, q.shape());
  expect_like(op, "m", m, q, {s.B, s.H, s.Tl});
  expect_like(op, "l", l, q, {s.B, s.H, s.Tl});
  (void)scratch;  // the CPU's per-thread score rows; the kernel recomputes the scores instead
  dispatch_float(q.dtype(), op, kBackend, [&]<typename T>() {
    cuda::ring_attention_merge<T>(dptr<T>(q), dptr<T>(k), dptr<T>(v), dptr<T>(out), dptr<T>(m), dptr<T>(l), s,
                                  stream());
  });
}

void CudaBackend::ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head) {
  const char* op = "ring_attention_finish";
  const cuda::RingShape s = ring_shape(op, out, n_head, 1, 0, 1, 0, false);
  expect_like(op, "lse", lse, out, {s.B, s.H, s.Tl});
  expect_like(op, "l", l, out, {s.B, s.H, s.Tl});
  dispatch_float(out.dtype(), op, kBackend, [&]<typename T>() {
    cuda::ring_attention_finish<T>(dptr<T>(out), dptr<T>(lse), dptr<T>(l), s.B, s.Tl, s.H, s.hd, stream());
  });
}

void CudaBackend::attention_row_dot(const Tensor& dout, const Tensor& out, const Tensor& D, int64_t n_head) {
  const char* op = "attention_row_dot";
  const cuda::RingShape s = ring_shape(op, out, n_head, 1, 0, 1, 0, false);
  expect_like(op, "dout", dout, out, out.shape());
  expect_like(op, "D", D, out, {s.B, s.H, s.Tl});
  dispatch_float(out.dtype(), op, kBackend, [&]<typename T>() {
    cuda::attention_row_dot<T>(dptr<T>(dout), dptr<T>(out), dptr<T>(D), s.B, s.Tl, s.H, s.hd, stream());
  });
}

void CudaBackend::ring_attention_block_backward(const Tensor& q, const Tensor& dout, const Tensor& lse,
                                                const Tensor& D, const Tensor& k, const Tensor& v, const Tensor& dq,
                                                const Tensor& dk, const Tensor& dv, const RingBlock& block) {
  const char* op = "ring_attention_block_backward";
  const cuda::RingShape s = check_block(op, q, k, v, block);
  expect_like(op, "dout", dout, q, q.shape());
  expect_like(op, "dq", dq, q, q.shape());
  expect_like(op, "lse", lse, q, {s.B, s.H, s.Tl});
  expect_like(op, "D", D, q, {s.B, s.H, s.Tl});
  expect_like(op, "dk", dk, q, k.shape());
  expect_like(op, "dv", dv, q, k.shape());
  dispatch_float(q.dtype(), op, kBackend, [&]<typename T>() {
    cuda::ring_attention_block_backward<T>(dptr<T>(q), dptr<T>(dout), dptr<T>(lse), dptr<T>(D), dptr<T>(k),
                                           dptr<T>(v), dptr<T>(dq), dptr<T>(dk), dptr<T>(dv), s, stream());
  });
}

// ---- Model-parallel slicing

void CudaBackend::copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& b) {
  LOOM_CHECK(src.defined() && dst.defined() && src.dtype() == dst.dtype(), "copy_block: src ",
             src.defined() ? src.describe() : "undefined", " and dst ", dst.defined() ? dst.describe() : "undefined",
             " must share a dtype");
  LOOM_CHECK(b.rows >= 0 && b.cols >= 0, "copy_block: negative block ", b.rows, " x ", b.cols);
  check_block_side("src", src, b.src_row, b.src_col, b.src_stride, b);
  check_block_side("dst", dst, b.dst_row, b.dst_col, b.dst_stride, b);
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
  checks::check_head_rows(op, x, weight, first, n, hd, in, rstd);
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cuda::head_rmsnorm_forward<T>(dptr<T>(x), dptr<T>(weight), dptr<T>(in), dptr<T>(rstd), rows_of(x), x.dim(-1),
                                  first, n, hd, eps, stream());
  });
}

void CudaBackend::head_rmsnorm_backward(const Tensor& dx, const Tensor& in, const Tensor& weight, const Tensor& rstd,
                                        int64_t first, int64_t n, int64_t hd, const Tensor& dweight) {
  const char* op = "head_rmsnorm_backward";
  checks::check_head_rows(op, dx, weight, first, n, hd, in, rstd);
  LOOM_CHECK(dweight.shape() == weight.shape() && dweight.dtype() == weight.dtype(), op, ": dweight ",
             dweight.describe(), " must match weight ", weight.describe());
  dispatch_float(dx.dtype(), op, kBackend, [&]<typename T>() {
    void* scratch = workspace(cuda::head_rmsnorm_backward_scratch_bytes(rows_of(dx), n, hd, sizeof(T)));
    cuda::head_rmsnorm_backward<T>(dptr<T>(dx), dptr<T>(in), dptr<T>(weight), dptr<T>(rstd), dptr<T>(dweight),
                                   rows_of(dx), dx.dim(-1), first, n, hd, scratch, stream());
  });
}

}  // namespace loom::cuda_backend_detail
