// loom plan, two modes:
// --hardware: the parallel layouts of a model that fit a cluster, ranked by estimated step time
//   (memory/planner.h), with the reasoning;
// --schedule: a pipeline schedule as data (what each rank runs, in order), simulated with given op
//   costs: per-rank busy and idle time, peak live micro-batches, and the bubble next to its formula.
#include <algorithm>
#include <climits>
#include <optional>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

// toml++ trips GCC 12's -Warray-bounds false positives inside its own headers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#include <toml++/toml.h>
#pragma GCC diagnostic pop

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/memory/planner.h"
#include "loom/parallel/pipeline_schedule.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom plan --hardware FILE [--config FILE] [--set k=v,...] [--global-batch G] [--top K] [--all]\n"
    "       loom plan --schedule KIND --pp P --micro M [--virtual V] [--costs F,B[,W]] [--p2p T]\n"
    "\n"
    "With --hardware: every parallel layout of the config's model on the cluster FILE describes\n"
    "(dp x tp x pp x cp x ep, ZeRO stage, recompute policy, pipeline schedule) whose bytes per\n"
    "device (loom memory's estimate, flash attention's log-sum-exp instead of probabilities)\n"
    "fit the device memory less the reserve, ranked by an estimated step time (memory/planner.h:\n"
    "compute at the stated efficiency, pipeline bubble, tp / cp / pp / ep traffic, exposed\n"
    "gradient reduction), with the reasoning. The micro-batch is train.batch_size x train.seq_len;\n"
    "--global-batch G sequences per step (default train.batch_size x train.grad_accum x devices).\n"
    "--top K prints the best K (default 10); --all also the layouts that do not fit.\n"
    "FILE is TOML: [hardware] name, nodes, devices_per_node, memory_gib, peak_tflops (dense bf16),\n"
    "efficiency, intra_node_gbs, inter_node_gbs, reserve (configs/hardware/*.toml).\n"
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
  if (s.kind == PipeScheduleKind::gpipe || s.kind == PipeScheduleKind::one_f_one_b) {
    std::printf("formula (p-1)/(m+p-1) = %.6g (Huang et al. 2019; Narayanan et al. 2021)\n",
                static_cast<double>(p - 1) / (m + p - 1));
  } else if (s.kind == PipeScheduleKind::interleaved) {
    std::printf("bubble/ideal %.6g (idle per rank / busy per rank); formula (1/v)(p-1)/m = %.6g (Narayanan et al. 2021)\n",
                max_idle / sim.busy[0], static_cast<double>(p - 1) / (static_cast<double>(v) * m));
  } else {
    std::printf("idle per rank %.6g; formula (p-1)(f+b-w) = %.6g (Qi et al. 2024; for m >= p, w <= f); 1F1B: (p-1)(f+b+w) = %.6g\n",
                max_idle, (p - 1) * (c.f + c.b - c.w), (p - 1) * (c.f + c.b + c.w));
  }
}
Hardware load_hardware(const std::string& path) {
  toml::table file;
  try {
    file = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw Error(str_cat(path, ":", e.source().begin.line, ": ", std::string(e.description())));
  }
  const toml::table* t = file["hardware"].as_table();
  LOOM_CHECK(t != nullptr, path, ": expected a [hardware] table");
  Hardware hw;
  for (const auto& [key, node] : *t) {
    const std::string k(key.str());
    auto number = [&]() {
      const std::optional<double> v = node.value<double>();
      LOOM_CHECK(v.has_value(), path, ": hardware.", k, " must be a number");
      return *v;
    };
    auto integer = [&]() {
      const std::optional<int64_t> v = node.value<int64_t>();
      LOOM_CHECK(v.has_value() && *v >= 1 && *v <= INT_MAX, path, ": hardware.", k, " must be a positive integer");
      return static_cast<int>(*v);
    };
    if (k == "name") {
      const std::optional<std::string> v = node.value<std::string>();
      LOOM_CHECK(v.has_value(), path, ": hardware.name must be a string");
      hw.name = *v;
    } else if (k == "nodes") {
      hw.nodes = integer();
    } else if (k == "devices_per_node") {
      hw.devices_per_node = integer();
    } else if (k == "memory_gib") {
      hw.memory_gib = number();
    } else if (k == "peak_tflops") {
      hw.peak_tflops = number();
    } else if (k == "efficiency") {
      hw.efficiency = number();
    } else if (k == "intra_node_gbs") {
      hw.intra_node_gbs = number();
    } else if (k == "inter_node_gbs") {
      hw.inter_node_gbs = number();
    } else if (k == "reserve") {
      hw.reserve = number();
    } else {
      throw Error(str_cat(path, ": unknown key hardware.", k, " (expected name, nodes, devices_per_node, memory_gib, "
                          "peak_tflops, efficiency, intra_node_gbs, inter_node_gbs, reserve)"));
    }
  }
  try {
    hw.validate();
  } catch (const Error& e) {
    throw Error(str_cat(path, ": ", e.what()));
  }
  return hw;
}

