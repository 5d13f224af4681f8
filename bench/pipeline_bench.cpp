// Pipeline schedules measured against their simulation: for each schedule (GPipe, 1F1B,
// interleaved 1F1B with 2 chunks per rank, ZB-H1) a GPT-2-shaped model is trained with a
// PipelineRunner over all ranks of the job (pp = P), and per rank the runner's busy seconds
// (computing) and idle seconds (blocked on a neighbour's message, and the step's final waits) are
// measured. Rank 0 also times one micro-batch's F, B (the whole backward), B (input gradient only)
// and W (weight gradient) of every model stage outside the pipeline, and one stage-to-stage message
// (ping-pong between ranks 0 and 1); simulate() (parallel/pipeline_schedule.h) is run with those
// measured unit costs and its idle fractions are printed beside the measured ones and beside the
// formula's bubble fraction (docs/model_parallel.md). Every schedule's step time is also given as
// a ratio to GPipe's, measured in the same run (GPipe always runs, first, as the reference).
//
//   OMP_NUM_THREADS=1 mpirun --oversubscribe -np P build/bench/pipeline_bench
//       [--schedule all|gpipe|1f1b|interleaved|zb-h1] [--micro M] [--layers L] [--d-model C] [--steps S]
//       [--heads H] [--batch B] [--seq T] [--vocab V] [--chunks v] [--reps R]
// Defaults: L = 8, C = 256, H = 8, d_ff = 4C, V = 1024, T = 128, B = 2 sequences per micro-batch,
// M = 8 micro-batches per step, S = 5 steps (the first discarded), v = 2 (interleaved only),
// R = 10 timed repetitions of each unit cost (after one untimed; the median is used). AdamW, fp32.
// Rank 0 prints.
//
// Legend: p = P ranks, m = M micro-batches, v = chunks per rank; F, B, W per chunk (a model
// stage: L / (p v) layers); idle fraction = idle / (busy + idle) of the runner's step. Also per
// rank: the activation bytes the runner allocates (MEM_ACTIVATIONS, counted by the allocator) and
// simulate()'s peak count of (chunk, micro-batch) activations held at once.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/comm/device_mesh.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/parallel/pipeline.h"
#include "loom/parallel/pipeline_schedule.h"
#include "loom/train/trainer.h"

namespace {

using namespace loom;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Args {
  std::string schedule = "all";
  int micro = 8, chunks = 2, reps = 10;
  int64_t layers = 8, d_model = 256, heads = 8, batch = 2, seq = 128, vocab = 1024, steps = 5;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string key = argv[i];
    LOOM_CHECK(i + 1 < argc, "option ", key, " needs a value");
    const std::string value = argv[i + 1];
    if (key == "--schedule") a.schedule = value;
    else if (key == "--micro") a.micro = std::stoi(value);
    else if (key == "--layers") a.layers = std::stoll(value);
    else if (key == "--d-model") a.d_model = std::stoll(value);
    else if (key == "--steps") a.steps = std::stoll(value);
    else if (key == "--heads") a.heads = std::stoll(value);
    else if (key == "--batch") a.batch = std::stoll(value);
    else if (key == "--seq") a.seq = std::stoll(value);
    else if (key == "--vocab") a.vocab = std::stoll(value);
    else if (key == "--chunks") a.chunks = std::stoi(value);
    else if (key == "--reps") a.reps = std::stoi(value);
    else throw Error("unknown option " + key + " (expected --schedule, --micro, --layers, --d-model, --steps, --heads, "
                     "--batch, --seq, --vocab, --chunks, --reps)");
  }
  LOOM_CHECK(a.steps >= 2, "--steps must be at least 2 (the first is discarded), got ", a.steps);
  LOOM_CHECK(a.reps >= 1, "--reps must be at least 1, got ", a.reps);
  LOOM_CHECK(a.d_model % a.heads == 0, "--d-model ", a.d_model, " must be a multiple of --heads ", a.heads);
  return a;
}

