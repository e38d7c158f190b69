// The OpenAI API's shapes without a socket: request bodies read (and refused naming the field),
// completion text cut at EOS and stop texts the same streamed or whole, chunks and errors.
#include "serve/openai.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "model/model_test_util.h"

namespace kvserve::serve_internal {
namespace {

using json = nlohmann::json;

OpenAiModel Model() {
  OpenAiModel m;
  m.id = "stories260K";
  m.tokenizer = &testing::Stories().tokenizer;
  m.context = 512;
  m.max_prompt = 511;
  return m;
}

TEST(OpenAi, ReadsCompletionAndChatBodiesWithKvserveKnobs) {
  OpenAiRequest r;
  OpenAiError e;
  const std::string body = R"J({"model":"stories260K","prompt":"Once upon a time","max_tokens":7,"stream":true,
      "stream_options":{"include_usage":true},"stop":["x","yz"],"slo_ms":250,"floor":0.99,"label":"chat",
      "strategy":"quant(kbits=4,vbits=4)","user":"u","seed":3,"top_p":0.5,"logprobs":null})J";
  ASSERT_TRUE(ParseOpenAiRequest(body, false, Model(), &r, &e)) << e.message;
  EXPECT_EQ(r.serve.prompt, testing::Stories().tokenizer.Encode("Once upon a time", true));
  EXPECT_EQ(r.serve.max_new_tokens, 7u);
  EXPECT_TRUE(r.stream && r.include_usage);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"x", "yz"}));
  EXPECT_EQ(r.serve.slo_ms, 250);
  EXPECT_EQ(r.serve.floor, 0.99);
  EXPECT_EQ(r.serve.label, "chat");
  EXPECT_EQ(r.serve.strategy.rfind("quant(kbits=4,vbits=4,", 0), 0u);
  EXPECT_EQ(r.serve.sampling.temperature, 0.0f);  // kvserve's default: greedy
  EXPECT_EQ(r.serve.sampling.top_p, 0.5f);
  EXPECT_EQ(r.serve.sampling.seed, 3u);
  // A batch of one prompt, token ids, and the default of 16 tokens.
  const std::string batch = R"J({"prompt":[[1,400,500]]})J";
  ASSERT_TRUE(ParseOpenAiRequest(batch, false, Model(), &r, &e)) << e.message;
  EXPECT_EQ(r.serve.prompt, (std::vector<int>{1, 400, 500}));
  EXPECT_EQ(r.serve.max_new_tokens, 16u);
  // Chat: the documented template; content as parts.
  const std::string chat = R"J({"messages":[{"role":"system","content":"Be brief."},
      {"role":"user","content":[{"type":"text","text":"Hi"}]}],"max_completion_tokens":5})J";
  ASSERT_TRUE(ParseOpenAiRequest(chat, true, Model(), &r, &e)) << e.message;
  EXPECT_EQ(r.serve.prompt, testing::Stories().tokenizer.Encode("System: Be brief.\nUser: Hi\nAssistant:", true));
  EXPECT_EQ(r.serve.max_new_tokens, 5u);
}

TEST(OpenAi, RefusesWhatItCannotDoNamingTheField) {
  struct Case {
    const char* body;
    bool chat;
    int status;
    const char* param;
  };
  for (const Case& c : std::vector<Case>{
           {R"J({"model":"gpt-4","prompt":"x"})J", false, 404, "model"},
           {R"J({"prompt":"x","max_tokens":0})J", false, 400, "max_tokens"},
           {R"J({"prompt":"x","max_tokens":600})J", false, 400, "max_tokens"},
           {R"J({"prompt":"x","max_tokens":2.5})J", false, 400, "max_tokens"},
           {R"J({"prompt":"x","temperature":2.5})J", false, 400, "temperature"},
           {R"J({"prompt":"x","top_p":0})J", false, 400, "top_p"},
           {R"J({"prompt":"x","seed":"s"})J", false, 400, "seed"},
           {R"J({"prompt":"x","n":2})J", false, 400, "n"},
           {R"J({"prompt":"x","logprobs":3})J", false, 400, "logprobs"},
           {R"J({"prompt":"x","response_format":{"type":5}})J", false, 400, "response_format"},
           {R"J({"prompt":"x","stop":[1]})J", false, 400, "stop"},
           {R"J({"prompt":"x","stream_options":{"include_usage":true}})J", false, 400, "stream_options"},
           {R"J({"prompt":["a","b"]})J", false, 400, "prompt"},
           {R"J({"prompt":[-1]})J", false, 400, "prompt"},
           {R"J({"prompt":""})J", false, 400, "prompt"},
           {R"J({})J", false, 400, "prompt"},
           {R"J({"prompt":"x","strategy":"nonsense"})J", false, 400, "strategy"},
           {R"J({"prompt":"x","floor":2})J", false, 400, "floor"},
           {R"J({"messages":[]})J", true, 400, "messages"},
           {R"J({"messages":[{"role":"wizard","content":"x"}]})J", true, 400, "messages[0].role"},
           {R"J({"messages":[{"role":"user","content":5}]})J", true, 400, "messages[0].content"},
           {R"J([1,2])J", false, 400, ""},
           {R"J({"prompt":)J", false, 400, ""}}) {
    OpenAiRequest r;
    OpenAiError e;
    EXPECT_FALSE(ParseOpenAiRequest(c.body, c.chat, Model(), &r, &e)) << c.body;
    EXPECT_EQ(e.status, c.status) << c.body << ": " << e.message;
    EXPECT_EQ(e.param, c.param) << c.body << ": " << e.message;
    const json j = json::parse(e.Json());
    EXPECT_EQ(j["error"]["message"], e.message);
    EXPECT_TRUE(j["error"].contains("type") && j["error"].contains("param") && j["error"].contains("code"));
  }
  // A prompt beyond the context, as ids.
  std::string ids = "[1";
  for (int i = 0; i < 600; ++i) ids += ",5";
  OpenAiRequest r;
  OpenAiError e;
  EXPECT_FALSE(ParseOpenAiRequest(R"J({"prompt":)J" + ids + "]}", false, Model(), &r, &e));
  EXPECT_EQ(e.code, "context_length_exceeded");
}

