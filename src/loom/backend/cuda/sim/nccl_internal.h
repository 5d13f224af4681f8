// Shared between the simulator's NCCL API (nccl.cpp: communicators, argument checks, groups)
// and its data movement (nccl_exchange.cpp: data types, reductions, the MPI rounds): the
// operation a call records and what both halves call. Not for callers.
#pragma once
#include <mpi.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

// The communicator behind ncclComm_t (declared, not defined, by nccl.h).
struct ncclComm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int rank = 0, nranks = 1, cuda_device = 0;
  int serial = 0;  // 1, 2, ... in creation order within this process: names it in reports
};

namespace loom::sim::nccl_detail {

template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// nccl.cpp: errors (the last one, NCCL_DEBUG=WARN), live communicators, MPI's state.
ncclResult_t warn(ncclResult_t code, const std::string& message);
bool is_live(const ncclComm* comm);
std::string where(const ncclComm* comm);
ncclResult_t check_mpi(const char* call);

// nccl_exchange.cpp: data types and reduction operations.
bool valid_type(ncclDataType_t t);
size_t type_size(ncclDataType_t t);
const char* type_name(ncclDataType_t t);
const char* op_name(ncclRedOp_t op);

// ---------------------------------------------------------------------------------------------
// Operations: what a call asked for, checked at the call, run now or at the group's end.

enum class Kind : uint8_t { AllReduce, Broadcast, Reduce, ReduceScatter, AllGather, Send, Recv };

inline bool is_p2p(Kind k) { return k == Kind::Send || k == Kind::Recv; }
inline bool reduces(Kind k) { return k == Kind::AllReduce || k == Kind::Reduce || k == Kind::ReduceScatter; }
inline bool has_root(Kind k) { return k == Kind::Broadcast || k == Kind::Reduce; }

// What the matching ncclRecv learns about the ncclSend (NCCL requires the same count and type).
struct P2PHeader {
  uint64_t magic = 0;
  uint64_t count = 0;
  int64_t type = -1;
};
constexpr uint64_t kHeaderMagic = 0x6c6f6f6d6e63636cull;  // "loomnccl"

inline uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

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

inline bool overlap(const Range& a, const Range& b) {
  if (a.bytes == 0 || b.bytes == 0) return false;
  const uintptr_t a0 = address(a.p), b0 = address(b.p);
  return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
}

// nccl_exchange.cpp: runs a call's or a group's operations.
ncclResult_t run(std::vector<Op>& ops, const char* call);

}  // namespace loom::sim::nccl_detail
