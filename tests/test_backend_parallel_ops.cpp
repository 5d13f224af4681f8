// The model-parallel ops of the Backend interface (backend.h: vocab_embedding_forward ...
// ring_attention_block_backward), in the manner of test_backend_ops_nn.cpp and in its suite
// (fixture: backend_ops_fixture.h): each case runs the op on the backend under test and on the
// CPU and compares, then checks the CPU's results against a naive double reference written here
// from the ops' contracts. Backends without capabilities().model_parallel (CUDA today: the
// defaults throw) are skipped; the strict backend always runs.
#include <omp.h>

#include "backend_ops_fixture.h"

namespace loom::backend_ops_test {

namespace {

constexpr double kNaiveF32Tol = 1e-5;  // f32 kernels against the double reference, relative to the output's scale

double naive_tol(DType dtype) { return dtype == DTYPE_F64 ? 1e-12 : kNaiveF32Tol; }

// The zig-zag position of local row t of rank r's shard (chunk C, world N), as nn/context_parallel.h.
int64_t zigzag(int64_t t, int64_t C, int r, int N) { return t < C ? r * C + t : (2 * int64_t{N} - 1 - r) * C + t - C; }

// Ring attention's problem on rank r of N: q (B, Tl, H hd), the blocks k[o], v[o] (B, Tl, KV hd)
// of every owner o.
struct RingCase {
  int64_t B, Tl, H, KV, hd;
  int r, N;
};

// For local query i of head h (batch b): the visible keys (owner, row) and their scaled scores.
struct Visible {
  std::vector<std::pair<int, int64_t>> keys;
  std::vector<double> s;
};

Visible visible(const RingCase& c, const std::vector<double>& q, const std::vector<std::vector<double>>& k,
                int64_t b, int64_t h, int64_t i) {
  const int64_t C = c.Tl / 2, g = h / (c.H / c.KV);
  const int64_t pq = zigzag(i, C, c.r, c.N);
  Visible v;
  for (int o = 0; o < c.N; ++o) {
    for (int64_t j = 0; j < c.Tl; ++j) {
      if (zigzag(j, C, o, c.N) > pq) continue;
      double s = 0.0;
      for (int64_t e = 0; e < c.hd; ++e) {
        s += q[((b * c.Tl + i) * c.H + h) * c.hd + e] * k[o][((b * c.Tl + j) * c.KV + g) * c.hd + e];
      }
      v.keys.emplace_back(o, j);
      v.s.push_back(s / std::sqrt(static_cast<double>(c.hd)));
    }
  }
  return v;
}

}  // namespace

#define LOOM_SKIP_WITHOUT_MODEL_PARALLEL()                                                 \
  if (GetParam() != "strict" && !backend_->capabilities().model_parallel) {                \
    GTEST_SKIP() << backend_->name() << " lacks model parallelism (its defaults throw)"; \
  }

TEST_P(BackendOpsTest, VocabEmbeddingAndPositionsForwardBackward) {
  LOOM_SKIP_WITHOUT_MODEL_PARALLEL();
  const int64_t B = 2, T = 17, C = 37, V = 101, Vs = 52, begin = 51, valid = 50, Tmax = 40, first = 5;
  Operands x;
  x.tensors["tokens"] = ids({B, T}, V, 1);
  x.tensors["weight"] = rnd({Vs, C}, DTYPE_F32, 2);
  x.tensors["positions"] = rnd({Tmax, C}, DTYPE_F32, 3);
  x.tensors["dout"] = rnd({B, T, C}, DTYPE_F32, 4);
  x.tensors["out"] = nans({B, T, C}, DTYPE_F32);
  x.tensors["dweight"] = rnd({Vs, C}, DTYPE_F32, 5);
  x.tensors["dpositions"] = rnd({Tmax, C}, DTYPE_F32, 6);
  const Op op = [&](Backend& be, Operands& o) {
    be.vocab_embedding_forward(o["tokens"], o["weight"], begin, valid, o["out"]);
    be.add_positions(o["out"], o["positions"], first);
    be.vocab_embedding_backward(o["tokens"], o["dout"], o["dweight"], begin, valid);
    be.positions_backward(o["dout"], o["dpositions"], first);
  };
  const Tol tol = elementwise_tol(DTYPE_F32);
  check("vocab embedding (B 2, T 17, C 37, rows [51, 101))", x, op,
        {{"out", tol}, {"dweight", tol}, {"dpositions", tol}}, true);

  Operands ref = copy_to_host(x);
  op(*cpu_, ref);
  const Tensor& tok = x["tokens"];
  std::vector<double> w = test::values(x["weight"]), p = test::values(x["positions"]), d = test::values(x["dout"]);
  std::vector<double> out(static_cast<size_t>(B * T * C)), dw = test::values(x["dweight"]),
      dp = test::values(x["dpositions"]);
  for (int64_t i = 0; i < B * T; ++i) {
    const int64_t row = tok.data<int32_t>()[i] - begin, t = i % T;
    const bool mine = row >= 0 && row < valid;
    for (int64_t c = 0; c < C; ++c) {
      out[i * C + c] = (mine ? w[row * C + c] : 0.0) + p[(first + t) * C + c];
      if (mine) dw[row * C + c] += d[i * C + c];
      dp[(first + t) * C + c] += d[i * C + c];
    }
  }
  EXPECT_LE(test::max_rel_error(test::values(ref["out"]), out), kNaiveF32Tol);
  EXPECT_LE(test::max_rel_error(test::values(ref["dweight"]), dw), kNaiveF32Tol);
  EXPECT_LE(test::max_rel_error(test::values(ref["dpositions"]), dp), kNaiveF32Tol);
}

TEST_P(BackendOpsTest, VocabCrossEntropyPartialsSumsFinishBackward) {
  LOOM_SKIP_WITHOUT_MODEL_PARALLEL();
  // (rows, global V, slice begin, slice rows, valid rows): an odd slice with a padding column, and GPT-2's vocabulary.
  struct Case {
    int64_t N, V, begin, Vs, valid;
  };
  for (const Case k : {Case{34, 101, 51, 52, 50}, Case{8, 50257, 25129, 25129, 25128}}) {
    Operands x;
    x.tensors["logits"] = rnd({k.N, k.Vs}, DTYPE_F32, 7, 4.0);
    x.tensors["inplace"] = rnd({k.N, k.Vs}, DTYPE_F32, 7, 4.0);  // the same values
    x.tensors["targets"] = ids({k.N}, static_cast<int32_t>(k.V), 8);
    x.tensors["lse"] = nans({k.N}, DTYPE_F32);
    x.tensors["losses"] = nans({k.N}, DTYPE_F32);
    x.tensors["sums"] = nans({k.N}, DTYPE_F32);
    x.tensors["dlogits"] = nans({k.N, k.Vs}, DTYPE_F32);
    const float scale = 0.37f;
    const Op op = [&](Backend& be, Operands& o) {
      be.vocab_ce_partials(o["logits"], o["targets"], k.begin, k.valid, o["lse"], o["losses"]);
      be.vocab_ce_sums(o["logits"], o["lse"], k.valid, o["sums"]);
      be.vocab_ce_finish(o["targets"], o["lse"], o["sums"], o["losses"]);
      be.vocab_ce_backward(o["logits"], o["targets"], o["lse"], k.begin, k.valid, scale, o["dlogits"]);
      be.vocab_ce_backward(o["inplace"], o["targets"], o["lse"], k.begin, k.valid, scale, o["inplace"]);
    };
    const Tol tol = reduction_tol(DTYPE_F32);
    check(str_cat("vocab cross-entropy (", k.N, ", ", k.Vs, ") of V ", k.V), x, op,
          {{"sums", tol}, {"lse", tol}, {"losses", tol}, {"dlogits", tol}, {"inplace", tol}}, true);

    Operands ref = copy_to_host(x);
    op(*cpu_, ref);
    EXPECT_TRUE(test::values(ref["inplace"]) == test::values(ref["dlogits"])) << "in place differs";
    const std::vector<double> lg = test::values(x["logits"]);
    std::vector<double> lse(static_cast<size_t>(k.N)), loss(lse.size()), dl(lg.size());
    for (int64_t r = 0; r < k.N; ++r) {
      double m = -kInf, s = 0.0;
      for (int64_t v = 0; v < k.valid; ++v) m = std::max(m, lg[r * k.Vs + v]);
      for (int64_t v = 0; v < k.valid; ++v) s += std::exp(lg[r * k.Vs + v] - m);
      const int64_t col = x["targets"].data<int32_t>()[r] - k.begin;
      const bool mine = col >= 0 && col < k.valid;
      lse[r] = m + std::log(s);
      loss[r] = lse[r] - (mine ? lg[r * k.Vs + col] : 0.0);
      for (int64_t v = 0; v < k.Vs; ++v) {
        dl[r * k.Vs + v] = v < k.valid ? scale * (std::exp(lg[r * k.Vs + v] - lse[r]) - (mine && v == col)) : 0.0;
      }
    }
    EXPECT_LE(test::max_rel_error(test::values(ref["lse"]), lse), kNaiveF32Tol);
    EXPECT_LE(test::max_rel_error(test::values(ref["losses"]), loss), kNaiveF32Tol);
    EXPECT_LE(test::max_rel_error(test::values(ref["dlogits"]), dl), kNaiveF32Tol);
  }
}

namespace {

// The naive double reference of ring attention over every block (the forward merges and finish,
// the row dots and the block backwards): out, lse, D, dq and each block's dk, dv, the gradients
// starting from their inputs' values.
struct RingReference {
  std::vector<double> out, lse, D, dq;
  std::vector<std::vector<double>> dk, dv;
};

RingReference ring_reference(const RingCase& c, const Operands& x) {
  const std::vector<double> q = test::values(x["q"]), dout = test::values(x["dout"]);
  std::vector<std::vector<double>> k, v;
  RingReference ref;
  ref.dq = test::values(x["dq"]);
  for (int o = 0; o < c.N; ++o) {
    k.push_back(test::values(x[str_cat("k", o)]));
    v.push_back(test::values(x[str_cat("v", o)]));
    ref.dk.push_back(test::values(x[str_cat("dk", o)]));
    ref.dv.push_back(test::values(x[str_cat("dv", o)]));
  }
  ref.out.assign(q.size(), 0.0);
  ref.lse.assign(static_cast<size_t>(c.B * c.H * c.Tl), 0.0);
  ref.D = ref.lse;
  const int64_t group = c.H / c.KV;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.hd));
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.H; ++h) {
      for (int64_t i = 0; i < c.Tl; ++i) {
        const Visible vis = visible(c, q, k, b, h, i);
        const int64_t st = (b * c.H + h) * c.Tl + i, qo = ((b * c.Tl + i) * c.H + h) * c.hd;
        double m = -kInf, l = 0.0;
        for (double s : vis.s) m = std::max(m, s);
        for (double s : vis.s) l += std::exp(s - m);
        ref.lse[st] = m + std::log(l);
        auto kv_off = [&](size_t n) { return ((b * c.Tl + vis.keys[n].second) * c.KV + h / group) * c.hd; };
        for (size_t n = 0; n < vis.keys.size(); ++n) {
          const double p = std::exp(vis.s[n] - ref.lse[st]);
          for (int64_t e = 0; e < c.hd; ++e) ref.out[qo + e] += p * v[vis.keys[n].first][kv_off(n) + e];
        }
        for (int64_t e = 0; e < c.hd; ++e) ref.D[st] += dout[qo + e] * ref.out[qo + e];
        for (size_t n = 0; n < vis.keys.size(); ++n) {
          const int o = vis.keys[n].first;
          const double p = std::exp(vis.s[n] - ref.lse[st]);
          double dp = 0.0;
          for (int64_t e = 0; e < c.hd; ++e) dp += dout[qo + e] * v[o][kv_off(n) + e];
          const double ds = p * (dp - ref.D[st]);
          for (int64_t e = 0; e < c.hd; ++e) {
            ref.dv[o][kv_off(n) + e] += p * dout[qo + e];
            ref.dq[qo + e] += scale * ds * k[o][kv_off(n) + e];
            ref.dk[o][kv_off(n) + e] += scale * ds * q[qo + e];
          }
        }
      }
    }
  }
  return ref;
}

}  // namespace

