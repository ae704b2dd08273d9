// thdpack/version.h: the library version. Thread-safety: constants.
#ifndef THDPACK_VERSION_H_
#define THDPACK_VERSION_H_

namespace thdpack {
inline constexpr const char* kVersion = "0.1.0";
}  // namespace thdpack

#endif  // THDPACK_VERSION_H_
