// loom serve's pieces without HTTP (src/loom/serve/): OpenAI request parsing and its 400s, the
// response objects' shapes, UTF-8 handling of streamed text, and the Prometheus histogram.
// tests/serve_test.py runs the server itself against the official openai client.
#include <gtest/gtest.h>

#include "loom/core/utf8.h"
#include "loom/serve/metrics.h"
#include "loom/serve/openai.h"

namespace loom::serve {
namespace {

ModelInfo model_info() {
  ModelInfo m;
  m.id = "tiny";
  m.context = 64;
  m.max_n = 4;
  m.stop_tokens = {ByteTokenizer::kEotToken};
  return m;
}

// The status and param of the ApiError `body` raises, or (0, "") when it parses.
std::pair<int, std::string> refusal(const std::string& body, Endpoint endpoint = Endpoint::completions,
                                    const ModelInfo& model = model_info()) {
  ByteTokenizer tok;
  try {
    parse_request(endpoint, body, tok, model);
  } catch (const ApiError& e) {
    EXPECT_EQ(e.body()["error"]["type"], e.status() == 400 ? "invalid_request_error" : e.type());
    EXPECT_FALSE(std::string(e.what()).empty());
    return {e.status(), e.param()};
  }
  return {0, ""};
}

TEST(ServeTest, RequestsParseIntoEngineTerms) {
  ByteTokenizer tok;
  const ParsedRequest r = parse_request(Endpoint::completions,
                                        R"({"model": "tiny", "prompt": "ab", "max_tokens": 5, "temperature": 0.5,
                                            "top_p": 0.9, "top_k": 7, "seed": 11, "n": 2, "stop": ["x", "yz"],
                                            "presence_penalty": 0.5, "frequency_penalty": -1, "logprobs": 3,
                                            "stream": true, "stream_options": {"include_usage": true},
                                            "user": "ignored"})",
                                        tok, model_info());
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0], (std::vector<int32_t>{'a', 'b'}));
  EXPECT_EQ(r.max_tokens, 5);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 7);
  EXPECT_EQ(r.sampling.seed, 11u);
  EXPECT_TRUE(r.seeded);
  EXPECT_EQ(r.n, 2);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"x", "yz"}));
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, -1.0f);
  EXPECT_EQ(r.logprobs, 3);
  EXPECT_TRUE(r.stream && r.include_usage);
  // Several prompts, token ids, and defaults.
  const ParsedRequest many = parse_request(Endpoint::completions, R"({"prompt": ["a", [1, 2, 3]]})", tok, model_info());
  ASSERT_EQ(many.prompts.size(), 2u);
  EXPECT_EQ(many.prompts[1], (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(many.max_tokens, 16);  // OpenAI's default for completions
  EXPECT_FALSE(many.seeded);
  EXPECT_EQ(many.logprobs, -1);
  // Chat: the template renders the conversation with the generation prompt.
  ModelInfo chat = model_info();
  chat.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
  const ParsedRequest c = parse_request(Endpoint::chat, R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                                           "logprobs": true, "top_logprobs": 2})",
                                        tok, chat);
  EXPECT_EQ(tok.decode(c.prompts[0]), "<user>hi<assistant>");
  EXPECT_EQ(c.max_tokens, 64);
  EXPECT_EQ(c.logprobs, 2);
}

