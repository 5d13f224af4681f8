// KV cache for autoregressive decoding: a contiguous cache (one fixed region of max_len
// positions per sequence) and a paged cache (PagedAttention, Kwon et al. 2023: a pool of
// fixed-size blocks, per-sequence block tables, reference-counted sharing with copy-on-write),
// both storing rows in fp32, bf16 or KIVI's asymmetric int8/int4/int2 (Liu et al. 2024; formats
// and byte layout in kv_quant.h).
//
// Dims: L = n_layer, B = block_size, R = residual, kw / vw = k_width / v_width. A position holds,
// per layer, a K row (kw) and a V row (vw). vw may be 0: an MLA cache keeps only the compressed
// latent (and the decoupled RoPE key) in the K row and is read with read().
//
// Decoding a position (per sequence):
//     for layer l: write(seq, l, k, v); attend(seq, l, q, out, ...)   // or read(...)
//     advance(seq)
// write() stores position length(seq) of layer l; advance() commits it once every layer wrote
// it. A layer's visible positions are [0, n) with n = length(seq) + (1 if that layer already
// wrote position length(seq), else 0): attend and read see the row just written.
//
// Storage. Positions are grouped into tiles of B consecutive positions (tile k = positions
// [kB, kB + B)); a tile holds, for every layer, a K tile and a V tile of B rows in the configured
// formats: block layout [layer][K tile (kv_tile_bytes(k spec, B)) | V tile]. The paged cache maps
// tile k of a sequence to a pool block through the sequence's block table; the contiguous cache
// keeps a sequence's tiles at fixed offsets of its region, laid out [layer][K tiles | V tiles],
// so an fp32 layer's K rows are one (max_len, kw) array.
//
// Quantization schedule (per layer, separately for K and V; "quantize" = store in the format):
//   fp32:                              rows are stored in their tile when written.
//   bf16 (either axis), per-token int: the newest R positions stay in an fp32 window; a position
//                                      is stored in its tile when it leaves the window
//                                      (R = 0: when written). Positions [0, max(0, n - R)) are
//                                      in tiles.
//   per-channel integer (KIVI keys):   a whole tile is quantized at once (block_size is the
//                                      per-channel group) when all its positions are older than
//                                      the newest R: positions [0, floor(max(0, n - R) / B) * B)
//                                      are in tiles, the rest (at most R + B - 1) in the window.
// The fp32 window is a per-sequence ring of W rows per layer and stream (W = 0 for fp32, R for
// bf16/per-token, R + B - 1 for per-channel integer); rows in it read back bitwise as written.
// A tile's slots are reserved (its block allocated) when its first position is written, even if
// its rows still sit in the window.
//
// Sharing (paged). fork(seq) gives a new sequence the parent's block table, forgotten tiles'
// empty markers included (refcount + 1 on every live block, the partially filled last one
// included; the child shares no forgotten block), the parent's forget point and a copy of its
// fp32 window. The first
// store into a block whose refcount is > 1 copies the block (all layers) into a free block for
// the writing sequence (copy-on-write); the other sharers keep the original. release() drops
// the sequence's references and returns blocks whose count reaches 0 to the free list. The
// contiguous cache's fork copies the region; it needs max_len to be a multiple of B when a
// stream is per-channel integer (whole tiles).
//
// Forgetting (sliding-window attention: Mistral 7B's rolling buffer, Jiang et al. 2023; vLLM's
// sliding-window block release, Kwon et al. 2023). forget_before(seq, f) declares positions
// [0, f) of seq never read again (f <= length(seq); the forget point only moves forward). The
// paged cache then drops the sequence's references to the blocks of tiles k with (k + 1) B <= f
// (refcount - 1, back to the free list at 0); the block table keeps its length with an empty
// marker there, so tile k still maps to positions [kB, kB + B). The tile holding f stays whole.
// The contiguous cache keeps its storage (a region is fixed). In both, attend and read of a
// position < f throw naming the position and the sequence (attend with window > 0 reads
// [max(0, n - window), n), so forget_before(seq, n + 1 - window) before writing position n is safe:
// a sequence then holds at most ceil((window + B - 1) / B) <= ceil(window / B) + 1 blocks).
// Quantization: rows of a forgotten tile still in the fp32 window are never stored when they
// age out (there is no block to store them in); a live tile straddling f is stored, quantized
// and read exactly as without forgetting (its per-channel (scale, min) still cover its forgotten
// rows), so attention over live positions is bitwise the same as in a cache that forgets nothing.
//
// Sequence ids count up from 0 and are never reused: using a released id throws ("was released").
//
// Accounting. bytes_reserved(): the pool (num_blocks blocks, or max_sequences regions) plus the
// fp32 windows of live sequences. bytes_used(): over distinct blocks (regions) in use, the bytes
// of their filled positions (integer per-token: kv_row_bytes per position; integer per-channel:
// the tile's (scale, min) pairs once any position is filled, plus code rows), plus the window
// rows holding positions. A sequence fills length(seq) positions, plus one while a position is
// part-written. utilisation() = block part of bytes_used() / (blocks_in_use() * block_bytes()).
// Paged, after forget_before: only live blocks count: a block a sequence forgot counts for the
// sharers still holding it, and is back in free_blocks() once none does; bytes_used(),
// positions_in_use() and utilisation() sum over live blocks (the live tile holding the forget
// point counts its filled positions from kB, as it stores them), sequence_blocks(seq) counts
// the sequence's live blocks (not the empty markers). The fp32 window is a fixed per-sequence
// ring, so its rows count as before (until they age out) whether forgotten or not. Contiguous:
// forgetting changes no figure.
//
// Attention (attend): for query head h (kv head g = h / (n_head / n_kv_head)) over positions
// [first, n), first = window > 0 ? max(0, n - window) : 0,
//     s_t = (q_h . k_t[g]) / sqrt(head_dim),  p_t = exp(s_t - max s) / sum_t exp(s_t - max s),
//     out_h = sum_t p_t v_t[g],
// two passes in fp32 over positions in increasing order (backend/attend_rows.h, which the engine's
// prompt chunks use too). Both caches run that kernel on rows handed out by the same walker (only
// the tile lookup differs), so for the same rows they give bitwise equal outputs.
//
// Memory. A cache's bytes are host memory (make_paged_kv_cache, make_contiguous_kv_cache) or a
// backend's (make_device_kv_cache: the same bookkeeping, the bytes written by Backend::kv_store and
// read by Backend::kv_attention, backend/kv_store.h and kv_attention.h). A cache in backend memory
// takes a step's rows where they are (write_rows: rows of a backend tensor) and attends for a
// batch of sequences in one op (attend_rows), into a backend tensor; its stores are collected and
// run at the next attend_rows, flush() or any read, copy, fork or release, so a decoding step costs
// one kv_store and one kv_attention per layer. write / attend / read with host rows work on it
// too (rows staged through the host: for tests, MLA latents and prefix-cache chunks). The CPU
// backend's kv_store and kv_attention run the host cache's arithmetic (backend/kv_quantize.h,
// backend/attend_rows.h), so both caches store the same bytes and attend bitwise equally there;
// a GPU's split-KV attention sums in another order (the op tests' f32 tolerance). A bad row
// (non-finite, or beyond fp16 for an integer format) is refused by write() before anything is
// stored; rows in backend memory are checked by the kv_store kernels, and check_status() throws
// once one was seen.
//
// A cache is not thread-safe: attend and read use scratch buffers owned by the cache.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/infer/kv_quant.h"

