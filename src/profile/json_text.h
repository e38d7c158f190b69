// Internal: JSON text from files, parsed without exceptions, with the position of a syntax error
// and a nesting limit (nlohmann's dump and destructor recurse: a hostile file nested 200,000
// deep would overflow the stack).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "kvserve/status.h"

namespace kvserve {

inline constexpr int kMaxJsonDepth = 64;

// `origin` names the file in errors: "p.json: JSON syntax error at byte 17: ...".
Result<nlohmann::json> ParseJsonText(std::string_view text, std::string_view origin, int max_depth = kMaxJsonDepth);

}  // namespace kvserve
