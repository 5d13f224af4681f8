// Pipeline-parallel schedules as data, and a discrete-event simulator that times them.
//
// Legend: p = ranks of the pipeline (parallel.pp), m = micro-batches per step
// (parallel.micro_batches), v = model chunks per rank (parallel.virtual_stages). The model is cut
// into p*v model stages; model stage s is chunk c on rank r with s = c*p + r (Megatron's
// interleaved assignment, Narayanan et al. 2021), so with v = 1 stage s is rank s.
//
// A schedule is, per rank, the ordered list of actions (chunk, micro-batch, F/B/W) that rank
// executes, strictly in order. A runner walks its rank's list: F runs the chunk's forward on the
// micro-batch (receiving activations from the previous model stage, sending to the next), B its
// backward (receiving the output gradient from the next stage, sending the input gradient to the
// previous one), W its weight gradient. pipe_links() says who sends and receives for each action.
//
// Kinds (make_pipe_schedule):
//   gpipe        all F, then all B in micro-batch order 0..m-1 (Huang et al. 2019; Megatron's
//                1F1B with every micro-batch a warm-up one). Bubble (p-1)/(m+p-1) of the time.
//   1f1b         Megatron's non-interleaved 1F1B (Narayanan et al. 2021): rank r runs
//                min(p-r-1, m) warm-up forwards, then alternates F and B, then drains the
//                remaining B. Same bubble as GPipe; at most min(p-r, m) micro-batches live.
//   interleaved  Megatron's interleaved 1F1B with v >= 2 chunks per rank and m a multiple of p.
//                Bubble/ideal (1/v)(p-1)/m.
//   zb-h1        Zero Bubble H1 (Qi et al. 2024, arXiv 2401.10241): the backward split into B
//                (input gradient) and W (weight gradient). F and B in 1F1B's order; rank r runs
//                W(i) right after B(i+r) and the W left over at the end. Bubble per rank
//                (p-1)(T_F+T_B-T_W) for m >= p and T_W <= T_F.
// For gpipe, 1f1b and interleaved B is the whole backward (input and weight gradient).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/enum_names.h"

namespace loom {

// parallel.schedule, the kinds listed above.
enum class PipeScheduleKind { gpipe, one_f_one_b, interleaved, zb_h1 };
template <>
struct EnumNames<PipeScheduleKind> {
  static constexpr std::array<std::string_view, 4> names{"gpipe", "1f1b", "interleaved", "zb-h1"};
};

enum PipeOp : uint8_t { PIPE_F, PIPE_B, PIPE_W, PIPE_OP_COUNT };

struct PipeAction {
  int chunk = 0;  // model chunk (virtual stage) on the executing rank, 0..v-1
  int micro = 0;  // micro-batch, 0..m-1
  PipeOp op = PIPE_F;
  bool operator==(const PipeAction&) const = default;
};

struct PipeSchedule {
  PipeScheduleKind kind = PipeScheduleKind::one_f_one_b;
  int stages = 1;             // p: ranks of the pipeline
  int micro = 1;              // m: micro-batches per step
  int virtual_chunks = 1;     // v: model chunks per rank
  bool split_backward = false;  // true: B is the input gradient only and every (stage, micro) has a W
  std::vector<std::vector<PipeAction>> per_rank;  // [rank][step]: executed strictly in order

  int model_stages() const;                 // p * v
  int stage_of(int rank, int chunk) const;  // chunk * p + rank
  int rank_of(int stage) const;             // stage % p
  int chunk_of(int stage) const;            // stage / p
};

// The schedule `kind` for p ranks, m micro-batches and v chunks per rank. One-line errors name
// parallel.pp, parallel.micro_batches, parallel.schedule or parallel.virtual_stages.
PipeSchedule make_pipe_schedule(PipeScheduleKind kind, int p, int m, int v = 1);
// The same by name (tests, benchmarks): an unknown name is an error naming parallel.schedule.
PipeSchedule make_pipe_schedule(const std::string& kind, int p, int m, int v = 1);

// The kinds make_pipe_schedule accepts, in the order of the list above.
const std::vector<std::string>& pipe_schedule_kinds();

// Throws a one-line error naming the schedule and rank unless every rank lists each of its
// (chunk, micro-batch, op) exactly once: F and B always, W exactly when split_backward.
void validate_pipe_schedule(const PipeSchedule& schedule);

// Peers of one action of `rank`: the rank its input comes from and the rank its output goes to,
// -1 when there is none (F of the first model stage receives nothing, B of it sends nothing;
// F of the last stage sends nothing, B of it receives nothing: its gradient starts at the loss;
// W neither). A peer may be `rank` itself (p = 1): the hand-off is local.
struct PipeLinks {
  int recv_from = -1;
  int send_to = -1;
};
PipeLinks pipe_links(const PipeSchedule& schedule, int rank, const PipeAction& action);

// "F3", "B3", "W3"; with v > 1 the chunk follows the micro-batch: "F3.1" is micro 3, chunk 1.
std::string pipe_action_name(const PipeSchedule& schedule, const PipeAction& action);

// One line per rank: "rank 0: F0 F1 F2 B0 F3 B1 ...\n".
std::string describe_schedule(const PipeSchedule& schedule);

// Time of each action as executed (per chunk: with v chunks a chunk is 1/v of a rank's layers).
struct PipeCosts {
  double f = 1;    // F
  double b = 1;    // B of a split schedule; an unsplit B costs b + w
  double w = 0;    // W of a split schedule
  double p2p = 0;  // added to a dependency that crosses ranks
};

struct PipeSimulation {
  double makespan = 0;          // end of the last action
  std::vector<double> busy;     // [rank] sum of action costs
  std::vector<double> idle;     // [rank] makespan - busy
  double bubble_fraction = 0;   // sum(idle) / (p * makespan)
  // [rank] most (chunk, micro-batch) activations held at once, counted from the start of F to the
  // end of B: B consumes them and frees them.
  std::vector<int> peak_live;
  // [rank] the same counted until the end of W: W still needs the linear layers' inputs and
  // output gradients (Qi et al.'s M_W, smaller than M_B). Equals peak_live for unsplit schedules.
  std::vector<int> peak_held;
};

// [chunk] the most micro-batches whose activations `rank` holds at once on that chunk (from F to
// B, or to W when the backward is split): the activation stores a pipeline rank keeps per chunk.
std::vector<int> pipe_live_peak(const PipeSchedule& schedule, int rank);

// Runs every rank's list strictly in order. An action starts when its rank is free and its
// dependency is done (+ p2p when the dependency ran on another rank): F of stage s needs F of
// stage s-1 (none for s = 0); B of stage s needs B of stage s+1, or F of stage s for the last
// stage; W needs B of its stage. Throws a one-line error naming the schedule and the rank when the
// schedule is invalid or deadlocks.
PipeSimulation simulate(const PipeSchedule& schedule, const PipeCosts& costs);

}  // namespace loom
