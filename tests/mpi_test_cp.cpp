// Context parallelism under `mpirun -np 2` and `-np 4`: the zig-zag sequence layout, ring
// attention and Ulysses against a naive float64 causal attention computed in full on every
// rank (forward output, log-sum-exp, and dq, dk, dv derived analytically), and the byte ledger
// against the formulas of parallel/context_parallel.h.
// Legend: B batch, T sequence, Tl = T/N, H query heads, KV kv heads, hd head dim, N cp ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/core/error.h"
#include "loom/core/philox.h"
#include "loom/nn/context_parallel.h"
#include "loom/nn/linear_attention.h"
#include "loom/train/trainer.h"
#include "loom/comm/device_mesh.h"
#include "mpi_fixture.h"
#include "test_util.h"

namespace loom {
namespace {

struct Fixture : MpiFixture {
  // Runs the rest of the test in the cp group of the ranks passing the same color.
  void use_group(int color) {
    comm = comm->split(color, r);
    r = comm->rank();
    n = comm->size();
  }
};

// Naive causal attention in double: out (B, T, H hd), lse (B, H, T) and, for dout, the exact
// gradients dq (B, T, H hd), dk, dv (B, T, KV hd):
//   S = scale Q K^T (j <= i), P = softmax(S); O = P V;
//   dV = P^T dO; dP = dO V^T; dS = P o (dP - rowsum(P o dP)); dQ = scale dS K; dK = scale dS^T Q.
struct Naive {
  std::vector<double> out, lse, dq, dk, dv;
};

Naive naive_attention(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                      const std::vector<double>& dout, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t hd) {
  const int64_t QW = H * hd, KW = KV * hd, group = H / KV;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  Naive n{std::vector<double>(q.size()), std::vector<double>(B * H * T), std::vector<double>(q.size()),
          std::vector<double>(k.size()), std::vector<double>(v.size())};
  std::vector<double> p(T), dp(T);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      for (int64_t i = 0; i < T; ++i) {
        const double* qi = &q[(b * T + i) * QW + h * hd];
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double s = 0;
          for (int64_t e = 0; e < hd; ++e) s += qi[e] * k[(b * T + j) * KW + g * hd + e];
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
        for (int64_t j = 0; j <= i; ++j) p[j] /= sum;
        n.lse[(b * H + h) * T + i] = mx + std::log(sum);
        double* oi = &n.out[(b * T + i) * QW + h * hd];
        const double* doi = &dout[(b * T + i) * QW + h * hd];
        double D = 0;
        for (int64_t j = 0; j <= i; ++j) {
          dp[j] = 0;
          for (int64_t e = 0; e < hd; ++e) {
            oi[e] += p[j] * v[(b * T + j) * KW + g * hd + e];
            dp[j] += doi[e] * v[(b * T + j) * KW + g * hd + e];
          }
          D += p[j] * dp[j];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - D);
          for (int64_t e = 0; e < hd; ++e) {
            n.dv[(b * T + j) * KW + g * hd + e] += p[j] * doi[e];
            n.dq[(b * T + i) * QW + h * hd + e] += scale * ds * k[(b * T + j) * KW + g * hd + e];
            n.dk[(b * T + j) * KW + g * hd + e] += scale * ds * qi[e];
          }
        }
      }
    }
  }
  return n;
}

// max |got - want| / max |want|: the error relative to the tensor's scale.
template <typename T>
double rel_error(const Tensor& got, const std::vector<double>& want) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(got.data<T>()[i]) - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

// One attention problem: full random q, k, v, dout (identical on every rank: Philox with fixed
// seeds), the naive reference, and this rank's zig-zag part of each input.
struct Problem {
  int64_t B = 2, T = 16, H = 4, KV = 2, hd = 8;
  Naive ref;
  Tensor q, k, v, dout;  // local: (B, Tl, H hd), (B, Tl, KV hd) x 2, (B, Tl, H hd)
  int64_t Tl(int n) const { return T / n; }
};

