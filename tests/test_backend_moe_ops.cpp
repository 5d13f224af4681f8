// The mixture-of-experts and latent-attention ops of the Backend interface (backend.h: moe_route
// ... mla_attend_latents), in the manner of test_backend_parallel_ops.cpp and in its suite
// (fixture: backend_ops_fixture.h): each case runs the ops on the backend under test and on the
// CPU and compares (integer outputs bitwise), then checks the CPU's results against a naive
// double reference written here from the ops' contracts. Backends without
// capabilities().mixture_of_experts / latent_attention (CUDA today: the defaults throw) are
// skipped; the strict backend always runs.
#include <omp.h>

#include <algorithm>
#include <numeric>

#include "backend_ops_fixture.h"

namespace loom::backend_ops_test {

namespace {

constexpr double kNaiveF32Tol = 1e-5;  // f32 kernels against the double reference, relative to the output's scale

std::vector<int32_t> ints(const Tensor& t) {
  const int32_t* p = t.data<int32_t>();
  return std::vector<int32_t>(p, p + t.numel());
}

Tensor int_tensor(CpuAllocator& host, Shape shape, const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty(host, std::move(shape), DTYPE_I32, MEM_WORKSPACE);
  EXPECT_EQ(static_cast<size_t>(t.numel()), v.size());
  std::copy(v.begin(), v.end(), t.data<int32_t>());
  return t;
}

// The selection of Backend::moe_route from its f32 scores s (N, E) and bias: experts (N, k).
std::vector<int32_t> naive_selection(const std::vector<double>& s, const std::vector<double>& bias,
                                     const MoeRouting& r, int64_t N) {
  const int64_t E = r.experts, per = E / r.groups;
  std::vector<int32_t> out;
  for (int64_t t = 0; t < N; ++t) {
    std::vector<float> sel(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) sel[e] = static_cast<float>(s[t * E + e]) + static_cast<float>(bias[e]);
    std::vector<bool> allowed(static_cast<size_t>(E), true);
    if (r.groups > 1) {  // a group's score: its two best (its one) selection scores
      std::vector<std::pair<float, int64_t>> groups;
      for (int64_t g = 0; g < r.groups; ++g) {
        std::vector<float> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
        std::sort(v.rbegin(), v.rend());
        groups.emplace_back(per > 1 ? v[0] + v[1] : v[0], g);
      }
      std::stable_sort(groups.begin(), groups.end(), [](auto& a, auto& b) { return a.first > b.first; });
      for (int64_t g = r.topk_groups; g < r.groups; ++g) {
        for (int64_t e = 0; e < per; ++e) allowed[groups[g].second * per + e] = false;
      }
    }
    std::vector<int64_t> order;
    for (int64_t e = 0; e < E; ++e) {
      if (allowed[e]) order.push_back(e);
    }
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sel[a] > sel[b]; });
    for (int64_t j = 0; j < r.top_k; ++j) out.push_back(static_cast<int32_t>(order[j]));
  }
  return out;
}

}  // namespace

#define LOOM_SKIP_WITHOUT(flag)                                                       \
  if (GetParam() != "strict" && !backend_->capabilities().flag) {                    \
    GTEST_SKIP() << backend_->name() << " lacks " #flag " (its defaults throw)"; \
  }

