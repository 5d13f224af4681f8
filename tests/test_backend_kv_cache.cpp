// KV caches in a backend's memory (infer/kv_cache.h "Memory": make_device_kv_cache, whose bytes
// Backend::kv_store writes and Backend::kv_attention reads) against the host caches, on every
// backend stating kv_cache ("strict": the CPU kernels on memory host code may not read; "cuda":
// the kernels on the simulator in CI, skipped without a CUDA backend):
// - one scenario per storage format, paged and contiguous: batched steps of several sequences
//   (write_rows from a backend tensor, attend_rows into one), a fork sharing blocks and copying on
//   write, a release and a new sequence reusing its slots, rows written from the host, a sliding
//   window forgetting blocks, a prompt of 13 positions stored in one flush;
// - the bytes stored are the host cache's bit for bit on every backend (read() of every position
//   and every layer equals the host cache's: both dequantize on the host from what was stored),
//   attention equals the host cache's bit for bit on "strict" (the CPU's kernels) and within the
//   f32 attention tolerance on "cuda" (split-KV sums in another order), the accounting is the
//   same;
// - a row an integer format cannot store (NaN, or beyond fp16) is reported by check_status() with
//   one line, and a kv_store plan outside its tensors is refused naming kv_store;
// - argmax_rows, greedy decoding's pick on the backend, is std::max_element's choice (ties);
// - sample_rows, sampled decoding's pick, is the host reference's token (backend/sampling.h) for
//   every setting of the rule (temperature, top-k, top-p, seeds and draws above 32 bits, ties,
//   NaN and -inf logits), bit for bit on every backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/backend/sampling.h"
#include "loom/core/philox.h"
#include "loom/infer/kv_cache.h"
#include "kv_test_util.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

using kvtest::kHeadDim;
using kvtest::kHeads;
using kvtest::kKvHeads;
using kvtest::kWidth;

constexpr double kCudaTol = 1e-5;  // the op tests' f32 attention bound, relative to the largest output

struct Format {
  const char* name;
  KvFormat k, v;
  KvAxis k_axis = KV_PER_TOKEN;
  int64_t group = 0, residual = 0;
};

const Format kFormats[] = {
    {"fp32", KV_FP32, KV_FP32},
    {"bf16", KV_BF16, KV_BF16},
    {"bf16 residual 3", KV_BF16, KV_BF16, KV_PER_TOKEN, 0, 3},
    {"int8 group 8", KV_INT8, KV_INT8, KV_PER_TOKEN, 8},
    {"int4 group 8", KV_INT4, KV_INT4, KV_PER_TOKEN, 8},
    {"int2 whole rows", KV_INT2, KV_INT2},
    {"kivi4 residual 5", KV_INT4, KV_INT4, KV_PER_CHANNEL, 8, 5},
    {"kivi2 residual 0", KV_INT2, KV_INT2, KV_PER_CHANNEL, 8, 0},
    {"int8 keys per channel, fp32 values", KV_INT8, KV_FP32, KV_PER_CHANNEL, 0, 2},
};

KvCacheConfig config_of(const Format& f) {
  KvCacheConfig c = kvtest::small_config();
  c.block_size = 4;
  c.num_blocks = 24;
  c.max_len = 32;
  c.k_format = f.k, c.v_format = f.v;
  c.k_axis = f.k_axis, c.v_axis = KV_PER_TOKEN;
  c.group = f.group, c.residual = f.residual;
  return c;
}

// The host cache and the cache in backend memory, driven alike.
struct Pair {
  Backend& backend;
  bool exact;  // the CPU's kernels: attention bitwise the host cache's
  std::unique_ptr<KvCache> host, device;
  kvtest::Rows rows{kWidth, kWidth};
  double worst = 0;  // attention, against the host cache, relative to its largest output

  Pair(Backend& b, bool exact_, const KvCacheConfig& c, bool paged)
      : backend(b),
        exact(exact_),
        host(paged ? make_paged_kv_cache(c) : make_contiguous_kv_cache(c, 4)),
        device(make_device_kv_cache(c, b, 4, paged)) {}