template <typename T>
Problem make_problem(Fixture& f, int64_t H, int64_t KV) {
  Problem p;
  p.H = H;
  p.KV = KV;
  const int64_t QW = H * p.hd, KW = KV * p.hd;
  std::vector<std::vector<double>> full;
  std::vector<Tensor> local;
  const int64_t widths[4] = {QW, KW, KW, QW};
  for (uint32_t stream = 0; stream < 4; ++stream) {
    std::vector<float> x(p.B * p.T * widths[stream]);
    philox_fill_normal(x.data(), static_cast<int64_t>(x.size()), 2024, stream, 0, 0.0f, 1.0f);
    Tensor t = f.make({p.B, p.T, widths[stream]}, dtype_of<T>());
    for (size_t i = 0; i < x.size(); ++i) t.data<T>()[i] = static_cast<T>(x[i]);
    full.emplace_back(x.begin(), x.end());
    local.push_back(f.make({p.B, p.Tl(f.n), widths[stream]}, dtype_of<T>()));
    cp_take_local(t, local.back(), f.r, f.n);
  }
  p.ref = naive_attention(full[0], full[1], full[2], full[3], p.B, p.T, H, KV, p.hd);
  p.q = local[0];
  p.k = local[1];
  p.v = local[2];
  p.dout = local[3];
  return p;
}

struct Errors {
  double out = 0, lse = 0, dq = 0, dk = 0, dv = 0;
  bool has_lse = false;  // ring attention returns lse; Ulysses keeps the backend's probabilities
};

// Gathers local (B, Tl, W) results to the full sequence and compares them with the reference.
template <typename T>
double gathered_error(Fixture& f, const Tensor& local, const std::vector<double>& want) {
  Tensor full = f.make({local.dim(0), local.dim(1) * f.n, local.dim(2)}, local.dtype());
  cp_gather_sequence(*f.backend, *f.comm, local, full);
  return rel_error<T>(full, want);
}

template <typename T>
Errors run_ring(Fixture& f, const Problem& p) {
  const int64_t Tl = p.Tl(f.n);
  Tensor out = f.make(p.q.shape(), dtype_of<T>()), lse = f.make({p.B, p.H, Tl}, dtype_of<T>());
  Tensor dq = f.make(p.q.shape(), dtype_of<T>()), dk = f.make(p.k.shape(), dtype_of<T>()),
         dv = f.make(p.v.shape(), dtype_of<T>());
  const int64_t E = static_cast<int64_t>(sizeof(T));
  f.comm->reset_ledger();
  ring_attention_forward(*f.backend, *f.comm, p.q, p.k, p.v, out, lse, p.H, p.KV);
  // Forward: the K/V block, N-1 hops: (N-1) x 2 B Tl KV hd E, sent and received.
  const int64_t fwd = static_cast<int64_t>(f.n - 1) * 2 * p.B * Tl * p.KV * p.hd * E;
  EXPECT_EQ(ring_attention_forward_bytes(f.n, p.B, Tl, p.KV, p.hd, E), fwd);
  EXPECT_EQ(f.comm->ledger().sent[COLL_SEND_RECV], fwd);
  EXPECT_EQ(f.comm->ledger().received[COLL_SEND_RECV], fwd);
  EXPECT_EQ(f.comm->ledger().total_sent(), fwd);  // nothing but the ring

  f.comm->reset_ledger();
  ring_attention_backward(*f.backend, *f.comm, p.dout, p.q, p.k, p.v, out, lse, dq, dk, dv, p.H, p.KV);
  // Backward: K, V for N-1 hops, dK, dV for N hops: (4N - 2) B Tl KV hd E (nothing for N = 1).
  const int64_t bwd = f.n == 1 ? 0 : (4 * static_cast<int64_t>(f.n) - 2) * p.B * Tl * p.KV * p.hd * E;
  EXPECT_EQ(ring_attention_backward_bytes(f.n, p.B, Tl, p.KV, p.hd, E), bwd);
  EXPECT_EQ(f.comm->ledger().sent[COLL_SEND_RECV], bwd);
  EXPECT_EQ(f.comm->ledger().received[COLL_SEND_RECV], bwd);

  Errors e;
  const std::vector<int64_t> pos = cp_local_positions(p.T, f.r, f.n);
  double lse_err = 0, lse_scale = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t h = 0; h < p.H; ++h) {
      for (int64_t i = 0; i < Tl; ++i) {
        const double want = p.ref.lse[(b * p.H + h) * p.T + pos[i]];
        lse_err = std::max(lse_err, std::abs(static_cast<double>(lse.data<T>()[(b * p.H + h) * Tl + i]) - want));
        lse_scale = std::max(lse_scale, std::abs(want));
      }
    }
  }
  e.lse = lse_err / lse_scale;
  e.has_lse = true;
  e.out = gathered_error<T>(f, out, p.ref.out);
  e.dq = gathered_error<T>(f, dq, p.ref.dq);
  e.dk = gathered_error<T>(f, dk, p.ref.dk);
  e.dv = gathered_error<T>(f, dv, p.ref.dv);
  return e;
}

