// The CUDA simulator's NCCL (docs/cuda.md "The simulator"): the API of include/nccl.h over MPI,
// one NCCL rank per process, on the simulated device memory of sim_runtime.h. This file has the
// communicators, the checks at the call and the groups; nccl_exchange.cpp moves the data.
//
// Where the work runs. Loom initializes MPI with MPI_THREAD_FUNNELED, so every MPI call here is
// made by the thread that calls the NCCL function (the host thread), never by a stream's
// worker. An operation on `stream` therefore first drains the stream (loom::sim::drain: all the
// work enqueued on it before the call has run, including what it waits for through
// cudaStreamWaitEvent), then copies its inputs out of device memory (with_device_access), moves
// them between the processes with MPI while no device access is held, and writes its outputs
// back (with_device_access, mark_written). The simulated NCCL is thus synchronous with respect
// to the host: when the call returns the result is final, where real NCCL only enqueues the
// kernel. The values and the order of operations are those of the real library; work the
// caller enqueues on `stream` after the call still runs after it, and an event recorded on
// `stream` after the call completes at once.
//
// Communicators. ncclCommInitRank is MPI_Comm_split(MPI_COMM_WORLD, color from the unique id,
// key = rank): every process of MPI_COMM_WORLD must call it together, as Loom does
// (make_nccl_communicator over the world communicator). The processes that passed one id form
// the communicator; its size and this process's rank in it must be the nranks and rank given.
// A process whose arguments are wrong still takes part in the split (with MPI_UNDEFINED) before
// it returns its error, so its peers fail the size check instead of waiting forever.
// ncclCommSplit is MPI_Comm_split of the parent's MPI communicator (NCCL_SPLIT_NOCOLOR:
// MPI_UNDEFINED, and *newcomm = nullptr). Destroy and Abort free the MPI communicator. Each
// NCCL communicator has an MPI communicator of its own, so its messages never match Loom's MPI
// communicator's.
//
// Data movement. Every operation is built from nonblocking point-to-point messages (MPI_Isend /
// MPI_Irecv, split at 1 GiB so sizes beyond an int fit) completed with one MPI_Waitall, and
// reductions are computed here, in rank order 0, 1, ..., n-1, identically on every rank (as an
// NCCL all-reduce leaves identical copies). A call, or a group, runs in two rounds: first each
// communicator's ranks exchange a signature of the collectives they were given (MPI_Iallgather)
// and every send tells its receiver its count and type (a small header message); then the data
// moves. A group (ncclGroupStart/End, nestable, per thread as in NCCL) is recorded and runs at
// its outermost ncclGroupEnd: every stream involved is drained, then all the group's messages
// are posted at once and waited for together, so its sends and receives progress concurrently
// and cannot block each other ("Point-to-point communication" in NCCL's user guide,
// docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html). Outside a group a send or
// receive is such an operation on its own, i.e. a blocking MPI_Send / MPI_Recv: two ranks that
// both send before receiving can deadlock, as the guide warns. All of a group's inputs are read
// before any of its outputs is written.
//
// Reductions. Integers wrap (two's complement); float and double are reduced in their own
// precision; half and bfloat16 are widened to float, combined, and rounded back to nearest even
// after every step, as NCCL's kernels do with the partial results they pass along (one step
// computed in float and rounded once is that step's correctly rounded half / bfloat16). NCCL's
// order of summation depends on its algorithm (ring, tree); this one's is rank order, so float
// sums that round may differ from a GPU's in the last bits. ncclAvg follows NCCL's
// implementation (enqueue.cc, hostToDevRedOp): integers sum, then divide by nranks (truncating);
// floating types multiply every input by 1/nranks (rounded to the type), then sum. Reductions
// over the fp8 types are refused (ncclInvalidArgument); moving fp8 data works.
//
// NCCL's argument checks are made at the call, with its result codes: a null or destroyed
// communicator, a type or operation out of range, a root or peer outside 0..nranks-1 are
// ncclInvalidArgument; an error inside a group is returned by the call and again by
// ncclGroupEnd, which then drops the group ("Group Calls", usage/groups.html). Collectives with
// count 0 do nothing, as in NCCL. In-place operations are recognized as the guide defines them
// (usage/inplace.html): sendbuff == recvbuff, except ReduceScatter (recvbuff == sendbuff + rank *
// recvcount) and AllGather (sendbuff == recvbuff + rank * sendcount).
//
// Checks beyond NCCL's own (each writes a report through loom::sim::fail, which makes the
// device's error sticky):
//  - a buffer of count x size bytes that is not inside one device allocation: the call returns
//    ncclInvalidArgument (NCCL with NCCL_CHECK_POINTERS=1 does; by default the GPU would fault
//    with an illegal address). Only the bytes NCCL touches count: Broadcast's sendbuff on the
//    root only, Reduce's recvbuff on the root only;
//  - inputs that were never written (initcheck, loom::sim::check_initialized);
//  - a send and a receive buffer that overlap without being the in-place layout, or two
//    operations of one group of which one writes what the other reads or writes (a data race on
//    a GPU: NCCL runs a group's operations concurrently); the operation still runs;
//  - ranks that gave one communicator different collectives (kind, count, type, operation or
//    root) in one call or group: every rank detects it, nothing moves, and the call returns
//    ncclInvalidUsage (NCCL would hang or mix the data). A rank that calls no collective while
//    its peers call one still waits forever, as with NCCL;
//  - a ncclRecv whose count or type differs from its peer's ncclSend: the receive returns
//    ncclInvalidUsage and leaves recvbuff unchanged (NCCL requires the same count and type).
#include <mpi.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "loom/backend/cuda/sim/nccl_internal.h"
#include "loom/backend/cuda/sim/sim_runtime.h"

