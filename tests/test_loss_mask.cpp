// Loss masks (supervised fine-tuning: only the completion's tokens count): a target of
// kIgnoreTarget gives the cross-entropy ops loss 0 and a zero gradient row, and the trainer's
// loss is the mean over the step's positions that count, on every micro-batch (and rank)
// together: masked positions contribute nothing to the loss or the gradients (finite
// differences of the masked mean), and splitting the batch into micro-batches with different
// numbers of counted positions changes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>

#include <filesystem>
#include <fstream>

#include "loom/core/error.h"
#include "loom/data/loader.h"
#include "loom/data/chat_template.h"
#include "loom/data/sft.h"
#include "loom/data/shard.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

// Rows of a fixed batch, handed out `rows` at a time; row r's first mask[r] targets are masked.
class MaskedRows final : public BatchSource {
 public:
  MaskedRows(int64_t total_rows, int64_t T, int32_t vocab, std::vector<int64_t> masked)
      : T_(T), masked_(std::move(masked)) {
    for (int64_t r = 0; r < total_rows; ++r) {
      for (int64_t t = 0; t <= T; ++t) stream_.push_back(static_cast<int32_t>((r * 31 + t * 7 + t * t) % vocab));
    }
  }
  void fill(const Tensor& tokens, const Tensor& targets) override {
    const int64_t rows = tokens.numel() / T_;
    for (int64_t i = 0; i < rows; ++i, next_ = (next_ + 1) % static_cast<int64_t>(masked_.size())) {
      const int32_t* row = stream_.data() + next_ * (T_ + 1);
      for (int64_t t = 0; t < T_; ++t) {
        tokens.data<int32_t>()[i * T_ + t] = row[t];
        targets.data<int32_t>()[i * T_ + t] = t < masked_[static_cast<size_t>(next_)] ? kIgnoreTarget : row[t + 1];
      }
    }
  }

 private:
  int64_t T_, next_ = 0;
  std::vector<int64_t> masked_;
  std::vector<int32_t> stream_;
};

TEST(LossMask, CrossEntropyIgnoresMaskedRows) {
  auto backend = make_cpu_backend();
  Allocator& a = backend->allocator();
  const int64_t N = 6, V = 11;
  const Tensor logits = test::random_tensor(a, {N, V}, DTYPE_F32, 3);
  const Tensor targets = Tensor::empty(a, {N}, DTYPE_I32, MEM_WORKSPACE);
  for (int64_t i = 0; i < N; ++i) targets.data<int32_t>()[i] = i % 2 == 0 ? kIgnoreTarget : static_cast<int32_t>(i);
  const Tensor losses = Tensor::empty(a, {N}, DTYPE_F32, MEM_WORKSPACE), lse = Tensor::empty(a, {N}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor d = Tensor::empty(a, {N, V}, DTYPE_F32, MEM_WORKSPACE);
  backend->cross_entropy_forward(logits, targets, losses, lse);
  backend->cross_entropy_backward(logits, targets, lse, 0.5f, d);
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits.data<float>() + i * V;
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(x[v]));
    const double want = i % 2 == 0 ? 0.0 : std::log(sum) - x[i];
    EXPECT_NEAR(losses.data<float>()[i], want, 1e-5) << i;
    double row = 0;
    for (int64_t v = 0; v < V; ++v) row += std::abs(d.data<float>()[i * V + v]);
    if (i % 2 == 0) EXPECT_EQ(row, 0.0) << i;
    else EXPECT_GT(row, 0.0) << i;
  }
  targets.data<int32_t>()[1] = -1;  // another negative is still an error
  EXPECT_NE(test::error_of([&] { backend->cross_entropy_forward(logits, targets, losses, lse); }).find("target -1"),
            std::string::npos);
}

struct StepResult {
  double loss = 0;
  std::vector<float> grads;
};

// One step (the step's gradients stay in the model after its update).
StepResult step(const ModelConfig& c, int64_t batch, int64_t accum, int64_t T, const std::vector<int64_t>& masked) {
  auto backend = make_cpu_backend();
  Transformer model(*backend, c);
  model.init_weights(5);
  TrainConfig tc;
  tc.batch_size = batch, tc.seq_len = T, tc.grad_accum = accum, tc.steps = 1;
  tc.grad_clip = 0.0;
  Trainer trainer(*backend, model, tc);
  MaskedRows data(static_cast<int64_t>(masked.size()), T, static_cast<int32_t>(c.vocab_size), masked);
  StepResult r;
  r.loss = trainer.train_step(data).loss;
  r.grads.assign(model.grads().data<float>(), model.grads().data<float>() + model.grads().numel());
  return r;
}