  int64_t add() {
    const int64_t h = host->add_sequence(), d = device->add_sequence();
    EXPECT_EQ(h, d);
    return h;
  }
  int64_t fork(int64_t seq) {
    const int64_t h = host->fork(seq), d = device->fork(seq);
    EXPECT_EQ(h, d);
    return h;
  }
  void release(int64_t seq) { host->release(seq), device->release(seq); }

  // One position of every sequence in `seqs` (tag[i] picks its rows): per layer, the batch's
  // rows stored from one backend tensor and attended in one op; with from_host, written as host
  // rows and attended per sequence instead. Compares the attention with the host cache's.
  void step(const std::vector<int64_t>& seqs, const std::vector<uint64_t>& tags, int64_t window, bool from_host,
            const std::string& what) {
    const auto n = static_cast<int64_t>(seqs.size());
    for (int64_t l = 0; l < host->config().n_layer; ++l) {
      std::vector<float> kv(static_cast<size_t>(n * 2 * kWidth)), q;
      std::vector<float> want;
      for (int64_t r = 0; r < n; ++r) {
        const int64_t seq = seqs[static_cast<size_t>(r)], p = host->length(seq);
        const std::vector<float> k = rows.k(tags[static_cast<size_t>(r)], l, p), v = rows.v(tags[static_cast<size_t>(r)], l, p);
        std::copy(k.begin(), k.end(), kv.begin() + r * 2 * kWidth);
        std::copy(v.begin(), v.end(), kv.begin() + r * 2 * kWidth + kWidth);
        const std::vector<float> qr = kvtest::query(kHeads * kHeadDim, 31 * static_cast<uint64_t>(seq) + 7 * p + l);
        q.insert(q.end(), qr.begin(), qr.end());
        host->write(seq, l, k.data(), v.data());
        const std::vector<float> o = kvtest::attend(*host, seq, l, qr, window);
        want.insert(want.end(), o.begin(), o.end());
      }
      std::vector<float> got(want.size());
      if (from_host) {
        for (int64_t r = 0; r < n; ++r) {
          const int64_t seq = seqs[static_cast<size_t>(r)];
          device->write(seq, l, kv.data() + r * 2 * kWidth, kv.data() + r * 2 * kWidth + kWidth);
          device->attend(seq, l, q.data() + r * kHeads * kHeadDim, got.data() + r * kHeads * kHeadDim, kHeads, kKvHeads,
                         kHeadDim, window);
        }
      } else {
        const Tensor src = Tensor::empty(backend.allocator(), {n, 2 * kWidth}, DTYPE_F32, MEM_WORKSPACE);
        const Tensor qt = Tensor::empty(backend.allocator(), {n, kHeads * kHeadDim}, DTYPE_F32, MEM_WORKSPACE);
        const Tensor out = Tensor::empty(backend.allocator(), {n, kHeads * kHeadDim}, DTYPE_F32, MEM_WORKSPACE);
        backend.write(src, kv.data());
        backend.write(qt, q.data());
        device->write_rows(l, seqs, src, 0, 0, kWidth);
        device->attend_rows(l, seqs, qt, out, kHeads, kKvHeads, kHeadDim, window);
        backend.read(out, got.data());
      }
      compare(got, want, what + " layer " + std::to_string(l));
    }
    for (const int64_t seq : seqs) host->advance(seq), device->advance(seq);
    device->check_status();
  }

  // `count` positions of seq stored in one flush, as the engine stores a prompt: rows leaving
  // the fp32 window within the plan are read from where they came from (kv_bytes.h).
  void prefill(int64_t seq, uint64_t tag, int64_t count) {
    const int64_t L = host->config().n_layer, first = host->length(seq);
    std::vector<float> rows_all(static_cast<size_t>(L * count * 2 * kWidth));
    for (int64_t p = 0; p < count; ++p) {
      for (int64_t l = 0; l < L; ++l) {
        const std::vector<float> k = rows.k(tag, l, first + p), v = rows.v(tag, l, first + p);
        std::copy(k.begin(), k.end(), rows_all.begin() + (l * count + p) * 2 * kWidth);
        std::copy(v.begin(), v.end(), rows_all.begin() + (l * count + p) * 2 * kWidth + kWidth);
        host->write(seq, l, k.data(), v.data());
      }
      host->advance(seq);
    }
    const Tensor src = Tensor::empty(backend.allocator(), {L * count, 2 * kWidth}, DTYPE_F32, MEM_WORKSPACE);
    backend.write(src, rows_all.data());
    for (int64_t p = 0; p < count; ++p) {
      for (int64_t l = 0; l < L; ++l) device->write_rows(l, {seq}, src, l * count + p, 0, kWidth);
      device->advance(seq);
    }
    device->flush();
  }

