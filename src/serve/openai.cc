// OpenAI request bodies in, OpenAI answers, chunks and errors out (serve/openai.h).
#include "serve/openai.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "serve/wire.h"

namespace kvserve::serve_internal {

using json = nlohmann::json;

std::string OpenAiError::Json() const {
  json e = {{"message", message}, {"type", type}, {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}};
  return Dump(json{{"error", e}}) + "\n";
}

OpenAiError ErrorFromStatus(const Status& st) {
  OpenAiError e;
  e.message = st.ToString();
  switch (st.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange: e.status = 400; break;
    case StatusCode::kNotFound: e.status = 404, e.type = "not_found_error"; break;
    case StatusCode::kUnavailable: e.status = 503, e.type = "server_error"; break;
    default: e.status = 500, e.type = "server_error"; break;
  }
  // The field a kvserve message names first ('field' ...), as OpenAI's `param`.
  const std::string& m = st.message();
  const size_t a = m.find('\'');
  const size_t b = a == std::string::npos ? a : m.find('\'', a + 1);
  if (e.status == 400 && b != std::string::npos && b - a < 40) e.param = m.substr(a + 1, b - a - 1);
  return e;
}

std::string ChatPrompt(const std::vector<std::pair<std::string, std::string>>& messages) {
  std::string p;
  for (const auto& [role, content] : messages) {
    std::string r = role == "developer" ? "system" : role;
    if (!r.empty()) r[0] = char(std::toupper(static_cast<unsigned char>(r[0])));
    p += r + ": " + content + "\n";
  }
  return p + "Assistant:";
}

namespace {

struct Fail {
  OpenAiError* err;
  bool operator()(std::string param, std::string message, int status = 400, std::string code = "") const {
    err->status = status;
    err->type = status == 404 ? "not_found_error" : "invalid_request_error";
    err->param = std::move(param);
    err->message = std::move(message);
    err->code = std::move(code);
    return false;
  }
};

// A message's content: a string, or an array of {"type": "text", "text": ...} parts.
bool ContentText(const json& c, std::string* out) {
  if (c.is_string()) {
    *out = c.get<std::string>();
    return true;
  }
  if (!c.is_array()) return false;
  for (const json& part : c) {
    if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") || !part["text"].is_string()) {
      return false;
    }
    *out += part["text"].get<std::string>();
  }
  return true;
}

}  // namespace