TEST(LossMask, MaskedPositionsContributeNothingAndMicroBatchesDoNotMatter) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig c = model_preset(preset);
    const int64_t T = 12;
    const std::vector<int64_t> masked = {9, 2, 5, 11};  // rows with 3, 10, 7 and 1 counted targets
    const StepResult one = step(c, 4, 1, T, masked);
    // The loss: the mean of the counted positions' losses of a plain forward.
    auto backend = make_cpu_backend();
    Transformer model(*backend, c);
    model.init_weights(5);
    ActivationStore s = model.allocate_store(4, T);
    MaskedRows data(4, T, static_cast<int32_t>(c.vocab_size), masked);
    data.fill(s.tokens, s.targets);
    const auto masked_mean = [&] {
      model.forward(s);
      double sum = 0;
      int64_t n = 0;
      for (int64_t i = 0; i < s.targets.numel(); ++i) {
        if (s.targets.data<int32_t>()[i] == kIgnoreTarget) continue;
        sum += s.losses.data<float>()[i];
        ++n;
      }
      return sum / static_cast<double>(n);
    };
    EXPECT_NEAR(one.loss, masked_mean(), 1e-6 * one.loss) << preset;
    // The gradients: central differences of that masked mean (3 elements of every parameter).
    test::expect_gradients_match_fd(model, one.grads.data(), masked_mean, preset);
    // Four micro-batches of one row each (1 to 10 counted targets apiece): the same step.
    const StepResult four = step(c, 1, 4, T, masked);
    EXPECT_NEAR(four.loss, one.loss, 1e-6 * one.loss) << preset;
    std::vector<double> a(four.grads.begin(), four.grads.end()), b(one.grads.begin(), one.grads.end());
    EXPECT_LT(test::max_rel_error(a, b), 1e-5) << preset;
  }
}

// A step whose every target is masked (short windows between replies) has no loss: no update.
TEST(LossMask, AStepWithEveryTargetMaskedMakesNoUpdate) {
  auto backend = make_cpu_backend();
  Transformer model(*backend, model_preset("gpt2-tiny"));
  model.init_weights(5);
  const std::vector<float> before(model.params().data<float>(), model.params().data<float>() + model.params().numel());
  TrainConfig tc;
  tc.batch_size = 2, tc.seq_len = 12, tc.steps = 2;
  Trainer trainer(*backend, model, tc);
  MaskedRows data(2, 12, static_cast<int32_t>(model.config().vocab_size), {12, 12});
  const StepStats s = trainer.train_step(data);
  EXPECT_TRUE(s.skipped);
  EXPECT_TRUE(std::isnan(s.loss));
  EXPECT_EQ(s.grad_norm, 0.0);
  EXPECT_EQ(std::memcmp(before.data(), model.params().data<float>(), before.size() * sizeof(float)), 0);
  EXPECT_EQ(trainer.step(), 1);
}

// chat-jsonl and prompt/completion jsonl: the counted tokens are exactly the assistant's replies
// (with their end-of-turn marker) and the completions (with the end-of-text token); the mask
// goes through the dataset's shards and the loader's targets.
const char* kChatMl =
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

std::string write_lines(const std::string& name, const std::string& text) {
  const std::string path = (std::filesystem::temp_directory_path() / name).string();
  std::ofstream(path) << text;
  return path;
}

// The counted tokens' text, one string per run of counted tokens.
std::vector<std::string> counted_runs(const SftStream& s, const Tokenizer& tok) {
  std::vector<std::string> runs;
  for (size_t i = 0; i < s.tokens.size(); ++i) {
    if (!s.mask[i]) continue;
    size_t j = i;
    while (j < s.tokens.size() && s.mask[j]) ++j;
    runs.push_back(tok.decode(std::span<const int32_t>(s.tokens).subspan(i, j - i)));
    i = j;
  }
  return runs;
}

std::string counted_text(const SftStream& s, const Tokenizer& tok) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < s.tokens.size(); ++i) {
    if (s.mask[i]) ids.push_back(s.tokens[i]);
  }
  return tok.decode(ids);
}

