// The NCCL communicator under `mpirun -np 2` (or more) on a machine with one GPU per rank: every
// collective's values on device tensors against what each rank computes alone on the host, the
// uneven (v) forms with empty segments, point-to-point, split, ordering after work queued on the
// compute stream, the byte ledger against the MPI communicator's for the same calls, and the
// routing communicator sending host tensors to MPI and device tensors to NCCL. Rank r uses GPU
// r % (visible devices); NCCL refuses two ranks of one communicator on one GPU, so every test
// skips when there are fewer devices than ranks. On a one-GPU machine `mpirun -np 1` still runs
// every test but point-to-point on a one-rank NCCL communicator (streams, events, groups, split,
// errors, ledger). Data moves with cudaMemcpy on the legacy default stream, which is also the
// compute stream handed to the communicator. Not part of loom_tests: it needs mpirun, CUDA, NCCL.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/comm/nccl_communicator.h"
#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/core/tensor.h"

namespace loom {
namespace {

void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw Error(str_cat(what, ": ", cudaGetErrorString(status)));
}

// Device memory for the tests' tensors (cudaMalloc / cudaFree / cudaMemset).
class TestCudaAllocator final : public Allocator {
 public:
  DeviceType device() const override { return DEVICE_CUDA; }
  void* raw_allocate(size_t bytes) override {
    void* ptr = nullptr;
    cuda_ok(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes), "cudaMalloc");
    return ptr;
  }
  void raw_release(void* ptr, size_t) override { cudaFree(ptr); }
  void raw_zero(void* ptr, size_t bytes) override { cuda_ok(cudaMemset(ptr, 0, bytes), "cudaMemset"); }
};

void* dev_ptr(const Tensor& t) { return t.device_ptr(); }

template <typename T>
void upload(const Tensor& t, const std::vector<T>& host) {
  LOOM_CHECK(static_cast<int64_t>(host.size()) == t.numel() && dtype_of<T>() == t.dtype(), "upload: ", host.size(),
             " values for ", t.describe());
  cuda_ok(cudaMemcpy(dev_ptr(t), host.data(), t.nbytes(), cudaMemcpyHostToDevice), "cudaMemcpy to device");
}

template <typename T>
std::vector<T> download(const Tensor& t) {
  LOOM_CHECK(dtype_of<T>() == t.dtype(), "download: ", t.describe());
  std::vector<T> host(static_cast<size_t>(t.numel()));
  cuda_ok(cudaMemcpy(host.data(), dev_ptr(t), t.nbytes(), cudaMemcpyDeviceToHost), "cudaMemcpy to host");
  return host;
}

std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out;
  for (float x : v) out.push_back(f32_to_bf16(x));
  return out;
}

// One MPI communicator and one NCCL communicator over the world, made once for all tests
// (NCCL's setup takes seconds), released before MPI finalizes.
class NcclComm : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    mpi = make_mpi_communicator();
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
    // Every rank must take the same decision, or the others wait forever in ncclCommInitRank.
    CpuAllocator local;
    int ok = 0;
    {
      Tensor flag = Tensor::zeros(local, {1}, DTYPE_I32, MEM_WORKSPACE);
      flag.data<int32_t>()[0] = devices >= mpi->size() ? 1 : 0;
      mpi->all_reduce(flag, REDUCE_MIN);
      ok = flag.data<int32_t>()[0];
    }
    if (!ok) {
      skip_reason = str_cat("needs one GPU per rank (NCCL refuses two ranks of one communicator on one GPU): ",
                            "rank ", mpi->rank(), " sees ", devices, " CUDA devices for ", mpi->size(),
                            " ranks; on one GPU run mpirun -np 1");
      return;
    }
    device = mpi->rank() % devices;
    cuda_ok(cudaSetDevice(device), "cudaSetDevice");
    try {
      nccl = make_nccl_communicator(*mpi, device, nullptr);
    } catch (const std::exception& e) {
      setup_error = e.what();
    }
  }
  static void TearDownTestSuite() {
    nccl.reset();
    mpi.reset();
  }
  void SetUp() override {
    if (!skip_reason.empty()) GTEST_SKIP() << skip_reason;
    ASSERT_TRUE(setup_error.empty()) << "make_nccl_communicator: " << setup_error;
    r = nccl->rank(), n = nccl->size();
  }

  Tensor dev(int64_t numel, DType dtype = DTYPE_F32) {
    return Tensor::zeros(gpu, {numel}, dtype, MEM_COMMUNICATION);
  }
  Tensor host(int64_t numel, DType dtype = DTYPE_F32) {
    return Tensor::zeros(cpu, {numel}, dtype, MEM_COMMUNICATION);
  }

  static std::unique_ptr<Communicator> mpi, nccl;
  static std::string skip_reason, setup_error;
  static int device;
  TestCudaAllocator gpu;
  CpuAllocator cpu;
  int r = 0, n = 1;
};