TEST_P(BackendOpsTest, RingAttentionMergeFinishAndBlockBackward) {
  LOOM_SKIP_WITHOUT_MODEL_PARALLEL();
  // One rank (plain causal attention), rank 1 of 2, rank 0 of 3 with one kv head.
  const std::vector<RingCase> cases = {{2, 8, 4, 2, 8, 0, 1}, {2, 6, 4, 2, 8, 1, 2}, {1, 10, 2, 1, 16, 0, 3}};
  for (DType dtype : kFloatTypes) {
    for (const RingCase& c : cases) {
      Operands x;
      x.tensors["q"] = rnd({c.B, c.Tl, c.H * c.hd}, dtype, 11);
      x.tensors["dout"] = rnd({c.B, c.Tl, c.H * c.hd}, dtype, 12);
      x.tensors["dq"] = rnd({c.B, c.Tl, c.H * c.hd}, dtype, 13);
      for (int o = 0; o < c.N; ++o) {
        const char* names[] = {"k", "v", "dk", "dv"};
        for (uint64_t n = 0; n < 4; ++n) {
          x.tensors[str_cat(names[n], o)] = rnd({c.B, c.Tl, c.KV * c.hd}, dtype, 20 + 4 * static_cast<uint64_t>(o) + n);
        }
      }
      x.tensors["out"] = nans({c.B, c.Tl, c.H * c.hd}, dtype);
      for (const char* name : {"lse", "l", "D"}) x.tensors[name] = nans({c.B, c.H, c.Tl}, dtype);
      x.tensors["scratch"] = nans({omp_get_max_threads() * c.Tl}, dtype);
      const Op op = [&](Backend& be, Operands& o) {
        be.fill(o["out"], 0.0);
        be.fill(o["lse"], -kInf);
        be.fill(o["l"], 0.0);
        for (int s = 0; s < c.N; ++s) {
          const int owner = (c.r - s + c.N) % c.N;
          be.ring_attention_merge(o["q"], o[str_cat("k", owner)], o[str_cat("v", owner)], o["out"], o["lse"], o["l"],
                                  o["scratch"], RingBlock{c.H, c.KV, c.r, c.N, owner});
        }
        be.ring_attention_finish(o["out"], o["lse"], o["l"], c.H);
        be.attention_row_dot(o["dout"], o["out"], o["D"], c.H);
        for (int owner = 0; owner < c.N; ++owner) {
          be.ring_attention_block_backward(o["q"], o["dout"], o["lse"], o["D"], o[str_cat("k", owner)],
                                           o[str_cat("v", owner)], o["dq"], o[str_cat("dk", owner)],
                                           o[str_cat("dv", owner)], RingBlock{c.H, c.KV, c.r, c.N, owner});
        }
      };
      const Tol tol = reduction_tol(dtype);
      std::vector<Output> outputs = {{"out", tol}, {"lse", tol}, {"D", tol}, {"dq", tol}};
      for (int o = 0; o < c.N; ++o) {
        outputs.push_back({str_cat("dk", o), tol});
        outputs.push_back({str_cat("dv", o), tol});
      }
      const std::string what = str_cat("ring attention ", dt(dtype), " rank ", c.r, " of ", c.N);
      check(what, x, op, outputs, true);

      Operands got = copy_to_host(x);
      op(*cpu_, got);
      const RingReference ref = ring_reference(c, x);
      const double t = naive_tol(dtype);
      EXPECT_LE(test::max_rel_error(test::values(got["out"]), ref.out), t) << what;
      EXPECT_LE(test::max_rel_error(test::values(got["lse"]), ref.lse), t) << what;
      EXPECT_LE(test::max_rel_error(test::values(got["D"]), ref.D), t) << what;
      EXPECT_LE(test::max_rel_error(test::values(got["dq"]), ref.dq), t) << what;
      for (int o = 0; o < c.N; ++o) {
        EXPECT_LE(test::max_rel_error(test::values(got[str_cat("dk", o)]), ref.dk[o]), t) << what << " dk" << o;
        EXPECT_LE(test::max_rel_error(test::values(got[str_cat("dv", o)]), ref.dv[o]), t) << what << " dv" << o;
      }
    }
  }
}

