#include "loom/comm/communicator.h"

#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>

#include "loom/core/env.h"
#include "loom/core/error.h"

namespace loom {

const char* collective_name(Collective c) {
  static constexpr const char* names[COLL_COUNT] = {"all_reduce", "reduce_scatter", "all_gather",
                                                    "all_to_all", "broadcast",      "send_recv"};
  return c < COLL_COUNT ? names[c] : "?";
}

int64_t ByteLedger::total_sent() const {
  int64_t t = 0;
  for (int64_t v : sent) t += v;
  return t;
}

int64_t ByteLedger::total_received() const {
  int64_t t = 0;
  for (int64_t v : received) t += v;
  return t;
}

void Communicator::book(Collective c, int64_t bytes, int root) {
  const int64_t n = size();
  ledger_.calls[c] += 1;
  if (n == 1) return;  // nothing leaves the process
  int64_t out = 0, in = 0;
  switch (c) {
    case COLL_ALL_REDUCE: out = in = 2 * (n - 1) * bytes / n; break;  // reduce-scatter + all-gather rings
    case COLL_REDUCE_SCATTER:
    case COLL_ALL_GATHER:
    case COLL_ALL_TO_ALL: out = in = (n - 1) * bytes / n; break;  // bytes = the full buffer
    case COLL_BROADCAST:
      out = rank() == root ? bytes : 0;
      in = rank() == root ? 0 : bytes;
      break;
    case COLL_SEND_RECV: out = bytes; break;  // recv books with root = -2: received
    case COLL_COUNT: break;
  }
  if (c == COLL_SEND_RECV && root == -2) std::swap(out, in);
  ledger_.sent[c] += out;
  ledger_.received[c] += in;
}

void Communicator::check_chunks(const char* op, const Tensor& full, const Tensor& shard) const {
  LOOM_CHECK(full.dtype() == shard.dtype(), op, " on rank ", rank(), ": dtypes differ (", full.describe(), " vs ",
             shard.describe(), ")");
  LOOM_CHECK(full.numel() == shard.numel() * size(), op, " on rank ", rank(), ": the full buffer ", full.describe(),
             " must hold ", size(), " chunks of ", shard.numel(), " elements (pad to a multiple of the world size)");
}

int64_t Communicator::check_counts(const char* op, const Tensor& x, const std::vector<int64_t>& counts) const {
  LOOM_CHECK(static_cast<int>(counts.size()) == size(), op, " on rank ", rank(), ": ", counts.size(),
             " segment counts for ", size(), " ranks");
  int64_t sum = 0, own = 0;
  for (int r = 0; r < size(); ++r) {
    LOOM_CHECK(counts[r] >= 0, op, " on rank ", rank(), ": negative count ", counts[r], " for rank ", r);
    if (r == rank()) own = sum;
    sum += counts[r];
  }
  LOOM_CHECK(sum == x.numel(), op, " on rank ", rank(), ": counts sum to ", sum, ", the buffer ", x.describe(),
             " has ", x.numel(), " elements");
  return own;
}

void Communicator::book_v(Collective c, int64_t full_bytes, int64_t own_bytes) {
  ledger_.calls[c] += 1;
  if (size() == 1) return;
  ledger_.sent[c] += full_bytes - own_bytes;
  ledger_.received[c] += full_bytes - own_bytes;
}

void Communicator::book_sent_received(Collective c, int64_t sent, int64_t received) {
  ledger_.calls[c] += 1;
  ledger_.sent[c] += sent;
  ledger_.received[c] += received;
}

void Communicator::check_all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_counts, const Tensor& out,
                                      const std::vector<int64_t>& recv_counts) const {
  LOOM_CHECK(in.dtype() == out.dtype(), "all_to_all_v on rank ", rank(), ": dtypes differ (", in.describe(), " vs ",
             out.describe(), ")");
  check_counts("all_to_all_v (send)", in, send_counts);
  check_counts("all_to_all_v (receive)", out, recv_counts);
}

