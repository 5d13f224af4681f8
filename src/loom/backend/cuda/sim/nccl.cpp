// The CUDA simulator's NCCL (docs/cuda.md "The simulator"): the API of include/nccl.h over MPI,
// one NCCL rank per process, on the simulated device memory of sim_runtime.h.
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
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "loom/backend/cuda/sim/sim_runtime.h"
#include "loom/core/dtype.h"

// The communicator behind ncclComm_t (declared, not defined, by nccl.h).
struct ncclComm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int rank = 0, nranks = 1, cuda_device = 0;
  int serial = 0;  // 1, 2, ... in creation order within this process: names it in reports
};

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

template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

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

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Communicators alive in this process (a destroyed or foreign handle is an invalid argument).

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

bool is_live(const ncclComm* comm) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.live.count(comm) != 0;
}

// NCCL's CommCheck: a null communicator is an invalid argument.
ncclResult_t check_comm(const ncclComm* comm, const char* call) {
  if (comm == nullptr) return warn(ncclInvalidArgument, cat(call, " : comm argument is NULL"));
  if (!is_live(comm)) {
    return warn(ncclInvalidArgument,
                cat(call, " : comm ", hex(comm), " is not a live communicator (destroyed, aborted or never created)"));
  }
  return ncclSuccess;
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

// ---------------------------------------------------------------------------------------------
// Data types and reduction operations.

bool valid_type(ncclDataType_t t) { return static_cast<int>(t) >= 0 && static_cast<int>(t) < ncclNumTypes; }

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    case ncclNumTypes: break;
  }
  return 0;
}

const char* type_name(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: return "ncclInt8";
    case ncclUint8: return "ncclUint8";
    case ncclInt32: return "ncclInt32";
    case ncclUint32: return "ncclUint32";
    case ncclInt64: return "ncclInt64";
    case ncclUint64: return "ncclUint64";
    case ncclFloat16: return "ncclFloat16";
    case ncclFloat32: return "ncclFloat32";
    case ncclFloat64: return "ncclFloat64";
    case ncclBfloat16: return "ncclBfloat16";
    case ncclFloat8e4m3: return "ncclFloat8e4m3";
    case ncclFloat8e5m2: return "ncclFloat8e5m2";
    case ncclNumTypes: break;
  }
  return "(invalid type)";
}

const char* op_name(ncclRedOp_t op) {
  switch (op) {
    case ncclSum: return "ncclSum";
    case ncclProd: return "ncclProd";
    case ncclMax: return "ncclMax";
    case ncclMin: return "ncclMin";
    case ncclAvg: return "ncclAvg";
    default: return "(invalid operation)";
  }
}

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// bfloat16 (core/dtype.h's conversions: rounding to nearest even, NaN kept quiet).
float bf16_to_float(uint16_t h) { return loom::bf16_to_f32(loom::bf16{h}); }
uint16_t float_to_bf16(float f) { return loom::f32_to_bf16(f).bits; }

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 fraction bits. Widening is core/dtype.h's
// f16_to_f32; narrowing rounds to nearest even and keeps a NaN's top fraction bits.
uint16_t float_to_half(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t exponent = (u >> 23) & 0xffu, fraction = u & 0x7fffffu;
  if (exponent == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (fraction != 0 ? 0x200u | (fraction >> 13) : 0));
  const int e = static_cast<int>(exponent) - 127 + 15;  // the half's biased exponent
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00u);  // beyond the largest half: infinity
  uint32_t kept, rest, halfway;
  if (e > 0) {  // normal: drop 13 fraction bits
    kept = (static_cast<uint32_t>(e) << 10) | (fraction >> 13);
    rest = fraction & 0x1fffu;
    halfway = 0x1000u;
  } else {  // subnormal half: the 24-bit significand shifted right by 14 - e
    const int shift = 14 - e;
    if (shift > 24) return sign;  // below half the smallest subnormal: zero
    const uint32_t significand = fraction | 0x800000u;
    kept = significand >> shift;
    rest = significand & ((1u << shift) - 1);
    halfway = 1u << (shift - 1);
  }
  if (rest > halfway || (rest == halfway && (kept & 1u) != 0)) ++kept;  // may carry into the exponent: correct
  return static_cast<uint16_t>(sign | kept);
}

