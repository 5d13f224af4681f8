// The NCCL communicator and the routing communicator (nccl_communicator.h): NCCL collectives
// on a stream of the communicator's own, ordered after the compute stream by events.
#include "loom/comm/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/error.h"

// LOOM_NCCL_CHECK / LOOM_NCCL_CUDA_CHECK: a failed NCCL or CUDA runtime call becomes a loom::Error
// naming the collective, the rank, the call, file:line and the library's message.
#define LOOM_NCCL_CHECK(expr, op, rank)                                                                        \
  do {                                                                                                         \
    const ncclResult_t loom_nccl_status_ = (expr);                                                             \
    if (loom_nccl_status_ != ncclSuccess) {                                                                    \
      throw ::loom::Error(::loom::str_cat("NCCL error in ", op, " on rank ", rank, ": ", #expr, " (", __FILE__, \
                                          ":", __LINE__, "): ", ncclGetErrorString(loom_nccl_status_),         \
                                          " (NCCL_DEBUG=WARN prints NCCL's reason)"));                         \
    }                                                                                                          \
  } while (0)

#define LOOM_NCCL_CUDA_CHECK(expr, op, rank)                                                                   \
  do {                                                                                                         \
    const cudaError_t loom_nccl_cuda_status_ = (expr);                                                         \
    if (loom_nccl_cuda_status_ != cudaSuccess) {                                                               \
      throw ::loom::Error(::loom::str_cat("CUDA error in ", op, " on rank ", rank, ": ", #expr, " (", __FILE__, \
                                          ":", __LINE__, "): ", cudaGetErrorString(loom_nccl_cuda_status_)));  \
    }                                                                                                          \
  } while (0)

namespace loom {

namespace {

// The device address of a DEVICE_CUDA tensor's first element.
void* dev_ptr(const Tensor& t) { return t.device_ptr(); }

// The device address of element `first` of t.
char* dev_at(const Tensor& t, int64_t first) {
  return static_cast<char*>(dev_ptr(t)) + static_cast<size_t>(first) * dtype_size(t.dtype());
}

const char* device_name(DeviceType d) { return d == DEVICE_CUDA ? "cuda" : "cpu"; }

ncclDataType_t nccl_type(DType d, const char* op, int rank) {
  switch (d) {
    case DTYPE_F32: return ncclFloat32;
    case DTYPE_BF16: return ncclBfloat16;
    case DTYPE_F64: return ncclFloat64;
    case DTYPE_I32: return ncclInt32;
    case DTYPE_U8: return ncclUint8;
    case DTYPE_F16: break;  // never communicated
    case DTYPE_COUNT: break;
  }
  throw Error(str_cat(op, " on rank ", rank, ": unsupported dtype ", static_cast<int>(d)));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case REDUCE_SUM: return ncclSum;
    case REDUCE_MAX: return ncclMax;
    case REDUCE_MIN: return ncclMin;
  }
  return ncclSum;
}

// Where each segment starts: the exclusive prefix sums of counts. // [rank]
std::vector<int64_t> segment_offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size(), 0);
  for (size_t r = 1; r < counts.size(); ++r) offsets[r] = offsets[r - 1] + counts[r - 1];
  return offsets;
}

// An all-to-all-v's bytes to and from the other ranks (the MPI communicator's booking).
std::pair<int64_t, int64_t> all_to_all_v_bytes(DType dtype, int rank, const std::vector<int64_t>& send_counts,
                                               const std::vector<int64_t>& recv_counts) {
  const int64_t elem = static_cast<int64_t>(dtype_size(dtype));
  int64_t sent = 0, received = 0;
  for (size_t r = 0; r < send_counts.size(); ++r) {
    if (static_cast<int>(r) == rank) continue;
    sent += send_counts[r] * elem, received += recv_counts[r] * elem;
  }
  return {sent, received};
}