template <typename T>
Errors run_ulysses(Fixture& f, const Problem& p) {
  const int64_t Tl = p.Tl(f.n);
  Tensor out = f.make(p.q.shape(), dtype_of<T>());
  Tensor dq = f.make(p.q.shape(), dtype_of<T>()), dk = f.make(p.k.shape(), dtype_of<T>()),
         dv = f.make(p.v.shape(), dtype_of<T>());
  const int64_t E = static_cast<int64_t>(sizeof(T));
  // All-to-all of q, k, v and of out (backward: dout and dq, dk, dv), each keeping 1/N:
  // (N-1)/N x B Tl (2H + 2KV) hd E; for MHA 4 (N-1)/N x the local bytes of q.
  const int64_t bytes = static_cast<int64_t>(f.n - 1) * p.B * Tl * (2 * p.H + 2 * p.KV) * p.hd * E / f.n;
  EXPECT_EQ(ulysses_attention_bytes(f.n, p.B, Tl, p.H, p.KV, p.hd, E), bytes);
  if (p.H == p.KV) {
    EXPECT_EQ(bytes, 4 * (f.n - 1) * static_cast<int64_t>(p.q.nbytes()) / f.n);
  }

  UlyssesSaved saved;
  f.comm->reset_ledger();
  ulysses_attention_forward(*f.backend, *f.comm, p.q, p.k, p.v, out, saved, p.H, p.KV);
  EXPECT_EQ(f.comm->ledger().sent[COLL_ALL_TO_ALL], bytes);
  EXPECT_EQ(f.comm->ledger().received[COLL_ALL_TO_ALL], bytes);
  EXPECT_EQ(f.comm->ledger().calls[COLL_ALL_TO_ALL], 2);
  EXPECT_EQ(f.comm->ledger().total_sent(), bytes);
  f.comm->reset_ledger();
  ulysses_attention_backward(*f.backend, *f.comm, p.dout, saved, dq, dk, dv, p.H, p.KV);
  EXPECT_EQ(f.comm->ledger().sent[COLL_ALL_TO_ALL], bytes);
  EXPECT_EQ(f.comm->ledger().received[COLL_ALL_TO_ALL], bytes);

  Errors e;
  e.out = gathered_error<T>(f, out, p.ref.out);
  e.dq = gathered_error<T>(f, dq, p.ref.dq);
  e.dk = gathered_error<T>(f, dk, p.ref.dk);
  e.dv = gathered_error<T>(f, dv, p.ref.dv);
  return e;
}

void expect_within(const Fixture& f, const char* what, const Errors& e, double tol) {
  if (f.r == 0) {
    char lse[32] = "";
    if (e.has_lse) std::snprintf(lse, sizeof(lse), " lse %.2e", e.lse);
    std::printf("[ cp ] %s N=%d: out %.2e%s dq %.2e dk %.2e dv %.2e (max abs error / max abs value)\n", what, f.n,
                e.out, lse, e.dq, e.dk, e.dv);
  }
  EXPECT_LE(e.out, tol);
  EXPECT_LE(e.lse, tol);
  EXPECT_LE(e.dq, tol);
  EXPECT_LE(e.dk, tol);
  EXPECT_LE(e.dv, tol);
}