TEST(SftData, ChatAndCompletionMasksCountOnlyTheReplies) {
  const auto tok = load_tokenizer("byte");
  const std::string chat = write_lines("loom_sft_chat.jsonl",
      "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"2+2?\"},"
      " {\"role\": \"assistant\", \"content\": \"4\"}, {\"role\": \"user\", \"content\": \"x3?\"},"
      " {\"role\": \"assistant\", \"content\": \"12\"}]}\n\n"
      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello\"}]}\n");
  const SftStream s = read_sft_file(chat, SftFormat::chat_jsonl, *tok, kChatMl);
  EXPECT_EQ(s.examples, 2);
  EXPECT_EQ(counted_text(s, *tok), "4<|im_end|>\n12<|im_end|>\nhello<|im_end|>\n");
  const std::string all = tok->decode(s.tokens);
  const std::string head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n";
  EXPECT_EQ(all.substr(0, head.size()), head);
  ASSERT_EQ(s.tokens.size(), s.mask.size());
  EXPECT_EQ(s.tokens.back(), tok->eot_token());
  EXPECT_EQ(s.mask.back(), 0);

  const std::string pc = write_lines("loom_sft_pc.jsonl", "{\"prompt\": \"Q: 1+1\\nA:\", \"completion\": \" 2\"}\n");
  const SftStream c = read_sft_file(pc, SftFormat::jsonl, *tok, "");
  EXPECT_EQ(counted_text(c, *tok), " 2<|endoftext|>");

  // Through the dataset's shards to the loader's targets.
  const std::string dir = (std::filesystem::temp_directory_path() / "loom_sft_ds").string();
  std::filesystem::remove_all(dir);
  write_dataset(dir, s.tokens, 257, "byte", 0.0, 16, s.mask);
  const TokenDataset ds = open_dataset(dir);
  ASSERT_EQ(ds.train.mask, s.mask);
  const int64_t T = 20;
  TokenLoader loader(ds.train, T, 1, LOADER_ORDER_SEQUENTIAL);
  auto backend = make_cpu_backend();
  const Tensor tokens = Tensor::empty(backend->allocator(), {1, T}, DTYPE_I32, MEM_WORKSPACE);
  const Tensor targets = Tensor::empty(backend->allocator(), {1, T}, DTYPE_I32, MEM_WORKSPACE);
  for (uint64_t w = 0; w < loader.windows_per_epoch(); ++w) {
    loader.fill(tokens, targets);
    for (int64_t t = 0; t < T; ++t) {
      const size_t next = static_cast<size_t>(w * T + t + 1);
      EXPECT_EQ(targets.data<int32_t>()[t], s.mask[next] ? s.tokens[next] : kIgnoreTarget) << w << " " << t;
    }
  }
  std::filesystem::remove_all(dir);
}