// One collective in flight: its completion event, recorded on the communicator's stream.
// wait(): the compute stream waits for the event (later kernels see the result) and the host
// blocks until it fires (the host sees it too).
class NcclWork final : public CommWork {
 public:
  NcclWork(const char* op, int rank, cudaStream_t compute) : op_(op), rank_(rank), compute_(compute) {
    LOOM_NCCL_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), op_, rank_);
  }
  NcclWork(const NcclWork&) = delete;
  NcclWork& operator=(const NcclWork&) = delete;

  void record(cudaStream_t stream) {
    LOOM_NCCL_CUDA_CHECK(cudaEventRecord(done_, stream), op_, rank_);
    recorded_ = true;
    issue_ = nullptr;
  }
  // A deferred send (NcclCommunicator::send_async): `issue` puts it on the stream, with every
  // send still deferred, when this handle is waited for or dropped first.
  void defer(std::function<void()> issue) { issue_ = std::move(issue); }
  void wait() override {
    if (!recorded_ && issue_) issue_();
    if (!recorded_ || waited_) return;
    waited_ = true;
    LOOM_NCCL_CUDA_CHECK(cudaStreamWaitEvent(compute_, done_, 0), op_, rank_);
    LOOM_NCCL_CUDA_CHECK(cudaEventSynchronize(done_), op_, rank_);
  }
  // A dropped handle still completes before its buffers go (as MPI's); errors cannot be thrown here.
  ~NcclWork() override {
    if (!recorded_ && issue_) {
      try {
        issue_();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "loom: %s on rank %d: issuing a dropped deferred send failed: %s\n", op_, rank_, e.what());
      }
    }
    if (recorded_ && !waited_) {
      const cudaError_t ordered = cudaStreamWaitEvent(compute_, done_, 0);
      const cudaError_t synced = cudaEventSynchronize(done_);
      if (ordered != cudaSuccess || synced != cudaSuccess) {
        std::fprintf(stderr, "loom: %s on rank %d: waiting for a dropped NCCL handle failed: %s\n", op_, rank_,
                     cudaGetErrorString(ordered != cudaSuccess ? ordered : synced));
      }
    }
    cudaEventDestroy(done_);
  }

 private:
  const char* op_;  // a string literal
  int rank_;
  cudaStream_t compute_;
  cudaEvent_t done_ = nullptr;
  bool recorded_ = false, waited_ = false;
  std::function<void()> issue_;
};

