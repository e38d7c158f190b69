// Status helpers: names and formatting of error codes.
#include "kvserve/status.h"

#include <cstdio>
#include <cstdlib>

namespace kvserve {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kCorrupt: return "corrupt";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kNotFound: return "not found";
    case StatusCode::kIoError: return "i/o error";
    case StatusCode::kOutOfRange: return "out of range";
    case StatusCode::kInternal: return "internal error";
    case StatusCode::kUnavailable: return "unavailable";
  }
  return "unknown";
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

Status Status::WithContext(const std::string& context) const {
  if (ok()) return *this;
  return Status(code_, context + ": " + message_);
}

namespace internal {
void DieOnValueOfError(const Status& status) {
  std::fprintf(stderr, "kvserve: bug: Result::value() called on an error: %s\n", status.ToString().c_str());
  std::abort();
}
}  // namespace internal

}  // namespace kvserve
