// The pipeline's message plan (parallel/pipe_messages.h) against a model of NCCL's
// point-to-point semantics: each rank's operations run in order on one stream, a group of them
// completes only when every operation in it has, and a send completes only when the peer's
// matching receive runs; NCCL matches the k-th send from a to b with b's k-th receive from a,
// whatever the tags. The hosts run their action lists as PipelineRunner does (a receive blocks;
// a send is deferred; F waits for its store's last send; the step ends waiting for every send),
// with the communicator's rule (comm/nccl_communicator.cpp): at a receive of tag t, the deferred
// sends of lower tags go out a group per tag, those of tag t in one group with the receive.
//
// Every schedule kind over a grid of p, m, v completes with the plan's rounds as tags, each
// message landing in the buffer it was sent for; the rule of stop 51 (every deferred send in one
// group with the next receive: all tags equal) deadlocks the interleaved schedule at p 2, m 4,
// v 2, the case that hung over simulated NCCL.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <tuple>

#include "loom/core/error.h"
#include "loom/parallel/pipe_messages.h"

namespace loom {
namespace {

struct Op {
  bool send = false;
  int message = -1;  // the (direction, stage, micro) message the host meant
  int peer = -1;
  bool done = false;
  int seq = -1;  // issued as the seq-th operation of its kind with that peer
};
using Group = std::vector<Op*>;

class NcclModel {
 public:
  NcclModel(const PipeSchedule& s, bool use_rounds) : s_(s), ranks_(static_cast<size_t>(s.stages)) {
    const auto plan = plan_pipe_messages(s);
    for (int r = 0; r < s.stages; ++r) {
      Host& h = ranks_[static_cast<size_t>(r)];
      const auto& actions = s.per_rank[static_cast<size_t>(r)];
      std::map<std::pair<int, int>, int> last_send;  // (chunk, slot) -> message
      for (size_t i = 0; i < actions.size(); ++i) {
        const PipeAction& a = actions[i];
        const PipeMessagePlan& p = plan[static_cast<size_t>(r)][i];
        const int stage = s.stage_of(r, a.chunk);
        const PipeLinks links = pipe_links(s, r, a);
        if (a.op == PIPE_W) continue;
        if (a.op == PIPE_F) {
          const auto it = last_send.find({a.chunk, p.slot});
          if (it != last_send.end()) h.program.push_back({Step::wait, it->second, -1, 0}), last_send.erase(it);
        }
        if (links.recv_from >= 0 && links.recv_from != r) {
          h.program.push_back({Step::recv, message(a.op == PIPE_F ? 0 : 1, stage, a.micro), links.recv_from,
                               use_rounds ? p.recv_round : 0});
        }
        if (links.send_to >= 0 && links.send_to != r) {
          const int m = a.op == PIPE_F ? message(0, stage + 1, a.micro) : message(1, stage - 1, a.micro);
          h.program.push_back({Step::send, m, links.send_to, use_rounds ? p.send_round : 0});
          if (a.op == PIPE_F) last_send[{a.chunk, p.slot}] = m;
        }
      }
      h.program.push_back({Step::wait_all, -1, -1, 0});
    }
  }

  // True when every host finishes and every stream drains; false on a deadlock.
  bool run() {
    for (;;) {
      bool moved = false;
      for (int r = 0; r < s_.stages; ++r) moved = host(r) || moved;
      moved = streams() || moved;
      bool finished = true;
      for (const Host& h : ranks_) finished = finished && h.pc == h.program.size() && h.stream.empty();
      if (finished) return true;
      if (!moved) return false;
    }
  }

 private:
  enum class Step { recv, send, wait, wait_all };
  struct Instr {
    Step step;
    int message, peer, tag;
  };
  struct Pending {
    Op* op;
    int tag;
  };
  struct Host {
    std::vector<Instr> program;
    size_t pc = 0;
    std::deque<std::unique_ptr<Op>> ops;  // owns every op
    std::vector<Pending> pending;         // deferred sends
    std::deque<Group> stream;
    std::map<int, Op*> sent;              // message -> its send op
    std::map<std::pair<bool, int>, int> issued;  // (send, peer) -> operations issued
    Op* blocked = nullptr;
  };

  int message(int direction, int stage, int micro) const {
    return (direction * s_.model_stages() + stage) * s_.micro + micro;
  }

  Op* new_op(Host& h, bool send, int message, int peer) {
    h.ops.push_back(std::make_unique<Op>(Op{send, message, peer, false, -1}));
    return h.ops.back().get();
  }
  // The deferred sends of tags below `limit`, a group per tag in ascending order.
  static void issue_below(Host& h, int64_t limit) {
    while (!h.pending.empty()) {
      int lowest = h.pending[0].tag;
      for (const Pending& p : h.pending) lowest = std::min(lowest, p.tag);
      if (lowest >= limit) return;
      push(h, take(h, lowest));
    }
  }
  // Onto the stream, in NCCL's order of matching.
  static void push(Host& h, const Group& g) {
    for (Op* op : g) op->seq = h.issued[{op->send, op->peer}]++;
    h.stream.push_back(g);
  }
  static Group take(Host& h, int tag) {
    Group g;
    std::vector<Pending> rest;
    for (const Pending& p : h.pending) (p.tag == tag ? g.push_back(p.op) : rest.push_back(p));
    h.pending = rest;
    return g;
  }