class NcclCommunicator final : public Communicator {
 public:
  // Takes ownership of comm: it is released even when this constructor throws.
  NcclCommunicator(ncclComm_t comm, int cuda_device, cudaStream_t compute_stream)
      : comm_(comm), device_(cuda_device), compute_(compute_stream) {
    try {
      LOOM_NCCL_CHECK(ncclCommUserRank(comm_, &rank_), "communicator setup", rank_);
      LOOM_NCCL_CHECK(ncclCommCount(comm_, &size_), "communicator setup", rank_);
      LOOM_NCCL_CUDA_CHECK(cudaSetDevice(device_), "communicator setup", rank_);
      LOOM_NCCL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "communicator setup", rank_);
      LOOM_NCCL_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "communicator setup", rank_);
      void* word = nullptr;
      LOOM_NCCL_CUDA_CHECK(cudaMalloc(&word, sizeof(int32_t)), "communicator setup", rank_);
      barrier_word_ = static_cast<int32_t*>(word);
      LOOM_NCCL_CUDA_CHECK(cudaMemset(barrier_word_, 0, sizeof(int32_t)), "communicator setup", rank_);
    } catch (...) {
      release(true);
      throw;
    }
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  // Unwinding from an error (a peer may never reach its own destroy): abort; else destroy.
  ~NcclCommunicator() override { release(std::uncaught_exceptions() > 0); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl"; }

  std::unique_ptr<Communicator> split(int color, int key) override {
    LOOM_CHECK(color >= 0, "split on rank ", rank_, ": color ", color, " must be >= 0");
    LOOM_NCCL_CUDA_CHECK(cudaSetDevice(device_), "split", rank_);
    ncclComm_t sub = nullptr;
    LOOM_NCCL_CHECK(ncclCommSplit(comm_, color, key, &sub, nullptr), "split", rank_);
    LOOM_CHECK(sub != nullptr, "split on rank ", rank_, ": ncclCommSplit returned no communicator for color ", color);
    return std::make_unique<NcclCommunicator>(sub, device_, compute_);
  }

  std::unique_ptr<CommWork> all_reduce_async(const Tensor& x, ReduceOp op) override {
    check_on_device("all_reduce", x);
    const ncclDataType_t t = nccl_type(x.dtype(), "all_reduce", rank_);
    book(COLL_ALL_REDUCE, static_cast<int64_t>(x.nbytes()));
    return enqueue("all_reduce", [&] {
      LOOM_NCCL_CHECK(ncclAllReduce(dev_ptr(x), dev_ptr(x), static_cast<size_t>(x.numel()), t, nccl_op(op), comm_,
                                    stream_),
                      "all_reduce", rank_);
    });
  }
  std::unique_ptr<CommWork> reduce_scatter_async(const Tensor& full, const Tensor& shard, ReduceOp op) override {
    check_on_device("reduce_scatter", full);
    check_on_device("reduce_scatter", shard);
    check_chunks("reduce_scatter", full, shard);
    const ncclDataType_t t = nccl_type(full.dtype(), "reduce_scatter", rank_);
    book(COLL_REDUCE_SCATTER, static_cast<int64_t>(full.nbytes()));
    return enqueue("reduce_scatter", [&] {
      LOOM_NCCL_CHECK(ncclReduceScatter(dev_ptr(full), dev_ptr(shard), static_cast<size_t>(shard.numel()), t,
                                        nccl_op(op), comm_, stream_),
                      "reduce_scatter", rank_);
    });
  }
  std::unique_ptr<CommWork> all_gather_async(const Tensor& shard, const Tensor& full) override {
    check_on_device("all_gather", shard);
    check_on_device("all_gather", full);
    check_chunks("all_gather", full, shard);
    const ncclDataType_t t = nccl_type(shard.dtype(), "all_gather", rank_);
    book(COLL_ALL_GATHER, static_cast<int64_t>(full.nbytes()));
    return enqueue("all_gather", [&] {
      LOOM_NCCL_CHECK(
          ncclAllGather(dev_ptr(shard), dev_ptr(full), static_cast<size_t>(shard.numel()), t, comm_, stream_),
          "all_gather", rank_);
    });
  }
  std::unique_ptr<CommWork> all_to_all_async(const Tensor& in, const Tensor& out) override {
    check_on_device("all_to_all", in);
    check_on_device("all_to_all", out);
    LOOM_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() && in.numel() % size_ == 0, "all_to_all on rank ",
               rank_, ": in ", in.describe(), " and out ", out.describe(), " must hold ", size_, " equal chunks");
    check_separate("all_to_all", in, out);
    book(COLL_ALL_TO_ALL, static_cast<int64_t>(in.nbytes()));
    const std::vector<int64_t> counts(static_cast<size_t>(size_), in.numel() / size_);
    return exchange("all_to_all", in, counts, out, counts);
  }
  std::unique_ptr<CommWork> broadcast_async(const Tensor& x, int root) override {
    check_on_device("broadcast", x);
    LOOM_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " outside [0, ", size_, ")");
    const ncclDataType_t t = nccl_type(x.dtype(), "broadcast", rank_);
    book(COLL_BROADCAST, static_cast<int64_t>(x.nbytes()), root);
    return enqueue("broadcast", [&] {
      LOOM_NCCL_CHECK(
          ncclBroadcast(dev_ptr(x), dev_ptr(x), static_cast<size_t>(x.numel()), t, root, comm_, stream_),
          "broadcast", rank_);
    });
  }
  // One in-place ncclReduce per non-empty segment, segment r reduced onto rank r, in one group.
  std::unique_ptr<CommWork> reduce_scatter_v_async(const Tensor& x, const std::vector<int64_t>& counts,
                                                   ReduceOp op) override {
    check_on_device("reduce_scatter_v", x);
    check_counts("reduce_scatter_v", x, counts);
    const int64_t elem = static_cast<int64_t>(dtype_size(x.dtype()));
    book_v(COLL_REDUCE_SCATTER, static_cast<int64_t>(x.nbytes()), counts[rank_] * elem);
    const ncclDataType_t t = nccl_type(x.dtype(), "reduce_scatter_v", rank_);
    const std::vector<int64_t> offsets = segment_offsets(counts);
    return enqueue("reduce_scatter_v", [&] {
      grouped("reduce_scatter_v", [&] {
        for (int r = 0; r < size_; ++r) {
          if (counts[r] == 0) continue;
          char* segment = dev_at(x, offsets[r]);
          const ncclResult_t s =
              ncclReduce(segment, segment, static_cast<size_t>(counts[r]), t, nccl_op(op), r, comm_, stream_);
          if (s != ncclSuccess) return s;
        }
        return ncclSuccess;
      });
    });
  }
  // One in-place ncclBroadcast per non-empty segment, segment r from rank r, in one group.
  std::unique_ptr<CommWork> all_gather_v_async(const Tensor& x, const std::vector<int64_t>& counts) override {
    check_on_device("all_gather_v", x);
    check_counts("all_gather_v", x, counts);
    const int64_t elem = static_cast<int64_t>(dtype_size(x.dtype()));
    book_v(COLL_ALL_GATHER, static_cast<int64_t>(x.nbytes()), counts[rank_] * elem);
    const ncclDataType_t t = nccl_type(x.dtype(), "all_gather_v", rank_);
    const std::vector<int64_t> offsets = segment_offsets(counts);
    return enqueue("all_gather_v", [&] {
      grouped("all_gather_v", [&] {
        for (int r = 0; r < size_; ++r) {
          if (counts[r] == 0) continue;
          char* segment = dev_at(x, offsets[r]);
          const ncclResult_t s = ncclBroadcast(segment, segment, static_cast<size_t>(counts[r]), t, r, comm_, stream_);
          if (s != ncclSuccess) return s;
        }
        return ncclSuccess;
      });
    });
  }
  std::unique_ptr<CommWork> all_to_all_v_async(const Tensor& in, const std::vector<int64_t>& send_counts,
                                               const Tensor& out, const std::vector<int64_t>& recv_counts) override {
    check_on_device("all_to_all_v", in);
    check_on_device("all_to_all_v", out);
    check_all_to_all_v(in, send_counts, out, recv_counts);
    LOOM_CHECK(send_counts[rank_] == recv_counts[rank_], "all_to_all_v on rank ", rank_, ": sends ",
               send_counts[rank_], " elements to itself but expects ", recv_counts[rank_]);
    check_separate("all_to_all_v", in, out);
    const auto [sent, received] = all_to_all_v_bytes(in.dtype(), rank_, send_counts, recv_counts);
    book_sent_received(COLL_ALL_TO_ALL, sent, received);
    return exchange("all_to_all_v", in, send_counts, out, recv_counts);
  }
  void send(const Tensor& x, int to, int tag) override { send_async(x, to, tag)->wait(); }
  // Deferred: the send is issued with this rank's next call on the communicator that has a tag
  // at least its own, in one NCCL group with it when that is a recv of the same tag (so two ranks
  // that each send to the other, then receive, exchange both messages at once: NCCL matches a
  // send only when the peer's receive runs, and one communicator's operations run in order on
  // its stream), or when its handle is waited for or dropped. Tags order the exchanges (the
  // pipeline's rounds, parallel/pipe_messages.h): deferred sends go out in ascending tag, one
  // group per tag. The data must stay unchanged until then, as for any asynchronous send.
  std::unique_ptr<CommWork> send_async(const Tensor& x, int to, int tag) override {
    LOOM_CHECK(to >= 0 && to < size_ && to != rank_, "send from rank ", rank_, " to rank ", to, ": no such peer");
    check_on_device("send", x);
    const ncclDataType_t t = nccl_type(x.dtype(), "send", rank_);
    book(COLL_SEND_RECV, static_cast<int64_t>(x.nbytes()));
    auto work = std::make_unique<NcclWork>("send", rank_, compute_);
    if (x.numel() == 0) {  // the receiver skips its empty message too
      work->record(compute_);
      return work;
    }
    pending_.push_back(PendingSend{dev_ptr(x), static_cast<size_t>(x.numel()), t, to, tag, work.get()});
    work->defer([this, tag] { issue_pending(tag); });
    return work;
  }
  // The deferred sends of lower tags go first, a group per tag; those of this tag go in one group
  // with the receive; those of higher tags stay deferred.
  void recv(const Tensor& x, int from, int tag) override {
    LOOM_CHECK(from >= 0 && from < size_ && from != rank_, "recv on rank ", rank_, " from rank ", from,
               ": no such peer");
    check_on_device("recv", x);
    const ncclDataType_t t = nccl_type(x.dtype(), "recv", rank_);
    book(COLL_SEND_RECV, static_cast<int64_t>(x.nbytes()), -2);
    enqueue(
        "recv",
        [&] {
          issue_sends_below("recv", tag);
          with_pending_sends("recv", tag, [&] {
            return x.numel() == 0 ? ncclSuccess
                                  : ncclRecv(dev_ptr(x), static_cast<size_t>(x.numel()), t, from, comm_, stream_);
          });
        },
        /*sends_in_body=*/true)
        ->wait();
  }
  // An all-reduce (max: the word stays 0) of one int every rank must join, then the host waits
  // for it. Not booked, as MPI's barrier is not.
  void barrier() override {
    enqueue("barrier", [&] {
      LOOM_NCCL_CHECK(ncclAllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclMax, comm_, stream_), "barrier",
                      rank_);
    })->wait();
  }

 private:
  void check_on_device(const char* op, const Tensor& t) const {
    LOOM_CHECK(t.device() == DEVICE_CUDA, op, " on rank ", rank_,
               ": the NCCL communicator needs CUDA device tensors, got ", t.describe(), " on ",
               device_name(t.device()));
  }
  // Disjoint byte ranges, not only different starts: overlapping views race inside NCCL (found by
  // the CUDA simulator's NCCL, which checks the buffers of every call).
  void check_separate(const char* op, const Tensor& in, const Tensor& out) const {
    const auto* a = static_cast<const char*>(dev_ptr(in));
    const auto* b = static_cast<const char*>(dev_ptr(out));
    const bool disjoint = a + in.nbytes() <= b || b + out.nbytes() <= a;
    LOOM_CHECK(in.numel() == 0 || out.numel() == 0 || disjoint, op, " on rank ", rank_,
               ": in and out must be separate buffers (they overlap)");
  }

  // Runs `body` (which enqueues NCCL work on stream_) after the work queued so far on the compute
  // stream, and returns the handle of its completion.
  // The deferred sends go first, a group per tag, unless the body issues them itself.
  template <typename Body>
  std::unique_ptr<NcclWork> enqueue(const char* op, Body&& body, bool sends_in_body = false) {
    LOOM_NCCL_CUDA_CHECK(cudaSetDevice(device_), op, rank_);
    auto work = std::make_unique<NcclWork>(op, rank_, compute_);
    LOOM_NCCL_CUDA_CHECK(cudaEventRecord(ready_, compute_), op, rank_);
    LOOM_NCCL_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0), op, rank_);
    if (!sends_in_body) issue_sends_below(op, std::numeric_limits<int64_t>::max());
    body();
    work->record(stream_);
    return work;
  }

  // The deferred sends of `tag` and `calls` (the caller's NCCL calls) in one group on stream_,
  // then each send's handle recorded.
  template <typename Calls>
  void with_pending_sends(const char* op, int tag, Calls&& calls) {
    std::vector<PendingSend> sends;
    const auto of_tag = std::stable_partition(pending_.begin(), pending_.end(),
                                              [tag](const PendingSend& p) { return p.tag != tag; });
    sends.assign(of_tag, pending_.end());
    pending_.erase(of_tag, pending_.end());
    grouped(op, [&] {
      for (const PendingSend& s : sends) {
        const ncclResult_t r = ncclSend(s.data, s.count, s.type, s.to, comm_, stream_);
        if (r != ncclSuccess) return r;
      }
      return calls();
    });
    for (const PendingSend& s : sends) s.work->record(stream_);
  }
  // The deferred sends of tags below `limit`, in ascending tag, one group per tag.
  void issue_sends_below(const char* op, int64_t limit) {
    while (!pending_.empty()) {
      const int lowest = std::min_element(pending_.begin(), pending_.end(), [](const PendingSend& a, const PendingSend& b) {
                           return a.tag < b.tag;
                         })->tag;
      if (lowest >= limit) return;
      with_pending_sends(op, lowest, [] { return ncclSuccess; });
    }
  }
  // The deferred sends of tags up to `tag` (a send's handle waited for or dropped first).
  void issue_pending(int tag) {
    if (std::none_of(pending_.begin(), pending_.end(), [tag](const PendingSend& p) { return p.tag <= tag; })) return;
    enqueue("send", [&] { issue_sends_below("send", int64_t{tag} + 1); }, /*sends_in_body=*/true);
  }

  // Issues `calls` (returning the first failed ncclResult_t, else ncclSuccess) inside one
  // ncclGroupStart/End; the group is closed even when a call inside it failed.
  template <typename Calls>
  void grouped(const char* op, Calls&& calls) {
    LOOM_NCCL_CHECK(ncclGroupStart(), op, rank_);
    const ncclResult_t call_in_group = calls();
    const ncclResult_t group_end = ncclGroupEnd();
    LOOM_NCCL_CHECK(call_in_group, op, rank_);
    LOOM_NCCL_CHECK(group_end, op, rank_);
  }

  // in's segment r (send_counts[r] elements) goes to rank r; out's segment r (recv_counts[r])
  // comes from rank r. This rank's own segment is a device copy; the rest are grouped
  // ncclSend/ncclRecv pairs, empty messages skipped on both sides.
  std::unique_ptr<CommWork> exchange(const char* op, const Tensor& in, const std::vector<int64_t>& send_counts,
                                     const Tensor& out, const std::vector<int64_t>& recv_counts) {
    const ncclDataType_t t = nccl_type(in.dtype(), op, rank_);
    const size_t elem = dtype_size(in.dtype());
    const std::vector<int64_t> send_offsets = segment_offsets(send_counts), recv_offsets = segment_offsets(recv_counts);
    return enqueue(op, [&] {
      if (send_counts[rank_] > 0) {
        LOOM_NCCL_CUDA_CHECK(cudaMemcpyAsync(dev_at(out, recv_offsets[rank_]), dev_at(in, send_offsets[rank_]),
                                             static_cast<size_t>(send_counts[rank_]) * elem, cudaMemcpyDeviceToDevice,
                                             stream_),
                             op, rank_);
      }
      grouped(op, [&] {
        for (int p = 0; p < size_; ++p) {
          if (p == rank_) continue;
          if (send_counts[p] > 0) {
            const ncclResult_t s =
                ncclSend(dev_at(in, send_offsets[p]), static_cast<size_t>(send_counts[p]), t, p, comm_, stream_);
            if (s != ncclSuccess) return s;
          }
          if (recv_counts[p] > 0) {
            const ncclResult_t s =
                ncclRecv(dev_at(out, recv_offsets[p]), static_cast<size_t>(recv_counts[p]), t, p, comm_, stream_);
            if (s != ncclSuccess) return s;
          }
        }
        return ncclSuccess;
      });
    });
  }

  // Frees everything this object holds; never throws. `abort`: ncclCommAbort (does not wait for
  // peers or for queued work), else wait for this stream's work and ncclCommDestroy.
  void release(bool abort) noexcept {
    for (const PendingSend& p : pending_) p.work->defer(nullptr);  // never issued: the communicator goes
    pending_.clear();
    cudaSetDevice(device_);
    if (!abort && stream_ != nullptr && cudaStreamSynchronize(stream_) != cudaSuccess) abort = true;
    if (comm_ != nullptr) {
      const ncclResult_t s = abort ? ncclCommAbort(comm_) : ncclCommDestroy(comm_);
      if (s != ncclSuccess) {
        std::fprintf(stderr, "loom: %s on rank %d failed: %s\n", abort ? "ncclCommAbort" : "ncclCommDestroy", rank_,
                     ncclGetErrorString(s));
      }
      comm_ = nullptr;
    }
    if (barrier_word_ != nullptr) cudaFree(barrier_word_);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    barrier_word_ = nullptr, ready_ = nullptr, stream_ = nullptr;
  }

  // A send_async not yet issued, and its handle (alive until recorded: it issues the send first).
  struct PendingSend {
    const void* data;
    size_t count;
    ncclDataType_t type;
    int to;
    int tag;  // its exchange's order (send_async)
    NcclWork* work;
  };

  ncclComm_t comm_;
  int device_;
  std::vector<PendingSend> pending_;
  cudaStream_t compute_;             // not owned
  cudaStream_t stream_ = nullptr;    // the collectives' stream (non-blocking)
  cudaEvent_t ready_ = nullptr;      // recorded on compute_ before each collective, waited on by stream_
  int32_t* barrier_word_ = nullptr;  // (1) device int all-reduced by barrier()
  int rank_ = -1, size_ = 0;
};