// Float types: values are loaded into Compute (float or double), combined, and stored back, the
// store rounding to the type.
template <typename Storage, typename Compute, Compute (*Load)(Storage), Storage (*Store)(Compute)>
struct FloatCodec {
  using storage = Storage;
  using compute = Compute;
  static Compute load(const char* p, size_t i) {
    Storage s;
    std::memcpy(&s, p + i * sizeof(Storage), sizeof(Storage));
    return Load(s);
  }
  static void store(char* p, size_t i, Compute v) {
    const Storage s = Store(v);
    std::memcpy(p + i * sizeof(Storage), &s, sizeof(Storage));
  }
  static Compute round(Compute v) { return Load(Store(v)); }
};
float id_f32(float v) { return v; }
double id_f64(double v) { return v; }
using F32 = FloatCodec<float, float, id_f32, id_f32>;
using F64 = FloatCodec<double, double, id_f64, id_f64>;
using F16 = FloatCodec<uint16_t, float, loom::f16_to_f32, float_to_half>;
using BF16 = FloatCodec<uint16_t, float, bf16_to_float, float_to_bf16>;

// dst = the fold of n contributions (contribution q: count elements at src + q * count * size),
// in rank order, every partial result rounded to the type.
template <typename Codec>
void fold_float(char* dst, const char* src, int n, size_t count, ncclRedOp_t op) {
  using C = typename Codec::compute;
  const size_t stride = count * sizeof(typename Codec::storage);
  const C scale = Codec::round(static_cast<C>(1.0 / n));  // ncclAvg's pre-multiplier
  auto input = [&](int q, size_t i) {
    const C v = Codec::load(src + static_cast<size_t>(q) * stride, i);
    return op == ncclAvg ? Codec::round(v * scale) : v;
  };
  for (size_t i = 0; i < count; ++i) Codec::store(dst, i, input(0, i));
  for (int q = 1; q < n; ++q) {
    for (size_t i = 0; i < count; ++i) {
      const C a = Codec::load(dst, i), b = input(q, i);
      C r = a;
      switch (op) {
        case ncclSum:
        case ncclAvg: r = a + b; break;
        case ncclProd: r = a * b; break;
        case ncclMax: r = std::fmax(a, b); break;
        case ncclMin: r = std::fmin(a, b); break;
        default: break;
      }
      Codec::store(dst, i, r);
    }
  }
}

template <typename T>
void fold_int(char* dst, const char* src, int n, size_t count, ncclRedOp_t op) {
  using U = std::make_unsigned_t<T>;
  const size_t stride = count * sizeof(T);
  auto load = [](const char* p, size_t i) {
    T v;
    std::memcpy(&v, p + i * sizeof(T), sizeof(T));
    return v;
  };
  auto store = [](char* p, size_t i, T v) { std::memcpy(p + i * sizeof(T), &v, sizeof(T)); };
  std::memcpy(dst, src, stride);
  for (int q = 1; q < n; ++q) {
    const char* in = src + static_cast<size_t>(q) * stride;
    for (size_t i = 0; i < count; ++i) {
      const T a = load(dst, i), b = load(in, i);
      T r = a;
      switch (op) {
        case ncclSum:
        case ncclAvg: r = static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b))); break;
        case ncclProd: r = static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b))); break;
        case ncclMax: r = std::max(a, b); break;
        case ncclMin: r = std::min(a, b); break;
        default: break;
      }
      store(dst, i, r);
    }
  }
  if (op == ncclAvg) {  // in 64 bits: n need not fit in T
    using Wide = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
    for (size_t i = 0; i < count; ++i) {
      store(dst, i, static_cast<T>(static_cast<Wide>(load(dst, i)) / static_cast<Wide>(n)));
    }
  }
}

void fold(char* dst, const char* src, int n, size_t count, ncclDataType_t type, ncclRedOp_t op) {
  switch (type) {
    case ncclInt8: fold_int<int8_t>(dst, src, n, count, op); break;
    case ncclUint8: fold_int<uint8_t>(dst, src, n, count, op); break;
    case ncclInt32: fold_int<int32_t>(dst, src, n, count, op); break;
    case ncclUint32: fold_int<uint32_t>(dst, src, n, count, op); break;
    case ncclInt64: fold_int<int64_t>(dst, src, n, count, op); break;
    case ncclUint64: fold_int<uint64_t>(dst, src, n, count, op); break;
    case ncclFloat16: fold_float<F16>(dst, src, n, count, op); break;
    case ncclFloat32: fold_float<F32>(dst, src, n, count, op); break;
    case ncclFloat64: fold_float<F64>(dst, src, n, count, op); break;
    case ncclBfloat16: fold_float<BF16>(dst, src, n, count, op); break;
    default: break;  // fp8 reductions are refused before they get here
  }
}