TEST(ServeTest, BadRequestsAre400sNamingTheField) {
  EXPECT_EQ(refusal(R"({"prompt": "a",)"), std::make_pair(400, std::string()));            // malformed JSON
  EXPECT_EQ(refusal("{\"prompt\": \"\xff\xfe\"}"), std::make_pair(400, std::string()));    // not UTF-8
  EXPECT_EQ(refusal(R"([1, 2])"), std::make_pair(400, std::string()));
  EXPECT_EQ(refusal(R"({})"), std::make_pair(400, std::string("prompt")));
  EXPECT_EQ(refusal(R"({"prompt": 3})"), std::make_pair(400, std::string("prompt")));
  EXPECT_EQ(refusal(R"({"prompt": [1, 999]})"), std::make_pair(400, std::string("prompt")));  // outside the vocabulary
  EXPECT_EQ(refusal(R"({"prompt": ")" + std::string(64, 'a') + "\"}"), std::make_pair(400, std::string("prompt")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "max_tokens": 0})"), std::make_pair(400, std::string("max_tokens")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "max_tokens": "5"})"), std::make_pair(400, std::string("max_tokens")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "max_tokens": 2.5})"), std::make_pair(400, std::string("max_tokens")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "temperature": "hot"})"), std::make_pair(400, std::string("temperature")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "temperature": 3})"), std::make_pair(400, std::string("temperature")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "top_p": 0})"), std::make_pair(400, std::string("top_p")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "n": 5})"), std::make_pair(400, std::string("n")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "n": 0})"), std::make_pair(400, std::string("n")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]})"), std::make_pair(400, std::string("stop")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "stop": 1})"), std::make_pair(400, std::string("stop")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "stream": "yes"})"), std::make_pair(400, std::string("stream")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "seed": "x"})"), std::make_pair(400, std::string("seed")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "presence_penalty": 2.5})"), std::make_pair(400, std::string("presence_penalty")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "logprobs": 6})"), std::make_pair(400, std::string("logprobs")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "echo": true})"), std::make_pair(400, std::string("echo")));
  EXPECT_EQ(refusal(R"({"prompt": "a", "model": "gpt-4o"})"), std::make_pair(404, std::string("model")));  // not served
  EXPECT_EQ(refusal(R"({"prompt": "a", "model": "tiny"})"), std::make_pair(0, std::string()));
  // Chat: no template, then a template and bad messages.
  EXPECT_EQ(refusal(R"({"messages": [{"role": "user", "content": "x"}]})", Endpoint::chat), std::make_pair(400, std::string("messages")));
  ModelInfo chat = model_info();
  chat.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}";
  EXPECT_EQ(refusal(R"({"messages": []})", Endpoint::chat, chat), std::make_pair(400, std::string("messages")));
  EXPECT_EQ(refusal(R"({"messages": [{"content": "x"}]})", Endpoint::chat, chat), std::make_pair(400, std::string("messages[0]")));
  EXPECT_EQ(refusal(R"({"messages": [{"role": "user", "content": 5}]})", Endpoint::chat, chat),
            std::make_pair(400, std::string("messages[0].content")));
  EXPECT_EQ(refusal(R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", Endpoint::chat, chat),
            std::make_pair(400, std::string("top_logprobs")));
  EXPECT_EQ(refusal(R"({"messages": [{"role": "user", "content": "x"}]})", Endpoint::chat, chat), std::make_pair(0, std::string()));
  ModelInfo raising = model_info();
  raising.chat_template = "{{ raise_exception('no system role') }}";
  EXPECT_EQ(refusal(R"({"messages": [{"role": "user", "content": "x"}]})", Endpoint::chat, raising),
            std::make_pair(400, std::string("messages")));
}

