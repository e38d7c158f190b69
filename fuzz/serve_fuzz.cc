// libFuzzer target: arbitrary bytes as each serving parser's input — the HTTP request JSON
// (ParseServeRequest, the router's RouteRequest, the OpenAI API's completion and chat bodies) and
// the decode port's request, resend, tokens, result and error messages, and the benchmark
// driver's reading of a node's answer
// (ServeResponseFromJson). Each must fail with a status or give values within the limits it was
// given: token ids below the vocabulary, a resend list of distinct frames the request has, no
// more tokens than were asked for, a forwarded body that a node parses again, non-negative ids
// and timings in an answer; an OpenAI body's prompt and tokens within the context, and its
// completion text the same handed out token by token as whole.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "kvserve/serve.h"
#include "kvserve/testbed.h"
#include "serve/openai.h"
#include "serve/wire.h"

namespace {

const kvserve::Tokenizer& SmallTokenizer() {
  static const kvserve::Tokenizer t = kvserve::Tokenizer::FromVocab(
      {"<unk>", "<s>", "</s>", " ", "a", "b", "ab", " a", " ab", "<0x41>", "<0xFF>", "ba"},
      {0, 0, 0, -1, -2, -2, -1, -1, -0.5f, -9, -9, -1.5f});
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvserve;
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::span<const uint8_t> bytes(data, size);
  constexpr uint32_t kVocab = 12, kMaxPrompt = 64;

  auto req = ParseServeRequest(text, &SmallTokenizer(), kMaxPrompt);
  if (req.ok()) {
    if (req->prompt.empty() || req->prompt.size() > kMaxPrompt || req->max_new_tokens == 0) __builtin_trap();
    for (int t : req->prompt)
      if (t < 0) __builtin_trap();
  }
  auto routed = RouteRequest(text, 8);
  if (routed.ok()) {
    if (routed->label.empty() || !CheckJsonNesting(routed->body, kMaxRequestJsonDepth).ok()) __builtin_trap();
    const nlohmann::json j = nlohmann::json::parse(routed->body, nullptr, false);
    if (j.is_discarded() || !j.is_object()) __builtin_trap();
    (void)ParseServeRequest(routed->body, &SmallTokenizer(), kMaxPrompt);
  }
  auto dreq = serve_internal::ParseDecodeRequest(bytes, kVocab, kMaxPrompt, 32);
  if (dreq.ok()) {
    if (dreq->first_token < 0 || uint32_t(dreq->first_token) >= kVocab || dreq->prompt_len == 0 ||
        dreq->prompt_len > kMaxPrompt || dreq->max_new_tokens == 0 || dreq->max_new_tokens > 32) {
      __builtin_trap();
    }
  }
  auto resend = serve_internal::ParseResendMessage(bytes, 8);
  if (resend.ok()) {
    if (resend->empty() || resend->size() > 8) __builtin_trap();
    for (size_t i = 0; i < resend->size(); ++i)
      if ((*resend)[i] >= 8 || (i > 0 && (*resend)[i] <= (*resend)[i - 1])) __builtin_trap();
  }
  auto result = serve_internal::ParseDecodeResult(bytes, 16, kVocab);
  if (result.ok()) {
    if (result->tokens.size() > 16 || !(result->decode_s >= 0) || !(result->generate_s >= 0)) __builtin_trap();
    for (int t : result->tokens)
      if (t < 0 || uint32_t(t) >= kVocab) __builtin_trap();
  }
  auto streamed = serve_internal::ParseTokensMessage(bytes, 4, kVocab);
  if (streamed.ok()) {
    if (streamed->empty() || streamed->size() > 4) __builtin_trap();
    for (int t : *streamed)
      if (t < 0 || uint32_t(t) >= kVocab) __builtin_trap();
  }
  for (bool chat : {false, true}) {
    serve_internal::OpenAiModel model;
    model.id = "m";
    model.tokenizer = &SmallTokenizer();
    model.context = 80;
    model.max_prompt = kMaxPrompt;
    serve_internal::OpenAiRequest oreq;
    serve_internal::OpenAiError err;
    if (!serve_internal::ParseOpenAiRequest(text, chat, model, &oreq, &err)) {
      if (err.status != 400 && err.status != 404) __builtin_trap();
      if (nlohmann::json::parse(err.Json(), nullptr, false).is_discarded()) __builtin_trap();
      continue;
    }
    const ServeRequest& s = oreq.serve;
    if (s.prompt.empty() || s.prompt.size() > kMaxPrompt || s.max_new_tokens == 0 ||
        s.prompt.size() + s.max_new_tokens > model.context || !(s.sampling.temperature >= 0 && s.sampling.temperature <= 2) ||
        !(s.sampling.top_p > 0 && s.sampling.top_p <= 1) || oreq.stop.size() > 4) {
      __builtin_trap();
    }
    // The prompt's own tokens as if generated: pieces handed out as they come join to the whole.
    serve_internal::CompletionText whole(&SmallTokenizer(), oreq.stop), pieces(&SmallTokenizer(), oreq.stop);
    std::string joined;
    for (int t : s.prompt) {
      const bool more = pieces.Add(t);
      joined += pieces.TakeReady();
      if (!more) break;
    }
    joined += pieces.TakeRest();
    for (int t : s.prompt)
      if (!whole.Add(t)) break;
    if (joined != whole.TakeRest()) __builtin_trap();
  }
  (void)serve_internal::ParseErrorMessage(bytes);
  auto answer = ServeResponseFromJson(text);
  if (answer.ok()) {
    for (int t : answer->tokens)
      if (t < 0) __builtin_trap();
    const StageTimings& st = answer->timings;
    for (double v : {st.queue_s, st.prefill_s, st.encode_s, st.wire_s, st.decode_s, st.transfer_s, st.generate_s, st.total_s})
      if (!(v >= 0)) __builtin_trap();
  }
  return 0;
}
