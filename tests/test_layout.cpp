// The layout component: RangeSet's set algebra against a naive per-element reference, and the
// compatibility table's verdicts (each refusal names its keys; keys without effect are noted).
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "loom/core/error.h"
#include "loom/core/range_set.h"
#include "loom/train/layout.h"
#include "test_util.h"

namespace loom {
using test::error_of;
namespace {

std::set<int64_t> elements(const RangeSet& s) {
  std::set<int64_t> out;
  for (const Range& r : s) {
    for (int64_t i = r.begin; i < r.end; ++i) out.insert(i);
  }
  return out;
}

RangeSet random_set(uint64_t seed, int64_t n) {
  std::mt19937_64 rng(seed);
  std::vector<Range> ranges;
  int64_t at = 0;
  while (at < n) {
    const int64_t gap = static_cast<int64_t>(rng() % 5), len = 1 + static_cast<int64_t>(rng() % 7);
    ranges.push_back({at + gap, std::min(n, at + gap + len)});
    at += gap + len;
  }
  return RangeSet(std::move(ranges));
}

TEST(RangeSetTest, NormalisesSortsMergesAndDropsEmpty) {
  const RangeSet s(std::vector<Range>{{10, 12}, {0, 3}, {3, 5}, {7, 7}, {11, 15}});
  ASSERT_EQ(s.ranges().size(), 2u);
  EXPECT_EQ(s.ranges()[0], (Range{0, 5}));
  EXPECT_EQ(s.ranges()[1], (Range{10, 15}));
  EXPECT_EQ(s.size(), 10);
}

TEST(RangeSetTest, SetAlgebraEqualsThePerElementReference) {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    const RangeSet a = random_set(seed, 60), b = random_set(seed + 1000, 60);
    const std::set<int64_t> ea = elements(a), eb = elements(b);
    std::set<int64_t> inter, diff, uni = ea;
    for (int64_t x : ea) (eb.count(x) ? inter : diff).insert(x);
    uni.insert(eb.begin(), eb.end());
    EXPECT_EQ(elements(a.intersect(b)), inter) << seed;
    EXPECT_EQ(elements(a.subtract(b)), diff) << seed;
    EXPECT_EQ(elements(a.unite(b)), uni) << seed;
    // pieces(begin, end): positions of the concatenation, as flat elements.
    const std::vector<int64_t> flat(ea.begin(), ea.end());
    const int64_t lo = static_cast<int64_t>(flat.size()) / 3, hi = 2 * static_cast<int64_t>(flat.size()) / 3;
    const std::set<int64_t> expect(flat.begin() + lo, flat.begin() + hi);
    EXPECT_EQ(elements(a.pieces(lo, hi)), expect) << seed;
    // Results are normalised: ascending, disjoint, never touching.
    for (const RangeSet& r : {a.intersect(b), a.subtract(b), a.unite(b)}) {
      for (size_t i = 1; i < r.ranges().size(); ++i) EXPECT_LT(r.ranges()[i - 1].end, r.ranges()[i].begin);
    }
  }
}

LoomConfig tiny() {
  LoomConfig c;
  c.model.n_layer = 2, c.model.n_head = 4, c.model.n_kv_head = 2, c.model.d_model = 32, c.model.d_ff = 64;
  c.model.max_seq_len = 32, c.train.seq_len = 32;
  return c;
}

BackendCapabilities all_caps() { return kEveryCapability; }

std::vector<std::string> verdict(const LoomConfig& c, int world, BackendCapabilities caps = all_caps()) {
  return check_layout(layout_facts(c, world, caps, "test"));
}

TEST(LayoutTableTest, AcceptsSupportedLayoutsWithoutNotes) {
  LoomConfig c = tiny();
  EXPECT_TRUE(verdict(c, 1).empty());
  c.parallel.tp = 2, c.parallel.sequence_parallel = true, c.parallel.zero_stage = 1;
  EXPECT_TRUE(verdict(c, 4).empty());  // tp2 + sp x dp2 with ZeRO-1
}

TEST(LayoutTableTest, UlyssesHeadsMustDivideCpBeforeAnythingRuns) {
  LoomConfig c = tiny();
  c.parallel.cp = 4, c.parallel.cp_attention = CpAttention::ulysses;  // n_kv_head 2 is not a multiple of 4
  const std::string msg = error_of([&] { verdict(c, 4); });
  EXPECT_NE(msg.find("parallel.cp_attention = ulysses"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.n_kv_head (2)"), std::string::npos) << msg;
  c.parallel.cp_attention = CpAttention::ring;
  EXPECT_TRUE(verdict(c, 4).empty());
}

TEST(LayoutTableTest, KeysWithoutEffectAreNoted) {
  LoomConfig c = tiny();
  c.parallel.sequence_parallel = true;
  std::vector<std::string> notes = verdict(c, 1);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("parallel.sequence_parallel has no effect"), std::string::npos) << notes[0];
  c = tiny();
  c.parallel.zero_stage = 2;
  notes = verdict(c, 1);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("parallel.zero_stage = 2 has no effect"), std::string::npos) << notes[0];
  EXPECT_TRUE(verdict(c, 2).empty());  // two data-parallel ranks: it shards
  EXPECT_TRUE(verdict(c, 0).empty());  // world unknown (loom memory): nothing said
}

TEST(LayoutTableTest, SequenceParallelWithZero2IsRefusedAtEveryRankCount) {
  LoomConfig c = tiny();
  c.parallel.tp = 2, c.parallel.sequence_parallel = true, c.parallel.zero_stage = 2;
  for (int world : {2, 4}) {
    const std::string msg = error_of([&] { verdict(c, world); });
    EXPECT_NE(msg.find("parallel.sequence_parallel with parallel.zero_stage = 2"), std::string::npos) << world << msg;
  }
}

TEST(LayoutTableTest, RefusalsNameTheirKeys) {
  struct Case {
    const char* set;
    int world;
    const char* needle;
  };
  const Case cases[] = {
      {"model.mla_kv_rank=16,model.arch=\"llama\",parallel.tp=2", 2, "model.mla_kv_rank"},
      {"train.flash_attention=true,parallel.pp=2", 2, "train.flash_attention"},
      {"model.attn_window=8,parallel.cp=2", 2, "model.attn_window"},
      {"parallel.ep=2", 2, "parallel.ep = 2 needs an MoE model"},
      {"parallel.pp=2,parallel.zero_stage=2", 4, "use zero_stage 0 or 1"},
      {"optim.name=\"adafactor\",parallel.zero_stage=1", 2, "element-wise optimizer"},
      {"optim.name=\"ldadam\"", 2, "data parallelism is not supported with optim.name = ldadam"},
      {"parallel.tp=3", 3, "parallel.tp = 3 must divide model.n_head"},
      {"parallel.cp=2,train.seq_len=30", 2, "train.seq_len divisible by 2 x parallel.cp"},
      {"train.recompute=\"full\",parallel.tp=2", 2, "train.recompute = full"},
  };
  for (const Case& k : cases) {
    LoomConfig c = tiny();
    apply_overrides(c, k.set);
    const std::string msg = error_of([&] { verdict(c, k.world); });
    EXPECT_NE(msg.find(k.needle), std::string::npos) << k.set << ": " << msg;
  }
}

// One owner for every refusal: each combination the Trainer, the Transformer, QLoRA's base and the
// objectives assert (LOOM_REFUSED, core/error.h) is refused by the table first, by its own row
// (the message is the table's, not the assertion's).
TEST(LayoutTableTest, EveryCombinationTheComponentsAssertIsTheTablesRefusal) {
  struct Case {
    const char* set;
    int world;
    const char* needle;
  };
  const char* moe = "model.arch=\"llama\",model.moe_experts=4,model.moe_top_k=2,model.moe_d_ff=16";
  const char* mla = "model.arch=\"llama\",model.mla_kv_rank=16,model.mla_rope_dim=8,model.mla_v_dim=8,model.mla_q_rank=16";
  const Case cases[] = {
      // Trainer
      {"parallel.ep=2,parallel.zero_stage=1,MOE", 2, "with parallel.ep > 1 is not supported"},
      {"parallel.pp=2,parallel.zero_stage=2", 4, "use zero_stage 0 or 1"},
      {"parallel.pp=2,optim.name=\"adafactor\"", 2, "needs an element-wise optimizer"},
      {"parallel.zero_stage=1,optim.name=\"adafactor\"", 2, "element-wise optimizer"},
      {"parallel.pp=2,train.recompute=\"full\"", 2, "with parallel.pp > 1 is not supported"},
      {"parallel.pp=2,train.flash_attention=true", 2, "train.flash_attention"},
      {"optim.name=\"ldadam\"", 2, "data parallelism is not supported with optim.name = ldadam"},
      {"parallel.compression=\"topk\",parallel.zero_stage=2", 2, "replaces DDP's all-reduce"},
      {"parallel.zero_stage=3,precision.param=\"bf16\"", 2, "parallel.zero_stage = 3 shards the fp32 parameters"},
      {"parallel.tp=2,optim.name=\"adafactor\"", 2, "tensor parallelism needs an element-wise optimizer"},
      {"parallel.tp=2,parallel.sequence_parallel=true,parallel.zero_stage=2", 2, "parallel.sequence_parallel with"},
      {"precision.loss_scaling=true,optim.name=\"ldadam\"", 1, "precision.loss_scaling is not supported with"},
      // Transformer
      {"train.recompute=\"full\",MLA", 1, "with activation checkpointing"},
      {"train.recompute=\"full\",parallel.cp=2", 2, "train.recompute = full"},
      {"data.document_mask=true,parallel.tp=2,parallel.sequence_parallel=true", 2, "data.document_mask with learned"},
      {"data.document_mask=true,parallel.cp=2", 2, "data.document_mask is not supported with context"},
      {"parallel.tp=2,parallel.sequence_parallel=true,MOE", 2, "parallel.sequence_parallel with an MoE model"},
      {"parallel.tp=2,parallel.sequence_parallel=true,parallel.cp=2", 4, "with parallel.sequence_parallel is not"},
      {"parallel.cp=2,MOE", 2, "parallel.cp > 1 with an MoE model"},
      // QLoRA's base
      {"peft.quantize_base=true", 1, "peft.quantize_base (QLoRA) needs peft.method = lora"},
      {"peft.method=\"lora\",peft.quantize_base=true,MOE", 1, "peft.quantize_base (QLoRA) is not supported yet"},
      // Objectives (their rows' ObjectiveLayout, and DPO's live reference)
      {"train.objective=\"dpo\",parallel.tp=2", 2, "train.objective = dpo does not run with tensor"},
      {"train.objective=\"grpo\"", 2, "train.objective = grpo does not run with 2 data-parallel ranks"},
      {"train.objective=\"distill\",parallel.pp=2", 2, "train.objective = distill does not run with"},
      {"train.objective=\"kto\"", 2, "train.objective = kto does not run with 2 data-parallel ranks"},
      {"train.objective=\"dpo\",dpo.reference=\"live\",parallel.zero_stage=3", 2, "dpo.reference = live copies"},
  };
  for (const Case& k : cases) {
    LoomConfig c = tiny();
    std::string set = k.set;
    for (const auto& [name, value] : {std::pair<std::string, const char*>{"MOE", moe}, {"MLA", mla}}) {
      if (const size_t at = set.find(name); at != std::string::npos) set.replace(at, name.size(), value);
    }
    apply_overrides(c, set);
    const std::string msg = error_of([&] { verdict(c, k.world); });
    EXPECT_NE(msg.find(k.needle), std::string::npos) << set << ": " << msg;
    EXPECT_EQ(msg.find("refused first by the layout table"), std::string::npos) << set << ": " << msg;
  }
}

TEST(LayoutTableTest, BackendCapabilitiesAreRefusedByName) {
  LoomConfig c = tiny();
  EXPECT_TRUE(verdict(c, 2, BackendCapabilities{}).empty());  // DDP with AdamW: every op is the backend's
  c.train.optim.name = "lion";
  std::string msg = error_of([&] { verdict(c, 1, BackendCapabilities{}); });
  EXPECT_NE(msg.find("optim.name = lion"), std::string::npos) << msg;
  EXPECT_NE(msg.find("test backend"), std::string::npos) << msg;
  EXPECT_TRUE(verdict(c, 1, BackendCapabilities{.every_optimizer = true}).empty());  // the optimizer ops
  for (const char* name : {"adam", "adamw"}) {  // only plain AdamW has the fused adamw_step
    c.train.optim.name = name;
    c.train.optim.amsgrad = std::string(name) == "adamw";
    msg = error_of([&] { verdict(c, 1, BackendCapabilities{}); });
    EXPECT_NE(msg.find(str_cat("optim.name = ", name)), std::string::npos) << msg;
  }
  c = tiny();
  c.parallel.tp = 2;
  msg = error_of([&] { verdict(c, 2, BackendCapabilities{}); });
  EXPECT_NE(msg.find("parallel.tp = 2"), std::string::npos) << msg;
}

// With every capability stated, a CUDA device refuses nothing the CPU allows: every pipeline
// schedule, the interleaved one included (its exchanges are paired by round over NCCL:
// parallel/pipe_messages.h), passes the table on both.
TEST(LayoutTableTest, EveryPipelineScheduleRunsOnCudaAsOnTheCpu) {
  LoomConfig c = tiny();
  c.model.n_layer = 4;
  c.parallel.pp = 2, c.train.grad_accum = 4;
  for (const PipeScheduleKind k : {PipeScheduleKind::one_f_one_b, PipeScheduleKind::gpipe, PipeScheduleKind::zb_h1,
                                   PipeScheduleKind::interleaved}) {
    c.parallel.schedule = k;
    c.parallel.virtual_stages = k == PipeScheduleKind::interleaved ? 2 : 1;
    for (const DeviceType d : {DEVICE_CPU, DEVICE_CUDA}) {
      c.device = d;
      EXPECT_TRUE(verdict(c, 2).empty()) << enum_name(k) << (d == DEVICE_CUDA ? " on cuda" : " on the cpu");
    }
  }
}

}  // namespace
}  // namespace loom
