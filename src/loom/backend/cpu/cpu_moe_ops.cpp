// CPU kernels of the mixture-of-experts ops (contracts in backend.h; the routing, the losses and
// the layouts in nn/moe.h). Token loops run under a static schedule and each token's sums run in
// index order, so the results are the same bits for any thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "loom/backend/cpu/cpu_moe_ops.h"
#include "loom/backend/moe_checks.h"
#include "loom/core/error.h"

namespace loom::cpu {

namespace {

// At least n elements.
void expect_room(const Tensor& t, int64_t n, const char* op, const char* what) {
  LOOM_CHECK(t.numel() >= n, op, ": ", what, " is ", t.describe(), ", needs at least ", n, " elements");
}

// fn(t, j, r) for every kept choice (row r >= 0), tokens t under a static schedule, choices j in order.
template <typename Fn>
void for_kept(const int32_t* row, int64_t N, int64_t K, Fn&& fn) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      const int32_t r = row[t * K + j];
      if (r >= 0) fn(t, j, r);
    }
  }
}

}  // namespace

void moe_route(const Tensor& logits, const Tensor& bias, const Tensor& scores, const Tensor& expert_t,
               const Tensor& gates_t, const Tensor& scratch, const MoeRouting& r) {
  const char* op = "moe_route";
  const int64_t N = checks::check_moe_route(logits, bias, scores, expert_t, gates_t, scratch, r);
  const int64_t E = r.experts, K = r.top_k, G = r.groups, per_group = E / G;
  expect_room(scratch, omp_get_max_threads() * (E + 2 * G), op, "scratch");
  const float* u = logits.data<float>();
  float* sc = scores.data<float>();
  const float* b = bias.data<float>();
  int32_t* expert = expert_t.data<int32_t>();
  float* gates = gates_t.data<float>();
  float* const select = scratch.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    const float* ut = u + t * E;
    float* st = sc + t * E;
    if (r.sigmoid) {
      for (int64_t e = 0; e < E; ++e) st[e] = 1.0f / (1.0f + std::exp(-ut[e]));
    } else {
      const float m = *std::max_element(ut, ut + E);
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(ut[e] - m));
      for (int64_t e = 0; e < E; ++e) st[e] = static_cast<float>(std::exp(static_cast<double>(ut[e] - m)) / sum);
    }
    // Selection scores: s + b; experts outside the chosen groups and already chosen are out.
    float* sel = select + omp_get_thread_num() * (E + 2 * G);
    for (int64_t e = 0; e < E; ++e) sel[e] = st[e] + b[e];
    constexpr float kOut = -std::numeric_limits<float>::infinity();
    if (G > 1) {
      float* group_score = sel + E;
      for (int64_t g = 0; g < G; ++g) {  // the sum of the group's two best selection scores
        float a = kOut, c = kOut;
        for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
          if (sel[e] > a) c = a, a = sel[e];
          else if (sel[e] > c) c = sel[e];
        }
        group_score[g] = per_group > 1 ? a + c : a;
      }
      float* keep = sel + E + G;  // 1: the group is kept
      std::fill(keep, keep + G, 0.0f);
      for (int64_t n = 0; n < r.topk_groups; ++n) {
        int64_t best = -1;
        for (int64_t g = 0; g < G; ++g) {
          if (keep[g] == 0.0f && (best < 0 || group_score[g] > group_score[best])) best = g;
        }
        keep[best] = 1.0f;
      }
      for (int64_t e = 0; e < E; ++e) {
        if (keep[e / per_group] == 0.0f) sel[e] = kOut;
      }
    }
    double sum_sel = 0.0;
    for (int64_t j = 0; j < K; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (sel[e] == kOut) continue;
        if (best < 0 || sel[e] > sel[best]) best = e;
      }
      expert[t * K + j] = static_cast<int32_t>(best);
      sel[best] = kOut;
      sum_sel += st[best];
    }
    for (int64_t j = 0; j < K; ++j) {  // gates from the unbiased scores
      const double g = st[expert[t * K + j]] / (r.renorm ? sum_sel : 1.0);
      gates[t * K + j] = static_cast<float>(g * r.route_scale);
    }
  }
}

void moe_assign(const Tensor& expert_t, int64_t capacity, const Tensor& row_t, const Tensor& token_t,
                const Tensor& counts) {
  const char* op = "moe_assign";
  const checks::MoeAssignDims d = checks::check_moe_assign(expert_t, capacity, row_t, token_t, counts);
  const int64_t E = d.E, N = d.N, K = d.K;
  const int32_t* expert = expert_t.data<int32_t>();
  int32_t* row = row_t.data<int32_t>();
  int32_t* token = token_t.data<int32_t>();
  int32_t* load = counts.data<int32_t>();
  int32_t* kept = load + E;
  int32_t* offsets = kept + E;
  std::fill(load, load + 3 * E + 1, 0);
  for (int64_t a = 0; a < N * K; ++a) {
    LOOM_CHECK(expert[a] >= 0 && expert[a] < E, op, ": expert ", expert[a], " outside [0, ", E, ")");
    ++load[expert[a]];
  }
  // Priority order is (choice j, token t).
  for (int64_t j = 0; j < K; ++j) {
    for (int64_t t = 0; t < N; ++t) {
      const int32_t e = expert[t * K + j];
      row[t * K + j] = kept[e] < capacity ? kept[e]++ : -1;  // rank within its expert for now
    }
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + kept[e];
  expect_room(token_t, offsets[E], op, "token");
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      int32_t& r = row[t * K + j];
      if (r < 0) continue;
      r += offsets[expert[t * K + j]];
      token[r] = static_cast<int32_t>(t);
    }
  }
}