std::unique_ptr<Communicator> NcclComm::mpi, NcclComm::nccl;
std::string NcclComm::skip_reason, NcclComm::setup_error;
int NcclComm::device = 0;

TEST_F(NcclComm, AllReduceSumAndMaxOnF32) {
  Tensor x = dev(1000), y = dev(7);
  std::vector<float> xs(1000), ys(7);
  for (int64_t i = 0; i < 1000; ++i) xs[i] = static_cast<float>(r * 1000 + i);
  for (int64_t i = 0; i < 7; ++i) ys[i] = static_cast<float>(r == n - 1 ? 100 + i : i);
  upload(x, xs);
  upload(y, ys);
  nccl->all_reduce(x);
  nccl->all_reduce(y, REDUCE_MAX);
  const std::vector<float> xr = download<float>(x), yr = download<float>(y);
  for (int64_t i = 0; i < 1000; ++i) EXPECT_EQ(xr[i], static_cast<float>(1000 * n * (n - 1) / 2 + n * i)) << i;
  for (int64_t i = 0; i < 7; ++i) EXPECT_EQ(yr[i], static_cast<float>(100 + i)) << i;
}

// Small integers: every partial sum is exact in bf16, so the result is exact too.
TEST_F(NcclComm, AllReduceSumAndMaxOnBf16) {
  const int64_t len = 64;
  Tensor x = dev(len, DTYPE_BF16), y = dev(len, DTYPE_BF16);
  std::vector<float> xs(len), ys(len);
  for (int64_t i = 0; i < len; ++i) {
    xs[i] = static_cast<float>(r + i % 8);
    ys[i] = static_cast<float>(r == n - 1 ? 100 + i % 4 : i % 4);
  }
  upload(x, to_bf16(xs));
  upload(y, to_bf16(ys));
  nccl->all_reduce(x);
  nccl->all_reduce(y, REDUCE_MAX);
  const std::vector<bf16> xr = download<bf16>(x), yr = download<bf16>(y);
  for (int64_t i = 0; i < len; ++i) {
    EXPECT_EQ(bf16_to_f32(xr[i]), static_cast<float>(n * (n - 1) / 2 + n * (i % 8))) << i;
    EXPECT_EQ(bf16_to_f32(yr[i]), static_cast<float>(100 + i % 4)) << i;
  }
}

TEST_F(NcclComm, ReduceScatterThenAllGather) {
  const int64_t chunk = 13;
  Tensor full = dev(chunk * n), shard = dev(chunk);
  std::vector<float> fs(static_cast<size_t>(chunk * n));
  for (int64_t j = 0; j < chunk * n; ++j) fs[j] = static_cast<float>(r + j);
  upload(full, fs);
  nccl->reduce_scatter(full, shard);
  const std::vector<float> got = download<float>(shard);
  for (int64_t i = 0; i < chunk; ++i) {  // sum over ranks q of (q + r*chunk + i)
    EXPECT_EQ(got[i], static_cast<float>(n * (n - 1) / 2 + n * (r * chunk + i))) << i;
  }
  std::vector<float> ss(chunk);
  for (int64_t i = 0; i < chunk; ++i) ss[i] = static_cast<float>(r * 100 + i);
  upload(shard, ss);
  nccl->all_gather(shard, full);
  const std::vector<float> gathered = download<float>(full);
  for (int q = 0; q < n; ++q) {
    for (int64_t i = 0; i < chunk; ++i) EXPECT_EQ(gathered[q * chunk + i], static_cast<float>(q * 100 + i));
  }
}

TEST_F(NcclComm, BroadcastFromTheLastRank) {
  Tensor x = dev(9);
  const int root = n - 1;
  std::vector<float> xs(9, -1.0f);
  if (r == root) {
    for (int64_t i = 0; i < 9; ++i) xs[i] = static_cast<float>(42 + i);
  }
  upload(x, xs);
  nccl->broadcast(x, root);
  const std::vector<float> got = download<float>(x);
  for (int64_t i = 0; i < 9; ++i) EXPECT_EQ(got[i], static_cast<float>(42 + i)) << i;
}

