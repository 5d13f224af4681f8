// Collectives between the ranks of a job: a Communicator over host tensors, with a
// single-process implementation (size 1) and an MPI one (Debian's OpenMPI; `mpirun -np N`).
// Every collective is also available asynchronously: it returns a CommWork to wait() on, so a
// bucket's all-reduce can run while backward computes the next bucket (issue 6's DDP).
//
// Conventions: tensors are contiguous host f32 (or bf16 / f64 / i32) buffers; all ranks call
// the same collectives in the same order with the same sizes. reduce_scatter and all_gather
// work on equal chunks: `full` holds size() chunks of `shard`'s numel, chunk r belonging to
// rank r (callers pad; parallel/ shards any tensor size that way).
//
// The byte ledger counts, per rank and per collective kind, the bytes this rank sends and
// receives under the bandwidth-optimal ring algorithms (Patarasuk & Yuan 2009; what NCCL's
// "bus bandwidth" assumes): all-reduce 2(N-1)/N x bytes each way, reduce-scatter and all-gather
// (N-1)/N x the full buffer, all-to-all (N-1)/N, broadcast the buffer (root sends, others
// receive), send/recv the message. MPI may pick another algorithm internally; the ledger is
// the algorithmic volume, the figure the ZeRO paper's communication analysis uses. The uneven
// (v) forms book (full - own) bytes each way: exactly what a rank receives in a ring
// all-gather, and what it sends in a ring reduce-scatter; equal to (N-1)/N x full for equal
// segments.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/tensor.h"

namespace loom {

class Tracer;

enum ReduceOp : uint8_t { REDUCE_SUM, REDUCE_MAX, REDUCE_MIN };

enum Collective : uint8_t {
  COLL_ALL_REDUCE,
  COLL_REDUCE_SCATTER,
  COLL_ALL_GATHER,
  COLL_ALL_TO_ALL,
  COLL_BROADCAST,
  COLL_SEND_RECV,
  COLL_COUNT
};
const char* collective_name(Collective c);  // "all_reduce", ...

struct ByteLedger {
  std::array<int64_t, COLL_COUNT> sent{}, received{}, calls{};
  int64_t total_sent() const;
  int64_t total_received() const;
};

// An operation in flight; wait() blocks until its buffers are final (and may be called once).
// Handles are recycled (communicator.cpp): a freed handle's block serves the next one of its
// size, so once a training step has run, the collectives of the next allocate nothing.
class CommWork {
 public:
  virtual ~CommWork() = default;
  virtual void wait() = 0;
  static void* operator new(size_t bytes);
  static void operator delete(void* block, size_t bytes);
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // "local", "mpi"
  // Ends every process of the job this communicator spans with exit status `code` (the watchdog,
  // a fatal error: peers blocked in a collective would otherwise wait forever); a communicator
  // of one process has nothing to end.
  virtual void abort_job(int code) { (void)code; }

  // In place over every rank's x.
  virtual std::unique_ptr<CommWork> all_reduce_async(const Tensor& x, ReduceOp op) = 0;
  // shard (n) = chunk rank() of the sum over ranks of full (size() * n).
  virtual std::unique_ptr<CommWork> reduce_scatter_async(const Tensor& full, const Tensor& shard, ReduceOp op) = 0;
  // full (size() * n): chunk r = rank r's shard (n).
  virtual std::unique_ptr<CommWork> all_gather_async(const Tensor& shard, const Tensor& full) = 0;
  // out chunk r = rank r's in chunk rank(); in and out hold size() equal chunks.
  virtual std::unique_ptr<CommWork> all_to_all_async(const Tensor& in, const Tensor& out) = 0;
  virtual std::unique_ptr<CommWork> broadcast_async(const Tensor& x, int root) = 0;
  // Uneven segments, in place: x holds size() segments back to back, segment r of counts[r]
  // elements (counts sum to x.numel(); zeros allowed). reduce_scatter_v: after wait(), this
  // rank's segment of x holds the reduction over ranks of that segment (the rest of x is
  // undefined). all_gather_v: after wait(), every segment r of x holds rank r's segment.
  // ZeRO-2/3 reduce and gather a layer's slice of every rank's shard with these.
  virtual std::unique_ptr<CommWork> reduce_scatter_v_async(const Tensor& x, const std::vector<int64_t>& counts,
                                                           ReduceOp op) = 0;
  virtual std::unique_ptr<CommWork> all_gather_v_async(const Tensor& x, const std::vector<int64_t>& counts) = 0;
  // Uneven all-to-all (MoE dispatch): in holds size() segments back to back, segment r of
  // send_counts[r] elements for rank r; after wait(), out holds size() segments, segment r of
  // recv_counts[r] elements from rank r (recv_counts[r] must equal rank r's send_counts[rank()]).
  virtual std::unique_ptr<CommWork> all_to_all_v_async(const Tensor& in, const std::vector<int64_t>& send_counts,
                                                       const Tensor& out, const std::vector<int64_t>& recv_counts) = 0;
  virtual void send(const Tensor& x, int to, int tag = 0) = 0;
  // Non-blocking send: x must stay unchanged until wait() (pipeline stages send while the
  // receiver may itself be sending, which blocking sends of large messages would deadlock).
  virtual std::unique_ptr<CommWork> send_async(const Tensor& x, int to, int tag = 0) = 0;
  virtual void recv(const Tensor& x, int from, int tag = 0) = 0;
  virtual void barrier() = 0;
  // A communicator over the ranks that pass the same color (>= 0), ranked by key (then by this
  // rank): every rank calls it (MPI_Comm_split). Device-mesh groups are built with it.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // Blocking forms.
  void all_reduce(const Tensor& x, ReduceOp op = REDUCE_SUM) { all_reduce_async(x, op)->wait(); }
  void reduce_scatter(const Tensor& full, const Tensor& shard, ReduceOp op = REDUCE_SUM) {
    reduce_scatter_async(full, shard, op)->wait();
  }
  void all_gather(const Tensor& shard, const Tensor& full) { all_gather_async(shard, full)->wait(); }
  void all_to_all(const Tensor& in, const Tensor& out) { all_to_all_async(in, out)->wait(); }
  void broadcast(const Tensor& x, int root = 0) { broadcast_async(x, root)->wait(); }