ModelConfig bench_model(const Args& a) {
  ModelConfig c;  // GPT-2: learned positions, LayerNorm, GELU, biases, tied head
  c.vocab_size = a.vocab, c.max_seq_len = a.seq, c.n_layer = a.layers, c.n_head = a.heads, c.n_kv_head = a.heads;
  c.d_model = a.d_model, c.d_ff = 4 * a.d_model;
  c.validate();
  return c;
}

std::vector<int32_t> random_tokens(int64_t count, int64_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(count));
  uint64_t state = 12345;
  for (auto& v : t) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<int32_t>((state >> 33) % static_cast<uint64_t>(vocab));
  }
  return t;
}

// Small deterministic values in [-0.5, 0.5): stage inputs and output gradients for the timings.
void fill_small(const Tensor& t, uint64_t seed) {
  float* p = t.data<float>();
  uint64_t state = seed;
  for (int64_t i = 0; i < t.numel(); ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    p[i] = static_cast<float>((state >> 40) & 0xffff) / 65536.0f - 0.5f;
  }
}

// One model stage's unit costs (seconds, one micro-batch), measured on one rank outside the pipeline.
struct StageCosts {
  int64_t first = 0, last = 0;
  double f = 0, b_all = 0, b_input = 0, w = 0;
};

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 == 1 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2;
}

// Times F, the whole backward, and the split backward (input pass, then weight pass) of every
// stage of `split` on one micro-batch: one untimed round over the stages, then `reps` rounds (the
// stages interleaved within a round, so a burst of load from outside lands on all of them), and
// the median of each. The model's gradients are left dirty (the trainer zeroes them every step).
std::vector<StageCosts> time_stages(Transformer& model, const std::vector<std::pair<int64_t, int64_t>>& split,
                                    const Args& a, RandomWindowSource& data) {
  const int64_t L = model.config().n_layer;
  const size_t S = split.size();
  std::vector<ActivationStore> stores;
  for (const auto& [first, last] : split) {
    stores.push_back(model.allocate_stage_store(a.batch, a.seq, first, last, /*split_backward=*/true));
    data.fill(stores.back().tokens, stores.back().targets);
  }
  const Tensor grad = model.stage_grad(a.batch, a.seq);
  std::vector<std::vector<double>> f(S), b_all(S), b_input(S), w(S);
  for (int rep = 0; rep <= a.reps; ++rep) {
    for (size_t s = 0; s < S; ++s) {
      const auto [first, last] = split[s];
      ActivationStore& store = stores[s];
      auto forward = [&] {
        if (first > 0) fill_small(store.blocks[static_cast<size_t>(first)].input, 1);  // from the previous stage
        const double t = now();
        model.forward_stage(store, first, last);
        return now() - t;
      };
      auto prepare_backward = [&] {
        if (last < L) fill_small(grad, 2);  // d(stage output), from the next stage
      };
      const double tf = forward();
      prepare_backward();
      double t = now();
      model.backward_stage(store, first, last, 1.0f, BACKWARD_ALL);
      const double tb = now() - t;
      forward();  // the last stage's backward overwrote its logits: a fresh forward for the split pass
      prepare_backward();
      t = now();
      model.backward_stage(store, first, last, 1.0f, BACKWARD_INPUT);
      const double ti = now() - t;
      t = now();
      model.backward_stage(store, first, last, 1.0f, BACKWARD_WEIGHT);
      const double tw = now() - t;
      if (rep == 0) continue;  // warm-up: first touches of the stores and gradients
      f[s].push_back(tf), b_all[s].push_back(tb), b_input[s].push_back(ti), w[s].push_back(tw);
    }
  }
  std::vector<StageCosts> out;
  for (size_t s = 0; s < S; ++s) {
    out.push_back({split[s].first, split[s].second, median(f[s]), median(b_all[s]), median(b_input[s]), median(w[s])});
  }
  return out;
}