namespace loom::sim::nccl_detail {
namespace {

// ---------------------------------------------------------------------------------------------
// Errors: the last one (ncclGetLastError) and NCCL_DEBUG=WARN's line on stderr.

// Process-wide state is never destroyed: a communicator may be released by another static's
// destructor at exit.
struct LastError {
  std::mutex mutex;
  std::string message;
};
LastError& last_error() {
  static auto* e = new LastError;
  return *e;
}

bool debug_warns() {
  const char* level = std::getenv("NCCL_DEBUG");
  if (level == nullptr) return false;
  std::string v(level);
  for (char& c : v) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return v == "WARN" || v == "INFO" || v == "TRACE";
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

}  // namespace

// Records `message` as the last error, prints it as NCCL does under NCCL_DEBUG=WARN, returns code.
ncclResult_t warn(ncclResult_t code, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(last_error().mutex);
    last_error().message = message;
  }
  if (debug_warns()) {
    char host[64] = "?";
    gethostname(host, sizeof(host) - 1);
    std::fprintf(stderr, "%s:%d [sim] NCCL WARN %s\n", host, static_cast<int>(getpid()), message.c_str());
  }
  return code;
}

// ---------------------------------------------------------------------------------------------
// Communicators alive in this process (a destroyed or foreign handle is an invalid argument).

namespace {

struct Registry {
  std::mutex mutex;
  std::unordered_set<const ncclComm*> live;
  int next_serial = 1;
};
Registry& registry() {
  static auto* r = new Registry;
  return *r;
}

ncclComm* register_comm(MPI_Comm mpi, int cuda_device) {
  auto* comm = new ncclComm;
  comm->mpi = mpi;
  MPI_Comm_rank(mpi, &comm->rank);
  MPI_Comm_size(mpi, &comm->nranks);
  comm->cuda_device = cuda_device;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  comm->serial = r.next_serial++;
  r.live.insert(comm);
  return comm;
}

}  // namespace

bool is_live(const ncclComm* comm) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.live.count(comm) != 0;
}

std::string where(const ncclComm* comm) {
  return cat("rank ", comm->rank, " of ", comm->nranks, " (communicator ", comm->serial, ")");
}