TEST_P(BackendOpsTest, MoeRouteScoresTopKAndGates) {
  LOOM_SKIP_WITHOUT(mixture_of_experts);
  const int64_t N = 37, E = 8;
  struct Case {
    bool sigmoid, renorm;
    int64_t K, G, topk_groups;
    float scale;
  };
  for (const Case k : {Case{false, true, 2, 1, 1, 1.0f}, Case{true, true, 2, 4, 2, 2.5f}, Case{false, false, 3, 2, 1, 1.0f},
                       Case{true, true, 2, 8, 3, 1.0f}}) {
    MoeRouting r;
    r.experts = E, r.top_k = k.K, r.groups = k.G, r.topk_groups = k.topk_groups;
    r.sigmoid = k.sigmoid, r.renorm = k.renorm, r.route_scale = k.scale;
    Operands x;
    x.tensors["logits"] = rnd({N, E}, DTYPE_F32, 11, 3.0);
    for (int64_t i = 0; i < 3 * E; ++i) x["logits"].data<float>()[i] = 0.5f;  // rows 0-2: equal scores, ties
    x.tensors["bias"] = empty({E}, DTYPE_F32);
    for (int64_t e = 0; e < E; ++e) x["bias"].data<float>()[e] = e % 2 == 0 ? 0.0f : -0.25f;
    x.tensors["scores"] = nans({N, E}, DTYPE_F32);
    x.tensors["expert"] = int_tensor(host_, {N, k.K}, std::vector<int32_t>(static_cast<size_t>(N * k.K), -5));
    x.tensors["gates"] = nans({N, k.K}, DTYPE_F32);
    x.tensors["scratch"] = nans({omp_get_max_threads() * (E + 2 * k.G)}, DTYPE_F32);
    const Op op = [&](Backend& be, Operands& o) {
      be.moe_route(o["logits"], o["bias"], o["scores"], o["expert"], o["gates"], o["scratch"], r);
    };
    const Tol tol = elementwise_tol(DTYPE_F32);
    check(str_cat("moe_route (sigmoid ", k.sigmoid, ", top ", k.K, ", groups ", k.G, ")"), x, op,
          {{"scores", tol}, {"expert", kBitwise}, {"gates", tol}}, true);

    Operands ref = copy_to_host(x);
    op(*cpu_, ref);
    const std::vector<double> u = test::values(x["logits"]), s = test::values(ref["scores"]);
    std::vector<double> want(u.size()), gates;
    for (int64_t t = 0; t < N; ++t) {
      double m = -kInf, z = 0.0;
      for (int64_t e = 0; e < E; ++e) m = std::max(m, u[t * E + e]);
      for (int64_t e = 0; e < E; ++e) z += std::exp(u[t * E + e] - m);
      for (int64_t e = 0; e < E; ++e) {
        want[t * E + e] = k.sigmoid ? 1.0 / (1.0 + std::exp(-u[t * E + e])) : std::exp(u[t * E + e] - m) / z;
      }
    }
    EXPECT_LE(test::max_rel_error(s, want), kNaiveF32Tol);
    const std::vector<int32_t> experts = naive_selection(s, test::values(x["bias"]), r, N);
    EXPECT_EQ(ints(ref["expert"]), experts);
    for (int64_t t = 0; t < N; ++t) {
      double sum = 0.0;
      for (int64_t j = 0; j < k.K; ++j) sum += s[t * E + experts[t * k.K + j]];
      for (int64_t j = 0; j < k.K; ++j) gates.push_back(s[t * E + experts[t * k.K + j]] / (k.renorm ? sum : 1.0) * k.scale);
    }
    EXPECT_LE(test::max_rel_error(test::values(ref["gates"]), gates), kNaiveF32Tol);
    // Tied rows: the lower index wins (even experts carry the larger bias).
    for (int64_t j = 0; j < k.K && k.G == 1; ++j) EXPECT_EQ(ref["expert"].data<int32_t>()[j], 2 * j);
  }
}

