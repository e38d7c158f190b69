// Status and Result<T>: how every kvserve library call reports failure.
// Errors are values with a message that names the bad field and value; no exceptions cross the API.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace kvserve {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,  // the caller passed something malformed (a spec, a flag, a shape)
  kCorrupt,          // stored or received bytes fail verification (checksum, length, magic)
  kUnsupported,      // well-formed but not handled by this build (a newer frame version)
  kNotFound,         // a file, key or stage that does not exist
  kIoError,          // the operating system refused (open, read, write, socket)
  kOutOfRange,       // a value exceeds a configured limit (decoded size, shape)
  kInternal,         // a bug in kvserve; never caused by input
  kUnavailable,      // a peer is unreachable, closed the connection or missed its deadline
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status Corrupt(std::string m) { return {StatusCode::kCorrupt, std::move(m)}; }
  static Status Unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
  static Status OutOfRange(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "corrupt: frame checksum mismatch ..." — what the CLI prints.
  std::string ToString() const;
  // Returns a copy whose message is prefixed with context ("reading x.kvf: ...").
  Status WithContext(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

namespace internal {
[[noreturn]] void DieOnValueOfError(const Status& status);
}  // namespace internal

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    if (std::get<Status>(v_).ok()) v_ = Status::Internal("Result constructed from an OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : *std::get_if<Status>(&v_);
  }
  // value() of an error is a bug in the caller, never a consequence of input: it prints the
  // error and stops the process (no exception crosses the API). Check ok() first.
  T& value() & { return *Checked(); }
  const T& value() const& { return *const_cast<Result*>(this)->Checked(); }
  // By value, so `for (auto& x : F().value())` does not dangle.
  T value() && { return std::move(*Checked()); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  T* Checked() {
    if (T* v = std::get_if<T>(&v_)) return v;
    internal::DieOnValueOfError(*std::get_if<Status>(&v_));
  }
  std::variant<T, Status> v_;
};

}  // namespace kvserve

#define KV_CONCAT_INNER_(a, b) a##b
#define KV_CONCAT_(a, b) KV_CONCAT_INNER_(a, b)

#define KV_RETURN_IF_ERROR(expr)                  \
  do {                                            \
    ::kvserve::Status kv_status_ = (expr);        \
    if (!kv_status_.ok()) return kv_status_;      \
  } while (0)

#define KV_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

#define KV_ASSIGN_OR_RETURN(lhs, expr) \
  KV_ASSIGN_OR_RETURN_IMPL_(KV_CONCAT_(kv_result_, __LINE__), lhs, expr)
