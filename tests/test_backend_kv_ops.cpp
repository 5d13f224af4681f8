// Backend::kv_attention (backend/kv_attention.h), the decode attention over a KV cache in the
// backend's memory, in every storage format of backend/kv_format.h:
// - on the CPU, against a double reference computed from the same dequantized rows (the stored
//   tiles read back with kv_dequantize_tile, the ring's fp32 rows as written), within 1e-5 of the
//   largest output (f32 sums over at most a few hundred positions);
// - on every other backend ("strict": the CPU kernels on memory host code may not read; "cuda":
//   the split-KV kernel, skipped unless the build has a CUDA backend stating kv_cache), against
//   the CPU backend within the f32 attention tolerance of the op tests (1e-5 of the largest
//   output: another summation order), and deterministic (a second run gives the same bytes);
// - a plan whose tile, ring or shapes fall outside the tensors is refused naming kv_attention.
// Each case is a batch of query rows as a paged cache hands them to the op: tiles in a shuffled
// pool (block tables), sequences of different lengths (1 to 300 positions), sliding windows
// (first > 0, the forgotten tiles' entries -1), the newest positions in the fp32 ring
// (residual), GQA (4 query heads per kv head) and MQA, and attention sinks (GPT-OSS: a logit per
// query head in the normalizer) on rows of one split and of several.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/philox.h"
#include "loom/infer/kv_quant.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

constexpr double kRefTol = 1e-5;  // f32 against the double reference, relative to max |ref|
constexpr double kCpuTol = 1e-5;  // against the CPU backend (the op tests' f32 attention bound)

struct Format {
  const char* name;
  KvFormat k, v;
  KvAxis k_axis = KV_PER_TOKEN;
  int64_t group = 0;     // per-token integer: channels per (scale, min)
  int64_t residual = 0;  // the newest positions in the fp32 ring
};

// Every format and axis the caches store (kv_cache.h's presets and more).
const Format kFormats[] = {
    {"fp32", KV_FP32, KV_FP32},
    {"bf16", KV_BF16, KV_BF16},
    {"bf16 residual 5", KV_BF16, KV_BF16, KV_PER_TOKEN, 0, 5},
    {"int8 per token", KV_INT8, KV_INT8},
    {"int4 per token group 8", KV_INT4, KV_INT4, KV_PER_TOKEN, 8},
    {"int2 per token group 4", KV_INT2, KV_INT2, KV_PER_TOKEN, 4},
    {"kivi4 (keys per channel, residual 32)", KV_INT4, KV_INT4, KV_PER_CHANNEL, 0, 32},
    {"kivi2 (keys per channel, residual 3)", KV_INT2, KV_INT2, KV_PER_CHANNEL, 0, 3},
    {"int8 keys per channel, fp32 values", KV_INT8, KV_FP32, KV_PER_CHANNEL, 0, 0},
};

struct Heads {
  int64_t n_head, n_kv_head, head_dim;
};

// One batch of query rows over sequences stored in a shuffled pool, with its inputs on the host.
struct Case {
  KvAttendPlan plan;
  std::vector<uint8_t> pool;
  std::vector<float> rings, q;
  int64_t extra_q_rows = 0;  // q gets this many rows beyond the plan's (a refusal case)
  std::vector<float> sinks;  // the plan's sink logits, written to a backend tensor by run() (empty: none)
  std::vector<std::vector<std::vector<float>>> values[2];  // [stream][row][position] the row as the op reads it
};

std::vector<float> normal(int64_t n, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  philox_fill_normal(v.data(), n, seed, 0, 0, 0.0f, 1.0f);
  return v;
}