TEST_P(BackendOpsTest, MoeAssignCapacityRowsAndTokens) {
  LOOM_SKIP_WITHOUT(mixture_of_experts);
  const int64_t N = 41, K = 2, E = 5;
  for (const int64_t cap : {int64_t{7}, N * K}) {
    Operands x;
    x.tensors["expert"] = ids({N, K}, static_cast<int32_t>(E), 21);
    x.tensors["row"] = int_tensor(host_, {N, K}, std::vector<int32_t>(static_cast<size_t>(N * K), -5));
    x.tensors["token"] = int_tensor(host_, {N * K}, std::vector<int32_t>(static_cast<size_t>(N * K), -5));
    x.tensors["counts"] = int_tensor(host_, {3 * E + 1}, std::vector<int32_t>(static_cast<size_t>(3 * E + 1), -5));
    const Op op = [&](Backend& be, Operands& o) { be.moe_assign(o["expert"], cap, o["row"], o["token"], o["counts"]); };
    check(str_cat("moe_assign (capacity ", cap, ")"), x, op,
          {{"row", kBitwise}, {"token", kBitwise}, {"counts", kBitwise}}, true);

    Operands ref = copy_to_host(x);
    op(*cpu_, ref);
    // Per expert, its assignments in priority order (choice j, then token t); the first cap keep rows.
    const std::vector<int32_t> expert = ints(x["expert"]);
    std::vector<int32_t> row(static_cast<size_t>(N * K), -1), token(static_cast<size_t>(N * K), -5), load, kept, offsets{0};
    for (int64_t e = 0; e < E; ++e) {
      std::vector<std::pair<int64_t, int64_t>> mine;
      for (int64_t j = 0; j < K; ++j) {
        for (int64_t t = 0; t < N; ++t) {
          if (expert[t * K + j] == e) mine.emplace_back(t, j);
        }
      }
      load.push_back(static_cast<int32_t>(mine.size()));
      kept.push_back(static_cast<int32_t>(std::min<int64_t>(cap, static_cast<int64_t>(mine.size()))));
      for (int64_t i = 0; i < kept.back(); ++i) {
        const auto [t, j] = mine[i];
        row[t * K + j] = static_cast<int32_t>(offsets.back() + i);
        token[offsets.back() + i] = static_cast<int32_t>(t);
      }
      offsets.push_back(offsets.back() + kept.back());
    }
    std::vector<int32_t> counts = load;
    counts.insert(counts.end(), kept.begin(), kept.end());
    counts.insert(counts.end(), offsets.begin(), offsets.end());
    EXPECT_EQ(ints(ref["counts"]), counts);
    EXPECT_EQ(ints(ref["row"]), row);
    EXPECT_EQ(ints(ref["token"]), token);
    if (cap < N * K) {
      EXPECT_LT(offsets.back(), N * K) << "the capacity case drops nothing";
    }
  }
}

TEST_P(BackendOpsTest, MoeDispatchCombineAndTheirBackwards) {
  LOOM_SKIP_WITHOUT(mixture_of_experts);
  const int64_t N = 29, K = 2, C = 37;
  // Rows: a shuffled injective map of the (t, j) pairs, every fifth pair dropped.
  std::vector<int32_t> row(static_cast<size_t>(N * K));
  std::iota(row.begin(), row.end(), 0);
  for (size_t i = 0; i < row.size(); ++i) std::swap(row[i], row[(i * 7 + 3) % row.size()]);
  std::vector<int32_t> token(row.size(), 0);
  int64_t R = 0;
  for (size_t a = 0; a < row.size(); ++a) R = std::max<int64_t>(R, row[a] + 1);
  for (size_t a = 0; a < row.size(); ++a) {
    if (a % 5 == 4) row[a] = -1;
    else token[static_cast<size_t>(row[a])] = static_cast<int32_t>(a / K);
  }
  Operands x;
  x.tensors["x"] = rnd({N, C}, DTYPE_F32, 31);
  x.tensors["token"] = int_tensor(host_, {R}, token);
  x.tensors["row"] = int_tensor(host_, {N, K}, row);
  x.tensors["gates"] = rnd({N, K}, DTYPE_F32, 32);
  x.tensors["rows"] = nans({R, C}, DTYPE_F32);
  x.tensors["out"] = rnd({N, C}, DTYPE_F32, 33);
  x.tensors["out1"] = rnd({N, C}, DTYPE_F32, 34);
  x.tensors["dout"] = rnd({N, C}, DTYPE_F32, 35);
  x.tensors["drows"] = rnd({R, C}, DTYPE_F32, 36);
  const Op op = [&](Backend& be, Operands& o) {
    be.moe_dispatch(o["x"], o["token"], o["rows"]);
    be.moe_combine(o["rows"], o["row"], o["gates"], o["out"]);
    be.moe_combine(o["rows"], o["row"], Tensor{}, o["out1"]);
    be.moe_combine_backward(o["dout"], o["row"], o["gates"], o["drows"]);
  };
  const Tol tol = elementwise_tol(DTYPE_F32);
  check("moe dispatch / combine (N 29, k 2, C 37)", x, op,
        {{"rows", kBitwise}, {"out", tol}, {"out1", tol}, {"drows", tol}}, true);

  Operands ref = copy_to_host(x);
  op(*cpu_, ref);
  const std::vector<double> xs = test::values(x["x"]), g = test::values(x["gates"]), dout = test::values(x["dout"]);
  std::vector<double> rows(static_cast<size_t>(R * C)), out = test::values(x["out"]), out1 = test::values(x["out1"]),
      drows = test::values(x["drows"]);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) rows[r * C + c] = xs[token[r] * C + c];
  }
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      const int32_t r = row[t * K + j];
      if (r < 0) continue;
      for (int64_t c = 0; c < C; ++c) {
        out[t * C + c] += g[t * K + j] * rows[r * C + c];
        out1[t * C + c] += rows[r * C + c];
        drows[r * C + c] = g[t * K + j] * dout[t * C + c];
      }
    }
  }
  EXPECT_EQ(test::values(ref["rows"]), rows);
  EXPECT_LE(test::max_rel_error(test::values(ref["out"]), out), kNaiveF32Tol);
  EXPECT_LE(test::max_rel_error(test::values(ref["out1"]), out1), kNaiveF32Tol);
  EXPECT_LE(test::max_rel_error(test::values(ref["drows"]), drows), kNaiveF32Tol);
}

