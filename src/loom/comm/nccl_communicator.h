// The NCCL communicator: the Communicator interface over CUDA device tensors (DEVICE_CUDA;
// f32, bf16, f64, i32), one GPU per rank, and a routing communicator that sends device tensors
// to NCCL and host tensors to MPI.
//
// Streams and events. The communicator owns a stream (cudaStreamNonBlocking) on which every
// collective runs, and is handed the compute stream that produces and consumes the tensors.
// Each call first makes its stream wait for the work already queued on the compute stream
// (cudaEventRecord on compute + cudaStreamWaitEvent), so data written by earlier kernels is
// final before NCCL reads it; the host never blocks there. The returned CommWork holds the
// collective's completion event. CommWork::wait() means "the buffers are final for both the
// host and later kernels": it makes the compute stream wait for the event (kernels queued on
// the compute stream after wait() see the result) and blocks the host until it has fired
// (cudaEventSynchronize). A CommWork dropped without wait() does the same in its destructor,
// as the MPI one does. Blocking forms (send, recv, barrier, all_reduce, ...) are the async
// form + wait().
//
// The byte ledger is booked with exactly the MPI communicator's formulas (communicator.h),
// from the same checks in the same order, so a layout moved from MPI to NCCL reports the same
// bytes per rank.
//
// Differences from MPI a caller must know:
//  - Tags do not match messages: NCCL matches the sends and receives between two ranks in call
//    order. A tag orders the deferred sends instead (below).
//  - recv cannot check the sender's element count; a mismatch is undefined (NCCL may hang).
//  - An NCCL send completes only when the peer's matching receive runs, and one communicator's
//    operations run in order on its stream, so two ranks that each send to the other before
//    receiving would deadlock (MPI's Isend does not). send_async therefore defers the send: it is
//    issued with the rank's next recv of a tag at least its own, in one NCCL group with it when
//    the tags are equal (a pipeline's "send activations, receive gradients" is one exchange),
//    before any other call, or when its handle is waited for or dropped. Deferred sends go out
//    in ascending tag, one group per tag: callers whose sends and receives must pair across
//    ranks number the exchanges (the pipeline's rounds, parallel/pipe_messages.h); callers with
//    one tag get every deferred send in one group with the next receive.
//  - reduce_scatter_v / all_gather_v are one grouped ncclReduce / ncclBroadcast per segment
//    (the ledger still books the ring volume of communicator.h).
//  - in and out of all_to_all(_v) must be separate buffers.
#pragma once
#include <cuda_runtime_api.h>

#include <memory>

#include "loom/comm/communicator.h"

namespace loom {

// An NCCL communicator over the ranks of `bootstrap` (an MPI communicator: the 128-byte NCCL
// unique id is made on its rank 0 and broadcast over it as a host tensor, which books one
// broadcast of 128 bytes in bootstrap's ledger). Every rank of bootstrap calls it; rank and
// size are bootstrap's. Sets `cuda_device` as the calling thread's current device; ranks of
// one communicator must use distinct GPUs. `compute_stream` is the stream that produces and
// consumes the tensors handed to the collectives; it must outlive the communicator and its
// CommWork handles. nullptr means the legacy default stream here: code built with
// --default-stream per-thread should pass its stream explicitly. split(color, key) (color >= 0) makes
// a sub-communicator with ncclCommSplit on the same device and compute stream.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, int cuda_device,
                                                     cudaStream_t compute_stream);

// One communicator over two that span the same ranks in the same order: tensors on DEVICE_CUDA
// go to `device` (NCCL), host tensors to `host` (MPI). rank() and size() are host's (checked
// equal to device's here). A call's tensors must all be on one device. split() splits both;
// barrier() is the device barrier, then the host one. The ledger books every call routed
// through it, with the formulas of communicator.h, once the inner communicator has accepted
// the call; the inner communicators' own ledgers are not read.
std::unique_ptr<Communicator> make_routing_communicator(std::unique_ptr<Communicator> host,
                                                        std::unique_ptr<Communicator> device);

}  // namespace loom
