#include "loom/nn/moe.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "loom/core/error.h"
#include "loom/nn/linear.h"

namespace loom {

namespace {
Tensor view_of(const ParamLayout& layout, const Tensor& flat, const std::string& name) {
  const ParamSpec& spec = layout.find(name);
  return flat.view(spec.offset, spec.shape);
}

// Expert activation over rows: GELU on (n, F) or the gated activation on (n, 2F) -> (n, F).
void activation_forward(Backend& backend, const ModelConfig& c, const Tensor& h, const Tensor& act) {
  if (c.gated_mlp()) backend.glu_forward(h, act, c.gate_activation);
  else backend.gelu_forward(h, act);
}
void activation_backward(Backend& backend, const ModelConfig& c, const Tensor& h, const Tensor& dact, const Tensor& dh) {
  if (c.gated_mlp()) backend.glu_backward(h, dact, dh, c.gate_activation);
  else backend.gelu_backward(h, dact, dh);
}
}  // namespace

MoeParams moe_params_view(const ModelConfig& c, const ParamLayout& layout, const Tensor& flat, int64_t layer) {
  MoeParams p;
  if (!c.moe_layer(layer)) return p;
  const bool llama = c.gated_mlp();
  const std::string pre = (llama ? "model.layers." : "h.") + std::to_string(layer) + ".";
  auto v = [&](const std::string& name) { return view_of(layout, flat, pre + name); };
  p.router_w = v(llama ? "mlp.gate.weight" : "mlp.router.weight");
  if (c.moe_router_bias) p.router_b = v("mlp.gate.bias");
  p.bias = v(llama ? "mlp.gate.e_score_correction_bias" : "mlp.router.bias_correction");
  for (int64_t e = 0; e < c.moe_experts; ++e) {
    const std::string x = "mlp.experts." + std::to_string(e) + ".";
    p.fc_w.push_back(v(x + (llama ? "gate_up_proj.weight" : "c_fc.weight")));
    p.fc2_w.push_back(v(x + (llama ? "down_proj.weight" : "c_proj.weight")));
    if (c.moe_expert_bias) p.fc_b.push_back(v(x + "gate_up_proj.bias")), p.fc2_b.push_back(v(x + "down_proj.bias"));
  }
  if (c.moe_shared > 0) {
    p.shared_fc_w = v(llama ? "mlp.shared_experts.gate_up_proj.weight" : "mlp.shared_experts.c_fc.weight");
    p.shared_fc2_w = v(llama ? "mlp.shared_experts.down_proj.weight" : "mlp.shared_experts.c_proj.weight");
    if (c.moe_shared_gate) p.shared_gate_w = v("mlp.shared_expert_gate.weight");
  }
  return p;
}

int64_t moe_capacity(const ModelConfig& c, int64_t tokens) {
  if (c.moe_capacity_factor <= 0.0f) return c.moe_top_k * tokens;
  // ceil(k N / E x CF), in double so that an exact product is not rounded up.
  const double exact = static_cast<double>(c.moe_top_k * tokens) / static_cast<double>(c.moe_experts) *
                       static_cast<double>(c.moe_capacity_factor);
  return static_cast<int64_t>(std::ceil(exact - 1e-9));
}

int64_t moe_max_rows(const ModelConfig& c, int64_t tokens) {
  const int64_t all = c.moe_top_k * tokens;
  return c.moe_capacity_factor > 0.0f ? std::min(all, c.moe_experts * moe_capacity(c, tokens)) : all;
}

namespace {
// The shared experts' first GEMM output width and hidden width.
std::pair<int64_t, int64_t> shared_widths(const ModelConfig& c) {
  const int64_t S = c.moe_shared * c.expert_ff();
  return {c.gated_mlp() ? 2 * S : S, S};
}
}  // namespace

namespace {
struct MoeField {
  Tensor MoeSaved::*field;
  Shape shape;
  DType dtype;
};
// The fields allocate_moe_saved allocates, in order.
std::vector<MoeField> moe_saved_fields(const ModelConfig& c, int64_t N, int ep) {
  const int64_t E = c.moe_experts, K = c.moe_top_k, R = moe_max_rows(c, N), C = c.d_model, Rx = R * ep;
  std::vector<MoeField> f = {
      {&MoeSaved::logits, {N, E}, DTYPE_F32},  {&MoeSaved::scores, {N, E}, DTYPE_F32},
      {&MoeSaved::expert, {N, K}, DTYPE_I32},  {&MoeSaved::gates, {N, K}, DTYPE_F32},
      {&MoeSaved::row, {N, K}, DTYPE_I32},     {&MoeSaved::token, {R}, DTYPE_I32},
      {&MoeSaved::counts, {3 * E + 1}, DTYPE_I32},
      {&MoeSaved::h, {Rx, c.expert_in_width()}, DTYPE_F32}, {&MoeSaved::act, {Rx, c.expert_ff()}, DTYPE_F32},
      {&MoeSaved::ye, {R, C}, DTYPE_F32}};
  if (ep > 1) f.push_back({&MoeSaved::xp, {Rx, C}, DTYPE_F32});
  if (c.moe_shared > 0) {
    const auto [in, hidden] = shared_widths(c);
    f.push_back({&MoeSaved::shared_fc, {N, in}, DTYPE_F32});
    f.push_back({&MoeSaved::shared_act, {N, hidden}, DTYPE_F32});
    if (c.moe_shared_gate) f.push_back({&MoeSaved::shared_gate, {N, 2 * C}, DTYPE_F32});
  }
  return f;
}

// model.moe_shared_gate: l = x w^T (N, 1) broadcast over the C columns by a GEMM with ones (C, 1),
// so that the glu op computes sigmoid(l) * shared on the rows [l ... l | shared].
Tensor shared_gate_logits(Backend& backend, const MoeParams& p, const Tensor& x, Tensor* broadcast) {
  Allocator& a = backend.allocator();
  const int64_t N = x.dim(0), C = x.dim(1);
  const Tensor logit = Tensor::empty(a, {N, 1}, DTYPE_F32, MEM_WORKSPACE);
  linear_forward(backend, x, p.shared_gate_w, Tensor{}, logit);
  if (broadcast != nullptr) {
    const Tensor ones = Tensor::empty(a, {C, 1}, DTYPE_F32, MEM_WORKSPACE);
    backend.fill(ones, 1.0);
    *broadcast = Tensor::empty(a, {N, C}, DTYPE_F32, MEM_WORKSPACE);
    linear_forward(backend, logit, ones, Tensor{}, *broadcast);
  }
  return logit;
}

// y += sigmoid(x w^T) * shared (shared: the shared experts' output, (N, C)); keeps [l | shared] in ga.
void shared_gate_forward(Backend& backend, const MoeParams& p, const Tensor& x, const Tensor& shared, const Tensor& ga,
                         const Tensor& y) {
  Tensor broadcast;
  shared_gate_logits(backend, p, x, &broadcast);
  copy_columns(backend, ga, 0, broadcast, true);
  copy_columns(backend, ga, x.dim(1), shared, true);
  const Tensor gated = Tensor::empty(backend.allocator(), shared.shape(), DTYPE_F32, MEM_WORKSPACE);
  backend.glu_forward(ga, gated, GateActivation::sigmoid);
  backend.add_inplace(y, gated);
}

// From dy: d(shared) (N, C) written, the gate's weight gradient accumulated, its d(x) added to dx.
void shared_gate_backward(Backend& backend, const MoeParams& p, const MoeParams& g, const Tensor& x, const Tensor& ga,
                          const Tensor& dy, const Tensor& d_shared, const Tensor& dx) {
  Allocator& a = backend.allocator();
  const int64_t N = x.dim(0), C = x.dim(1);
  const auto ws = [&](Shape dims) { return Tensor::empty(a, std::move(dims), DTYPE_F32, MEM_WORKSPACE); };
  const Tensor d_ga = ws({N, 2 * C}), d_broadcast = ws({N, C}), d_logit = ws({N, 1}), ones = ws({C, 1}), sink = ws({C, 1});
  const Tensor dxg = ws({N, C});
  backend.glu_backward(ga, dy, d_ga, GateActivation::sigmoid);
  copy_columns(backend, d_ga, C, d_shared, false);
  copy_columns(backend, d_ga, 0, d_broadcast, false);
  backend.fill(ones, 1.0);
  backend.fill(sink, 0.0);
  linear_backward(backend, shared_gate_logits(backend, p, x, nullptr), ones, d_broadcast, d_logit, sink, Tensor{});
  linear_backward(backend, x, p.shared_gate_w, d_logit, dxg, g.shared_gate_w, Tensor{});
  backend.add_inplace(dx, dxg);
}
}  // namespace

MoeSaved allocate_moe_saved(Allocator& allocator, const ModelConfig& c, int64_t N, int ep) {
  MoeSaved s;
  for (auto& f : moe_saved_fields(c, N, ep)) s.*f.field = Tensor::empty(allocator, std::move(f.shape), f.dtype, MEM_ACTIVATIONS);
  const size_t E = static_cast<size_t>(c.moe_experts);
  s.offsets.reserve(E + 1), s.load.reserve(E), s.recv_rows.reserve(E);
  return s;
}

int64_t moe_saved_bytes(const ModelConfig& c, int64_t N, int ep) {
  int64_t bytes = 0;
  for (const MoeField& f : moe_saved_fields(c, N, ep)) {
    int64_t n = static_cast<int64_t>(dtype_size(f.dtype));
    for (int64_t d : f.shape) n *= d;
    bytes += n;
  }
  return bytes;
}

MoeScratch allocate_moe_scratch(Allocator& allocator, const ModelConfig& c, int64_t N, int ep) {
  const int64_t R = moe_max_rows(c, N), C = c.d_model, Rx = R * ep;
  auto ws = [&](Shape shape) { return Tensor::empty(allocator, std::move(shape), DTYPE_F32, MEM_WORKSPACE); };
  MoeScratch k;
  k.xe = ws({R, C});
  k.dye = ws({R, C});
  k.dh = ws({Rx, c.expert_in_width()});
  k.dact = ws({Rx, c.expert_ff()});
  k.ds = ws({N, c.moe_experts});
  k.dx = ws({N, C});
  const int64_t E = c.moe_experts, threads = omp_get_max_threads();
  k.route = ws({threads * (E + 2 * c.moe_groups)});
  k.stats = Tensor::empty(allocator, {4}, DTYPE_F64, MEM_WORKSPACE);
  k.sums = Tensor::empty(allocator, {(1 + N + threads) * E}, DTYPE_F64, MEM_WORKSPACE);
  if (ep > 1) {
    k.recv = Tensor::empty(allocator, {Rx, C}, DTYPE_F32, MEM_COMMUNICATION);
    k.yp = ws({Rx, C});
    k.counts_out = Tensor::empty(allocator, {c.moe_experts}, DTYPE_I32, MEM_COMMUNICATION);
    k.counts_in = Tensor::empty(allocator, {c.moe_experts}, DTYPE_I32, MEM_COMMUNICATION);
  }
  if (c.moe_shared > 0) {
    const auto [in, hidden] = shared_widths(c);
    k.shared_dfc = ws({N, in});
    k.shared_dact = ws({N, hidden});
  }
  return k;
}

namespace {
// v with at least n elements (grown only when smaller: reused scratch).
template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
  return v.data();
}

// Experts [first, first + offsets.size() - 1) on rows x (grouped by expert: expert first + i's
// rows [offsets[i], offsets[i + 1])): h = x W1^T, act, y = act W2^T.
// Expert e's bias (model.moe_expert_bias), or none.
Tensor expert_bias(const std::vector<Tensor>& biases, int64_t e) {
  return biases.empty() ? Tensor{} : biases[static_cast<size_t>(e)];
}

void experts_forward(Backend& backend, const ModelConfig& c, const MoeParams& p, int64_t first,
                     const std::vector<int64_t>& offsets, const Tensor& x, const Tensor& h, const Tensor& act,
                     const Tensor& y) {
  const int64_t C = c.d_model, Fin = c.expert_in_width(), F = c.expert_ff();
  for (size_t i = 0; i + 1 < offsets.size(); ++i) {
    const int64_t o = offsets[i], n = offsets[i + 1] - o, e = first + static_cast<int64_t>(i);
    if (n == 0) continue;
    const Tensor hv = h.view(o * Fin, {n, Fin}), av = act.view(o * F, {n, F});
    linear_forward(backend, x.view(o * C, {n, C}), p.fc_w[e], expert_bias(p.fc_b, e), hv);
    activation_forward(backend, c, hv, av);
    linear_forward(backend, av, p.fc2_w[e], expert_bias(p.fc2_b, e), y.view(o * C, {n, C}));
  }
}

// Their backward: d holds the rows' output gradients on entry and their input gradients on exit.
void experts_backward(Backend& backend, const ModelConfig& c, const MoeParams& p, const MoeParams& g, int64_t first,
                      const std::vector<int64_t>& offsets, const Tensor& x, const Tensor& h, const Tensor& act,
                      const Tensor& d, MoeScratch& k) {
  const int64_t C = c.d_model, Fin = c.expert_in_width(), F = c.expert_ff();
  for (size_t i = 0; i + 1 < offsets.size(); ++i) {
    const int64_t o = offsets[i], n = offsets[i + 1] - o, e = first + static_cast<int64_t>(i);
    if (n == 0) continue;
    const Tensor dact = k.dact.view(o * F, {n, F}), dh = k.dh.view(o * Fin, {n, Fin}), dv = d.view(o * C, {n, C});
    linear_backward(backend, act.view(o * F, {n, F}), p.fc2_w[e], dv, dact, g.fc2_w[e], expert_bias(g.fc2_b, e));
    activation_backward(backend, c, h.view(o * Fin, {n, Fin}), dact, dh);
    linear_backward(backend, x.view(o * C, {n, C}), p.fc_w[e], dh, dv, g.fc_w[e], expert_bias(g.fc_b, e));
  }
}

// Expert parallel: the received rows' order. Source-major (as the all-to-all-v delivers them:
// source s's rows for local expert 0, 1, ...) <-> expert-major (local expert l's rows from source
// 0, 1, ...), moving C floats per row. Leaves the expert-major offsets of the local experts in
// k.eoff.
void permute_received(Backend& backend, const std::vector<int64_t>& recv_rows, int64_t P, int64_t El, int64_t C,
                      const Tensor& source_major, const Tensor& expert_major, bool to_expert_major, MoeScratch& k) {
  std::vector<int64_t>& eoff = k.eoff;
  eoff.assign(static_cast<size_t>(El + 1), 0);
  for (int64_t l = 0; l < El; ++l) {
    eoff[l + 1] = eoff[l];
    for (int64_t src = 0; src < P; ++src) eoff[l + 1] += recv_rows[src * El + l];
  }
  int64_t so = 0;
  std::vector<int64_t>& cursor = k.cursor;
  cursor.assign(eoff.begin(), eoff.end() - 1);
  for (int64_t src = 0; src < P; ++src) {
    for (int64_t l = 0; l < El; ++l) {
      const int64_t n = recv_rows[src * El + l];
      if (n > 0) {
        const Tensor sm = source_major.view(so * C, {n, C}), em = expert_major.view(cursor[l] * C, {n, C});
        if (to_expert_major) backend.copy(sm, em);
        else backend.copy(em, sm);
      }
      cursor[l] += n, so += n;
    }
  }
}

// Rows per rank (x C elements) of rows grouped by the global expert order, El experts per rank.
void rank_counts(const std::vector<int64_t>& offsets, int64_t P, int64_t El, int64_t C, std::vector<int64_t>& out) {
  out.assign(static_cast<size_t>(P), 0);
  for (int64_t r = 0; r < P; ++r) out[r] = (offsets[(r + 1) * El] - offsets[r * El]) * C;
}
void source_counts(const std::vector<int64_t>& recv_rows, int64_t P, int64_t El, int64_t C, std::vector<int64_t>& out) {
  out.assign(static_cast<size_t>(P), 0);
  for (int64_t r = 0; r < P; ++r) {
    for (int64_t l = 0; l < El; ++l) out[r] += recv_rows[r * El + l] * C;
  }
}
// Expert parallel round trip: `rows` (R rows grouped by global expert) to their experts' ranks,
// arranged by local expert into `into`; compute(offsets of the local experts) leaves its results
// in `out` (same arrangement), which go back to the rows' ranks into `back` (R rows).
template <typename Compute>
void expert_round_trip(Backend& backend, Communicator& ep, const MoeSaved& s, MoeScratch& k, int64_t E, int64_t C,
                       const Tensor& rows, const Tensor& into, const Tensor& out, const Tensor& back, Compute&& compute) {
  const int64_t P = ep.size(), El = E / P, R = s.offsets[E];
  std::vector<int64_t>& sent = k.sent;
  std::vector<int64_t>& got = k.got;
  rank_counts(s.offsets, P, El, C, sent);
  source_counts(s.recv_rows, P, El, C, got);
  int64_t received = 0;
  for (int64_t n : got) received += n;
  const Tensor recv = k.recv.view(0, {received / C, C});
  ep.all_to_all_v_async(rows.view(0, {R * C}), sent, recv.view(0, {received}), got)->wait();
  permute_received(backend, s.recv_rows, P, El, C, recv, into, true, k);
  compute(static_cast<const std::vector<int64_t>&>(k.eoff));
  permute_received(backend, s.recv_rows, P, El, C, recv, out, false, k);
  ep.all_to_all_v_async(recv.view(0, {received}), got, back.view(0, {R * C}), sent)->wait();
}
}  // namespace