namespace {

// A routed problem: the routing, N tokens of width C, the capacity.
struct Routed {
  MoeRouting r;
  int64_t N, C, cap;
};

// The naive balance losses [aux, seq_aux, z, entropy] from the routing's f32 results.
std::vector<double> naive_stats(const Routed& k, const std::vector<double>& u, const std::vector<double>& s,
                                const std::vector<int32_t>& expert, const std::vector<int32_t>& load) {
  const int64_t E = k.r.experts, K = k.r.top_k, T = k.r.seq_len, N = k.N, B = N / T;
  std::vector<double> P(static_cast<size_t>(E)), out(4, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> Pb(static_cast<size_t>(E)), f(static_cast<size_t>(E));
    for (int64_t t = b * T; t < (b + 1) * T; ++t) {
      const double sum = std::accumulate(s.begin() + t * E, s.begin() + (t + 1) * E, 0.0);
      double m = -kInf, z = 0.0;
      for (int64_t e = 0; e < E; ++e) m = std::max(m, u[t * E + e]);
      for (int64_t e = 0; e < E; ++e) z += std::exp(u[t * E + e] - m);
      const double lse = m + std::log(z);
      out[2] += k.r.z_alpha * lse * lse / static_cast<double>(N);
      for (int64_t e = 0; e < E; ++e) {
        const double q = s[t * E + e] / sum;
        Pb[e] += q / static_cast<double>(T), P[e] += q / static_cast<double>(N);
        out[3] -= q > 0 ? q * std::log(q) / static_cast<double>(N) : 0.0;
      }
      for (int64_t j = 0; j < K; ++j) f[expert[t * K + j]] += static_cast<double>(E) / static_cast<double>(K * T);
    }
    for (int64_t e = 0; e < E; ++e) out[1] += k.r.seq_aux_alpha * f[e] * Pb[e] / static_cast<double>(B);
  }
  for (int64_t e = 0; e < E; ++e) out[0] += k.r.aux_alpha * static_cast<double>(E * load[e]) / static_cast<double>(K * N) * P[e];
  return out;
}

}  // namespace

