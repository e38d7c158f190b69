// JSON of the HTTP API (ServeRequest in, ServeResponse out, the router's forwarded body), the
// decode port's JSON messages, and node metrics as Prometheus text.
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "kvserve/codec.h"
#include "kvserve/serve.h"
#include "kvserve/testbed.h"
#include "serve/wire.h"

namespace kvserve {

using json = nlohmann::json;
using serve_internal::Dump;

Status CheckJsonNesting(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char ch : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (ch == '\\') escaped = true;
      else if (ch == '"') in_string = false;
      continue;
    }
    if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > max_depth) {
        return Status::InvalidArgument("request nests arrays or objects deeper than " + std::to_string(max_depth) + " levels");
      }
    } else if (ch == ']' || ch == '}') {
      depth = std::max(0, depth - 1);
    }
  }
  return Status::Ok();
}

namespace serve_internal {

// The JSON object in `text`, its nesting bounded before it is parsed (a parser, a serialiser or
// a destructor that recurses per level would otherwise overflow a worker's stack).
Result<json> ParseJsonObject(std::string_view text) {
  KV_RETURN_IF_ERROR(CheckJsonNesting(text, kMaxRequestJsonDepth));
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    // The reason names the position (text that is not UTF-8 included).
    return Status::InvalidArgument(std::string("request is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) return Status::InvalidArgument("request must be a JSON object");
  return j;
}

// An optional number field in [lo, hi]; `out` keeps its default when the field is absent.
Status JsonNumber(const json& j, const char* key, double lo, double hi, double* out) {
  if (!j.contains(key)) return Status::Ok();
  const json& v = j[key];
  if (!v.is_number()) return Status::InvalidArgument(std::string("'") + key + "' must be a number");
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < lo || d > hi) {
    return Status::InvalidArgument(std::string("'") + key + "' = " + Dump(v) + " is not in [" + json(lo).dump() + ", " +
                                   json(hi).dump() + "]");
  }
  *out = d;
  return Status::Ok();
}

// The same for an integer (a whole float such as 7.0 included).
Status JsonWholeNumber(const json& j, const char* key, double lo, double hi, uint64_t* out) {
  double d = double(*out);
  KV_RETURN_IF_ERROR(JsonNumber(j, key, lo, hi, &d));
  if (d != std::floor(d)) return Status::InvalidArgument(std::string("'") + key + "' = " + Dump(j[key]) + " is not a whole number");
  *out = j.contains(key) && j[key].is_number_unsigned() ? j[key].get<uint64_t>() : uint64_t(d);
  return Status::Ok();
}

}  // namespace serve_internal

using serve_internal::JsonNumber;
using serve_internal::JsonWholeNumber;
using serve_internal::ParseJsonObject;

Result<std::string> RequestStrategy(const std::string& text) {
  if (text.size() > kMaxRequestStrategyBytes) {
    return Status::InvalidArgument("'strategy' of " + std::to_string(text.size()) + " bytes is above the limit of " +
                                   std::to_string(kMaxRequestStrategyBytes));
  }
  KV_ASSIGN_OR_RETURN(StrategySpec spec, ParseStrategy(text));
  if (spec.stages.size() > kMaxRequestStrategyStages) {
    return Status::InvalidArgument("'strategy' has " + std::to_string(spec.stages.size()) + " stages, above the limit of " +
                                   std::to_string(kMaxRequestStrategyStages) + " a request may ask for");
  }
  for (size_t i = 0; i < spec.stages.size(); ++i) {
    for (size_t k = 0; k < i; ++k) {
      if (spec.stages[k].name == spec.stages[i].name) {
        return Status::InvalidArgument("'strategy' names stage '" + spec.stages[i].name + "' twice; a request may use each stage once");
      }
    }
  }
  return CanonicalStrategy(text);
}

Result<ServeRequest> ParseServeRequest(const std::string& text, const Tokenizer* tokenizer, uint32_t max_prompt) {
  KV_ASSIGN_OR_RETURN(json j, ParseJsonObject(text));
  ServeRequest r;
  uint64_t id = 0, max_new = r.max_new_tokens;
  KV_RETURN_IF_ERROR(JsonWholeNumber(j, "id", 0, 9007199254740991.0, &id));
  KV_RETURN_IF_ERROR(JsonWholeNumber(j, "max_new_tokens", 1, 1 << 20, &max_new));
  KV_RETURN_IF_ERROR(JsonNumber(j, "slo_ms", 1e-3, 1e9, &r.slo_ms));
  KV_RETURN_IF_ERROR(JsonNumber(j, "floor", 0, 1.05, &r.floor));
  r.id = id;
  r.max_new_tokens = uint32_t(max_new);
  KV_RETURN_IF_ERROR(serve_internal::ReadSampling(j, &r.sampling));
  for (const char* key : {"label", "strategy", "prompt"}) {
    if (j.contains(key) && !j[key].is_string()) return Status::InvalidArgument(std::string("'") + key + "' must be a string");
  }
  if (j.contains("label")) r.label = j["label"].get<std::string>();
  if (j.contains("strategy")) {
    KV_ASSIGN_OR_RETURN(r.strategy, RequestStrategy(j["strategy"].get<std::string>()));
  }
  const bool has_prompt = j.contains("prompt"), has_tokens = j.contains("tokens");
  if (has_prompt == has_tokens) return Status::InvalidArgument("give exactly one of 'prompt' (text) or 'tokens' (ids)");
  if (has_tokens) {
    if (!j["tokens"].is_array()) return Status::InvalidArgument("'tokens' must be an array of token ids");
    if (j["tokens"].size() > max_prompt) {
      return Status::OutOfRange("prompt of " + std::to_string(j["tokens"].size()) + " tokens is above the limit of " +
                                std::to_string(max_prompt));
    }
    for (const json& t : j["tokens"]) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > (1 << 30)) {
        return Status::InvalidArgument("'tokens' holds " + t.dump() + ", not a token id");
      }
      r.prompt.push_back(int(t.get<int64_t>()));
    }
  } else {
    if (tokenizer == nullptr) return Status::InvalidArgument("this node has no tokenizer: send 'tokens'");
    const std::string& p = j["prompt"].get_ref<const std::string&>();
    if (p.empty()) return Status::InvalidArgument("empty prompt: 'prompt' holds no text");
    // Every token covers at most max_piece_bytes of text: a longer text cannot fit, and is
    // refused before the tokenizer spends time on it.
    const size_t max_bytes = size_t(max_prompt) * tokenizer->max_piece_bytes();
    if (p.size() > max_bytes) {
      return Status::OutOfRange("prompt text of " + std::to_string(p.size()) + " bytes cannot fit in " +
                                std::to_string(max_prompt) + " tokens (at most " + std::to_string(max_bytes) + " bytes)");
    }
    r.prompt = tokenizer->Encode(p, true);
    if (r.prompt.size() > max_prompt) {
      return Status::OutOfRange("prompt of " + std::to_string(r.prompt.size()) + " tokens is above the limit of " +
                                std::to_string(max_prompt));
    }
  }
  if (r.prompt.empty()) return Status::InvalidArgument("empty prompt");
  return r;
}

