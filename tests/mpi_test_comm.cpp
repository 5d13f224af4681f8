// The MPI communicator under `mpirun -np 2` and `-np 4` (ctest runs both): every collective's
// values against the formula each rank can compute alone, asynchronous handles in flight
// together, the byte ledger's ring formulas, and one-line errors. Not part of loom_tests: it
// needs mpirun.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include <vector>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/comm/device_mesh.h"
#include "loom/arch/param_layout.h"
#include "loom/arch/config.h"
#include "loom/parallel/compress.h"
#include "loom/core/error.h"
#include "mpi_fixture.h"

namespace loom {
namespace {

using Fixture = MpiFixture;

TEST(MpiComm, AllReduceSumAndMax) {
  Fixture f;
  ASSERT_GT(f.n, 1) << "run under mpirun -np 2 or more";
  Tensor x = f.f32(1000), y = f.f32(7);
  for (int64_t i = 0; i < 1000; ++i) x.data<float>()[i] = static_cast<float>(f.r * 1000 + i);
  for (int64_t i = 0; i < 7; ++i) y.data<float>()[i] = static_cast<float>(f.r == 1 ? 100 + i : i);
  f.comm->all_reduce(x);
  f.comm->all_reduce(y, REDUCE_MAX);
  for (int64_t i = 0; i < 1000; ++i) {
    EXPECT_EQ(x.data<float>()[i], static_cast<float>(1000 * f.n * (f.n - 1) / 2 + f.n * i)) << i;
  }
  for (int64_t i = 0; i < 7; ++i) EXPECT_EQ(y.data<float>()[i], static_cast<float>(100 + i));
}

TEST(MpiComm, ReduceScatterAndAllGatherAreInverseShapes) {
  Fixture f;
  const int64_t chunk = 13;
  Tensor full = f.f32(chunk * f.n), shard = f.f32(chunk);
  for (int64_t j = 0; j < chunk * f.n; ++j) full.data<float>()[j] = static_cast<float>(f.r + j);
  f.comm->reduce_scatter(full, shard);
  for (int64_t i = 0; i < chunk; ++i) {  // sum over ranks q of (q + r*chunk + i)
    EXPECT_EQ(shard.data<float>()[i], static_cast<float>(f.n * (f.n - 1) / 2 + f.n * (f.r * chunk + i))) << i;
  }
  for (int64_t i = 0; i < chunk; ++i) shard.data<float>()[i] = static_cast<float>(f.r * 100 + i);
  f.comm->all_gather(shard, full);
  for (int q = 0; q < f.n; ++q) {
    for (int64_t i = 0; i < chunk; ++i) EXPECT_EQ(full.data<float>()[q * chunk + i], static_cast<float>(q * 100 + i));
  }
}

TEST(MpiComm, AllToAllTransposesChunks) {
  Fixture f;
  const int64_t chunk = 5;
  Tensor in = f.f32(chunk * f.n), out = f.f32(chunk * f.n);
  for (int j = 0; j < f.n; ++j) {
    for (int64_t i = 0; i < chunk; ++i) in.data<float>()[j * chunk + i] = static_cast<float>(f.r * 1000 + j * 10 + i);
  }
  f.comm->all_to_all(in, out);
  for (int q = 0; q < f.n; ++q) {
    for (int64_t i = 0; i < chunk; ++i) {
      EXPECT_EQ(out.data<float>()[q * chunk + i], static_cast<float>(q * 1000 + f.r * 10 + i));
    }
  }
}

TEST(MpiComm, BroadcastSendRecvAndBarrier) {
  Fixture f;
  Tensor x = f.f32(9);
  const int root = f.n - 1;
  if (f.r == root) {
    for (int64_t i = 0; i < 9; ++i) x.data<float>()[i] = static_cast<float>(42 + i);
  }
  f.comm->broadcast(x, root);
  for (int64_t i = 0; i < 9; ++i) EXPECT_EQ(x.data<float>()[i], static_cast<float>(42 + i));
  // A ring: even ranks send first, odd ranks receive first.
  Tensor out = f.f32(3), in = f.f32(3);
  for (int64_t i = 0; i < 3; ++i) out.data<float>()[i] = static_cast<float>(f.r * 10 + i);
  const int next = (f.r + 1) % f.n, prev = (f.r + f.n - 1) % f.n;
  if (f.r % 2 == 0) {
    f.comm->send(out, next, 7);
    f.comm->recv(in, prev, 7);
  } else {
    f.comm->recv(in, prev, 7);
    f.comm->send(out, next, 7);
  }
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(in.data<float>()[i], static_cast<float>(prev * 10 + i));
  f.comm->barrier();
}

TEST(MpiComm, AsyncCollectivesOverlap) {
  Fixture f;
  std::vector<Tensor> buckets;
  std::vector<std::unique_ptr<CommWork>> work;
  for (int b = 0; b < 4; ++b) {
    buckets.push_back(f.f32(1 << 12));
    for (int64_t i = 0; i < (1 << 12); ++i) buckets.back().data<float>()[i] = static_cast<float>(b + f.r);
    work.push_back(f.comm->all_reduce_async(buckets.back(), REDUCE_SUM));  // all four in flight
  }
  for (auto& w : work) w->wait();
  for (int b = 0; b < 4; ++b) EXPECT_EQ(buckets[b].data<float>()[123], static_cast<float>(f.n * b + f.n * (f.n - 1) / 2));
}

TEST(MpiComm, LedgerFollowsTheRingFormulas) {
  Fixture f;
  const int64_t chunk = 1024, bytes = 4 * chunk * f.n;
  Tensor full = f.f32(chunk * f.n), shard = f.f32(chunk);
  f.comm->reset_ledger();
  f.comm->all_reduce(full);
  f.comm->reduce_scatter(full, shard);
  f.comm->all_gather(shard, full);
  const ByteLedger& l = f.comm->ledger();
  EXPECT_EQ(l.sent[COLL_ALL_REDUCE], 2 * (f.n - 1) * bytes / f.n);
  EXPECT_EQ(l.received[COLL_ALL_REDUCE], 2 * (f.n - 1) * bytes / f.n);
  EXPECT_EQ(l.sent[COLL_REDUCE_SCATTER], (f.n - 1) * bytes / f.n);
  EXPECT_EQ(l.sent[COLL_ALL_GATHER], (f.n - 1) * bytes / f.n);
  // ZeRO's accounting: reduce-scatter + all-gather move what one all-reduce moves.
  EXPECT_EQ(l.sent[COLL_REDUCE_SCATTER] + l.sent[COLL_ALL_GATHER], l.sent[COLL_ALL_REDUCE]);
  EXPECT_EQ(l.calls[COLL_ALL_REDUCE], 1);
}

// Mesh groups: on 4 ranks as dp=2 x tp=2 the tp groups are {0,1}, {2,3} and the dp groups
// {0,2}, {1,3}; a collective in a group sums only its members.
TEST(MpiComm, MeshGroupsReduceInsideTheirGroup) {
  Fixture f;
  if (f.n != 4) GTEST_SKIP() << "needs 4 ranks";
  const DeviceMesh mesh(4, {{"dp", 2}, {"tp", 2}});
  auto tp = mesh_group(*f.comm, mesh, "tp");
  auto dp = mesh_group(*f.comm, mesh, "dp");
  EXPECT_EQ(tp->size(), 2);
  EXPECT_EQ(tp->rank(), mesh.coord(f.r, "tp"));
  EXPECT_EQ(dp->rank(), mesh.coord(f.r, "dp"));
  Tensor x = f.f32(3);
  x.data<float>()[0] = static_cast<float>(1 << f.r);
  tp->all_reduce(x);
  EXPECT_EQ(x.data<float>()[0], static_cast<float>(f.r < 2 ? 1 + 2 : 4 + 8));
  x.data<float>()[0] = static_cast<float>(1 << f.r);
  dp->all_reduce(x);
  EXPECT_EQ(x.data<float>()[0], static_cast<float>(f.r % 2 == 0 ? 1 + 4 : 2 + 8));
}

// Every compression hook's wire bytes, per rank and call, equal its formula (compress.h).
TEST(MpiComm, CompressionWireBytesFollowTheFormulas) {
  Fixture f;
  const int64_t n = 1000, N = f.n;  // not a multiple of 32 or 4
  auto bytes_of = [&](GradCompressor& c) {
    Tensor g = f.f32(n);
    for (int64_t i = 0; i < n; ++i) g.data<float>()[i] = std::sin(0.37f * static_cast<float>(i + 17 * f.r));
    f.comm->reset_ledger();
    c.reduce(*f.comm, g, 0);
    return f.comm->ledger().total_sent();
  };
  Backend& a = *f.backend;
  const int64_t k = 50;  // floor(0.05 n)
  EXPECT_EQ(bytes_of(*make_topk_compressor(a, n, 0.05)), (N - 1) * k * 8);
  EXPECT_EQ(bytes_of(*make_dgc_compressor(a, n, DgcOptions{0.05, 0.9, 0.0, 0})), (N - 1) * k * 8);
  EXPECT_EQ(bytes_of(*make_onebit_compressor(a, n)), (N - 1) * (4 * ((n + 31) / 32) + 4));
  EXPECT_EQ(bytes_of(*make_qsgd_compressor(a, n, 127, 3)), (N - 1) * (4 * ((n + 3) / 4) + 4));
  // PowerSGD on a whole model's gradient: per matrix two all-reduces of (rows + cols) r floats,
  // vectors all-reduced dense.
  const ParamLayout layout = build_param_layout(model_preset("gpt2-tiny"));
  int64_t floats = 0, dense = 0;
  for (const ParamSpec& p : layout.params) {
    if (p.shape.size() != 2) {
      dense += p.numel;
      continue;
    }
    const int64_t rows = p.shape[0], cols = p.numel / rows, r = std::min<int64_t>(4, std::min(rows, cols));
    floats += (rows + cols) * r;
  }
  auto psgd = make_powersgd_compressor(a, layout, 4, 5);
  Tensor g = f.f32(layout.total);
  for (int64_t i = 0; i < layout.total; ++i) g.data<float>()[i] = std::cos(0.11f * static_cast<float>(i + f.r));
  f.comm->reset_ledger();
  psgd->reduce(*f.comm, g, 0);
  EXPECT_EQ(f.comm->ledger().total_sent(), 2 * (N - 1) * 4 * (floats + dense) / N);
  EXPECT_LT(floats + dense, layout.total / 2);  // it compresses
}

TEST(MpiComm, MisshapenChunksAndBf16ReductionsAreOneLineErrors) {
  Fixture f;
  Tensor full = f.f32(10 * f.n + 1), shard = f.f32(10);
  try {
    f.comm->reduce_scatter(full, shard);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("reduce_scatter on rank " + std::to_string(f.r)), std::string::npos) << e.what();
  }
  Tensor b = Tensor::zeros(f.backend->allocator(), {8}, DTYPE_BF16, MEM_WORKSPACE);
  EXPECT_THROW(f.comm->all_reduce(b), Error);
}

}  // namespace
}  // namespace loom
