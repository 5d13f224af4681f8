// What both KV caches share, not for callers (their interface is kv_cache.h). TiledKvCache owns
// everything but the mapping from (sequence, tile index) to bytes: the paged cache
// (kv_cache_paged.cpp) looks the tile up in the sequence's block table, the contiguous cache
// (kv_cache.cpp) adds its offset to the sequence's region base. Attention and read walk rows
// through that one mapping, so both caches sum in the same order. forget_before (sliding windows;
// kv_cache.h "Forgetting") records a per-sequence forget point here; the paged cache also returns
// the blocks of the tiles wholly before it. The storage, KIVI's quantization schedule (Liu et al.
// 2024), sharing and accounting rules are stated in kv_cache.h. Every byte is stored, copied and
// read through a KvBytes (kv_bytes.h): host memory, or a backend's (make_device_kv_cache), where
// tiles and windows are byte and float offsets rather than pointers.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/tensor.h"
#include "loom/backend/attend_rows.h"
#include "loom/infer/kv_bytes.h"
#include "loom/infer/kv_cache.h"

namespace loom::kv {

enum KvStream : int { STREAM_K, STREAM_V, STREAM_COUNT };

// One of a position's two rows (K or V): how it is stored and when it leaves the fp32 window.
struct StreamLayout {
  KvQuantSpec spec;
  bool present = false;    // V is absent when v_width == 0
  int64_t width = 0;       // channels (0 when absent)
  int64_t row_bytes = 0;   // kv_row_bytes
  int64_t tile_bytes = 0;  // one tile of B rows
  int64_t window = 0;      // rows of the fp32 ring per layer (W in kv_cache.h)
  int64_t block = 0, residual = 0;

  StreamLayout() = default;
  StreamLayout(const KvQuantSpec& s, const KvCacheConfig& c)
      : spec(s), present(s.width > 0), width(s.width), block(c.block_size), residual(c.residual) {
    if (!present) return;
    row_bytes = kv_row_bytes(spec);
    tile_bytes = kv_tile_bytes(spec, block);
    if (spec.format == KV_FP32) window = 0;
    else if (spec.per_channel_integer()) window = residual + block - 1;
    else window = residual;
  }

  // Positions [0, result) of a layer with n positions are stored in tiles, [result, n) in the window.
  int64_t window_start(int64_t n) const {
    if (spec.format == KV_FP32) return n;
    const int64_t aged = std::max<int64_t>(0, n - residual);
    return spec.per_channel_integer() ? aged / block * block : aged;
  }

  // Bytes of a tile whose first `filled` positions are in use.
  int64_t used_tile_bytes(int64_t filled) const {
    if (!present || filled <= 0) return 0;
    return filled * row_bytes + kv_tile_param_bytes(spec);
  }
};

struct Layouts {
  StreamLayout stream[STREAM_COUNT];
  explicit Layouts(const KvCacheConfig& c) : stream{StreamLayout(c.k_spec(), c), StreamLayout(c.v_spec(), c)} {}
  int64_t tile_pair_bytes() const { return stream[STREAM_K].tile_bytes + stream[STREAM_V].tile_bytes; }
  bool has_window() const { return window_floats_per_layer() > 0; }
  int64_t window_floats_per_layer() const {
    return stream[STREAM_K].window * stream[STREAM_K].width + stream[STREAM_V].window * stream[STREAM_V].width;
  }
};

inline bool float_aligned(const uint8_t* p) { return reinterpret_cast<uintptr_t>(p) % alignof(float) == 0; }

inline constexpr int64_t kNoBlock = -1;  // a forgotten tile's entry in a block table

// The paged cache over the given bytes (kv_cache_paged.cpp; make_device_kv_cache).
std::unique_ptr<KvCache> make_paged_kv_cache(const KvCacheConfig& config, std::unique_ptr<KvBytes> bytes);

struct Sequence {
  bool live = false;
  int64_t length = 0;                // committed positions
  std::vector<uint8_t> written;      // [layer] 1 when the layer wrote position `length`
  std::vector<int64_t> blocks;       // [tile] pool block (paged); kNoBlock once forgotten
  int64_t forgotten = 0;             // positions [0, forgotten) are never read (forget_before)
  int64_t dropped = 0;               // tiles [0, dropped) have no storage (paged: kNoBlock)
  int64_t region = -1;               // region index (contiguous)
  int64_t ring = -1;                 // float offset of the window in the rings (KvBytes), -1: none:
                                     // [layer] (K ring (W_K, kw), V ring (W_V, vw)) fp32

