// loom plan: a pipeline schedule as data (what each rank runs, in order), simulated with given op
// costs: per-rank busy and idle time, peak live micro-batches, and the bubble next to its formula.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/parallel/pipeline_schedule.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom plan --schedule KIND --pp P --micro M [--virtual V] [--costs F,B[,W]] [--p2p T]\n"
    "\n"
    "Prints the pipeline schedule KIND for P ranks and M micro-batches: one line per rank with the\n"
    "actions it runs, in order (F3 = forward of micro-batch 3, B3 its backward, W3 its weight\n"
    "gradient; with V chunks per rank F3.1 is micro-batch 3 on chunk 1, model stage 1*P + rank).\n"
    "Then simulates it: every rank runs its list in order, an action starts when its input is\n"
    "ready (+ T when it comes from another rank). Prints per rank the busy and idle time and the\n"
    "peak number of micro-batch activations held (F to B; and F to W for zb-h1; with V chunks,\n"
    "chunk-micro-batch pairs, each 1/V of a stage's activations), the bubble\n"
    "fraction (idle / (P * makespan)) and the formula for the schedule.\n"
    "\n"
    "KIND: gpipe        all forwards, then all backwards            (p-1)/(m+p-1)\n"
    "      1f1b         Megatron's 1F1B                              (p-1)/(m+p-1)\n"
    "      interleaved  Megatron's interleaved 1F1B, V >= 2 chunks   bubble/ideal (1/v)(p-1)/m\n"
    "                   per rank (default 2), M a multiple of P\n"
    "      zb-h1        Zero Bubble H1: backward split into B and W   idle (p-1)(f+b-w) per rank\n"
    "--costs: time of one F, B and W as executed (for interleaved: of one chunk). Default 1,1,1.\n"
    "Schedules without a split backward run B and W as one op costing B + W.\n";

int int_option(const Args& args, const std::string& name, int fallback) {
  const int64_t value = args.get_int(name, fallback);
  LOOM_CHECK(value >= INT_MIN && value <= INT_MAX, "--", name, " = ", value, " is out of range");
  return static_cast<int>(value);
}

// "f,b" or "f,b,w".
PipeCosts parse_costs(const std::string& text) {
  std::vector<double> values;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    size_t used = 0;
    double value = 0;
    try {
      value = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    LOOM_CHECK(!item.empty() && used == item.size(), "--costs expects F,B or F,B,W (numbers), got '", text, "'");
    values.push_back(value);
    begin = end + 1;
  }
  LOOM_CHECK(values.size() == 2 || values.size() == 3, "--costs expects F,B or F,B,W (numbers), got '", text, "'");
  return PipeCosts{values[0], values[1], values.size() == 3 ? values[2] : 0.0, 0.0};
}

// The published formula for the schedule's bubble, next to the simulated value.
void print_bubble(const PipeSchedule& s, const PipeCosts& c, const PipeSimulation& sim) {
  const int p = s.stages, m = s.micro, v = s.virtual_chunks;
  double max_idle = 0;
  for (double idle : sim.idle) max_idle = std::max(max_idle, idle);
  std::printf("bubble fraction %.6g (idle / (p * makespan))\n", sim.bubble_fraction);
  if (c.p2p > 0) std::printf("(the formulas below leave out p2p)\n");
  if (s.kind == "gpipe" || s.kind == "1f1b") {
    std::printf("formula (p-1)/(m+p-1) = %.6g (Huang et al. 2019; Narayanan et al. 2021)\n",
                static_cast<double>(p - 1) / (m + p - 1));
  } else if (s.kind == "interleaved") {
    std::printf("bubble/ideal %.6g (idle per rank / busy per rank); formula (1/v)(p-1)/m = %.6g (Narayanan et al. 2021)\n",
                max_idle / sim.busy[0], static_cast<double>(p - 1) / (static_cast<double>(v) * m));
  } else {
    std::printf("idle per rank %.6g; formula (p-1)(f+b-w) = %.6g (Qi et al. 2024; for m >= p, w <= f); 1F1B: (p-1)(f+b+w) = %.6g\n",
                max_idle, (p - 1) * (c.f + c.b - c.w), (p - 1) * (c.f + c.b + c.w));
  }
}
}  // namespace

int plan_main(int argc, char** argv) {
  if (argc >= 1 && std::strcmp(argv[0], "--help") == 0) return std::fputs(kHelp, stdout), 0;
  const Args args(argc, argv, {"schedule", "pp", "micro", "virtual", "costs", "p2p"}, {}, "plan");
  LOOM_CHECK(args.has("schedule") && args.has("pp") && args.has("micro"), "loom plan needs --schedule KIND --pp P --micro M");
  const std::string kind = args.get("schedule");
  const int p = int_option(args, "pp", 1), m = int_option(args, "micro", 1);
  const int v = int_option(args, "virtual", kind == "interleaved" ? 2 : 1);
  PipeCosts costs = parse_costs(args.get("costs", "1,1,1"));
  costs.p2p = args.get_double("p2p", 0.0);

  const PipeSchedule schedule = make_pipe_schedule(kind, p, m, v);
  const PipeSimulation sim = simulate(schedule, costs);
  std::printf("%s: %d rank%s, %d micro-batch%s, %d chunk%s per rank; F %g, B %g, W %g, p2p %g (%s)\n", kind.c_str(), p,
              p == 1 ? "" : "s", m, m == 1 ? "" : "es", v, v == 1 ? "" : "s", costs.f, costs.b, costs.w, costs.p2p,
              schedule.split_backward ? "B = input gradient, W = weight gradient" : "B runs with W: costs B + W");
  std::fputs(describe_schedule(schedule).c_str(), stdout);
  std::printf("\n%4s %10s %10s %10s%s\n", "rank", "busy", "idle", "peak live", schedule.split_backward ? "  held until W" : "");
  for (int r = 0; r < p; ++r) {
    const size_t i = static_cast<size_t>(r);
    std::printf("%4d %10.6g %10.6g %10d", r, sim.busy[i], sim.idle[i], sim.peak_live[i]);
    if (schedule.split_backward) std::printf("  %13d", sim.peak_held[i]);
    std::printf("\n");
  }
  std::printf("makespan %.6g, ideal %.6g per rank\n", sim.makespan, sim.busy[0]);
  print_bubble(schedule, costs, sim);
  return 0;
}

}  // namespace loom::cli