RangeSet moe_expert_ranges(const ModelConfig& c, const ParamLayout& layout, int ep_rank, int ep_size, bool own) {
  std::vector<Range> out;
  if (c.moe_experts == 0 || ep_size <= 1) return {};
  const int64_t El = c.moe_experts / ep_size;
  for (const ParamSpec& spec : layout.params) {
    const size_t at = spec.name.find(".mlp.experts.");
    if (at == std::string::npos) continue;
    const int64_t e = std::stoll(spec.name.substr(at + 13));
    if ((e / El == ep_rank) != own) continue;
    out.push_back({spec.offset, spec.offset + spec.numel});
  }
  return RangeSet(std::move(out));
}

namespace {
// The router's configuration as the MoE ops read it.
MoeRouting routing_of(const ModelConfig& c, int64_t seq_len, float loss_weight = 1.0f) {
  MoeRouting r;
  r.experts = c.moe_experts, r.top_k = c.moe_top_k, r.groups = c.moe_groups, r.topk_groups = c.moe_topk_groups;
  r.sigmoid = c.moe_sigmoid, r.renorm = c.moe_renorm, r.route_scale = c.moe_route_scale;
  r.aux_alpha = c.moe_aux_alpha, r.seq_aux_alpha = c.moe_seq_aux_alpha, r.z_alpha = c.moe_z_alpha;
  r.seq_len = seq_len, r.loss_weight = loss_weight;
  return r;
}

// Backend::moe_assign's counts, read back: the loads, the experts' row offsets and the drops.
void read_counts(Backend& backend, MoeSaved& s, MoeScratch& k, int64_t E, int64_t assignments) {
  int32_t* h = at_least(k.counts_host, 3 * E + 1);
  backend.read(s.counts, h);
  s.load.assign(h, h + E);
  s.offsets.assign(h + 2 * E, h + 3 * E + 1);
  s.dropped = assignments - s.offsets[E];
}

// Expert parallel: every rank's row counts per expert to the experts' ranks (s.recv_rows), then
// the rows there and back, the local experts computing in between.
void experts_parallel_forward(Backend& backend, const ModelConfig& c, const MoeParams& p, MoeSaved& s, MoeScratch& k,
                              Communicator& ep) {
  const int64_t E = c.moe_experts, C = c.d_model, P = ep.size(), El = E / P;
  LOOM_CHECK(E % P == 0, "expert parallel: parallel.ep = ", P, " must divide model.moe_experts = ", E);
  int32_t* co = at_least(k.counts_host, 3 * E + 1);
  for (int64_t e = 0; e < E; ++e) co[e] = static_cast<int32_t>(s.offsets[e + 1] - s.offsets[e]);
  backend.write(k.counts_out, co);
  ep.all_to_all(k.counts_out, k.counts_in);  // chunk r: rank r's rows for each of this rank's experts
  backend.read(k.counts_in, co);
  s.recv_rows.assign(co, co + E);
  s.dispatched = s.offsets[E] - (s.offsets[(ep.rank() + 1) * El] - s.offsets[ep.rank() * El]);
  expert_round_trip(backend, ep, s, k, E, C, k.xe, s.xp, k.yp, s.ye, [&](const std::vector<int64_t>& eoff) {
    experts_forward(backend, c, p, ep.rank() * El, eoff, s.xp, s.h, s.act, k.yp);
  });
}
}  // namespace