// The chat-jsonl spans are found from windows of each conversation (linear time); they must be
// exactly the spans of the definition, render(messages[:i], add_generation_prompt) to
// render(messages[:i+1]), which this test computes prefix by prefix, for templates shaped like
// released models' (BOS and trim as Llama 3, a default system prompt as Qwen2.5, a system prompt
// folded into the first turn and roles checked by parity as Gemma, tool responses merged with their
// neighbours as Qwen) and for ones the windows cannot reproduce (turn numbers, a think block only
// on the last message), which fall back to the prefixes or fail as they did.
TEST(SftData, ChatSpansFromWindowsAreTheSpansOfEveryPrefix) {
  const auto tok = load_tokenizer("byte");
  const std::string chatml_body =
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  const std::vector<std::string> templates = {
      kChatMl,
      "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}"
      "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
      "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}" + chatml_body,
      "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
      "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
      "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
      "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
      "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}<start_of_turn>{{ role }}\n"
      "{{ (first if loop.first else '') + message['content'] | trim }}<end_of_turn>\n{% endfor %}"
      "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
      "{% for m in messages %}{% if m.role == 'tool' %}{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
      "<|im_start|>user{% endif %}\n<tool_response>{{ m.content }}</tool_response>"
      "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}{% else %}"
      "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
      "{% for m in messages %}[{{ loop.index }}] {{ m.role }}: {{ m.content }}\n{% endfor %}"
      "{% if add_generation_prompt %}[{{ messages | length + 1 }}] assistant: {% endif %}",
  };
  // Conversations of up to 15 messages: with or without a system message, user and assistant
  // alternating, contents with spaces to trim, empty ones, and (some) two tool responses in a row.
  std::vector<nlohmann::json> conversations;
  for (int c = 0; c < 12; ++c) {
    nlohmann::json messages = nlohmann::json::array();
    if (c % 3 == 0) messages.push_back({{"role", "system"}, {"content", "Be brief. "}});
    const int turns = 1 + (c * 5) % 8;
    for (int t = 0; t < turns; ++t) {
      messages.push_back({{"role", "user"}, {"content", str_cat(" question ", c, ".", t, t % 3 == 0 ? "  " : "")}});
      if (c % 4 == 1 && t % 2 == 1) {
        messages.push_back({{"role", "assistant"}, {"content", "<tool_call>f()</tool_call>"}});
        messages.push_back({{"role", "tool"}, {"content", str_cat("r", t)}});
        messages.push_back({{"role", "tool"}, {"content", str_cat("s", t)}});
      }
      messages.push_back({{"role", "assistant"}, {"content", t % 4 == 2 ? std::string() : str_cat("answer ", c * 10 + t, "\n")}});
    }
    conversations.push_back({{"messages", messages}});
  }
  for (size_t k = 0; k < templates.size(); ++k) {
    const std::string& tmpl = templates[k];
    ChatTemplateOptions options = chat_template_options(*tok);
    for (const nlohmann::json& conversation : conversations) {
      std::vector<ChatMessage> messages;
      for (const auto& m : conversation["messages"]) messages.push_back({m["role"], m["content"]});
      const auto render = [&](size_t n, bool generation) {
        ChatTemplateOptions o = options;
        o.add_generation_prompt = generation;
        return render_chat_template(tmpl, std::vector<ChatMessage>(messages.begin(), messages.begin() + static_cast<long>(n)), o);
      };
      bool gemma_roles = true;  // roles alternate from the first non-system message
      for (size_t i = messages[0].role == "system" ? 1 : 0, j = 0; i < messages.size(); ++i, ++j)
        gemma_roles = gemma_roles && (messages[i].role == "user") == (j % 2 == 0);
      if (k == 3 && !gemma_roles) continue;
      const std::string full = render(messages.size(), false);
      std::vector<uint8_t> mask(full.size(), 0);
      for (size_t i = 0; i < messages.size(); ++i) {
        if (messages[i].role != "assistant") continue;
        const size_t begin = render(i, true).size(), end = render(i + 1, false).size();
        for (size_t b = begin; b < end; ++b) mask[b] = 1;
      }
      const std::string path = write_lines("loom_sft_windows.jsonl", conversation.dump() + "\n");
      const SftStream s = read_sft_file(path, SftFormat::chat_jsonl, *tok, tmpl);
      ASSERT_EQ(s.tokens.size(), full.size() + 1) << k << " " << conversation.dump();
      EXPECT_EQ(tok->decode(std::span<const int32_t>(s.tokens).first(full.size())), full) << k;
      mask.push_back(0);  // the end-of-text token
      EXPECT_EQ(s.mask, mask) << "template " << k << ": " << conversation.dump();
    }
  }
  // A think block on the last message only (Qwen3's loop.last): no prefix is a prefix of the
  // whole, from windows or not, and each reply is located in the whole rendering instead
  // (SftData.MultiTurnMasksEqualTrlsOnTheRealTemplates): as the whole rendering writes it, the
  // think block on the last one only.
  const std::string think =
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}<think></think>"
      "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  const std::string path = write_lines("loom_sft_windows.jsonl", conversations[5].dump() + "\n");
  EXPECT_EQ(counted_runs(read_sft_file(path, SftFormat::chat_jsonl, *tok, think), *tok),
            std::vector<std::string>({"answer 50\n<|im_end|>\n", "<tool_call>f()</tool_call><|im_end|>\n",
                                      "<think></think>answer 51\n<|im_end|>\n"}));
}