  bool part_written() const { return std::find(written.begin(), written.end(), 1) != written.end(); }
  int64_t filled() const { return length + (part_written() ? 1 : 0); }
};

// Everything except where a sequence's tile k lives (see the file comment).
class TiledKvCache : public KvCache {
 public:
  // bytes: a device storage (make_device_kv_bytes); null: host memory from `allocator`.
  TiledKvCache(const KvCacheConfig& config, Allocator* allocator, std::unique_ptr<KvBytes> bytes = nullptr)
      : allocator_(allocator ? allocator : &own_allocator_), config_(config), layouts_((config.validate(), config)),
        bytes_(bytes ? std::move(bytes) : host_bytes()) {
    const int64_t widest = std::max(config.k_width, config.v_width);
    rows_scratch_.resize(static_cast<size_t>(config.block_size * widest));
  }

  int64_t add_sequence() override { return add(std::vector<int64_t>{}); }

  int64_t add_sequence_with(const std::vector<int64_t>& blocks) override {
    LOOM_CHECK(!layouts_.has_window(), "kv cache: a sequence made of cached blocks needs a cache without an fp32 window "
               "(kv_cache.residual = 0 and no per-channel integer stream)");
    return add(blocks);
  }

  int64_t add(const std::vector<int64_t>& blocks) {
    Sequence s;
    s.live = true;
    s.written.assign(static_cast<size_t>(config_.n_layer), 0);
    s.ring = bytes_->take_ring();
    on_add(s);
    if (!blocks.empty()) {
      adopt(s, blocks);
      s.length = static_cast<int64_t>(blocks.size()) * config_.block_size;
    }
    const int64_t id = next_id_++;
    sequences_.emplace(id, std::move(s));
    return id;
  }

  int64_t fork(int64_t seq) override {
    const Sequence& parent = live(seq);
    LOOM_CHECK(!parent.part_written(), "kv cache: fork(sequence ", seq, ") in the middle of position ", parent.length,
               " (some layers wrote it, advance() was not called)");
    Sequence child;
    child.live = true;
    child.length = parent.length;
    child.written = parent.written;
    child.forgotten = parent.forgotten;
    child.dropped = parent.dropped;
    child.ring = bytes_->take_ring();
    if (child.ring >= 0) bytes_->copy_ring(parent.ring, child.ring, window_floats());
    on_fork(parent, child);
    const int64_t id = next_id_++;
    sequences_.emplace(id, std::move(child));
    return id;
  }

  void release(int64_t seq) override {
    Sequence& s = live(seq);
    bytes_->flush();  // no pending store may land in a block after its next owner's
    on_release(s);
    bytes_->free_ring(s.ring);
    sequences_.erase(seq);  // nothing of a released sequence stays (a server releases millions)
  }

  int64_t length(int64_t seq) const override { return live(seq).length; }

  void write(int64_t seq, int64_t layer, const float* k, const float* v) override {
    const Sequence& s = live(seq);
    check_layer(layer);
    check_row(STREAM_K, k, seq, layer, s.length);
    if (layouts_.stream[STREAM_V].present) check_row(STREAM_V, v, seq, layer, s.length);
    write_ref(seq, layer, RowRef::of_host(k), RowRef::of_host(v));
  }

  bool in_backend_memory() const override { return bytes_->backend() != nullptr; }

  void write_rows(int64_t layer, const std::vector<int64_t>& seqs, const Tensor& rows, int64_t first_row,
                  int64_t k_col, int64_t v_col) override {
    check_layer(layer);
    LOOM_CHECK(rows.ndim() == 2 && first_row >= 0 && first_row + static_cast<int64_t>(seqs.size()) <= rows.dim(0) &&
                   k_col >= 0 && k_col + config_.k_width <= rows.dim(1) &&
                   (config_.v_width == 0 || (v_col >= 0 && v_col + config_.v_width <= rows.dim(1))),
               "kv cache: write_rows of ", seqs.size(), " rows from row ", first_row, " of ", rows.describe(),
               " with K at column ", k_col, " and V at ", v_col, " (rows of k_width ", config_.k_width, ", v_width ",
               config_.v_width, ")");
    const int32_t source = bytes_->add_source(rows);
    const int64_t width = rows.dim(1);
    for (size_t r = 0; r < seqs.size(); ++r) {
      const int64_t at = (first_row + static_cast<int64_t>(r)) * width;
      write_ref(seqs[r], layer, RowRef::of_source(source, at + k_col), RowRef::of_source(source, at + v_col));
    }
  }

