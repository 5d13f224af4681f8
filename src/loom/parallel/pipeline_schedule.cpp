// Pipeline schedules (what each rank runs, in order) and their discrete-event simulation.
// Legend and kinds: pipeline_schedule.h.
#include "loom/parallel/pipeline_schedule.h"

#include <algorithm>
#include <optional>

#include "loom/core/error.h"

namespace loom {

namespace {

const char kOpNames[] = {'F', 'B', 'W'};
// Bounds p*m*v so that every index (model stage, micro-batch, op) fits an int.
constexpr int64_t kMaxActionsPerOp = int64_t{1} << 24;
static_assert(sizeof(kOpNames) / sizeof(kOpNames[0]) == PIPE_OP_COUNT);

std::string schedule_label(const PipeSchedule& s) {
  return str_cat("pipeline schedule '", enum_name(s.kind), "' (p=", s.stages, ", m=", s.micro, ", v=", s.virtual_chunks, ")");
}

// GPipe (Huang et al. 2019): every forward, then every backward in micro-batch order.
std::vector<PipeAction> gpipe_rank(int m) {
  std::vector<PipeAction> out;
  for (int i = 0; i < m; ++i) out.push_back({0, i, PIPE_F});
  for (int i = 0; i < m; ++i) out.push_back({0, i, PIPE_B});
  return out;
}

// 1F1B without interleaving (Narayanan et al. 2021, PipeDream-Flush): min(p-r-1, m) warm-up
// forwards, then F(warm-up + j) B(j) pairs, then the backwards left over.
std::vector<PipeAction> one_f_one_b_rank(int p, int m, int r) {
  const int warmup = std::min(p - r - 1, m);
  std::vector<PipeAction> out;
  for (int i = 0; i < warmup; ++i) out.push_back({0, i, PIPE_F});
  for (int j = 0; j < m - warmup; ++j) {
    out.push_back({0, warmup + j, PIPE_F});
    out.push_back({0, j, PIPE_B});
  }
  for (int j = m - warmup; j < m; ++j) out.push_back({0, j, PIPE_B});
  return out;
}

// Interleaved 1F1B (Narayanan et al. 2021, section 2.2): the rank's k-th forward (k = 0..m*v-1)
// runs micro-batches in groups of p, each group through chunk 0, then chunk 1, ... chunk v-1;
// the k-th backward runs the same micro-batch through the chunks in reverse. Rank r first runs
// 2(p-r-1) + (v-1)p forwards (Megatron-LM's warm-up count), then alternates one forward and
// one backward, then drains the backwards.
PipeAction interleaved_action(int p, int v, int k, PipeOp op) {
  const int group = k / (p * v), in_group = k % (p * v);
  const int chunk = in_group / p;
  return {op == PIPE_F ? chunk : v - 1 - chunk, group * p + in_group % p, op};
}

std::vector<PipeAction> interleaved_rank(int p, int m, int v, int r) {
  const int total = m * v;
  const int warmup = std::min(2 * (p - r - 1) + (v - 1) * p, total);
  std::vector<PipeAction> out;
  for (int k = 0; k < warmup; ++k) out.push_back(interleaved_action(p, v, k, PIPE_F));
  for (int k = 0; k < total - warmup; ++k) {
    out.push_back(interleaved_action(p, v, warmup + k, PIPE_F));
    out.push_back(interleaved_action(p, v, k, PIPE_B));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(interleaved_action(p, v, k, PIPE_B));
  return out;
}

// ZB-H1 (Qi et al. 2024, section 3.1). F and B keep 1F1B's order, so the live activations
// (F to B) are 1F1B's. Only B is on the critical path backwards through the ranks; W waits to fill
// the time a rank would idle for the next B: rank r runs W(i) right after B(i+r) and the last r
// W's after its last B (rank p-1, where the backward chain starts, defers the most). With
// unit costs every rank idles r at the start and p-1-r waiting for its first B, and never again:
// bubble (p-1)(T_F+T_B-T_W) per rank when m >= p and T_W <= T_F. Counting activations until W,
// every rank holds at most min(p, m), 1F1B's peak on rank 0.
std::vector<PipeAction> zb_h1_rank(int p, int m, int r) {
  std::vector<PipeAction> out;
  int next_w = 0;
  for (const PipeAction& a : one_f_one_b_rank(p, m, r)) {
    out.push_back(a);
    if (a.op == PIPE_B && a.micro >= r) out.push_back({0, next_w++, PIPE_W});
  }
  while (next_w < m) out.push_back({0, next_w++, PIPE_W});
  return out;
}

}  // namespace

int PipeSchedule::model_stages() const { return stages * virtual_chunks; }
int PipeSchedule::stage_of(int rank, int chunk) const { return chunk * stages + rank; }
int PipeSchedule::rank_of(int stage) const { return stage % stages; }
int PipeSchedule::chunk_of(int stage) const { return stage / stages; }

const std::vector<std::string>& pipe_schedule_kinds() {
  static const std::vector<std::string> kKinds(EnumNames<PipeScheduleKind>::names.begin(),
                                               EnumNames<PipeScheduleKind>::names.end());
  return kKinds;
}

PipeSchedule make_pipe_schedule(const std::string& kind, int p, int m, int v) {
  const std::optional<PipeScheduleKind> k = enum_from_name<PipeScheduleKind>(kind);
  LOOM_CHECK(k.has_value(), "parallel.schedule = '", kind, "': unknown pipeline schedule (expected gpipe, 1f1b, interleaved or zb-h1)");
  return make_pipe_schedule(*k, p, m, v);
}

PipeSchedule make_pipe_schedule(PipeScheduleKind kind, int p, int m, int v) {
  LOOM_CHECK(p >= 1, "parallel.pp = ", p, ": a pipeline needs at least 1 rank");
  LOOM_CHECK(m >= 1, "parallel.micro_batches = ", m, ": a pipeline step needs at least 1 micro-batch");
  if (kind == PipeScheduleKind::interleaved) {
    LOOM_CHECK(v >= 2, "parallel.virtual_stages = ", v, ": the interleaved schedule needs at least 2 model chunks per rank");
    LOOM_CHECK(m % p == 0, "parallel.micro_batches = ", m, ": the interleaved schedule needs a multiple of parallel.pp = ", p,
               " (micro-batches go through the chunks in groups of p)");
  } else {
    LOOM_CHECK(v == 1, "parallel.virtual_stages = ", v, ": only parallel.schedule = interleaved runs several model chunks per rank, not '",
               enum_name(kind), "'");
  }
  const int64_t actions = static_cast<int64_t>(p) * m * v;
  LOOM_CHECK(actions <= kMaxActionsPerOp, "parallel.pp x parallel.micro_batches x parallel.virtual_stages = ", actions,
             ": at most ", kMaxActionsPerOp, " (chunk, micro-batch) pairs per step");
  PipeSchedule s;
  s.kind = kind;
  s.stages = p;
  s.micro = m;
  s.virtual_chunks = v;
  s.split_backward = kind == PipeScheduleKind::zb_h1;
  for (int r = 0; r < p; ++r) {
    switch (kind) {
      case PipeScheduleKind::gpipe: s.per_rank.push_back(gpipe_rank(m)); break;
      case PipeScheduleKind::one_f_one_b: s.per_rank.push_back(one_f_one_b_rank(p, m, r)); break;
      case PipeScheduleKind::interleaved: s.per_rank.push_back(interleaved_rank(p, m, v, r)); break;
      case PipeScheduleKind::zb_h1: s.per_rank.push_back(zb_h1_rank(p, m, r)); break;
    }
  }
  return s;
}

void validate_pipe_schedule(const PipeSchedule& s) {
  LOOM_CHECK(s.stages >= 1 && s.micro >= 1 && s.virtual_chunks >= 1, schedule_label(s), ": p, m and v must be at least 1");
  LOOM_CHECK(static_cast<int>(s.per_rank.size()) == s.stages, schedule_label(s), ": lists ", s.per_rank.size(),
             " ranks, expected ", s.stages);
  for (int r = 0; r < s.stages; ++r) {
    std::vector<int> seen(static_cast<size_t>(s.virtual_chunks * s.micro * PIPE_OP_COUNT), 0);  // [chunk][micro][op]
    const auto slot = [&](const PipeAction& a) { return (a.chunk * s.micro + a.micro) * PIPE_OP_COUNT + a.op; };
    const auto& actions = s.per_rank[static_cast<size_t>(r)];
    for (size_t i = 0; i < actions.size(); ++i) {
      const PipeAction& a = actions[i];
      LOOM_CHECK(a.chunk >= 0 && a.chunk < s.virtual_chunks && a.micro >= 0 && a.micro < s.micro && a.op < PIPE_OP_COUNT,
                 schedule_label(s), ": rank ", r, " step ", i, " names chunk ", a.chunk, ", micro-batch ", a.micro,
                 ", op ", static_cast<int>(a.op), ", outside the schedule");
      LOOM_CHECK(a.op != PIPE_W || s.split_backward, schedule_label(s), ": rank ", r, " step ", i,
                 " is a W, but this schedule's B is the whole backward");
      LOOM_CHECK(++seen[static_cast<size_t>(slot(a))] == 1, schedule_label(s), ": rank ", r, " runs ",
                 pipe_action_name(s, a), " twice");
    }
    for (int c = 0; c < s.virtual_chunks; ++c) {
      for (int i = 0; i < s.micro; ++i) {
        for (int op = 0; op < (s.split_backward ? 3 : 2); ++op) {
          const PipeAction a{c, i, static_cast<PipeOp>(op)};
          LOOM_CHECK(seen[static_cast<size_t>(slot(a))] == 1, schedule_label(s), ": rank ", r, " never runs ",
                     pipe_action_name(s, a));
        }
      }
    }
  }
}

PipeLinks pipe_links(const PipeSchedule& s, int rank, const PipeAction& a) {
  const int stage = s.stage_of(rank, a.chunk);
  const bool first = stage == 0, last = stage == s.model_stages() - 1;
  if (a.op == PIPE_F) return {first ? -1 : s.rank_of(stage - 1), last ? -1 : s.rank_of(stage + 1)};
  if (a.op == PIPE_B) return {last ? -1 : s.rank_of(stage + 1), first ? -1 : s.rank_of(stage - 1)};
  return {};
}

std::string pipe_action_name(const PipeSchedule& s, const PipeAction& a) {
  std::string name = str_cat(kOpNames[a.op], a.micro);
  if (s.virtual_chunks > 1) name += str_cat(".", a.chunk);
  return name;
}

std::string describe_schedule(const PipeSchedule& s) {
  std::string out;
  for (size_t r = 0; r < s.per_rank.size(); ++r) {
    out += str_cat("rank ", r, ":");
    for (const PipeAction& a : s.per_rank[r]) {
      out += ' ';
      out += pipe_action_name(s, a);
    }
    out += "\n";
  }
  return out;
}

PipeSimulation simulate(const PipeSchedule& s, const PipeCosts& costs) {
  validate_pipe_schedule(s);
  LOOM_CHECK(costs.f >= 0 && costs.b >= 0 && costs.w >= 0 && costs.p2p >= 0, schedule_label(s),
             ": costs must be non-negative, got f=", costs.f, " b=", costs.b, " w=", costs.w, " p2p=", costs.p2p);
  const int p = s.stages, m = s.micro, stages = s.model_stages();
  const double cost[PIPE_OP_COUNT] = {costs.f, s.split_backward ? costs.b : costs.b + costs.w, costs.w};
  // finish[(stage * m + micro) * PIPE_OP_COUNT + op]: end time, or -1 while not yet run.
  std::vector<double> finish(static_cast<size_t>(stages * m * PIPE_OP_COUNT), -1.0);
  const auto at = [&](int stage, int micro, PipeOp op) -> double& {
    return finish[static_cast<size_t>((stage * m + micro) * PIPE_OP_COUNT + op)];
  };
  struct Dependency {
    int stage = -1, micro = 0;
    PipeOp op = PIPE_F;
  };
  const auto dependency_of = [&](int stage, const PipeAction& a) -> Dependency {
    if (a.op == PIPE_F) return stage == 0 ? Dependency{} : Dependency{stage - 1, a.micro, PIPE_F};
    if (a.op == PIPE_B) return stage == stages - 1 ? Dependency{stage, a.micro, PIPE_F} : Dependency{stage + 1, a.micro, PIPE_B};
    return {stage, a.micro, PIPE_B};
  };

  PipeSimulation out;
  out.busy.assign(static_cast<size_t>(p), 0.0);
  std::vector<double> free_at(static_cast<size_t>(p), 0.0);  // [rank]
  std::vector<size_t> next(static_cast<size_t>(p), 0);       // [rank] index of the next action
  size_t remaining = 0;
  for (const auto& actions : s.per_rank) remaining += actions.size();
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < p; ++r) {
      const auto& actions = s.per_rank[static_cast<size_t>(r)];
      size_t& i = next[static_cast<size_t>(r)];
      for (; i < actions.size(); ++i) {
        const PipeAction& a = actions[i];
        const int stage = s.stage_of(r, a.chunk);
        const Dependency d = dependency_of(stage, a);
        double start = free_at[static_cast<size_t>(r)];
        if (d.stage >= 0) {
          const double ready = at(d.stage, d.micro, d.op);
          if (ready < 0) break;
          start = std::max(start, ready + (s.rank_of(d.stage) != r ? costs.p2p : 0.0));
        }
        at(stage, a.micro, a.op) = start + cost[a.op];
        free_at[static_cast<size_t>(r)] = start + cost[a.op];
        out.busy[static_cast<size_t>(r)] += cost[a.op];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed) {
      int r = 0;
      while (next[static_cast<size_t>(r)] == s.per_rank[static_cast<size_t>(r)].size()) ++r;
      const size_t i = next[static_cast<size_t>(r)];
      const PipeAction& a = s.per_rank[static_cast<size_t>(r)][i];
      const Dependency d = dependency_of(s.stage_of(r, a.chunk), a);
      const int d_rank = s.rank_of(d.stage);
      throw Error(str_cat(schedule_label(s), " deadlocks: rank ", r, " waits at step ", i, " (",
                          pipe_action_name(s, a), ") for ", pipe_action_name(s, {s.chunk_of(d.stage), d.micro, d.op}),
                          " on rank ", d_rank, ", and no rank can progress"));
    }
  }