TEST(CpLayout, RanksHoldChunksRAnd2NMinus1MinusRCoveringTheSequenceOnce) {
  Fixture f;
  const int64_t T = 16, C = T / (2 * f.n);
  std::vector<int> seen(T, 0);
  for (int r = 0; r < f.n; ++r) {
    const std::vector<int64_t> pos = cp_local_positions(T, r, f.n);
    ASSERT_EQ(static_cast<int64_t>(pos.size()), T / f.n);
    for (int64_t t = 0; t < C; ++t) {
      EXPECT_EQ(pos[t], r * C + t);
      EXPECT_EQ(pos[C + t], (2 * f.n - 1 - r) * C + t);
    }
    for (int64_t p : pos) seen[p] += 1;
  }
  for (int64_t p = 0; p < T; ++p) EXPECT_EQ(seen[p], 1) << p;
  // Zig-zag balance: every rank's queries see the same number of causal (query, key) pairs.
  int64_t pairs0 = 0;
  for (int64_t p : cp_local_positions(T, 0, f.n)) pairs0 += p + 1;
  int64_t pairs = 0;
  for (int64_t p : cp_local_positions(T, f.r, f.n)) pairs += p + 1;
  EXPECT_EQ(pairs, pairs0);
}

TEST(CpLayout, TakeLocalThenGatherSequenceRestoresTheFullTensor) {
  Fixture f;
  const int64_t B = 2, T = 16, W = 3;
  Tensor full = f.make({B, T, W}, DTYPE_F32), local = f.make({B, T / f.n, W}, DTYPE_F32);
  for (int64_t i = 0; i < full.numel(); ++i) full.data<float>()[i] = static_cast<float>(i);
  cp_take_local(full, local, f.r, f.n);
  const std::vector<int64_t> pos = cp_local_positions(T, f.r, f.n);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T / f.n; ++t) {
      EXPECT_EQ(local.data<float>()[(b * (T / f.n) + t) * W + 2], static_cast<float>((b * T + pos[t]) * W + 2));
    }
  }
  Tensor back = f.make({B, T, W}, DTYPE_F32);
  cp_gather_sequence(*f.backend, *f.comm, local, back);
  for (int64_t i = 0; i < full.numel(); ++i) EXPECT_EQ(back.data<float>()[i], full.data<float>()[i]) << i;
}

