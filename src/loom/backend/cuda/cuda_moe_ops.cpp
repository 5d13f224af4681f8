// The CUDA backend's mixture-of-experts ops (backend.h: moe_route ... moe_router_backward): each
// validates its operands as the CPU does (cpu/cpu_moe_ops.cpp, same one-line errors), then runs
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
#include <algorithm>
#include <climits>

#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_moe.h"

namespace loom::cuda_backend_detail {

namespace {

using checks::expect_dtype;
using checks::expect_numel;
using checks::rows_of;

void expect_f32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_F32, op, what); }
void expect_i32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_I32, op, what); }

// (N, E) router logits and the routing's per-token operands: returns N (the CPU's check_router).
int64_t check_router(const char* op, const Tensor& logits, const Tensor& scores, const Tensor& expert,
                     const MoeRouting& r) {
  LOOM_CHECK(r.experts >= 1 && r.top_k >= 1 && r.top_k <= std::min<int64_t>(r.experts, 64) && r.groups >= 1 &&
                 r.experts % r.groups == 0 && r.topk_groups >= 1 && r.topk_groups <= r.groups && r.seq_len >= 1,
             op, ": bad routing (", r.experts, " experts in ", r.groups, " groups, top ", r.top_k, " of the best ",
             r.topk_groups, " groups, sequences of ", r.seq_len, ")");
  expect_f32(logits, op, "logits");
  LOOM_CHECK(logits.dim(-1) == r.experts, op, ": logits ", logits.describe(), " for ", r.experts, " experts");
  const int64_t N = rows_of(logits);
  expect_f32(scores, op, "scores");
  expect_numel(scores, N * r.experts, op, "scores");
  expect_i32(expert, op, "expert");
  expect_numel(expert, N * r.top_k, op, "expert");
  LOOM_CHECK(N <= INT_MAX / r.top_k && r.experts < INT_MAX, op, ": ", N, " tokens of ", r.top_k, " choices over ",
             r.experts, " experts exceed the kernels' 32-bit indices");
  return N;
}

void check_counts(const char* op, const Tensor& counts, int64_t E) {
  expect_i32(counts, op, "counts");
  expect_numel(counts, 3 * E + 1, op, "counts");
}

// row (N, k) i32 and, when defined, gates shaped as row (f32); rows and out f32 of one width C.
void check_combine(const char* op, const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out) {
  expect_f32(rows, op, "rows");
  expect_f32(out, op, "out");
  expect_i32(row, op, "row");
  LOOM_CHECK(rows.dim(-1) == out.dim(-1) && rows_of(out) == rows_of(row), op, ": rows ", rows.describe(), ", row ",
             row.describe(), " and out ", out.describe(), " do not match (R, C), (N, k), (N, C)");
  if (gates.defined()) {
    expect_f32(gates, op, "gates");
    expect_numel(gates, row.numel(), op, "gates");
  }
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
  const char* op = "moe_route";
  const int64_t N = check_router(op, logits, scores, expert, routing);
  const int64_t E = routing.experts, K = routing.top_k;
  expect_f32(bias, op, "bias");
  expect_numel(bias, E, op, "bias");
  expect_f32(gates, op, "gates");
  expect_numel(gates, N * K, op, "gates");
  expect_f32(scratch, op, "scratch");  // sized for the CPU's threads; unused here
  const cuda::MoeRoute r = route_of(routing);
  const size_t bytes = cuda::moe_route_scratch_bytes(N, r);
  cuda::moe_route(dptr<float>(logits), dptr<float>(bias), dptr<float>(scores), dptr<int32_t>(expert),
                  dptr<float>(gates), bytes > 0 ? workspace(bytes) : nullptr, N, r, stream());
}