  void attend_rows(int64_t layer, const std::vector<int64_t>& seqs, const Tensor& q, const Tensor& out,
                   int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window,
                   const Tensor& sinks = Tensor{}) override {
    check_layer(layer);
    check_heads(n_head, n_kv_head, head_dim, window);
    KvAttendPlan& p = plan_;
    p.spec[STREAM_K] = layouts_.stream[STREAM_K].spec, p.spec[STREAM_V] = layouts_.stream[STREAM_V].spec;
    p.block = config_.block_size;
    p.window[STREAM_K] = layouts_.stream[STREAM_K].window, p.window[STREAM_V] = layouts_.stream[STREAM_V].window;
    p.n_head = n_head, p.n_kv_head = n_kv_head, p.head_dim = head_dim;
    p.rows.clear(), p.tile_offsets.clear();
    p.sinks = sinks;
    for (const int64_t seq : seqs) {
      const Sequence& s = live(seq);
      KvAttendRow row;
      std::tie(row.first, row.n) = attended(s, seq, layer, window);
      const int64_t n = row.n;
      row.tiles = static_cast<int64_t>(p.tile_offsets.size());
      int64_t tiles = 0;
      for (int st = 0; st < STREAM_COUNT; ++st) {
        row.stored[st] = layouts_.stream[st].window_start(n);
        row.ring[st] = layouts_.stream[st].window > 0 ? window_rows(s, layer, st) : -1;
        tiles = std::max(tiles, (row.stored[st] + config_.block_size - 1) / config_.block_size);
      }
      for (int64_t k = 0; k < tiles; ++k) {
        for (int st = 0; st < STREAM_COUNT; ++st) p.tile_offsets.push_back(k < s.dropped ? -1 : tile(s, k, layer, st));
      }
      p.rows.push_back(row);
    }
    bytes_->flush();
    bytes_->backend()->kv_attention(p, q, bytes_->pool(), bytes_->rings(), out);
  }

  void flush() override { bytes_->flush(); }
  void check_status() override { bytes_->check_status(); }

  void advance(int64_t seq) override {
    Sequence& s = live(seq);
    for (int64_t l = 0; l < config_.n_layer; ++l) {
      LOOM_CHECK(s.written[static_cast<size_t>(l)], "kv cache: advance(sequence ", seq, ") before layer ", l,
                 " wrote position ", s.length);
    }
    std::fill(s.written.begin(), s.written.end(), 0);
    ++s.length;
  }

  void forget_before(int64_t seq, int64_t position) override {
    Sequence& s = live(seq);
    LOOM_CHECK(position <= s.length, "kv cache: forget_before(sequence ", seq, ", position ", position,
               ") beyond its ", s.length, " committed positions");
    if (position <= s.forgotten) return;
    s.forgotten = position;
    bytes_->flush();  // the blocks it returns may be handed out again
    on_forget(s);
  }

  void attend(int64_t seq, int64_t layer, const float* q, float* out, int64_t n_head, int64_t n_kv_head,
              int64_t head_dim, int64_t window, const float* sinks = nullptr) override {
    const Sequence& s = live(seq);
    check_layer(layer);
    check_heads(n_head, n_kv_head, head_dim, window);
    int64_t first = 0, n = 0;  // named variables: lambdas below capture them
    std::tie(first, n) = attended(s, seq, layer, window);
    loom::attend_rows(
        q, out, n_head, n_kv_head, head_dim, first, n,
        [&](auto&& fn) { walk_rows(s, layer, STREAM_K, first, n, n, fn); },
        [&](auto&& fn) { walk_rows(s, layer, STREAM_V, first, n, n, fn); }, scores_, sums_, sinks);
  }

