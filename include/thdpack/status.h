// thdpack/status.h: error handling for the whole public API.
//
// Status is a cheap value: OK, or a code plus a message that names the input, where, and the
// rule broken. Result<T> holds either a T or a non-OK Status. No public function throws or
// exits; every fallible one returns one of these, marked [[nodiscard]].
//
// Thread-safety: values; distinct objects may be used from distinct threads freely.
#ifndef THDPACK_STATUS_H_
#define THDPACK_STATUS_H_

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace thdpack {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // the caller's input breaks a documented rule
  kCorruption = 2,       // bytes read from a file or the wire are malformed
  kIOError = 3,          // the operating system refused (open, read, mmap)
  kOutOfRange = 4,       // a value does not fit (int32 overflow, budget exceeded)
  kNotFound = 5,
  kUnimplemented = 6,
  kInternal = 7,         // a broken invariant inside thdpack: a bug
  kAborted = 8,          // another rank failed; this one stopped because of it
  kResourceExhausted = 9,  // the input needs more memory than the limit (or an allocation failed)
  // Not a failure: a stream of steps ended where its caller said it would (a source fed by the
  // caller ran out on every loader at a step boundary, a StepSource made its `steps`).
  kEndOfData = 10,
};

// Short name of a code, e.g. "InvalidArgument".
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
  static Status Corruption(std::string msg) { return {StatusCode::kCorruption, std::move(msg)}; }
  static Status IOError(std::string msg) { return {StatusCode::kIOError, std::move(msg)}; }
  static Status OutOfRange(std::string msg) { return {StatusCode::kOutOfRange, std::move(msg)}; }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
  static Status Unimplemented(std::string msg) { return {StatusCode::kUnimplemented, std::move(msg)}; }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }
  static Status Aborted(std::string msg) { return {StatusCode::kAborted, std::move(msg)}; }
  static Status EndOfData(std::string msg) { return {StatusCode::kEndOfData, std::move(msg)}; }
  // kAborted because another rank failed with `origin` (AgreeOnStatus, thdpack/comm.h).
  static Status Aborted(std::string msg, StatusCode origin);
  static Status ResourceExhausted(std::string msg) {
    return {StatusCode::kResourceExhausted, std::move(msg)};
  }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  // The message alone (empty when OK).
  const std::string& message() const;
  // The code of the failure behind this status: for a kAborted made with an origin (a peer's
  // failure, carried to this rank by AgreeOnStatus), the failed rank's code; otherwise code().
  // The command line's exit code follows from it (docs/errors.md), so every rank of a job
  // exits with the same code for the same cause.
  StatusCode origin() const { return rep_ ? rep_->origin : StatusCode::kOk; }
  // "InvalidArgument: <message>", or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>" (same code and origin). OK stays OK.
  Status WithContext(std::string_view context) const;
  // Returns a copy whose message is "<message> (<note>)" (same code and origin). OK stays OK.
  Status WithNote(std::string_view note) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    std::string message;
    StatusCode origin;  // code, unless made by Aborted(msg, origin)
  };
  // Null when OK, so an OK status costs one pointer and no allocation.
  std::shared_ptr<const Rep> rep_;
};

// Either a value or an error. Access to value() on an error is a programming bug (checked by
// an assertion in debug builds).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}                 // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {           // NOLINT: implicit by design
    if (std::get<Status>(v_).ok()) v_ = Status::Internal("Result constructed from an OK Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  // OK when a value is held.
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace thdpack

// Internal helpers (also usable by callers): return early on error.
#define THDPACK_CONCAT_INNER_(a, b) a##b
#define THDPACK_CONCAT_(a, b) THDPACK_CONCAT_INNER_(a, b)

#define THDPACK_RETURN_IF_ERROR(expr)                 \
  do {                                                \
    ::thdpack::Status thdpack_status_ = (expr);       \
    if (!thdpack_status_.ok()) return thdpack_status_; \
  } while (0)

#define THDPACK_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()

// THDPACK_ASSIGN_OR_RETURN(auto x, ComputeX()); returns the error, or binds the value.
#define THDPACK_ASSIGN_OR_RETURN(lhs, expr) \
  THDPACK_ASSIGN_OR_RETURN_IMPL_(THDPACK_CONCAT_(thdpack_result_, __LINE__), lhs, expr)

#endif  // THDPACK_STATUS_H_
