// Ring attention and Ulysses over a zig-zag sequence shard; see context_parallel.h for the
// layout, the formulas and the byte counts.
#include "loom/nn/context_parallel.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "loom/core/error.h"

namespace loom {

namespace {

constexpr int kRingTag = 7301;  // ring attention's point-to-point messages

void expect_float(const char* op, DType dtype) {
  LOOM_CHECK(dtype == DTYPE_F32 || dtype == DTYPE_F64, op, ": not supported for dtype ", dtype_name(dtype),
             " (f32, f64)");
}

void expect_shape(const char* op, const char* what, const Tensor& t, const Shape& shape, DType dtype) {
  LOOM_CHECK(t.defined(), op, ": ", what, " is undefined");
  LOOM_CHECK(t.shape() == shape && t.dtype() == dtype, op, ": ", what, " is ", t.describe(), ", expected ",
             dtype_name(dtype), shape_str(shape));
}

// The dimensions of one attention call on a local shard.
struct AttnDims {
  int64_t B = 0, Tl = 0, H = 0, KV = 0, hd = 0;
  int N = 1, r = 0;
  int64_t C() const { return Tl / 2; }   // chunk length
  int64_t seq() const { return Tl * N; } // global sequence T
  int64_t QW() const { return H * hd; }  // q / out row width
  int64_t KW() const { return KV * hd; } // k / v row width
  int64_t pos(int64_t t) const { return cp_global_position(t, C(), r, N); }  // local query t's global position
};

// Validates q (B, Tl, H hd), k, v (B, Tl, KV hd) and the zig-zag sequence length.
AttnDims attn_dims(const char* op, const Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                   int64_t n_head, int64_t n_kv_head) {
  LOOM_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0, op, ": n_head ", n_head,
             " must be a positive multiple of n_kv_head ", n_kv_head);
  LOOM_CHECK(q.defined() && q.ndim() == 3 && q.dim(2) % n_head == 0, op, ": q is ",
             q.defined() ? q.describe() : "undefined", ", expected (B, Tl, n_head * head_dim) with n_head ", n_head);
  AttnDims d;
  d.B = q.dim(0);
  d.Tl = q.dim(1);
  d.H = n_head;
  d.KV = n_kv_head;
  d.hd = q.dim(2) / n_head;
  d.N = cp.size();
  d.r = cp.rank();
  check_cp_seq_len(d.Tl * d.N, d.N);
  expect_shape(op, "k", k, {d.B, d.Tl, d.KW()}, q.dtype());
  expect_shape(op, "v", v, {d.B, d.Tl, d.KW()}, q.dtype());
  return d;
}

// Exchanges with the ring neighbours: send `out` to r+1, receive `in` from r-1. Even ranks send
// first and odd ranks receive first, so with blocking send/recv every send meets a posted
// receive without a cycle of waits (for odd N, rank N-1 and rank 0 are both even: rank 0's send
// to 1 completes first, then it receives from N-1).
void ring_shift(Communicator& cp, const Tensor& out, const Tensor& in) {
  const int n = cp.size(), r = cp.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
  if (r % 2 == 0) {
    cp.send(out, next, kRingTag);
    cp.recv(in, prev, kRingTag);
  } else {
    cp.recv(in, prev, kRingTag);
    cp.send(out, next, kRingTag);
  }
}

Tensor comm_buffer(Allocator& allocator, int64_t numel, DType dtype) {
  return Tensor::empty(allocator, {numel}, dtype, MEM_COMMUNICATION);
}

// Calls move(full_rows, local_rows) for each of rank's 2B zig-zag chunks: the C = Tl/2 rows
// (C, W) of full (B, T, W) and of local (B, Tl, W) that hold one chunk of one sequence.
template <typename Fn>
void for_each_local_chunk(const Tensor& full, const Tensor& local, int rank, int world, Fn&& move) {
  const int64_t B = local.dim(0), Tl = local.dim(1), T = full.dim(1), W = local.dim(2), C = Tl / 2;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t c = 0; c < 2; ++c) {
      move(full.view((b * T + cp_global_position(c * C, C, rank, world)) * W, {C, W}),
           local.view((b * Tl + c * C) * W, {C, W}));
    }
  }
}

// `given` when it is one for these dims (allocate_cp_workspace's), else a new one in `local`.
const CpWorkspace& workspace_for(Backend& backend, const AttnDims& d, DType dtype, bool ulysses, CpWorkspace* given,
                                 CpWorkspace& local) {
  const CpWorkspace::Dims want{d.B, d.Tl, d.H, d.KV, d.hd, d.N, omp_get_max_threads(), ulysses, dtype};
  if (given != nullptr && given->dims == want) return *given;
  local = allocate_cp_workspace(backend.allocator(), d.B, d.Tl, d.H, d.KV, d.hd, d.N, ulysses, dtype);
  return local;
}

