// loom plan: which parallel layouts of a model fit a cluster, ranked by an estimated step time.
//
// Every layout dp x tp x pp x cp (x ep for MoE) of the cluster's devices that Loom can run is
// enumerated (tp a power of two inside a node, dividing the heads; sequence parallel with tp;
// pp dividing the layers, 1F1B or interleaved; cp ring attention when the sequence splits into
// 2 cp chunks; ZeRO 0-3 where it composes; recompute policies without model parallelism), its
// bytes per device estimated (memory/estimate.h, the largest rank), and those that fit the
// device's memory (less a reserve for workspace and fragmentation) ranked by the step time of
// a simple cost model (the seeds' reasoning, "Efficient Large-Scale Language Model Training on
// GPU Clusters", Narayanan et al. 2021, §3):
//   compute  = train FLOPs of the global batch / (devices x peak x efficiency), x 4/3 with full
//              recompute (one more forward), x 1.05 selective (Korthikanti et al. 2022)
//   bubble   = compute x (p-1)/m (1F1B), (p-1)/(v m) interleaved
//   tp       = m x L/p layers x 4 collectives (2 forward, 2 backward) of b T/cp C a bytes, each
//              2 (t-1)/t of it over the tp link (all-reduce, or all-gather + reduce-scatter)
//   cp       = m x L/p x 3 ring passes of (cp-1) K/V chunks of b T/cp 2 KV hd a bytes
//   pp       = m x 2 messages of b T/cp C a / (t with sp) bytes over the pp link
//   ep       = m x MoE layers x 4 all-to-alls of k b T/cp C a (ep-1)/ep bytes
//   dp       = 2 (d-1)/d x the rank's gradient bytes (ZeRO-3: x 1.5, the parameter gathers),
//              less the overlap with the last micro-batch's backward (2/3 of its compute)
// a = 2 (bf16 activations on the wire). A group's link is the node's when the group (with the
// dimensions inside it: tp innermost, then cp, ep, dp, pp outermost) fits in a node, else the
// network's. Nothing here is measured: it orders layouts and says why; loom train measures.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/memory/estimate.h"

namespace loom {

struct Hardware {
  std::string name = "8 x H100 SXM 80GB per node";
  int nodes = 1;
  int devices_per_node = 8;
  double memory_gib = 80.0;     // per device
  double peak_tflops = 989.0;   // dense bf16 per device (H100 SXM)
  double efficiency = 0.5;      // the fraction of peak a step's compute reaches (MFU without communication)
  double intra_node_gbs = 450;  // per-device bandwidth inside a node, GB/s (NVLink 4: 450 per direction)
  double inter_node_gbs = 50;   // per-device bandwidth between nodes, GB/s (400 Gb/s InfiniBand)
  double reserve = 0.1;         // memory fraction kept free (workspace, communication buffers, fragmentation)

  int devices() const { return nodes * devices_per_node; }
  void validate() const;  // throws naming the key (hardware.nodes, ...)
};

struct LayoutCost {
  MemoryPlan plan;   // the layout (tp, pp, cp, ep, ranks = dp, zero_stage, recompute, schedule, micro)
  MemoryEstimate memory;
  double compute_s = 0, bubble_s = 0, tp_s = 0, cp_s = 0, pp_s = 0, ep_s = 0, dp_s = 0;  // dp_s: exposed
  double dp_total_s = 0;  // the whole gradient reduction, overlapped or not (breaks ties)
  double step_s = 0;
  double tokens_per_s = 0;
  double mfu = 0;     // model FLOPs / (step x devices x peak)
  bool fits = false;  // memory.total() <= memory_gib x (1 - reserve)
  std::string describe() const;  // "dp 8 x tp 1 ..., ZeRO-1, recompute none"
  std::string reasoning;        // why this layout: the rules it follows, its largest costs
};

// All candidate layouts for `base` (model, micro-batch size and sequence length, optimizer,
// precision; its layout fields are ignored) at a global batch of `global_batch` sequences per
// step, sorted: those that fit first, by step time; then the rest by memory.
std::vector<LayoutCost> plan_layouts(const MemoryPlan& base, int64_t global_batch, const Hardware& hw);

}  // namespace loom
