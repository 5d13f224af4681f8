// The CUDA backend's decode attention over a KV cache in device memory (Backend::kv_attention;
// backend/kv_attention.h states the plan and the formula):
//   1. check_kv_attention, the check every backend runs (one-line errors naming kv_attention);
//   2. the plan as the kernels read it: each row's splits (cuda::kv_decode_split picks S, the
//      positions per split, from the rows' lengths), packed with the rows and the tile offsets into
//      one table in page-locked host memory (PinnedStaging, reused across calls);
//   3. one asynchronous host -> device copy of the table to the front of the backend's workspace
//      (the split kernel's partials follow it there), then the split kernel and, for rows of
//      several splits, the merge kernel (cuda_decode.cu), all on the backend's stream.
// Nothing here waits for the device, except that filling the staging buffer first waits for the
// previous call's copy out of it (an event), which is long done in steady state.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_decode.h"
#include "loom/backend/cuda/cuda_sample.h"
#include "loom/backend/kv_attention.h"

namespace loom::cuda_backend_detail {

bool decode_ops_complete() { return true; }

// ---- PinnedStaging (cuda_backend_internal.h)

PinnedStaging::~PinnedStaging() {
  if (copied_ != nullptr) {
    (void)cudaEventSynchronize(copied_);
    (void)cudaEventDestroy(copied_);
  }
  if (arena_done_ != nullptr) {
    if (arena_pending_) (void)cudaEventSynchronize(arena_done_);
    (void)cudaEventDestroy(arena_done_);
  }
  if (host_ != nullptr) (void)cudaFreeHost(host_);
  for (auto& [chunk, bytes] : chunks_) (void)cudaFreeHost(chunk);
}

void PinnedStaging::begin_graph() {
  if (arena_done_ == nullptr) LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&arena_done_, cudaEventDisableTiming));
  if (arena_pending_) LOOM_CUDA_CHECK(cudaEventSynchronize(arena_done_));  // the last graph has read its regions
  arena_pending_ = false;
  graph_ = true;
  chunk_ = used_ = 0;
}

void PinnedStaging::end_graph() { graph_ = false; }

void PinnedStaging::graph_launched(cudaStream_t stream) {
  if (arena_done_ == nullptr) return;
  LOOM_CUDA_CHECK(cudaEventRecord(arena_done_, stream));
  arena_pending_ = true;
}

void* PinnedStaging::acquire(size_t bytes) {
  if (graph_) {  // a new region of the arena (cudaMallocHost is allowed in a relaxed capture)
    const size_t need = (bytes + 255) / 256 * 256;
    while (chunk_ < chunks_.size() && used_ + need > chunks_[chunk_].second) ++chunk_, used_ = 0;
    if (chunk_ == chunks_.size()) {
      const size_t grown = std::max({need, size_t{64} << 10, chunks_.empty() ? size_t{0} : 2 * chunks_.back().second});
      void* chunk = nullptr;
      LOOM_CUDA_CHECK(cudaMallocHost(&chunk, grown));
      chunks_.emplace_back(static_cast<char*>(chunk), grown);
      used_ = 0;
    }
    region_ = chunks_[chunk_].first + used_;
    used_ += need;
    return region_;
  }
  if (copied_ == nullptr) {
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
  } else {
    LOOM_CUDA_CHECK(cudaEventSynchronize(copied_));  // the previous copy has read the buffer
  }
  if (bytes > capacity_) {
    const size_t grown = std::max({bytes, 2 * capacity_, size_t{4096}});
    if (host_ != nullptr) LOOM_CUDA_CHECK(cudaFreeHost(host_));
    host_ = nullptr;
    capacity_ = 0;
    LOOM_CUDA_CHECK(cudaMallocHost(&host_, grown));
    capacity_ = grown;
  }
  return host_;
}

void PinnedStaging::upload(void* device, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  if (graph_) {  // the graph copies from the region at each launch; no event in a capture
    LOOM_CUDA_CHECK(cudaMemcpyAsync(device, region_, bytes, cudaMemcpyHostToDevice, stream));
    return;
  }
  LOOM_CUDA_CHECK(cudaMemcpyAsync(device, host_, bytes, cudaMemcpyHostToDevice, stream));
  LOOM_CUDA_CHECK(cudaEventRecord(copied_, stream));
}

namespace {

cuda::KvStreamLayout stream_layout(const KvAttendPlan& plan, int s) {
  const KvQuantSpec& spec = plan.spec[s];
  cuda::KvStreamLayout f;
  f.kind = spec.format == KV_FP32 ? cuda::KV_KIND_F32 : spec.format == KV_BF16 ? cuda::KV_KIND_BF16 : cuda::KV_KIND_INT;
  f.bits = kv_format_bits(spec.format);
  f.per_channel = spec.per_channel_integer() ? 1 : 0;
  f.group = spec.group_size();
  f.groups = spec.width / spec.group_size();
  f.row_bytes = kv_row_bytes(spec);
  f.param_bytes = kv_tile_param_bytes(spec);
  f.window = plan.window[s];
  return f;
}

}  // namespace