TEST_F(NcclComm, AllToAllTransposesChunks) {
  const int64_t chunk = 5;
  Tensor in = dev(chunk * n), out = dev(chunk * n);
  std::vector<float> is(static_cast<size_t>(chunk * n));
  for (int j = 0; j < n; ++j) {
    for (int64_t i = 0; i < chunk; ++i) is[j * chunk + i] = static_cast<float>(r * 1000 + j * 10 + i);
  }
  upload(in, is);
  nccl->all_to_all(in, out);
  const std::vector<float> got = download<float>(out);
  for (int q = 0; q < n; ++q) {
    for (int64_t i = 0; i < chunk; ++i) EXPECT_EQ(got[q * chunk + i], static_cast<float>(q * 1000 + r * 10 + i));
  }
}

// Overlapping views of one buffer race inside NCCL: refused, not only the same start (found by
// the CUDA simulator's NCCL, which checks every call's buffers).
TEST_F(NcclComm, AllToAllRefusesOverlappingViews) {
  const int64_t chunk = 4;
  Tensor both = dev(chunk * n + 1);
  upload(both, std::vector<float>(static_cast<size_t>(chunk * n + 1), 1.0f));
  const Tensor in = both.view(0, {chunk * n}), out = both.view(1, {chunk * n});
  std::string error;
  try {
    nccl->all_to_all(in, out);
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("all_to_all on rank " + std::to_string(r) + ": in and out must be separate buffers (they overlap)"),
            std::string::npos)
      << error;
}

// Segment q holds 2q + 3 elements, except every third from q = 1, which is empty (rank 1's).
std::vector<int64_t> uneven_counts(int n) {
  std::vector<int64_t> c;
  for (int q = 0; q < n; ++q) c.push_back(q % 3 == 1 ? 0 : 2 * q + 3);
  return c;
}

TEST_F(NcclComm, ReduceScatterVAndAllGatherVWithUnevenAndEmptySegments) {
  const std::vector<int64_t> counts = uneven_counts(n);
  std::vector<int64_t> first(n, 0);
  for (int q = 1; q < n; ++q) first[q] = first[q - 1] + counts[q - 1];
  const int64_t total = first[n - 1] + counts[n - 1];
  Tensor x = dev(total);
  std::vector<float> xs(static_cast<size_t>(total));
  for (int64_t j = 0; j < total; ++j) xs[j] = static_cast<float>(r + j);
  upload(x, xs);
  nccl->reduce_scatter_v_async(x, counts, REDUCE_SUM)->wait();
  std::vector<float> got = download<float>(x);
  for (int64_t j = first[r]; j < first[r] + counts[r]; ++j) {
    EXPECT_EQ(got[j], static_cast<float>(n * (n - 1) / 2 + n * j)) << j;
  }
  for (int64_t k = 0; k < counts[r]; ++k) got[first[r] + k] = static_cast<float>(r * 100 + k);
  upload(x, got);
  nccl->all_gather_v_async(x, counts)->wait();
  const std::vector<float> gathered = download<float>(x);
  for (int q = 0; q < n; ++q) {
    for (int64_t k = 0; k < counts[q]; ++k) EXPECT_EQ(gathered[first[q] + k], static_cast<float>(q * 100 + k)) << q;
  }
}

// Rank p sends (p + 2q + 1) % 3 elements to rank q: uneven, with empty messages (0 -> 1), and
// one element to itself from rank 0.
int64_t a2a_count(int p, int q) { return (p + 2 * q + 1) % 3; }

TEST_F(NcclComm, AllToAllVWithUnevenAndEmptyMessages) {
  std::vector<int64_t> send_counts, recv_counts;
  for (int q = 0; q < n; ++q) send_counts.push_back(a2a_count(r, q)), recv_counts.push_back(a2a_count(q, r));
  int64_t send_total = 0, recv_total = 0;
  for (int q = 0; q < n; ++q) send_total += send_counts[q], recv_total += recv_counts[q];
  Tensor in = dev(send_total), out = dev(recv_total);
  std::vector<float> is;
  for (int q = 0; q < n; ++q) {
    for (int64_t k = 0; k < send_counts[q]; ++k) is.push_back(static_cast<float>(r * 1000 + q * 10 + k));
  }
  upload(in, is);
  nccl->all_to_all_v_async(in, send_counts, out, recv_counts)->wait();
  const std::vector<float> got = download<float>(out);
  size_t at = 0;
  for (int p = 0; p < n; ++p) {
    for (int64_t k = 0; k < recv_counts[p]; ++k) EXPECT_EQ(got[at++], static_cast<float>(p * 1000 + r * 10 + k)) << p;
  }
}