// Seconds of one (B, T, C) stage-to-stage message: half the mean round trip of a ping-pong
// between ranks 0 and 1 (20 round trips after 2 untimed). Every rank returns rank 0's figure.
double time_p2p(Communicator& world, Backend& backend, const Args& a) {
  Tensor msg = Tensor::zeros(backend.allocator(), {a.batch, a.seq, a.d_model}, DTYPE_F32, MEM_COMMUNICATION);
  Tensor result = Tensor::zeros(backend.allocator(), {1}, DTYPE_F64, MEM_WORKSPACE);
  constexpr int kWarm = 2, kTrips = 20;
  double start = 0;
  world.barrier();
  for (int i = 0; i < kWarm + kTrips; ++i) {
    if (i == kWarm) start = now();
    if (world.rank() == 0) {
      world.send(msg, 1, 7);
      world.recv(msg, 1, 8);
    } else if (world.rank() == 1) {
      world.recv(msg, 0, 7);
      world.send(msg, 0, 8);
    }
  }
  if (world.rank() == 0) result.data<double>()[0] = (now() - start) / kTrips / 2;
  world.broadcast(result, 0);
  return result.data<double>()[0];
}

// The formula's bubble fraction of the step (GPipe, Megatron, Zero Bubble), from p, m, v and
// (ZB-H1) the measured F, B, W: idle time / (idle time + ideal time).
double formula_bubble(const PipeSchedule& s, const PipeCosts& c) {
  const double p = s.stages, m = s.micro, v = s.virtual_chunks;
  if (s.kind == PipeScheduleKind::gpipe || s.kind == PipeScheduleKind::one_f_one_b) return (p - 1) / (m + p - 1);
  if (s.kind == PipeScheduleKind::interleaved) {
    const double x = (p - 1) / (v * m);  // bubble / ideal
    return x / (1 + x);
  }
  // ZB-H1: (p-1)(T_F + T_B - T_W) per rank against the ideal m (T_F + T_B + T_W).
  const double bubble = (p - 1) * (c.f + c.b - c.w);
  return bubble / (m * (c.f + c.b + c.w) + bubble);
}

struct Result {
  std::string kind;
  double step = 0;      // mean step seconds (slowest rank)
  double makespan = 0;  // simulated step (seconds)
};