void CudaBackend::kv_attention(const KvAttendPlan& plan, const Tensor& q, const Tensor& pool, const Tensor& rings,
                               const Tensor& out) {
  const char* op = "kv_attention";
  check_kv_attention(plan, q, pool, rings, out);
  const int64_t rows = static_cast<int64_t>(plan.rows.size());
  LOOM_CHECK(plan.head_dim <= cuda::kKvMaxHeadDim, op, ": head_dim ", plan.head_dim, " exceeds the CUDA kernel's ",
             cuda::kKvMaxHeadDim);
  if (rows == 0) return;

  cuda::KvDecodeShape s;
  s.rows = rows;
  s.n_head = plan.n_head, s.n_kv_head = plan.n_kv_head, s.head_dim = plan.head_dim;
  s.width = plan.n_kv_head * plan.head_dim;
  s.block = plan.block;
  s.entries = static_cast<int64_t>(plan.tile_offsets.size());
  s.scale = 1.0f / std::sqrt(static_cast<float>(plan.head_dim));  // as attend_rows
  s.sinks = plan.sinks.defined() ? 1 : 0;
  for (int st = 0; st < 2; ++st) s.stream[st] = stream_layout(plan, st);
  const int64_t per_split = cuda::kv_decode_blocks_per_split(s.n_head, s.n_kv_head, s.head_dim);
  LOOM_CHECK(per_split <= 65535 && s.n_head <= 65535, op, ": ", s.n_head, " query heads over ", s.n_kv_head,
             " kv heads exceed the CUDA grid");
  std::vector<int64_t> lengths(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) lengths[static_cast<size_t>(i)] = plan.rows[static_cast<size_t>(i)].n - plan.rows[static_cast<size_t>(i)].first;
  s.split = cuda::kv_decode_split(lengths.data(), rows, per_split);
  for (int64_t len : lengths) {
    const int64_t splits = (len + s.split - 1) / s.split;
    s.items += splits;
    if (splits > 1) ++s.merge_rows;
  }
  LOOM_CHECK(s.items <= INT_MAX && rows <= INT_MAX, op, ": ", rows, " rows in ", s.items,
             " splits exceed the CUDA grid");
  int64_t last = 0;  // the kernels index positions, tiles and ring rows in 32 bits
  for (const KvAttendRow& r : plan.rows) last = std::max(last, r.n);
  LOOM_CHECK(last <= INT_MAX && plan.block <= INT_MAX && plan.window[0] <= INT_MAX && plan.window[1] <= INT_MAX, op,
             ": positions up to ", last, " in tiles of ", plan.block, " exceed the CUDA kernel's 32-bit positions");

  // The table, packed in pinned memory at the layout's offsets.
  const cuda::KvDecodeLayout at = cuda::kv_decode_layout(s);
  char* host = static_cast<char*>(kv_staging_.acquire(at.table_bytes));
  auto* table_rows = reinterpret_cast<cuda::KvDecodeRow*>(host + at.rows_at);
  auto* item_row = reinterpret_cast<int32_t*>(host + at.items_at);
  auto* merge_row = reinterpret_cast<int32_t*>(host + at.merges_at);
  // The sink logits stay on the device: copied into the table's slot after the upload (below).
  if (s.sinks) std::memset(host + at.sinks_at, 0, static_cast<size_t>(plan.n_head) * sizeof(float));
  if (s.entries > 0) {
    std::memcpy(host + at.offsets_at, plan.tile_offsets.data(), static_cast<size_t>(s.entries) * sizeof(int64_t));
  }
  int64_t item = 0, merges = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const KvAttendRow& r = plan.rows[static_cast<size_t>(i)];
    cuda::KvDecodeRow d;
    d.first = r.first, d.n = r.n, d.tiles = r.tiles;
    for (int st = 0; st < 2; ++st) d.stored[st] = r.stored[st], d.ring[st] = r.ring[st];
    d.item0 = item;
    d.splits = (lengths[static_cast<size_t>(i)] + s.split - 1) / s.split;
    std::memcpy(static_cast<void*>(table_rows + i), &d, sizeof d);
    for (int64_t k = 0; k < d.splits; ++k) item_row[item++] = static_cast<int32_t>(i);
    if (d.splits > 1) merge_row[merges++] = static_cast<int32_t>(i);
  }

  void* ws = workspace(at.bytes);
  kv_staging_.upload(ws, at.table_bytes, stream());
  if (s.sinks) {  // device to device, in stream order: no host synchronisation for GPT-OSS's sinks
    LOOM_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(ws) + at.sinks_at, plan.sinks.device_ptr(),
                                    static_cast<size_t>(plan.n_head) * sizeof(float), cudaMemcpyDeviceToDevice,
                                    stream()));
  }
  cuda::kv_attention_decode(s, ws, dptr<float>(q), dptr<uint8_t>(pool), dptr_or_null<float>(rings),
                            dptr<float>(out), stream());
}

}  // namespace loom::cuda_backend_detail