namespace {

// The recycled blocks of CommWork handles: one free list per 64-byte size class up to
// kPooledBytes (larger handles use the heap directly). Blocks are never given back: the lists
// hold at most the most handles ever in flight at once.
constexpr size_t kBlockGrain = 64, kPooledBytes = 4096;

struct FreeBlock {
  FreeBlock* next;
};

struct WorkPool {
  std::mutex mutex;
  std::array<FreeBlock*, kPooledBytes / kBlockGrain> free{};
};

// Process-wide (handles may outlive the communicator that made them) and never destroyed (a
// handle may be freed during static destruction).
WorkPool& work_pool() {
  alignas(WorkPool) static unsigned char storage[sizeof(WorkPool)];
  static WorkPool* pool = new (storage) WorkPool;
  return *pool;
}

size_t size_class(size_t bytes) { return (bytes + kBlockGrain - 1) / kBlockGrain - 1; }

}  // namespace

void* CommWork::operator new(size_t bytes) {
  if (bytes == 0 || bytes > kPooledBytes) return ::operator new(bytes);
  WorkPool& pool = work_pool();
  const size_t c = size_class(bytes);
  {
    std::lock_guard<std::mutex> lock(pool.mutex);
    if (FreeBlock* b = pool.free[c]) {
      pool.free[c] = b->next;
      return b;
    }
  }
  return ::operator new((c + 1) * kBlockGrain);
}

void CommWork::operator delete(void* block, size_t bytes) {
  if (block == nullptr) return;
  if (bytes == 0 || bytes > kPooledBytes) {
    ::operator delete(block);
    return;
  }
  WorkPool& pool = work_pool();
  const size_t c = size_class(bytes);
  std::lock_guard<std::mutex> lock(pool.mutex);
  pool.free[c] = new (block) FreeBlock{pool.free[c]};
}