void moe_forward(Backend& backend, const ModelConfig& c, const MoeParams& p, const Tensor& x, MoeSaved& s,
                 MoeScratch& k, const Tensor& y, int64_t seq_len, Communicator* ep) {
  const int64_t N = x.dim(0), C = c.d_model, E = c.moe_experts, K = c.moe_top_k;
  LOOM_CHECK(x.dim(1) == C && y.dim(0) == N && s.logits.dim(0) >= N && seq_len > 0 && N % seq_len == 0,
             "moe_forward: x ", x.describe(), ", y ", y.describe(), " for ", s.logits.dim(0), " tokens of sequences of ",
             seq_len);
  s.tokens = N;
  s.dispatched = 0;
  const Tensor logits = s.logits.view(0, {N, E}), scores = s.scores.view(0, {N, E});
  const Tensor expert = s.expert.view(0, {N, K}), gates = s.gates.view(0, {N, K}), row = s.row.view(0, {N, K});
  const MoeRouting routing = routing_of(c, seq_len);
  linear_forward(backend, x, p.router_w, p.router_b, logits);
  backend.moe_route(logits, p.bias, scores, expert, gates, k.route, routing);
  // Loads, capacity and the expert rows: priority order is (choice j, token t).
  backend.moe_assign(expert, moe_capacity(c, N), row, s.token, s.counts);
  read_counts(backend, s, k, E, N * K);
  // Experts: gather their rows (grouped by expert), two GEMMs and the activation each.
  const int64_t R = s.offsets[E];
  if (R > 0) backend.moe_dispatch(x, s.token.view(0, {R}), k.xe.view(0, {R, C}));
  if (ep == nullptr || ep->size() == 1) {
    experts_forward(backend, c, p, 0, s.offsets, k.xe, s.h, s.act, s.ye);
  } else {  // dispatch each expert's rows to its rank, run the local experts, send the outputs back
    experts_parallel_forward(backend, c, p, s, k, *ep);
  }
  // Combine: y_t += sum over kept choices of g_j ye[row] (per token: deterministic).
  backend.moe_combine(s.ye, row, gates, y);
  if (c.moe_shared > 0) {
    linear_forward(backend, x, p.shared_fc_w, Tensor{}, s.shared_fc.view(0, {N, s.shared_fc.dim(1)}));
    const Tensor sa = s.shared_act.view(0, {N, s.shared_act.dim(1)});
    activation_forward(backend, c, s.shared_fc.view(0, {N, s.shared_fc.dim(1)}), sa);
    if (c.moe_shared_gate) {
      const Tensor shared = Tensor::empty(backend.allocator(), {N, C}, DTYPE_F32, MEM_WORKSPACE);
      linear_forward(backend, sa, p.shared_fc2_w, Tensor{}, shared);
      shared_gate_forward(backend, p, x, shared, s.shared_gate.view(0, {N, 2 * C}), y);
    } else {
      linear_forward(backend, sa, p.shared_fc2_w, Tensor{}, y, 1.0f);
    }
  }
  // The losses' values and the router entropy (q = s / sum s).
  backend.moe_balance_stats(logits, scores, expert, s.counts, k.stats, k.sums, routing);
  double stats[4];
  backend.read(k.stats, stats);
  s.aux = stats[0], s.seq_aux = stats[1], s.z = stats[2], s.entropy = stats[3];
}