// Ulysses' head groups: rank r' owns query heads [r' hl, (r'+1) hl) and kv heads [r' kvl, (r'+1) kvl).
struct UlyssesDims {
  AttnDims a;
  int64_t hl = 0, kvl = 0;
  int64_t Wg() const { return (hl + 2 * kvl) * a.hd; }  // a rank's fused qkv row
};

UlyssesDims ulysses_dims(const char* op, const AttnDims& a) {
  LOOM_CHECK(a.H % a.N == 0 && a.KV % a.N == 0, op, ": Ulysses needs n_head (", a.H, ") and n_kv_head (", a.KV,
             ") divisible by parallel.cp (", a.N, ")");
  return {a, a.H / a.N, a.KV / a.N};
}

// Moves head-sharded full-sequence rows (B, T, w) into the per-source-rank chunks of `chunks`
// (N, B, Tl, w): chunk r, row (b, t) <- row (b, pos_r[t]), as 2 N B Backend::copy calls of
// C rows each. With scatter = false the direction is reversed (chunks -> full).
void reorder_sequence(Backend& backend, const UlyssesDims& u, const Tensor& full, const Tensor& chunks,
                      bool scatter) {
  const AttnDims& a = u.a;
  const int64_t w = full.dim(2);
  for (int r = 0; r < a.N; ++r) {
    const Tensor chunk = chunks.view(static_cast<int64_t>(r) * a.B * a.Tl * w, {a.B, a.Tl, w});
    for_each_local_chunk(full, chunk, r, a.N, [&](const Tensor& f, const Tensor& c) {
      if (scatter) backend.copy(f, c);
      else backend.copy(c, f);
    });
  }
}

// Between this rank's (B, Tl, heads * hd) tensor x and the per-destination chunks (N, B, Tl, w)
// at column offset `off` (elements): chunk r' holds x's head group r' (`group` wide), a
// B Tl x group block of each (Backend::copy_block). pack = true: x -> chunks; false: chunks -> x.
void move_head_groups(Backend& backend, const UlyssesDims& u, const Tensor& x, const Tensor& chunks, int64_t w,
                      int64_t off, int64_t group, bool pack) {
  const AttnDims& a = u.a;
  const int64_t rows = a.B * a.Tl, xw = a.N * group;
  for (int64_t r = 0; r < a.N; ++r) {
    if (pack) backend.copy_block(x, chunks, BlockCopy{rows, group, 0, r * group, xw, r * rows, off, w});
    else backend.copy_block(chunks, x, BlockCopy{rows, group, r * rows, off, w, 0, r * group, xw});
  }
}

void ensure_saved(Backend& backend, Tensor& t, const Shape& shape, DType dtype) {
  if (!t.defined() || t.shape() != shape || t.dtype() != dtype) {
    t = Tensor::empty(backend.allocator(), shape, dtype, MEM_ACTIVATIONS);
  }
}

}  // namespace

// ---- Layout ------------------------------------------------------------------------------------

void check_cp_seq_len(int64_t seq_len, int cp) {
  LOOM_CHECK(cp >= 1 && seq_len > 0 && seq_len % (2 * static_cast<int64_t>(cp)) == 0, "parallel.cp = ", cp,
             " needs train.seq_len divisible by 2 x parallel.cp = ", 2 * static_cast<int64_t>(cp),
             " (zig-zag chunks), got train.seq_len = ", seq_len);
}

std::vector<int64_t> cp_local_positions(int64_t seq_len, int rank, int world) {
  check_cp_seq_len(seq_len, world);
  LOOM_CHECK(rank >= 0 && rank < world, "context parallel: rank ", rank, " outside [0, ", world, ")");
  const int64_t C = seq_len / (2 * world);
  std::vector<int64_t> pos(static_cast<size_t>(2 * C));
  for (int64_t t = 0; t < 2 * C; ++t) pos[static_cast<size_t>(t)] = cp_global_position(t, C, rank, world);
  return pos;
}

