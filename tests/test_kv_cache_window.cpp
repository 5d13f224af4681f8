// KV caches under a sliding window (kv_cache.h "Forgetting"): blocks wholly before the window go
// back to the pool, attention stays bitwise the same, freed blocks are reused, forks share only
// live blocks, and reading a forgotten position is refused naming it.
#include <gtest/gtest.h>

#include <vector>

#include "kv_test_util.h"
#include "loom/infer/kv_cache.h"
#include "test_util.h"

namespace loom {
namespace {
using namespace kvtest;

// Sliding-window forgetting (kv_cache.h "Forgetting"): W = 10, B = 4.
constexpr int64_t kWindow = 10, kBlock = 4;

KvCacheConfig window_config(int64_t num_blocks) {
  KvCacheConfig c = small_config();
  c.block_size = kBlock;
  c.num_blocks = num_blocks;
  c.max_len = 200;
  return c;
}

// Writes positions [length, end) of seq (every layer, rows of `tag`), forgetting after each
// advance what the next position's window no longer reads: positions < length - W + 1.
void fill_windowed(KvCache& cache, int64_t seq, const Rows& rows, uint64_t tag, int64_t end) {
  for (int64_t p = cache.length(seq); p < end; ++p) {
    fill(cache, seq, rows, tag, p + 1);
    cache.forget_before(seq, p + 1 - kWindow + 1);
  }
}

// A windowed sequence of 100 positions holds at most ceil(W / B) + 1 blocks at every step (the
// peak is while a position is written), counts only its live blocks, and attends bitwise like
// a cache that forgets nothing, in fp32 and with the fp32 residual window of the quantized
// formats (KIVI keys with residual 12 > W: tiles are forgotten before they are quantized).
TEST(KvCacheTest, ForgettingBeyondTheWindowBoundsBlocksAndAttendsBitwiseTheSame) {
  constexpr int64_t N = 100, bound = (kWindow + kBlock - 1) / kBlock + 1, pool = 32;
  const Rows rows{kWidth, kWidth};
  KvCacheConfig int4 = window_config(pool);
  int4.k_format = int4.v_format = KV_INT4;
  int4.group = 8;
  int4.residual = 3;
  struct Case {
    const char* name;
    KvCacheConfig config;
  };
  const Case cases[] = {{"fp32", window_config(pool)},
                        {"int4 per-token, residual 3", int4},
                        {"kivi2, residual 12", kivi(window_config(pool), KV_INT2, 8, 12)},
                        {"kivi4, residual 2", kivi(window_config(pool), KV_INT4, 8, 2)}};
  for (const Case& c : cases) {
    auto forgetting = make_paged_kv_cache(c.config);
    auto keeping = make_paged_kv_cache(c.config);
    const int64_t seq = forgetting->add_sequence(), ref = keeping->add_sequence();
    int64_t most = 0;
    for (int64_t p = 0; p < N; ++p) {
      for (int64_t l = 0; l < 2; ++l) {
        forgetting->write(seq, l, rows.k(0, l, p).data(), rows.v(0, l, p).data());
        keeping->write(ref, l, rows.k(0, l, p).data(), rows.v(0, l, p).data());
        const std::vector<float> q = query(kHeads * kHeadDim, 100 * static_cast<uint64_t>(p) + static_cast<uint64_t>(l));
        ASSERT_TRUE(bitwise_equal(attend(*forgetting, seq, l, q, kWindow), attend(*keeping, ref, l, q, kWindow)))
            << c.name << " position " << p << " layer " << l;
      }
      most = std::max(most, forgetting->sequence_blocks(seq));
      ASSERT_LE(forgetting->sequence_blocks(seq), bound) << c.name << " position " << p;
      forgetting->advance(seq);
      keeping->advance(ref);
      forgetting->forget_before(seq, p + 1 - kWindow + 1);
      // Live blocks only: tiles wholly before the forget point are gone.
      const int64_t dropped = std::max<int64_t>(0, p + 2 - kWindow) / kBlock;
      const int64_t blocks = (p + 1 + kBlock - 1) / kBlock - dropped, positions = p + 1 - dropped * kBlock;
      ASSERT_EQ(forgetting->sequence_blocks(seq), blocks) << c.name << " position " << p;
      ASSERT_EQ(forgetting->blocks_in_use(), blocks) << c.name << " position " << p;
      ASSERT_EQ(forgetting->free_blocks(), pool - blocks) << c.name << " position " << p;
      ASSERT_EQ(forgetting->positions_in_use(), positions) << c.name << " position " << p;
      if (c.config.k_format == KV_FP32) {
        ASSERT_EQ(forgetting->bytes_used(), positions * 2 * 2 * kWidth * 4) << "position " << p;
        ASSERT_DOUBLE_EQ(forgetting->utilisation(),
                         static_cast<double>(positions) / static_cast<double>(blocks * kBlock));
      }
    }
    EXPECT_EQ(most, bound) << c.name;
    EXPECT_EQ(keeping->sequence_blocks(ref), N / kBlock) << c.name;
    // The live rows (the next position's window but itself) read back as in the cache that keeps everything.
    for (int64_t l = 0; l < 2; ++l) {
      std::vector<float> k1((kWindow - 1) * kWidth), v1(k1.size()), k2(k1.size()), v2(k1.size());
      forgetting->read(seq, l, N - kWindow + 1, N, k1.data(), v1.data());
      keeping->read(ref, l, N - kWindow + 1, N, k2.data(), v2.data());
      EXPECT_TRUE(bitwise_equal(k1, k2) && bitwise_equal(v1, v2)) << c.name << " layer " << l;
    }
    forgetting->release(seq);
    EXPECT_EQ(forgetting->free_blocks(), pool) << c.name;
    EXPECT_EQ(forgetting->bytes_used(), 0) << c.name;
  }
}

// Blocks a windowed sequence forgets go back to the shared free list: two windowed sequences
// of 100 positions (50 blocks unforgotten) run side by side in a pool of 8, then a plain
// sequence takes every block the first one no longer holds.
TEST(KvCacheTest, ForgottenBlocksAreReusedByOtherSequences) {
  const Rows rows{kWidth, kWidth};
  {
    auto cache = make_paged_kv_cache(window_config(8));
    const int64_t a = cache->add_sequence(), b = cache->add_sequence();
    for (int64_t p = 1; p <= 100; ++p) {
      fill_windowed(*cache, a, rows, 1, p);
      fill_windowed(*cache, b, rows, 2, p);
      ASSERT_LE(cache->blocks_in_use(), 8);
    }
    EXPECT_EQ(cache->length(a), 100);
    EXPECT_EQ(cache->length(b), 100);
  }
  {
    auto cache = make_paged_kv_cache(window_config(6));
    const int64_t a = cache->add_sequence();
    fill_windowed(*cache, a, rows, 1, 100);  // held 4 blocks at its peak, 3 now
    ASSERT_EQ(cache->sequence_blocks(a), 3);
    ASSERT_EQ(cache->free_blocks(), 3);
    const int64_t c = cache->add_sequence();
    fill(*cache, c, rows, 2, 12);  // 3 blocks: at least one of them a block `a` forgot
    EXPECT_EQ(cache->sequence_blocks(c), 3);
    EXPECT_EQ(cache->free_blocks(), 0);
    EXPECT_EQ(cache->positions_in_use(), 100 - 88 + 12);  // a: tiles from 88 on; c: 12
    const std::string message = test::error_of([&] { fill(*cache, c, rows, 2, 13); });
    EXPECT_NE(message.find("out of blocks"), std::string::npos) << message;
    const std::vector<float> q = query(kHeads * kHeadDim, 77);
    auto alone = make_contiguous_kv_cache(window_config(6), 1);
    fill(*alone, alone->add_sequence(), rows, 1, 100);
    EXPECT_TRUE(bitwise_equal(attend(*cache, a, 1, q, kWindow - 1), attend(*alone, 0, 1, q, kWindow - 1)));
  }
}

// Fork after forgetting: the child shares the live blocks only (refcount 2), copies the shared
// partial block on its first write, and both branches attend as unshared caches holding their
// rows; releasing both returns every block.
TEST(KvCacheTest, ForkAfterForgettingSharesOnlyLiveBlocks) {
  const Rows rows{kWidth, kWidth};
  for (const KvCacheConfig& config : {window_config(16), kivi(window_config(16), KV_INT2, 8, 4)}) {
    const std::string name(kv_format_name(config.k_format));
    auto cache = make_paged_kv_cache(config);
    const int64_t parent = cache->add_sequence();
    fill_windowed(*cache, parent, rows, 1, 30);  // forgot [0, 21): tiles 0..4; live tiles 5, 6, 7
    ASSERT_EQ(cache->sequence_blocks(parent), 3) << name;
    const int64_t child = cache->fork(parent);
    EXPECT_EQ(cache->length(child), 30) << name;
    EXPECT_EQ(cache->sequence_blocks(child), 3) << name;
    EXPECT_EQ(cache->blocks_in_use(), 3) << name;
    EXPECT_EQ(cache->block_refcount(child, 20), 2) << name;
    EXPECT_EQ(cache->block_refcount(parent, 29), 2) << name;
    EXPECT_NE(test::error_of([&] { cache->block_refcount(child, 19); }).find("position 19 of sequence 1 was forgotten"),
              std::string::npos)
        << name;
    fill_windowed(*cache, child, rows, 2, 60);
    fill_windowed(*cache, parent, rows, 3, 60);
    EXPECT_LE(cache->blocks_in_use(), 2 * 3) << name;
    auto alone = make_contiguous_kv_cache(config, 2);
    const int64_t a = alone->add_sequence(), b = alone->add_sequence();
    fill(*alone, a, rows, 1, 30);
    fill(*alone, a, rows, 3, 60);
    fill(*alone, b, rows, 1, 30);
    fill(*alone, b, rows, 2, 60);
    for (int64_t l = 0; l < 2; ++l) {
      const std::vector<float> q = query(kHeads * kHeadDim, 41 + static_cast<uint64_t>(l));
      EXPECT_TRUE(bitwise_equal(attend(*cache, parent, l, q, kWindow - 1), attend(*alone, a, l, q, kWindow - 1)))
          << name << " layer " << l;
      EXPECT_TRUE(bitwise_equal(attend(*cache, child, l, q, kWindow - 1), attend(*alone, b, l, q, kWindow - 1)))
          << name << " layer " << l;
    }
    const std::vector<float> q = query(kHeads * kHeadDim, 43);
    const std::vector<float> child_out = attend(*cache, child, 1, q, kWindow - 1);
    cache->release(parent);
    EXPECT_EQ(cache->blocks_in_use(), cache->sequence_blocks(child)) << name;
    EXPECT_TRUE(bitwise_equal(attend(*cache, child, 1, q, kWindow - 1), child_out)) << name;
    cache->release(child);
    EXPECT_EQ(cache->free_blocks(), 16) << name;
  }
}

// attend and read of a forgotten position throw naming the position and the sequence, in both
// caches (the contiguous one keeps the storage); forgetting ahead of the sequence is refused.
TEST(KvCacheTest, ReadingAForgottenPositionThrowsNamingIt) {
  const Rows rows{kWidth, kWidth};
  auto paged = make_paged_kv_cache(window_config(16));
  auto contiguous = make_contiguous_kv_cache(window_config(16), 1);
  for (KvCache* cache : {paged.get(), contiguous.get()}) {
    const int64_t seq = cache->add_sequence();
    fill(*cache, seq, rows, 0, 20);
    const int64_t blocks = cache->blocks_in_use();
    cache->forget_before(seq, 9);
    cache->forget_before(seq, 3);  // behind the forget point: nothing changes
    EXPECT_EQ(cache->blocks_in_use(), cache == paged.get() ? blocks - 2 : blocks);  // tiles [0, 8) went
    std::vector<float> k(20 * kWidth), v(k.size());
    std::string message = test::error_of([&] { cache->read(seq, 1, 8, 20, k.data(), v.data()); });
    EXPECT_NE(message.find("read of position 8 of sequence 0 layer 1, which was forgotten"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    const std::vector<float> q = query(kHeads * kHeadDim, 3);
    message = test::error_of([&] { attend(*cache, seq, 0, q, 0); });
    EXPECT_NE(message.find("position 0 of sequence 0"), std::string::npos) << message;
    message = test::error_of([&] { attend(*cache, seq, 0, q, 12); });  // [8, 20)
    EXPECT_NE(message.find("position 8 of sequence 0"), std::string::npos) << message;
    EXPECT_EQ(test::error_of([&] { attend(*cache, seq, 0, q, 11); }), "");  // [9, 20)
    EXPECT_EQ(test::error_of([&] { cache->read(seq, 0, 9, 20, k.data(), v.data()); }), "");
    message = test::error_of([&] { cache->forget_before(seq, 21); });
    EXPECT_NE(message.find("forget_before(sequence 0, position 21) beyond its 20 committed positions"),
              std::string::npos)
        << message;
  }
  EXPECT_NE(test::error_of([&] { paged->block_refcount(0, 7); }).find("position 7 of sequence 0 was forgotten"),
            std::string::npos);
  EXPECT_EQ(paged->block_refcount(0, 8), 1);
  EXPECT_EQ(paged->positions_in_use(), 12);  // tiles 2..4: positions 8..19
  EXPECT_EQ(contiguous->positions_in_use(), 20);
}

}  // namespace
}  // namespace loom