// A tokenizer for the mask tests: each special string one token (parsed where EncodeOptions
// asks), other text a token per byte or (pairs) per two bytes (a byte alone before a special
// token or at the end), so that tokens straddle the spans' edges. lossy: decode drops a leading
// space of what it decodes (as SentencePiece drops its dummy prefix), so tokens decoded one at a
// time do not give the text back.
class ToyTokenizer final : public Tokenizer {
 public:
  ToyTokenizer(std::vector<std::string> specials, const std::string& bos, const std::string& eos, bool pairs,
               bool lossy = false)
      : specials_(std::move(specials)), pairs_(pairs), lossy_(lossy) {
    specials_.push_back("<|endoftext|>");
    for (size_t k = 0; k < specials_.size(); ++k) {
      if (specials_[k] == bos && !bos.empty()) bos_ = static_cast<int32_t>(256 + k);
      if (specials_[k] == eos && !eos.empty()) eos_ = static_cast<int32_t>(256 + k);
    }
  }
  using Tokenizer::encode;
  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options) const override {
    std::vector<int32_t> ids;
    const auto special_at = [&](size_t i) -> int32_t {
      if (!options.parse_special_tokens) return -1;
      for (size_t k = 0; k < specials_.size(); ++k)
        if (text.substr(i, specials_[k].size()) == specials_[k]) return static_cast<int32_t>(k);
      return -1;
    };
    for (size_t i = 0; i < text.size();) {
      if (const int32_t k = special_at(i); k >= 0) {
        ids.push_back(256 + k);
        i += specials_[static_cast<size_t>(k)].size();
      } else if (pairs_ && i + 1 < text.size() && special_at(i + 1) < 0) {
        ids.push_back(1024 + static_cast<unsigned char>(text[i]) * 256 + static_cast<unsigned char>(text[i + 1]));
        i += 2;
      } else {
        ids.push_back(static_cast<unsigned char>(text[i++]));
      }
    }
    return ids;
  }
  std::string decode(std::span<const int32_t> tokens) const override {
    std::string out;
    for (const int32_t id : tokens) {
      if (id < 256) out.push_back(static_cast<char>(id));
      else if (id < 1024) out += specials_.at(static_cast<size_t>(id - 256));
      else out += {static_cast<char>((id - 1024) / 256), static_cast<char>((id - 1024) % 256)};
    }
    if (lossy_ && !out.empty() && out[0] == ' ') out.erase(0, 1);
    return out;
  }
  int64_t vocab_size() const override { return 1024 + 65536; }
  int32_t eot_token() const override { return static_cast<int32_t>(256 + specials_.size() - 1); }
  std::optional<int32_t> bos_token() const override { return bos_; }
  std::optional<int32_t> eos_token() const override { return eos_; }
  std::string token_text(int32_t id) const override { return decode(std::vector<int32_t>{id}); }
  std::string name() const override { return "toy"; }

 private:
  std::vector<std::string> specials_;
  bool pairs_, lossy_;
  std::optional<int32_t> bos_, eos_;
};

std::string chat_fixture(const std::string& name) {
  const char* source = std::getenv("LOOM_SOURCE_DIR");
  return ((source && *source ? std::filesystem::path(source) : std::filesystem::current_path()) / "tests" / "fixtures" /
          "chat_templates" / (name + ".json"))
      .string();
}