class RoutingCommunicator final : public Communicator {
 public:
  RoutingCommunicator(std::unique_ptr<Communicator> host, std::unique_ptr<Communicator> device)
      : host_(std::move(host)), device_(std::move(device)) {
    LOOM_CHECK(host_ != nullptr && device_ != nullptr,
               "routing communicator: needs both a host and a device communicator");
    LOOM_CHECK(host_->rank() == device_->rank() && host_->size() == device_->size(),
               "routing communicator: the host communicator (", host_->name(), ") has rank ", host_->rank(), " of ",
               host_->size(), ", the device communicator (", device_->name(), ") rank ", device_->rank(), " of ",
               device_->size(), "; they must span the same ranks in the same order");
  }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string name() const override { return host_->name() + "+" + device_->name(); }

  std::unique_ptr<CommWork> all_reduce_async(const Tensor& x, ReduceOp op) override {
    auto work = route(x).all_reduce_async(x, op);
    book(COLL_ALL_REDUCE, static_cast<int64_t>(x.nbytes()));
    return work;
  }
  std::unique_ptr<CommWork> reduce_scatter_async(const Tensor& full, const Tensor& shard, ReduceOp op) override {
    auto work = route("reduce_scatter", full, shard).reduce_scatter_async(full, shard, op);
    book(COLL_REDUCE_SCATTER, static_cast<int64_t>(full.nbytes()));
    return work;
  }
  std::unique_ptr<CommWork> all_gather_async(const Tensor& shard, const Tensor& full) override {
    auto work = route("all_gather", shard, full).all_gather_async(shard, full);
    book(COLL_ALL_GATHER, static_cast<int64_t>(full.nbytes()));
    return work;
  }
  std::unique_ptr<CommWork> all_to_all_async(const Tensor& in, const Tensor& out) override {
    auto work = route("all_to_all", in, out).all_to_all_async(in, out);
    book(COLL_ALL_TO_ALL, static_cast<int64_t>(in.nbytes()));
    return work;
  }
  std::unique_ptr<CommWork> broadcast_async(const Tensor& x, int root) override {
    auto work = route(x).broadcast_async(x, root);
    book(COLL_BROADCAST, static_cast<int64_t>(x.nbytes()), root);
    return work;
  }
  std::unique_ptr<CommWork> reduce_scatter_v_async(const Tensor& x, const std::vector<int64_t>& counts,
                                                   ReduceOp op) override {
    auto work = route(x).reduce_scatter_v_async(x, counts, op);
    book_v(COLL_REDUCE_SCATTER, static_cast<int64_t>(x.nbytes()), own_bytes(x, counts));
    return work;
  }
  std::unique_ptr<CommWork> all_gather_v_async(const Tensor& x, const std::vector<int64_t>& counts) override {
    auto work = route(x).all_gather_v_async(x, counts);
    book_v(COLL_ALL_GATHER, static_cast<int64_t>(x.nbytes()), own_bytes(x, counts));
    return work;
  }
  std::unique_ptr<CommWork> all_to_all_v_async(const Tensor& in, const std::vector<int64_t>& send_counts,
                                               const Tensor& out, const std::vector<int64_t>& recv_counts) override {
    auto work = route("all_to_all_v", in, out).all_to_all_v_async(in, send_counts, out, recv_counts);
    const auto [sent, received] = all_to_all_v_bytes(in.dtype(), rank(), send_counts, recv_counts);
    book_sent_received(COLL_ALL_TO_ALL, sent, received);
    return work;
  }
  void send(const Tensor& x, int to, int tag) override {
    route(x).send(x, to, tag);
    book(COLL_SEND_RECV, static_cast<int64_t>(x.nbytes()));
  }
  std::unique_ptr<CommWork> send_async(const Tensor& x, int to, int tag) override {
    auto work = route(x).send_async(x, to, tag);
    book(COLL_SEND_RECV, static_cast<int64_t>(x.nbytes()));
    return work;
  }
  void recv(const Tensor& x, int from, int tag) override {
    route(x).recv(x, from, tag);
    book(COLL_SEND_RECV, static_cast<int64_t>(x.nbytes()), -2);
  }
  void barrier() override {
    device_->barrier();
    host_->barrier();
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    auto host = host_->split(color, key);
    auto device = device_->split(color, key);
    return std::make_unique<RoutingCommunicator>(std::move(host), std::move(device));
  }

