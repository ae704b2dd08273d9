#include "thdpack/status.h"

namespace thdpack {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kCorruption: return "Corruption";
    case StatusCode::kIOError: return "IOError";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kUnimplemented: return "Unimplemented";
    case StatusCode::kInternal: return "Internal";
    case StatusCode::kAborted: return "Aborted";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kEndOfData: return "EndOfData";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string message) {
  if (code != StatusCode::kOk) {
    rep_ = std::make_shared<const Rep>(Rep{code, std::move(message), code});
  }
}

Status Status::Aborted(std::string msg, StatusCode origin) {
  Status s(StatusCode::kAborted, std::move(msg));
  if (origin != StatusCode::kOk) {
    s.rep_ = std::make_shared<const Rep>(Rep{StatusCode::kAborted, s.rep_->message, origin});
  }
  return s;
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return rep_ ? rep_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code()));
  out += ": ";
  out += rep_->message;
  return out;
}

Status Status::WithNote(std::string_view note) const {
  if (ok()) return *this;
  std::string msg = rep_->message + " (";
  msg += note;
  msg += ")";
  Status s;
  s.rep_ = std::make_shared<const Rep>(Rep{code(), std::move(msg), rep_->origin});
  return s;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string msg(context);
  msg += ": ";
  msg += rep_->message;
  Status s;
  s.rep_ = std::make_shared<const Rep>(Rep{code(), std::move(msg), rep_->origin});
  return s;
}

}  // namespace thdpack