// MPI must be initialized (Loom's make_mpi_communicator does it), not finalized, and called from
// the thread that initialized it unless it runs MPI_THREAD_MULTIPLE.
ncclResult_t check_mpi(const char* call) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized) {
    return warn(ncclInvalidUsage, cat(call, " : MPI is not initialized; the simulated NCCL runs over MPI, one rank per "
                                      "process: initialize MPI first (make_mpi_communicator) and run under mpirun"));
  }
  if (finalized) return warn(ncclInvalidUsage, cat(call, " : MPI is already finalized"));
  int level = MPI_THREAD_SINGLE, is_main = 0;
  MPI_Query_thread(&level);
  MPI_Is_thread_main(&is_main);
  if (level < MPI_THREAD_MULTIPLE && !is_main) {
    return warn(ncclInvalidUsage, cat(call, " : called from a thread other than the one that initialized MPI; MPI runs "
                                      "with a thread level below MPI_THREAD_MULTIPLE (Loom: MPI_THREAD_FUNNELED), so "
                                      "the simulated NCCL must be called from that thread"));
  }
  return ncclSuccess;
}

namespace {

// NCCL's CommCheck: a null communicator is an invalid argument.
ncclResult_t check_comm(const ncclComm* comm, const char* call) {
  if (comm == nullptr) return warn(ncclInvalidArgument, cat(call, " : comm argument is NULL"));
  if (!is_live(comm)) {
    return warn(ncclInvalidArgument,
                cat(call, " : comm ", hex(comm), " is not a live communicator (destroyed, aborted or never created)"));
  }
  return ncclSuccess;
}

// ---------------------------------------------------------------------------------------------
// Operations (nccl_internal.h): checked at the call, run now or at the group's end.

// The calling thread's open group (NCCL's group state is per thread).
struct GroupState {
  int depth = 0;
  std::vector<Op> ops;
  ncclResult_t error = ncclSuccess;  // the first call inside the group that failed
};
thread_local GroupState t_group;

// A buffer that must lie in device memory: "" when it does, else the report.
std::string device_range_report(const Op& op, const char* name, const Range& r, const char* access) {
  if (r.bytes == 0 || loom::sim::is_device_range(r.p, r.bytes)) return "";
  std::string report = cat(op.describe(), " on ", where(op.comm), ": ", name, " ", hex(r.p), " (", r.bytes, " bytes ",
                           access, ") does not lie inside one device allocation\n");
  if (!loom::sim::is_device_pointer(r.p)) {
    report += cat(name, " ", hex(r.p), ": ", loom::sim::describe_address(r.p));
  } else {  // starts inside an allocation and runs past its end: find the first byte outside
    size_t inside = 0, outside = r.bytes;  // is_device_range(p, inside) holds, (p, outside) does not
    while (outside - inside > 1) {
      const size_t mid = inside + (outside - inside) / 2;
      (loom::sim::is_device_range(r.p, mid) ? inside : outside) = mid;
    }
    report += cat("byte ", inside, " of it, ", hex(r.p + inside), ": ", loom::sim::describe_address(r.p + inside));
  }
  return report;
}

// NCCL's argument checks (enqueue.cc ArgsCheck) plus the simulator's buffer checks, at the call.
ncclResult_t check_op(const Op& op) {
  if (const ncclResult_t s = check_comm(op.comm, op.call); s != ncclSuccess) return s;
  if (!valid_type(op.type)) {
    return warn(ncclInvalidArgument, cat(op.call, " : invalid type ", static_cast<int>(op.type)));
  }
  if (reduces(op.kind)) {
    if (static_cast<int>(op.op) < 0 || static_cast<int>(op.op) >= ncclNumOps) {
      return warn(ncclInvalidArgument, cat(op.call, " : invalid reduction operation ", static_cast<int>(op.op)));
    }
    if (op.type == ncclFloat8e4m3 || op.type == ncclFloat8e5m2) {
      return warn(ncclInvalidArgument,
                  cat(op.call, " : the simulator does not reduce ", type_name(op.type), " (moving fp8 data works)"));
    }
  }
  if (has_root(op.kind) && (op.root < 0 || op.root >= op.nranks())) {
    return warn(ncclInvalidArgument, cat(op.call, " : invalid root ", op.root, " (root should be in the 0..",
                                         op.nranks() - 1, " range)"));
  }
  if (is_p2p(op.kind) && (op.root < 0 || op.root >= op.nranks())) {
    return warn(ncclInvalidArgument, cat(op.call, " : invalid peer ", op.root, " (peer should be in the 0..",
                                         op.nranks() - 1, " range)"));
  }
  const size_t elem = type_size(op.type), per_rank = static_cast<size_t>(op.nranks());
  if (op.count > SIZE_MAX / elem / per_rank) {
    return warn(ncclInvalidArgument, cat(op.call, " : count ", op.count, " of ", type_name(op.type), " overflows"));
  }
  if (op.count == 0) return ncclSuccess;
  std::string report;
  loom::sim::with_device_access([&] {
    report = device_range_report(op, "sendbuff", op.reads(), "read");
    if (report.empty()) report = device_range_report(op, "recvbuff", op.writes(), "written");
  });
  if (!report.empty()) {
    loom::sim::fail(cudaErrorIllegalAddress, report);
    return warn(ncclInvalidArgument, report);
  }
  if (!is_p2p(op.kind) && overlap(op.reads(), op.writes()) && !op.in_place()) {
    loom::sim::fail(cudaErrorLaunchFailure,
                    cat(op.describe(), " on ", where(op.comm), ": sendbuff ", hex(op.send), " (", op.reads().bytes,
                        " bytes) and recvbuff ", hex(op.recv), " (", op.writes().bytes,
                        " bytes) overlap but are not NCCL's in-place layout (user guide, \"In-place Operations\": ",
                        op.kind == Kind::AllGather        ? "sendbuff == recvbuff + rank * sendcount"
                        : op.kind == Kind::ReduceScatter ? "recvbuff == sendbuff + rank * recvcount"
                                                          : "sendbuff == recvbuff",
                        "); on a GPU the result is a data race"));
  }
  return ncclSuccess;
}

// Checks an operation, then runs it, or records it in the open group.
ncclResult_t submit(Op op) {
  const ncclResult_t checked = check_op(op);
  if (checked != ncclSuccess) {
    if (t_group.depth > 0 && t_group.error == ncclSuccess) t_group.error = checked;
    return checked;
  }
  if (!is_p2p(op.kind) && op.count == 0) return ncclSuccess;  // NCCL drops empty collectives
  if (t_group.depth > 0) {
    t_group.ops.push_back(std::move(op));
    return ncclSuccess;
  }
  const char* call = op.call;
  std::vector<Op> ops;
  ops.push_back(std::move(op));
  return run(ops, call);
}

Op make(Kind kind, const char* call, ncclComm* comm, cudaStream_t stream, const void* send, void* recv, size_t count,
        ncclDataType_t type, ncclRedOp_t op, int root) {
  Op o;
  o.kind = kind, o.call = call, o.comm = comm, o.stream = stream;
  o.send = static_cast<const char*>(send), o.recv = static_cast<char*>(recv);
  o.count = count, o.type = type, o.op = op, o.root = root;
  return o;
}

// ---------------------------------------------------------------------------------------------
// Unique ids: a magic prefix and random bytes; the communicator's color is drawn from them.

constexpr char kIdMagic[16] = {'l', 'o', 'o', 'm', '-', 's', 'i', 'm', '-', 'n', 'c', 'c', 'l', '-', 'i', 'd'};

int color_of(const ncclUniqueId& id) {
  uint32_t bits;
  std::memcpy(&bits, id.internal + sizeof(kIdMagic), sizeof(bits));
  return static_cast<int>(bits & 0x7fffffffu);
}

// Frees a communicator's MPI side (skipped once MPI is finalized) and forgets it.
void release(ncclComm* comm) {
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.live.erase(comm);
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm->mpi != MPI_COMM_NULL) MPI_Comm_free(&comm->mpi);
  delete comm;
}