Result run_schedule(Communicator& world, const Args& a, const std::string& kind,
                    const std::map<int, std::vector<StageCosts>>& cost_table, double p2p) {
  const int P = world.size(), rank = world.rank();
  const int v = kind == "interleaved" ? a.chunks : 1;
  // pp = P: the whole job is one pipeline (a 1-D mesh; its pp group is the world).
  const DeviceMesh mesh(P, {{"pp", P}});
  auto pp = mesh_group(world, mesh, "pp");
  auto backend = make_cpu_backend();
  const ModelConfig config = bench_model(a);
  Transformer model(*backend, config);
  model.init_weights(7);
  PipeSchedule schedule = make_pipe_schedule(kind, P, a.micro, v);
  RandomWindowSource data(random_tokens(1 << 20, config.vocab_size), 11);

  // Activation bytes the runner allocates on this rank (its stage stores for all m micro-batches).
  const MemoryTracker& mem = backend->allocator().tracker();
  const size_t act_before = mem.current(MEM_ACTIVATIONS);
  PipelineRunner runner(model, *pp, schedule, a.batch, a.seq);
  const double act_bytes = static_cast<double>(mem.current(MEM_ACTIVATIONS) - act_before);
  TrainConfig tc;
  tc.batch_size = a.batch, tc.seq_len = a.seq, tc.grad_accum = a.micro, tc.steps = a.steps, tc.schedule.warmup = 1;
  Trainer trainer(*backend, model, tc, nullptr, DdpConfig{}, &runner);

  double busy = 0, idle = 0, step = 0;
  double loss = 0;
  for (int64_t s = 0; s < a.steps; ++s) {
    world.barrier();
    const StepStats st = trainer.train_step(data);
    loss = st.loss;
    if (s == 0) continue;  // warm-up: first touches of the stores and optimizer state
    busy += runner.busy_seconds(), idle += runner.idle_seconds(), step += st.seconds;
  }
  const double n = static_cast<double>(a.steps - 1);
  // [rank][busy, idle, step, activation bytes]: each rank writes its slot, the sum gathers them everywhere.
  constexpr int kFields = 4;
  Tensor all = Tensor::zeros(backend->allocator(), {kFields * static_cast<int64_t>(P)}, DTYPE_F64, MEM_WORKSPACE);
  double* mine = all.data<double>() + kFields * rank;
  mine[0] = busy / n, mine[1] = idle / n, mine[2] = step / n, mine[3] = act_bytes;
  world.all_reduce(all);

  Result res;
  res.kind = kind;
  const double* g = all.data<double>();
  for (int r = 0; r < P; ++r) res.step = std::max(res.step, g[kFields * r + 2]);
  if (rank != 0) return res;

  // Simulation with the measured unit costs: the mean over the model stages (simulate() takes
  // one cost per op; the per-stage figures are printed at the end).
  const std::vector<StageCosts>& sc = cost_table.at(v);
  StageCosts mean;
  for (const StageCosts& c : sc) {
    mean.f += c.f / sc.size(), mean.b_all += c.b_all / sc.size(), mean.b_input += c.b_input / sc.size();
    mean.w += c.w / sc.size();
  }
  PipeCosts costs;
  costs.f = mean.f;
  costs.b = schedule.split_backward ? mean.b_input : mean.b_all;
  costs.w = schedule.split_backward ? mean.w : 0.0;
  costs.p2p = p2p;
  const PipeSimulation sim = simulate(schedule, costs);
  res.makespan = sim.makespan;
  const double formula = formula_bubble(schedule, costs);

  std::printf("\n### %s (p=%d, m=%d, v=%d)\n\n", kind.c_str(), P, a.micro, v);
  std::printf("simulated with F %.2f ms, B %.2f ms, W %.2f ms, p2p %.3f ms per chunk action (mean over %zu model stages)\n",
              1e3 * costs.f, 1e3 * costs.b, 1e3 * costs.w, 1e3 * costs.p2p, sc.size());
  std::printf("final loss %.4f; mean step %.3f s (slowest rank, steps 2..%lld), simulated step %.3f s\n\n", loss,
              res.step, static_cast<long long>(a.steps), sim.makespan);
  std::printf("| rank | busy s | idle s | idle fraction | simulated idle fraction | formula bubble | busy / simulated "
              "busy | activation MiB | simulated peak live |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  double sum_busy = 0, sum_idle = 0, sum_act = 0;
  for (int r = 0; r < P; ++r) {
    const double b = g[kFields * r], i = g[kFields * r + 1], act = g[kFields * r + 3];
    const size_t ri = static_cast<size_t>(r);
    sum_busy += b, sum_idle += i, sum_act += act;
    std::printf("| %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f | %.1f | %d |\n", r, b, i, i / (b + i),
                sim.idle[ri] / sim.makespan, formula, b / sim.busy[ri], act / (1 << 20), sim.peak_held[ri]);
  }
  double sim_busy = 0;
  for (double b : sim.busy) sim_busy += b;
  std::printf("| all | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f | %.1f | |\n", sum_busy, sum_idle,
              sum_idle / (sum_busy + sum_idle), sim.bubble_fraction, formula, sum_busy / sim_busy, sum_act / (1 << 20));
  std::printf("(activation MiB: allocated by the runner on the rank, its stage stores for all %d micro-batches; "
              "simulated peak live: the (chunk, micro-batch) activations the schedule holds at once, until W)\n",
              a.micro);
  std::fflush(stdout);
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse(argc, argv);
    auto world = make_mpi_communicator();
    const int P = world->size();
    LOOM_CHECK(P >= 2, "pipeline_bench needs at least 2 ranks (mpirun -np P, P >= 2), got ", P);
    std::vector<std::string> kinds;
    const auto& all = pipe_schedule_kinds();
    if (args.schedule == "all") {
      kinds = all;
    } else {
      LOOM_CHECK(std::find(all.begin(), all.end(), args.schedule) != all.end(), "--schedule '", args.schedule,
                 "': expected all, gpipe, 1f1b, interleaved or zb-h1");
      kinds = {"gpipe"};  // the reference, measured in the same run
      if (args.schedule != "gpipe") kinds.push_back(args.schedule);
    }
    const ModelConfig config = bench_model(args);
    const char* threads = std::getenv("OMP_NUM_THREADS");
    if (world->rank() == 0) {
      std::printf("pipeline_bench: %d ranks (OMP_NUM_THREADS=%s), GPT-2 L=%lld C=%lld heads=%lld d_ff=%lld V=%lld, "
                  "%lld parameters; micro-batch %lld x %lld tokens, m=%d micro-batches per step, %lld steps (first "
                  "discarded), AdamW fp32\n",
                  P, threads ? threads : "unset", static_cast<long long>(config.n_layer),
                  static_cast<long long>(config.d_model), static_cast<long long>(config.n_head),
                  static_cast<long long>(config.d_ff), static_cast<long long>(config.vocab_size),
                  static_cast<long long>(param_count(config)), static_cast<long long>(args.batch),
                  static_cast<long long>(args.seq), args.micro, static_cast<long long>(args.steps));
    }
    double p2p = 0;
    {
      auto backend = make_cpu_backend();
      p2p = time_p2p(*world, *backend, args);
    }
    // Unit costs of every model stage, for each chunk count the schedules use, timed on rank 0
    // alone before any training (the other ranks wait at the barrier).
    std::map<int, std::vector<StageCosts>> cost_table;  // [v][model stage]
    {
      auto backend = make_cpu_backend();
      Transformer model(*backend, config);
      model.init_weights(7);
      RandomWindowSource timing_data(random_tokens(1 << 16, config.vocab_size), 3);
      world->barrier();
      for (const std::string& kind : kinds) {
        const int v = kind == "interleaved" ? args.chunks : 1;
        if (cost_table.count(v) != 0) continue;
        const auto split = pipeline_stage_split(config, P * v, args.seq);  // the runner's split; throws naming parallel.pp if too few layers
        cost_table[v] = world->rank() == 0 ? time_stages(model, split, args, timing_data) : std::vector<StageCosts>{};
      }
      world->barrier();
    }
    std::vector<Result> results;
    for (const std::string& kind : kinds) {
      results.push_back(run_schedule(*world, args, kind, cost_table, p2p));
    }
    if (world->rank() == 0) {
      std::printf("\nunit costs measured on rank 0 before training, one micro-batch (%lld x %lld tokens), median of %d "
                  "after 1 untimed; "
                  "p2p = one (B,T,C) f32 message, half a ping-pong round trip between ranks 0 and 1: %.3f ms\n\n",
                  static_cast<long long>(args.batch), static_cast<long long>(args.seq), args.reps, 1e3 * p2p);
      std::printf("| chunks per rank | model stage | layers | F ms | B (whole) ms | B (input) ms | W ms |\n");
      std::printf("|---|---|---|---|---|---|---|\n");
      for (const auto& [v, stages] : cost_table) {
        for (size_t s = 0; s < stages.size(); ++s) {
          const StageCosts& c = stages[s];
          std::printf("| %d | %zu | [%lld, %lld)%s | %.2f | %.2f | %.2f | %.2f |\n", v, s,
                      static_cast<long long>(c.first), static_cast<long long>(c.last),
                      c.first == 0 ? " + embedding" : (c.last == config.n_layer ? " + head, loss" : ""), 1e3 * c.f,
                      1e3 * c.b_all, 1e3 * c.b_input, 1e3 * c.w);
        }
      }
      std::printf("\n| schedule | measured step s | measured / GPipe | simulated step s | simulated / GPipe |\n");
      std::printf("|---|---|---|---|---|\n");
      for (const Result& r : results) {
        std::printf("| %s | %.3f | %.3f | %.3f | %.3f |\n", r.kind.c_str(), r.step, r.step / results[0].step, r.makespan,
                    r.makespan / results[0].makespan);
      }
      std::fflush(stdout);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_bench: %s\n", e.what());
    return 1;
  }
}
