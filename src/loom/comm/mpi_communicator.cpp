// The MPI communicator (OpenMPI): non-blocking collectives (MPI-3 MPI_I*) on MPI_COMM_WORLD.
// MPI's error handler stays MPI_ERRORS_ARE_FATAL, so a failed peer ends the whole job instead
// of leaving ranks waiting.
#include <mpi.h>

#include <array>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/core/error.h"
#include "loom/core/trace.h"

namespace loom {

namespace {

// A tensor's address for MPI: host memory only (the strict test backend's included, which is
// host memory host code may not touch directly). GPU tensors go over NCCL instead.
void* mpi_ptr(const Tensor& t) {
  LOOM_CHECK(t.device() == DEVICE_CPU, "MPI communicator: tensor ", t.describe(), " is in GPU memory; GPU tensors go "
             "over NCCL (loom train builds it under mpirun with device = \"cuda\")");
  return t.device_ptr();
}


// MPI is process-wide by nature: initialized once, on first use, finalized at exit.
class MpiRuntime {
 public:
  static MpiRuntime& get() {
    static MpiRuntime runtime;
    return runtime;
  }
  ~MpiRuntime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }

 private:
  MpiRuntime() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) return;
    int provided = 0;
    LOOM_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) == MPI_SUCCESS,
               "MPI_Init_thread failed: launch with mpirun");
  }
};

MPI_Datatype mpi_type(DType d, const char* op) {
  switch (d) {
    case DTYPE_F32: return MPI_FLOAT;
    case DTYPE_F64: return MPI_DOUBLE;
    case DTYPE_I32: return MPI_INT;
    case DTYPE_U8: return MPI_UINT8_T;
    case DTYPE_BF16: return MPI_UINT16_T;  // moved, never reduced (see reduce_type)
    case DTYPE_F16: break;                 // never communicated
    case DTYPE_COUNT: break;
  }
  throw Error(str_cat(op, ": unsupported dtype ", static_cast<int>(d)));
}

MPI_Datatype reduce_type(const Tensor& t, const char* op) {
  LOOM_CHECK(t.dtype() != DTYPE_BF16, op, ": reductions over bf16 are not supported by MPI; reduce in f32");
  return mpi_type(t.dtype(), op);
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case REDUCE_SUM: return MPI_SUM;
    case REDUCE_MAX: return MPI_MAX;
    case REDUCE_MIN: return MPI_MIN;
  }
  return MPI_SUM;
}

// A request in flight, with what must outlive it: a v-collective's int counts and
// displacements (inline up to kInlineRanks ranks, so a handle allocates nothing beyond its
// recycled block), and a move to run once it completes (an in-place reduce-scatter's result).
class MpiWork final : public CommWork {
 public:
  static constexpr int kInlineRanks = 32;
  MpiWork() = default;
  MPI_Request* request() { return &request_; }
  // Runs once the request completes: moves `bytes` from base to base + to.
  void then_move(char* base, size_t to, size_t bytes) { move_ = {base, to, bytes}; }
  // Room for `arrays` int arrays of `ranks` entries each; array i at ints(ranks, i).
  void reserve_ints(int arrays, int ranks) {
    if (ranks > kInlineRanks) heap_.resize(static_cast<size_t>(arrays) * static_cast<size_t>(ranks));
  }
  int* ints(int ranks, int i) {
    return (heap_.empty() ? inline_.data() : heap_.data()) + static_cast<ptrdiff_t>(i) * ranks;
  }
  void wait() override {
    if (request_ != MPI_REQUEST_NULL) MPI_Wait(&request_, MPI_STATUS_IGNORE);
    if (move_.bytes != 0) std::memmove(move_.base + move_.to, move_.base, move_.bytes);
    move_.bytes = 0;
    if (trace_.tracer != nullptr) {  // train.trace: the collective from issue to completion
      trace_.tracer->complete(trace_.name, "comm", trace_.start, 0, trace_.bytes, trace_.sent, trace_.group);
      trace_.tracer = nullptr;
    }
  }
  struct Trace {
    Tracer* tracer = nullptr;
    const char* name = nullptr;
    const char* group = nullptr;
    int64_t start = 0, bytes = 0, sent = 0;
  };
  void trace(const Trace& t) { trace_ = t; }
  ~MpiWork() override { wait(); }  // a dropped handle still completes before its buffers go