CpWorkspace allocate_cp_workspace(Allocator& allocator, int64_t batch, int64_t local_seq, int64_t n_head,
                                  int64_t n_kv_head, int64_t head_dim, int world, bool ulysses, DType dtype) {
  CpWorkspace w;
  w.dims = {batch, local_seq, n_head, n_kv_head, head_dim, world, omp_get_max_threads(), ulysses, dtype};
  const int64_t rows = batch * local_seq;
  auto work = [&](Shape shape) { return Tensor::empty(allocator, std::move(shape), dtype, MEM_WORKSPACE); };
  if (ulysses) {  // the all-to-all buffers (N, B, Tl, Wg) and the head-sharded gradients
    const int64_t n = rows * (n_head + 2 * n_kv_head) * head_dim;
    w.send = comm_buffer(allocator, n, dtype), w.recv = comm_buffer(allocator, n, dtype);
    const int64_t seq = local_seq * world;
    w.grad_out = work({batch, seq, n_head / world * head_dim});
    w.grad_qkv = work({batch, seq, (n_head / world + 2 * (n_kv_head / world)) * head_dim});
  } else {  // two [K | V | dK | dV] blocks, the running sum (or D) and one query's scores per thread
    const int64_t n = 4 * rows * n_kv_head * head_dim;
    w.send = comm_buffer(allocator, n, dtype), w.recv = comm_buffer(allocator, n, dtype);
    w.stats = work({batch * n_head * local_seq});
    w.scratch = work({omp_get_max_threads() * local_seq});
  }
  return w;
}

namespace {

// Checks full (B, T, W) against local (B, T/N, W) and rank's zig-zag chunks.
void check_local_rows(const char* op, const Tensor& full, const Tensor& local, int rank, int world) {
  LOOM_CHECK(full.defined() && local.defined() && full.ndim() == 3 && local.ndim() == 3 &&
                 full.dtype() == local.dtype() && full.dim(0) == local.dim(0) && full.dim(2) == local.dim(2) &&
                 full.dim(1) == local.dim(1) * world,
             op, ": full ", full.defined() ? full.describe() : "undefined", " and local ",
             local.defined() ? local.describe() : "undefined", " must be (B, T, W) and (B, T/", world, ", W)");
  check_cp_seq_len(full.dim(1), world);
  LOOM_CHECK(rank >= 0 && rank < world, "context parallel: rank ", rank, " outside [0, ", world, ")");
}

}  // namespace

void cp_take_local(const Tensor& full, const Tensor& local, int rank, int world) {
  check_local_rows("cp_take_local", full, local, rank, world);
  for_each_local_chunk(full, local, rank, world, [](const Tensor& f, const Tensor& l) {
    std::memcpy(l.raw_data(), f.raw_data(), f.nbytes());
  });
}

void cp_put_local(const Tensor& local, const Tensor& full, int rank, int world) {
  check_local_rows("cp_put_local", full, local, rank, world);
  for_each_local_chunk(full, local, rank, world, [](const Tensor& f, const Tensor& l) {
    std::memcpy(f.raw_data(), l.raw_data(), l.nbytes());
  });
}

void cp_gather_sequence(Backend& backend, Communicator& cp, const Tensor& local, const Tensor& full) {
  check_local_rows("cp_gather_sequence", full, local, cp.rank(), cp.size());
  const Tensor all = comm_buffer(backend.allocator(), local.numel() * cp.size(), local.dtype());  // (N, B, Tl, W)
  cp.all_gather(local.reshape({local.numel()}), all);
  for (int r = 0; r < cp.size(); ++r) {
    for_each_local_chunk(full, all.view(r * local.numel(), local.shape()), r, cp.size(),
                         [&](const Tensor& f, const Tensor& l) { backend.copy(l, f); });
  }
}

// ---- Ring attention ----------------------------------------------------------------------------

void ring_attention_forward(Backend& backend, Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& lse, int64_t n_head, int64_t n_kv_head,
                            CpWorkspace* workspace) {
  const char* op = "ring_attention_forward";
  const AttnDims d = attn_dims(op, cp, q, k, v, n_head, n_kv_head);
  expect_float(op, q.dtype());
  expect_shape(op, "out", out, q.shape(), q.dtype());
  expect_shape(op, "lse", lse, {d.B, d.H, d.Tl}, q.dtype());
  CpWorkspace local;
  const CpWorkspace& w = workspace_for(backend, d, q.dtype(), false, workspace, local);
  const int64_t blk = d.B * d.Tl * d.KW();  // elements of one of K, V
  const Shape& kv = k.shape();
  // The block in hand and the one arriving: (2, B, Tl, KV hd) = [K | V].
  Tensor cur = w.send.view(0, {2 * blk}), next = w.recv.view(0, {2 * blk});
  const Tensor l = w.stats.view(0, lse.shape());  // running sum
  backend.copy(k, cur.view(0, kv));
  backend.copy(v, cur.view(blk, kv));
  backend.fill(out, 0.0);
  backend.fill(lse, -std::numeric_limits<double>::infinity());  // the running max lives in lse until the end
  backend.fill(l, 0.0);
  for (int s = 0; s < d.N; ++s) {
    const RingBlock block{d.H, d.KV, d.r, d.N, (d.r - s + d.N) % d.N};
    backend.ring_attention_merge(q, cur.view(0, kv), cur.view(blk, kv), out, lse, l, w.scratch, block);
    if (s + 1 < d.N) {
      ring_shift(cp, cur, next);
      std::swap(cur, next);
    }
  }
  // Every query sees at least itself, so l > 0: O /= l, lse = m + log l.
  backend.ring_attention_finish(out, lse, l, d.H);
}