TEST_P(BackendOpsTest, MoeBalanceStatsAndRouterBackward) {
  LOOM_SKIP_WITHOUT(mixture_of_experts);
  struct Case {
    bool sigmoid, renorm;
    float scale, aux, seq_aux, z, weight;
  };
  for (const Case c : {Case{false, true, 1.0f, 1e-2f, 0.0f, 1e-3f, 0.5f}, Case{true, true, 2.5f, 0.3f, 0.2f, 0.1f, 1.0f},
                       Case{true, false, 1.0f, 0.0f, 0.4f, 0.0f, 0.25f}}) {
    Routed k;
    k.r.experts = 6, k.r.top_k = 2, k.r.sigmoid = c.sigmoid, k.r.renorm = c.renorm, k.r.route_scale = c.scale;
    k.r.aux_alpha = c.aux, k.r.seq_aux_alpha = c.seq_aux, k.r.z_alpha = c.z, k.r.seq_len = 17, k.r.loss_weight = c.weight;
    k.N = 34, k.C = 13, k.cap = 9;  // drops some assignments
    const int64_t E = k.r.experts, K = k.r.top_k, N = k.N, T = k.r.seq_len, B = N / T, C = k.C;
    Operands x;  // logits, scores, experts and gates from moe_route, rows from moe_assign
    x.tensors["logits"] = rnd({N, E}, DTYPE_F32, 41, 2.0);
    x.tensors["bias"] = rnd({E}, DTYPE_F32, 42, 0.1);
    x.tensors["scores"] = nans({N, E}, DTYPE_F32);
    x.tensors["expert"] = ids({N, K}, 1, 43);
    x.tensors["gates"] = nans({N, K}, DTYPE_F32);
    x.tensors["route"] = nans({omp_get_max_threads() * (E + 2 * k.r.groups)}, DTYPE_F32);
    x.tensors["row"] = ids({N, K}, 1, 44);
    x.tensors["token"] = ids({N * K}, 1, 45);
    x.tensors["counts"] = ids({3 * E + 1}, 1, 46);
    x.tensors["ye"] = rnd({N * K, C}, DTYPE_F32, 47);
    x.tensors["dy"] = rnd({N, C}, DTYPE_F32, 48);
    x.tensors["dlogits"] = nans({N, E}, DTYPE_F32);
    x.tensors["stats"] = nans({4}, DTYPE_F64);
    x.tensors["sums"] = nans({(1 + N + omp_get_max_threads()) * E}, DTYPE_F64);
    const Op op = [&](Backend& be, Operands& o) {
      be.moe_route(o["logits"], o["bias"], o["scores"], o["expert"], o["gates"], o["route"], k.r);
      be.moe_assign(o["expert"], k.cap, o["row"], o["token"], o["counts"]);
      be.moe_balance_stats(o["logits"], o["scores"], o["expert"], o["counts"], o["stats"], o["sums"], k.r);
      be.moe_router_backward(o["logits"], o["scores"], o["expert"], o["row"], o["ye"], o["dy"], o["counts"],
                             o["dlogits"], o["sums"], k.r);
    };
    check(str_cat("moe balance stats and router backward (sigmoid ", c.sigmoid, ", renorm ", c.renorm, ")"), x, op,
          // stats: f64 sums, but of the backend's own f32 scores (moe_route's expf, which a GPU rounds
          // differently in the last bit: an H200's entropy differed by 6.5e-10, 2026-12-04), so f32's.
          {{"stats", reduction_tol(DTYPE_F32)}, {"dlogits", reduction_tol(DTYPE_F32)}, {"row", kBitwise}}, true);

    Operands ref = copy_to_host(x);
    op(*cpu_, ref);
    const std::vector<double> u = test::values(x["logits"]), s = test::values(ref["scores"]);
    const std::vector<int32_t> expert = ints(ref["expert"]), row = ints(ref["row"]), counts = ints(ref["counts"]);
    const std::vector<int32_t> load(counts.begin(), counts.begin() + E);
    EXPECT_LE(test::max_rel_error(test::values(ref["stats"]), naive_stats(k, u, s, expert, load)), kNaiveF32Tol);
    // d/du of dy . y (y = sum_j g_j ye[row_j]) + weight (aux + seq_aux + z).
    const std::vector<double> ye = test::values(x["ye"]), dy = test::values(x["dy"]);
    std::vector<double> du(static_cast<size_t>(N * E));
    for (int64_t t = 0; t < N; ++t) {
      std::vector<double> ds(static_cast<size_t>(E)), dq(static_cast<size_t>(E));
      double S = 0.0, sum = 0.0;
      for (int64_t j = 0; j < K; ++j) S += s[t * E + expert[t * K + j]];
      for (int64_t e = 0; e < E; ++e) sum += s[t * E + e];
      for (int64_t j = 0; j < K; ++j) {  // g_j = scale s_j / S (renorm) or scale s_j
        double dg = 0.0;
        for (int64_t i = 0; i < C && row[t * K + j] >= 0; ++i) dg += dy[t * C + i] * ye[row[t * K + j] * C + i];
        for (int64_t i = 0; i < K; ++i) {
          const double dgi_dsj = c.renorm ? ((i == j) / S - s[t * E + expert[t * K + j]] / (S * S)) : (i == j);
          ds[expert[t * K + i]] += c.scale * dg * dgi_dsj;
        }
      }
      for (int64_t e = 0; e < E; ++e) {  // dL/dq_e: Switch, and the sequence's count of e
        int64_t n = 0;
        for (int64_t tt = (t / T) * T; tt < (t / T + 1) * T; ++tt) {
          for (int64_t j = 0; j < K; ++j) n += expert[tt * K + j] == e;
        }
        dq[e] = c.weight * (c.aux * static_cast<double>(E * load[e]) / static_cast<double>(K * N) / static_cast<double>(N) +
                            c.seq_aux * static_cast<double>(E * n) / static_cast<double>(K * T) / static_cast<double>(T * B));
      }
      for (int64_t e = 0; e < E; ++e) {  // q_e = s_e / sum
        for (int64_t f = 0; f < E; ++f) ds[e] += dq[f] * ((e == f) / sum - s[t * E + f] / (sum * sum));
      }
      double m = -kInf, z = 0.0, dot = 0.0;
      for (int64_t e = 0; e < E; ++e) m = std::max(m, u[t * E + e]), dot += ds[e] * s[t * E + e];
      for (int64_t e = 0; e < E; ++e) z += std::exp(u[t * E + e] - m);
      const double lse = m + std::log(z);
      for (int64_t e = 0; e < E; ++e) {
        const double se = s[t * E + e];
        du[t * E + e] = (c.sigmoid ? ds[e] * se * (1.0 - se) : se * (ds[e] - dot)) +
                        c.weight * c.z * 2.0 * lse * std::exp(u[t * E + e] - lse) / static_cast<double>(N);
      }
    }
    EXPECT_LE(test::max_rel_error(test::values(ref["dlogits"]), du), kNaiveF32Tol);
  }
}

