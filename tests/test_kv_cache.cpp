// KV caches: paged attention equals contiguous attention bit for bit and a float64 reference
// within fp32 rounding; fork shares blocks and copies only the block it writes into; waste is
// under one block per sequence; bytes match the formulas; KIVI keeps its residual window exact.
// Sliding-window forgetting: test_kv_cache_window.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "loom/core/philox.h"
#include "loom/infer/kv_cache.h"
#include "kv_test_util.h"
#include "test_util.h"


namespace loom {
namespace {
using namespace kvtest;

TEST(KvCacheTest, PagedAttentionIsBitwiseEqualToContiguous) {
  const Rows rows{kWidth, kWidth};
  const std::vector<int64_t> lengths = {1, 17, 50};
  for (const KvCacheConfig& config : {small_config(), kivi(small_config(), KV_INT2, 8, 0), kivi(small_config(), KV_INT4, 0, 5)}) {
    auto paged = make_paged_kv_cache(config);
    auto contiguous = make_contiguous_kv_cache(config, 3);
    for (size_t i = 0; i < lengths.size(); ++i) {
      ASSERT_EQ(paged->add_sequence(), static_cast<int64_t>(i));
      ASSERT_EQ(contiguous->add_sequence(), static_cast<int64_t>(i));
    }
    // Round-robin over the sequences, so their blocks interleave in the pool.
    for (int64_t p = 0; p < 50; ++p) {
      for (size_t i = 0; i < lengths.size(); ++i) {
        if (p >= lengths[i]) continue;
        fill(*paged, static_cast<int64_t>(i), rows, i, p + 1);
        fill(*contiguous, static_cast<int64_t>(i), rows, i, p + 1);
      }
    }
    for (size_t i = 0; i < lengths.size(); ++i) {
      for (int64_t l = 0; l < config.n_layer; ++l) {
        for (int64_t window : {0, 5, 16, 40}) {
          const std::vector<float> q = query(kHeads * kHeadDim, 10 * i + static_cast<uint64_t>(l));
          EXPECT_TRUE(bitwise_equal(attend(*paged, static_cast<int64_t>(i), l, q, window),
                                    attend(*contiguous, static_cast<int64_t>(i), l, q, window)))
              << kv_format_name(config.k_format) << " sequence " << i << " layer " << l << " window " << window;
        }
      }
    }
  }
}

TEST(KvCacheTest, AttendMatchesAFloat64Reference) {
  const Rows rows{kWidth, kWidth};
  auto cache = make_paged_kv_cache(small_config());
  const int64_t seq = cache->add_sequence();
  fill(*cache, seq, rows, 0, 50);
  const std::vector<uint64_t> tags(50, 0);
  for (int64_t l = 0; l < 2; ++l) {
    const std::vector<float> K = rows.stack(tags, l, false), V = rows.stack(tags, l, true);
    for (int64_t window : {0, 7}) {
      const std::vector<float> q = query(kHeads * kHeadDim, 3 + static_cast<uint64_t>(l), 2.0f);
      const int64_t first = window > 0 ? 50 - window : 0;
      const double err =
          relative_max_error(attend(*cache, seq, l, q, window), reference_attention(K, V, q.data(), kHeads, kKvHeads, kHeadDim, first, 50));
      EXPECT_LT(err, 1e-6) << "layer " << l << " window " << window;
    }
  }
}

TEST(KvCacheTest, AttendSeesTheRowItsLayerJustWrote) {
  const Rows rows{kWidth, kWidth};
  auto cache = make_paged_kv_cache(small_config());
  const int64_t seq = cache->add_sequence();
  fill(*cache, seq, rows, 0, 20);
  cache->write(seq, 0, rows.k(0, 0, 20).data(), rows.v(0, 0, 20).data());  // layer 1 has not written 20
  const std::vector<uint64_t> tags(21, 0);
  const std::vector<float> q = query(kHeads * kHeadDim, 5);
  for (int64_t l = 0; l < 2; ++l) {
    const int64_t n = l == 0 ? 21 : 20;
    const double err = relative_max_error(attend(*cache, seq, l, q, 0),
                                          reference_attention(rows.stack(tags, l, false), rows.stack(tags, l, true),
                                                              q.data(), kHeads, kKvHeads, kHeadDim, 0, n));
    EXPECT_LT(err, 1e-6) << "layer " << l;
  }
  EXPECT_EQ(cache->length(seq), 20);
}

TEST(KvCacheTest, ForkSharesBlocksAndCopiesOnlyTheBlockItWrites) {
  const Rows rows{kWidth, kWidth};
  auto cache = make_paged_kv_cache(small_config());
  const int64_t parent = cache->add_sequence();
  fill(*cache, parent, rows, 1, 20);  // blocks: [0, 16) full, [16, 20) partial
  ASSERT_EQ(cache->blocks_in_use(), 2);
  const std::vector<float> q = query(kHeads * kHeadDim, 11);
  const std::vector<float> before = attend(*cache, parent, 1, q, 0);

  const int64_t child = cache->fork(parent);
  EXPECT_EQ(cache->length(child), 20);
  EXPECT_EQ(cache->blocks_in_use(), 2);
  for (int64_t pos : {0, 19}) {
    EXPECT_EQ(cache->block_refcount(parent, pos), 2);
    EXPECT_EQ(cache->block_refcount(child, pos), 2);
  }
  EXPECT_EQ(cache->positions_in_use(), 20);

  // The child's position 20 lands in the shared partial block: that block alone is copied.
  for (int64_t l = 0; l < 2; ++l) cache->write(child, l, rows.k(2, l, 20).data(), rows.v(2, l, 20).data());
  cache->advance(child);
  EXPECT_EQ(cache->blocks_in_use(), 3);
  EXPECT_EQ(cache->block_refcount(parent, 0), 2);
  EXPECT_EQ(cache->block_refcount(child, 0), 2);
  EXPECT_EQ(cache->block_refcount(parent, 19), 1);
  EXPECT_EQ(cache->block_refcount(child, 20), 1);
  EXPECT_TRUE(bitwise_equal(attend(*cache, parent, 1, q, 0), before));

  // The child sees its own position: the same numbers as an unshared cache holding its rows.
  auto alone = make_contiguous_kv_cache(small_config(), 1);
  const int64_t only = alone->add_sequence();
  fill(*alone, only, rows, 1, 20);
  fill(*alone, only, rows, 2, 21);
  const std::vector<float> child_out = attend(*cache, child, 1, q, 0);
  EXPECT_TRUE(bitwise_equal(child_out, attend(*alone, only, 1, q, 0)));
  EXPECT_FALSE(bitwise_equal(child_out, before));

  // The parent's own position 20 goes into its block, now unshared: no copy.
  fill(*cache, parent, rows, 3, 21);
  EXPECT_EQ(cache->blocks_in_use(), 3);
  EXPECT_EQ(cache->positions_in_use(), 16 + 5 + 5);

  const int64_t pool = small_config().num_blocks;
  cache->release(parent);  // frees the parent's partial block; block 0 stays with the child
  EXPECT_EQ(cache->blocks_in_use(), 2);
  EXPECT_EQ(cache->free_blocks(), pool - 2);
  EXPECT_EQ(cache->block_refcount(child, 0), 1);
  EXPECT_TRUE(bitwise_equal(attend(*cache, child, 1, q, 0), child_out));
  cache->release(child);
  EXPECT_EQ(cache->blocks_in_use(), 0);
  EXPECT_EQ(cache->free_blocks(), pool);
}

TEST(KvCacheTest, ForkAtABlockBoundaryCopiesNothing) {
  const Rows rows{kWidth, kWidth};
  auto cache = make_paged_kv_cache(small_config());
  const int64_t parent = cache->add_sequence();
  fill(*cache, parent, rows, 1, 32);
  const int64_t child = cache->fork(parent);
  fill(*cache, child, rows, 2, 33);  // a fresh block for position 32
  EXPECT_EQ(cache->blocks_in_use(), 3);
  EXPECT_EQ(cache->block_refcount(child, 31), 2);
  EXPECT_EQ(cache->block_refcount(child, 32), 1);
  EXPECT_EQ(cache->sequence_blocks(child), 3);
  EXPECT_EQ(cache->sequence_blocks(parent), 2);
}

TEST(KvCacheTest, PagedWasteIsUnderOneBlockPerSequence) {
  KvCacheConfig config;
  config.n_layer = 1;
  config.k_width = config.v_width = 4;
  config.block_size = 16;
  config.num_blocks = 40 * 13;
  config.max_len = 200;
  auto paged = make_paged_kv_cache(config);
  auto contiguous = make_contiguous_kv_cache(config, 40);
  const Rows rows{4, 4};
  std::vector<float> u(40);
  philox_fill_uniform(u.data(), 40, 17, 0, 0);
  int64_t total = 0;
  for (int i = 0; i < 40; ++i) {
    const int64_t length = 1 + static_cast<int64_t>(u[static_cast<size_t>(i)] * 199.0f);
    const int64_t a = paged->add_sequence(), b = contiguous->add_sequence();
    fill(*paged, a, rows, 0, length);
    fill(*contiguous, b, rows, 0, length);
    EXPECT_EQ(paged->sequence_blocks(a), (length + 15) / 16);
    EXPECT_LT(paged->sequence_blocks(a) * 16 - length, 16);
    total += length;
  }
  EXPECT_EQ(paged->positions_in_use(), total);
  EXPECT_LT(paged->blocks_in_use() * 16 - total, 40 * 16);
  EXPECT_DOUBLE_EQ(paged->utilisation(), static_cast<double>(total) / static_cast<double>(paged->blocks_in_use() * 16));
  EXPECT_DOUBLE_EQ(contiguous->utilisation(), static_cast<double>(total) / (40.0 * 200.0));
  EXPECT_EQ(paged->bytes_used(), contiguous->bytes_used());
  std::printf("[          ] 40 sequences of 1..200 positions: paged utilisation %.3f, contiguous (max_len 200) %.3f\n",
              paged->utilisation(), contiguous->utilisation());
}

TEST(KvCacheTest, BytesPerTokenMatchTheFormulas) {
  KvCacheConfig c;
  c.n_layer = 2;
  c.k_width = c.v_width = 64;
  c.block_size = 16;
  const auto with = [&](KvFormat format, int64_t group) {
    KvCacheConfig d = c;
    d.k_format = d.v_format = format;
    d.group = group;
    return d;
  };
  // L * (bytes_K + bytes_V) per position.
  EXPECT_EQ(kv_bytes_per_token(c), 2 * (64 * 4 + 64 * 4));
  EXPECT_EQ(kv_bytes_per_token(with(KV_BF16, 0)), 2 * (64 * 2 + 64 * 2));
  EXPECT_EQ(kv_bytes_per_token(with(KV_INT8, 0)), 2 * 2 * (64 + 4));          // one (scale, min) per row
  EXPECT_EQ(kv_bytes_per_token(with(KV_INT4, 32)), 2 * 2 * (32 + 2 * 4));     // two groups per row
  EXPECT_EQ(kv_bytes_per_token(with(KV_INT2, 32)), 2 * 2 * (16 + 2 * 4));
  // KIVI-2: keys per channel (a (scale, min) per channel per 16 positions), values per token.
  const KvCacheConfig k2 = kivi(c, KV_INT2, 32, 0);
  EXPECT_EQ(kv_bytes_per_token(k2), 2 * ((16 + 4.0 * 64 / 16) + (16 + 2 * 4)));
  EXPECT_EQ(kv_block_bytes(k2), 16 * 112);
  EXPECT_EQ(kv_bytes_per_token(kivi(c, KV_INT4, 32, 0)), 2 * ((32 + 4.0 * 64 / 16) + (32 + 2 * 4)));
  // fp32 windows: K keeps up to R + B - 1 rows, V R rows.
  EXPECT_EQ(kv_window_bytes(c), 0);
  EXPECT_EQ(kv_window_bytes(kivi(c, KV_INT2, 32, 32)), 2 * 4 * ((32 + 15) * 64 + 32 * 64));
  EXPECT_EQ(kv_window_bytes(kivi(c, KV_INT2, 32, 0)), 2 * 4 * (15 * 64));
  // MLA (DeepSeek-V3: 61 layers, a 512 + 64 latent, no V) in bf16: 70272 bytes per position.
  KvCacheConfig mla;
  mla.n_layer = 61;
  mla.k_width = 576;
  mla.k_format = KV_BF16;
  EXPECT_EQ(kv_bytes_per_token(mla), 61 * 576 * 2);
}

TEST(KvCacheTest, BytesReservedAndUsedAfterWritingPositions) {
  KvCacheConfig c;
  c.n_layer = 2;
  c.k_width = c.v_width = 64;
  c.block_size = 16;
  c.num_blocks = 10;
  c.max_len = 64;
  const Rows rows{64, 64};
  {  // fp32: 1024 bytes per position, blocks of 16384
    auto cache = make_paged_kv_cache(c);
    EXPECT_EQ(cache->bytes_reserved(), 10 * 16384);
    fill(*cache, cache->add_sequence(), rows, 0, 37);
    EXPECT_EQ(cache->blocks_in_use(), 3);
    EXPECT_EQ(cache->bytes_used(), 37 * 1024);
    EXPECT_DOUBLE_EQ(cache->utilisation(), 37.0 / 48.0);
    EXPECT_EQ(kv_sequence_bytes(c, 37), 3 * 16384);
  }
  {  // KIVI-2, no residual: blocks of 2 * (K 64*4 + 16*16 = 512, V 16 * (16 + 8) = 384)
    const KvCacheConfig k2 = kivi(c, KV_INT2, 32, 0);
    CpuAllocator allocator;
    auto cache = make_paged_kv_cache(k2, &allocator);
    const int64_t window = 2 * 15 * 64 * 4;  // K rows of an unfilled tile stay fp32
    EXPECT_EQ(cache->block_bytes(), 2 * (512 + 384));
    EXPECT_EQ(cache->bytes_reserved(), 10 * 1792);
    fill(*cache, cache->add_sequence(), rows, 0, 37);
    EXPECT_EQ(cache->bytes_reserved(), 10 * 1792 + window);
    // Per layer: K tiles 512 + 512 + (256 + 5 * 16), V 37 rows of 24; window: K rows 32..36.
    EXPECT_EQ(cache->bytes_used(), 2 * (512 + 512 + 336 + 37 * 24) + 2 * 5 * 64 * 4);
    EXPECT_EQ(kv_sequence_bytes(k2, 37), 3 * 1792 + window);
    EXPECT_EQ(allocator.tracker().current(MEM_KV_CACHE), static_cast<size_t>(cache->bytes_reserved()));
    cache->release(0);
    EXPECT_EQ(allocator.tracker().current(MEM_KV_CACHE), static_cast<size_t>(10 * 1792));
  }
  {  // contiguous fp32: 2 regions of 64 positions
    auto cache = make_contiguous_kv_cache(c, 2);
    fill(*cache, cache->add_sequence(), rows, 0, 37);
    EXPECT_EQ(cache->bytes_reserved(), 2 * 64 * 1024);
    EXPECT_EQ(cache->bytes_used(), 37 * 1024);
    EXPECT_EQ(cache->blocks_in_use(), 1);
    EXPECT_EQ(cache->free_blocks(), 1);
  }
}

TEST(KvCacheTest, QuantizedAttentionStaysCloseToFp32) {
  // 8 query heads over 4 kv heads of 16; 200 positions of normal(0, 1) rows; queries
  // normal(0, 2) so that attention is peaked and the outputs are O(1).
  constexpr int64_t H = 8, KV = 4, hd = 16, n = 200;
  KvCacheConfig c;
  c.n_layer = 1;
  c.k_width = c.v_width = KV * hd;
  c.block_size = 16;
  c.num_blocks = 16;
  const Rows rows{KV * hd, KV * hd};
  const std::vector<float> q = query(H * hd, 21, 2.0f);
  const auto run = [&](const KvCacheConfig& config) {
    auto cache = make_paged_kv_cache(config);
    const int64_t seq = cache->add_sequence();
    fill(*cache, seq, rows, 0, n);
    return attend(*cache, seq, 0, q, 0, H, KV, hd);
  };
  const std::vector<float> exact = run(c);
  const std::vector<double> ref(exact.begin(), exact.end());
  KvCacheConfig int8 = c;
  int8.k_format = int8.v_format = KV_INT8;
  int8.group = 16;
  struct Case {
    const char* name;
    KvCacheConfig config;
    double bound;
  };
  KvCacheConfig bf16 = c;
  bf16.k_format = bf16.v_format = KV_BF16;
  // int8, groups of 16 normal values: step s ~ range / 255 ~ 3.5 / 255 = 0.014, rounding errors
  // uniform in +-s/2 (sd s / sqrt(12) = 0.004). A logit moves by |q_h| sd / sqrt(hd) ~ 8 * 0.004 / 4
  // = 0.008 (sd), an output by about that times the O(1) spread of the values it averages, and the
  // largest output is O(1): ~0.005 typical, 0.02 leaves room for the largest of 128 outputs.
  // bf16 rounds to 2^-9 relative (0.002) per element; 0.01 likewise.
  const Case cases[] = {{"bf16", bf16, 0.01},
                        {"int8 per-token", int8, 0.02},
                        {"int4 KIVI", kivi(c, KV_INT4, 16, 0), 0.2},
                        {"int2 KIVI", kivi(c, KV_INT2, 16, 0), 1.0},
                        {"int2 KIVI, residual 32", kivi(c, KV_INT2, 16, 32), 1.0}};
  std::vector<double> errors;
  for (const Case& k : cases) {
    errors.push_back(relative_max_error(run(k.config), ref));
    std::printf("[          ] %-24s attention error (max |out - fp32| / max |fp32|) %.5f\n", k.name, errors.back());
    EXPECT_LT(errors.back(), k.bound) << k.name;
  }
  EXPECT_LT(errors[0], errors[1]);  // fewer bits, more error
  EXPECT_LT(errors[1], errors[2]);
  EXPECT_LT(errors[2], errors[3]);
  EXPECT_LT(errors[4], errors[3]);  // the fp32 residual window helps
}

TEST(KvCacheTest, ForkedQuantizedSequencesMatchUnsharedOnes) {
  // KIVI-2 with a residual window: copy-on-write of blocks quantized after the fork, and the
  // copied fp32 window, give each branch exactly what an unshared cache holding its rows gives.
  const Rows rows{kWidth, kWidth};
  const KvCacheConfig config = kivi(small_config(), KV_INT2, 8, 4);
  auto cache = make_paged_kv_cache(config);
  const int64_t parent = cache->add_sequence();
  fill(*cache, parent, rows, 1, 30);
  const int64_t child = cache->fork(parent);
  EXPECT_EQ(cache->blocks_in_use(), 2);
  fill(*cache, child, rows, 2, 50);
  fill(*cache, parent, rows, 3, 50);
  EXPECT_EQ(cache->block_refcount(child, 0), 2);  // quantized before the fork: still shared
  EXPECT_EQ(cache->block_refcount(child, 16), 1);
  auto alone = make_contiguous_kv_cache(config, 2);
  const int64_t a = alone->add_sequence(), b = alone->add_sequence();
  fill(*alone, a, rows, 1, 30);
  fill(*alone, a, rows, 3, 50);
  fill(*alone, b, rows, 1, 30);
  fill(*alone, b, rows, 2, 50);
  for (int64_t l = 0; l < 2; ++l) {
    const std::vector<float> q = query(kHeads * kHeadDim, 31 + static_cast<uint64_t>(l));
    EXPECT_TRUE(bitwise_equal(attend(*cache, parent, l, q, 0), attend(*alone, a, l, q, 0))) << "layer " << l;
    EXPECT_TRUE(bitwise_equal(attend(*cache, child, l, q, 0), attend(*alone, b, l, q, 0))) << "layer " << l;
  }
}

TEST(KvCacheTest, KiviResidualWindowReadsBackExactly) {
  const Rows rows{kWidth, kWidth};
  KvCacheConfig config = kivi(small_config(), KV_INT2, 8, 32);
  config.num_blocks = 8;
  auto cache = make_paged_kv_cache(config);
  const int64_t seq = cache->add_sequence();
  fill(*cache, seq, rows, 0, 70);
  cache->write(seq, 0, rows.k(0, 0, 70).data(), rows.v(0, 0, 70).data());  // layer 0 holds 71
  const std::vector<uint64_t> tags(71, 0);
  for (int64_t l = 0; l < 2; ++l) {
    const int64_t n = l == 0 ? 71 : 70;
    std::vector<float> K(static_cast<size_t>(n * kWidth)), V(K.size());
    cache->read(seq, l, 0, n, K.data(), V.data());
    const std::vector<float> k_written = rows.stack(tags, l, false), v_written = rows.stack(tags, l, true);
    const auto row_exact = [&](const std::vector<float>& got, const std::vector<float>& want, int64_t p) {
      return std::memcmp(got.data() + p * kWidth, want.data() + p * kWidth, kWidth * sizeof(float)) == 0;
    };
    for (int64_t p = n - 32; p < n; ++p) {
      EXPECT_TRUE(row_exact(K, k_written, p)) << "K layer " << l << " position " << p;
      EXPECT_TRUE(row_exact(V, v_written, p)) << "V layer " << l << " position " << p;
    }
    // Keys leave the window a whole tile at a time: tiles below floor((n - 32) / 16) * 16 = 32.
    for (int64_t p = 32; p < n - 32; ++p) EXPECT_TRUE(row_exact(K, k_written, p)) << "K position " << p;
    EXPECT_FALSE(row_exact(K, k_written, 0));
    EXPECT_FALSE(row_exact(V, v_written, n - 33));
    EXPECT_FALSE(row_exact(K, k_written, 31));
  }
}

TEST(KvCacheTest, MlaLatentCacheReadsBackItsRows) {
  KvCacheConfig config;
  config.n_layer = 2;
  config.k_width = 24;  // latent + decoupled RoPE key; no V rows
  config.block_size = 4;
  config.num_blocks = 8;
  const Rows rows{24, 0};
  for (KvFormat format : {KV_FP32, KV_BF16}) {
    config.k_format = format;
    auto cache = make_paged_kv_cache(config);
    const int64_t seq = cache->add_sequence();
    for (int64_t p = 0; p < 10; ++p) {
      for (int64_t l = 0; l < 2; ++l) cache->write(seq, l, rows.k(0, l, p).data(), nullptr);
      cache->advance(seq);
    }
    std::vector<float> got(7 * 24);
    cache->read(seq, 1, 2, 9, got.data(), nullptr);  // across three blocks
    const std::vector<float> all = rows.stack(std::vector<uint64_t>(10, 0), 1, false);
    for (int64_t i = 0; i < 7 * 24; ++i) {
      const float want = format == KV_FP32 ? all[2 * 24 + i] : bf16_to_f32(f32_to_bf16(all[2 * 24 + i]));
      ASSERT_EQ(got[i], want) << kv_format_name(format) << " element " << i;
    }
    const std::vector<float> q(24, 1.0f);
    std::vector<float> out(24);
    EXPECT_NE(test::error_of([&] { cache->attend(seq, 0, q.data(), out.data(), 1, 1, 24, 0); }).find("needs V rows"),
              std::string::npos);
  }
}

TEST(KvCacheTest, MisuseFailsWithMessagesNamingWhatWasExpected) {
  KvCacheConfig config;
  config.n_layer = 2;
  config.k_width = config.v_width = 4;
  config.block_size = 4;
  config.num_blocks = 2;
  config.max_len = 4;
  const Rows rows{4, 4};
  auto cache = make_paged_kv_cache(config);
  const int64_t seq = cache->add_sequence();
  fill(*cache, seq, rows, 0, 8);
  std::string message = test::error_of([&] { fill(*cache, seq, rows, 0, 9); });
  EXPECT_NE(message.find("kv cache: out of blocks"), std::string::npos) << message;
  EXPECT_NE(message.find("all 2 blocks"), std::string::npos) << message;
  EXPECT_EQ(cache->length(seq), 8);

  message = test::error_of([&] { cache->length(42); });
  EXPECT_NE(message.find("unknown sequence id 42"), std::string::npos) << message;

  const int64_t other = cache->fork(seq);
  message = test::error_of([&] { cache->advance(other); });
  EXPECT_NE(message.find("before layer 0 wrote position 8"), std::string::npos) << message;
  cache->release(other);
  message = test::error_of([&] { cache->write(other, 0, rows.k(0, 0, 0).data(), rows.v(0, 0, 0).data()); });
  EXPECT_NE(message.find("sequence 1 was released"), std::string::npos) << message;

  cache->release(seq);
  const int64_t fresh = cache->add_sequence();
  cache->write(fresh, 0, rows.k(0, 0, 0).data(), rows.v(0, 0, 0).data());
  message = test::error_of([&] { cache->write(fresh, 0, rows.k(0, 0, 0).data(), rows.v(0, 0, 0).data()); });
  EXPECT_NE(message.find("already wrote position 0"), std::string::npos) << message;
  message = test::error_of([&] { cache->write(fresh, 2, rows.k(0, 0, 0).data(), rows.v(0, 0, 0).data()); });
  EXPECT_NE(message.find("layer 2 is outside [0, 2)"), std::string::npos) << message;
  std::vector<float> q(8), out(8);
  message = test::error_of([&] { cache->attend(fresh, 0, q.data(), out.data(), 2, 2, 4, 0); });
  EXPECT_NE(message.find("do not match k_width 4"), std::string::npos) << message;

  auto contiguous = make_contiguous_kv_cache(config, 1);
  const int64_t only = contiguous->add_sequence();
  fill(*contiguous, only, rows, 0, 4);
  message = test::error_of([&] { fill(*contiguous, only, rows, 0, 5); });
  EXPECT_NE(message.find("sequence 0 is full (max_len 4"), std::string::npos) << message;
  message = test::error_of([&] { contiguous->add_sequence(); });
  EXPECT_NE(message.find("all 1 sequence regions"), std::string::npos) << message;

  config.num_blocks = 0;
  message = test::error_of([&] { make_paged_kv_cache(config); });
  EXPECT_NE(message.find("kv_cache.num_blocks must be > 0"), std::string::npos) << message;
  config.num_blocks = 2;
  config.k_format = KV_INT4;
  config.group = 3;
  message = test::error_of([&] { make_paged_kv_cache(config); });
  EXPECT_NE(message.find("group 3 must divide the row width 4"), std::string::npos) << message;
}

}  // namespace
}  // namespace loom