  const ByteLedger& ledger() const { return ledger_; }
  void reset_ledger() { ledger_ = ByteLedger{}; }
  // train.trace: every collective from now on is an event of `tracer` (core/trace.h) with its
  // bytes, tagged `group` (a literal: "world", "dp", "tp", ...). Null: none (the default).
  void set_tracer(Tracer* tracer, const char* group) { tracer_ = tracer, trace_group_ = group; }

 protected:
  Tracer* tracer_ = nullptr;
  const char* trace_group_ = "world";
  // Books one call of kind c for a buffer of `bytes` (see the header comment for the formulas).
  void book(Collective c, int64_t bytes, int root = -1);
  // Checks equal-chunk shapes and dtypes; throws naming the collective and rank.
  void check_chunks(const char* op, const Tensor& full, const Tensor& shard) const;
  // Checks that counts has size() non-negative entries summing to x.numel(); returns this
  // rank's first element.
  int64_t check_counts(const char* op, const Tensor& x, const std::vector<int64_t>& counts) const;
  // Books a v-collective: full and own bytes.
  void book_v(Collective c, int64_t full_bytes, int64_t own_bytes);
  // Books an all-to-all-v: the bytes to and from the other ranks.
  void book_sent_received(Collective c, int64_t sent, int64_t received);
  // Checks an all-to-all-v's buffers and counts; throws naming the rank.
  void check_all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_counts, const Tensor& out,
                          const std::vector<int64_t>& recv_counts) const;

 private:
  ByteLedger ledger_;
};

// The one-process communicator: every collective is the identity (or a copy).
std::unique_ptr<Communicator> make_local_communicator();

// MPI: initializes MPI on first use in the process (MPI_THREAD_FUNNELED) and finalizes at exit.
// Throws when Loom was launched without mpirun and MPI cannot initialize.
std::unique_ptr<Communicator> make_mpi_communicator();
// How this process was launched, from the launchers' environment variables (docs/cluster.md):
// OpenMPI's mpirun (OMPI_COMM_WORLD_SIZE / _RANK), PMIx (PMIX_RANK: srun --mpi=pmix), PMI
// (PMI_SIZE / PMI_RANK). A launch of several processes that MPI cannot wire up (srun without
// PMIx: SLURM_STEP_NUM_TASKS > 1; torchrun-style: WORLD_SIZE > 1) is an Error naming the
// variables, instead of N independent runs writing one folder.
struct LaunchInfo {
  std::string launcher = "none";  // "mpirun (OpenMPI)", "PMIx (srun --mpi=pmix)", "PMI", "none"
  int rank = 0, size = 1;         // size 0: the launcher did not say
  int local_size = 0;             // ranks on this machine (0: the launcher did not say)
  bool mpi = false;               // MPI_Init will find its peers
};
LaunchInfo detect_launch();
// True when an MPI launcher started the process (detect_launch().mpi; refuses the unwired ones).
bool launched_by_mpirun();
// After a rank's fatal error: when MPI runs with more than one rank, ends the whole job
// (MPI_Abort with `code`) instead of leaving the other ranks blocked in a collective; else nothing.
void abort_other_ranks(int code);

}  // namespace loom
