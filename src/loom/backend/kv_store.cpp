#include "loom/backend/kv_store.h"

#include <cstring>

#include "loom/core/error.h"

namespace loom {

namespace {

constexpr const char* kStream[2] = {"K", "V"};

// Bytes job j writes: `rows` slots of a per-token or fp32 / bf16 stream, or a whole tile.
int64_t job_bytes(const KvStorePlan& plan, const KvTileJob& job) {
  return kv_tile_bytes(plan.spec[job.stream], job.rows);
}

}  // namespace

kvq::KvStoreFormat kv_store_format(const KvQuantSpec& spec) {
  kvq::KvStoreFormat f;
  f.kind = spec.format == KV_FP32 ? 0 : spec.format == KV_BF16 ? 1 : 2;
  f.bits = kv_format_bits(spec.format);
  f.per_channel = spec.per_channel_integer() ? 1 : 0;
  f.width = spec.width;
  f.group = spec.group_size();
  f.row_bytes = kv_row_bytes(spec);
  f.code_bytes = kv_code_bytes(spec);
  f.param_bytes = kv_tile_param_bytes(spec);
  return f;
}

void check_kv_store(const KvStorePlan& plan, const std::vector<Tensor>& sources, const Tensor& pool,
                    const Tensor& rings, const Tensor& status) {
  LOOM_CHECK(pool.dtype() == DTYPE_U8, "kv_store: the pool must be u8 bytes, got ", dtype_name(pool.dtype()));
  LOOM_CHECK(!rings.defined() || rings.dtype() == DTYPE_F32, "kv_store: the rings must be f32, got ",
             dtype_name(rings.dtype()));
  LOOM_CHECK(status.defined() && status.dtype() == DTYPE_I32 && status.numel() >= 1,
             "kv_store: status must be an i32 tensor of at least one element");
  for (size_t i = 0; i < sources.size(); ++i) {
    LOOM_CHECK(sources[i].dtype() == DTYPE_F32, "kv_store: source ", i, " must be f32, got ",
               dtype_name(sources[i].dtype()));
  }
  const int64_t pool_bytes = pool.numel(), ring_floats = rings.defined() ? rings.numel() : 0;
  const auto check_row = [&](const KvStoreRow& r, int64_t width, const char* what, size_t j) {
    int64_t floats = ring_floats;
    if (r.source != KvStoreRow::kFromRings) {
      LOOM_CHECK(r.source >= 0 && r.source < static_cast<int32_t>(sources.size()), "kv_store: ", what, " job ", j,
                 " reads source ", r.source, " of ", sources.size());
      floats = sources[static_cast<size_t>(r.source)].numel();
    }
    LOOM_CHECK(r.offset >= 0 && r.offset + width <= floats, "kv_store: ", what, " job ", j, " reads ", width,
               " floats at ", r.offset, " of ", floats, r.source == KvStoreRow::kFromRings ? " (rings)" : "");
  };
  for (int s = 0; s < 2; ++s) {
    if (plan.spec[s].width > 0) plan.spec[s].validate();
  }
  const int64_t rows = static_cast<int64_t>(plan.rows.size());
  for (size_t j = 0; j < plan.tiles.size(); ++j) {
    const KvTileJob& job = plan.tiles[j];
    LOOM_CHECK(job.stream == 0 || job.stream == 1, "kv_store: tile job ", j, " names stream ", job.stream);
    const KvQuantSpec& spec = plan.spec[job.stream];
    LOOM_CHECK(spec.width > 0, "kv_store: tile job ", j, " stores ", kStream[job.stream], " rows of no width");
    LOOM_CHECK(job.rows >= 1 && job.first >= 0 && job.first + job.rows <= rows, "kv_store: tile job ", j,
               "'s rows [", job.first, ", ", job.first + job.rows, ") fall outside the plan's ", rows);
    LOOM_CHECK(job.dst >= 0 && job.dst + job_bytes(plan, job) <= pool_bytes, "kv_store: tile job ", j, " writes ",
               job_bytes(plan, job), " bytes at ", job.dst, " of a pool of ", pool_bytes);
    for (int64_t r = 0; r < job.rows; ++r) check_row(plan.rows[static_cast<size_t>(job.first + r)], spec.width, "tile", j);
  }
  for (size_t j = 0; j < plan.rings.size(); ++j) {
    const KvRingJob& job = plan.rings[j];
    LOOM_CHECK(job.row.source != KvStoreRow::kFromRings, "kv_store: ring job ", j,
               " reads the rings (ring rows come from the sources)");
    LOOM_CHECK(job.width > 0 && job.dst >= 0 && job.dst + job.width <= ring_floats, "kv_store: ring job ", j,
               " writes ", job.width, " floats at ", job.dst, " of rings of ", ring_floats);
    check_row(job.row, job.width, "ring", j);
  }
}

void check_argmax_rows(const Tensor& x, const Tensor& out) {
  LOOM_CHECK(x.dtype() == DTYPE_F32 && x.ndim() == 2 && x.dim(1) >= 1, "argmax_rows: x must be f32 (rows, V >= 1), got ",
             x.describe());
  LOOM_CHECK(out.dtype() == DTYPE_I32 && out.numel() == x.dim(0), "argmax_rows: out must be i32 of ", x.dim(0),
             " elements, got ", out.describe());
}

void kv_store_host(const KvStorePlan& plan, const std::vector<const float*>& sources, uint8_t* pool, float* rings,
                   int32_t* status) {
  const kvq::KvStoreFormat formats[2] = {kv_store_format(plan.spec[0]), kv_store_format(plan.spec[1])};
  const auto at = [&](const KvStoreRow& r) {
    return (r.source == KvStoreRow::kFromRings ? rings : sources[static_cast<size_t>(r.source)]) + r.offset;
  };
  int32_t failed = kvq::KV_FIT_OK;
  for (const KvTileJob& job : plan.tiles) {
    const auto row = [&](int64_t t) { return at(plan.rows[static_cast<size_t>(job.first + t)]); };
    const int32_t s = kvq::store_rows(formats[job.stream], row, job.rows, pool + job.dst, 0, 1);
    if (failed == kvq::KV_FIT_OK) failed = s;
  }
  for (const KvRingJob& job : plan.rings) {
    std::memcpy(rings + job.dst, at(job.row), static_cast<size_t>(job.width) * sizeof(float));
  }
  if (failed != kvq::KV_FIT_OK) *status = failed;
}

}  // namespace loom
