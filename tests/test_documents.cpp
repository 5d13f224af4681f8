// Packed documents (core/documents.h, data.document_mask): a row holding several documents,
// each ended by the separator token, attends only within each document and restarts its
// positions there, so it gives the loss and gradients of the same documents in rows of their
// own (padded, the padding's targets masked) -- for learned positions (gpt2) and RoPE (llama),
// the plain and the flash attention, a sliding window and selective recomputation. Without the
// mask the packed row gives something else (the test can fail).
#include <gtest/gtest.h>

#include <cmath>

#include "loom/core/documents.h"
#include "loom/core/targets.h"
#include "loom/data/loader.h"
#include "loom/model/transformer.h"
#include "test_util.h"

namespace loom {
namespace {

constexpr int32_t kEnd = 3;  // the separator of these tests' documents
constexpr int64_t kT = 16;

TEST(Documents, SpansSplitAfterEachSeparator) {
  const std::vector<int32_t> tokens = {5, 3, 7, 7, 3, 9,   // row 0: [0,2) [2,5) [5,6)
                                       1, 1, 1, 1, 1, 3};  // row 1: [0,6) (a final separator splits nothing)
  const DocumentSpans spans = document_spans(tokens.data(), 2, 6, kEnd);
  const DocumentSpans want = {{0, 0, 2}, {0, 2, 3}, {0, 5, 1}, {1, 0, 6}};
  EXPECT_EQ(spans, want);
  const std::vector<int32_t> plain = {1, 2, 4, 5, 6, 3};
  EXPECT_TRUE(document_spans(plain.data(), 1, 6, kEnd).empty()) << "one document per row: nothing to mask";
}

// Three documents: two ended by kEnd, the last cut by the row's end (its final target continues it).
std::vector<std::vector<int32_t>> documents(int32_t vocab) {
  std::vector<std::vector<int32_t>> docs = {std::vector<int32_t>(5), std::vector<int32_t>(7), std::vector<int32_t>(4)};
  int32_t v = 11;
  for (auto& d : docs) {
    for (int32_t& t : d) {
      t = 4 + (v = (v * 37 + 5) % (vocab - 4));  // never kEnd
    }
  }
  docs[0].back() = kEnd;
  docs[1].back() = kEnd;
  return docs;
}

struct Result {
  double loss = 0;  // mean over the counted targets
  std::vector<float> grads;
};

// Forward and backward of `rows` (each kT tokens + 1 target per position) through a model
// initialised with seed 5; the loss is the mean over the counted targets.
Result run(const ModelConfig& c, const std::vector<std::vector<int32_t>>& tokens,
           const std::vector<std::vector<int32_t>>& targets, bool document_mask, bool flash, RecomputePolicy recompute) {
  auto backend = make_cpu_backend();
  Transformer model(*backend, c);
  model.init_weights(5);
  model.set_flash_attention(flash);
  if (recompute != RECOMPUTE_NONE) model.set_recompute(std::vector<RecomputePolicy>(static_cast<size_t>(c.n_layer), recompute));
  const auto B = static_cast<int64_t>(tokens.size());
  ActivationStore s = model.allocate_store(B, kT);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < kT; ++t) {
      s.tokens.data<int32_t>()[b * kT + t] = tokens[static_cast<size_t>(b)][static_cast<size_t>(t)];
      s.targets.data<int32_t>()[b * kT + t] = targets[static_cast<size_t>(b)][static_cast<size_t>(t)];
    }
  }
  if (document_mask) s.docs = document_spans(s.tokens.data<int32_t>(), B, kT, kEnd);
  const int64_t counted = counted_targets(s.targets.data<int32_t>(), B * kT);
  const double weight = static_cast<double>(B * kT) / static_cast<double>(counted);  // mean over B T -> over counted
  model.zero_grads();
  Result r;
  r.loss = model.forward(s) * weight;
  model.backward(s, static_cast<float>(weight));
  r.grads.assign(model.grads().data<float>(), model.grads().data<float>() + model.grads().numel());
  return r;
}