 private:
  Communicator& route(const Tensor& x) { return x.device() == DEVICE_CUDA ? *device_ : *host_; }
  Communicator& route(const char* op, const Tensor& a, const Tensor& b) {
    LOOM_CHECK(a.device() == b.device(), op, " on rank ", rank(), ": ", a.describe(), " is on ",
               device_name(a.device()), " but ", b.describe(), " on ", device_name(b.device()));
    return route(a);
  }
  // This rank's segment of a v-collective, in bytes (counts were checked by the inner communicator).
  int64_t own_bytes(const Tensor& x, const std::vector<int64_t>& counts) const {
    return counts[static_cast<size_t>(rank())] * static_cast<int64_t>(dtype_size(x.dtype()));
  }

  std::unique_ptr<Communicator> host_;    // MPI: host tensors
  std::unique_ptr<Communicator> device_;  // NCCL: DEVICE_CUDA tensors
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, int cuda_device,
                                                     cudaStream_t compute_stream) {
  const int rank = bootstrap.rank(), size = bootstrap.size();
  LOOM_NCCL_CUDA_CHECK(cudaSetDevice(cuda_device), "communicator setup", rank);
  // The unique id travels as 32 host int32s (an i32 broadcast is a plain byte copy).
  static_assert(sizeof(ncclUniqueId) == 32 * sizeof(int32_t), "the NCCL unique id is 128 bytes");
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank == 0) LOOM_NCCL_CHECK(ncclGetUniqueId(&id), "communicator setup", rank);
  CpuAllocator allocator;  // declared before `wire`, so it outlives it
  {
    Tensor wire = Tensor::zeros(allocator, {32}, DTYPE_I32, MEM_COMMUNICATION);
    if (rank == 0) std::memcpy(wire.data<int32_t>(), &id, sizeof(id));
    bootstrap.broadcast(wire, 0);
    std::memcpy(&id, wire.data<int32_t>(), sizeof(id));
  }
  ncclComm_t comm = nullptr;
  LOOM_NCCL_CHECK(ncclCommInitRank(&comm, size, id, rank), "communicator setup", rank);
  return std::make_unique<NcclCommunicator>(comm, cuda_device, compute_stream);
}

std::unique_ptr<Communicator> make_routing_communicator(std::unique_ptr<Communicator> host,
                                                        std::unique_ptr<Communicator> device) {
  return std::make_unique<RoutingCommunicator>(std::move(host), std::move(device));
}

}  // namespace loom