// Drops the open group's operations on `comm`; returns how many there were.
size_t drop_group_ops(const ncclComm* comm) {
  const size_t before = t_group.ops.size();
  std::erase_if(t_group.ops, [&](const Op& op) { return op.comm == comm; });
  return before - t_group.ops.size();
}

ncclResult_t destroy(ncclComm* comm, const char* call) {
  if (comm == nullptr) return ncclSuccess;  // as NCCL
  if (const ncclResult_t s = check_comm(comm, call); s != ncclSuccess) return s;
  const size_t dropped = drop_group_ops(comm);
  release(comm);
  if (dropped != 0 && std::strcmp(call, "ncclCommDestroy") == 0) {
    return warn(ncclInvalidUsage, cat(call, " : ", dropped, " operation(s) on it were waiting in the open group; "
                                      "they were dropped"));
  }
  return ncclSuccess;
}

}  // namespace
}  // namespace loom::sim::nccl_detail

using namespace loom::sim::nccl_detail;

// ---------------------------------------------------------------------------------------------
// The API.

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return warn(ncclInvalidArgument, "ncclGetVersion : version argument is NULL");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return warn(ncclInvalidArgument, "ncclGetUniqueId : uniqueId argument is NULL");
  std::random_device device;
  std::memcpy(id->internal, kIdMagic, sizeof(kIdMagic));
  for (size_t at = sizeof(kIdMagic); at < NCCL_UNIQUE_ID_BYTES; at += sizeof(uint32_t)) {
    const uint32_t word = device();
    std::memcpy(id->internal + at, &word, std::min(sizeof(word), NCCL_UNIQUE_ID_BYTES - at));
  }
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  const char* call = "ncclCommInitRank";
  if (comm != nullptr) *comm = nullptr;
  if (const ncclResult_t s = check_mpi(call); s != ncclSuccess) return s;
  // A wrong argument is found before the split, which this process still joins (see the top).
  ncclResult_t local = ncclSuccess;
  if (comm == nullptr) {
    local = warn(ncclInvalidArgument, cat(call, " : newcomm argument is NULL"));
  } else if (nranks < 1 || rank < 0 || rank >= nranks) {
    local = warn(ncclInvalidArgument, cat(call, " : rank ", rank, " nranks ", nranks, ": rank must be in 0..nranks-1"));
  } else if (std::memcmp(id.internal, kIdMagic, sizeof(kIdMagic)) != 0) {
    local = warn(ncclInvalidArgument, cat(call, " : the unique id was not made by ncclGetUniqueId (or did not reach "
                                          "this rank intact)"));
  }
  MPI_Comm mpi = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, local == ncclSuccess ? color_of(id) : MPI_UNDEFINED, local == ncclSuccess ? rank : 0,
                 &mpi);
  if (local != ncclSuccess) return local;
  int size = 0, got = 0;
  MPI_Comm_size(mpi, &size);
  MPI_Comm_rank(mpi, &got);
  if (size != nranks || got != rank) {
    MPI_Comm_free(&mpi);
    return warn(ncclInvalidArgument,
                cat(call, " : rank ", rank, " of ", nranks, ": the processes that passed this unique id are ", size,
                    " and this one is rank ", got, " among them (check nranks and that ranks are 0..nranks-1; the "
                    "simulator needs every process of MPI_COMM_WORLD to call ncclCommInitRank together)"));
  }
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) device = 0;
  *comm = register_comm(mpi, device);
  return ncclSuccess;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  const char* call = "ncclCommSplit";
  if (newcomm != nullptr) *newcomm = nullptr;
  if (const ncclResult_t s = check_comm(comm, call); s != ncclSuccess) return s;
  if (const ncclResult_t s = check_mpi(call); s != ncclSuccess) return s;
  ncclResult_t local = ncclSuccess;
  if (newcomm == nullptr) {
    local = warn(ncclInvalidArgument, cat(call, " : newcomm argument is NULL"));
  } else if (color < 0 && color != NCCL_SPLIT_NOCOLOR) {
    local = warn(ncclInvalidArgument, cat(call, " : invalid color ", color, " (>= 0, or NCCL_SPLIT_NOCOLOR)"));
  } else if (config != nullptr && (config->magic != 0xcafebeef || config->size != sizeof(ncclConfig_t))) {
    local = warn(ncclInvalidArgument, cat(call, " : config was not initialized with NCCL_CONFIG_INITIALIZER"));
  }
  const bool joins = local == ncclSuccess && color != NCCL_SPLIT_NOCOLOR;
  MPI_Comm mpi = MPI_COMM_NULL;
  MPI_Comm_split(comm->mpi, joins ? color : MPI_UNDEFINED, key, &mpi);
  if (local != ncclSuccess || !joins) return local;
  *newcomm = register_comm(mpi, comm->cuda_device);
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) { return destroy(comm, "ncclCommDestroy"); }
ncclResult_t ncclCommAbort(ncclComm_t comm) { return destroy(comm, "ncclCommAbort"); }

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (const ncclResult_t s = check_comm(comm, "ncclCommCount"); s != ncclSuccess) return s;
  if (count == nullptr) return warn(ncclInvalidArgument, "ncclCommCount : count argument is NULL");
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (const ncclResult_t s = check_comm(comm, "ncclCommCuDevice"); s != ncclSuccess) return s;
  if (device == nullptr) return warn(ncclInvalidArgument, "ncclCommCuDevice : device argument is NULL");
  *device = comm->cuda_device;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (const ncclResult_t s = check_comm(comm, "ncclCommUserRank"); s != ncclSuccess) return s;
  if (rank == nullptr) return warn(ncclInvalidArgument, "ncclCommUserRank : rank argument is NULL");
  *rank = comm->rank;
  return ncclSuccess;
}

