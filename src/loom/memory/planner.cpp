#include "loom/memory/planner.h"

#include <algorithm>
#include <cmath>
#include <exception>

#include "loom/core/error.h"
#include "loom/arch/config.h"
#include "loom/parallel/tensor_parallel.h"

namespace loom {

void Hardware::validate() const {
  LOOM_CHECK(nodes >= 1, "hardware.nodes must be >= 1, got ", nodes);
  LOOM_CHECK(devices_per_node >= 1, "hardware.devices_per_node must be >= 1, got ", devices_per_node);
  LOOM_CHECK(memory_gib > 0, "hardware.memory_gib must be > 0, got ", memory_gib);
  LOOM_CHECK(peak_tflops > 0, "hardware.peak_tflops must be > 0, got ", peak_tflops);
  LOOM_CHECK(efficiency > 0 && efficiency <= 1, "hardware.efficiency must be in (0, 1], got ", efficiency);
  LOOM_CHECK(intra_node_gbs > 0 && inter_node_gbs > 0, "hardware.intra_node_gbs and inter_node_gbs must be > 0, got ",
             intra_node_gbs, " and ", inter_node_gbs);
  LOOM_CHECK(reserve >= 0 && reserve < 1, "hardware.reserve must be in [0, 1), got ", reserve);
}

std::string LayoutCost::describe() const {
  const MemoryPlan& p = plan;
  std::string s = str_cat("dp ", p.ranks / p.ep, " x tp ", p.tp, p.sequence_parallel ? "+sp" : "", " x pp ", p.pp);
  if (p.pp > 1) s += str_cat(" (", enum_name(p.schedule), p.virtual_stages > 1 ? str_cat(" v", p.virtual_stages) : "", ")");
  s += str_cat(" x cp ", p.cp);
  if (p.ep > 1) s += str_cat(" x ep ", p.ep);
  return s + str_cat(", ZeRO-", p.zero_stage, ", recompute ", p.recompute, ", ", p.micro, " micro-batch",
                     p.micro == 1 ? "" : "es");
}

namespace {
bool valid_tp(const ModelConfig& model, int tp) {
  if (tp == 1) return true;
  try {
    tp_local_config(model, tp);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

std::vector<int> powers_of_two(int limit) {
  std::vector<int> out;
  for (int v = 1; v <= limit; v *= 2) out.push_back(v);
  return out;
}

// Ring all-reduce (or reduce-scatter + all-gather) of `bytes` over `n` ranks at `gbs` GB/s.
double all_reduce_s(double bytes, int n, double gbs) {
  return n <= 1 ? 0.0 : 2.0 * (n - 1) / n * bytes / (gbs * 1e9);
}

void cost(LayoutCost& lc, const Hardware& hw, int64_t global_batch) {
  const MemoryPlan& p = lc.plan;
  const ModelConfig& c = p.model;
  const int N = hw.devices(), dpn = hw.devices_per_node, d = p.ranks;
  const double G = static_cast<double>(global_batch), T = static_cast<double>(p.seq_len), b = static_cast<double>(p.batch);
  const double m = static_cast<double>(p.micro), a = 2.0;  // bf16 on the wire
  const double flops = train_flops_per_token(c, p.seq_len) * G * T;
  const double peak = hw.peak_tflops * 1e12;
  const double recompute = p.recompute == "full" ? 4.0 / 3.0 : p.recompute == "selective" ? 1.05 : 1.0;
  lc.compute_s = flops / (N * peak * hw.efficiency) * recompute;
  if (p.pp > 1) lc.bubble_s = lc.compute_s * (p.pp - 1) / (p.virtual_stages * m);
  // Links: a group inside a node uses NVLink (tp innermost, then cp, ep, dp, pp).
  auto link = [&](int span) { return span <= dpn ? hw.intra_node_gbs : hw.inter_node_gbs; };
  const double layers = static_cast<double>(c.n_layer) / p.pp, Tl = T / p.cp;
  const double C = static_cast<double>(c.d_model);
  if (p.tp > 1) lc.tp_s = m * layers * 4 * all_reduce_s(b * Tl * C * a, p.tp, link(p.tp));
  if (p.cp > 1) {
    const double kv = b * Tl * 2 * static_cast<double>(c.n_kv_head * c.head_dim()) / p.tp * a;
    lc.cp_s = m * layers * 3 * (p.cp - 1) * kv / (link(p.tp * p.cp) * 1e9);
  }
  if (p.ep > 1) {
    double moe_layers = 0;
    for (int64_t l = 0; l < c.n_layer; ++l) moe_layers += c.moe_layer(l) ? 1 : 0;
    lc.ep_s = m * moe_layers / p.pp * 4 * c.moe_top_k * b * Tl * C * a * (p.ep - 1) / p.ep /
              (link(p.tp * p.cp * p.ep) * 1e9);
  }
  if (p.pp > 1) lc.pp_s = m * 2 * b * Tl * C * a / (p.sequence_parallel ? p.tp : 1) / (link(N) * 1e9);
  const int dp_group = d * p.cp;  // gradients are averaged over dp x cp
  if (dp_group > 1) {
    const double grad_bytes = static_cast<double>(lc.memory.rank_parameters) * (p.precision.reduce == "bf16" ? 2 : 4);
    double t = all_reduce_s(grad_bytes, dp_group, link(p.tp * p.cp * d));
    if (p.zero_stage == 3) t *= 1.5;
    const double backward_last_micro = lc.compute_s / m * 2.0 / 3.0;
    lc.dp_total_s = t;
    lc.dp_s = std::max(0.0, t - backward_last_micro);
  }
  lc.step_s = lc.compute_s + lc.bubble_s + lc.tp_s + lc.cp_s + lc.ep_s + lc.pp_s + lc.dp_s;
  lc.tokens_per_s = G * T / lc.step_s;
  lc.mfu = flops / (lc.step_s * N * peak);
  const double budget = hw.memory_gib * (1 << 30) * (1 - hw.reserve);
  lc.fits = static_cast<double>(lc.memory.total()) <= budget;

  // The reasoning (the seeds' rules) and the largest overheads.
  std::vector<std::string> why;
  if (p.tp == 1 && p.pp == 1 && p.cp == 1 && p.ep == 1 && p.zero_stage == 0) why.push_back("a replica fits a device: plain data parallel");
  if (p.zero_stage > 0) why.push_back(str_cat("ZeRO-", p.zero_stage, " shards the ", p.zero_stage == 1 ? "optimizer state" :
                                              p.zero_stage == 2 ? "optimizer state and gradients" : "model states",
                                              " over ", dp_group, " data-parallel ranks"));
  if (p.tp > 1) why.push_back(str_cat("tp ", p.tp, " inside a node (", hw.intra_node_gbs, " GB/s): ", p.tp, "x less per device, ",
                                      static_cast<int>(std::lround(100 * lc.tp_s / lc.step_s)), "% of the step in its collectives"));
  if (p.pp > 1) why.push_back(str_cat("pp ", p.pp, p.tp * p.cp * d * p.pp > dpn ? " across nodes" : " inside a node",
                                      " (point-to-point only): bubble ", static_cast<int>(std::lround(100 * lc.bubble_s / lc.step_s)), "%"));
  if (p.cp > 1) why.push_back(str_cat("cp ", p.cp, " for the ", p.seq_len, "-token sequence: activations / ", p.cp));
  if (p.ep > 1) why.push_back(str_cat("ep ", p.ep, ": each rank computes 1/", p.ep, " of the experts"));
  if (p.recompute != "none") why.push_back(str_cat("recompute ", p.recompute, ": +", static_cast<int>(std::lround(100 * (recompute - 1))),
                                                   "% compute for activation memory"));
  if (lc.dp_s > 0) why.push_back(str_cat("gradient reduction exposed ", static_cast<int>(std::lround(100 * lc.dp_s / lc.step_s)), "%"));
  for (size_t i = 0; i < why.size(); ++i) lc.reasoning += (i ? "; " : "") + why[i];
}
}  // namespace

std::vector<LayoutCost> plan_layouts(const MemoryPlan& base, int64_t global_batch, const Hardware& hw) {
  hw.validate();
  const ModelConfig& c = base.model;
  const int N = hw.devices();
  LOOM_CHECK(global_batch >= 1, "the global batch must be >= 1 sequence, got ", global_batch);
  LOOM_CHECK(base.batch >= 1, "train.batch_size (the micro-batch) must be >= 1, got ", base.batch);
  std::vector<LayoutCost> out;
  for (const int tp : powers_of_two(hw.devices_per_node)) {
    if (N % tp != 0 || !valid_tp(c, tp) || base.seq_len % tp != 0) continue;
    for (const int cp : powers_of_two(16)) {
      if (N % (tp * cp) != 0 || base.seq_len % (2 * cp) != 0) continue;
      for (int pp = 1; pp <= N / (tp * cp) && pp <= c.n_layer; ++pp) {
        if ((N / (tp * cp)) % pp != 0) continue;
        const int dp = N / (tp * cp * pp);  // data-parallel ranks (with the ep ones)
        if (global_batch % (static_cast<int64_t>(dp) * base.batch) != 0) continue;
        const int64_t micro = global_batch / (static_cast<int64_t>(dp) * base.batch);
        for (int ep = 1; ep <= dp; ep *= 2) {
          if (ep > 1 && (c.moe_experts == 0 || c.moe_experts % ep != 0 || dp % ep != 0)) continue;
          for (const PipeScheduleKind schedule : {PipeScheduleKind::one_f_one_b, PipeScheduleKind::interleaved}) {
            const bool interleaved = schedule == PipeScheduleKind::interleaved;
            if (interleaved && (pp == 1 || micro % pp != 0 || c.n_layer < 2 * pp)) continue;
            if (!interleaved && pp > 1 && micro < pp) continue;  // 1F1B needs m >= p to fill the pipe
            for (int zero = 0; zero <= 3; ++zero) {
              if (zero > 0 && (dp * cp == 1 || ep > 1 || (pp > 1 && zero > 1))) continue;
              for (const char* recompute : {"none", "selective", "full"}) {
                if (std::string(recompute) != "none" && (tp > 1 || pp > 1 || cp > 1)) continue;
                LayoutCost lc;
                MemoryPlan& p = lc.plan;
                p = base;
                p.tp = tp, p.sequence_parallel = tp > 1, p.cp = cp, p.ulysses = false, p.pp = pp, p.ep = ep;
                p.ranks = dp, p.zero_stage = zero, p.recompute = recompute, p.micro = micro;
                p.schedule = pp > 1 ? schedule : PipeScheduleKind::one_f_one_b, p.virtual_stages = interleaved ? 2 : 1;
                // Context parallelism runs ring attention, which keeps its own log-sum-exp: the
                // layer plan refuses flash attention with cp > 1, and before this line every cp
                // layout was refused and silently skipped.
                p.flash_attention = base.flash_attention && cp == 1;
                try {
                  lc.memory = estimate_memory(p);
                } catch (const std::exception&) {
                  continue;  // a layout the estimate (the runtime) refuses
                }
                cost(lc, hw, global_batch);
                out.push_back(std::move(lc));
              }
            }
          }
        }
      }
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const LayoutCost& x, const LayoutCost& y) {
    if (x.fits != y.fits) return x.fits;
    if (!x.fits) return x.memory.total() < y.memory.total();
    if (x.step_s != y.step_s) return x.step_s < y.step_s;
    if (x.dp_total_s != y.dp_total_s) return x.dp_total_s < y.dp_total_s;  // equal times: fewer bytes on the wire,
    return x.memory.total() < y.memory.total();                              // then more memory to spare
  });
  return out;
}

}  // namespace loom