void ring_attention_backward(Backend& backend, Communicator& cp, const Tensor& dout, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dq,
                             const Tensor& dk, const Tensor& dv, int64_t n_head, int64_t n_kv_head,
                             CpWorkspace* workspace) {
  const char* op = "ring_attention_backward";
  const AttnDims d = attn_dims(op, cp, q, k, v, n_head, n_kv_head);
  expect_float(op, q.dtype());
  for (const auto& [what, t] : {std::pair<const char*, const Tensor*>{"dout", &dout}, {"out", &out}, {"dq", &dq}}) {
    expect_shape(op, what, *t, q.shape(), q.dtype());
  }
  expect_shape(op, "lse", lse, {d.B, d.H, d.Tl}, q.dtype());
  expect_shape(op, "dk", dk, k.shape(), q.dtype());
  expect_shape(op, "dv", dv, k.shape(), q.dtype());
  CpWorkspace local;
  const CpWorkspace& w = workspace_for(backend, d, q.dtype(), false, workspace, local);
  const int64_t blk = d.B * d.Tl * d.KW();
  const Shape& kv = k.shape();
  // (4, B, Tl, KV hd) = [K | V | dK | dV]: a block travels with its accumulating gradient.
  Tensor cur = w.send.view(0, {4 * blk}), next = w.recv.view(0, {4 * blk});
  const Tensor D = w.stats.view(0, lse.shape());
  backend.attention_row_dot(dout, out, D, d.H);  // D_i = dO_i . O_i (FlashAttention-2's rowsum trick)
  backend.copy(k, cur.view(0, kv));
  backend.copy(v, cur.view(blk, kv));
  backend.fill(cur.view(2 * blk, {2 * blk}), 0.0);
  backend.fill(dq, 0.0);
  for (int s = 0; s < d.N; ++s) {
    const RingBlock block{d.H, d.KV, d.r, d.N, (d.r - s + d.N) % d.N};
    backend.ring_attention_block_backward(q, dout, lse, D, cur.view(0, kv), cur.view(blk, kv), dq,
                                          cur.view(2 * blk, kv), cur.view(3 * blk, kv), block);
    if (s + 1 < d.N) {
      ring_shift(cp, cur, next);
      std::swap(cur, next);
    }
  }
  // After N-1 hops this rank holds the block of rank r+1: one more hop sends its dK/dV home.
  if (d.N > 1) ring_shift(cp, cur.view(2 * blk, {2 * blk}), next.view(2 * blk, {2 * blk}));
  const Tensor& home = d.N > 1 ? next : cur;
  backend.copy(home.view(2 * blk, kv), dk);
  backend.copy(home.view(3 * blk, kv), dv);
}

int64_t ring_attention_forward_bytes(int world, int64_t batch, int64_t local_seq, int64_t n_kv_head,
                                     int64_t head_dim, int64_t elem_bytes) {
  return static_cast<int64_t>(world - 1) * 2 * batch * local_seq * n_kv_head * head_dim * elem_bytes;
}

int64_t ring_attention_backward_bytes(int world, int64_t batch, int64_t local_seq, int64_t n_kv_head,
                                      int64_t head_dim, int64_t elem_bytes) {
  if (world == 1) return 0;
  return (4 * static_cast<int64_t>(world) - 2) * batch * local_seq * n_kv_head * head_dim * elem_bytes;
}

// ---- Ulysses -----------------------------------------------------------------------------------