// Rows with lengths[i] visible positions each, attention window `window` (0: all).
Case make_case(const Format& f, const Heads& h, int64_t block, const std::vector<int64_t>& lengths, int64_t window,
               uint64_t seed) {
  Case c;
  KvAttendPlan& p = c.plan;
  const int64_t W = h.n_kv_head * h.head_dim;
  p.spec[0] = {f.k, f.k_axis, W, f.k_axis == KV_PER_TOKEN ? f.group : 0};
  p.spec[1] = {f.v, KV_PER_TOKEN, W, f.group};
  p.block = block;
  p.n_head = h.n_head, p.n_kv_head = h.n_kv_head, p.head_dim = h.head_dim;
  for (int s = 0; s < 2; ++s) {  // the ring's rows, as kv_cache.h's schedule
    const KvQuantSpec& spec = p.spec[s];
    p.window[s] = spec.format == KV_FP32 ? 0 : spec.per_channel_integer() ? f.residual + block - 1 : f.residual;
  }
  const int64_t tile_bytes = p.tile_bytes(0) + p.tile_bytes(1);
  int64_t tiles_total = 0;
  for (int64_t n : lengths) tiles_total += (n + block - 1) / block;
  // The pool's blocks in a shuffled order: tile j of the batch lives in block order[j].
  std::vector<int64_t> order(static_cast<size_t>(tiles_total));
  std::iota(order.begin(), order.end(), 0);
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[(seed * 7919 + i * 104729) % i]);
  c.pool.assign(static_cast<size_t>(tiles_total * tile_bytes), 0xA5);  // unwritten rows hold garbage
  int64_t next_tile = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t n = lengths[i], tiles = (n + block - 1) / block;
    KvAttendRow row;
    row.n = n;
    row.first = window > 0 ? std::max<int64_t>(0, n - window) : 0;
    row.tiles = static_cast<int64_t>(p.tile_offsets.size());
    for (int64_t k = 0; k < tiles; ++k) {
      const int64_t base = order[static_cast<size_t>(next_tile++)] * tile_bytes;
      const bool forgotten = (k + 1) * block <= row.first;
      p.tile_offsets.push_back(forgotten ? -1 : base);
      p.tile_offsets.push_back(forgotten ? -1 : base + p.tile_bytes(0));
    }
    for (int s = 0; s < 2; ++s) {
      const KvQuantSpec& spec = p.spec[s];
      const int64_t aged = std::max<int64_t>(0, n - f.residual);
      row.stored[s] = spec.format == KV_FP32 ? n : spec.per_channel_integer() ? aged / block * block : aged;
      const std::vector<float> x = normal(n * W, seed * 31 + i * 2 + static_cast<uint64_t>(s));
      std::vector<std::vector<float>>& seen = c.values[s].emplace_back(static_cast<size_t>(n));
      std::vector<float> rows(static_cast<size_t>(block * W));
      for (int64_t k = 0; k * block < row.stored[s]; ++k) {  // stored rows, quantized into their tile
        const int64_t offset = p.tile_offsets[static_cast<size_t>(row.tiles + 2 * k + s)];
        if (offset < 0) continue;
        uint8_t* tile = c.pool.data() + offset;
        const int64_t r1 = std::min(block, row.stored[s] - k * block);
        if (spec.per_channel_integer()) {
          kv_quantize_tile(spec, x.data() + k * block * W, block, tile);
        } else {
          for (int64_t r = 0; r < r1; ++r) {
            kv_quantize_tile(spec, x.data() + (k * block + r) * W, 1, tile + r * kv_row_bytes(spec));
          }
        }
        kv_dequantize_tile(spec, tile, block, 0, r1, rows.data());
        for (int64_t r = 0; r < r1; ++r) seen[static_cast<size_t>(k * block + r)].assign(rows.data() + r * W, rows.data() + (r + 1) * W);
      }
      if (row.stored[s] < n) {  // the newest positions in the fp32 ring, position t at row t % window
        row.ring[s] = static_cast<int64_t>(c.rings.size());
        c.rings.resize(c.rings.size() + static_cast<size_t>(p.window[s] * W), std::nanf(""));
        for (int64_t t = row.stored[s]; t < n; ++t) {
          std::copy(x.data() + t * W, x.data() + (t + 1) * W, c.rings.data() + row.ring[s] + t % p.window[s] * W);
          seen[static_cast<size_t>(t)].assign(x.data() + t * W, x.data() + (t + 1) * W);
        }
      }
    }
    p.rows.push_back(row);
  }
  c.q = normal(static_cast<int64_t>(lengths.size()) * h.n_head * h.head_dim, seed * 17 + 5);
  return c;
}