// copy_block: strided 2-D blocks as tensor parallelism's column slices, sequence parallelism's
// shards and Ulysses' head groups use them, in every dtype; bitwise the CPU's, and the CPU's
// bitwise a naive element loop; the elements outside the block untouched (the NaNs stay).
TEST_P(BackendOpsTest, CopyBlockIsTheNaiveStridedCopy) {
  LOOM_SKIP_WITHOUT_MODEL_PARALLEL();
  struct Case {
    BlockCopy b;
    int64_t src_n, dst_n;
  };
  const Case cases[] = {
      {{5, 7, 1, 3, 13, 0, 2, 9}, 6 * 13, 5 * 9 + 4},  // columns of a wide matrix into a narrower one
      {{3, 40, 0, 40, 80, 3, 0, 40}, 3 * 80, 6 * 40},  // a sequence shard: the second half of each row
      {{1, 17, 0, 0, 17, 0, 5, 30}, 17, 30},           // one row
      {{4, 0, 0, 0, 3, 0, 0, 3}, 12, 12},              // an empty block
  };
  for (const DType dtype : {DTYPE_F32, DTYPE_F64, DTYPE_BF16}) {
    for (const Case& c : cases) {
      Operands x;
      x.tensors["src"] = rnd({c.src_n}, dtype, 11);
      x.tensors["dst"] = nans({c.dst_n}, dtype);
      const Op op = [&](Backend& be, Operands& o) { be.copy_block(o["src"], o["dst"], c.b); };
      const std::string what = str_cat("copy_block ", dt(dtype), " ", c.b.rows, " x ", c.b.cols);
      check(what, x, op, {{"dst", kBitwise}}, true);

      Operands ref = copy_to_host(x);
      op(*cpu_, ref);
      const size_t e = dtype_size(dtype);
      std::vector<uint8_t> want(static_cast<size_t>(c.dst_n) * e);
      std::memcpy(want.data(), x["dst"].raw_data(), want.size());
      const auto* src = static_cast<const uint8_t*>(x["src"].raw_data());
      for (int64_t i = 0; i < c.b.rows; ++i) {
        for (int64_t j = 0; j < c.b.cols; ++j) {
          const int64_t from = (c.b.src_row + i) * c.b.src_stride + c.b.src_col + j;
          const int64_t to = (c.b.dst_row + i) * c.b.dst_stride + c.b.dst_col + j;
          std::memcpy(want.data() + to * e, src + from * e, e);
        }
      }
      EXPECT_EQ(std::memcmp(ref["dst"].raw_data(), want.data(), want.size()), 0) << what;
    }
  }
  // A block past either end is refused, naming the op.
  Operands x;
  x.tensors["src"] = rnd({20}, DTYPE_F32, 12);
  x.tensors["dst"] = nans({20}, DTYPE_F32);
  Operands on = copy_to_backend(x);
  const std::string past = error_of([&] { backend_->copy_block(on["src"], on["dst"], BlockCopy{3, 5, 2, 0, 5, 0, 0, 5}); });
  EXPECT_NE(past.find("copy_block"), std::string::npos) << past;
  const std::string wide = error_of([&] { backend_->copy_block(on["src"], on["dst"], BlockCopy{2, 5, 0, 1, 5, 0, 0, 5}); });
  EXPECT_NE(wide.find("copy_block"), std::string::npos) << wide;
}

}  // namespace loom::backend_ops_test