void moe_backward(Backend& backend, const ModelConfig& c, const MoeParams& p, const MoeParams& g, const Tensor& x,
                  const MoeSaved& s, MoeScratch& k, const Tensor& dy, const Tensor& dx, float loss_weight,
                  int64_t seq_len, Communicator* ep) {
  const int64_t N = s.tokens, C = c.d_model, E = c.moe_experts, K = c.moe_top_k;
  LOOM_CHECK(x.dim(0) == N && dy.dim(0) == N && dx.dim(0) == N, "moe_backward: ", N, " tokens, got x ", x.describe(),
             ", dy ", dy.describe(), ", dx ", dx.describe());
  const Tensor expert = s.expert.view(0, {N, K}), gates = s.gates.view(0, {N, K}), row = s.row.view(0, {N, K});
  // The gates' and the balance losses' gradients through the scores to the router's logits.
  backend.moe_router_backward(s.logits.view(0, {N, E}), s.scores.view(0, {N, E}), expert, row, s.ye, dy, s.counts,
                              k.ds.view(0, {N, E}), k.sums, routing_of(c, seq_len, loss_weight));
  // Router: dx = du Wr (overwrites dx), dWr += du^T x.
  linear_backward(backend, x, p.router_w, k.ds.view(0, {N, E}), dx, g.router_w, g.router_b);
  if (c.moe_shared > 0) {
    const int64_t Sin = s.shared_fc.dim(1), S = s.shared_act.dim(1);
    const Tensor dact = k.shared_dact.view(0, {N, S}), dfc = k.shared_dfc.view(0, {N, Sin}), dxs = k.dx.view(0, {N, C});
    Tensor d_shared = dy;
    if (c.moe_shared_gate) {
      d_shared = Tensor::empty(backend.allocator(), {N, C}, DTYPE_F32, MEM_WORKSPACE);
      shared_gate_backward(backend, p, g, x, s.shared_gate.view(0, {N, 2 * C}), dy, d_shared, dx);
    }
    linear_backward(backend, s.shared_act.view(0, {N, S}), p.shared_fc2_w, d_shared, dact, g.shared_fc2_w, Tensor{});
    activation_backward(backend, c, s.shared_fc.view(0, {N, Sin}), dact, dfc);
    linear_backward(backend, x, p.shared_fc_w, dfc, dxs, g.shared_fc_w, Tensor{});
    backend.add_inplace(dx, dxs);
  }
  // Experts: d(ye) = g dy per row; d(xe) lands in dye. Their inputs: here gathered again into xe
  // (the scratch other layers' forwards overwrote); expert parallel, saved (xp) by their owners.
  const bool local = ep == nullptr || ep->size() == 1;
  const int64_t R = s.offsets[E];
  backend.moe_combine_backward(dy, row, gates, k.dye);
  if (local && R > 0) backend.moe_dispatch(x, s.token.view(0, {R}), k.xe.view(0, {R, C}));
  if (local) {
    experts_backward(backend, c, p, g, 0, s.offsets, k.xe, s.h, s.act, k.dye, k);  // d(xe) lands in dye
  } else {  // the rows' output gradients to the experts' ranks, their input gradients back
    const int64_t El = E / ep->size();
    expert_round_trip(backend, *ep, s, k, E, C, k.dye, k.yp, k.yp, k.dye, [&](const std::vector<int64_t>& eoff) {
      experts_backward(backend, c, p, g, ep->rank() * El, eoff, s.xp, s.h, s.act, k.yp, k);
    });
  }
  backend.moe_combine(k.dye, row, Tensor{}, dx);  // dx_t += the input gradients of its rows
}

void moe_update_bias(Backend& backend, const Tensor& bias, const std::vector<double>& load, float gamma,
                     std::vector<float>& host) {
  const int64_t E = bias.numel();
  LOOM_CHECK(static_cast<int64_t>(load.size()) == E, "moe_update_bias: ", load.size(), " loads for ", E, " experts");
  double mean = 0.0;
  for (double l : load) mean += l;
  mean /= static_cast<double>(E);
  float* b = at_least(host, E);
  backend.read(bias, b);
  for (int64_t e = 0; e < E; ++e) {
    const double d = load[e] - mean;
    b[e] -= gamma * static_cast<float>((d > 0.0) - (d < 0.0));
  }
  backend.write(bias, b);
}

double moe_max_violation(const std::vector<double>& load) {
  if (load.empty()) return 0.0;
  double mean = 0.0, mx = 0.0;
  for (double l : load) mean += l, mx = std::max(mx, l);
  mean /= static_cast<double>(load.size());
  return mean > 0.0 ? mx / mean - 1.0 : 0.0;
}

}  // namespace loom
