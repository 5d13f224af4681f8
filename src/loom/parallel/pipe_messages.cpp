#include "loom/parallel/pipe_messages.h"

#include <algorithm>

#include "loom/core/error.h"

namespace loom {
namespace {

// One rank's walk through its actions, as PipelineRunner executes them.
enum class Wait { none, store, receive };

struct Message {
  bool sent = false;
  int round = -1;  // when its receiver took it
};

class Planner {
 public:
  explicit Planner(const PipeSchedule& s) : s_(s), S_(s.model_stages()) {
    const auto p = static_cast<size_t>(s.stages), v = static_cast<size_t>(s.virtual_chunks);
    messages_.resize(static_cast<size_t>(2 * S_ * s.micro));
    plan_.resize(p);
    send_of_.resize(p);
    ranks_.resize(p);
    for (size_t r = 0; r < p; ++r) {
      const size_t n = s.per_rank[r].size();
      plan_[r].resize(n);
      send_of_[r].assign(n, -1);
      const std::vector<int> peak = pipe_live_peak(s, static_cast<int>(r));
      ranks_[r].slot_of.assign(v, std::vector<int>(static_cast<size_t>(s.micro), -1));
      ranks_[r].last_send.resize(v);
      for (size_t c = 0; c < v; ++c) ranks_[r].last_send[c].assign(static_cast<size_t>(std::max(1, peak[c])), -1);
    }
  }

  std::vector<std::vector<PipeMessagePlan>> run() {
    for (int round = 0;; ++round) {
      bool done = true;
      for (int r = 0; r < s_.stages; ++r) done = advance(r) && done;
      if (done) break;
      bool moved = false;
      for (int r = 0; r < s_.stages; ++r) moved = take(r, round) || moved;
      if (!moved) stuck();
    }
    for (size_t r = 0; r < plan_.size(); ++r) {
      for (size_t i = 0; i < plan_[r].size(); ++i) {
        if (send_of_[r][i] >= 0) plan_[r][i].send_round = messages_[static_cast<size_t>(send_of_[r][i])].round;
      }
    }
    return std::move(plan_);
  }

 private:
  struct RankState {
    size_t pc = 0;  // the action it is at
    int phase = 0;  // 0: F's store, 1: its receive, 2: compute and send
    Wait wait = Wait::none;
    int message = -1;                              // what it waits for
    std::vector<std::vector<int>> slot_of;          // [chunk][micro] its store while live, else -1
    std::vector<std::vector<int>> last_send;        // [chunk][slot] the message its output last sent
  };

  // Messages: activations to stage s (direction 0) and gradients to stage s (direction 1).
  int message(int direction, int stage, int micro) const { return (direction * S_ + stage) * s_.micro + micro; }

  // Runs rank r's actions until it must wait; true when it has none left.
  bool advance(int r) {
    RankState& st = ranks_[static_cast<size_t>(r)];
    const std::vector<PipeAction>& actions = s_.per_rank[static_cast<size_t>(r)];
    while (st.pc < actions.size()) {
      if (st.wait != Wait::none) return false;
      const PipeAction& a = actions[st.pc];
      const int stage = s_.stage_of(r, a.chunk);
      const PipeLinks links = pipe_links(s_, r, a);
      PipeMessagePlan& plan = plan_[static_cast<size_t>(r)][st.pc];
      if (a.op == PIPE_W) {
        st.slot_of[a.chunk][a.micro] = -1;
        next(st);
        continue;
      }
      if (st.phase == 0 && a.op == PIPE_F) {  // the first free store; its last output must have left
        const std::vector<int>& live = st.slot_of[a.chunk];
        int slot = 0;
        while (std::find(live.begin(), live.end(), slot) != live.end()) ++slot;
        LOOM_CHECK(slot < static_cast<int>(st.last_send[a.chunk].size()), describe(), ": rank ", r,
                   " has no free activation store for ", pipe_action_name(s_, a));
        plan.slot = slot;
        st.slot_of[a.chunk][a.micro] = slot;
        const int last = st.last_send[a.chunk][slot];
        if (last >= 0 && messages_[static_cast<size_t>(last)].round < 0) block(st, Wait::store, last);
        st.phase = 1;
        continue;
      }
      if (st.phase <= 1) {
        st.phase = 2;
        if (links.recv_from >= 0 && links.recv_from != r) {
          block(st, Wait::receive, a.op == PIPE_F ? message(0, stage, a.micro) : message(1, stage, a.micro));
          continue;
        }
      }
      if (links.send_to >= 0 && links.send_to != r) {
        const int m = a.op == PIPE_F ? message(0, stage + 1, a.micro) : message(1, stage - 1, a.micro);
        messages_[static_cast<size_t>(m)].sent = true;
        send_of_[static_cast<size_t>(r)][st.pc] = m;
        if (a.op == PIPE_F) st.last_send[a.chunk][static_cast<size_t>(plan.slot)] = m;
      }
      if (a.op == PIPE_B && !s_.split_backward) st.slot_of[a.chunk][a.micro] = -1;
      next(st);
    }
    return st.wait == Wait::none;
  }

  // The round's matching: rank r takes its message if it has been sent, or finds its store's
  // last send taken. True when r can go on.
  bool take(int r, int round) {
    RankState& st = ranks_[static_cast<size_t>(r)];
    if (st.wait == Wait::none) return false;
    Message& m = messages_[static_cast<size_t>(st.message)];
    if (st.wait == Wait::receive) {
      if (!m.sent) return false;
      m.round = round;
      plan_[static_cast<size_t>(r)][st.pc].recv_round = round;
    } else if (m.round < 0) {
      return false;
    }
    st.wait = Wait::none;
    return true;
  }

  [[noreturn]] void stuck() const {
    for (int r = 0; r < s_.stages; ++r) {
      const RankState& st = ranks_[static_cast<size_t>(r)];
      if (st.wait == Wait::none) continue;
      const PipeAction& a = s_.per_rank[static_cast<size_t>(r)][st.pc];
      throw Error(str_cat(describe(), " cannot run: rank ", r, " waits at ", pipe_action_name(s_, a), " for ",
                        st.wait == Wait::receive ? "a message no rank sends first" : "a send no rank receives"));
    }
    throw Error(str_cat(describe(), " cannot run"));
  }

  static void next(RankState& st) { ++st.pc, st.phase = 0; }
  static void block(RankState& st, Wait w, int message) { st.wait = w, st.message = message; }
  std::string describe() const {
    return str_cat("pipeline schedule '", enum_name(s_.kind), "' (p=", s_.stages, ", m=", s_.micro, ", v=",
                   s_.virtual_chunks, ")");
  }

  const PipeSchedule& s_;
  const int S_;
  std::vector<Message> messages_;
  std::vector<std::vector<PipeMessagePlan>> plan_;
  std::vector<std::vector<int>> send_of_;  // [rank][action] the message it sends, -1 none
  std::vector<RankState> ranks_;
};

}  // namespace

std::vector<std::vector<PipeMessagePlan>> plan_pipe_messages(const PipeSchedule& schedule) {
  validate_pipe_schedule(schedule);
  return Planner(schedule).run();
}

}  // namespace loom