TEST_F(NcclComm, SendRecvBlockingAndAsyncThenBarrier) {
  if (n < 2) GTEST_SKIP() << "point-to-point needs 2 ranks";
  // A ring: even ranks send first, odd ranks receive first (context_parallel's ring_shift).
  Tensor out = dev(3), in = dev(3);
  upload(out, std::vector<float>{static_cast<float>(r * 10), static_cast<float>(r * 10 + 1),
                                 static_cast<float>(r * 10 + 2)});
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  if (r % 2 == 0) {
    nccl->send(out, next, 7);
    nccl->recv(in, prev, 7);
  } else {
    nccl->recv(in, prev, 7);
    nccl->send(out, next, 7);
  }
  const std::vector<float> got = download<float>(in);
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(got[i], static_cast<float>(prev * 10 + i));
  // Non-blocking: rank 2k sends to 2k + 1, which receives; the sender waits afterwards.
  Tensor big = dev(1 << 20);
  if (r % 2 == 0 && r + 1 < n) {
    upload(big, std::vector<float>(1 << 20, static_cast<float>(r + 0.5f)));
    auto work = nccl->send_async(big, r + 1, 3);
    work->wait();
  } else if (r % 2 == 1) {
    nccl->recv(big, r - 1, 3);
    const std::vector<float> b = download<float>(big);
    EXPECT_EQ(b.front(), static_cast<float>(r - 1 + 0.5f));
    EXPECT_EQ(b.back(), static_cast<float>(r - 1 + 0.5f));
  }
  nccl->barrier();
}

// The collective's stream waits for what the compute stream (here the legacy default stream)
// has queued: an asynchronous memset issued just before the all-reduce is already in its input.
TEST_F(NcclComm, CollectivesWaitForWorkQueuedOnTheComputeStream) {
  const int64_t len = int64_t{1} << 22;
  Tensor x = dev(len, DTYPE_I32);
  cuda_ok(cudaMemsetAsync(dev_ptr(x), 0x01, x.nbytes(), nullptr), "cudaMemsetAsync");  // every int 0x01010101
  nccl->all_reduce(x);
  const std::vector<int32_t> got = download<int32_t>(x);
  EXPECT_EQ(got.front(), n * 0x01010101);
  EXPECT_EQ(got[len / 2], n * 0x01010101);
  EXPECT_EQ(got.back(), n * 0x01010101);
}

TEST_F(NcclComm, AsyncAllReducesOverlap) {
  std::vector<Tensor> buckets;
  std::vector<std::unique_ptr<CommWork>> work;
  for (int b = 0; b < 4; ++b) {
    buckets.push_back(dev(1 << 12));
    upload(buckets.back(), std::vector<float>(1 << 12, static_cast<float>(b + r)));
    work.push_back(nccl->all_reduce_async(buckets.back(), REDUCE_SUM));  // all four in flight
  }
  for (auto& w : work) w->wait();
  for (int b = 0; b < 4; ++b) {
    EXPECT_EQ(download<float>(buckets[b])[123], static_cast<float>(n * b + n * (n - 1) / 2)) << b;
  }
}

// split(0, n - r) keeps every rank in reverse order; split(r % 2, r) groups ranks by parity.
TEST_F(NcclComm, SplitOrdersByKeyAndGroupsByColor) {
  auto reversed = nccl->split(0, n - r);
  ASSERT_EQ(reversed->size(), n);
  EXPECT_EQ(reversed->rank(), n - 1 - r);
  EXPECT_EQ(reversed->name(), "nccl");
  Tensor x = dev(4);
  upload(x, std::vector<float>(4, static_cast<float>(r == n - 1 ? 9 : -1)));
  reversed->broadcast(x, 0);  // the reversed group's rank 0 is world rank n - 1
  EXPECT_EQ(download<float>(x)[3], 9.0f);

  auto parity = nccl->split(r % 2, r);
  EXPECT_EQ(parity->size(), (n - r % 2 + 1) / 2);
  EXPECT_EQ(parity->rank(), r / 2);
  upload(x, std::vector<float>(4, static_cast<float>(r)));
  parity->all_reduce(x);
  float expected = 0.0f;
  for (int q = r % 2; q < n; q += 2) expected += static_cast<float>(q);
  EXPECT_EQ(download<float>(x)[0], expected);
  EXPECT_THROW(nccl->split(-1, r), Error);  // fails on every rank before NCCL is called
}