// ---- kv_store (backend/kv_store.h): check_kv_store, the plan packed into one table in pinned
// memory (its own staging buffer, so a step's kv_store and kv_attention never wait on each
// other's copy), one host -> device copy to the workspace, the tile and ring kernels.
namespace loom::cuda_backend_detail {

void CudaBackend::argmax_rows(const Tensor& x, const Tensor& out) {
  check_argmax_rows(x, out);
  LOOM_CHECK(x.dim(0) <= INT_MAX && x.dim(1) <= INT_MAX, "argmax_rows: ", x.describe(), " exceeds the CUDA grid");
  if (x.dim(0) == 0) return;
  cuda::argmax_rows(dptr<float>(x), x.dim(0), x.dim(1), dptr<int32_t>(out), stream());
}

// The rows' settings and the penalties go to the workspace through their own pinned staging
// buffer, then the penalties, the keys, two sorts and the draw (cuda_sample.cu): the logits never
// leave the device.
void CudaBackend::sample_rows(const Tensor& logits, const std::vector<RowSampling>& rows,
                              const std::vector<SamplePenalty>& penalties, const Tensor& out) {
  check_sample_rows(logits, rows, penalties, out);
  const int64_t n = logits.dim(0), V = logits.dim(1);
  if (n == 0) return;
  LOOM_CHECK(n * V <= INT_MAX, "sample_rows: ", logits.describe(), " exceeds the sort's 2^31 elements");
  const cuda::SampleLayout at = cuda::sample_layout(n, V, static_cast<int64_t>(penalties.size()));
  const size_t table = at.max_at - at.rows_at;  // the settings and the penalties, as they are laid out there
  char* host = static_cast<char*>(sample_staging_.acquire(table));
  std::memcpy(host, rows.data(), rows.size() * sizeof(RowSampling));
  if (!penalties.empty()) {
    std::memcpy(host + (at.penalties_at - at.rows_at), penalties.data(), penalties.size() * sizeof(SamplePenalty));
  }
  void* ws = workspace(at.bytes);
  sample_staging_.upload(static_cast<char*>(ws) + at.rows_at, table, stream());
  cuda::sample_rows(ws, at, dptr<float>(logits), n, V, static_cast<int64_t>(penalties.size()), dptr<int32_t>(out), stream());
}

void CudaBackend::kv_store(const KvStorePlan& plan, const std::vector<Tensor>& sources, const Tensor& pool,
                           const Tensor& rings, const Tensor& status) {
  check_kv_store(plan, sources, pool, rings, status);
  if (plan.empty()) return;
  LOOM_CHECK(plan.tiles.size() <= INT_MAX && plan.rings.size() <= INT_MAX, "kv_store: ", plan.tiles.size(),
             " tile jobs and ", plan.rings.size(), " ring jobs exceed the CUDA grid");
  cuda::KvStoreShape s;
  s.tiles = static_cast<int64_t>(plan.tiles.size());
  s.rows = static_cast<int64_t>(plan.rows.size());
  s.rings = static_cast<int64_t>(plan.rings.size());
  s.sources = static_cast<int64_t>(sources.size());
  for (int st = 0; st < 2; ++st) {
    if (plan.spec[st].width > 0) s.format[st] = kv_store_format(plan.spec[st]);
  }
  const cuda::KvStoreLayout at = cuda::kv_store_layout(s);
  char* host = static_cast<char*>(kv_store_staging_.acquire(at.bytes));
  const auto source_of = [](const KvStoreRow& r) {
    return cuda::KvStoreSource{r.source == KvStoreRow::kFromRings ? -1 : r.source, r.offset};
  };
  for (size_t j = 0; j < plan.tiles.size(); ++j) {
    const KvTileJob& job = plan.tiles[j];
    const cuda::KvStoreTile t{job.stream, job.dst, job.rows, job.first};
    std::memcpy(host + at.tiles_at + j * sizeof t, &t, sizeof t);
  }
  for (size_t j = 0; j < plan.rows.size(); ++j) {
    const cuda::KvStoreSource r = source_of(plan.rows[j]);
    std::memcpy(host + at.rows_at + j * sizeof r, &r, sizeof r);
  }
  for (size_t j = 0; j < plan.rings.size(); ++j) {
    const KvRingJob& job = plan.rings[j];
    const cuda::KvStoreRing r{source_of(job.row), job.dst, job.width};
    std::memcpy(host + at.rings_at + j * sizeof r, &r, sizeof r);
  }
  for (size_t j = 0; j < sources.size(); ++j) {
    const float* p = dptr<float>(sources[j]);
    std::memcpy(host + at.sources_at + j * sizeof p, &p, sizeof p);
  }
  void* ws = workspace(at.bytes);
  kv_store_staging_.upload(ws, at.bytes, stream());
  cuda::kv_store_rows(s, ws, dptr<uint8_t>(pool), dptr_or_null<float>(rings),
                      dptr<int32_t>(status), stream());
}

}  // namespace loom::cuda_backend_detail