  void read(int64_t seq, int64_t layer, int64_t begin, int64_t end, float* k_out, float* v_out) override {
    const Sequence& s = live(seq);
    check_layer(layer);
    const int64_t n = visible(s, layer);
    LOOM_CHECK(0 <= begin && begin <= end && end <= n, "kv cache: read of positions [", begin, ", ", end,
               ") of sequence ", seq, " layer ", layer, ", which holds ", n);
    if (begin < end) check_not_forgotten(s, seq, layer, begin);
    const auto copy_into = [](float* out, int64_t width, int64_t offset) {
      return [=](int64_t t, const float* row) {
        std::memcpy(out + (t - offset) * width, row, static_cast<size_t>(width) * sizeof(float));
      };
    };
    walk_rows(s, layer, STREAM_K, begin, end, n, copy_into(k_out, config_.k_width, begin));
    if (!layouts_.stream[STREAM_V].present) return;
    LOOM_CHECK(v_out != nullptr, "kv cache: read needs v_out for v_width ", config_.v_width);
    walk_rows(s, layer, STREAM_V, begin, end, n, copy_into(v_out, config_.v_width, begin));
  }

  const KvCacheConfig& config() const override { return config_; }

 protected:
  // Where tile k of a sequence lives: the pool byte offset of layer `layer`'s tile of `stream`.
  virtual int64_t tile(const Sequence& s, int64_t k, int64_t layer, int stream) const = 0;
  // Makes position p of a sequence addressable (paged: allocates its block at a tile's start).
  virtual void reserve_position(Sequence& s, int64_t seq, int64_t p) = 0;
  // Called before storing into tile k (paged: copy-on-write of a shared block).
  virtual void make_tile_writable(Sequence& s, int64_t k) = 0;
  virtual void on_add(Sequence& s) = 0;
  // A new sequence's first tiles are `blocks` (add_sequence_with; paged only).
  virtual void adopt(Sequence&, const std::vector<int64_t>&) {
    throw Error("kv cache: cached blocks need a paged cache (generate.paged)");
  }
  virtual void on_fork(const Sequence& parent, Sequence& child) = 0;
  virtual void on_release(Sequence& s) = 0;
  // s.forgotten moved forward (paged: drops the blocks of tiles wholly before it).
  virtual void on_forget(Sequence& s) = 0;

  // Bytes of the tiles holding a unit's first `filled` positions (B per tile, all layers).
  int64_t used_bytes_of_positions(int64_t filled) const {
    const int64_t B = config_.block_size;
    int64_t bytes = 0;
    for (int64_t k = 0; k * B < filled; ++k) {
      const int64_t f = std::min(B, filled - k * B);
      bytes += layouts_.stream[STREAM_K].used_tile_bytes(f) + layouts_.stream[STREAM_V].used_tile_bytes(f);
    }
    return config_.n_layer * bytes;
  }

  int64_t window_bytes_reserved() const { return bytes_->ring_bytes_reserved(); }

  // Window rows holding positions, over live sequences, in bytes.
  int64_t window_bytes_in_use() const {
    int64_t rows = 0;
    for (const auto& [id, s] : sequences_) {
      for (int64_t l = 0; l < config_.n_layer; ++l) {
        const int64_t n = visible(s, l);
        for (const StreamLayout& st : layouts_.stream) {
          if (st.present && st.window > 0) rows += (n - st.window_start(n)) * st.width;
        }
      }
    }
    return rows * static_cast<int64_t>(sizeof(float));
  }

  const Sequence& live(int64_t seq) const {
    LOOM_CHECK(0 <= seq && seq < next_id_, "kv cache: unknown sequence id ", seq, " (", next_id_,
               " sequences were added)");
    const auto it = sequences_.find(seq);
    LOOM_CHECK(it != sequences_.end(), "kv cache: sequence ", seq, " was released (expected a live sequence)");
    return it->second;
  }
  Sequence& live(int64_t seq) { return const_cast<Sequence&>(std::as_const(*this).live(seq)); }

  KvBytes& bytes() const { return *bytes_; }

 private:
  // First, so that it outlives every Storage allocated from it (pools and windows).
  CpuAllocator own_allocator_;
  Allocator* allocator_;

