// The OpenAI-compatible API of the serving fronts: request bodies of /v1/completions and
// /v1/chat/completions read into a ServeRequest (with kvserve's own knobs as extra fields),
// answers and server-sent-event chunks in OpenAI's shapes, errors in its error shape. Pure
// functions over text, so every shape is unit-tested without a socket.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "kvserve/model.h"
#include "kvserve/serve.h"

namespace kvserve::serve_internal {

// What the node serving the API knows of its model.
struct OpenAiModel {
  std::string id;                       // the name /v1/models lists and requests must use
  const Tokenizer* tokenizer = nullptr;  // null: a synthetic stand-in (prompts as token ids)
  uint32_t context = 0;                 // prompt + generated tokens at most
  uint32_t max_prompt = 0;
  int64_t created = 0;                  // unix seconds the node started
};

struct OpenAiRequest {
  bool chat = false;
  ServeRequest serve;                    // prompt tokens, max_new_tokens and kvserve's knobs
  bool stream = false, include_usage = false;
  std::vector<std::string> stop;         // up to 4 texts that end the completion (not included)
};

// An error with the HTTP status and the OpenAI `type`/`param` it is answered with.
struct OpenAiError {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string param;   // the field at fault ("" when none)
  std::string code;    // e.g. "model_not_found", "context_length_exceeded"
  std::string message;
  std::string Json() const;  // {"error": {...}}
};
OpenAiError ErrorFromStatus(const Status& st);

// Reads a completions (`chat` false) or chat-completions body. Sampling: `temperature` 0 (the
// default: greedy) to 2, `top_p`, `seed` (default 1) as `kvserve generate` samples; `n` 1; no
// logprobs. kvserve's fields: slo_ms, floor, label, strategy.
bool ParseOpenAiRequest(std::string_view body, bool chat, const OpenAiModel& model, OpenAiRequest* out, OpenAiError* err);

// The chat template for models without one (both shipped models are base models): each
// message as "<Role>: <content>\n" (System, User, Assistant), then "Assistant:" for the reply.
std::string ChatPrompt(const std::vector<std::pair<std::string, std::string>>& messages);

// Generated tokens as text, one token at a time, the same whether streamed or not: ends at EOS
// or at a stop text (neither included); holds back bytes that may be the start of a UTF-8
// character or of a stop text, so every piece it hands out is final.
class CompletionText {
 public:
  CompletionText(const Tokenizer* tokenizer, std::vector<std::string> stop);
  // False once the completion is over (EOS or a stop text): generation should end.
  bool Add(int token);
  std::string TakeReady();  // text now final, not handed out before
  std::string TakeRest();   // at the end: everything not yet handed out
  bool stopped() const { return stopped_; }
  uint32_t tokens() const { return tokens_; }  // generated tokens the completion used
  const std::vector<int>& ids() const { return ids_; }

 private:
  const Tokenizer* tokenizer_;
  std::vector<std::string> stop_;
  size_t hold_ = 0;          // longest stop text - 1
  std::string pending_;      // decoded, not handed out
  int prev_ = Tokenizer::kEos;
  uint32_t tokens_ = 0;
  bool stopped_ = false;
  std::vector<int> ids_;
};

// kvserve's extension object of an answer: strategy, explanation, stage timings, bytes.
nlohmann::json KvserveExtension(const ServeResponse& r);

struct OpenAiUsage {
  uint32_t prompt = 0, completion = 0, cached = 0;
};

// A whole answer (stream false).
std::string CompletionJson(const OpenAiRequest& req, const std::string& model, const std::string& id, int64_t created,
                           const std::string& text, const std::string& finish_reason, const OpenAiUsage& usage,
                           const ServeResponse& r);
// One server-sent event: "data: {...}\n\n". `text` null: the chat's first chunk (the role);
// finish_reason non-empty: the last; usage: the usage chunk (no choices).
std::string StreamChunk(const OpenAiRequest& req, const std::string& model, const std::string& id, int64_t created,
                        const std::string* text, const std::string& finish_reason);
std::string StreamUsageChunk(const OpenAiRequest& req, const std::string& model, const std::string& id, int64_t created,
                             const OpenAiUsage& usage, const ServeResponse& r);
inline constexpr std::string_view kStreamDone = "data: [DONE]\n\n";

// GET /v1/models.
std::string ModelsJson(const OpenAiModel& model, const std::string& owner);

}  // namespace kvserve::serve_internal
