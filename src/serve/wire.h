// Internal to serve: JSON messages over a Connection, and elapsed time, for both node kinds.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvserve/frame.h"
#include "kvserve/serve.h"
#include "kvserve/transport.h"

namespace kvserve::serve_internal {

inline double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
// Seconds on the steady clock (for differences and the estimator's timestamps).
inline double NowSeconds() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }
// The bandwidth a node's decision plans with (bytes/s): its estimator's, or the assumed rate
// before anything was measured.
inline double PlanningBps(const BandwidthEstimator& e, double assume_gbps) {
  return e.has_estimate() ? e.PlanningEstimate(NowSeconds()) : assume_gbps * 1e9 / 8;
}

// CPU seconds the calling thread has used (user and system), for timing what a call costs the CPU
// rather than the wall clock; 0 where the clock is unavailable.
double ThreadCpuSeconds();
// Cores this process may run on (its affinity mask), at least 1.
int UsableCores();

// JSON text that never throws: strings that are not UTF-8 (a peer's bytes, a model's byte
// tokens cut mid-character) are written with U+FFFD in place of the bad bytes.
inline std::string Dump(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

inline Status SendJson(Connection* c, MessageKind kind, const nlohmann::json& j, Clock::time_point deadline) {
  const std::string s = Dump(j);
  return c->Send(kind, std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size()), deadline);
}

// Runs a thread's body, turning any exception (an allocation refused, a library's throw) into
// a status: no exception leaves a thread a node starts, which would terminate the process.
template <typename F>
Status Guarded(const char* what, F&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    return Status::Internal(std::string(what) + ": " + e.what());
  } catch (...) {
    return Status::Internal(std::string(what) + ": unknown exception");
  }
}

// ---- JSON fields of request bodies, checked -------------------------------------------------------
// The JSON object in `text`, its nesting bounded (kMaxRequestJsonDepth) before it is parsed: a
// parser, a serialiser or a destructor that recurses per level would otherwise overflow a stack.
Result<nlohmann::json> ParseJsonObject(std::string_view text);
// An optional number field in [lo, hi]; `out` keeps its default when the field is absent.
Status JsonNumber(const nlohmann::json& j, const char* key, double lo, double hi, double* out);
// The same for a whole number (7.0 included).
Status JsonWholeNumber(const nlohmann::json& j, const char* key, double lo, double hi, uint64_t* out);

// ServeResponseJson's object (the HTTP answer of /generate, and the OpenAI answers' extension).
nlohmann::json ServeResponseObject(const ServeResponse& r, const Tokenizer* tokenizer);

// Sampling fields of a body or message: temperature in [0, 100], top_p in (0, 1], seed an
// integer; absent fields keep `s`'s values.
Status ReadSampling(const nlohmann::json& j, Sampling* s);

// ---- The decode port's JSON messages ----------------------------------------------------------
// Each parser checks every field's type and range before anything is allocated from it, and
// names the bad field; they are fuzzed (fuzz/serve_fuzz.cc).

// Bodies of request, resend, result and error messages are at most this long (a result holds at
// most max_new_tokens ids: ResultMessageLimit).
inline constexpr uint64_t kControlMessageBytes = 64 << 10;
inline uint64_t ResultMessageLimit(uint32_t max_new_tokens) { return kControlMessageBytes + uint64_t{24} * max_new_tokens; }

// The longest frame `elements` KV values of n_token tokens can code to, whatever the strategy
// and the KV's dtype: 8 bytes a value (twice f32; an 8-bit code with its own fp16 range, group=1,
// takes 5) and the largest header (spec, kept positions, checksum). Frames and pool values above
// it are refused unread.
inline uint64_t MaxFrameBytes(uint64_t elements, uint32_t n_token) {
  return 8 * elements + kFrameFixedHeader + kFrameMaxSpec + 4 + uint64_t{4} * n_token + kFrameChecksumBytes;
}

// prefill -> decode: what to generate after the KV that follows.
struct DecodeRequestMessage {
  uint64_t id = 0;
  uint32_t max_new_tokens = 0;
  int first_token = 0;
  uint32_t prompt_len = 0;
  bool stream = false;  // send tokens as generated (kTokens messages) before the result
  Sampling sampling;    // as the prefill node picked the first token
};
// Limits of the receiving decode node: token ids below `vocab`, prompts below `max_prompt_len`
// tokens, at most `max_new_tokens` generated.
Result<DecodeRequestMessage> ParseDecodeRequest(std::span<const uint8_t> body, uint32_t vocab, uint32_t max_prompt_len,
                                                uint32_t max_new_tokens);
// decode -> prefill: the frames to send again, each an index below n_frames, each once (sorted).
Result<std::vector<uint32_t>> ParseResendMessage(std::span<const uint8_t> body, uint32_t n_frames);
// decode -> prefill: the generated tokens (at most max_new_tokens, each below vocab) and timings.
struct DecodeResultMessage {
  std::vector<int> tokens;
  double decode_s = 0, generate_s = 0;
};
Result<DecodeResultMessage> ParseDecodeResult(std::span<const uint8_t> body, uint32_t max_new_tokens, uint32_t vocab);
// decode -> prefill, streaming: the next tokens (1 to max_tokens of them, each below vocab).
Result<std::vector<int>> ParseTokensMessage(std::span<const uint8_t> body, uint32_t max_tokens, uint32_t vocab);
// The reason an error message gives (a description when it gives none that is text).
std::string ParseErrorMessage(std::span<const uint8_t> body);

// Items between a producer and a consumer thread (encoded frames waiting for the wire, fetched
// chunks waiting to be decoded): the producer blocks when `capacity` are queued, so a slow
// consumer holds it back instead of letting items pile up in memory.
template <typename T>
class BoundedQueue {
 public:
  explicit BoundedQueue(size_t capacity) : capacity_(capacity) {}
  bool Push(T f) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return q_.size() < capacity_ || closed_; });
    if (closed_) return false;
    q_.push_back(std::move(f));
    cv_.notify_all();
    return true;
  }
  // Empty when the producer finished (or failed) and everything was taken.
  std::optional<T> Pop() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !q_.empty() || done_ || closed_; });
    if (q_.empty()) return std::nullopt;
    T f = std::move(q_.front());
    q_.pop_front();
    cv_.notify_all();
    return f;
  }
  void Finish() { std::lock_guard<std::mutex> l(mu_); done_ = true; cv_.notify_all(); }
  // The consumer gives up: a blocked or later Push returns false.
  void Close() { std::lock_guard<std::mutex> l(mu_); closed_ = true; cv_.notify_all(); }

 private:
  size_t capacity_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<T> q_;
  bool done_ = false, closed_ = false;
};

}  // namespace kvserve::serve_internal