// ---------------------------------------------------------------------------------------------
// Operations: what a call asked for, checked at the call, run now or at the group's end.

enum class Kind : uint8_t { AllReduce, Broadcast, Reduce, ReduceScatter, AllGather, Send, Recv };

bool is_p2p(Kind k) { return k == Kind::Send || k == Kind::Recv; }
bool reduces(Kind k) { return k == Kind::AllReduce || k == Kind::Reduce || k == Kind::ReduceScatter; }
bool has_root(Kind k) { return k == Kind::Broadcast || k == Kind::Reduce; }

// What the matching ncclRecv learns about the ncclSend (NCCL requires the same count and type).
struct P2PHeader {
  uint64_t magic = 0;
  uint64_t count = 0;
  int64_t type = -1;
};
constexpr uint64_t kHeaderMagic = 0x6c6f6f6d6e63636cull;  // "loomnccl"

uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

struct Range {
  const char* p = nullptr;
  size_t bytes = 0;
};

struct Op {
  Kind kind = Kind::AllReduce;
  const char* call = "";  // "ncclAllReduce"
  ncclComm* comm = nullptr;
  cudaStream_t stream = nullptr;
  const char* send = nullptr;
  char* recv = nullptr;
  size_t count = 0;  // NCCL's count argument (per rank for AllGather and ReduceScatter)
  ncclDataType_t type = ncclFloat32;
  ncclRedOp_t op = ncclSum;
  int root = -1;  // the root, or the peer of a send / receive

  // Filled while it runs.
  std::vector<char> in;       // this rank's input bytes
  std::vector<char> scratch;  // the contributions a reduction folds (rank q's at q * block)
  std::vector<char> out;      // the bytes written to recv
  bool write_out = false;     // out goes to recv
  P2PHeader header;           // sent (Send) or received (Recv)
  size_t incoming = 0;        // the bytes a Recv's peer sends
  std::string error;          // a mismatch found while running: nothing is written
  ncclResult_t result = ncclSuccess;

  size_t block() const { return count * type_size(type); }
  int rank() const { return comm->rank; }
  int nranks() const { return comm->nranks; }
  // The bytes it reads from sendbuff and writes to recvbuff on this rank (NCCL's ArgsCheck:
  // Broadcast reads sendbuff only on the root, Reduce writes recvbuff only on the root).
  Range reads() const {
    switch (kind) {
      case Kind::AllReduce:
      case Kind::Reduce:
      case Kind::AllGather:
      case Kind::Send: return {send, block()};
      case Kind::Broadcast: return rank() == root ? Range{send, block()} : Range{};
      case Kind::ReduceScatter: return {send, block() * static_cast<size_t>(nranks())};
      case Kind::Recv: return {};
    }
    return {};
  }
  Range writes() const {
    switch (kind) {
      case Kind::AllReduce:
      case Kind::Broadcast:
      case Kind::ReduceScatter:
      case Kind::Recv: return {recv, block()};
      case Kind::Reduce: return rank() == root ? Range{recv, block()} : Range{};
      case Kind::AllGather: return {recv, block() * static_cast<size_t>(nranks())};
      case Kind::Send: return {};
    }
    return {};
  }
  // NCCL's in-place layouts (the user guide's "In-place Operations"): the send and receive
  // buffers may overlap only this way.
  bool in_place() const {
    switch (kind) {
      case Kind::AllReduce:
      case Kind::Broadcast:
      case Kind::Reduce: return send == recv;
      case Kind::ReduceScatter: return address(recv) == address(send) + static_cast<size_t>(rank()) * block();
      case Kind::AllGather: return address(send) == address(recv) + static_cast<size_t>(rank()) * block();
      default: return false;
    }
  }
  std::string describe() const {
    std::string s = cat(call, "(", count, " x ", type_name(type));
    if (reduces(kind)) s += cat(", ", op_name(op));
    if (has_root(kind)) s += cat(", root ", root);
    if (is_p2p(kind)) s += cat(kind == Kind::Send ? ", to peer " : ", from peer ", root);
    return s + ")";
  }
};

bool overlap(const Range& a, const Range& b) {
  if (a.bytes == 0 || b.bytes == 0) return false;
  const uintptr_t a0 = address(a.p), b0 = address(b.p);
  return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
}

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