Result<RoutedRequest> RouteRequest(const std::string& body, uint32_t long_prompt_tokens) {
  KV_ASSIGN_OR_RETURN(json j, ParseJsonObject(body));
  RoutedRequest out;
  if (j.contains("label")) {
    if (!j["label"].is_string()) return Status::InvalidArgument("'label' must be a string");
    out.label = j["label"].get<std::string>();
  }
  if (out.label.empty()) {
    const size_t n = j.contains("tokens") && j["tokens"].is_array() ? j["tokens"].size()
                     : j.contains("prompt") && j["prompt"].is_string() ? j["prompt"].get_ref<const std::string&>().size() / 4
                                                                       : 0;
    out.label = n >= long_prompt_tokens ? "long" : "short";
  }
  // Only the fields a node reads go on; the node validates them.
  json fwd = json::object();
  for (const char* key : {"id", "prompt", "tokens", "max_new_tokens", "slo_ms", "floor", "strategy", "temperature", "top_p", "seed"}) {
    if (j.contains(key)) fwd[key] = std::move(j[key]);
  }
  fwd["label"] = out.label;
  out.body = Dump(fwd);
  return out;
}

json serve_internal::ServeResponseObject(const ServeResponse& r, const Tokenizer* tokenizer) {
  const StageTimings& t = r.timings;
  json j = {{"id", r.id},
            {"tokens", r.tokens},
            {"strategy", r.strategy},
            {"explanation", r.explanation},
            {"kv_bytes", r.kv_bytes},
            {"wire_bytes", r.wire_bytes},
            {"ratio", r.wire_bytes ? double(r.kv_bytes) / double(r.wire_bytes) : 0.0},
            {"resent_layers", r.resent_layers},
            {"decode_node", r.decode_node},
            {"timings_ms",
             {{"queue", t.queue_s * 1e3},
              {"prefill", t.prefill_s * 1e3},
              {"encode", t.encode_s * 1e3},
              {"wire", t.wire_s * 1e3},
              {"decode", t.decode_s * 1e3},
              {"transfer", t.transfer_s * 1e3},
              {"generate", t.generate_s * 1e3},
              {"total", t.total_s * 1e3}}}};
  if (!r.pool_action.empty()) {
    j["pool"] = {{"action", r.pool_action}, {"cached_tokens", r.cached_tokens}, {"stored_bytes", r.stored_bytes}};
    j["timings_ms"]["fetch"] = t.fetch_s * 1e3;
    j["timings_ms"]["first_token"] = t.first_token_s * 1e3;
    j["timings_ms"]["store"] = t.store_s * 1e3;
  }
  if (tokenizer != nullptr) {
    std::string text;
    int prev = Tokenizer::kEos;  // a continuation: keep the first piece's leading space (only BOS drops it)
    for (int id : r.tokens) {
      if (id >= 0 && uint32_t(id) < tokenizer->vocab_size()) text += tokenizer->Decode(prev, id);
      prev = id;
    }
    j["text"] = text;  // byte tokens may cut a character: Dump replaces what is not UTF-8
  }
  return j;
}