TEST_P(BackendOpsTest, MlaRopeForwardAndInverse) {
  LOOM_SKIP_WITHOUT(latent_attention);
  const int64_t B = 2, T = 5, H = 3, dn = 4, dr = 6, qk = dn + dr, first = 3;
  const RopeSpec theta{10000.0, ROPE_SCALING_LINEAR, 2.0};  // frequencies halved
  Operands x;
  x.tensors["q"] = rnd({B, T, H * qk}, DTYPE_F32, 51);
  x.tensors["back"] = rnd({B, T, H * qk}, DTYPE_F32, 51);  // the same values
  x.tensors["kr"] = rnd({B, T, dr}, DTYPE_F32, 52);
  const Op op = [&](Backend& be, Operands& o) {
    be.mla_rope(o["q"], H, qk, dn, dr, theta, first, false);
    be.mla_rope(o["kr"], 1, dr, 0, dr, theta, first, true);
    be.mla_rope(o["back"], H, qk, dn, dr, theta, first, false);
    be.mla_rope(o["back"], H, qk, dn, dr, theta, first, true);
  };
  const Tol tol = elementwise_tol(DTYPE_F32);
  check("mla_rope (B 2, T 5, 3 heads of d_n 4 + d_r 6)", x, op, {{"q", tol}, {"kr", tol}, {"back", tol}}, true);

  Operands ref = copy_to_host(x);
  op(*cpu_, ref);
  // Rows' slices at offset + h stride turn by sign (first + t) theta^(-2j/d_r) / 2.
  const auto rotate = [&](std::vector<double> v, int64_t width, int64_t heads, int64_t stride, int64_t offset,
                          double sign) {
    for (int64_t n = 0; n < B * T; ++n) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t j = 0; j < dr / 2; ++j) {
          const double a = sign * static_cast<double>(first + n % T) * std::pow(theta.theta, -2.0 * j / dr) / 2.0;
          double* p = v.data() + n * width + offset + h * stride;
          const double x0 = p[j], x1 = p[j + dr / 2];
          p[j] = x0 * std::cos(a) - x1 * std::sin(a), p[j + dr / 2] = x1 * std::cos(a) + x0 * std::sin(a);
        }
      }
    }
    return v;
  };
  EXPECT_LE(test::max_rel_error(test::values(ref["q"]), rotate(test::values(x["q"]), H * qk, H, qk, dn, 1.0)), kNaiveF32Tol);
  EXPECT_LE(test::max_rel_error(test::values(ref["kr"]), rotate(test::values(x["kr"]), dr, 1, dr, 0, -1.0)), kNaiveF32Tol);
  EXPECT_LE(test::max_rel_error(test::values(ref["back"]), test::values(x["back"])), kNaiveF32Tol);
}

