// Internal to serve: JSON messages over a Connection, and elapsed time, for both node kinds.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>

#include "kvserve/transport.h"

namespace kvserve::serve_internal {

inline double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

inline Status SendJson(Connection* c, MessageKind kind, const nlohmann::json& j, Clock::time_point deadline) {
  const std::string s = j.dump();
  return c->Send(kind, std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size()), deadline);
}

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