int layouts_main(const Args& args) {
  const Hardware hw = load_hardware(args.get("hardware"));
  LoomConfig config = load_config(args);
  vocab_from_data(config);
  config.model.validate();
  MemoryPlan base;
  base.model = config.model;
  base.batch = config.train.batch_size, base.seq_len = config.train.seq_len;
  base.optim = config.train.optim, base.precision = config.train.precision;
  base.flash_attention = true;
  const int64_t global = args.get_int("global-batch", config.train.batch_size * config.train.grad_accum * hw.devices());
  const int top = static_cast<int>(std::clamp<int64_t>(args.get_int("top", 10), 1, 100000));
  const std::vector<LayoutCost> layouts = plan_layouts(base, global, hw);
  const int64_t fitting = std::count_if(layouts.begin(), layouts.end(), [](const LayoutCost& l) { return l.fits; });
  std::printf("%s: %lld parameters, %s; micro-batch %lld x %lld, global batch %lld sequences (%lld tokens) per step; "
              "optimizer %s, precision %s\n", std::string(arch_name(config.model.arch)).c_str(),
              static_cast<long long>(param_count(config.model)), hw.name.c_str(), static_cast<long long>(base.batch),
              static_cast<long long>(base.seq_len), static_cast<long long>(global),
              static_cast<long long>(global * base.seq_len), base.optim.name.c_str(),
              resolve_policy(base.precision).describe().c_str());
  std::printf("%d nodes x %d devices, %.0f GiB each (%.0f%% reserved), %.0f TFLOP/s peak at %.0f%% efficiency, "
              "%.0f GB/s in a node, %.0f GB/s between nodes\n", hw.nodes, hw.devices_per_node, hw.memory_gib,
              100 * hw.reserve, hw.peak_tflops, 100 * hw.efficiency, hw.intra_node_gbs, hw.inter_node_gbs);
  std::printf("%lld of %zu layouts fit (activations as Loom keeps them, fp32, flash attention); estimated, not "
              "measured: loom train measures\n", static_cast<long long>(fitting), layouts.size());
  if (fitting == 0) {
    std::printf("nothing fits: the smallest layout needs %s per device: more devices, a smaller micro-batch or "
                "sequence, or activation recompute\n", layouts.empty() ? "?" : format_bytes(static_cast<size_t>(layouts.front().memory.total())).c_str());
  }
  std::printf("%4s  %-62s %10s %10s %10s %6s  %s\n", "rank", "layout", "memory", "step s", "tokens/s", "MFU",
              "compute / bubble / tp / cp / pp / ep / dp exposed (s)");
  int shown = 0;
  for (const LayoutCost& l : layouts) {
    if (!l.fits && !args.has("all")) break;
    if (shown == top && l.fits) continue;
    ++shown;
    std::printf("%4d  %-62s %10s %10.4g %10.4g %5.1f%%  %.3g / %.3g / %.3g / %.3g / %.3g / %.3g / %.3g\n", shown,
                l.describe().c_str(), format_bytes(static_cast<size_t>(l.memory.total())).c_str(), l.step_s,
                l.tokens_per_s, 100 * l.mfu, l.compute_s, l.bubble_s, l.tp_s, l.cp_s, l.pp_s, l.ep_s, l.dp_s);
    std::printf("      %s%s\n", l.fits ? "" : "does not fit; ", l.reasoning.c_str());
  }
  return 0;
}
}  // namespace

int plan_main(int argc, char** argv) {
  const Args args(argc, argv, "plan", kHelp,
                  {{"hardware", "FILE", "rank the parallel layouts that fit the cluster FILE describes (TOML)"},
                   {"config", "FILE", "a TOML config applied after configs/default.toml"},
                   {"set", "KEY=VALUE,...", "config overrides, applied last (comma-separated; repeatable)"},
                   {"global-batch", "G", "--hardware: sequences per step (default batch_size x grad_accum x devices)"},
                   {"top", "K", "--hardware: print the best K layouts (default 10)"},
                   {"all", "", "--hardware: also print the layouts that do not fit"},
                   {"schedule", "KIND", "simulate a pipeline schedule: gpipe | 1f1b | interleaved | zb-h1"},
                   {"pp", "P", "--schedule: pipeline ranks"},
                   {"micro", "M", "--schedule: micro-batches"},
                   {"virtual", "V", "--schedule interleaved: model chunks per rank (default 2)"},
                   {"costs", "F,B[,W]", "--schedule: time of one forward, backward and weight-gradient op (default 1,1,1)"},
                   {"p2p", "T", "--schedule: time added to an input from another rank (default 0)"}});
  if (args.has("hardware")) return layouts_main(args);
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