// The same calls, once over MPI on host tensors and once over NCCL on device tensors, book
// the same ledger.
TEST_F(NcclComm, LedgerEqualsTheMpiLedgerForTheSameCalls) {
  auto calls = [&](Communicator& c, auto make) {
    const int64_t chunk = 1024;
    Tensor full = make(chunk * n), shard = make(chunk), in = make(chunk * n), out = make(chunk * n);
    c.reset_ledger();
    c.all_reduce(full);
    c.reduce_scatter(full, shard);
    c.all_gather(shard, full);
    c.all_to_all(in, out);
    c.broadcast(shard, n - 1);
    const std::vector<int64_t> counts = uneven_counts(n);
    int64_t total = 0;
    for (int64_t k : counts) total += k;
    Tensor v = make(total);
    c.reduce_scatter_v_async(v, counts, REDUCE_SUM)->wait();
    c.all_gather_v_async(v, counts)->wait();
    std::vector<int64_t> sc, rc;
    int64_t st = 0, rt = 0;
    for (int q = 0; q < n; ++q) {
      sc.push_back(a2a_count(r, q)), rc.push_back(a2a_count(q, r));
      st += sc.back(), rt += rc.back();
    }
    Tensor a = make(st), b = make(rt);
    c.all_to_all_v_async(a, sc, b, rc)->wait();
    if (n > 1 && r == 0) c.send(shard, 1, 5);
    if (n > 1 && r == 1) c.recv(shard, 0, 5);
    c.barrier();
    return c.ledger();
  };
  const ByteLedger over_mpi = calls(*mpi, [&](int64_t numel) { return host(numel); });
  const ByteLedger over_nccl = calls(*nccl, [&](int64_t numel) { return dev(numel); });
  for (int k = 0; k < COLL_COUNT; ++k) {
    const char* what = collective_name(static_cast<Collective>(k));
    EXPECT_EQ(over_nccl.sent[k], over_mpi.sent[k]) << what;
    EXPECT_EQ(over_nccl.received[k], over_mpi.received[k]) << what;
    EXPECT_EQ(over_nccl.calls[k], over_mpi.calls[k]) << what;
  }
  if (n > 1) {
    EXPECT_GT(over_nccl.total_sent(), 0);
  }
}

TEST_F(NcclComm, RoutingSendsHostTensorsToMpiAndDeviceTensorsToNccl) {
  auto host_side = make_mpi_communicator();
  auto device_side = nccl->split(0, r);  // the world again, owned by the routing communicator
  Communicator* mpi_inner = host_side.get();
  Communicator* nccl_inner = device_side.get();
  auto routing = make_routing_communicator(std::move(host_side), std::move(device_side));
  EXPECT_EQ(routing->rank(), r);
  EXPECT_EQ(routing->size(), n);
  EXPECT_EQ(routing->name(), "mpi+nccl");
  mpi_inner->reset_ledger();
  nccl_inner->reset_ledger();

  Tensor h = host(10);
  for (int64_t i = 0; i < 10; ++i) h.data<float>()[i] = static_cast<float>(r + i);
  routing->all_reduce(h);
  EXPECT_EQ(h.data<float>()[4], static_cast<float>(n * (n - 1) / 2 + n * 4));
  EXPECT_EQ(mpi_inner->ledger().calls[COLL_ALL_REDUCE], 1);
  EXPECT_EQ(nccl_inner->ledger().calls[COLL_ALL_REDUCE], 0);

  Tensor d = dev(10);
  upload(d, std::vector<float>(10, static_cast<float>(r + 1)));
  routing->all_reduce(d);
  EXPECT_EQ(download<float>(d)[9], static_cast<float>(n * (n + 1) / 2));
  EXPECT_EQ(mpi_inner->ledger().calls[COLL_ALL_REDUCE], 1);
  EXPECT_EQ(nccl_inner->ledger().calls[COLL_ALL_REDUCE], 1);
  EXPECT_EQ(routing->ledger().calls[COLL_ALL_REDUCE], 2);
  EXPECT_EQ(routing->ledger().sent[COLL_ALL_REDUCE], 2 * (2 * (n - 1) * 40 / n));

  Tensor shard = host(10), full = dev(10 * n);
  EXPECT_THROW(routing->all_gather(shard, full), Error);  // one call, two devices
  auto sub = routing->split(0, r);
  EXPECT_EQ(sub->size(), n);
  sub->barrier();
}

TEST_F(NcclComm, HostTensorsAndMisshapenChunksAreOneLineErrors) {
  Tensor h = host(8);
  try {
    nccl->all_reduce(h);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce on rank " + std::to_string(r)), std::string::npos) << e.what();
  }
  Tensor full = dev(10 * n + 1), shard = dev(10);
  try {
    nccl->reduce_scatter(full, shard);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("reduce_scatter on rank " + std::to_string(r)), std::string::npos) << e.what();
  }
  nccl->barrier();  // every rank failed before calling NCCL: the communicator still works
}

}  // namespace
}  // namespace loom