 protected:
  const KvCacheConfig config_;
  const Layouts layouts_;
  std::unique_ptr<KvBytes> bytes_;          // after the allocator it may take from
  std::map<int64_t, Sequence> sequences_;  // the live sequences by id; ids are never reused
  int64_t next_id_ = 0;

 private:
  std::unique_ptr<KvBytes> host_bytes() {
    LOOM_CHECK(allocator_->host_accessible(), "kv cache: storage on a device allocator needs a cache in the backend's "
               "memory (make_device_kv_cache)");
    return make_host_kv_bytes(*allocator_, window_floats());
  }
  int64_t window_floats() const { return config_.n_layer * layouts_.window_floats_per_layer(); }

  // Writes position length(seq) of `layer` (KvCache::write, write_rows).
  void write_ref(int64_t seq, int64_t layer, const RowRef& k, const RowRef& v) {
    Sequence& s = live(seq);
    const int64_t p = s.length;
    LOOM_CHECK(!s.written[static_cast<size_t>(layer)], "kv cache: layer ", layer, " of sequence ", seq,
               " already wrote position ", p, "; call advance() once every layer has written it");
    if (!s.part_written()) reserve_position(s, seq, p);
    store_row(s, layer, STREAM_K, p, k);
    if (layouts_.stream[STREAM_V].present) store_row(s, layer, STREAM_V, p, v);
    s.written[static_cast<size_t>(layer)] = 1;
  }

  // The positions [first, n) a query of `layer` attends to (window 0: all), none forgotten.
  std::pair<int64_t, int64_t> attended(const Sequence& s, int64_t seq, int64_t layer, int64_t window) const {
    const int64_t n = visible(s, layer);
    LOOM_CHECK(n > 0, "kv cache: attend on sequence ", seq, " whose layer ", layer, " holds no position");
    const int64_t first = window > 0 ? std::max<int64_t>(0, n - window) : 0;
    check_not_forgotten(s, seq, layer, first);
    return {first, n};
  }

  void check_heads(int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window) const {
    LOOM_CHECK(config_.v_width > 0, "kv cache: attend needs V rows (v_width > 0); read() an MLA latent cache instead");
    LOOM_CHECK(n_head > 0 && n_kv_head > 0 && head_dim > 0 && n_head % n_kv_head == 0, "kv cache: attend with ",
               n_head, " query heads over ", n_kv_head, " kv heads of ", head_dim,
               " (expected positive sizes, query heads a multiple of kv heads)");
    LOOM_CHECK(n_kv_head * head_dim == config_.k_width && n_kv_head * head_dim == config_.v_width, "kv cache: ",
               n_kv_head, " kv heads of ", head_dim, " do not match k_width ", config_.k_width, " and v_width ",
               config_.v_width);
    LOOM_CHECK(window >= 0, "kv cache: attention window must be >= 0 (0 = all positions), got ", window);
  }

  void check_layer(int64_t layer) const {
    LOOM_CHECK(0 <= layer && layer < config_.n_layer, "kv cache: layer ", layer, " is outside [0, ", config_.n_layer,
               ")");
  }

  // Integer formats need finite values inside fp16's range (the (scale, min) are fp16), checked
  // before anything is stored so a bad row leaves the cache unchanged.
  void check_row(int stream, const float* x, int64_t seq, int64_t layer, int64_t p) const {
    const StreamLayout& st = layouts_.stream[stream];
    LOOM_CHECK(x != nullptr, "kv cache: write of sequence ", seq, " layer ", layer, " has no ",
               stream == STREAM_K ? "K" : "V", " row");
    if (!kv_format_is_integer(st.spec.format)) return;
    for (int64_t c = 0; c < st.width; ++c) {
      LOOM_CHECK(std::fabs(x[c]) < 65504.0f, "kv cache: ", stream == STREAM_K ? "K" : "V", " row of sequence ", seq,
                 " layer ", layer, " position ", p, " channel ", c, " is ", x[c],
                 " (expected finite values with |x| < 65504 for ", kv_format_name(st.spec.format), ")");
    }
  }

  int64_t visible(const Sequence& s, int64_t layer) const { return s.length + s.written[static_cast<size_t>(layer)]; }