std::string ServeResponseJson(const ServeResponse& r, const Tokenizer* tokenizer) {
  return Dump(serve_internal::ServeResponseObject(r, tokenizer));
}

// The driver's reading of a node's answer: what ServeResponseJson wrote (and the router's extra
// field, ignored). A field of the wrong kind is kCorrupt naming it: a node that answers 200 with
// something else is a broken node, not a bad request.
Result<ServeResponse> ServeResponseFromJson(std::string_view body) {
  auto parsed = ParseJsonObject(body);
  if (!parsed.ok()) return Status::Corrupt("answer: " + parsed.status().message());
  const json& j = parsed.value();
  auto fail = [](const Status& st) { return Status::Corrupt("answer: " + st.message()); };
  ServeResponse r;
  uint64_t id = 0, kv_bytes = 0, wire_bytes = 0, resent = 0;
  const double kMaxWhole = 9007199254740991.0;
  for (auto [key, out] : {std::pair{"id", &id}, {"kv_bytes", &kv_bytes}, {"wire_bytes", &wire_bytes}, {"resent_layers", &resent}}) {
    if (!j.contains(key)) return Status::Corrupt(std::string("answer has no '") + key + "'");
    if (Status st = JsonWholeNumber(j, key, 0, kMaxWhole, out); !st.ok()) return fail(st);
  }
  r.id = id, r.kv_bytes = kv_bytes, r.wire_bytes = wire_bytes, r.resent_layers = uint32_t(resent);
  for (auto [key, out] : {std::pair{"strategy", &r.strategy}, {"explanation", &r.explanation}, {"decode_node", &r.decode_node}}) {
    if (j.contains(key) && !j[key].is_string()) return Status::Corrupt(std::string("answer: '") + key + "' is not a string");
    if (j.contains(key)) *out = j[key].get<std::string>();
  }
  if (!j.contains("tokens") || !j["tokens"].is_array()) return Status::Corrupt("answer: 'tokens' is not an array");
  for (const json& t : j["tokens"]) {
    const bool id = t.is_number_unsigned() ? t.get<uint64_t>() <= uint64_t(INT32_MAX) : t.is_number_integer() && t.get<int64_t>() >= 0;
    if (!id) return Status::Corrupt("answer: 'tokens' holds " + Dump(t) + ", not a token id");
    r.tokens.push_back(int(t.get<int64_t>()));
  }
  if (!j.contains("timings_ms") || !j["timings_ms"].is_object()) return Status::Corrupt("answer has no 'timings_ms' object");
  const json& t = j["timings_ms"];
  StageTimings& st = r.timings;
  for (auto [key, out] : {std::pair{"queue", &st.queue_s}, {"prefill", &st.prefill_s}, {"encode", &st.encode_s}, {"wire", &st.wire_s},
                          {"decode", &st.decode_s}, {"transfer", &st.transfer_s}, {"generate", &st.generate_s},
                          {"total", &st.total_s}, {"fetch", &st.fetch_s}, {"first_token", &st.first_token_s},
                          {"store", &st.store_s}}) {
    double ms = 0;
    if (Status s = JsonNumber(t, key, 0, 1e12, &ms); !s.ok()) return fail(s);
    *out = ms / 1e3;
  }
  if (j.contains("pool")) {
    const json& p = j["pool"];
    if (!p.is_object() || !p.contains("action") || !p["action"].is_string()) return Status::Corrupt("answer: 'pool' has no 'action'");
    r.pool_action = p["action"].get<std::string>();
    uint64_t cached = 0, stored = 0;
    if (Status s = JsonWholeNumber(p, "cached_tokens", 0, kMaxWhole, &cached); !s.ok()) return fail(s);
    if (Status s = JsonWholeNumber(p, "stored_bytes", 0, kMaxWhole, &stored); !s.ok()) return fail(s);
    r.cached_tokens = uint32_t(cached), r.stored_bytes = stored;
  }
  return r;
}