  out.makespan = *std::max_element(free_at.begin(), free_at.end());
  double idle_total = 0;
  for (int r = 0; r < p; ++r) {
    out.idle.push_back(out.makespan - out.busy[static_cast<size_t>(r)]);
    idle_total += out.idle.back();
  }
  out.bubble_fraction = out.makespan > 0 ? idle_total / (p * out.makespan) : 0.0;

  // Activation counts follow the list order, whatever the costs: a rank runs it in order.
  const PipeOp frees = s.split_backward ? PIPE_W : PIPE_B;
  for (const auto& actions : s.per_rank) {
    int live = 0, held = 0, peak_live = 0, peak_held = 0;
    for (const PipeAction& a : actions) {
      live += a.op == PIPE_F ? 1 : a.op == PIPE_B ? -1 : 0;
      held += a.op == PIPE_F ? 1 : a.op == frees ? -1 : 0;
      peak_live = std::max(peak_live, live);
      peak_held = std::max(peak_held, held);
    }
    out.peak_live.push_back(peak_live);
    out.peak_held.push_back(peak_held);
  }
  return out;
}

std::vector<int> pipe_live_peak(const PipeSchedule& schedule, int rank) {
  const size_t v = static_cast<size_t>(schedule.virtual_chunks);
  std::vector<int> live(v, 0), peak(v, 0);
  for (const PipeAction& a : schedule.per_rank[static_cast<size_t>(rank)]) {
    if (a.op == PIPE_F) peak[a.chunk] = std::max(peak[a.chunk], ++live[a.chunk]);
    if (a.op == (schedule.split_backward ? PIPE_W : PIPE_B)) --live[a.chunk];
  }
  return peak;
}

}  // namespace loom