  // Reading from position `first` on must not touch a forgotten position.
  void check_not_forgotten(const Sequence& s, int64_t seq, int64_t layer, int64_t first) const {
    LOOM_CHECK(first >= s.forgotten, "kv cache: read of position ", first, " of sequence ", seq, " layer ", layer,
               ", which was forgotten (forget_before(", seq, ", ", s.forgotten, ") was called)");
  }

  // Layer `layer`'s ring of `stream`: (W, width) fp32, position t in row t % W; its float offset in
  // the rings (-1: the sequence has no window).
  int64_t window_rows(const Sequence& s, int64_t layer, int stream) const {
    if (s.ring < 0) return -1;
    int64_t at = s.ring + layer * layouts_.window_floats_per_layer();
    if (stream == STREAM_V) at += layouts_.stream[STREAM_K].window * layouts_.stream[STREAM_K].width;
    return at;
  }

  // Position p's row x joins layer `layer`: rows leaving the window go to their tiles first (row
  // p itself when it is not to stay in the window), then p enters the window.
  void store_row(Sequence& s, int64_t layer, int stream, int64_t p, const RowRef& x) {
    const StreamLayout& st = layouts_.stream[stream];
    const int64_t B = config_.block_size, W = st.width;
    const int64_t old_start = st.window_start(p), new_start = st.window_start(p + 1);
    const int64_t ring = window_rows(s, layer, stream);
    const auto row_at = [&](int64_t t) { return t == p ? x : RowRef::of_ring(ring + t % st.window * W); };
    if (st.spec.per_channel_integer()) {
      // Tile old_start / B ages out whole; a forgotten tile's rows are never stored.
      if (new_start > old_start && old_start / B >= s.dropped) {
        const int64_t k = old_start / B;
        tile_rows_.clear();
        for (int64_t r = 0; r < B; ++r) tile_rows_.push_back(row_at(k * B + r));
        make_tile_writable(s, k);
        bytes_->store_tile(st.spec, stream, tile_rows_.data(), B, tile(s, k, layer, stream));
      }
    } else {
      for (int64_t t = std::max(old_start, s.dropped * B); t < new_start; ++t) {
        make_tile_writable(s, t / B);
        const RowRef row = row_at(t);
        bytes_->store_tile(st.spec, stream, &row, 1, tile(s, t / B, layer, stream) + t % B * st.row_bytes);
      }
    }
    if (p >= new_start) bytes_->store_ring(x, W, ring + p % st.window * W);
  }

  // Calls fn(t, row) for positions t in [begin, end) in increasing order with layer `layer`'s
  // fp32 row of `stream` (width floats), for a layer holding n positions.
  template <typename Fn>
  void walk_rows(const Sequence& s, int64_t layer, int stream, int64_t begin, int64_t end, int64_t n, Fn&& fn) {
    const StreamLayout& st = layouts_.stream[stream];
    const int64_t B = config_.block_size, W = st.width;
    const int64_t stored_end = std::min(end, st.window_start(n));
    int64_t t = begin;
    while (t < stored_end) {
      const int64_t k = t / B, r0 = t % B, r1 = std::min(B, stored_end - k * B);
      const uint8_t* tp = bytes_->pool_view(tile(s, k, layer, stream), st.tile_bytes);
      if (st.spec.format == KV_FP32 && float_aligned(tp)) {
        for (int64_t r = r0; r < r1; ++r) fn(t++, reinterpret_cast<const float*>(tp + r * st.row_bytes));
      } else {
        kv_dequantize_tile(st.spec, tp, B, r0, r1, rows_scratch_.data());
        for (int64_t r = r0; r < r1; ++r) fn(t++, rows_scratch_.data() + (r - r0) * W);
      }
    }
    if (t == end) return;
    const float* ring = bytes_->ring_view(window_rows(s, layer, stream), st.window * W);
    for (; t < end; ++t) fn(t, ring + t % st.window * W);
  }

  std::vector<RowRef> tile_rows_;    // (B): a per-channel tile's rows being quantized
  KvAttendPlan plan_;                // attend_rows'
  std::vector<float> rows_scratch_;  // (B, max(k_width, v_width)): dequantized rows
  std::vector<float> scores_;        // (n_head, positions)
  std::vector<float> sums_;          // [n_head] softmax denominators
};

}  // namespace loom::kv