bool ParseOpenAiRequest(std::string_view body, bool chat, const OpenAiModel& model, OpenAiRequest* out, OpenAiError* err) {
  Fail fail{err};
  auto parsed = ParseJsonObject(body);
  if (!parsed.ok()) return fail("", parsed.status().message());
  json& j = parsed.value();
  OpenAiRequest r;
  r.chat = chat;
  // A field given as null is as if absent (the openai client sends some so).
  for (auto it = j.begin(); it != j.end();) it = it->is_null() ? j.erase(it) : std::next(it);
  if (j.contains("model")) {
    if (!j["model"].is_string()) return fail("model", "'model' must be a string");
    const std::string& m = j["model"].get_ref<const std::string&>();
    if (m != model.id) {
      return fail("model", "The model '" + m + "' does not exist: this node serves '" + model.id + "' (GET /v1/models)", 404,
                  "model_not_found");
    }
  }
  // Sampling: greedy at temperature 0 (kvserve's default), else seeded top-p sampling.
  double temperature = 0, top_p = 1, n = 1;
  for (auto [key, lo, hi, v] : {std::tuple{"temperature", 0.0, 2.0, &temperature}, {"top_p", 1e-9, 1.0, &top_p}, {"n", 1.0, 128.0, &n}}) {
    if (Status st = JsonNumber(j, key, lo, hi, v); !st.ok()) return fail(key, st.message());
  }
  if (n != 1) return fail("n", "'n' = " + Dump(j["n"]) + ": one completion per request");
  r.serve.sampling.temperature = float(temperature);
  r.serve.sampling.top_p = float(top_p);
  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    double v = 0;
    if (Status st = JsonNumber(j, key, -2, 2, &v); !st.ok()) return fail(key, st.message());
    if (v != 0) return fail(key, std::string("'") + key + "' is not supported: send 0 or leave it out");
  }
  for (const char* key : {"logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "tools", "functions",
                          "response_format"}) {
    if (!j.contains(key)) continue;
    const json& v = j[key];
    const bool harmless = v == false || (std::string(key) == "best_of" && v == 1) || (v.is_object() && v.empty()) ||
                          (std::string(key) == "response_format" && v.is_object() && v.contains("type") && v["type"] == "text");
    if (!harmless) return fail(key, std::string("'") + key + "' is not supported by this node");
  }
  if (j.contains("seed")) {
    if (!j["seed"].is_number_integer()) return fail("seed", "'seed' must be an integer");
    r.serve.sampling.seed = j["seed"].is_number_unsigned() ? j["seed"].get<uint64_t>() : uint64_t(j["seed"].get<int64_t>());
  }
  if (j.contains("stream")) {
    if (!j["stream"].is_boolean()) return fail("stream", "'stream' must be true or false");
    r.stream = j["stream"].get<bool>();
  }
  if (j.contains("stream_options")) {
    const json& so = j["stream_options"];
    if (!so.is_object()) return fail("stream_options", "'stream_options' must be an object");
    if (!r.stream) return fail("stream_options", "'stream_options' is only allowed with 'stream': true");
    if (so.contains("include_usage")) {
      if (!so["include_usage"].is_boolean()) return fail("stream_options.include_usage", "'include_usage' must be true or false");
      r.include_usage = so["include_usage"].get<bool>();
    }
  }
  if (j.contains("stop")) {
    const json& s = j["stop"];
    if (s.is_string()) {
      r.stop.push_back(s.get<std::string>());
    } else if (s.is_array() && s.size() <= 4) {
      for (const json& x : s) {
        if (!x.is_string()) return fail("stop", "'stop' must be a string or an array of at most 4 strings");
        r.stop.push_back(x.get<std::string>());
      }
    } else {
      return fail("stop", "'stop' must be a string or an array of at most 4 strings");
    }
    for (const std::string& x : r.stop) {
      if (x.empty() || x.size() > 256) return fail("stop", "a 'stop' text must hold 1 to 256 bytes");
    }
  }
  // kvserve's knobs.
  if (Status st = JsonNumber(j, "slo_ms", 1e-3, 1e9, &r.serve.slo_ms); !st.ok()) return fail("slo_ms", st.message());
  if (Status st = JsonNumber(j, "floor", 0, 1.05, &r.serve.floor); !st.ok()) return fail("floor", st.message());
  if (j.contains("label")) {
    if (!j["label"].is_string()) return fail("label", "'label' must be a string");
    r.serve.label = j["label"].get<std::string>();
  }
  if (j.contains("strategy")) {
    if (!j["strategy"].is_string()) return fail("strategy", "'strategy' must be a string");
    auto s = RequestStrategy(j["strategy"].get<std::string>());
    if (!s.ok()) return fail("strategy", s.status().message());
    r.serve.strategy = *s;
  }
  // The prompt.
  std::string text;
  std::vector<int> ids;
  bool as_ids = false;
  if (chat) {
    if (!j.contains("messages") || !j["messages"].is_array() || j["messages"].empty()) {
      return fail("messages", "'messages' must be a non-empty array of {role, content}");
    }
    if (model.tokenizer == nullptr) return fail("messages", "this node serves a synthetic model without a tokenizer: use /v1/completions with token ids");
    std::vector<std::pair<std::string, std::string>> msgs;
    for (size_t i = 0; i < j["messages"].size(); ++i) {
      const json& m = j["messages"][i];
      const std::string at = "messages[" + std::to_string(i) + "]";
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) return fail(at + ".role", "'role' of " + at + " must be a string");
      const std::string role = m["role"].get<std::string>();
      if (role != "system" && role != "developer" && role != "user" && role != "assistant") {
        return fail(at + ".role", "'role' of " + at + " is '" + role + "': system, developer, user or assistant");
      }
      std::string content;
      if (!m.contains("content") || !ContentText(m["content"], &content)) {
        return fail(at + ".content", "'content' of " + at + " must be text or an array of text parts");
      }
      msgs.emplace_back(role, std::move(content));
    }
    text = ChatPrompt(msgs);
  } else {
    if (!j.contains("prompt")) return fail("prompt", "'prompt' is required");
    json p = j["prompt"];
    // A batch of one is the one prompt; more than one is refused (one completion per request).
    if (p.is_array() && p.size() == 1 && (p[0].is_string() || p[0].is_array())) p = json(p[0]);
    if (p.is_string()) {
      text = p.get<std::string>();
    } else if (p.is_array() && !p.empty() && std::all_of(p.begin(), p.end(), [](const json& t) { return t.is_number_integer(); })) {
      as_ids = true;
      if (p.size() > model.max_prompt) {
        return fail("prompt", "prompt of " + std::to_string(p.size()) + " tokens is above this model's limit of " +
                                  std::to_string(model.max_prompt), 400, "context_length_exceeded");
      }
      for (const json& t : p) {
        const int64_t v = t.get<int64_t>();
        if (v < 0 || (model.tokenizer && uint64_t(v) >= model.tokenizer->vocab_size()) || v > (1 << 30)) {
          return fail("prompt", "'prompt' holds token id " + t.dump() + ", outside the vocabulary");
        }
        ids.push_back(int(v));
      }
    } else {
      return fail("prompt", "'prompt' must be a string, an array of token ids, or a batch of one of these");
    }
  }
  if (!as_ids) {
    if (model.tokenizer == nullptr) return fail("prompt", "this node serves a synthetic model without a tokenizer: send the prompt as token ids");
    if (text.empty()) return fail(chat ? "messages" : "prompt", "the prompt holds no text");
    const size_t max_bytes = size_t(model.max_prompt) * model.tokenizer->max_piece_bytes();
    if (text.size() > max_bytes) {
      return fail(chat ? "messages" : "prompt", "prompt text of " + std::to_string(text.size()) + " bytes cannot fit in " +
                                                    std::to_string(model.max_prompt) + " tokens", 400, "context_length_exceeded");
    }
    ids = model.tokenizer->Encode(text, true);
  }
  if (ids.size() > model.max_prompt) {
    return fail(chat ? "messages" : "prompt", "prompt of " + std::to_string(ids.size()) + " tokens is above this model's limit of " +
                                                  std::to_string(model.max_prompt), 400, "context_length_exceeded");
  }
  r.serve.prompt = std::move(ids);
  // Tokens to generate: OpenAI's default of 16 for completions; for chat, what the context leaves, at most 256.
  const uint32_t room = model.context > r.serve.prompt.size() ? model.context - uint32_t(r.serve.prompt.size()) : 0;
  uint64_t max_tokens = chat ? std::min<uint32_t>(room, 256) : 16;
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    if (!j.contains(key)) continue;
    if (Status st = JsonWholeNumber(j, key, 1, 9007199254740991.0, &max_tokens); !st.ok()) return fail(key, st.message());
    if (max_tokens > room) {
      return fail(key, "'" + std::string(key) + "' = " + std::to_string(max_tokens) + ": the prompt's " +
                           std::to_string(r.serve.prompt.size()) + " tokens leave room for " + std::to_string(room) +
                           " in this model's context of " + std::to_string(model.context), 400, "context_length_exceeded");
    }
  }
  if (max_tokens == 0) return fail(chat ? "messages" : "prompt", "the prompt fills this model's context of " + std::to_string(model.context) + " tokens", 400, "context_length_exceeded");
  r.serve.max_new_tokens = uint32_t(max_tokens);
  *out = std::move(r);
  return true;
}