  void compare(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
    if (exact) {
      EXPECT_TRUE(kvtest::bitwise_equal(got, want)) << what;
      return;
    }
    double err = 0, scale = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      err = std::max(err, static_cast<double>(std::fabs(got[i] - want[i])));
      scale = std::max(scale, static_cast<double>(std::fabs(want[i])));
    }
    worst = std::max(worst, err / scale);
    EXPECT_LT(err / scale, kCudaTol) << what;
  }

  // Every visible position of every layer reads back bitwise as the host cache's.
  void same_rows(int64_t seq, int64_t from, const std::string& what) {
    const int64_t n = host->length(seq);
    for (int64_t l = 0; l < host->config().n_layer; ++l) {
      std::vector<float> hk(static_cast<size_t>((n - from) * kWidth)), hv(hk.size()), dk(hk.size()), dv(hk.size());
      host->read(seq, l, from, n, hk.data(), hv.data());
      device->read(seq, l, from, n, dk.data(), dv.data());
      EXPECT_TRUE(kvtest::bitwise_equal(dk, hk) && kvtest::bitwise_equal(dv, hv)) << what << " layer " << l;
    }
  }
  void same_accounting(const std::string& what) {
    EXPECT_EQ(device->bytes_used(), host->bytes_used()) << what;
    EXPECT_EQ(device->blocks_in_use(), host->blocks_in_use()) << what;
    EXPECT_EQ(device->positions_in_use(), host->positions_in_use()) << what;
  }
};

class BackendKvCacheTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string skip;
    backend_ = test::op_test_backend(GetParam(), &BackendCapabilities::kv_cache, &skip);
    if (!backend_) GTEST_SKIP() << skip;
  }
  std::unique_ptr<Backend> backend_;
};

TEST_P(BackendKvCacheTest, StoresTheHostCachesBytesAndAttendsAsItDoes) {
  double worst = 0;
  for (const Format& f : kFormats) {
    for (const bool paged : {true, false}) {
      const std::string what = std::string(f.name) + (paged ? " paged" : " contiguous");
      Pair c(*backend_, GetParam() == "strict", config_of(f), paged);
      EXPECT_TRUE(c.device->in_backend_memory() && !c.host->in_backend_memory());
      const int64_t a = c.add(), b = c.add();
      for (int64_t p = 0; p < 9; ++p) c.step({a, b}, {1, 2}, 0, false, what + " a, b position " + std::to_string(p));
      const int64_t f1 = c.fork(a);  // shares a's blocks; its next writes copy the shared last block
      for (int64_t p = 0; p < 6; ++p) c.step({a, f1, b}, {1, 3, 2}, 0, false, what + " after fork " + std::to_string(p));
      c.same_rows(a, 0, what + " a");
      c.same_rows(f1, 0, what + " fork");
      c.same_accounting(what + " after the fork");
      c.release(a);
      const int64_t d = c.add();  // takes a's window slot and blocks
      for (int64_t p = 0; p < 5; ++p) c.step({d}, {4}, 0, true, what + " host rows " + std::to_string(p));
      for (int64_t p = 0; p < 7; ++p) {
        c.step({b, d}, {2, 4}, 6, false, what + " window 6, position " + std::to_string(p));
        const int64_t forget = c.host->length(b) - 6 + 1;  // as the engine does for a sliding window
        c.host->forget_before(b, forget), c.device->forget_before(b, forget);
      }
      c.same_rows(b, c.host->length(b) - 5, what + " b after forgetting");
      const int64_t e = c.add();  // a prompt of 13 positions in one kv_store, then decoded
      c.prefill(e, 5, 13);
      c.same_rows(e, 0, what + " prompt");
      c.step({e}, {5}, 0, false, what + " after the prompt");
      c.same_rows(d, 0, what + " d");
      c.same_rows(f1, 0, what + " fork at the end");
      c.same_accounting(what + " at the end");
      worst = std::max(worst, c.worst);
    }
  }
  if (GetParam() != "strict") std::printf("[ errors   ] kv cache attention: worst %.2e against the host cache\n", worst);
}