namespace {

struct MlaCase {
  int64_t B, T;
  MlaDims d;
};

// The naive attention and its backward in double: probs, out, and dq, dkv, dkr from their inputs' values.
std::map<std::string, std::vector<double>> naive_mla(const MlaCase& k, const Operands& x) {
  const MlaDims& d = k.d;
  const int64_t T = k.T, H = d.n_head, qk = d.nope + d.rope, kvw = d.nope + d.v;
  const std::vector<double> q = test::values(x["q"]), kr = test::values(x["kr"]), kv = test::values(x["kv"]),
                            dout = test::values(x["dout"]);
  std::map<std::string, std::vector<double>> r;
  r["probs"].assign(static_cast<size_t>(k.B * H * T * T), 0.0);
  r["out"].assign(static_cast<size_t>(k.B * T * H * d.v), 0.0);
  r["dq"] = test::values(x["dq"]), r["dkv"] = test::values(x["dkv"]), r["dkr"] = test::values(x["dkr"]);
  const double scale = 1.0 / std::sqrt(static_cast<double>(qk));
  for (int64_t b = 0; b < k.B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < T; ++i) {
        const int64_t qo = (b * T + i) * H * qk + h * qk, oo = (b * T + i) * H * d.v + h * d.v;
        const auto kvo = [&](int64_t j) { return (b * T + j) * H * kvw + h * kvw; };
        const int64_t j0 = d.window > 0 ? std::max<int64_t>(0, i - d.window + 1) : 0;
        std::vector<double> p(static_cast<size_t>(T), 0.0);
        double m = -kInf, z = 0.0;
        for (int64_t j = j0; j <= i; ++j) {
          for (int64_t e = 0; e < d.nope; ++e) p[j] += q[qo + e] * kv[kvo(j) + e];
          for (int64_t e = 0; e < d.rope; ++e) p[j] += q[qo + d.nope + e] * kr[(b * T + j) * d.rope + e];
          p[j] *= scale, m = std::max(m, p[j]);
        }
        for (int64_t j = j0; j <= i; ++j) z += std::exp(p[j] - m);
        double D = 0.0;
        std::vector<double> dp(static_cast<size_t>(T), 0.0);
        for (int64_t j = j0; j <= i; ++j) {
          p[j] = std::exp(p[j] - m) / z;
          r["probs"][((b * H + h) * T + i) * T + j] = p[j];
          for (int64_t e = 0; e < d.v; ++e) {
            r["out"][oo + e] += p[j] * kv[kvo(j) + d.nope + e];
            dp[j] += dout[oo + e] * kv[kvo(j) + d.nope + e];
            r["dkv"][kvo(j) + d.nope + e] += p[j] * dout[oo + e];
          }
          D += p[j] * dp[j];
        }
        for (int64_t j = j0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - D) * scale;
          for (int64_t e = 0; e < d.nope; ++e) {
            r["dq"][qo + e] += ds * kv[kvo(j) + e];
            r["dkv"][kvo(j) + e] += ds * q[qo + e];
          }
          for (int64_t e = 0; e < d.rope; ++e) {
            r["dq"][qo + d.nope + e] += ds * kr[(b * T + j) * d.rope + e];
            r["dkr"][(b * T + j) * d.rope + e] += ds * q[qo + d.nope + e];
          }
        }
      }
    }
  }
  return r;
}

}  // namespace