void ulysses_attention_forward(Backend& backend, Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& out, UlyssesSaved& saved, int64_t n_head, int64_t n_kv_head,
                               CpWorkspace* workspace) {
  const char* op = "ulysses_attention_forward";
  const UlyssesDims u = ulysses_dims(op, attn_dims(op, cp, q, k, v, n_head, n_kv_head));
  const AttnDims& a = u.a;
  expect_shape(op, "out", out, q.shape(), q.dtype());
  const int64_t qg = u.hl * a.hd, kg = u.kvl * a.hd, wg = u.Wg(), og = qg;  // elements per row
  ensure_saved(backend, saved.qkv, {a.B, a.seq(), u.Wg()}, q.dtype());
  ensure_saved(backend, saved.out, {a.B, a.seq(), u.hl * a.hd}, q.dtype());
  ensure_saved(backend, saved.probs, {a.B, u.hl, a.seq(), a.seq()}, q.dtype());

  // q, k, v -> (N, B, Tl, Wg) chunks by destination head group -> all_to_all_qkv -> true order.
  CpWorkspace local;
  const CpWorkspace& w = workspace_for(backend, a, q.dtype(), true, workspace, local);
  const Tensor& send = w.send;
  const Tensor& recv = w.recv;
  move_head_groups(backend, u, q, send, wg, 0, qg, true);
  move_head_groups(backend, u, k, send, wg, qg, kg, true);
  move_head_groups(backend, u, v, send, wg, qg + kg, kg, true);
  cp.all_to_all(send, recv);
  reorder_sequence(backend, u, saved.qkv, recv, false);

  backend.attention_forward(saved.qkv, saved.out, saved.probs, u.hl, u.kvl, /*window=*/0);

  // out (B, T, H/N hd) in true order -> chunks by owner rank -> all_to_all_out -> out's columns.
  const Tensor osend = send.view(0, {a.N * a.B * a.Tl * u.hl * a.hd});
  const Tensor orecv = recv.view(0, osend.shape());
  reorder_sequence(backend, u, saved.out, osend, true);
  cp.all_to_all(osend, orecv);
  move_head_groups(backend, u, out, orecv, og, 0, og, false);
}

void ulysses_attention_backward(Backend& backend, Communicator& cp, const Tensor& dout, const UlyssesSaved& saved,
                                const Tensor& dq, const Tensor& dk, const Tensor& dv, int64_t n_head,
                                int64_t n_kv_head, CpWorkspace* workspace) {
  const char* op = "ulysses_attention_backward";
  const UlyssesDims u = ulysses_dims(op, attn_dims(op, cp, dq, dk, dv, n_head, n_kv_head));
  const AttnDims& a = u.a;
  expect_shape(op, "dout", dout, dq.shape(), dq.dtype());
  expect_shape(op, "saved.qkv", saved.qkv, {a.B, a.seq(), u.Wg()}, dq.dtype());
  expect_shape(op, "saved.out", saved.out, {a.B, a.seq(), u.hl * a.hd}, dq.dtype());
  const int64_t qg = u.hl * a.hd, kg = u.kvl * a.hd, wg = u.Wg(), og = qg;  // elements per row

  // dout -> head-sharded, true order (all_to_all_dout).
  CpWorkspace local;
  const CpWorkspace& w = workspace_for(backend, a, dq.dtype(), true, workspace, local);
  const Tensor& send = w.send;
  const Tensor& recv = w.recv;
  const Tensor& dout_g = w.grad_out;
  const Tensor& dqkv_g = w.grad_qkv;
  const Tensor osend = send.view(0, {a.N * a.B * a.Tl * u.hl * a.hd});
  const Tensor orecv = recv.view(0, osend.shape());
  move_head_groups(backend, u, dout, osend, og, 0, og, true);
  cp.all_to_all(osend, orecv);
  reorder_sequence(backend, u, dout_g, orecv, false);

  backend.attention_backward(dout_g, saved.qkv, saved.out, saved.probs, dqkv_g, u.hl, u.kvl, /*window=*/0);

  // dqkv (B, T, Wg) -> chunks by owner rank -> all_to_all_dqkv -> dq, dk, dv columns.
  reorder_sequence(backend, u, dqkv_g, send, true);
  cp.all_to_all(send, recv);
  move_head_groups(backend, u, dq, recv, wg, 0, qg, false);
  move_head_groups(backend, u, dk, recv, wg, qg, kg, false);
  move_head_groups(backend, u, dv, recv, wg, qg + kg, kg, false);
}

int64_t ulysses_attention_bytes(int world, int64_t batch, int64_t local_seq, int64_t n_head, int64_t n_kv_head,
                                int64_t head_dim, int64_t elem_bytes) {
  return static_cast<int64_t>(world - 1) * batch * local_seq * (2 * n_head + 2 * n_kv_head) * head_dim * elem_bytes /
         world;
}

}  // namespace loom
