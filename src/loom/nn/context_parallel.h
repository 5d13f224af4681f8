// Context parallelism for causal self-attention: the sequence of T tokens is sharded over the N
// ranks of a cp group, and attention — the only op that mixes positions — is computed exactly
// across the shards, in one of two ways (docs/model_parallel.md):
//
//   Ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for
//   Near-Infinite Context"): each rank keeps its queries and passes its K/V block around the ring
//   of ranks for N-1 steps; a block's contribution is merged into the running output with the
//   online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the
//   FlashAttention recurrence of Dao et al. 2022, arXiv 2205.14135). Backward follows
//   FlashAttention-2 (Dao 2023) with the saved log-sum-exp, and the partial dK/dV of each block
//   travel with it until they are home again.
//
//   Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training
//   of Extreme Long Sequence Transformer Models"): an all-to-all turns the sequence-sharded
//   q/k/v into head-sharded, full-sequence tensors, each rank runs ordinary causal attention
//   (Backend::attention_forward/backward) on its H/N query heads and KV/N kv heads, and an
//   all-to-all turns the output back.
//
// Layout (zig-zag, for causal load balance): the sequence is cut into 2N chunks of C = T/(2N)
// tokens; rank r holds chunks r and 2N-1-r, concatenated, so its T/N local positions are
//   local t < C:  global r*C + t;      local t >= C:  global (2N-1-r)*C + (t - C).
// Under a causal mask every rank then attends to the same number of (query, key) pairs.
//
// Legend: B batch, T global sequence, Tl = T/N local sequence, C = T/(2N) chunk, H query heads,
// KV key/value heads (GQA: query head h reads kv head h / (H/KV)), hd head dim, N cp ranks,
// W any row width. Attention scale is 1/sqrt(hd), the mask causal on global positions: exactly
// Backend::attention_forward's semantics. Tensors are contiguous f32 or f64 (one dtype per
// call). Ring attention's element loops are Backend ops (ring_attention_merge,
// ring_attention_finish, attention_row_dot, ring_attention_block_backward), and
// cp_gather_sequence and Ulysses' sequence reorders are Backend::copy calls of whole chunks,
// Ulysses' head-group packing (column slices of rows) Backend::copy_block calls; only
// cp_take_local / cp_put_local copy host memory (the batch sources' host staging of tokens,
// written to the backend by the trainer or the pipeline). Activation gradients (dq, dk, dv) are overwritten. Every function is called by all
// ranks of the cp communicator together. Communication and scratch buffers come from a
// CpWorkspace allocated once (a training step allocates nothing); a call given none (or one
// for other dims) allocates its own from the backend's allocator (MEM_COMMUNICATION, MEM_WORKSPACE).
#pragma once
#include <cstdint>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"