// ---- Decode port messages --------------------------------------------------------------------
namespace serve_internal {
namespace {

Result<json> ParseMessage(std::span<const uint8_t> body, const char* what) {
  // Its length was bounded by the connection before it was read.
  const std::string_view text(reinterpret_cast<const char*>(body.data()), body.size());
  if (!CheckJsonNesting(text, kMaxRequestJsonDepth).ok()) return Status::Corrupt(std::string(what) + " message nests too deep");
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Status::Corrupt(std::string("malformed ") + what + " message");
  return j;
}

// An unsigned integer field below `limit` (JSON floats and negative numbers are refused).
bool IndexField(const json& j, const char* key, uint64_t limit, uint64_t* out) {
  if (!j.contains(key) || !j[key].is_number_unsigned()) return false;
  const uint64_t v = j[key].get<uint64_t>();
  if (v >= limit) return false;
  *out = v;
  return true;
}

}  // namespace

// temperature in [0, 100], top_p in (0, 1], seed an unsigned integer; absent fields keep theirs.
Status ReadSampling(const json& j, Sampling* s) {
  double t = s->temperature, p = s->top_p;
  KV_RETURN_IF_ERROR(JsonNumber(j, "temperature", 0, 100, &t));
  KV_RETURN_IF_ERROR(JsonNumber(j, "top_p", 1e-9, 1, &p));
  if (j.contains("seed")) {
    if (!j["seed"].is_number_integer()) return Status::InvalidArgument("'seed' must be an integer");
    s->seed = j["seed"].is_number_unsigned() ? j["seed"].get<uint64_t>() : uint64_t(j["seed"].get<int64_t>());
  }
  s->temperature = float(t);
  s->top_p = float(p);
  return Status::Ok();
}

Result<DecodeRequestMessage> ParseDecodeRequest(std::span<const uint8_t> body, uint32_t vocab, uint32_t max_prompt_len,
                                                uint32_t max_new_tokens) {
  KV_ASSIGN_OR_RETURN(json j, ParseMessage(body, "request"));
  DecodeRequestMessage m;
  uint64_t first = 0, prompt = 0, max_new = 0;
  if (!IndexField(j, "id", UINT64_MAX, &m.id)) return Status::InvalidArgument("request message: 'id' is not an unsigned integer");
  if (!IndexField(j, "first_token", vocab, &first)) {
    return Status::InvalidArgument("request " + std::to_string(m.id) + ": 'first_token' is not a token id below " + std::to_string(vocab));
  }
  if (!IndexField(j, "prompt_len", uint64_t{max_prompt_len} + 1, &prompt) || prompt == 0) {
    return Status::InvalidArgument("request " + std::to_string(m.id) + ": 'prompt_len' is not in [1, " + std::to_string(max_prompt_len) + "]");
  }
  if (!IndexField(j, "max_new_tokens", UINT64_MAX, &max_new) || max_new == 0) {
    return Status::InvalidArgument("request " + std::to_string(m.id) + ": 'max_new_tokens' is not a positive integer");
  }
  if (j.contains("stream")) {
    if (!j["stream"].is_boolean()) return Status::InvalidArgument("request " + std::to_string(m.id) + ": 'stream' is not true or false");
    m.stream = j["stream"].get<bool>();
  }
  KV_RETURN_IF_ERROR(ReadSampling(j, &m.sampling).WithContext("request " + std::to_string(m.id)));
  m.first_token = int(first);
  m.prompt_len = uint32_t(prompt);
  m.max_new_tokens = uint32_t(std::min<uint64_t>(max_new, max_new_tokens));
  return m;
}

Result<std::vector<int>> ParseTokensMessage(std::span<const uint8_t> body, uint32_t max_tokens, uint32_t vocab) {
  KV_ASSIGN_OR_RETURN(json j, ParseMessage(body, "tokens"));
  if (!j.contains("tokens") || !j["tokens"].is_array()) return Status::Corrupt("tokens message without a 'tokens' array");
  const json& t = j["tokens"];
  if (t.empty() || t.size() > max_tokens) {
    return Status::Corrupt("tokens message of " + std::to_string(t.size()) + " tokens (1 to " + std::to_string(max_tokens) + " expected)");
  }
  std::vector<int> out;
  for (const json& v : t) {
    if (!v.is_number_unsigned() || v.get<uint64_t>() >= vocab) {
      return Status::Corrupt("tokens message holds " + v.dump() + ", not a token id below " + std::to_string(vocab));
    }
    out.push_back(int(v.get<uint64_t>()));
  }
  return out;
}

Result<std::vector<uint32_t>> ParseResendMessage(std::span<const uint8_t> body, uint32_t n_frames) {
  KV_ASSIGN_OR_RETURN(json j, ParseMessage(body, "resend"));
  if (!j.contains("layers") || !j["layers"].is_array()) return Status::Corrupt("resend message without a 'layers' array");
  const json& layers = j["layers"];
  if (layers.empty() || layers.size() > n_frames) {
    return Status::Corrupt("resend message asks for " + std::to_string(layers.size()) + " frames of " + std::to_string(n_frames));
  }
  std::vector<bool> seen(n_frames, false);
  std::vector<uint32_t> out;
  for (const json& l : layers) {
    if (!l.is_number_unsigned() || l.get<uint64_t>() >= n_frames) {
      return Status::Corrupt("resend message asks for frame " + Dump(l) + " of " + std::to_string(n_frames));
    }
    const uint32_t f = uint32_t(l.get<uint64_t>());
    if (seen[f]) return Status::Corrupt("resend message asks for frame " + std::to_string(f) + " twice");
    seen[f] = true;
    out.push_back(f);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Result<DecodeResultMessage> ParseDecodeResult(std::span<const uint8_t> body, uint32_t max_new_tokens, uint32_t vocab) {
  KV_ASSIGN_OR_RETURN(json j, ParseMessage(body, "result"));
  if (!j.contains("tokens") || !j["tokens"].is_array()) return Status::Corrupt("result message without a 'tokens' array");
  const json& tokens = j["tokens"];
  if (tokens.size() > max_new_tokens) {
    return Status::Corrupt("result message holds " + std::to_string(tokens.size()) + " tokens; " +
                           std::to_string(max_new_tokens) + " were asked for");
  }
  DecodeResultMessage m;
  for (const json& t : tokens) {
    if (!t.is_number_unsigned() || t.get<uint64_t>() >= vocab) {
      return Status::Corrupt("result message holds " + Dump(t) + ", not a token id below " + std::to_string(vocab));
    }
    m.tokens.push_back(int(t.get<uint64_t>()));
  }
  for (auto [key, out] : {std::pair<const char*, double*>{"decode_s", &m.decode_s}, {"generate_s", &m.generate_s}}) {
    if (!j.contains(key)) continue;
    if (!j[key].is_number() || !std::isfinite(j[key].get<double>()) || j[key].get<double>() < 0) {
      return Status::Corrupt(std::string("result message: '") + key + "' is not a non-negative number");
    }
    *out = j[key].get<double>();
  }
  return m;
}

std::string ParseErrorMessage(std::span<const uint8_t> body) {
  auto j = ParseMessage(body, "error");
  if (!j.ok()) return j.status().message();
  if (!j->contains("error") || !(*j)["error"].is_string()) return "error message gives no reason";
  return (*j)["error"].get<std::string>();
}

double ThreadCpuSeconds() {
  timespec ts{};
  if (::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0;
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

}  // namespace serve_internal

std::string NodeMetrics::Prometheus(const std::string& node) const {
  std::string out;
  auto counter = [&](const char* name, const char* help, double v) {
    out += std::string("# HELP kvserve_") + name + " " + help + "\n# TYPE kvserve_" + name + " counter\n";
    out += std::string("kvserve_") + name + "{node=\"" + node + "\"} " + json(v).dump() + "\n";
  };
  counter("requests_total", "requests served", double(requests));
  counter("errors_total", "requests that failed", double(errors));
  counter("kv_bytes_total", "raw KV bytes of the requests", double(kv_bytes));
  counter("wire_bytes_total", "frame bytes sent or received", double(wire_bytes));
  counter("resent_layers_total", "layers sent a second time after failing verification", double(resent_layers));
  counter("corrupt_frames_total", "frames that failed verification on arrival", double(corrupt_frames));
  counter("encode_seconds_total", "codec encode time", double(encode_us) / 1e6);
  counter("wire_seconds_total", "time spent sending frames", double(wire_us) / 1e6);
  counter("decode_seconds_total", "codec decode time", double(decode_us) / 1e6);
  if (pool_hits + pool_misses + pool_recomputes > 0) {
    counter("pool_hits_total", "requests that fetched a cached prefix", double(pool_hits));
    counter("pool_misses_total", "requests with no usable cached prefix", double(pool_misses));
    counter("pool_recomputes_total", "requests that recomputed although a prefix was cached", double(pool_recomputes));
    counter("pool_corrupt_total", "pool values that failed verification (deleted)", double(pool_corrupt));
    counter("pool_errors_total", "pool backend failures (served without it)", double(pool_errors));
    counter("pool_cached_tokens_total", "prompt tokens whose KV came from the pool", double(cached_tokens));
    counter("pool_computed_tokens_total", "prompt tokens computed", double(computed_tokens));
    counter("pool_stored_bytes_total", "bytes stored into the pool", double(stored_bytes));
  }
  return out;
}

}  // namespace kvserve