namespace loom {

class Allocator;
class Backend;

struct KvCacheConfig {
  int64_t n_layer = 0, k_width = 0, v_width = 0;
  int64_t block_size = 16;  // positions per block (paged) and per tile (both); per-channel group
  int64_t num_blocks = 0;   // pool size (paged; must be > 0)
  int64_t max_len = 0;      // positions per sequence (contiguous; must be > 0)
  KvFormat k_format = KV_FP32, v_format = KV_FP32;
  KvAxis k_axis = KV_PER_TOKEN, v_axis = KV_PER_TOKEN;
  int64_t group = 0;     // per-token integer: channels per (scale, min) group; 0 = the whole row
  int64_t residual = 0;  // KIVI: the newest `residual` positions stay fp32 (see the schedule above)

  void validate() const;  // shapes, formats and groups; throws naming the kv_cache.<field>
  KvQuantSpec k_spec() const { return {k_format, k_axis, k_width, group}; }
  KvQuantSpec v_spec() const { return {v_format, v_axis, v_width, group}; }
};

// Bytes of one block (B positions, all layers, K and V tiles).
int64_t kv_block_bytes(const KvCacheConfig& config);
// Asymptotic bytes per position (all layers) of the stored formats: kv_block_bytes / B, i.e.
//     L * (bytes_K + bytes_V),  bytes = 4w (fp32), 2w (bf16), w b / 8 + 4 w / group (per-token
//     integer, group 0 = w), w b / 8 + 4 w / B (per-channel integer), b = 8, 4, 2;
// for rows whose codes fill whole bytes (w b divisible by 8). The fp32 window is a per-sequence
// constant (kv_window_bytes) and is not included.
double kv_bytes_per_token(const KvCacheConfig& config);
// fp32 window bytes per sequence: 4 L (W_K kw + W_V vw), W as in the schedule above.
int64_t kv_window_bytes(const KvCacheConfig& config);
// Exact bytes a paged cache reserves for one unshared sequence of `length` positions:
// ceil(length / B) * kv_block_bytes + kv_window_bytes.
int64_t kv_sequence_bytes(const KvCacheConfig& config, int64_t length);

class KvCache {
 public:
  virtual ~KvCache() = default;

  virtual int64_t add_sequence() = 0;         // a new empty sequence; returns its id
  virtual int64_t fork(int64_t seq) = 0;      // a new sequence with seq's positions (see Sharing)
  virtual void release(int64_t seq) = 0;      // the id becomes invalid; its storage is returned
  virtual int64_t length(int64_t seq) const = 0;  // committed positions