void CudaBackend::moe_assign(const Tensor& expert, int64_t capacity, const Tensor& row, const Tensor& token,
                             const Tensor& counts) {
  const char* op = "moe_assign";
  expect_i32(expert, op, "expert");
  expect_i32(row, op, "row");
  expect_i32(token, op, "token");
  expect_i32(counts, op, "counts");
  LOOM_CHECK(counts.numel() >= 4 && (counts.numel() - 1) % 3 == 0 && row.shape() == expert.shape() &&
                 expert.ndim() == 2 && capacity >= 0,
             op, ": expert ", expert.describe(), ", row ", row.describe(), ", counts ", counts.describe(),
             ", capacity ", capacity, ": expected (N, k), (N, k), (3E + 1), capacity >= 0");
  const int64_t E = (counts.numel() - 1) / 3, N = expert.dim(0), K = expert.dim(1);
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
  expect_f32(x, op, "x");
  expect_f32(rows, op, "rows");
  expect_i32(token, op, "token");
  const int64_t R = rows_of(rows), C = rows.dim(-1), N = rows_of(x);
  LOOM_CHECK(x.dim(-1) == C, op, ": x ", x.describe(), " and rows ", rows.describe(), " differ in width");
  expect_numel(token, R, op, "token");
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
  check_combine("moe_combine", rows, row, gates, out);
  const int64_t N = rows_of(out), C = out.dim(-1), K = row.dim(-1);
  cuda::moe_combine(dptr<float>(rows), dptr<int32_t>(row), gates.defined() ? dptr<float>(gates) : nullptr,
                    dptr<float>(out), N, K, rows_of(rows), C, stream());
}

void CudaBackend::moe_combine_backward(const Tensor& dout, const Tensor& row, const Tensor& gates,
                                       const Tensor& drows) {
  const char* op = "moe_combine_backward";
  LOOM_CHECK(gates.defined(), op, ": needs the gates");
  check_combine(op, drows, row, gates, dout);
  const int64_t N = rows_of(dout), C = dout.dim(-1), K = row.dim(-1);
  cuda::moe_combine_backward(dptr<float>(dout), dptr<int32_t>(row), dptr<float>(gates), dptr<float>(drows), N, K,
                             rows_of(drows), C, stream());
}

void CudaBackend::moe_balance_stats(const Tensor& logits, const Tensor& scores, const Tensor& expert,
                                    const Tensor& counts, const Tensor& stats, const Tensor& scratch,
                                    const MoeRouting& routing) {
  const char* op = "moe_balance_stats";
  const int64_t N = check_router(op, logits, scores, expert, routing);
  const int64_t E = routing.experts, T = routing.seq_len;
  LOOM_CHECK(N % T == 0, op, ": ", N, " tokens are not sequences of ", T);
  check_counts(op, counts, E);
  expect_dtype(stats, DTYPE_F64, op, "stats");
  expect_numel(stats, 4, op, "stats");
  expect_dtype(scratch, DTYPE_F64, op, "scratch");  // the CPU's; unused here
  const cuda::MoeRoute r = route_of(routing);
  cuda::moe_balance_stats(dptr<float>(logits), dptr<float>(scores), dptr<int32_t>(expert), dptr<int32_t>(counts),
                          dptr<double>(stats), workspace(cuda::moe_balance_stats_scratch_bytes(N, r)), N, r, stream());
}

void CudaBackend::moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& expert,
                                      const Tensor& row, const Tensor& ye, const Tensor& dy, const Tensor& counts,
                                      const Tensor& dlogits, const Tensor& scratch, const MoeRouting& routing) {
  const char* op = "moe_router_backward";
  const int64_t N = check_router(op, logits, scores, expert, routing);
  const int64_t E = routing.experts, K = routing.top_k, T = routing.seq_len, C = dy.dim(-1);
  LOOM_CHECK(N % T == 0, op, ": ", N, " tokens are not sequences of ", T);
  check_counts(op, counts, E);
  expect_i32(row, op, "row");
  expect_numel(row, N * K, op, "row");
  expect_f32(ye, op, "ye");
  expect_f32(dy, op, "dy");
  expect_numel(dy, N * C, op, "dy");
  LOOM_CHECK(ye.dim(-1) == C, op, ": ye ", ye.describe(), " and dy ", dy.describe(), " differ in width");
  expect_f32(dlogits, op, "dlogits");
  expect_numel(dlogits, N * E, op, "dlogits");
  expect_dtype(scratch, DTYPE_F64, op, "scratch");  // the CPU's; unused here
  const cuda::MoeRoute r = route_of(routing);
  cuda::moe_router_backward(dptr<float>(logits), dptr<float>(scores), dptr<int32_t>(expert), dptr<int32_t>(row),
                            dptr<float>(ye), dptr<float>(dy), dptr<int32_t>(counts), dptr<float>(dlogits),
                            workspace(cuda::moe_router_backward_scratch_bytes(N, r)), N, C, r, stream());
}

}  // namespace loom::cuda_backend_detail