void moe_dispatch(const Tensor& x, const Tensor& token_t, const Tensor& rows) {
  const char* op = "moe_dispatch";
  const checks::MoeDispatchDims d = checks::check_moe_dispatch(x, token_t, rows);
  const int64_t R = d.R, C = d.C, N = d.N;
  const int32_t* token = token_t.data<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    LOOM_CHECK(token[r] >= 0 && token[r] < N, op, ": token ", token[r], " outside [0, ", N, ")");
  }
  const float* xs = x.data<float>();
  float* xe = rows.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) std::memcpy(xe + r * C, xs + token[r] * C, static_cast<size_t>(C) * sizeof(float));
}

void moe_combine(const Tensor& rows, const Tensor& row_t, const Tensor& gates_t, const Tensor& out) {
  const checks::MoeCombineDims d = checks::check_moe_combine(rows, row_t, gates_t, out);
  const int64_t N = d.N, C = d.C, K = d.K;
  const int32_t* row = row_t.data<int32_t>();
  const float* ye = rows.data<float>();
  float* ys = out.data<float>();
  if (gates_t.defined()) {
    const float* gates = gates_t.data<float>();
    for_kept(row, N, K, [&](int64_t t, int64_t j, int32_t r) {
      const float g = gates[t * K + j];
      for (int64_t i = 0; i < C; ++i) ys[t * C + i] += g * ye[r * C + i];
    });
  } else {
    for_kept(row, N, K, [&](int64_t t, int64_t, int32_t r) {
      for (int64_t i = 0; i < C; ++i) ys[t * C + i] += ye[r * C + i];
    });
  }
}

void moe_combine_backward(const Tensor& dout, const Tensor& row_t, const Tensor& gates_t, const Tensor& drows) {
  const checks::MoeCombineDims d = checks::check_moe_combine_backward(dout, row_t, gates_t, drows);
  const int64_t N = d.N, C = d.C, K = d.K;
  const int32_t* row = row_t.data<int32_t>();
  const float* gates = gates_t.data<float>();
  const float* dys = dout.data<float>();
  float* dye = drows.data<float>();
  for_kept(row, N, K, [&](int64_t t, int64_t j, int32_t r) {
    const float gt = gates[t * K + j];
    for (int64_t i = 0; i < C; ++i) dye[r * C + i] = gt * dys[t * C + i];
  });
}

void moe_balance_stats(const Tensor& logits, const Tensor& scores, const Tensor& expert_t, const Tensor& counts,
                       const Tensor& stats, const Tensor& scratch, const MoeRouting& r) {
  const char* op = "moe_balance_stats";
  const int64_t N = checks::check_moe_balance_stats(logits, scores, expert_t, counts, stats, scratch, r);
  const int64_t E = r.experts, K = r.top_k, T = r.seq_len, B = N / T;
  expect_room(scratch, 3 * E, op, "scratch");
  const float* u = logits.data<float>();
  const float* sc = scores.data<float>();
  const int32_t* expert = expert_t.data<int32_t>();
  const int32_t* load = counts.data<int32_t>();
  double* P = scratch.data<double>();
  double* Pb = P + E;
  double* fb = Pb + E;
  std::fill(P, P + E, 0.0);
  double z = 0.0, entropy = 0.0, seq_aux = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    std::fill(Pb, Pb + E, 0.0);
    std::fill(fb, fb + E, 0.0);
    for (int64_t t = b * T; t < (b + 1) * T; ++t) {
      const float* st = sc + t * E;
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) sum += st[e];
      for (int64_t e = 0; e < E; ++e) {
        const double q = st[e] / sum;
        Pb[e] += q;
        if (q > 0.0) entropy -= q * std::log(q);
      }
      const float* ut = u + t * E;
      const float m = *std::max_element(ut, ut + E);
      double se = 0.0;
      for (int64_t e = 0; e < E; ++e) se += std::exp(static_cast<double>(ut[e] - m));
      const double lse = m + std::log(se);
      z += lse * lse;
      for (int64_t j = 0; j < K; ++j) fb[expert[t * K + j]] += 1.0;
    }
    double lb = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      P[e] += Pb[e];
      lb += (static_cast<double>(E) / static_cast<double>(K * T) * fb[e]) * (Pb[e] / static_cast<double>(T));
    }
    seq_aux += r.seq_aux_alpha * lb / static_cast<double>(B);
  }
  double aux = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    aux += static_cast<double>(load[e]) / static_cast<double>(K * N) * P[e] / static_cast<double>(N);
  }
  double* o = stats.data<double>();
  o[0] = r.aux_alpha * static_cast<double>(E) * aux;
  o[1] = seq_aux;
  o[2] = r.z_alpha * z / static_cast<double>(N);
  o[3] = entropy / static_cast<double>(N);
}

void moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& expert_t, const Tensor& row_t,
                         const Tensor& ye_t, const Tensor& dy, const Tensor& counts, const Tensor& dlogits,
                         const Tensor& scratch, const MoeRouting& r) {
  const char* op = "moe_router_backward";
  const checks::MoeRouterBackwardDims dims =
      checks::check_moe_router_backward(logits, scores, expert_t, row_t, ye_t, dy, counts, dlogits, scratch, r);
  const int64_t N = dims.N, E = r.experts, K = r.top_k, T = r.seq_len, B = N / T, C = dims.C;
  expect_room(scratch, (1 + B + omp_get_max_threads()) * E, op, "scratch");
  const float* u = logits.data<float>();
  const float* sc = scores.data<float>();
  const int32_t* expert = expert_t.data<int32_t>();
  const int32_t* row = row_t.data<int32_t>();
  const int32_t* load = counts.data<int32_t>();
  const float* ye = ye_t.data<float>();
  const float* dys = dy.data<float>();
  // The balance losses' d/dq_ti coefficients (q = s / sum s): c_i for every token (Switch), and
  // per sequence (DeepSeek-V3), times loss_weight.
  double* c_aux = scratch.data<double>();
  double* c_seq = c_aux + E;
  std::fill(c_aux, c_aux + E + B * E, 0.0);
  for (int64_t e = 0; e < E; ++e) {
    const double f = static_cast<double>(load[e]) / static_cast<double>(K * N);
    c_aux[e] = r.loss_weight * r.aux_alpha * static_cast<double>(E) * f / static_cast<double>(N);
  }
  if (r.seq_aux_alpha > 0.0f) {
    for (int64_t t = 0; t < N; ++t) {
      for (int64_t j = 0; j < K; ++j) c_seq[(t / T) * E + expert[t * K + j]] += 1.0;
    }
    for (int64_t i = 0; i < B * E; ++i) {  // f_i = E/(k T) count; dL/dq = alpha' f_i / (T B)
      double& v = c_seq[i];
      v = r.loss_weight * r.seq_aux_alpha * static_cast<double>(E) / static_cast<double>(K * T) * v /
          static_cast<double>(T * B);
    }
  }
  const bool any_aux = r.aux_alpha > 0.0f || r.seq_aux_alpha > 0.0f;
  const double z_coeff = r.loss_weight * r.z_alpha * 2.0 / static_cast<double>(N);
  float* du = dlogits.data<float>();
  double* const dscores = c_seq + B * E;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    const float* st = sc + t * E;
    double* ds = dscores + omp_get_thread_num() * E;
    std::fill(ds, ds + E, 0.0);
    // Gates: dg_j = dy_t . ye[row]; g_j = scale s_ij / S (renorm) or scale s_ij.
    double dg[64];  // K <= 64 (checked)
    double S = 0.0, dgs = 0.0;
    for (int64_t j = 0; j < K; ++j) {
      const int32_t rr = row[t * K + j];
      double d = 0.0;
      if (rr >= 0) {
        for (int64_t i = 0; i < C; ++i) d += static_cast<double>(dys[t * C + i]) * ye[rr * C + i];
      }
      dg[j] = d;
      S += st[expert[t * K + j]];
      dgs += d * st[expert[t * K + j]];
    }
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = expert[t * K + j];
      ds[e] += r.renorm ? r.route_scale * (dg[j] / S - dgs / (S * S)) : r.route_scale * dg[j];
    }
    if (any_aux) {
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) sum += st[e];
      const double* cs = c_seq + (t / T) * E;
      double cq = 0.0;
      for (int64_t e = 0; e < E; ++e) cq += (c_aux[e] + cs[e]) * st[e] / sum;
      for (int64_t e = 0; e < E; ++e) ds[e] += (c_aux[e] + cs[e] - cq) / sum;
    }
    // Scores -> logits, then the z-loss.
    float* dut = du + t * E;
    if (r.sigmoid) {
      for (int64_t e = 0; e < E; ++e) dut[e] = static_cast<float>(ds[e] * st[e] * (1.0 - st[e]));
    } else {
      double dot = 0.0;
      for (int64_t e = 0; e < E; ++e) dot += ds[e] * st[e];
      for (int64_t e = 0; e < E; ++e) dut[e] = static_cast<float>(st[e] * (ds[e] - dot));
    }
    if (r.z_alpha > 0.0f) {
      const float* ut = u + t * E;
      const float m = *std::max_element(ut, ut + E);
      double se = 0.0;
      for (int64_t e = 0; e < E; ++e) se += std::exp(static_cast<double>(ut[e] - m));
      const double lse = m + std::log(se);
      for (int64_t e = 0; e < E; ++e) {
        dut[e] += static_cast<float>(z_coeff * lse * std::exp(static_cast<double>(ut[e]) - lse));
      }
    }
  }
}

}  // namespace loom::cpu
