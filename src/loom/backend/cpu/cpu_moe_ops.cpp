// CPU kernels of the mixture-of-experts ops (contracts in backend.h; the routing, the losses and
// the layouts in nn/moe.h). Token loops run under a static schedule and each token's sums run in
// index order, so the results are the same bits for any thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "loom/backend/checks.h"
#include "loom/backend/cpu/cpu_moe_ops.h"
#include "loom/core/error.h"

namespace loom::cpu {

using checks::expect_dtype;
using checks::expect_numel;
using checks::rows_of;

namespace {

void expect_f32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_F32, op, what); }
void expect_i32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_I32, op, what); }

// At least n elements.
void expect_room(const Tensor& t, int64_t n, const char* op, const char* what) {
  LOOM_CHECK(t.numel() >= n, op, ": ", what, " is ", t.describe(), ", needs at least ", n, " elements");
}

// (N, E) router logits and the routing's per-token operands: returns N.
int64_t check_router(const char* op, const Tensor& logits, const Tensor& scores, const Tensor& expert,
                     const MoeRouting& r) {
  LOOM_CHECK(r.experts >= 1 && r.top_k >= 1 && r.top_k <= std::min<int64_t>(r.experts, 64) && r.groups >= 1 &&
                 r.experts % r.groups == 0 && r.topk_groups >= 1 && r.topk_groups <= r.groups && r.seq_len >= 1,
             op, ": bad routing (", r.experts, " experts in ", r.groups, " groups, top ", r.top_k, " of the best ",
             r.topk_groups, " groups, sequences of ", r.seq_len, ")");
  expect_f32(logits, op, "logits");
  LOOM_CHECK(logits.dim(-1) == r.experts, op, ": logits ", logits.describe(), " for ", r.experts, " experts");
  const int64_t N = rows_of(logits);
  expect_f32(scores, op, "scores");
  expect_numel(scores, N * r.experts, op, "scores");
  expect_i32(expert, op, "expert");
  expect_numel(expert, N * r.top_k, op, "expert");
  return N;
}

// counts: moe_assign's (3E + 1) i32.
void check_counts(const char* op, const Tensor& counts, int64_t E) {
  expect_i32(counts, op, "counts");
  expect_numel(counts, 3 * E + 1, op, "counts");
}

// row (N, k) i32 and, when defined, gates shaped as row (f32); rows and out f32 of one width C.
void check_combine(const char* op, const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out) {
  expect_f32(rows, op, "rows");
  expect_f32(out, op, "out");
  expect_i32(row, op, "row");
  LOOM_CHECK(rows.dim(-1) == out.dim(-1) && rows_of(out) == rows_of(row), op, ": rows ", rows.describe(), ", row ",
             row.describe(), " and out ", out.describe(), " do not match (R, C), (N, k), (N, C)");
  if (gates.defined()) {
    expect_f32(gates, op, "gates");
    expect_numel(gates, row.numel(), op, "gates");
  }
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
  const int64_t N = check_router(op, logits, scores, expert_t, r);
  const int64_t E = r.experts, K = r.top_k, G = r.groups, per_group = E / G;
  expect_f32(bias, op, "bias");
  expect_numel(bias, E, op, "bias");
  expect_f32(gates_t, op, "gates");
  expect_numel(gates_t, N * K, op, "gates");
  expect_f32(scratch, op, "scratch");
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
  expect_i32(expert_t, op, "expert");
  expect_i32(row_t, op, "row");
  expect_i32(token_t, op, "token");
  expect_i32(counts, op, "counts");
  LOOM_CHECK(counts.numel() >= 4 && (counts.numel() - 1) % 3 == 0 && row_t.shape() == expert_t.shape() &&
                 expert_t.ndim() == 2 && capacity >= 0,
             op, ": expert ", expert_t.describe(), ", row ", row_t.describe(), ", counts ", counts.describe(),
             ", capacity ", capacity, ": expected (N, k), (N, k), (3E + 1), capacity >= 0");
  const int64_t E = (counts.numel() - 1) / 3, N = expert_t.dim(0), K = expert_t.dim(1);
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
  expect_f32(x, op, "x");
  expect_f32(rows, op, "rows");
  expect_i32(token_t, op, "token");
  const int64_t R = rows_of(rows), C = rows.dim(-1), N = rows_of(x);
  LOOM_CHECK(x.dim(-1) == C, op, ": x ", x.describe(), " and rows ", rows.describe(), " differ in width");
  expect_numel(token_t, R, op, "token");
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
  check_combine("moe_combine", rows, row_t, gates_t, out);
  const int64_t N = rows_of(out), C = out.dim(-1), K = row_t.dim(-1);
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
  const char* op = "moe_combine_backward";
  LOOM_CHECK(gates_t.defined(), op, ": needs the gates");
  check_combine(op, drows, row_t, gates_t, dout);
  const int64_t N = rows_of(dout), C = dout.dim(-1), K = row_t.dim(-1);
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
  const int64_t N = check_router(op, logits, scores, expert_t, r);
  const int64_t E = r.experts, K = r.top_k, T = r.seq_len, B = N / T;
  LOOM_CHECK(N % T == 0, op, ": ", N, " tokens are not sequences of ", T);
  check_counts(op, counts, E);
  expect_dtype(stats, DTYPE_F64, op, "stats");
  expect_numel(stats, 4, op, "stats");
  expect_dtype(scratch, DTYPE_F64, op, "scratch");
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
  const int64_t N = check_router(op, logits, scores, expert_t, r);
  const int64_t E = r.experts, K = r.top_k, T = r.seq_len, B = N / T, C = dy.dim(-1);
  LOOM_CHECK(N % T == 0, op, ": ", N, " tokens are not sequences of ", T);
  check_counts(op, counts, E);
  expect_i32(row_t, op, "row");
  expect_numel(row_t, N * K, op, "row");
  expect_f32(ye_t, op, "ye");
  expect_f32(dy, op, "dy");
  expect_numel(dy, N * C, op, "dy");
  LOOM_CHECK(ye_t.dim(-1) == C, op, ": ye ", ye_t.describe(), " and dy ", dy.describe(), " differ in width");
  expect_f32(dlogits, op, "dlogits");
  expect_numel(dlogits, N * E, op, "dlogits");
  expect_dtype(scratch, DTYPE_F64, op, "scratch");
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