CompletionText::CompletionText(const Tokenizer* tokenizer, std::vector<std::string> stop) : tokenizer_(tokenizer), stop_(std::move(stop)) {
  for (const std::string& s : stop_) hold_ = std::max(hold_, s.size() - 1);
}

bool CompletionText::Add(int token) {
  if (stopped_) return false;
  ids_.push_back(token);
  tokens_++;
  if (tokenizer_ == nullptr) return true;
  if (token == Tokenizer::kEos) {
    stopped_ = true;
    return false;
  }
  if (token >= 0 && uint32_t(token) < tokenizer_->vocab_size()) pending_ += tokenizer_->Decode(prev_, token);
  prev_ = token;
  size_t at = std::string::npos;
  for (const std::string& s : stop_) at = std::min(at, pending_.find(s));
  if (at != std::string::npos) {
    pending_.resize(at);
    stopped_ = true;
    return false;
  }
  return true;
}

std::string CompletionText::TakeReady() {
  if (stopped_) return TakeRest();
  // Keep what a stop text could still start with, and an unfinished UTF-8 character.
  size_t n = pending_.size() > hold_ ? pending_.size() - hold_ : 0;
  size_t lead = n;
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(pending_[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back for its lead
    const size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if (len > back) lead = n - back;   // the character is not complete yet
    break;
  }
  n = lead;
  std::string out = pending_.substr(0, n);
  pending_.erase(0, n);
  return out;
}

std::string CompletionText::TakeRest() {
  std::string out = std::move(pending_);
  pending_.clear();
  return out;
}

json KvserveExtension(const ServeResponse& r) {
  json j = ServeResponseObject(r, nullptr);
  j.erase("tokens");
  return j;
}

namespace {

json Usage(const OpenAiUsage& u) {
  return {{"prompt_tokens", u.prompt},
          {"completion_tokens", u.completion},
          {"total_tokens", u.prompt + u.completion},
          {"prompt_tokens_details", {{"cached_tokens", u.cached}}}};
}

json Envelope(const OpenAiRequest& req, const std::string& model, const std::string& id, int64_t created, bool chunk) {
  return {{"id", id},
          {"object", req.chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
          {"created", created},
          {"model", model},
          {"system_fingerprint", "kvserve"}};
}

}  // namespace

std::string CompletionJson(const OpenAiRequest& req, const std::string& model, const std::string& id, int64_t created,
                           const std::string& text, const std::string& finish_reason, const OpenAiUsage& usage,
                           const ServeResponse& r) {
  json j = Envelope(req, model, id, created, false);
  json choice = {{"index", 0}, {"finish_reason", finish_reason}, {"logprobs", nullptr}};
  if (req.chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  j["choices"] = json::array({choice});
  j["usage"] = Usage(usage);
  j["kvserve"] = KvserveExtension(r);
  return Dump(j) + "\n";
}

std::string StreamChunk(const OpenAiRequest& req, const std::string& model, const std::string& id, int64_t created,
                        const std::string* text, const std::string& finish_reason) {
  json j = Envelope(req, model, id, created, true);
  json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)}};
  if (req.chat) {
    choice["delta"] = text == nullptr ? json{{"role", "assistant"}, {"content", ""}}
                      : finish_reason.empty() ? json{{"content", *text}}
                                              : json::object();
  } else {
    choice["text"] = text ? *text : "";
  }
  j["choices"] = json::array({choice});
  return "data: " + Dump(j) + "\n\n";
}

std::string StreamUsageChunk(const OpenAiRequest& req, const std::string& model, const std::string& id, int64_t created,
                             const OpenAiUsage& usage, const ServeResponse& r) {
  json j = Envelope(req, model, id, created, true);
  j["choices"] = json::array();
  j["usage"] = Usage(usage);
  j["kvserve"] = KvserveExtension(r);
  return "data: " + Dump(j) + "\n\n";
}

std::string ModelsJson(const OpenAiModel& model, const std::string& owner) {
  json m = {{"id", model.id}, {"object", "model"}, {"created", model.created}, {"owned_by", owner}, {"max_model_len", model.context}};
  return Dump(json{{"object", "list"}, {"data", json::array({m})}}) + "\n";
}

}  // namespace kvserve::serve_internal
