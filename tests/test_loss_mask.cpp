// Loss masks (supervised fine-tuning: only the completion's tokens count): a target of
// kIgnoreTarget gives the cross-entropy ops loss 0 and a zero gradient row, and the trainer's
// loss is the mean over the step's positions that count, on every micro-batch (and rank)
// together: masked positions contribute nothing to the loss or the gradients (finite
// differences of the masked mean), and splitting the batch into micro-batches with different
// numbers of counted positions changes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

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
  // whole, from windows or not.
  const std::string think =
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}<think></think>"
      "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  const std::string path = write_lines("loom_sft_windows.jsonl", conversations[5].dump() + "\n");
  EXPECT_NE(test::error_of([&] { read_sft_file(path, SftFormat::chat_jsonl, *tok, think); })
                .find("does not render the conversation up to message"),
            std::string::npos);
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
}

}  // namespace
}  // namespace loom
