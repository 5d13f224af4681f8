// The simulator's NCCL, its data movement (nccl.cpp's top comment says how the library works):
// the data types and their reductions in rank order, and the two rounds that run one call's or
// one group's operations over MPI (the peers agree on the collectives, then the data moves).
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "loom/backend/cuda/sim/nccl_internal.h"
#include "loom/backend/cuda/sim/sim_runtime.h"
#include "loom/core/dtype.h"

namespace loom::sim::nccl_detail {

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

namespace {

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
// operation that does not match its peers' gets its error (and moves nothing in round 2). A send's
// data is posted here too, into `data` (waited for in round 2), as a GPU's send progresses while
// the rest of its group waits: a group that sends to a peer and receives from it must not wait
// for that peer's own group to reach its second round (a pipeline's "send activations, receive
// gradients" on one rank and "send gradients, receive activations" on the other).
void agree_with_peers(std::vector<Op>& ops, const char* call, Messages& data) {
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
      post(op, data);
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

// Round 2: the data (the sends' already posted in round 1); then the outputs into device memory,
// and the first error as the result.
ncclResult_t move_data(std::vector<Op>& ops, Messages& messages) {
  for (Op& op : ops) {
    if (op.kind != Kind::Send && (op.error.empty() || op.kind == Kind::Recv)) post(op, messages);
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

}  // namespace

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
  Messages data;
  agree_with_peers(ops, call, data);
  return move_data(ops, data);
}

}  // namespace loom::sim::nccl_detail