// ---------------------------------------------------------------------------------------------
// Running a list of operations (one call, or a group).

constexpr int kTagHeader = 101, kTagP2P = 102, kTagCollective = 103;
constexpr size_t kMaxMessage = size_t{1} << 30;  // bytes per MPI message (counts are ints)

class Messages {
 public:
  void send(const char* p, size_t bytes, int peer, int tag, MPI_Comm comm) {
    for (size_t at = 0; at < bytes; at += kMaxMessage) {
      requests_.emplace_back();
      MPI_Isend(p + at, static_cast<int>(std::min(kMaxMessage, bytes - at)), MPI_BYTE, peer, tag, comm,
                &requests_.back());
    }
  }
  void recv(char* p, size_t bytes, int peer, int tag, MPI_Comm comm) {
    for (size_t at = 0; at < bytes; at += kMaxMessage) {
      requests_.emplace_back();
      MPI_Irecv(p + at, static_cast<int>(std::min(kMaxMessage, bytes - at)), MPI_BYTE, peer, tag, comm,
                &requests_.back());
    }
  }
  void add(MPI_Request r) { requests_.push_back(r); }
  // MPI_Request handles are values: the vector may grow while requests are pending.
  void wait_all() {
    if (!requests_.empty()) MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
    requests_.clear();
  }

 private:
  std::vector<MPI_Request> requests_;
};

// What every rank of a communicator says about the collectives of one call or group: equal on
// all ranks, or the ranks called different collectives.
struct Signature {
  int64_t collectives = 0, kind = -1, type = -1, count = -1, op = -1, root = -1;
  uint64_t hash = 14695981039346656037ull;  // FNV-1a over every collective's fields
  void add(const Op& o) {
    const int64_t fields[5] = {static_cast<int64_t>(o.kind), static_cast<int64_t>(o.type),
                               static_cast<int64_t>(o.count), reduces(o.kind) ? static_cast<int64_t>(o.op) : -1,
                               has_root(o.kind) ? o.root : -1};
    if (collectives++ == 0) kind = fields[0], type = fields[1], count = fields[2], op = fields[3], root = fields[4];
    for (int64_t f : fields) {
      for (int b = 0; b < 8; ++b) hash = (hash ^ ((static_cast<uint64_t>(f) >> (8 * b)) & 0xffu)) * 1099511628211ull;
    }
  }
  bool operator==(const Signature&) const = default;
  std::string describe() const {
    static const char* const names[] = {"ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclReduceScatter",
                                        "ncclAllGather"};
    if (collectives == 0) return "no collective";
    std::string s = cat(collectives, " collective(s), the first ", kind >= 0 && kind < 5 ? names[kind] : "?", "(",
                        count, " x ", type_name(static_cast<ncclDataType_t>(type)));
    if (op >= 0) s += cat(", ", op_name(static_cast<ncclRedOp_t>(op)));
    if (root >= 0) s += cat(", root ", root);
    return s + ")";
  }
};
static_assert(sizeof(Signature) == 7 * sizeof(int64_t), "a Signature travels as 7 int64s");

struct CommCheck {
  ncclComm* comm = nullptr;
  Signature mine;
  std::vector<Signature> all;
};