// Multi-turn SFT masks on the real chat templates, against TRL's (SFTConfig(assistant_only_loss=True):
// transformers' apply_chat_template(return_assistant_tokens_mask=True) renders the conversation
// once and marks the tokens from char_to_token(start) to char_to_token(end - 1) of each
// {% generation %} block's output). TRL cannot run here, so its rule is applied by Loom's own
// generation-block path (ChatTemplate.GenerationBlocksGiveTheRangesTheyRender checks the ranges) to
// copies of each real template with the blocks placed where TRL's training templates place them
// (huggingface/trl trl/chat_templates/*_training.jinja): llama3 = TRL's llama3_training.jinja as
// TRL ships it; Qwen3 and DeepSeek R1 / V3 = the real template with the assistant's output wrapped
// as qwen3_training.jinja / deepseekv3_training.jinja wrap it (the *_generation fixtures; their
// text is the original's, asserted here and against @huggingface/jinja in test_chat_template.cpp).
// Loom's masks come from the original templates, which have no blocks: each reply located by the
// definition or in the whole rendering (docs/finetune.md). Equal to TRL's token for token, but for
// one stated difference: TRL's DeepSeek templates put the generation prompt <｜Assistant｜> inside
// the block, and Loom leaves it out (it is the prompt add_generation_prompt writes at inference,
// not generated; TRL's own Llama 3, Qwen3 and Gemma templates leave their prompt cue out too), so
// TRL's mask is Loom's plus that one token before each reply. The expected replies are written out
// by hand from the renderings.
TEST(SftData, MultiTurnMasksEqualTrlsOnTheRealTemplates) {
  const std::vector<std::string> specials = {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                             "<|im_start|>", "<|im_end|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                                             "<｜User｜>", "<｜Assistant｜>"};
  using Runs = std::vector<std::string>;
  // A: a reply with reasoning, then one without; B: the reverse; C: a system message in the middle.
  const nlohmann::json A = {{{"role", "system"}, {"content", "You are terse."}}, {{"role", "user"}, {"content", "What is 2+2?"}},
                            {{"role", "assistant"}, {"content", "<think>\nAdd them.\n</think>\n\n4"}},
                            {{"role", "user"}, {"content", "And times 3?"}}, {{"role", "assistant"}, {"content", "12"}}};
  const nlohmann::json B = {{{"role", "system"}, {"content", "You are terse."}}, {{"role", "user"}, {"content", "What is 2+2?"}},
                            {{"role", "assistant"}, {"content", "4"}}, {{"role", "user"}, {"content", "And times 3?"}},
                            {{"role", "assistant"}, {"content", "<think>\nReason.\n</think>\n\n12"}}};
  const nlohmann::json C = {{{"role", "user"}, {"content", "a"}}, {{"role", "assistant"}, {"content", "b"}},
                            {{"role", "system"}, {"content", "Now in French."}}, {{"role", "user"}, {"content", "c"}},
                            {{"role", "assistant"}, {"content", "d"}}};
  const std::string eos = "<｜end▁of▁sentence｜>";
  struct Case {
    std::string original, trl;
    bool prompt_in_trl;     // TRL's block holds the generation prompt <｜Assistant｜>
    Runs a, b, c;           // Loom's replies on A, B, C
  };
  const std::vector<Case> cases = {
      {"llama3_instruct", "trl_llama3_training", false,
       {"<think>\nAdd them.\n</think>\n\n4<|eot_id|>", "12<|eot_id|>"},
       {"4<|eot_id|>", "<think>\nReason.\n</think>\n\n12<|eot_id|>"},
       {"b<|eot_id|>", "d<|eot_id|>"}},
      // The reasoning of a reply before the last user message is not in the whole rendering; the
      // last reply gets a think block, empty when it has no reasoning.
      {"qwen3_0_6b", "qwen3_0_6b_generation", false,
       {"4<|im_end|>\n", "<think>\n\n</think>\n\n12<|im_end|>\n"},
       {"4<|im_end|>\n", "<think>\nReason.\n</think>\n\n12<|im_end|>\n"},
       {"b<|im_end|>\n", "<think>\n\n</think>\n\nd<|im_end|>\n"}},
      // R1 keeps what follows </think>; every system message goes first.
      {"deepseek_r1", "deepseek_r1_generation", true,
       {"\n\n4" + eos, "12" + eos}, {"4" + eos, "\n\n12" + eos}, {"b" + eos, "d" + eos}},
      {"deepseek_v3", "deepseek_v3_generation", true,
       {"<think>\nAdd them.\n</think>\n\n4" + eos, "12" + eos}, {"4" + eos, "<think>\nReason.\n</think>\n\n12" + eos},
       {"b" + eos, "d" + eos}},
      // TRL's own DeepSeek-V3 pair: its generation prompt is <｜Assistant｜><think>\n, which no reply
      // starts with, so every reply is located.
      {"trl_deepseekv3", "trl_deepseekv3_training", true,
       {"\n\n4" + eos, "12" + eos}, {"4" + eos, "\n\n12" + eos}, {"b" + eos, "d" + eos}},
  };
  for (const Case& c : cases) {
    const nlohmann::json file = nlohmann::json::parse(std::ifstream(chat_fixture(c.original)));
    const std::string original = load_chat_template(chat_fixture(c.original)), trl = load_chat_template(chat_fixture(c.trl));
    for (const bool pairs : {false, true}) {
      const ToyTokenizer tok(specials, file["bos_token"], file["eos_token"], pairs);
      const int32_t prompt_token = tok.encode("<｜Assistant｜>", {.parse_special_tokens = true}).at(0);
      for (const auto& [messages, expected] : {std::pair{A, c.a}, std::pair{B, c.b}, std::pair{C, c.c}}) {
        const std::string path = write_lines("loom_sft_trl.jsonl", nlohmann::json{{"messages", messages}}.dump() + "\n");
        const SftStream loom = read_sft_file(path, SftFormat::chat_jsonl, tok, original);
        const SftStream want = read_sft_file(path, SftFormat::chat_jsonl, tok, trl);
        const std::string label = c.original + (pairs ? " (pairs) " : " ") + messages.dump();
        ASSERT_EQ(loom.tokens, want.tokens) << label;  // the same rendering
        if (!pairs) {
          EXPECT_EQ(counted_runs(loom, tok), expected) << label;
        }
        for (size_t t = 0; t < loom.tokens.size(); ++t) {
          const bool prompt = c.prompt_in_trl && loom.tokens[t] == prompt_token && t + 1 < loom.mask.size() && loom.mask[t + 1];
          EXPECT_EQ(want.mask[t], loom.mask[t] || prompt ? 1 : 0) << label << " token " << t;
        }
        if (!pairs && c.prompt_in_trl) {
          Runs with_prompt;
          for (const std::string& r : expected) with_prompt.push_back("<｜Assistant｜>" + r);
          EXPECT_EQ(counted_runs(want, tok), with_prompt) << label;
        }
      }
    }
  }
  // TRL's own Qwen3 training template also changes the text: it always writes the think block
  // (prefix-preserving for GRPO), so an earlier reply keeps its reasoning. Loom given that template
  // (--chat-template) trains on TRL's rendering and TRL's mask.
  const ToyTokenizer tok(specials, "", "<|im_end|>", false);
  const std::string path = write_lines("loom_sft_trl.jsonl", nlohmann::json{{"messages", A}}.dump() + "\n");
  EXPECT_EQ(counted_runs(read_sft_file(path, SftFormat::chat_jsonl, tok, load_chat_template(chat_fixture("trl_qwen3_training"))), tok),
            Runs({"<think>\nAdd them.\n</think>\n\n4<|im_end|>\n", "<think>\n\n</think>\n\n12<|im_end|>\n"}));
}

// The broken alternative: on Qwen3 the definition's span of the first reply, render(messages[:2],
// add_generation_prompt) to render(messages[:3]), is the reply with its reasoning, which the whole
// rendering does not hold: taken as offsets into the whole rendering it would count the next
// user message and miss TRL's mask (Loom refused such conversations before).
TEST(SftData, PerPrefixSpansWouldMissQwen3sMask) {
  const std::string tmpl = load_chat_template(chat_fixture("qwen3_0_6b"));
  const std::vector<ChatMessage> messages = {{"system", "You are terse."}, {"user", "What is 2+2?"},
                                             {"assistant", "<think>\nAdd them.\n</think>\n\n4"},
                                             {"user", "And times 3?"}, {"assistant", "12"}};
  ChatTemplateOptions options;
  const std::string full = render_chat_template(tmpl, messages, options);
  options.add_generation_prompt = true;
  const std::string prompt = render_chat_template(tmpl, {messages.begin(), messages.begin() + 3 - 1}, options);
  options.add_generation_prompt = false;
  const std::string through = render_chat_template(tmpl, {messages.begin(), messages.begin() + 3}, options);
  EXPECT_EQ(through.substr(prompt.size()), "<think>\nAdd them.\n</think>\n\n4<|im_end|>\n");
  EXPECT_NE(full.compare(0, through.size(), through), 0);
  const std::string by_prefix = full.substr(prompt.size(), through.size() - prompt.size());
  EXPECT_EQ(by_prefix, "4<|im_end|>\n<|im_start|>user\nAnd times 3");  // 40 bytes, as the reply with its reasoning
  const ToyTokenizer tok({"<|im_start|>", "<|im_end|>"}, "", "<|im_end|>", false);
  const std::string path = write_lines("loom_sft_trl.jsonl",
      nlohmann::json{{"messages", {{{"role", "system"}, {"content", messages[0].content}}, {{"role", "user"}, {"content", messages[1].content}},
                                   {{"role", "assistant"}, {"content", messages[2].content}}, {{"role", "user"}, {"content", messages[3].content}},
                                   {{"role", "assistant"}, {"content", messages[4].content}}}}}.dump() + "\n");
  const std::vector<std::string> trl = counted_runs(
      read_sft_file(path, SftFormat::chat_jsonl, tok, load_chat_template(chat_fixture("qwen3_0_6b_generation"))), tok);
  EXPECT_EQ(trl.at(0), "4<|im_end|>\n");
  EXPECT_NE(trl.at(0), by_prefix);
}

// A token straddling a span's edge counts (transformers' char_to_token rule), the whole rendering
// tokenized once; a tokenizer whose tokens do not decode to the text one at a time has each piece
// tokenized on its own instead. "user: hey\nassistant: yo\n" in two-byte tokens: ..., "t:", " y",
// "o\n": the reply "yo\n" (from byte 21) starts inside " y" (bytes 20-21).
TEST(SftData, TokensStraddlingASpanEdgeCount) {
  const std::string located =
      "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}";
  const std::string blocks =
      "{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}{{ m.content }}\n{% endgeneration %}"
      "{% else %}{{ m.content }}\n{% endif %}{% endfor %}";
  const std::string path = write_lines("loom_sft_straddle.jsonl",
      "{\"messages\": [{\"role\": \"user\", \"content\": \"hey\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n");
  const ToyTokenizer pairs({}, "", "", true);
  for (const std::string& tmpl : {located, blocks}) {
    const SftStream s = read_sft_file(path, SftFormat::chat_jsonl, pairs, tmpl);
    EXPECT_EQ(s.tokens.size(), 13u);  // 12 pairs and the end-of-text token
    EXPECT_EQ(counted_runs(s, pairs), std::vector<std::string>{" yo\n"});
    EXPECT_EQ(s.counted, 2);
  }
  const ToyTokenizer lossy({}, "", "", true, true);
  const SftStream s = read_sft_file(path, SftFormat::chat_jsonl, lossy, located);
  EXPECT_EQ(counted_runs(s, lossy), std::vector<std::string>{"yo\n"});
  EXPECT_EQ(s.counted, 2);  // "yo", "\n"
}

TEST(SftData, BadLinesNameTheFileAndLine) {
  const auto tok = load_tokenizer("byte");
  const auto error = [&](const std::string& text, SftFormat f, const std::string& tmpl = kChatMl) {
    const std::string path = write_lines("loom_sft_bad.jsonl", text);
    return test::error_of([&] { read_sft_file(path, f, *tok, tmpl); });
  };
  const std::string ok = "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\"}]}\n";
  EXPECT_NE(error(ok + "{\"messages\": [\n", SftFormat::chat_jsonl).find("loom_sft_bad.jsonl:2: not valid JSON"), std::string::npos);
  EXPECT_NE(error("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n", SftFormat::chat_jsonl)
                .find("loom_sft_bad.jsonl:1: the conversation has no assistant message"), std::string::npos);
  EXPECT_NE(error(ok, SftFormat::chat_jsonl, "{{ raise_exception('no system role') }}").find("does not render"),
            std::string::npos);
  EXPECT_NE(error("{\"messages\": [{\"role\": \"user\"}]}\n", SftFormat::chat_jsonl).find("messages[0]: expected a string \"content\""),
            std::string::npos);
  EXPECT_NE(error(ok, SftFormat::chat_jsonl, "").find("needs a chat template"), std::string::npos);
  EXPECT_NE(error("{\"prompt\": \"a\"}\n", SftFormat::jsonl).find("loom_sft_bad.jsonl:1: expected a string \"completion\""),
            std::string::npos);
  // A reply the whole rendering does not hold (this template writes an assistant message only
  // when it is the last): refused, naming the line and the message.
  const std::string lost =
      "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}assistant: {% endif %}";
  const std::string two = "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", \"content\": \"a\"}, "
                          "{\"role\": \"user\", \"content\": \"r\"}, {\"role\": \"assistant\", \"content\": \"b\"}]}\n";
  EXPECT_NE(error(ok + two, SftFormat::chat_jsonl, lost).find("loom_sft_bad.jsonl:2: messages[1] (assistant): its text cannot "
                                                               "be found in the chat template's rendering"),
            std::string::npos);
  // A template with generation blocks that mark nothing of the conversation.
  EXPECT_NE(error(ok, SftFormat::chat_jsonl, "{{ messages[0].content }}{% if false %}{% generation %}{% endgeneration %}{% endif %}")
                .find("loom_sft_bad.jsonl:1: the chat template's {% generation %} blocks mark no text"),
            std::string::npos);
}

}  // namespace
}  // namespace loom