// The formula of kv_attention.h in double over the rows the op reads.
std::vector<double> reference(const Case& c) {
  const KvAttendPlan& p = c.plan;
  const int64_t H = p.n_head, hd = p.head_dim, per = p.n_head / p.n_kv_head;
  std::vector<double> out;
  for (size_t i = 0; i < p.rows.size(); ++i) {
    const KvAttendRow& r = p.rows[i];
    for (int64_t hh = 0; hh < H; ++hh) {
      const float* q = c.q.data() + (static_cast<int64_t>(i) * H + hh) * hd;
      const int64_t g = hh / per;
      std::vector<double> s;
      for (int64_t t = r.first; t < r.n; ++t) {
        const std::vector<float>& k = c.values[0][i][static_cast<size_t>(t)];
        double dot = 0;
        for (int64_t d = 0; d < hd; ++d) dot += static_cast<double>(q[d]) * k[static_cast<size_t>(g * hd + d)];
        s.push_back(dot / std::sqrt(static_cast<double>(hd)));
      }
      const double sink = c.sinks.empty() ? -INFINITY : c.sinks[static_cast<size_t>(hh)];
      const double m = std::max(*std::max_element(s.begin(), s.end()), sink);
      double z = std::exp(sink - m);  // 0 without a sink
      for (double& x : s) z += (x = std::exp(x - m));
      for (int64_t d = 0; d < hd; ++d) {
        double o = 0;
        for (int64_t t = r.first; t < r.n; ++t) o += s[static_cast<size_t>(t - r.first)] * c.values[1][i][static_cast<size_t>(t)][static_cast<size_t>(g * hd + d)];
        out.push_back(o / z);
      }
    }
  }
  return out;
}

// The op on `backend` with its copies of the case's tensors; out starts as NaN.
std::vector<float> run(Backend& backend, const Case& c) {
  const int64_t rows = static_cast<int64_t>(c.plan.rows.size()), width = c.plan.n_head * c.plan.head_dim;
  Allocator& a = backend.allocator();
  Tensor q = Tensor::empty(a, {rows + c.extra_q_rows, width}, DTYPE_F32, MEM_WORKSPACE);
  Tensor out = Tensor::empty(a, {rows, width}, DTYPE_F32, MEM_WORKSPACE);
  Tensor pool = Tensor::empty(a, {static_cast<int64_t>(c.pool.size())}, DTYPE_U8, MEM_KV_CACHE);
  Tensor rings;
  std::vector<float> q_host = c.q;
  q_host.resize(static_cast<size_t>((rows + c.extra_q_rows) * width));
  backend.write(q, q_host.data());
  backend.write(pool, c.pool.data());
  if (!c.rings.empty()) {
    rings = Tensor::empty(a, {static_cast<int64_t>(c.rings.size())}, DTYPE_F32, MEM_KV_CACHE);
    backend.write(rings, c.rings.data());
  }
  const std::vector<float> nan(static_cast<size_t>(rows * width), std::nanf(""));
  backend.write(out, nan.data());
  KvAttendPlan plan = c.plan;
  if (!c.sinks.empty()) {  // in the backend's memory, as the layer's parameter is
    plan.sinks = Tensor::empty(a, {static_cast<int64_t>(c.sinks.size())}, DTYPE_F32, MEM_WORKSPACE);
    backend.write(plan.sinks, c.sinks.data());
  }
  backend.kv_attention(plan, q, pool, rings, out);
  std::vector<float> got(static_cast<size_t>(rows * width));
  backend.read(out, got.data());
  return got;
}

double rel_error(const std::vector<float>& got, const std::vector<double>& want) {
  double scale = 1e-30, err = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) err = std::max(err, std::isfinite(got[i]) ? std::abs(got[i] - want[i]) : 1e30);
  return err / scale;
}