// Sizes the op's buffers and posts its messages (after its input is in op.in).
void post(Op& op, Messages& m) {
  const int r = op.rank(), n = op.nranks(), tag = kTagCollective;
  const size_t b = op.block();
  const MPI_Comm c = op.comm->mpi;
  switch (op.kind) {
    case Kind::AllReduce:
    case Kind::ReduceScatter:
      op.scratch.assign(b * static_cast<size_t>(n), 0);
      std::memcpy(op.scratch.data() + static_cast<size_t>(r) * b,
                  op.in.data() + (op.kind == Kind::ReduceScatter ? static_cast<size_t>(r) * b : 0), b);
      for (int p = 0; p < n; ++p) {
        if (p == r) continue;
        m.recv(op.scratch.data() + static_cast<size_t>(p) * b, b, p, tag, c);
        m.send(op.in.data() + (op.kind == Kind::ReduceScatter ? static_cast<size_t>(p) * b : 0), b, p, tag, c);
      }
      op.out.assign(b, 0);
      op.write_out = true;
      break;
    case Kind::Reduce:
      if (r == op.root) {
        op.scratch.assign(b * static_cast<size_t>(n), 0);
        std::memcpy(op.scratch.data() + static_cast<size_t>(r) * b, op.in.data(), b);
        for (int p = 0; p < n; ++p) {
          if (p != r) m.recv(op.scratch.data() + static_cast<size_t>(p) * b, b, p, tag, c);
        }
        op.out.assign(b, 0);
        op.write_out = true;
      } else {
        m.send(op.in.data(), b, op.root, tag, c);
      }
      break;
    case Kind::Broadcast:
      if (r == op.root) {
        op.out = op.in;
        for (int p = 0; p < n; ++p) {
          if (p != r) m.send(op.in.data(), b, p, tag, c);
        }
      } else {
        op.out.assign(b, 0);
        m.recv(op.out.data(), b, op.root, tag, c);
      }
      op.write_out = true;
      break;
    case Kind::AllGather:
      op.out.assign(b * static_cast<size_t>(n), 0);
      std::memcpy(op.out.data() + static_cast<size_t>(r) * b, op.in.data(), b);
      for (int p = 0; p < n; ++p) {
        if (p == r) continue;
        m.recv(op.out.data() + static_cast<size_t>(p) * b, b, p, tag, c);
        m.send(op.in.data(), b, p, tag, c);
      }
      op.write_out = true;
      break;
    case Kind::Send: m.send(op.in.data(), b, op.root, kTagP2P, c); break;
    case Kind::Recv:  // the sender's size decides what arrives; after a mismatch it is dropped
      op.out.assign(op.incoming, 0);
      m.recv(op.out.data(), op.incoming, op.root, kTagP2P, c);
      op.write_out = op.error.empty();
      break;
  }
}

// The op's result once its messages arrived.
void finish(Op& op) {
  const int n = op.nranks();
  switch (op.kind) {
    case Kind::AllReduce:
    case Kind::ReduceScatter: fold(op.out.data(), op.scratch.data(), n, op.count, op.type, op.op); break;
    case Kind::Reduce:
      if (op.rank() == op.root) fold(op.out.data(), op.scratch.data(), n, op.count, op.type, op.op);
      break;
    default: break;
  }
  op.scratch.clear();
  op.scratch.shrink_to_fit();
}

std::string what_reads(const Op& op) { return cat(op.describe(), " sendbuff on ", where(op.comm)); }

// Two operations of one group that touch the same bytes, one of them writing.
void check_group_races(const std::vector<Op>& ops, const char* call) {
  for (size_t i = 0; i < ops.size(); ++i) {
    for (size_t j = i + 1; j < ops.size(); ++j) {
      const Op &a = ops[i], &b = ops[j];
      const char* conflict = overlap(a.writes(), b.writes())  ? "both write"
                             : overlap(a.writes(), b.reads()) ? "the first writes what the second reads"
                             : overlap(a.reads(), b.writes()) ? "the second writes what the first reads"
                                                              : nullptr;
      if (conflict == nullptr) continue;
      loom::sim::fail(cudaErrorLaunchFailure,
                      cat(call, " on ", where(a.comm), ": operations ", i + 1, " and ", j + 1,
                          " of one group touch the same device memory (", conflict, "): ", a.describe(), " and ",
                          b.describe(), "\nNCCL runs the operations of a group concurrently (user guide, \"Group "
                          "Calls\"): on a GPU the result is a data race; here every input was read before any "
                          "output was written"));
    }
  }
}

// Everything enqueued before the calls has run; then the inputs are copied out of device memory.
void read_inputs(std::vector<Op>& ops, const char* call) {
  std::vector<cudaStream_t> streams;
  for (const Op& op : ops) {
    if (std::find(streams.begin(), streams.end(), op.stream) == streams.end()) streams.push_back(op.stream);
  }
  for (cudaStream_t s : streams) loom::sim::drain(s);
  if (ops.size() > 1) check_group_races(ops, call);
  loom::sim::with_device_access([&] {
    for (Op& op : ops) {
      const Range r = op.reads();
      if (r.bytes == 0) continue;
      loom::sim::check_initialized(r.p, r.bytes, what_reads(op).c_str());
      op.in.assign(r.p, r.p + r.bytes);
    }
  });
}