// NCCL 2.28's strings.
const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

// The last error of any communicator in this process (NCCL ignores the argument too).
const char* ncclGetLastError(ncclComm_t) {
  thread_local std::string copy;
  std::lock_guard<std::mutex> lock(last_error().mutex);
  copy = last_error().message;
  return copy.c_str();
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return submit(make(Kind::AllReduce, "ncclAllReduce", comm, stream, sendbuff, recvbuff, count, datatype, op, -1));
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  return submit(
      make(Kind::Broadcast, "ncclBroadcast", comm, stream, sendbuff, recvbuff, count, datatype, ncclSum, root));
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  return submit(make(Kind::Reduce, "ncclReduce", comm, stream, sendbuff, recvbuff, count, datatype, op, root));
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return submit(
      make(Kind::ReduceScatter, "ncclReduceScatter", comm, stream, sendbuff, recvbuff, recvcount, datatype, op, -1));
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  return submit(
      make(Kind::AllGather, "ncclAllGather", comm, stream, sendbuff, recvbuff, sendcount, datatype, ncclSum, -1));
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return submit(make(Kind::Send, "ncclSend", comm, stream, sendbuff, nullptr, count, datatype, ncclSum, peer));
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return submit(make(Kind::Recv, "ncclRecv", comm, stream, nullptr, recvbuff, count, datatype, ncclSum, peer));
}

ncclResult_t ncclGroupStart(void) {
  ++t_group.depth;
  return ncclSuccess;
}

// The outermost end runs the group, unless a call inside it failed: then, as in NCCL, the group's
// operations are dropped and its first error returned.
ncclResult_t ncclGroupEnd(void) {
  if (t_group.depth == 0) return warn(ncclInvalidUsage, "ncclGroupEnd : not in a group call");
  if (--t_group.depth > 0) return ncclSuccess;
  std::vector<Op> ops = std::move(t_group.ops);
  const ncclResult_t error = t_group.error;
  t_group.ops.clear();
  t_group.error = ncclSuccess;
  if (error != ncclSuccess) return error;
  return run(ops, "ncclGroupEnd");
}

}  // extern "C"
