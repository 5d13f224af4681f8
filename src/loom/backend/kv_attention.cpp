#include "loom/backend/kv_attention.h"

#include <algorithm>
#include <vector>

#include "loom/backend/attend_rows.h"
#include "loom/core/error.h"

namespace loom {

namespace {

constexpr const char* kStream[2] = {"K", "V"};

// The number of tiles row r's table holds: those of its stored positions.
int64_t row_tiles(const KvAttendPlan& plan, const KvAttendRow& row) {
  return (std::max(row.stored[0], row.stored[1]) + plan.block - 1) / plan.block;
}

}  // namespace

int64_t KvAttendPlan::max_positions() const {
  int64_t most = 0;
  for (const KvAttendRow& r : rows) most = std::max(most, r.n - r.first);
  return most;
}

void check_kv_attention(const KvAttendPlan& plan, const Tensor& q, const Tensor& pool, const Tensor& rings,
                        const Tensor& out) {
  LOOM_CHECK(q.dtype() == DTYPE_F32 && out.dtype() == DTYPE_F32 && q.ndim() == 2 && out.ndim() == 2,
             "kv_attention: q and out must be 2-D f32 (rows, n_head x head_dim)");
  LOOM_CHECK(pool.dtype() == DTYPE_U8, "kv_attention: the pool must be u8 bytes, got ", dtype_name(pool.dtype()));
  LOOM_CHECK(!rings.defined() || rings.dtype() == DTYPE_F32, "kv_attention: the rings must be f32, got ",
             dtype_name(rings.dtype()));
  const int64_t pool_bytes = pool.numel(), ring_floats = rings.defined() ? rings.numel() : 0;
  const int64_t q_rows = q.dim(0), q_width = q.dim(1), out_rows = out.dim(0), out_width = out.dim(1);
  const int64_t H = plan.n_head, G = plan.n_kv_head, hd = plan.head_dim;
  LOOM_CHECK(H > 0 && G > 0 && hd > 0 && H % G == 0, "kv_attention: ", H, " query heads over ", G, " kv heads of ", hd,
             " (expected positive sizes, query heads a multiple of kv heads)");
  LOOM_CHECK(plan.block > 0, "kv_attention: block must be > 0, got ", plan.block);
  LOOM_CHECK(!plan.sinks.defined() || (plan.sinks.dtype() == DTYPE_F32 && plan.sinks.numel() == H),
             "kv_attention: ", plan.sinks.defined() ? plan.sinks.numel() : 0, " sink logits (",
             plan.sinks.defined() ? dtype_name(plan.sinks.dtype()) : "none", ") for ", H,
             " query heads (expected one f32 per head, or none)");
  for (int s = 0; s < 2; ++s) {
    plan.spec[s].validate();
    LOOM_CHECK(plan.spec[s].width == G * hd, "kv_attention: ", kStream[s], " rows of ", plan.spec[s].width,
               " channels, expected n_kv_head x head_dim = ", G * hd);
    LOOM_CHECK(plan.window[s] >= 0, "kv_attention: ", kStream[s], " window must be >= 0, got ", plan.window[s]);
  }
  const int64_t rows = static_cast<int64_t>(plan.rows.size());
  LOOM_CHECK(q_rows == rows && out_rows == rows && q_width == H * hd && out_width == H * hd, "kv_attention: q (", q_rows,
             ", ", q_width, ") and out (", out_rows, ", ", out_width, ") must be (", rows, ", ", H * hd, ")");
  const int64_t entries = static_cast<int64_t>(plan.tile_offsets.size());
  for (int64_t i = 0; i < rows; ++i) {
    const KvAttendRow& r = plan.rows[static_cast<size_t>(i)];
    LOOM_CHECK(0 <= r.first && r.first < r.n, "kv_attention: row ", i, " attends to positions [", r.first, ", ", r.n,
               "), expected a non-empty range from 0");
    const int64_t tiles = row_tiles(plan, r);
    LOOM_CHECK(r.tiles >= 0 && r.tiles + 2 * tiles <= entries, "kv_attention: row ", i, "'s ", tiles,
               " tiles from entry ", r.tiles, " fall outside the table of ", entries, " offsets");
    for (int s = 0; s < 2; ++s) {
      LOOM_CHECK(0 <= r.stored[s] && r.stored[s] <= r.n, "kv_attention: row ", i, " stores ", r.stored[s], " ",
                 kStream[s], " positions of ", r.n);
      for (int64_t k = r.first / plan.block; k * plan.block < r.stored[s]; ++k) {
        const int64_t off = plan.tile_offsets[static_cast<size_t>(r.tiles + 2 * k + s)];
        LOOM_CHECK(off >= 0 && off + plan.tile_bytes(s) <= pool_bytes, "kv_attention: row ", i, "'s ", kStream[s],
                   " tile ", k, " at byte ", off, " is not inside the pool of ", pool_bytes, " bytes");
      }
      const int64_t in_ring = r.n - std::max(r.first, r.stored[s]);
      if (in_ring <= 0) continue;
      LOOM_CHECK(in_ring <= plan.window[s] && r.ring[s] >= 0 &&
                     r.ring[s] + plan.window[s] * plan.spec[s].width <= ring_floats,
                 "kv_attention: row ", i, " reads ", in_ring, " ", kStream[s], " positions from a ring of ",
                 plan.window[s], " rows at float ", r.ring[s], " of ", ring_floats);
    }
  }
}

void kv_attention_host(const KvAttendPlan& plan, const float* q, const uint8_t* pool, const float* rings,
                       const float* sinks, float* out) {
  const int64_t H = plan.n_head, hd = plan.head_dim, B = plan.block;
  std::vector<float> scores, sums, scratch(static_cast<size_t>(B * plan.spec[0].width));
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    const KvAttendRow& r = plan.rows[i];
    // Positions t in [first, n) in increasing order, each row dequantized tile by tile as the
    // host cache walks them (kv_cache.h), then the ring's fp32 rows.
    const auto walk = [&](int s) {
      return [&, s](auto&& fn) {
        const KvQuantSpec& spec = plan.spec[s];
        const int64_t W = spec.width, stored_end = std::min(r.n, r.stored[s]);
        int64_t t = r.first;
        while (t < stored_end) {
          const int64_t k = t / B, r0 = t % B, r1 = std::min(B, stored_end - k * B);
          const uint8_t* tile = pool + plan.tile_offsets[static_cast<size_t>(r.tiles + 2 * k + s)];
          kv_dequantize_tile(spec, tile, B, r0, r1, scratch.data());
          for (int64_t j = r0; j < r1; ++j) fn(t++, scratch.data() + (j - r0) * W);
        }
        for (; t < r.n; ++t) fn(t, rings + r.ring[s] + t % plan.window[s] * W);
      };
    };
    const int64_t row = static_cast<int64_t>(i) * H * hd;
    attend_rows(q + row, out + row, H, plan.n_kv_head, hd, r.first, r.n, walk(0), walk(1), scores, sums, sinks);
  }
}

}  // namespace loom