TEST_P(BackendKvCacheTest, RowsAnIntegerFormatCannotStoreAreReported) {
  for (const float bad : {NAN, -1e6f}) {  // -1e6: its fp16 min would be -inf
    const Format f{"int8", KV_INT8, KV_INT8, KV_PER_TOKEN, 8};
    auto cache = make_device_kv_cache(config_of(f), *backend_, 2, true);
    const int64_t seq = cache->add_sequence();
    std::vector<float> rows(2 * kWidth, 0.5f);
    rows[kWidth + 3] = bad;  // a V channel
    const Tensor src = Tensor::empty(backend_->allocator(), {1, 2 * kWidth}, DTYPE_F32, MEM_WORKSPACE);
    backend_->write(src, rows.data());
    cache->write_rows(0, {seq}, src, 0, 0, kWidth);
    cache->flush();
    const std::string e = test::error_of([&] { cache->check_status(); });
    EXPECT_NE(e.find(std::isnan(bad) ? "non-finite" : "beyond fp16"), std::string::npos) << e;
  }
}

TEST_P(BackendKvCacheTest, KvStoreRefusesAPlanOutsideItsTensors) {
  KvStorePlan plan;
  plan.spec[0] = plan.spec[1] = {KV_INT4, KV_PER_TOKEN, 16, 8};
  const Tensor src = Tensor::zeros(backend_->allocator(), {2, 16}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor pool = Tensor::zeros(backend_->allocator(), {64}, DTYPE_U8, MEM_WORKSPACE);
  const Tensor rings = Tensor::zeros(backend_->allocator(), {32}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor status = Tensor::zeros(backend_->allocator(), {1}, DTYPE_I32, MEM_WORKSPACE);
  const auto error = [&](KvStorePlan p) { return test::error_of([&] { backend_->kv_store(p, {src}, pool, rings, status); }); };
  plan.tiles.push_back({0, 0, 1, 0});
  plan.rows.push_back({0, 16});
  plan.rings.push_back({{0, 0}, 16, 16});
  EXPECT_EQ(error(plan), "");
  std::vector<KvStorePlan> spoiled(5, plan);
  spoiled[0].tiles[0].dst = 60;                       // 16 bytes past the pool's end
  spoiled[1].rows[0].offset = 24;                     // a row past the source
  spoiled[2].rows[0].source = 1;                      // a source that is not there
  spoiled[3].rings[0].dst = 24;                       // a ring row past the rings
  spoiled[4].rings[0].row.source = KvStoreRow::kFromRings;  // ring rows come from the sources
  for (const KvStorePlan& p : spoiled) {
    const std::string e = error(p);
    EXPECT_NE(e.find("kv_store"), std::string::npos) << "[" << e << "]";
  }
}

// Greedy decoding's pick: the first index of each row's largest value, as std::max_element, with
// ties (the first wins) and rows of one element; a vocabulary of 50,257 (GPT-2's) over 5 rows.
TEST_P(BackendKvCacheTest, ArgmaxRowsPicksTheFirstLargestValue) {
  const int64_t n = 5, V = 50257;
  std::vector<float> x(static_cast<size_t>(n * V));
  philox_fill_normal(x.data(), n * V, 3, 0, 0, 0.0f, 1.0f);
  x[static_cast<size_t>(1 * V + 70)] = x[static_cast<size_t>(1 * V + 40000)] = 9.0f;  // a tie: 70 wins
  for (int64_t v = 0; v < V; ++v) x[static_cast<size_t>(2 * V + v)] = -3.0f;           // all equal: 0
  x[static_cast<size_t>(3 * V + V - 1)] = 50.0f;                                         // the last one
  x[static_cast<size_t>(4 * V)] = 50.0f;                                                 // the first one
  std::vector<int32_t> want(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    want[static_cast<size_t>(i)] = static_cast<int32_t>(std::max_element(x.begin() + i * V, x.begin() + (i + 1) * V) - (x.begin() + i * V));
  }
  EXPECT_EQ(want[1], 70);
  EXPECT_EQ(want[2], 0);
  const Tensor xt = Tensor::empty(backend_->allocator(), {n, V}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor out = Tensor::empty(backend_->allocator(), {n}, DTYPE_I32, MEM_WORKSPACE);
  backend_->write(xt, x.data());
  backend_->argmax_rows(xt, out);
  std::vector<int32_t> got(static_cast<size_t>(n));
  backend_->read(out, got.data());
  EXPECT_EQ(got, want);
  const Tensor one = Tensor::empty(backend_->allocator(), {1, 1}, DTYPE_F32, MEM_WORKSPACE);
  backend_->write(one, x.data());
  backend_->argmax_rows(one, out.view(0, {1}));
  backend_->read(out.view(0, {1}), got.data());
  EXPECT_EQ(got[0], 0);
  EXPECT_NE(test::error_of([&] { backend_->argmax_rows(xt, out.view(0, {4})); }).find("argmax_rows"), std::string::npos);
}

// Sampled decoding's pick (Backend::sample_rows): each row's token is the host reference's
// (sample_row: the rule of backend/sampling_rule.h) on every backend, bit for bit (the rule's
// probabilities, weights and sums are exact on both sides), over 12 settings x 4 draws at GPT-2's
// vocabulary, rows of 7 and of 1 token. The draws vary (a rule that ignored the draw would give
// one token a row), top-k keeps to the k largest logits, OpenAI's penalties are subtracted from
// the logits in place as the host sampler subtracts them, and bad settings or penalties are
// refused naming sample_rows. A kernel drawing over the nucleus with the top-k's sum (checked once) fails this test.
TEST_P(BackendKvCacheTest, SampleRowsDrawsTheRulesToken) {
  const auto run = [&](int64_t n, int64_t V, const std::vector<float>& x, const std::vector<RowSampling>& rows,
                       const std::vector<SamplePenalty>& penalties = {}) {
    const Tensor xt = Tensor::empty(backend_->allocator(), {n, V}, DTYPE_F32, MEM_WORKSPACE);
    const Tensor out = Tensor::empty(backend_->allocator(), {n}, DTYPE_I32, MEM_WORKSPACE);
    backend_->write(xt, x.data());
    backend_->sample_rows(xt, rows, penalties, out);
    std::vector<int32_t> got(static_cast<size_t>(n));
    backend_->read(out, got.data());
    std::vector<float> penalised = x, after(x.size());
    apply_penalties(penalised.data(), V, penalties);
    backend_->read(xt, after.data());
    EXPECT_EQ(std::memcmp(after.data(), penalised.data(), after.size() * sizeof(float)), 0) << "the penalised logits";
    SampleCandidates scratch;
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(got[static_cast<size_t>(i)], sample_row(penalised.data() + i * V, V, rows[static_cast<size_t>(i)], scratch))
          << "row " << i << " of V " << V << ", draw " << rows[static_cast<size_t>(i)].draw;
    }
    return got;
  };
  const int64_t n = 12, V = 50257;
  std::vector<float> x(static_cast<size_t>(n * V));
  philox_fill_normal(x.data(), n * V, 5, 0, 0, 0.0f, 2.0f);
  const auto at = [&](int64_t r, int64_t v) -> float& { return x[static_cast<size_t>(r * V + v)]; };
  for (int64_t v = 0; v < V; ++v) at(10, v) = std::round(at(10, v) * 4.0f) / 4.0f;  // ties
  for (int64_t v = 0; v < V; v += 97) at(10, v) = std::nanf("");
  for (int64_t v = 5; v < V; v += 89) at(10, v) = -INFINITY;
  for (int64_t v = 0; v < V; ++v) at(11, v) = -INFINITY;  // no weight anywhere: the first token
  const std::vector<RowSampling> settings = {
      {0.0f, 1.0f, 0, 1, 0},     {1.0f, 1.0f, 0, 2, 0},    {0.5f, 1.0f, 1, 3, 0},   {1.0f, 1.0f, 3, 4, 0},
      {2.0f, 1.0f, 40, 5, 0},    {1.0f, 0.9f, 0, 6, 0},    {0.7f, 0.5f, 50, 7, 0},  {1.0f, 1e-6f, 0, 8, 0},
      {1.5f, 1.0f, V + 5, 9, 0}, {1.0f, 1.0f, 0, (uint64_t{1} << 40) + 3, uint64_t{1} << 33},
      {1.0f, 0.95f, 0, 11, 0},   {1.0f, 1.0f, 0, 12, 0}};
  std::vector<std::vector<int32_t>> draws;
  for (uint64_t d = 0; d < 4; ++d) {
    std::vector<RowSampling> rows = settings;
    for (RowSampling& r : rows) r.draw += d;
    draws.push_back(run(n, V, x, rows));
  }
  std::vector<int32_t> top3(static_cast<size_t>(V));
  std::iota(top3.begin(), top3.end(), 0);
  std::partial_sort(top3.begin(), top3.begin() + 3, top3.end(), [&](int32_t a, int32_t b) { return at(3, a) > at(3, b); });
  int distinct_draws = 0;
  for (size_t d = 0; d < draws.size(); ++d) {
    EXPECT_EQ(draws[d][0], static_cast<int32_t>(std::max_element(x.begin(), x.begin() + V) - x.begin()));
    EXPECT_EQ(draws[d][2], draws[0][2]);  // top_k 1: the argmax whatever the draw
    EXPECT_TRUE(std::find(top3.begin(), top3.begin() + 3, draws[d][3]) != top3.begin() + 3) << draws[d][3];
    EXPECT_EQ(draws[d][11], 0);
    distinct_draws += std::count(draws.begin(), draws.begin() + static_cast<std::ptrdiff_t>(d), draws[d]) == 0 ? 1 : 0;
  }
  EXPECT_EQ(distinct_draws, 4);  // every draw changed some row's token
  // OpenAI's penalties: each row's last draw's tokens penalised (presence 0.5 + frequency 0.3 x
  // count); a greedy row whose argmax is penalised away picks another token.
  std::vector<SamplePenalty> penalties;
  for (int32_t r = 0; r < n; ++r) {
    penalties.push_back({r, draws[3][static_cast<size_t>(r)], 0.5f + 0.3f * static_cast<float>(r % 3 + 1)});
  }
  penalties.push_back({0, draws[0][0] == 7 ? 8 : 7, 0.8f});
  penalties[0].amount = 100.0f;  // row 0 is greedy: its argmax must change
  const std::vector<int32_t> penalised = run(n, V, x, settings, penalties);
  EXPECT_NE(penalised[0], draws[0][0]);
  std::vector<float> small(7);
  philox_fill_normal(small.data(), 7, 8, 0, 0, 0.0f, 1.0f);
  small.insert(small.end(), small.begin(), small.end());
  run(2, 7, small, {{1.0f, 1.0f, 0, 1, 0}, {0.8f, 0.6f, 2, 1, 1}});
  run(1, 1, {3.0f}, {{1.0f, 1.0f, 0, 1, 0}});
  const Tensor xt = Tensor::empty(backend_->allocator(), {2, 7}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor out = Tensor::empty(backend_->allocator(), {2}, DTYPE_I32, MEM_WORKSPACE);
  backend_->write(xt, small.data());
  const std::vector<RowSampling> bad = {{1.0f, 1.0f, 0, 1, 0}, {1.0f, 0.0f, 0, 1, 0}};
  EXPECT_NE(test::error_of([&] { backend_->sample_rows(xt, bad, {}, out); }).find("sample_rows: row 1"), std::string::npos);
  EXPECT_NE(test::error_of([&] { backend_->sample_rows(xt, {bad[0]}, {}, out); }).find("sample_rows"), std::string::npos);
  const std::vector<RowSampling> good = {bad[0], bad[0]};
  EXPECT_NE(test::error_of([&] { backend_->sample_rows(xt, good, {{1, 7, 1.0f}}, out); }).find("penalty 0 of row 1 token 7"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { backend_->sample_rows(xt, good, {{1, 3, 1.0f}, {1, 3, 2.0f}}, out); }).find("two penalties"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendKvCacheTest, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace loom