namespace loom {

// Throws a one-line error naming parallel.cp and train.seq_len unless seq_len % (2 cp) == 0.
void check_cp_seq_len(int64_t seq_len, int cp);

// The global positions of rank's Tl = seq_len / world local positions, in local order.
std::vector<int64_t> cp_local_positions(int64_t seq_len, int rank, int world);
// One of them: the global position of local position t (< 2 chunk), chunk = seq_len / (2 world).
inline int64_t cp_global_position(int64_t t, int64_t chunk, int rank, int world) {
  return t < chunk ? rank * chunk + t : (2 * static_cast<int64_t>(world) - 1 - rank) * chunk + (t - chunk);
}

// The buffers of one ring or Ulysses call besides its arguments, for one set of dims.
struct CpWorkspace {
  struct Dims {
    int64_t batch = 0, local_seq = 0, n_head = 0, n_kv_head = 0, head_dim = 0;
    int world = 0, threads = 0;
    bool ulysses = false;
    DType dtype = DTYPE_F32;
    bool operator==(const Dims&) const = default;
  } dims;
  Tensor send, recv;  // ring: the block in hand and the one arriving (4 B Tl KV hd each);
                      // Ulysses: the all-to-all buffers (N, B, Tl, (H/N + 2 KV/N) hd)
  Tensor stats;       // ring: (B H Tl) the forward's running sum, the backward's D
  Tensor scratch;     // ring: (threads, 2C) one query's scores
  Tensor grad_out, grad_qkv;  // Ulysses backward: dout and dqkv head-sharded over the whole sequence
};
CpWorkspace allocate_cp_workspace(Allocator& allocator, int64_t batch, int64_t local_seq, int64_t n_head,
                                  int64_t n_kv_head, int64_t head_dim, int world, bool ulysses,
                                  DType dtype = DTYPE_F32);

// full (B, T, W) -> local (B, T/N, W): this rank's rows, in local (zig-zag) order. Any dtype;
// host tensors (a batch source's staging).
void cp_take_local(const Tensor& full, const Tensor& local, int rank, int world);
// local (B, T/N, W) -> rank's rows of full (B, T, W); the other rows of full are untouched.
void cp_put_local(const Tensor& local, const Tensor& full, int rank, int world);
// Every rank's local (B, T/N, W) -> full (B, T, W) in true position order, on every rank (one
// all-gather of N x local bytes into a temporary, then a reorder).
void cp_gather_sequence(Backend& backend, Communicator& cp, const Tensor& local, const Tensor& full);

// ---- Ring attention ----------------------------------------------------------------------------
//
// Forward on this rank's shard: q (B, Tl, H hd); k, v (B, Tl, KV hd); out (B, Tl, H hd);
// lse (B, H, Tl) = log sum_j exp(s_ij) over the keys query i sees, saved for backward.
// Per rank: K and V are packed into one block of 2 B Tl KV hd elements; at step s = 0..N-1 the
// rank holds the block of rank (r - s) mod N, merges it, then (s < N-1) sends it to r+1 and
// receives the next from r-1 (even ranks send first, odd ranks receive first: deadlock-free with
// blocking send/recv, for any N). Key chunks a query cannot see (global position > the query's)
// are skipped, so each rank computes about half of its Tl x T scores.
// Bytes sent per rank and layer (and the same received), E = dtype bytes:
//   forward:  (N-1) x 2 B Tl KV hd E   — the K/V block, N-1 hops.
// Memory: O(B Tl (H + KV) hd) (two K/V blocks, the output accumulator and running max and sum
// per query); nothing O(T^2). Cost: plain loops over (b, h, query) with OpenMP, each query
// computing its visible scores once (a dot product per key) — correctness first, not GEMMs.
void ring_attention_forward(Backend& backend, Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& lse, int64_t n_head, int64_t n_kv_head,
                            CpWorkspace* workspace = nullptr);

// Backward: given dout (B, Tl, H hd) and the forward's q, k, v, out and lse, writes dq (B, Tl,
// H hd), dk and dv (B, Tl, KV hd). The K/V block circulates again, now with its accumulating
// dK/dV: at step s the rank adds its queries' contribution to the dK/dV of block (r - s) mod N,
// then passes K, V, dK, dV on; after the last step the dK/dV make one more hop and arrive home.
// Per query i and visible key j (FlashAttention-2, Dao 2023, arXiv 2307.08691):
//   P = exp(S - lse); D_i = dO_i . O_i; dV_j += P dO_i; dP = dO_i . V_j; dS = P (dP - D_i);
//   dQ_i += scale dS K_j; dK_j += scale dS Q_i.
// Bytes sent per rank and layer (and the same received):
//   backward: (N-1) x 2 B Tl KV hd E (K, V) + N x 2 B Tl KV hd E (dK, dV) = (4N - 2) B Tl KV hd E.
void ring_attention_backward(Backend& backend, Communicator& cp, const Tensor& dout, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dq,
                             const Tensor& dk, const Tensor& dv, int64_t n_head, int64_t n_kv_head,
                             CpWorkspace* workspace = nullptr);

// Bytes sent per rank (and received) by ring_attention_forward / _backward: the formulas above.
int64_t ring_attention_forward_bytes(int world, int64_t batch, int64_t local_seq, int64_t n_kv_head,
                                     int64_t head_dim, int64_t elem_bytes);
int64_t ring_attention_backward_bytes(int world, int64_t batch, int64_t local_seq, int64_t n_kv_head,
                                      int64_t head_dim, int64_t elem_bytes);

// ---- Ulysses -----------------------------------------------------------------------------------
//
// What forward keeps for backward, head-sharded over the full sequence in true position order
// (allocated by the forward on first use, reused while the shapes stay the same):
struct UlyssesSaved {
  Tensor qkv;    // (B, T, (H/N + 2 KV/N) hd): this rank's heads, [q heads | k heads | v heads]
  Tensor out;    // (B, T, H/N hd)
  Tensor probs;  // (B, H/N, T, T): Backend::attention_forward's probabilities
};

// Needs n_head % N == 0 and n_kv_head % N == 0 (one-line error naming parallel.cp): rank r'
// gets query heads [r' H/N, (r'+1) H/N) and kv heads [r' KV/N, (r'+1) KV/N), which keeps GQA's
// pairing (query head h reads kv head h / (H/KV)) inside each rank.
// Forward: q (B, Tl, H hd); k, v (B, Tl, KV hd) -> out (B, Tl, H hd).
//   1. pack: chunk r' of the send buffer = this rank's tokens, head group r' of q, k and v,
//      (B, Tl, (H/N + 2 KV/N) hd); one all-to-all (all three at once);
//   2. received chunk r = rank r's tokens, in r's zig-zag order: row t goes to global row
//      cp_local_positions(T, r, N)[t] of saved.qkv, so the sequence is in true order;
//   3. Backend::attention_forward (causal over true positions);
//   4. row p of saved.out goes back to chunk (owner rank of p, its local index), one all-to-all,
//      received chunk r' = head group r' of this rank's tokens, written into out's columns.
// Backward mirrors it: dout to head-sharded (one all-to-all), Backend::attention_backward, dq,
// dk, dv back (one all-to-all).
// Bytes sent per rank and layer (and the same received), E = dtype bytes: each all-to-all
// keeps 1/N of its buffer, so
//   forward = backward = (N-1)/N x B Tl (2H + 2KV) hd E,
// i.e. 4 (N-1)/N x the local bytes of q for MHA (Ulysses, arXiv 2309.14509: 4Nh/P per link for
// sequence N, hidden h, P ranks).
// Memory: saved holds the full sequence for H/N heads, and probs is O(T^2) per head (the CPU
// backend's attention saves P).
void ulysses_attention_forward(Backend& backend, Communicator& cp, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& out, UlyssesSaved& saved, int64_t n_head, int64_t n_kv_head,
                               CpWorkspace* workspace = nullptr);
void ulysses_attention_backward(Backend& backend, Communicator& cp, const Tensor& dout, const UlyssesSaved& saved,
                                const Tensor& dq, const Tensor& dk, const Tensor& dv, int64_t n_head,
                                int64_t n_kv_head, CpWorkspace* workspace = nullptr);

// Bytes sent per rank by ulysses_attention_forward (backward sends the same).
int64_t ulysses_attention_bytes(int world, int64_t batch, int64_t local_seq, int64_t n_head, int64_t n_kv_head,
                                int64_t head_dim, int64_t elem_bytes);

}  // namespace loom