  // k: (k_width), v: (v_width; ignored when v_width == 0) -> position length(seq) of `layer`.
  virtual void write(int64_t seq, int64_t layer, const float* k, const float* v) = 0;
  virtual void advance(int64_t seq) = 0;  // commits position length(seq); every layer must have written it
  // Positions [0, position) of seq will never be read again (position <= length(seq); a smaller
  // position than an earlier call is a no-op). Paged: returns the blocks they fill alone (see
  // Forgetting); contiguous: keeps the storage. Reading them afterwards throws.
  virtual void forget_before(int64_t seq, int64_t position) = 0;

  // q: (n_head, head_dim), out: (n_head, head_dim); needs k_width == v_width == n_kv_head * head_dim.
  // sinks: the layer's (n_head) attention-sink logits (GPT-OSS; backend/attend_rows.h), or null.
  virtual void attend(int64_t seq, int64_t layer, const float* q, float* out, int64_t n_head, int64_t n_kv_head,
                      int64_t head_dim, int64_t window = 0, const float* sinks = nullptr) = 0;
  // Rows [begin, end) of the visible positions, dequantized: k_out (end - begin, k_width) and,
  // when v_width > 0, v_out (end - begin, v_width).
  virtual void read(int64_t seq, int64_t layer, int64_t begin, int64_t end, float* k_out, float* v_out) = 0;

  virtual const KvCacheConfig& config() const = 0;
  // Accounting (see the header comment). A "block" is a pool block (paged) or a sequence's
  // region (contiguous).
  virtual int64_t bytes_reserved() const = 0;
  virtual int64_t bytes_used() const = 0;
  virtual int64_t block_bytes() const = 0;
  virtual int64_t block_positions() const = 0;  // B (paged) or max_len (contiguous)
  virtual int64_t blocks_in_use() const = 0;
  virtual int64_t free_blocks() const = 0;
  virtual int64_t positions_in_use() const = 0;  // filled positions over distinct blocks
  virtual double utilisation() const = 0;
  virtual int64_t sequence_blocks(int64_t seq) const = 0;                   // live blocks seq refers to
  // Sharers of position's block; throws for a position whose block seq forgot (paged).
  virtual int64_t block_refcount(int64_t seq, int64_t position) const = 0;

  // Blocks held apart from sequences (paged only; automatic prefix caching, prefix_cache.h). A
  // block is a pool index. The contiguous cache throws.
  //   block_of(seq, k): the block holding tile k of seq (k < the tiles seq wrote);
  //   retain(block) / drop(block): one more / one less reference (the block is free at 0);
  //   refcount(block): its references (sequences and retains);
  //   add_sequence_with(blocks): a new sequence whose first tiles are `blocks`, all full
  //     (length = blocks.size() * B, one more reference each); needs a cache without an fp32
  //     window (kv_window_bytes == 0), whose full tiles hold every row.
  virtual int64_t block_of(int64_t seq, int64_t tile) const;
  virtual void retain(int64_t block);
  virtual void drop(int64_t block);
  virtual int64_t refcount(int64_t block) const;
  virtual int64_t add_sequence_with(const std::vector<int64_t>& blocks);

  // A cache in a backend's memory (see Memory); the others throw.
  virtual bool in_backend_memory() const { return false; }
  // Row first_row + r of `rows` (a 2-D f32 backend tensor; K at column k_col, V at v_col) ->
  // position length(seqs[r]) of `layer`, for distinct sequences seqs[r].
  virtual void write_rows(int64_t layer, const std::vector<int64_t>& seqs, const Tensor& rows, int64_t first_row,
                          int64_t k_col, int64_t v_col);
  // attend() for every seqs[r] at once: q and out (seqs.size(), n_head x head_dim) backend tensors;
  // sinks the layer's (n_head) f32 sink logits, a backend tensor too (undefined: none).
  virtual void attend_rows(int64_t layer, const std::vector<int64_t>& seqs, const Tensor& q, const Tensor& out,
                           int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window,
                           const Tensor& sinks = Tensor{});
  virtual void flush() {}         // runs the pending stores
  virtual void check_status() {}  // throws if a stored row could not be (see Memory)
};

// max_sequences regions of max_len positions, allocated up front. allocator: a host allocator
// (host_accessible(): the cache reads and writes its rows on the host; it must outlive the cache) whose tracker accounts the storage under MEM_KV_CACHE, exactly
// bytes_reserved(); nullptr = one owned by the cache.
std::unique_ptr<KvCache> make_contiguous_kv_cache(const KvCacheConfig& config, int64_t max_sequences,
                                                  Allocator* allocator = nullptr);
// A pool of num_blocks blocks of block_size positions, allocated up front.
std::unique_ptr<KvCache> make_paged_kv_cache(const KvCacheConfig& config, Allocator* allocator = nullptr);

// Either cache with its bytes in `backend`'s memory (see Memory; the backend states
// capabilities().kv_cache): its pool, plus max_sequences fp32 windows (sequences alive at once)
// when the formats keep one, allocated up front from the backend's allocator under MEM_KV_CACHE.
// paged = false: a contiguous cache of max_sequences regions.
std::unique_ptr<KvCache> make_device_kv_cache(const KvCacheConfig& config, Backend& backend, int64_t max_sequences,
                                              bool paged);

}  // namespace loom