// Pieces handed out token by token join to the whole text; nothing is handed out that a stop
// text or an unfinished UTF-8 character could still change.
TEST(OpenAi, CompletionTextIsTheSameStreamedOrWholeAndStopsBeforeTheStopText) {
  const Tokenizer& tok = testing::Stories().tokenizer;
  const std::vector<int> ids = tok.Encode("Once upon a time, there was a little girl named Lily.", false);
  for (const std::vector<std::string>& stop : std::vector<std::vector<std::string>>{{}, {"little"}, {"e, th"}, {"zzz", "girl n"}}) {
    CompletionText whole(&tok, stop), streamed(&tok, stop);
    std::string pieces;
    for (int id : ids) {
      const bool more = streamed.Add(id);
      const std::string p = streamed.TakeReady();
      pieces += p;
      if (!more) break;
    }
    pieces += streamed.TakeRest();
    for (int id : ids) {
      if (!whole.Add(id)) break;
    }
    const std::string all = whole.TakeRest();
    EXPECT_EQ(pieces, all);
    // A continuation's text: the first piece keeps its leading space (only after BOS is it dropped).
    std::string full;
    int prev = Tokenizer::kEos;
    for (int id : ids) full += tok.Decode(prev, id), prev = id;
    if (stop.empty()) {
      EXPECT_EQ(all, full);
      EXPECT_FALSE(whole.stopped());
    } else {
      size_t at = std::string::npos;
      for (const std::string& s : stop) at = std::min(at, full.find(s));
      EXPECT_EQ(all, full.substr(0, at)) << stop[0];
      EXPECT_TRUE(whole.stopped());
    }
  }
  // EOS ends the text; a byte token that starts a UTF-8 character waits for the rest.
  CompletionText eos(&tok, {});
  EXPECT_TRUE(eos.Add(ids[0]));
  EXPECT_FALSE(eos.Add(Tokenizer::kEos));
  EXPECT_TRUE(eos.stopped());
  EXPECT_EQ(eos.tokens(), 2u);
  const std::vector<int> e_ids = tok.Encode("\xC3\xA9", false);
  CompletionText utf8(&tok, {});
  std::string got;
  for (int id : e_ids) {
    utf8.Add(id);
    const std::string p = utf8.TakeReady();
    EXPECT_TRUE(p.empty() || p.find("\xC3\xA9") != std::string::npos || (static_cast<unsigned char>(p.back()) & 0x80) == 0) << p;
    got += p;
  }
  got += utf8.TakeRest();
  EXPECT_NE(got.find("\xC3\xA9"), std::string::npos);
}

TEST(OpenAi, ChunksAndAnswersHaveOpenAisShapes) {
  OpenAiRequest req;
  ServeResponse r;
  r.strategy = "none";
  r.kv_bytes = 100;
  r.wire_bytes = 50;
  const std::string whole = CompletionJson(req, "m", "cmpl-1", 7, "hi", "length", {3, 2, 1}, r);
  const json w = json::parse(whole);
  EXPECT_EQ(w["object"], "text_completion");
  EXPECT_EQ(w["choices"][0]["text"], "hi");
  EXPECT_EQ(w["usage"]["total_tokens"], 5);
  EXPECT_EQ(w["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
  EXPECT_EQ(w["kvserve"]["ratio"], 2.0);
  req.chat = true;
  const std::string text = "x";
  const std::string first = StreamChunk(req, "m", "c", 7, nullptr, "");
  ASSERT_EQ(first.rfind("data: ", 0), 0u);
  ASSERT_EQ(first.substr(first.size() - 2), "\n\n");
  const json f = json::parse(first.substr(6));
  EXPECT_EQ(f["object"], "chat.completion.chunk");
  EXPECT_EQ(f["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(f["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(json::parse(StreamChunk(req, "m", "c", 7, &text, "").substr(6))["choices"][0]["delta"]["content"], "x");
  EXPECT_EQ(json::parse(StreamChunk(req, "m", "c", 7, &text, "stop").substr(6))["choices"][0]["finish_reason"], "stop");
  const json u = json::parse(StreamUsageChunk(req, "m", "c", 7, {3, 2, 0}, r).substr(6));
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["completion_tokens"], 2);
  EXPECT_EQ(json::parse(ModelsJson(Model(), "kvserve"))["data"][0]["id"], "stories260K");
}

}  // namespace
}  // namespace kvserve::serve_internal
