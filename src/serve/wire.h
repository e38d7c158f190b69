// Internal to serve: JSON messages over a Connection, and elapsed time, for both node kinds.
#pragma once

#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "kvserve/transport.h"

namespace kvserve::serve_internal {

inline double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

inline Status SendJson(Connection* c, MessageKind kind, const nlohmann::json& j, Clock::time_point deadline) {
  const std::string s = j.dump();
  return c->Send(kind, std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size()), deadline);
}

}  // namespace kvserve::serve_internal