namespace {

class DoneWork final : public CommWork {
 public:
  void wait() override {}
};

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "local"; }

  std::unique_ptr<CommWork> all_reduce_async(const Tensor& x, ReduceOp) override {
    book(COLL_ALL_REDUCE, static_cast<int64_t>(x.nbytes()));
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<CommWork> reduce_scatter_async(const Tensor& full, const Tensor& shard, ReduceOp) override {
    check_chunks("reduce_scatter", full, shard);
    book(COLL_REDUCE_SCATTER, static_cast<int64_t>(full.nbytes()));
    if (full.raw_data() != shard.raw_data()) std::memcpy(shard.raw_data(), full.raw_data(), shard.nbytes());
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<CommWork> all_gather_async(const Tensor& shard, const Tensor& full) override {
    check_chunks("all_gather", full, shard);
    book(COLL_ALL_GATHER, static_cast<int64_t>(full.nbytes()));
    if (full.raw_data() != shard.raw_data()) std::memcpy(full.raw_data(), shard.raw_data(), shard.nbytes());
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<CommWork> all_to_all_async(const Tensor& in, const Tensor& out) override {
    check_chunks("all_to_all", in, out);
    book(COLL_ALL_TO_ALL, static_cast<int64_t>(in.nbytes()));
    if (in.raw_data() != out.raw_data()) std::memcpy(out.raw_data(), in.raw_data(), in.nbytes());
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<CommWork> broadcast_async(const Tensor& x, int root) override {
    LOOM_CHECK(root == 0, "broadcast: root ", root, " outside the 1 rank of a local communicator");
    book(COLL_BROADCAST, static_cast<int64_t>(x.nbytes()), root);
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<CommWork> reduce_scatter_v_async(const Tensor& x, const std::vector<int64_t>& counts,
                                                   ReduceOp) override {
    check_counts("reduce_scatter_v", x, counts);
    book_v(COLL_REDUCE_SCATTER, static_cast<int64_t>(x.nbytes()), static_cast<int64_t>(x.nbytes()));
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<CommWork> all_gather_v_async(const Tensor& x, const std::vector<int64_t>& counts) override {
    check_counts("all_gather_v", x, counts);
    book_v(COLL_ALL_GATHER, static_cast<int64_t>(x.nbytes()), static_cast<int64_t>(x.nbytes()));
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<CommWork> all_to_all_v_async(const Tensor& in, const std::vector<int64_t>& send_counts,
                                               const Tensor& out, const std::vector<int64_t>& recv_counts) override {
    check_all_to_all_v(in, send_counts, out, recv_counts);
    LOOM_CHECK(send_counts[0] == recv_counts[0], "all_to_all_v: rank 0 sends ", send_counts[0], " elements to itself but expects ",
               recv_counts[0]);
    book_sent_received(COLL_ALL_TO_ALL, 0, 0);
    if (in.raw_data() != out.raw_data()) std::memcpy(out.raw_data(), in.raw_data(), in.nbytes());
    return std::make_unique<DoneWork>();
  }
  void send(const Tensor&, int to, int) override { LOOM_CHECK(false, "send to rank ", to, ": a local communicator has 1 rank"); }
  std::unique_ptr<CommWork> send_async(const Tensor&, int to, int) override {
    LOOM_CHECK(false, "send to rank ", to, ": a local communicator has 1 rank");
    return nullptr;
  }
  void recv(const Tensor&, int from, int) override {
    LOOM_CHECK(false, "recv from rank ", from, ": a local communicator has 1 rank");
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int color, int) override {
    LOOM_CHECK(color >= 0, "split: color ", color, " must be >= 0");
    return std::make_unique<LocalCommunicator>();
  }
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator() { return std::make_unique<LocalCommunicator>(); }

namespace {
int env_int(const char* name, int fallback) {  // a rank count or index
  return static_cast<int>(env_integer(name, fallback, 0, kMaxLaunchRanks - 1));
}
}  // namespace

LaunchInfo detect_launch() {
  LaunchInfo info;
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {  // OpenMPI's mpirun / prterun
    info.launcher = "mpirun (OpenMPI)";
    info.size = env_int("OMPI_COMM_WORLD_SIZE", 1), info.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    info.local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 0);
    info.mpi = true;
    return info;
  }
  if (std::getenv("PMIX_RANK") != nullptr) {  // srun --mpi=pmix (OpenMPI wires itself through PMIx)
    info.launcher = "PMIx (srun --mpi=pmix)";
    info.rank = env_int("PMIX_RANK", 0), info.size = env_int("SLURM_STEP_NUM_TASKS", env_int("SLURM_NTASKS", 0));
    info.mpi = true;
    return info;
  }
  if (std::getenv("PMI_SIZE") != nullptr) {  // PMI-1/2 (srun --mpi=pmi2, MPICH's Hydra)
    info.launcher = "PMI";
    info.size = env_int("PMI_SIZE", 1), info.rank = env_int("PMI_RANK", 0);
    info.mpi = true;
    return info;
  }
  // Launchers that start several processes without anything MPI can wire up: each would train
  // alone and write the same run folder. Refused, naming the variables and the way that works.
  const int slurm_tasks = env_int("SLURM_STEP_NUM_TASKS", 1);
  LOOM_CHECK(slurm_tasks <= 1, "srun started ", slurm_tasks, " tasks (SLURM_STEP_NUM_TASKS, this is SLURM_PROCID ",
             env_int("SLURM_PROCID", 0), ") without PMIx, so they cannot be wired into one job: use srun --mpi=pmix, or "
             "mpirun inside the allocation (docs/cluster.md)");
  const int world = env_int("WORLD_SIZE", 1);
  LOOM_CHECK(world <= 1, "WORLD_SIZE=", world, ", RANK=", env_int("RANK", 0), ", LOCAL_RANK=", env_int("LOCAL_RANK", 0),
             " (a torchrun-style launch): Loom wires its ranks with MPI, so these ", world, " processes would each "
             "train alone; launch with mpirun -np ", world, " or srun --mpi=pmix (docs/cluster.md)");
  return info;
}

bool launched_by_mpirun() { return detect_launch().mpi; }

}  // namespace loom