// Integers past int64 (nlohmann keeps 2^63 .. 2^64 - 1 unsigned) are reported as given, not
// wrapped: max_tokens 2^63 was "got -9223372036854775808", top_k 2^64 - 1 passed as -1 (no limit).
TEST(ServeTest, HugeIntegersAreRefusedAsGiven) {
  ByteTokenizer tok;
  const auto message = [&](const std::string& body) {
    try {
      parse_request(Endpoint::completions, body, tok, model_info());
    } catch (const ApiError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message(R"({"prompt": "a", "max_tokens": 9223372036854775808})"),
            "'max_tokens' must be in [1, 64], got 9223372036854775808");
  EXPECT_EQ(message(R"({"prompt": "a", "max_tokens": 18446744073709551615})"),
            "'max_tokens' must be in [1, 64], got 18446744073709551615");
  EXPECT_EQ(message(R"({"prompt": "a", "max_tokens": -9223372036854775808})"),
            "'max_tokens' must be in [1, 64], got -9223372036854775808");
  EXPECT_EQ(message(R"({"prompt": "a", "top_k": 18446744073709551615})"),
            "'top_k' must be in [-1, 1073741824], got 18446744073709551615");
  EXPECT_EQ(message(R"({"prompt": "a", "max_tokens": 2.5})"), "'max_tokens' must be an integer, got 2.5");
  EXPECT_EQ(message(R"({"prompt": "a", "max_tokens": 64, "top_k": -1})"), "accepted");
}

TEST(ServeTest, ResponsesHaveOpenAIsShape) {
  ByteTokenizer tok;
  const ModelInfo m = model_info();
  std::vector<ChoiceOutput> choices(2);
  choices[0] = {"hi", "stop", {{'h', -0.5, {{'h', -0.5}, {'x', -1.5}}}, {'i', -0.25, {}}}};
  choices[1] = {"yo", "length", {}};
  const auto chat = completion_response("chatcmpl-1", m, Endpoint::chat, choices, 7, 4, true, tok);
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "hi");
  EXPECT_EQ(chat["choices"][1]["finish_reason"], "length");
  EXPECT_EQ(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1]["token"], "x");
  EXPECT_EQ(chat["usage"]["total_tokens"], 11);
  const auto text = completion_response("cmpl-1", m, Endpoint::completions, choices, 7, 4, true, tok);
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_EQ(text["choices"][0]["text"], "hi");
  EXPECT_EQ(text["choices"][0]["logprobs"]["text_offset"][1], 1);
  EXPECT_DOUBLE_EQ(text["choices"][0]["logprobs"]["top_logprobs"][0]["x"].get<double>(), -1.5);
  const auto chunk = stream_chunk("chatcmpl-1", m, Endpoint::chat, 1, "h", "", true, nullptr, tok);
  EXPECT_EQ(chunk["object"], "chat.completion.chunk");
  EXPECT_EQ(chunk["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(chunk["choices"][0]["index"], 1);
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  const ApiError full(429, "queue full");
  EXPECT_EQ(full.body()["error"]["type"], "rate_limit_error");
  EXPECT_TRUE(full.body()["error"]["param"].is_null());
}

TEST(ServeTest, StreamedTextStopsOnlyAtWholeCharacters) {
  EXPECT_EQ(complete_utf8_prefix("ab"), 2u);
  EXPECT_EQ(complete_utf8_prefix("a\xE2\x82"), 1u);          // € cut after two of its three bytes
  EXPECT_EQ(complete_utf8_prefix("a\xE2\x82\xAC"), 4u);
  EXPECT_EQ(complete_utf8_prefix("a\xF0\x9F"), 1u);
  EXPECT_EQ(complete_utf8_prefix("a\x80"), 2u);              // a stray continuation byte: nothing to wait for
  EXPECT_EQ(valid_utf8("a\xFF" "b"), "a\xEF\xBF\xBD" "b");
  EXPECT_EQ(valid_utf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong '/'
  EXPECT_EQ(valid_utf8("\xE2\x82\xAC"), "\xE2\x82\xAC");
}

TEST(ServeTest, HistogramBucketsAreCumulative) {
  Histogram h({0.1, 1.0});
  for (double v : {0.05, 0.1, 0.5, 2.0}) h.observe(v);
  const std::string text = h.render("x");
  EXPECT_NE(text.find("x_bucket{le=\"0.1\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("x_bucket{le=\"1\"} 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("x_bucket{le=\"+Inf\"} 4\n"), std::string::npos) << text;
  EXPECT_NE(text.find("x_count 4\n"), std::string::npos) << text;
  EXPECT_DOUBLE_EQ(h.quantile(0.5), 0.1);
  EXPECT_DOUBLE_EQ(h.quantile(0.75), 1.0);
}

}  // namespace
}  // namespace loom::serve
