// One rank's part of a model-parallel layout, as the distributed tests build it: the mesh groups
// (pp x dp x ep x cp x tp), this rank's slice of a preset model, the pipeline runner, the
// trainer and the batches of the test corpus this rank trains on.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/comm/device_mesh.h"
#include "loom/core/error.h"
#include "loom/parallel/pipeline.h"
#include "mpi_fixture.h"

namespace loom {

struct RunLayout {
  const char* preset = "gpt2-tiny";
  int n_layer = 0;  // > 0: the preset with this many layers
  int dp = 1, tp = 1, pp = 1, cp = 1, ep = 1;
  bool sp = false, ulysses = false;
  const char* schedule = "1f1b";
  int virtual_stages = 1;
  int zero = 0;
  int64_t grad_accum = 1;  // without pp (a pipeline runs kLayoutMicro micro-batches)
  bool moe_losses = false;  // the MoE auxiliary losses and the routing bias update on
  const char* optimizer = "adamw";
  const char* compression = "none";  // parallel.compression over the data-parallel ranks (Top-K ratio 0.05)
  std::string name() const {
    return str_cat(preset, " dp", dp, " tp", tp, sp ? "+sp" : "", " pp", pp, pp > 1 ? str_cat("(", schedule, ")") : "",
                   " cp", cp, cp > 1 ? (ulysses ? "(ulysses)" : "(ring)") : "", " ep", ep, " zero", zero, " accum",
                   grad_accum, moe_losses ? " moe-losses " : " ", optimizer,
                   std::string(compression) == "none" ? "" : str_cat(" compression ", compression));
  }
};

constexpr int64_t kLayoutBatch = 2, kLayoutSeq = 16, kLayoutMicro = 4;

// `backend_in`: the backend it runs on (the CPU's by default; the strict test backend's device
// memory gets its batches staged in host memory, as a GPU's).
struct LayoutRun {
  LayoutRun(Communicator& world, const RunLayout& lay, std::unique_ptr<Backend> backend_in = make_cpu_backend())
      : config(layout_model(lay)),
        mesh(world.size(), {{"pp", lay.pp}, {"dp", lay.dp}, {"ep", lay.ep}, {"cp", lay.cp}, {"tp", lay.tp}}),
        pp(mesh_group(world, mesh, "pp")),
        dp(mesh_group(world, mesh, std::vector<std::string>{"dp", "ep"})),
        ep(mesh_group(world, mesh, "ep")),
        tp(mesh_group(world, mesh, "tp")),
        cp(mesh_group(world, mesh, "cp")),
        reduce(mesh_group(world, mesh, std::vector<std::string>{"dp", "ep", "cp"})),
        backend(std::move(backend_in)),
        sliced(*backend, config, *tp, lay.sp),
        rows(staging(), config, dp->rank(), dp->size(), kLayoutBatch),
        positions(rows.source(), staging(), cp->rank(), cp->size(), kLayoutBatch, kLayoutSeq) {
    Transformer& model = sliced.model;
    if (lay.cp > 1) model.set_context_parallel(cp.get(), lay.ulysses);
    if (lay.ep > 1) model.set_expert_parallel(ep.get());
    tc.batch_size = kLayoutBatch, tc.seq_len = kLayoutSeq, tc.grad_accum = lay.pp > 1 ? kLayoutMicro : lay.grad_accum;
    tc.steps = 4;
    tc.optim.name = lay.optimizer;
    if (lay.pp > 1) {
      runner = std::make_unique<PipelineRunner>(
          model, *pp, make_pipe_schedule(lay.schedule, lay.pp, kLayoutMicro, lay.virtual_stages), kLayoutBatch, kLayoutSeq);
    }
    DdpConfig ddp;
    ddp.zero_stage = lay.zero;
    ddp.compression = parse_enum<Compression>(lay.compression, "compression"), ddp.topk_ratio = 0.05;
    trainer = std::make_unique<Trainer>(*backend, model, tc, reduce->size() > 1 ? reduce.get() : nullptr, ddp, runner.get());
    data = lay.cp > 1 ? static_cast<BatchSource*>(&positions) : &rows.source();
  }

  static ModelConfig layout_model(const RunLayout& lay) {
    ModelConfig c = model_preset(lay.preset);
    if (lay.n_layer > 0) c.n_layer = lay.n_layer;
    if (lay.moe_losses) c.moe_seq_aux_alpha = 1e-2f, c.moe_z_alpha = 1e-3f, c.moe_bias_gamma = 1e-2f;
    return c;
  }

  // The batch sources' memory: the backend's when host code can read it.
  Allocator& staging() { return backend->allocator().host_accessible() ? backend->allocator() : host; }

  CpuAllocator host;
  ModelConfig config;
  DeviceMesh mesh;
  std::unique_ptr<Communicator> pp, dp, ep, tp, cp, reduce;
  std::unique_ptr<Backend> backend;
  SlicedModel sliced;
  TrainConfig tc;
  RankData rows;
  ContextSliceSource positions;
  std::unique_ptr<PipelineRunner> runner;
  std::unique_ptr<Trainer> trainer;
  BatchSource* data = nullptr;
};

// The model-parallel layouts the distributed tests build on `world` ranks (2 or 4): tp + sp, pp
// under every schedule, cp ring and Ulysses (with ZeRO-1) for a GPT-2 and a Llama, ep on the
// MoE preset, and (4 ranks) each beside data parallelism, MoE ep x pp and Llama tp + sp x pp.
inline std::vector<RunLayout> model_parallel_layouts(int world) {
  const int d = world / 2;  // the data-parallel ranks beside a 2-way model-parallel dimension
  std::vector<RunLayout> layouts;
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    RunLayout l;
    l.preset = preset, l.dp = d;
    RunLayout tp = l;
    tp.tp = 2, tp.sp = true;
    layouts.push_back(tp);
    for (const char* schedule : {"1f1b", "gpipe", "zb-h1"}) {
      RunLayout pl = l;
      pl.pp = 2, pl.schedule = schedule, pl.zero = d > 1 ? 1 : 0;
      layouts.push_back(pl);
    }
    RunLayout il = l;
    il.n_layer = 4, il.pp = 2, il.schedule = "interleaved", il.virtual_stages = 2;
    layouts.push_back(il);
    for (const bool ulysses : {false, true}) {
      RunLayout c = l;
      c.cp = 2, c.ulysses = ulysses, c.zero = 1;
      layouts.push_back(c);
    }
  }
  RunLayout moe;
  moe.preset = "moe-tiny", moe.dp = d, moe.ep = 2;
  layouts.push_back(moe);
  if (world == 4) {
    RunLayout moe_pp = moe;
    moe_pp.dp = 1, moe_pp.pp = 2;
    layouts.push_back(moe_pp);
    RunLayout tp_pp;
    tp_pp.preset = "llama-tiny", tp_pp.tp = 2, tp_pp.sp = true, tp_pp.pp = 2;
    layouts.push_back(tp_pp);
  }
  return layouts;
}

}  // namespace loom