// Round 1: every rank's collectives on each communicator, and each send's count and type. An
// operation that does not match its peers' gets its error (and moves nothing in round 2).
void agree_with_peers(std::vector<Op>& ops, const char* call) {
  std::vector<CommCheck> checks;
  for (const Op& op : ops) {
    if (is_p2p(op.kind)) continue;
    auto it = std::find_if(checks.begin(), checks.end(), [&](const CommCheck& c) { return c.comm == op.comm; });
    if (it == checks.end()) {
      checks.push_back(CommCheck{op.comm, {}, {}});
      it = checks.end() - 1;
    }
    it->mine.add(op);
  }
  Messages messages;
  for (CommCheck& c : checks) {
    c.all.resize(static_cast<size_t>(c.comm->nranks));
    MPI_Request request;
    MPI_Iallgather(&c.mine, 7, MPI_INT64_T, c.all.data(), 7, MPI_INT64_T, c.comm->mpi, &request);
    messages.add(request);
  }
  for (Op& op : ops) {
    if (op.kind == Kind::Send) {
      op.header = P2PHeader{kHeaderMagic, op.count, static_cast<int64_t>(op.type)};
      messages.send(reinterpret_cast<const char*>(&op.header), sizeof(P2PHeader), op.root, kTagHeader, op.comm->mpi);
    } else if (op.kind == Kind::Recv) {
      messages.recv(reinterpret_cast<char*>(&op.header), sizeof(P2PHeader), op.root, kTagHeader, op.comm->mpi);
    }
  }
  messages.wait_all();

  for (const CommCheck& c : checks) {
    bool same = true;
    for (const Signature& s : c.all) same = same && s == c.mine;
    if (same) continue;
    std::string report = cat(call, " on ", where(c.comm),
                             ": the ranks called different collectives on this communicator (every rank must call "
                             "the same collectives, in the same order, with the same count, type, operation and "
                             "root; NCCL would hang or mix the data). Nothing was moved:");
    for (size_t q = 0; q < c.all.size(); ++q) report += cat("\nrank ", q, ": ", c.all[q].describe());
    for (Op& op : ops) {
      if (op.comm == c.comm && !is_p2p(op.kind)) op.error = report, op.result = ncclInvalidUsage;
    }
  }
  for (Op& op : ops) {
    if (op.kind != Kind::Recv) continue;
    const P2PHeader& h = op.header;
    op.incoming = op.block();
    if (h.magic == kHeaderMagic && h.count == op.count && h.type == static_cast<int64_t>(op.type)) continue;
    op.error = cat(op.describe(), " on ", where(op.comm), ": rank ", op.root, " sent ", h.count, " x ",
                   type_name(static_cast<ncclDataType_t>(h.type)), "; a receive needs its send's count and type (user "
                   "guide, \"Point-to-point communication\"). Its data was dropped; recvbuff is unchanged");
    op.result = ncclInvalidUsage;
    const bool known = h.magic == kHeaderMagic && valid_type(static_cast<ncclDataType_t>(h.type));
    op.incoming = known ? static_cast<size_t>(h.count) * type_size(static_cast<ncclDataType_t>(h.type)) : 0;
  }
}

// Round 2: the data; then the outputs into device memory, and the first error as the result.
ncclResult_t move_data(std::vector<Op>& ops) {
  Messages messages;
  for (Op& op : ops) {
    if (op.error.empty() || op.kind == Kind::Recv) post(op, messages);
  }
  messages.wait_all();
  for (Op& op : ops) {
    if (op.error.empty()) finish(op);
  }
  loom::sim::with_device_access([&] {
    for (Op& op : ops) {
      if (!op.error.empty() || !op.write_out) continue;
      std::memcpy(op.recv, op.out.data(), op.out.size());
      loom::sim::mark_written(op.recv, op.out.size());
    }
  });
  ncclResult_t result = ncclSuccess;
  std::string reported;
  for (const Op& op : ops) {
    if (op.result == ncclSuccess) continue;
    if (result == ncclSuccess) result = warn(op.result, op.error);
    if (op.error != reported) loom::sim::fail(cudaErrorLaunchFailure, op.error), reported = op.error;
  }
  return result;
}

// Runs a call's or a group's operations. `call`: the API function that runs them (the
// operation's own, or ncclGroupEnd).
ncclResult_t run(std::vector<Op>& ops, const char* call) {
  if (ops.empty()) return ncclSuccess;
  if (const ncclResult_t s = check_mpi(call); s != ncclSuccess) return s;
  for (const Op& op : ops) {
    if (!is_live(op.comm)) {
      return warn(ncclInvalidUsage, cat(op.call, " : its communicator was destroyed in the group"));
    }
  }
  read_inputs(ops, call);
  agree_with_peers(ops, call);
  return move_data(ops);
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