  bool host(int r) {
    Host& h = ranks_[static_cast<size_t>(r)];
    bool moved = false;
    while (h.pc < h.program.size()) {
      if (h.blocked != nullptr) {
        if (!h.blocked->done) return moved;
        h.blocked = nullptr, ++h.pc, moved = true;
        continue;
      }
      const Instr& in = h.program[h.pc];
      if (in.step == Step::send) {
        Op* op = new_op(h, true, in.message, in.peer);
        h.sent[in.message] = op;
        h.pending.push_back({op, in.tag});
        ++h.pc, moved = true;
      } else if (in.step == Step::recv) {
        issue_below(h, in.tag);
        Group g = take(h, in.tag);
        h.blocked = new_op(h, false, in.message, in.peer);
        g.push_back(h.blocked);
        push(h, g);
        moved = true;
      } else if (in.step == Step::wait) {
        Op* op = h.sent.at(in.message);
        for (const Pending& p : h.pending) {
          if (p.op == op) issue_below(h, int64_t{p.tag} + 1);
        }
        h.blocked = op;
        moved = true;
      } else {  // the step's end: every send waited for
        issue_below(h, std::numeric_limits<int64_t>::max());
        for (const auto& op : h.ops) {
          if (op->send && !op->done) return moved;
        }
        ++h.pc, moved = true;
      }
    }
    return moved;
  }

  // Matches the operations at the heads of the streams in NCCL's order and retires whole groups.
  bool streams() {
    bool moved = false;
    for (int r = 0; r < s_.stages; ++r) {
      Host& h = ranks_[static_cast<size_t>(r)];
      if (h.stream.empty()) continue;
      for (Op* op : h.stream.front()) {
        if (op->done || !op->send) continue;
        Host& peer = ranks_[static_cast<size_t>(op->peer)];
        if (peer.stream.empty()) continue;
        // NCCL's matching: the k-th send r -> peer with the peer's k-th receive from r.
        for (Op* other : peer.stream.front()) {
          if (other->send || other->peer != r || other->done || other->seq != op->seq) continue;
          EXPECT_EQ(other->message, op->message) << "rank " << r << " -> " << op->peer << ": NCCL would deliver message "
                                                 << op->message << " into the buffer of " << other->message;
          op->done = other->done = true;
          moved = true;
        }
      }
    }
    for (Host& h : ranks_) {
      while (!h.stream.empty() && std::all_of(h.stream.front().begin(), h.stream.front().end(),
                                              [](const Op* op) { return op->done; })) {
        h.stream.pop_front();
        moved = true;
      }
    }
    return moved;
  }
  const PipeSchedule& s_;
  std::vector<Host> ranks_;
};

TEST(PipeMessagesTest, EveryScheduleCompletesUnderNcclSemanticsWithTheRounds) {
  int runs = 0;
  for (const std::string& kind : pipe_schedule_kinds()) {
    for (int p : {2, 3, 4}) {
      for (int m : {1, 2, 4, 8}) {
        for (int v : {1, 2, 3}) {
          if ((kind == "interleaved") != (v > 1)) continue;
          PipeSchedule s;
          try {
            s = make_pipe_schedule(kind, p, m, v);
          } catch (const Error&) {
            continue;  // not a valid combination (interleaved needs m a multiple of p)
          }
          EXPECT_TRUE(NcclModel(s, true).run()) << kind << " p " << p << " m " << m << " v " << v;
          ++runs;
        }
      }
    }
  }
  EXPECT_GE(runs, 40);
}

TEST(PipeMessagesTest, OneGroupPerReceiveDeadlocksTheInterleavedSchedule) {
  const PipeSchedule s = make_pipe_schedule("interleaved", 2, 4, 2);
  EXPECT_FALSE(NcclModel(s, false).run());
  EXPECT_TRUE(NcclModel(s, true).run());
  // As seen over simulated NCCL at stop 51: that rule ran 1f1b, gpipe and zb-h1.
  for (const char* kind : {"1f1b", "gpipe", "zb-h1"}) EXPECT_TRUE(NcclModel(make_pipe_schedule(kind, 2, 4, 1), false).run()) << kind;
}

// Each rank receives one message per round, in its program order, and a message's send and
// receive carry the same round; a one-process pipeline has no messages.
TEST(PipeMessagesTest, RoundsAreIncreasingAndAgreeAcrossRanks) {
  const PipeSchedule s = make_pipe_schedule("interleaved", 4, 8, 2);
  const auto plan = plan_pipe_messages(s);
  std::map<std::tuple<int, int, int>, int> sent, received;  // (direction, to stage, micro) -> round
  for (int r = 0; r < s.stages; ++r) {
    int last = -1;
    for (size_t i = 0; i < plan[static_cast<size_t>(r)].size(); ++i) {
      const PipeAction& a = s.per_rank[static_cast<size_t>(r)][i];
      const PipeMessagePlan& p = plan[static_cast<size_t>(r)][i];
      const int stage = s.stage_of(r, a.chunk);
      if (a.op == PIPE_F) {
        EXPECT_GE(p.slot, 0);
      }
      if (p.recv_round >= 0) {
        EXPECT_GT(p.recv_round, last);
        last = p.recv_round;
        received[{a.op == PIPE_F ? 0 : 1, stage, a.micro}] = p.recv_round;
      }
      if (p.send_round >= 0) sent[{a.op == PIPE_F ? 0 : 1, a.op == PIPE_F ? stage + 1 : stage - 1, a.micro}] = p.send_round;
    }
  }
  EXPECT_EQ(sent, received);
  EXPECT_EQ(sent.size(), static_cast<size_t>(2 * (s.model_stages() - 1) * s.micro));
  const auto alone = plan_pipe_messages(make_pipe_schedule("1f1b", 1, 4, 1));
  for (const PipeMessagePlan& p : alone[0]) {
    EXPECT_EQ(p.recv_round, -1);
    EXPECT_EQ(p.send_round, -1);
  }
}

}  // namespace
}  // namespace loom