 private:
  struct Move {
    char* base = nullptr;
    size_t to = 0, bytes = 0;
  };
  MPI_Request request_ = MPI_REQUEST_NULL;
  Move move_;
  Trace trace_;
  std::array<int, 4 * kInlineRanks> inline_{};
  std::vector<int> heap_;  // more ranks than kInlineRanks
};

// MPI's int counts of a v-collective into `out`, and (displs non-null) their displacements.
void int_counts(const std::vector<int64_t>& counts, const char* op, int* out, int* displs = nullptr) {
  for (size_t r = 0; r < counts.size(); ++r) {
    LOOM_CHECK(counts[r] <= INT32_MAX, op, ": a segment of ", counts[r], " elements exceeds MPI's int count");
    out[r] = static_cast<int>(counts[r]);
    if (displs != nullptr) displs[r] = r == 0 ? 0 : displs[r - 1] + out[r - 1];
  }
}

int count_of(const Tensor& t, const char* op) {
  LOOM_CHECK(t.numel() <= INT32_MAX, op, ": ", t.numel(), " elements exceed MPI's int count; split the buffer");
  return static_cast<int>(t.numel());
}

class MpiCommunicator final : public Communicator {
 public:
  // world: MPI_COMM_WORLD; otherwise a communicator this object owns (from split()).
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm_ != MPI_COMM_WORLD && !finalized) MPI_Comm_free(&comm_);
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    LOOM_CHECK(color >= 0, "split on rank ", rank_, ": color ", color, " must be >= 0");
    MPI_Comm sub = MPI_COMM_NULL;
    LOOM_CHECK(MPI_Comm_split(comm_, color, key, &sub) == MPI_SUCCESS, "MPI_Comm_split failed on rank ", rank_);
    return std::make_unique<MpiCommunicator>(sub);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }
  void abort_job(int code) override { abort_other_ranks(code); }

  // A request's handle, traced (train.trace) as `op` of `bytes` from now: its sent bytes are
  // what the ledger booked since sent_before.
  std::unique_ptr<MpiWork> work(const char* op, int64_t bytes, int64_t sent_before) {
    auto w = std::make_unique<MpiWork>();
    if (tracer_ != nullptr) {
      w->trace({tracer_, op, trace_group_, Tracer::now_ns(), bytes, ledger().total_sent() - sent_before});
    }
    return w;
  }

  std::unique_ptr<CommWork> all_reduce_async(const Tensor& x, ReduceOp op) override {
    const int64_t sent_before = ledger().total_sent();
    book(COLL_ALL_REDUCE, static_cast<int64_t>(x.nbytes()));
    auto w = work("all_reduce", static_cast<int64_t>(x.nbytes()), sent_before);
    MPI_Iallreduce(MPI_IN_PLACE, mpi_ptr(x), count_of(x, "all_reduce"), reduce_type(x, "all_reduce"), mpi_op(op),
                   comm_, w->request());
    return w;
  }
  std::unique_ptr<CommWork> reduce_scatter_async(const Tensor& full, const Tensor& shard, ReduceOp op) override {
    check_chunks("reduce_scatter", full, shard);
    const int64_t sent_before = ledger().total_sent();
    book(COLL_REDUCE_SCATTER, static_cast<int64_t>(full.nbytes()));
    auto w = work("reduce_scatter", static_cast<int64_t>(full.nbytes()), sent_before);
    MPI_Ireduce_scatter_block(mpi_ptr(full), mpi_ptr(shard), count_of(shard, "reduce_scatter"),
                              reduce_type(full, "reduce_scatter"), mpi_op(op), comm_, w->request());
    return w;
  }
  std::unique_ptr<CommWork> all_gather_async(const Tensor& shard, const Tensor& full) override {
    check_chunks("all_gather", full, shard);
    const int64_t sent_before = ledger().total_sent();
    book(COLL_ALL_GATHER, static_cast<int64_t>(full.nbytes()));
    auto w = work("all_gather", static_cast<int64_t>(full.nbytes()), sent_before);
    const MPI_Datatype t = mpi_type(shard.dtype(), "all_gather");
    const int n = count_of(shard, "all_gather");
    MPI_Iallgather(mpi_ptr(shard), n, t, mpi_ptr(full), n, t, comm_, w->request());
    return w;
  }
  std::unique_ptr<CommWork> all_to_all_async(const Tensor& in, const Tensor& out) override {
    LOOM_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() && in.numel() % size_ == 0, "all_to_all on rank ",
               rank_, ": in ", in.describe(), " and out ", out.describe(), " must hold ", size_, " equal chunks");
    const int64_t sent_before = ledger().total_sent();
    book(COLL_ALL_TO_ALL, static_cast<int64_t>(in.nbytes()));
    auto w = work("all_to_all", static_cast<int64_t>(in.nbytes()), sent_before);
    const MPI_Datatype t = mpi_type(in.dtype(), "all_to_all");
    const int n = count_of(in, "all_to_all") / size_;
    MPI_Ialltoall(mpi_ptr(in), n, t, mpi_ptr(out), n, t, comm_, w->request());
    return w;
  }
  std::unique_ptr<CommWork> broadcast_async(const Tensor& x, int root) override {
    LOOM_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " outside [0, ", size_, ")");
    const int64_t sent_before = ledger().total_sent();
    book(COLL_BROADCAST, static_cast<int64_t>(x.nbytes()), root);
    auto w = work("broadcast", static_cast<int64_t>(x.nbytes()), sent_before);
    MPI_Ibcast(mpi_ptr(x), count_of(x, "broadcast"), mpi_type(x.dtype(), "broadcast"), root, comm_, w->request());
    return w;
  }
  std::unique_ptr<CommWork> reduce_scatter_v_async(const Tensor& x, const std::vector<int64_t>& counts,
                                                   ReduceOp op) override {
    const int64_t own = check_counts("reduce_scatter_v", x, counts);
    const size_t elem = dtype_size(x.dtype());
    const int64_t sent_before = ledger().total_sent();
    book_v(COLL_REDUCE_SCATTER, static_cast<int64_t>(x.nbytes()), counts[rank_] * static_cast<int64_t>(elem));
    auto w = work("reduce_scatter_v", static_cast<int64_t>(x.nbytes()), sent_before);
    count_of(x, "reduce_scatter_v");
    w->reserve_ints(1, size_);
    int* n = w->ints(size_, 0);
    int_counts(counts, "reduce_scatter_v", n);
    // MPI_IN_PLACE leaves this rank's result at the start of the buffer: moved to its segment.
    MPI_Ireduce_scatter(MPI_IN_PLACE, mpi_ptr(x), n, reduce_type(x, "reduce_scatter_v"), mpi_op(op), comm_,
                        w->request());
    const size_t bytes = static_cast<size_t>(counts[rank_]) * elem;
    if (own != 0) w->then_move(static_cast<char*>(mpi_ptr(x)), static_cast<size_t>(own) * elem, bytes);
    return w;
  }
  std::unique_ptr<CommWork> all_gather_v_async(const Tensor& x, const std::vector<int64_t>& counts) override {
    check_counts("all_gather_v", x, counts);
    const int64_t elem = static_cast<int64_t>(dtype_size(x.dtype()));
    const int64_t sent_before = ledger().total_sent();
    book_v(COLL_ALL_GATHER, static_cast<int64_t>(x.nbytes()), counts[rank_] * elem);
    auto w = work("all_gather_v", static_cast<int64_t>(x.nbytes()), sent_before);
    count_of(x, "all_gather_v");
    w->reserve_ints(2, size_);
    int* n = w->ints(size_, 0);
    int* displs = w->ints(size_, 1);
    int_counts(counts, "all_gather_v", n, displs);
    MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, mpi_ptr(x), n, displs, mpi_type(x.dtype(), "all_gather_v"),
                    comm_, w->request());
    return w;
  }
  std::unique_ptr<CommWork> all_to_all_v_async(const Tensor& in, const std::vector<int64_t>& send_counts,
                                               const Tensor& out, const std::vector<int64_t>& recv_counts) override {
    check_all_to_all_v(in, send_counts, out, recv_counts);
    const int64_t elem = static_cast<int64_t>(dtype_size(in.dtype()));
    int64_t sent = 0, received = 0;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      sent += send_counts[r] * elem, received += recv_counts[r] * elem;
    }
    const int64_t sent_before = ledger().total_sent();
    book_sent_received(COLL_ALL_TO_ALL, sent, received);
    auto w = work("all_to_all_v", sent + received, sent_before);
    count_of(in, "all_to_all_v");
    count_of(out, "all_to_all_v");
    w->reserve_ints(4, size_);
    int *sc = w->ints(size_, 0), *sd = w->ints(size_, 1), *rc = w->ints(size_, 2), *rd = w->ints(size_, 3);
    int_counts(send_counts, "all_to_all_v", sc, sd);
    int_counts(recv_counts, "all_to_all_v", rc, rd);
    const MPI_Datatype t = mpi_type(in.dtype(), "all_to_all_v");
    MPI_Ialltoallv(mpi_ptr(in), sc, sd, t, mpi_ptr(out), rc, rd, t, comm_, w->request());
    return w;
  }
  void send(const Tensor& x, int to, int tag) override {
    LOOM_CHECK(to >= 0 && to < size_ && to != rank_, "send from rank ", rank_, " to rank ", to, ": no such peer");
    const int64_t start = tracer_ != nullptr ? Tracer::now_ns() : 0;
    book(COLL_SEND_RECV, static_cast<int64_t>(x.nbytes()));
    MPI_Send(mpi_ptr(x), count_of(x, "send"), mpi_type(x.dtype(), "send"), to, tag, comm_);
    if (tracer_ != nullptr) tracer_->complete("send", "comm", start, 0, x.nbytes(), x.nbytes(), trace_group_);
  }
  std::unique_ptr<CommWork> send_async(const Tensor& x, int to, int tag) override {
    LOOM_CHECK(to >= 0 && to < size_ && to != rank_, "send from rank ", rank_, " to rank ", to, ": no such peer");
    const int64_t sent_before = ledger().total_sent();
    book(COLL_SEND_RECV, static_cast<int64_t>(x.nbytes()));
    auto w = work("send", static_cast<int64_t>(x.nbytes()), sent_before);
    MPI_Isend(mpi_ptr(x), count_of(x, "send"), mpi_type(x.dtype(), "send"), to, tag, comm_, w->request());
    return w;
  }
  void recv(const Tensor& x, int from, int tag) override {
    LOOM_CHECK(from >= 0 && from < size_ && from != rank_, "recv on rank ", rank_, " from rank ", from, ": no such peer");
    const int64_t start = tracer_ != nullptr ? Tracer::now_ns() : 0;
    book(COLL_SEND_RECV, static_cast<int64_t>(x.nbytes()), -2);
    MPI_Status status;
    MPI_Recv(mpi_ptr(x), count_of(x, "recv"), mpi_type(x.dtype(), "recv"), from, tag, comm_, &status);
    if (tracer_ != nullptr) tracer_->complete("recv", "comm", start, 0, x.nbytes(), 0, trace_group_);
    int got = 0;
    MPI_Get_count(&status, mpi_type(x.dtype(), "recv"), &got);
    LOOM_CHECK(got == x.numel(), "recv on rank ", rank_, " from rank ", from, ": got ", got, " elements, expected ",
               x.numel());
  }
  void barrier() override {
    const int64_t start = tracer_ != nullptr ? Tracer::now_ns() : 0;
    MPI_Barrier(comm_);
    if (tracer_ != nullptr) tracer_->complete("barrier", "comm", start, 0, 0, 0, trace_group_);
  }

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

void abort_other_ranks(int code) {
  int initialized = 0, finalized = 0, size = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1) MPI_Abort(MPI_COMM_WORLD, code);
}

std::unique_ptr<Communicator> make_mpi_communicator() {
  MpiRuntime::get();
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD);
}

}  // namespace loom