TEST(CpLayout, SeqLenNotDivisibleByTwiceCpIsOneLineError) {
  Fixture f;
  const int64_t T = 3 * f.n;  // divisible by N, not by 2N
  try {
    cp_local_positions(T, f.r, f.n);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("parallel.cp"), std::string::npos) << msg;
    EXPECT_NE(msg.find("train.seq_len = " + std::to_string(T)), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  // The attention entry points check the same thing on their local shard (odd Tl).
  Tensor q = f.make({1, 3, 8}, DTYPE_F32), kv = f.make({1, 3, 8}, DTYPE_F32), lse = f.make({1, 1, 3}, DTYPE_F32);
  EXPECT_THROW(ring_attention_forward(*f.backend, *f.comm, q, kv, kv, q, lse, 1, 1), Error);
}

// Ring (f32 GQA and MHA, f64) and Ulysses (f32 MHA and GQA, f64) against the naive reference.
TEST(ContextParallelAttention, RingAndUlyssesMatchNaiveCausalAttention) {
  Fixture f;
  expect_within(f, "ring f32 H=4 KV=2", run_ring<float>(f, make_problem<float>(f, 4, 2)), 1e-5);
  expect_within(f, "ring f32 H=4 KV=4", run_ring<float>(f, make_problem<float>(f, 4, 4)), 1e-5);
  expect_within(f, "ring f64 H=4 KV=2", run_ring<double>(f, make_problem<double>(f, 4, 2)), 1e-13);
  expect_within(f, "ulysses f32 H=4 KV=4", run_ulysses<float>(f, make_problem<float>(f, 4, 4)), 1e-5);
  // GQA with 2 query heads per kv head: H=4, KV=2 when N divides KV (np 2), else H=8, KV=4 (np 4).
  const int64_t KV = 2 % f.n == 0 ? 2 : 4;
  expect_within(f, KV == 2 ? "ulysses f32 H=4 KV=2" : "ulysses f32 H=8 KV=4",
                run_ulysses<float>(f, make_problem<float>(f, 2 * KV, KV)), 1e-5);
  expect_within(f, "ulysses f64 H=4 KV=4", run_ulysses<double>(f, make_problem<double>(f, 4, 4)), 1e-13);
}

TEST(RingAndUlyssesAttention, MatchNaiveInsideCpGroupsOfHalfTheWorld) {
  Fixture f;
  f.use_group(f.r / std::max(1, f.n / 2));  // np 2: two groups of 1 rank; np 4: two groups of 2
  const Problem p = make_problem<float>(f, 4, 2);
  expect_within(f, "ring f32 H=4 KV=2 (group)", run_ring<float>(f, p), 1e-5);
  const Problem pm = make_problem<float>(f, 4, 4);
  expect_within(f, "ulysses f32 H=4 KV=4 (group)", run_ulysses<float>(f, pm), 1e-5);
}

TEST(UlyssesAttention, KvHeadsNotDivisibleByCpIsOneLineError) {
  Fixture f;
  const Problem p = make_problem<float>(f, 4, 1);  // KV = 1 < N
  Tensor out = f.make(p.q.shape(), DTYPE_F32);
  UlyssesSaved saved;
  try {
    ulysses_attention_forward(*f.backend, *f.comm, p.q, p.k, p.v, out, saved, p.H, p.KV);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("n_kv_head (1)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("parallel.cp (" + std::to_string(f.n) + ")"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  EXPECT_EQ(f.comm->ledger().total_sent(), 0);  // refused before any communication
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// cp = 2 (dp = the rest of the world) against one process of the same global batch, 10 steps:
// the losses (and with SGD every step's gradients) within 1e-5; returns the worst (loss, gradient).
std::pair<double, double> check_cp(Communicator& world, const ModelConfig& config, bool ulysses, const char* optimizer,
                                   bool masked, const std::string& what) {
  const int n = world.size(), cp_size = 2, dp_size = n / cp_size;
  const DeviceMesh mesh(n, {{"dp", dp_size}, {"cp", cp_size}});
  TrainConfig tc;
  tc.batch_size = 2, tc.seq_len = 16, tc.grad_accum = 2, tc.steps = 10, tc.schedule.warmup = 3;
  tc.schedule.max_lr = 1e-2;
  tc.optim.name = optimizer;
  TrainConfig ref_tc = tc;
  ref_tc.batch_size = 2 * dp_size;
  const Curve ref = train_single(config, ref_tc, 10, masked);
  auto cp = mesh_group(world, mesh, "cp");
  auto reduce = mesh_group(world, mesh, std::vector<std::string>{"dp", "cp"});
  auto dp = mesh_group(world, mesh, "dp");
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(7);
  model.set_context_parallel(cp.get(), ulysses);
  Trainer trainer(*backend, model, tc, reduce.get());
  RankData rows(backend->allocator(), config, dp->rank(), dp->size(), 2, masked);
  ContextSliceSource data(rows.source(), backend->allocator(), cp->rank(), cp->size(), 2, 16);
  double worst_loss = 0, worst_grad = 0;
  for (int s = 0; s < 10; ++s) {
    const StepStats st = trainer.train_step(data);
    const double rel = std::abs(st.loss - ref.losses[s]) / ref.losses[s];
    worst_loss = std::max(worst_loss, rel);
    EXPECT_LT(rel, 1e-5) << what << " step " << s;
    if (std::string(optimizer) != "sgd") continue;  // AdamW: by loss (sqrt(v) amplifies rounding)
    const double grel = gradient_rel_diff(model.grads().data<float>(), ref.grads[s]);
    worst_grad = std::max(worst_grad, grel);
    EXPECT_LT(grel, 1e-5) << what << " gradient, step " << s;
  }
  if (world.rank() == 0) {
    std::printf("%s, dp=%d x cp=%d: 10 steps, worst loss rel diff %.2e, gradient %.2e\n", what.c_str(), dp_size, cp_size,
                worst_loss, worst_grad);
  }
  return {worst_loss, worst_grad};
}

// The model under context parallelism: cp = 2 (np 2; dp = 2 x cp = 2 at np 4) with ring and
// with Ulysses attention reproduces the one-process losses and gradients (fp32, 10 steps).
TEST(MpiContextParallelModel, RingAndUlyssesReproduceTheSingleProcessRun) {
  auto world = make_mpi_communicator();
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    for (const bool ulysses : {false, true}) {
      for (const char* optimizer : {"sgd", "adamw"}) {
        check_cp(*world, model_preset(preset), ulysses, optimizer, false,
                 str_cat(preset, ulysses ? " ulysses, " : " ring, ", optimizer));
      }
    }
  }
}

// The gated DeltaNet sub-layer alone (f64) on cp = 2 ranks: each rank's zig-zag chunks, the state
// relayed between them, give the whole sequence's output (gathered), input gradient and (summed
// over the ranks) parameter gradients.
TEST(MpiContextParallelLinearAttention, SpansOnTwoRanksEqualTheWholeSequence) {
  auto world = make_mpi_communicator();
  if (world->size() != 2) GTEST_SKIP() << "runs under np 2";
  auto be = make_cpu_backend();
  Allocator& a = be->allocator();
  const GatedDeltaNetShape sh{2, 4, 4, 3, 4};
  const int64_t B = 2, T = 16, C = 8, Tl = T / 2;
  ModelConfig config = model_preset("llama-tiny");
  config.d_model = C;
  const std::vector<Shape> shapes = {{C}, {sh.qkvz_width(), C}, {2 * sh.value_heads, C}, {sh.conv_width(), sh.conv_taps},
                                     {sh.value_heads}, {sh.value_heads}, {sh.value_dim}, {C, sh.v_width()}};
  GatedDeltaNetParams p, g;
  std::vector<Tensor*> ps = {&p.norm_w, &p.qkvz_w, &p.ba_w, &p.conv_w, &p.a_log, &p.dt_bias, &p.gate_norm_w, &p.out_w};
  std::vector<Tensor*> gs = {&g.norm_w, &g.qkvz_w, &g.ba_w, &g.conv_w, &g.a_log, &g.dt_bias, &g.gate_norm_w, &g.out_w};
  for (size_t i = 0; i < ps.size(); ++i) {
    *ps[i] = test::random_tensor(a, shapes[i], DTYPE_F64, 10 + i, 0.4);
    *gs[i] = Tensor::zeros(a, shapes[i], DTYPE_F64, MEM_GRADIENTS);
  }
  const Tensor x = test::random_tensor(a, {B, T, C}, DTYPE_F64, 3, 0.8), w = test::random_tensor(a, {B, T, C}, DTYPE_F64, 4);
  const auto record = [&](int64_t t, bool spans) {
    GatedDeltaNetSaved s;
    gated_delta_net_saved_fields(sh, B, t, C, s, [&](Tensor& f, Shape dims, DType dt) {
      f = Tensor::zeros(a, std::move(dims), dt, MEM_ACTIVATIONS);
    }, DTYPE_F64, spans);
    return s;
  };
  const auto gathered_grads = [&] {
    std::vector<double> all;
    for (Tensor* t : gs) {
      const std::vector<double> v = test::values(*t);
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  };
  // The whole sequence on one rank.
  GatedDeltaNet whole(config, sh, p, g);
  GatedDeltaNetSaved ws = record(T, false);
  const Tensor out = Tensor::zeros(a, {B, T, C}, DTYPE_F64, MEM_WORKSPACE), d = Tensor::zeros(a, {B, T, C}, DTYPE_F64, MEM_WORKSPACE);
  whole.forward(*be, x, ws, out);
  be->copy(w, d);
  whole.backward(*be, x, ws, d);
  const std::vector<double> grads_whole = gathered_grads();
  for (Tensor* t : gs) t->zero_();
  // This rank's chunks.
  ContextParallel cp;
  cp.comm = world.get();
  GatedDeltaNet part(config, sh, p, g);
  part.set_context_parallel(&cp);
  const Tensor xl = Tensor::zeros(a, {B, Tl, C}, DTYPE_F64, MEM_WORKSPACE), wl = Tensor::zeros(a, {B, Tl, C}, DTYPE_F64, MEM_WORKSPACE);
  cp_take_local(x, xl, world->rank(), 2);
  cp_take_local(w, wl, world->rank(), 2);
  GatedDeltaNetSaved ls = record(Tl, true);
  const Tensor outl = Tensor::zeros(a, {B, Tl, C}, DTYPE_F64, MEM_WORKSPACE);
  part.forward(*be, xl, ls, outl);
  part.backward(*be, xl, ls, wl);
  const Tensor out_all = Tensor::zeros(a, {B, T, C}, DTYPE_F64, MEM_WORKSPACE), d_all = Tensor::zeros(a, {B, T, C}, DTYPE_F64, MEM_WORKSPACE);
  cp_gather_sequence(*be, *world, outl, out_all);
  cp_gather_sequence(*be, *world, wl, d_all);
  for (Tensor* t : gs) world->all_reduce(*t);
  const double e_out = test::max_rel_error(test::values(out_all), test::values(out));
  const double e_dx = test::max_rel_error(test::values(d_all), test::values(d));
  const double e_grads = test::max_rel_error(gathered_grads(), grads_whole);
  EXPECT_LT(e_out, 1e-12);
  EXPECT_LT(e_dx, 1e-12);
  EXPECT_LT(e_grads, 1e-12);
  if (world->rank() == 0) {
    std::printf("gated DeltaNet cp=2 vs whole (f64): output %.1e, d(input) %.1e, parameter gradients %.1e\n", e_out, e_dx,
                e_grads);
  }
}

// Qwen3-Next's hybrid blocks under context parallelism (dense MLPs: MoE with cp is not supported
// yet): the gated DeltaNet block relays its recurrent state (conv inputs and delta state) from
// chunk to chunk in sequence order across the zig-zag ranks, d(state) back in the backward; the
// gated-attention block runs ring or Ulysses attention with partial RoPE. cp = 2 (dp 2 x cp 2 at
// np 4): the one-process losses and gradients (SGD and AdamW, 10 steps), within 1e-5.
TEST(MpiContextParallelModel, LinearAttentionRelaysItsStateAndReproducesTheSingleProcessRun) {
  auto world = make_mpi_communicator();
  ModelConfig config = model_preset("qwen3-next-tiny");
  config.moe_experts = 0, config.moe_shared = 0, config.moe_shared_gate = false;
  for (const bool ulysses : {false, true}) {
    for (const char* optimizer : {"sgd", "adamw"}) {
      check_cp(*world, config, ulysses, optimizer, false,
               str_cat("qwen3-next-tiny (dense)", ulysses ? " ulysses, " : " ring, ", optimizer));
    }
  }
}

// LoRA (every linear layer, the base frozen) and loss masks under context parallelism: the
// adapters are per-position linear maps and their gradients reduce over dp x cp like any other;
// the masked positions are counted over the same group. cp = 2 (ring and Ulysses; dp 2 x cp 2
// at np 4): the one-process losses and gradients (SGD, 10 steps).
TEST(MpiContextParallelModel, LoraAndLossMasksReproduceTheSingleProcessRun) {
  auto world = make_mpi_communicator();
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    for (const bool lora : {false, true}) {
      ModelConfig config = model_preset(preset);
      if (lora) {
        config.peft_method = PeftMethod::lora, config.lora_rank = 4, config.lora_alpha = 8.0f;
        config.lora_targets = config.arch == ARCH_GPT2 ? "q,k,v,o,up,down" : "q,k,v,o,gate,up,down";
      }
      for (const bool ulysses : {false, true}) {
        check_cp(*world, config, ulysses, "sgd", true,
                 str_cat(preset, lora ? " LoRA" : "", " masked, ", ulysses ? "ulysses" : "ring"));
      }
    }
  }
}

}  // namespace
}  // namespace loom
