#include "loom/parallel/tensor_parallel.h"

#include <algorithm>
#include <string>
#include <tuple>

#include "loom/core/error.h"
#include "loom/nn/block.h"

namespace loom {

namespace {

bool is_vocab_param(const std::string& name) {
  return name == "wte.weight" || name == "model.embed_tokens.weight" || name == "lm_head.weight";
}

bool is_block_param(const ModelConfig& c, const std::string& name) {
  return name.rfind(c.arch == ARCH_GPT2 ? "h." : "model.layers.", 0) == 0;
}

int64_t cols_of(const Tensor& t) { return t.ndim() == 2 ? t.dim(1) : 1; }

// n rows starting at g0 of the global matrix <-> rows starting at l0 of the local one (contiguous).
void copy_rows(Backend& backend, const Tensor& g, int64_t g0, const Tensor& l, int64_t l0, int64_t n, bool to_local) {
  const int64_t cols = cols_of(g);
  const Tensor gv = g.view(g0 * cols, {n * cols}), lv = l.view(l0 * cols, {n * cols});
  if (to_local) backend.copy(gv, lv);
  else backend.copy(lv, gv);
}

void copy_whole(Backend& backend, const Tensor& g, const Tensor& l, bool to_local) {
  if (!g.defined()) return;
  if (to_local) backend.copy(g, l);
  else backend.copy(l, g);
}

// A fused column-parallel weight's rows: [global begin, local begin, count) of each piece a rank holds.
struct RowPiece {
  int64_t global = 0, local = 0, count = 0;
};

// LoRA's adapters of one layer (nn/lora.h), g and l in the same site order. A column-parallel
// layer (qkv, fc: the output sliced) keeps A whole (replicated) and the rows of B its output
// slice holds (`rows`: the fused weight's pieces); a row-parallel one (proj, fc2: the input
// sliced) the columns [col0, col0 + its width) of A and B whole (replicated).
void copy_adapters(Backend& backend, const LoraAdapters& g, const LoraAdapters& l, const std::vector<RowPiece>& rows,
                   int64_t col0, bool column_parallel, bool to_local, bool replicated, int tp) {
  LOOM_CHECK(g.size() == l.size(), "tensor parallel copy: ", g.size(), " global and ", l.size(), " local adapters");
  for (size_t i = 0; i < g.size(); ++i) {
    LOOM_CHECK(!g[i].m.defined() || tp == 1, "tensor parallel copy: DoRA's magnitudes are not sliced for tensor parallelism");
    if (g[i].m.defined() && replicated) copy_whole(backend, g[i].m, l[i].m, to_local);  // (one rank: whole)
    if (!column_parallel) {
      copy_columns(backend, g[i].a, col0, l[i].a, !to_local);
      if (replicated) copy_whole(backend, g[i].b, l[i].b, to_local);
      continue;
    }
    if (replicated) copy_whole(backend, g[i].a, l[i].a, to_local);
    const int64_t gb = g[i].out_begin, ge = gb + g[i].b.dim(0), lb = l[i].out_begin;
    for (const RowPiece& p : rows) {  // the pieces of the adapter's rows [gb, ge) this rank holds
      const int64_t lo = std::max(gb, p.global), hi = std::min(ge, p.global + p.count);
      if (lo < hi) copy_rows(backend, g[i].b, lo - gb, l[i].b, p.local + (lo - p.global) - lb, hi - lo, to_local);
    }
  }
}

// A gated DeltaNet block (nn/linear_attention.h) split by heads: rank r holds key heads
// [r Hk/tp, ...) and the value heads that read them, [r Hv/tp, ...): their rows of [q | k | v | z],
// of [b | a] and of the conv's [q | k | v] channels, their A_log and dt_bias, and those columns of
// the output projection (row-parallel); the gated norm's per-head weight is replicated.
void copy_linear_attention(Backend& backend, const ModelConfig& gc, const ModelConfig& lc, const GatedDeltaNetParams& g,
                           const GatedDeltaNetParams& l, int rank, bool to_local, bool replicated) {
  const int64_t Dq = gc.linear_key_heads * gc.linear_key_dim, Dv = gc.linear_value_heads * gc.linear_value_dim;
  const int64_t Dql = lc.linear_key_heads * lc.linear_key_dim, Dvl = lc.linear_value_heads * lc.linear_value_dim;
  const int64_t Hv = gc.linear_value_heads, Hvl = lc.linear_value_heads;
  for (const auto& [gt, lt, with_z] : {std::tuple{g.qkvz_w, l.qkvz_w, true}, std::tuple{g.conv_w, l.conv_w, false}}) {
    copy_rows(backend, gt, rank * Dql, lt, 0, Dql, to_local);                    // q
    copy_rows(backend, gt, Dq + rank * Dql, lt, Dql, Dql, to_local);             // k
    copy_rows(backend, gt, 2 * Dq + rank * Dvl, lt, 2 * Dql, Dvl, to_local);     // v
    if (with_z) copy_rows(backend, gt, 2 * Dq + Dv + rank * Dvl, lt, 2 * Dql + Dvl, Dvl, to_local);  // z
  }
  copy_rows(backend, g.ba_w, rank * Hvl, l.ba_w, 0, Hvl, to_local);        // b
  copy_rows(backend, g.ba_w, Hv + rank * Hvl, l.ba_w, Hvl, Hvl, to_local);  // a
  copy_rows(backend, g.a_log, rank * Hvl, l.a_log, 0, Hvl, to_local);
  copy_rows(backend, g.dt_bias, rank * Hvl, l.dt_bias, 0, Hvl, to_local);
  copy_columns(backend, g.out_w, rank * Dvl, l.out_w, !to_local);
  if (replicated) copy_whole(backend, g.gate_norm_w, l.gate_norm_w, to_local);
}

}  // namespace

ModelConfig tp_local_config(const ModelConfig& global, int tp) {
  LOOM_CHECK(tp >= 1, "parallel.tp must be >= 1, got ", tp);
  LOOM_CHECK(tp == 1 || !global.mla(), "model.mla_kv_rank > 0 (MLA) is not supported with tensor parallelism "
             "(parallel.tp = ", tp, ")");
  LOOM_CHECK(tp == 1 || !global.qk_norm_whole, "model.qk_norm_whole (q/k norms over all heads) is not supported with "
             "tensor parallelism (parallel.tp = ", tp, ")");
  LOOM_CHECK(global.n_head % tp == 0 && global.n_kv_head % tp == 0, "parallel.tp = ", tp, " must divide model.n_head (",
             global.n_head, ") and model.n_kv_head (", global.n_kv_head, "): attention is split by heads");
  LOOM_CHECK(global.d_ff % tp == 0, "parallel.tp = ", tp, " must divide model.d_ff (", global.d_ff, ")");
  LOOM_CHECK(global.linear_interval == 0 || (global.linear_key_heads % tp == 0 && global.linear_value_heads % tp == 0),
             "parallel.tp = ", tp, " must divide model.linear_key_heads (", global.linear_key_heads,
             ") and model.linear_value_heads (", global.linear_value_heads, "): gated DeltaNet is split by heads");
  ModelConfig local = global;
  local.head_size = global.head_dim();
  local.linear_key_heads = global.linear_key_heads / tp;
  local.linear_value_heads = global.linear_value_heads / tp;
  local.n_head = global.n_head / tp;
  local.n_kv_head = global.n_kv_head / tp;
  local.d_ff = global.d_ff / tp;
  if (global.moe_experts > 0 && global.moe_d_ff == 0) local.moe_d_ff = global.d_ff;  // experts are not sliced
  local.vocab_size = (global.vocab_size + tp - 1) / tp;
  return local;
}

VocabRange tp_vocab_range(const ModelConfig& global, int rank, int tp) {
  const int64_t rows = (global.vocab_size + tp - 1) / tp;
  VocabRange v;
  v.begin = std::min<int64_t>(global.vocab_size, rank * rows);
  v.valid = std::min<int64_t>(global.vocab_size, v.begin + rows) - v.begin;
  return v;
}

void tp_copy(Backend& backend, const ModelConfig& gc, const Tensor& global, const ModelConfig& lc, const Tensor& local, int rank, int tp,
             bool to_local, bool write_replicated) {
  const ParamLayout gl = build_param_layout(gc), ll = build_param_layout(lc);
  LOOM_CHECK(global.numel() == gl.total && local.numel() == ll.total && global.dtype() == DTYPE_F32 &&
                 local.dtype() == DTYPE_F32,
             "tensor parallel copy: buffers ", global.describe(), " and ", local.describe(), " do not hold ", gl.total,
             " and ", ll.total, " f32 elements");
  const bool replicated = to_local || write_replicated;
  if (to_local) local.zero_();
  for (const ParamSpec& spec : ll.params) {
    if (is_block_param(lc, spec.name)) continue;  // (LoRA's adapters too: per layer below)
    const Tensor g = global.view(gl.find(spec.name).offset, gl.find(spec.name).shape);
    const Tensor l = local.view(spec.offset, spec.shape);
    if (is_vocab_param(spec.name)) {
      const VocabRange v = tp_vocab_range(gc, rank, tp);
      copy_rows(backend, g, v.begin, l, 0, v.valid, to_local);
    } else if (replicated) {
      copy_whole(backend, g, l, to_local);
    }
  }
  const int64_t hd = gc.head_dim(), H = gc.n_head, KV = gc.n_kv_head, F = gc.d_ff;
  const int64_t Hl = lc.n_head, KVl = lc.n_kv_head, Fl = lc.d_ff;
  for (int64_t layer = 0; layer < gc.n_layer; ++layer) {
    const BlockParams g = block_params_view(gc, gl, global, layer);
    const BlockParams l = block_params_view(lc, ll, local, layer);
    for (const auto& [gt, lt] : {std::pair{g.attention.qkv_w, l.attention.qkv_w}, std::pair{g.attention.qkv_b, l.attention.qkv_b}}) {
      if (!gt.defined()) continue;
      copy_rows(backend, gt, rank * Hl * hd, lt, 0, Hl * hd, to_local);                                  // query heads
      copy_rows(backend, gt, (H + rank * KVl) * hd, lt, Hl * hd, KVl * hd, to_local);                    // key heads
      copy_rows(backend, gt, (H + KV + rank * KVl) * hd, lt, (Hl + KVl) * hd, KVl * hd, to_local);       // value heads
    }
    if (g.attention.gate_w.defined()) copy_rows(backend, g.attention.gate_w, rank * Hl * hd, l.attention.gate_w, 0, Hl * hd, to_local);
    if (g.attention.sinks.defined()) copy_rows(backend, g.attention.sinks, rank * Hl, l.attention.sinks, 0, Hl, to_local);
    if (g.attention.proj_w.defined()) copy_columns(backend, g.attention.proj_w, rank * Hl * hd, l.attention.proj_w, !to_local);
    if (g.linear.qkvz_w.defined()) copy_linear_attention(backend, gc, lc, g.linear, l.linear, rank, to_local, replicated);
    for (const auto& [gt, lt] : {std::pair{g.mlp.fc_w, l.mlp.fc_w}, std::pair{g.mlp.fc_b, l.mlp.fc_b}}) {
      if (!gt.defined()) continue;
      copy_rows(backend, gt, rank * Fl, lt, 0, Fl, to_local);
      if (gc.gated_mlp()) copy_rows(backend, gt, F + rank * Fl, lt, Fl, Fl, to_local);  // the up half of [gate | up]
    }
    if (g.mlp.fc2_w.defined()) copy_columns(backend, g.mlp.fc2_w, rank * Fl, l.mlp.fc2_w, !to_local);
    // LoRA's adapters, sliced as their layers (the rows of the fused qkv and gate/up as above).
    const std::vector<RowPiece> qkv_rows = {{rank * Hl * hd, 0, Hl * hd},
                                            {(H + rank * KVl) * hd, Hl * hd, KVl * hd},
                                            {(H + KV + rank * KVl) * hd, (Hl + KVl) * hd, KVl * hd}};
    std::vector<RowPiece> fc_rows = {{rank * Fl, 0, Fl}};
    if (gc.gated_mlp()) fc_rows.push_back({F + rank * Fl, Fl, Fl});
    copy_adapters(backend, g.attention.qkv_lora, l.attention.qkv_lora, qkv_rows, 0, true, to_local, replicated, tp);
    copy_adapters(backend, g.attention.proj_lora, l.attention.proj_lora, {}, rank * Hl * hd, false, to_local, replicated, tp);
    copy_adapters(backend, g.mlp.fc_lora, l.mlp.fc_lora, fc_rows, 0, true, to_local, replicated, tp);
    copy_adapters(backend, g.mlp.fc2_lora, l.mlp.fc2_lora, {}, rank * Fl, false, to_local, replicated, tp);
    if (replicated && g.mlp.moe.defined()) {  // an MoE block's router and experts are replicated
      for (const auto& [gt, lt] : {std::pair{g.mlp.moe.router_w, l.mlp.moe.router_w}, std::pair{g.mlp.moe.bias, l.mlp.moe.bias},
                                   std::pair{g.mlp.moe.shared_fc_w, l.mlp.moe.shared_fc_w},
                                   std::pair{g.mlp.moe.shared_fc2_w, l.mlp.moe.shared_fc2_w},
                                   std::pair{g.mlp.moe.shared_gate_w, l.mlp.moe.shared_gate_w},
                                   std::pair{g.mlp.moe.router_b, l.mlp.moe.router_b}}) {
        copy_whole(backend, gt, lt, to_local);
      }
      for (size_t e = 0; e < g.mlp.moe.fc_w.size(); ++e) {
        copy_whole(backend, g.mlp.moe.fc_w[e], l.mlp.moe.fc_w[e], to_local);
        copy_whole(backend, g.mlp.moe.fc2_w[e], l.mlp.moe.fc2_w[e], to_local);
      }
      for (size_t e = 0; e < g.mlp.moe.fc_b.size(); ++e) {
        copy_whole(backend, g.mlp.moe.fc_b[e], l.mlp.moe.fc_b[e], to_local);
        copy_whole(backend, g.mlp.moe.fc2_b[e], l.mlp.moe.fc2_b[e], to_local);
      }
    }
    if (replicated) {
      for (const auto& [gt, lt] : {std::pair{g.attention.norm_w, l.attention.norm_w}, std::pair{g.attention.norm_b, l.attention.norm_b},
                                   std::pair{g.mlp.norm_w, l.mlp.norm_w}, std::pair{g.mlp.norm_b, l.mlp.norm_b},
                                   std::pair{g.attention.proj_b, l.attention.proj_b}, std::pair{g.mlp.fc2_b, l.mlp.fc2_b},
                                   std::pair{g.attention.q_norm, l.attention.q_norm},
                                   std::pair{g.attention.k_norm, l.attention.k_norm}}) {
        copy_whole(backend, gt, lt, to_local);
      }
    }
  }
}

std::vector<std::pair<int64_t, int64_t>> tp_replicated_ranges(const ModelConfig& lc) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const ParamSpec& spec : build_param_layout(lc).params) {
    if (is_vocab_param(spec.name)) continue;
    const std::string& n = spec.name;
    auto ends = [&n](const char* suffix) {
      const std::string s(suffix);
      return n.size() >= s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0;
    };
    // Sliced in a block: the fused QKV, the MLP's first weight and bias, the two row-parallel weights.
    const bool sliced = is_block_param(lc, n) &&
                        (ends("attn.c_attn.weight") || ends("attn.c_attn.bias") || ends("attn.c_proj.weight") ||
                         ends("mlp.c_fc.weight") || ends("mlp.c_fc.bias") || ends("mlp.c_proj.weight") ||
                         ends("self_attn.qkv_proj.weight") || ends("self_attn.qkv_proj.bias") ||
                         ends("self_attn.o_proj.weight") || ends("self_attn.gate_proj.weight") || ends("self_attn.sinks") ||
                         ends("linear_attn.in_proj_qkvz.weight") || ends("linear_attn.in_proj_ba.weight") ||
                         ends("linear_attn.conv1d.weight") || ends("linear_attn.A_log") || ends("linear_attn.dt_bias") ||
                         ends("linear_attn.out_proj.weight") ||
                         ends("mlp.gate_up_proj.weight") || ends("mlp.down_proj.weight"));
    // LoRA: B of a column-parallel layer (its output rows) and A of a row-parallel one (its input columns).
    const bool column = ends("q_proj.lora_B.weight") || ends("k_proj.lora_B.weight") || ends("v_proj.lora_B.weight") ||
                        ends("gate_proj.lora_B.weight") || ends("up_proj.lora_B.weight") ||
                        ends("attn.c_attn.lora_B.weight") || ends("mlp.c_fc.lora_B.weight");
    const bool row = ends("o_proj.lora_A.weight") || ends("down_proj.lora_A.weight") || ends("attn.c_proj.lora_A.weight") ||
                     ends("mlp.c_proj.lora_A.weight");
    if (sliced || column || row) continue;
    if (!out.empty() && out.back().second == spec.offset) out.back().second += spec.numel;
    else out.emplace_back(spec.offset, spec.offset + spec.numel);
  }
  return out;
}

}  // namespace loom
