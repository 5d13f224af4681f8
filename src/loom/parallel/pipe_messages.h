// The point-to-point plan of a pipeline schedule: which activation store each forward uses, and
// the round in which each message between two ranks is exchanged.
//
// Why rounds. Over MPI a send is asynchronous and a receive matches its message by tag, so any
// order of sends and receives that the schedule allows runs. Over NCCL a send completes only when
// the peer's receive runs, one communicator's operations run in order on its stream, and a group
// of them completes only when all of it has: a rank that puts a send in the same group as its
// receive waits until the peer has taken that send, and if the peer takes it only after a
// message the first rank sends after the group, both wait for ever (found on the interleaved
// schedule, p 2, m 4, v 2). The plan removes the guesswork: it executes every rank's action list
// as the runner does (receives and the waits for a store's last send block; sends do not) in
// lock step, one receive per rank per round, and numbers each message by the round in which its
// receiver takes it. Each rank then issues its messages in round order, a round's sends and
// receive in one group (NCCL's batched exchange): the communicator's tag (comm/communicator.h).
//
// Deadlock-free by construction: take the earliest round not complete; each rank in it is
// blocked in a receive or a send's wait of that round or a later one, and by then the plan has it
// call every operation of rounds up to that one, so the round's groups are all issued and at the
// head of their streams, and complete. The same rounds are the MPI tags: a rank receives one
// message per round, so (sender, receiver, round) names one message of a step.
#pragma once
#include <vector>

#include "loom/parallel/pipeline_schedule.h"

namespace loom {

struct PipeMessagePlan {
  int slot = -1;        // F: its chunk's activation store, the first not held by a live micro-batch
  int recv_round = -1;  // the round of its receive from another rank (-1: none, or a local hand-off)
  int send_round = -1;  // the round of its send to another rank (-1: none, or a local hand-off)
};

// [rank][action] of schedule.per_rank. Throws a one-line error naming the schedule if it cannot
// run (a receive whose message is never sent).
std::vector<std::vector<PipeMessagePlan>> plan_pipe_messages(const PipeSchedule& schedule);

}  // namespace loom