TEST_P(BackendOpsTest, MlaAttentionForwardBackward) {
  LOOM_SKIP_WITHOUT(latent_attention);
  for (const int64_t window : {int64_t{0}, int64_t{3}}) {
    MlaCase k{2, 7, {}};
    k.d.n_head = 3, k.d.nope = 4, k.d.rope = 2, k.d.v = 5, k.d.latent = 6, k.d.window = window;
    const int64_t B = k.B, T = k.T, H = k.d.n_head, qk = k.d.nope + k.d.rope, kvw = k.d.nope + k.d.v;
    Operands x;
    x.tensors["q"] = rnd({B, T, H * qk}, DTYPE_F32, 61);
    x.tensors["kr"] = rnd({B, T, k.d.rope}, DTYPE_F32, 62);
    x.tensors["kv"] = rnd({B, T, H * kvw}, DTYPE_F32, 63);
    x.tensors["probs"] = nans({B, H, T, T}, DTYPE_F32);
    x.tensors["out"] = nans({B, T, H * k.d.v}, DTYPE_F32);
    x.tensors["dout"] = rnd({B, T, H * k.d.v}, DTYPE_F32, 64);
    x.tensors["dq"] = rnd({B, T, H * qk}, DTYPE_F32, 65);
    x.tensors["dkv"] = rnd({B, T, H * kvw}, DTYPE_F32, 66);
    x.tensors["dkr"] = rnd({B, T, k.d.rope}, DTYPE_F32, 67);
    x.tensors["dp_row"] = nans({T}, DTYPE_F32);
    const Op op = [&](Backend& be, Operands& o) {
      be.mla_attention_forward(o["q"], o["kr"], o["kv"], o["probs"], o["out"], k.d);
      be.mla_attention_backward(o["q"], o["kr"], o["kv"], o["probs"], o["dout"], o["dq"], o["dkv"], o["dkr"],
                                o["dp_row"], k.d);
    };
    const Tol tol = reduction_tol(DTYPE_F32);
    check(str_cat("mla attention (B 2, T 7, window ", window, ")"), x, op,
          {{"probs", tol}, {"out", tol}, {"dq", tol}, {"dkv", tol}, {"dkr", tol}}, true);

    Operands ref = copy_to_host(x);
    op(*cpu_, ref);
    for (const auto& [name, want] : naive_mla(k, x)) {
      EXPECT_LE(test::max_rel_error(test::values(ref[name]), want), kNaiveF32Tol) << name << ", window " << window;
    }
  }
}

TEST_P(BackendOpsTest, MlaAttendLatentsIsAttentionOverUpProjectedLatents) {
  LOOM_SKIP_WITHOUT(latent_attention);
  MlaDims d;
  d.n_head = 2, d.nope = 4, d.rope = 2, d.v = 3, d.latent = 5;
  const int64_t H = d.n_head, dc = d.latent, dr = d.rope, qk = d.nope + dr, kvw = d.nope + d.v, count = 6;
  Operands x;
  x.tensors["q"] = rnd({H * qk}, DTYPE_F32, 71);
  x.tensors["latents"] = rnd({count, dc + dr}, DTYPE_F32, 72);
  x.tensors["kv_b"] = rnd({H * kvw, dc}, DTYPE_F32, 73);
  x.tensors["out"] = nans({H * d.v}, DTYPE_F32);
  const Op op = [&](Backend& be, Operands& o) { be.mla_attend_latents(o["q"], o["latents"], o["kv_b"], o["out"], d); };
  check("mla_attend_latents (2 heads, 6 positions)", x, op, {{"out", reduction_tol(DTYPE_F32)}}, true);

  Operands ref = copy_to_host(x);
  op(*cpu_, ref);
  // Without the absorption: k_n(j) = W_uk c'(j), v(j) = W_uv c'(j), then plain attention.
  const std::vector<double> q = test::values(x["q"]), lat = test::values(x["latents"]), w = test::values(x["kv_b"]);
  std::vector<double> out(static_cast<size_t>(H * d.v), 0.0);
  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> s(static_cast<size_t>(count), 0.0), kn(static_cast<size_t>(count * kvw), 0.0);
    for (int64_t j = 0; j < count; ++j) {
      for (int64_t r = 0; r < kvw; ++r) {
        for (int64_t c = 0; c < dc; ++c) kn[j * kvw + r] += w[(h * kvw + r) * dc + c] * lat[j * (dc + dr) + c];
      }
      for (int64_t e = 0; e < d.nope; ++e) s[j] += q[h * qk + e] * kn[j * kvw + e];
      for (int64_t e = 0; e < dr; ++e) s[j] += q[h * qk + d.nope + e] * lat[j * (dc + dr) + dc + e];
      s[j] /= std::sqrt(static_cast<double>(qk));
    }
    const double m = *std::max_element(s.begin(), s.end());
    double z = 0.0;
    for (double v : s) z += std::exp(v - m);
    for (int64_t j = 0; j < count; ++j) {
      for (int64_t e = 0; e < d.v; ++e) out[h * d.v + e] += std::exp(s[j] - m) / z * kn[j * kvw + d.nope + e];
    }
  }
  EXPECT_LE(test::max_rel_error(test::values(ref["out"]), out), kNaiveF32Tol);
}

}  // namespace loom::backend_ops_test