struct Batches {
  std::vector<std::vector<int32_t>> packed_tokens, packed_targets, tokens, targets;
};

// The documents packed into one row (a target crossing into the next document masked, as the
// supervised data's prompt tokens are), and each in a row of its own, padded with masked targets.
Batches batches(int32_t vocab) {
  const auto docs = documents(vocab);
  Batches b;
  std::vector<int32_t> row, next;
  for (size_t d = 0; d < docs.size(); ++d) {
    std::vector<int32_t> x(kT, 1), y(kT, kIgnoreTarget);
    for (size_t t = 0; t < docs[d].size(); ++t) {
      const bool last = t + 1 == docs[d].size();
      const int32_t target = !last ? docs[d][t + 1] : d + 1 < docs.size() ? kIgnoreTarget : 9;
      x[t] = docs[d][t];
      y[t] = target;
      row.push_back(docs[d][t]);
      next.push_back(target);
    }
    b.tokens.push_back(x);
    b.targets.push_back(y);
  }
  EXPECT_EQ(row.size(), static_cast<size_t>(kT));
  b.packed_tokens = {row};
  b.packed_targets = {next};
  return b;
}

// fp32: the two computations differ only in the order of the weight gradients' sums over rows
// (padding rows add exact zeros): 1e-5 of the largest gradient, 1e-6 relative on the loss.
void expect_packed_equals_unpacked(const ModelConfig& c, bool flash, RecomputePolicy recompute, const std::string& what) {
  const Batches b = batches(static_cast<int32_t>(c.vocab_size));
  const Result packed = run(c, b.packed_tokens, b.packed_targets, true, flash, recompute);
  const Result alone = run(c, b.tokens, b.targets, false, flash, recompute);
  EXPECT_NEAR(packed.loss, alone.loss, 1e-6 * std::abs(alone.loss)) << what;
  const std::vector<double> gp(packed.grads.begin(), packed.grads.end()), ga(alone.grads.begin(), alone.grads.end());
  EXPECT_LT(test::max_rel_error(gp, ga), 1e-5) << what;
  // The same packed row without the mask attends across documents: another loss.
  const Result unmasked = run(c, b.packed_tokens, b.packed_targets, false, flash, recompute);
  EXPECT_GT(std::abs(unmasked.loss - alone.loss), 1e-4 * std::abs(alone.loss)) << what;
}

TEST(Documents, PackedRowEqualsDocumentsAlone) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig c = model_preset(preset);
    expect_packed_equals_unpacked(c, false, RECOMPUTE_NONE, str_cat(preset, " mha"));
    expect_packed_equals_unpacked(c, true, RECOMPUTE_NONE, str_cat(preset, " flash"));
    expect_packed_equals_unpacked(c, false, RECOMPUTE_SELECTIVE, str_cat(preset, " selective recompute"));
    expect_packed_equals_unpacked(c, false, RECOMPUTE_FULL, str_cat(preset, " full recompute"));
  }
  ModelConfig windowed = model_preset("llama-tiny");
  windowed.attn_window = 4;
  expect_packed_equals_unpacked(windowed, false, RECOMPUTE_NONE, "llama-tiny window 4");
  expect_packed_equals_unpacked(windowed, true, RECOMPUTE_NONE, "llama-tiny window 4 flash");
}

TEST(Documents, LoaderNamesTheSeparatorItWasGiven) {
  TokenSplit split;
  split.name = "train";
  split.tokens = {5, 6, kEnd, 7, 8, 9, kEnd, 4, 4};
  TokenLoader plain(split, 4, 1, LOADER_ORDER_SEQUENTIAL);
  EXPECT_EQ(plain.document_end(), -1);
  split.document_end = kEnd;
  TokenLoader loader(split, 4, 1, LOADER_ORDER_SEQUENTIAL);
  EXPECT_EQ(loader.document_end(), kEnd);
}

}  // namespace
}  // namespace loom
