// JSON of the HTTP API (ServeRequest in, ServeResponse out) and node metrics as Prometheus text.
#include <cmath>
#include <nlohmann/json.hpp>

#include "kvserve/codec.h"
#include "kvserve/serve.h"

namespace kvserve {

using json = nlohmann::json;

Result<ServeRequest> ParseServeRequest(const std::string& text, const Tokenizer* tokenizer, uint32_t max_prompt) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    return Status::InvalidArgument(std::string("request is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) return Status::InvalidArgument("request must be a JSON object");
  ServeRequest r;
  auto number = [&](const char* key, double lo, double hi, double* out) -> Status {
    if (!j.contains(key)) return Status::Ok();
    if (!j[key].is_number()) return Status::InvalidArgument(std::string("'") + key + "' must be a number");
    const double v = j[key].get<double>();
    if (!std::isfinite(v) || v < lo || v > hi) {
      return Status::InvalidArgument(std::string("'") + key + "' = " + j[key].dump() + " is not in [" +
                                     json(lo).dump() + ", " + json(hi).dump() + "]");
    }
    *out = v;
    return Status::Ok();
  };
  double id = 0, max_new = r.max_new_tokens;
  KV_RETURN_IF_ERROR(number("id", 0, 9007199254740991.0, &id));
  KV_RETURN_IF_ERROR(number("max_new_tokens", 1, 1 << 20, &max_new));
  KV_RETURN_IF_ERROR(number("slo_ms", 1e-3, 1e9, &r.slo_ms));
  KV_RETURN_IF_ERROR(number("floor", 0, 1.05, &r.floor));
  r.id = uint64_t(id);
  r.max_new_tokens = uint32_t(max_new);
  for (const char* key : {"label", "strategy", "prompt"}) {
    if (j.contains(key) && !j[key].is_string()) return Status::InvalidArgument(std::string("'") + key + "' must be a string");
  }
  if (j.contains("label")) r.label = j["label"].get<std::string>();
  if (j.contains("strategy")) {
    r.strategy = j["strategy"].get<std::string>();
    KV_ASSIGN_OR_RETURN(r.strategy, CanonicalStrategy(r.strategy));
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
    if (p.size() > size_t(max_prompt) * 64) return Status::OutOfRange("prompt text of " + std::to_string(p.size()) + " bytes is too long");
    r.prompt = tokenizer->Encode(p, true);
    if (r.prompt.size() > max_prompt) {
      return Status::OutOfRange("prompt of " + std::to_string(r.prompt.size()) + " tokens is above the limit of " +
                                std::to_string(max_prompt));
    }
  }
  if (r.prompt.empty()) return Status::InvalidArgument("empty prompt");
  return r;
}

std::string ServeResponseJson(const ServeResponse& r, const Tokenizer* tokenizer) {
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
    j["text"] = text;
  }
  return j.dump();
}

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
