// The single-process communicator: collectives are identities or copies, and the ledger books
// calls but no bytes (nothing leaves the process).
#include <gtest/gtest.h>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/core/error.h"
#include "test_util.h"

namespace loom {
namespace {

TEST(LocalComm, CollectivesOfOneRank) {
  auto comm = make_local_communicator();
  auto backend = make_cpu_backend();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  Tensor x = test::random_tensor(backend->allocator(), {17}, DTYPE_F32, 1);
  const std::vector<double> before = test::values(x);
  comm->all_reduce(x);
  EXPECT_EQ(test::values(x), before);
  Tensor y = Tensor::zeros(backend->allocator(), {17}, DTYPE_F32, MEM_WORKSPACE);
  comm->reduce_scatter(x, y);
  EXPECT_EQ(test::values(y), before);
  Tensor z = Tensor::zeros(backend->allocator(), {17}, DTYPE_F32, MEM_WORKSPACE);
  comm->all_gather(y, z);
  EXPECT_EQ(test::values(z), before);
  EXPECT_EQ(comm->ledger().calls[COLL_ALL_REDUCE], 1);
  EXPECT_EQ(comm->ledger().total_sent(), 0);
  Tensor bad = Tensor::zeros(backend->allocator(), {16}, DTYPE_F32, MEM_WORKSPACE);
  EXPECT_THROW(comm->reduce_scatter(x, bad), Error);
  EXPECT_THROW(comm->send(x, 1), Error);
}

}  // namespace
}  // namespace loom