std::vector<double> widen(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// The batches of every format: lengths across tile edges, a long sequence (split-KV splits it),
// a window, GQA and MQA, head dims 64 and 128 and an odd one.
struct Batch {
  Heads heads;
  int64_t block;
  std::vector<int64_t> lengths;
  int64_t window;
  bool sinks = false;  // the plan carries sink logits (normal, scaled by 2: some above the scores)
};
const Batch kBatches[] = {
    {{8, 2, 64}, 16, {1, 15, 16, 17, 40}, 0},
    {{4, 4, 128}, 16, {300, 33}, 0},
    {{6, 1, 24}, 8, {1, 9, 70}, 20},
    {{8, 2, 64}, 16, {1, 17, 300}, 0, true},
    {{6, 1, 24}, 8, {1, 9, 70}, 20, true},
};

Case make_batch(const Format& f, const Batch& b, uint64_t seed) {
  Case c = make_case(f, b.heads, b.block, b.lengths, b.window, seed);
  if (b.sinks) {
    c.sinks = normal(b.heads.n_head, seed * 13 + 3);
    for (float& x : c.sinks) x *= 2.0f;
  }
  return c;
}

TEST(KvAttentionTest, CpuMatchesTheDoubleReferenceInEveryFormat) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  uint64_t seed = 1;
  for (const Format& f : kFormats) {
    for (const Batch& b : kBatches) {
      const Case c = make_batch(f, b, seed++);
      const double err = rel_error(run(*cpu, c), reference(c));
      EXPECT_LT(err, kRefTol) << f.name << ", head_dim " << b.heads.head_dim << ", window " << b.window << (b.sinks ? ", sinks" : "");
    }
  }
}

// The reference itself can fail: a row of V read from the wrong tile moves the output far.
TEST(KvAttentionTest, AWrongTileIsSeen) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  Case c = make_case(kFormats[3], {8, 2, 64}, 16, {40, 40}, 0, 7);
  std::swap(c.plan.tile_offsets[1], c.plan.tile_offsets[3]);  // row 0's V tiles 0 and 1 exchanged
  EXPECT_GT(rel_error(run(*cpu, c), reference(c)), 100 * kRefTol);
}

class BackendKvOpsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    backend_ = test::op_test_backend(GetParam(), &BackendCapabilities::kv_cache, &skip);
    if (!backend_) GTEST_SKIP() << skip;
  }
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
};

TEST_P(BackendKvOpsTest, KvAttentionMatchesTheCpuInEveryFormat) {
  uint64_t seed = 100;
  double worst = 0;
  for (const Format& f : kFormats) {
    for (const Batch& b : kBatches) {
      const Case c = make_batch(f, b, seed++);
      const std::vector<float> want = run(*cpu_, c), got = run(*backend_, c);
      const double err = rel_error(got, widen(want));
      worst = std::max(worst, err);
      EXPECT_LT(err, kCpuTol) << f.name << ", head_dim " << b.heads.head_dim << ", window " << b.window << (b.sinks ? ", sinks" : "");
      EXPECT_TRUE(run(*backend_, c) == got) << f.name << ": two runs from the same inputs differ";
    }
  }
  if (GetParam() != "strict") std::printf("[ errors   ] kv_attention: worst %.2e against the CPU\n", worst);
}

TEST_P(BackendKvOpsTest, KvAttentionRefusesAPlanOutsideItsTensors) {
  const Case good = make_case(kFormats[2], {8, 2, 64}, 16, {40, 3}, 0, 9);  // bf16, residual 5: tiles and rings
  const auto error = [&](const std::function<void(Case&)>& spoil) {
    Case c = good;
    spoil(c);
    return test::error_of([&] { run(*backend_, c); });
  };
  EXPECT_EQ(error([](Case&) {}), "");
  for (const auto& spoil : std::vector<std::function<void(Case&)>>{
           [](Case& c) { c.plan.tile_offsets[0] = static_cast<int64_t>(c.pool.size()); },  // a tile past the pool
           [](Case& c) { c.plan.tile_offsets[2] = -1; },                                    // a read tile marked forgotten
           [](Case& c) { c.plan.rows[1].ring[0] = static_cast<int64_t>(c.rings.size()); },  // a ring past the rings
           [](Case& c) { c.plan.rows[0].first = c.plan.rows[0].n; },                       // no visible position
           [](Case& c) { c.plan.n_kv_head = 3; },                                           // heads that do not divide
           [](Case& c) { c.extra_q_rows = 1; },                                             // q has another row count
           [](Case& c) { c.sinks.assign(3, 0.0f); },                                        // sinks for 3 of 8 heads
       }) {
    const std::string e = error(spoil);
    EXPECT_NE(e.find("kv_attention"), std::string::npos) << "[" << e << "]";
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendKvOpsTest, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace loom
