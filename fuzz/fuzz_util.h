// fuzz/fuzz_util.h: what the fuzz targets share (docs/testing.md, "Fuzzing").
//
// - FUZZ_CHECK(cond, detail): a property of the code under test that must hold for every input.
//   On failure it prints the condition and the detail and aborts, which libFuzzer (and the
//   replay driver) report as a crash with the input that caused it.
// - ScratchFile: the readers under test take file paths, so an input is written to a file in a
//   directory private to this process (under /dev/shm when it exists, so no disk is touched),
//   removed at exit.
//
// Thread-safety: a fuzz target runs one input at a time; nothing here is thread-safe.
#ifndef THDPACK_FUZZ_FUZZ_UTIL_H_
#define THDPACK_FUZZ_FUZZ_UTIL_H_

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

#include "thdpack/status.h"

#define FUZZ_CHECK(cond, detail)                                                         \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: fuzz property failed: %s\n  %s\n", __FILE__, __LINE__, \
                   #cond, std::string(detail).c_str());                                  \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

namespace thdpack::fuzz {

// "CODE: message" of a status, for FUZZ_CHECK details.
inline std::string Describe(const Status& s) { return s.ok() ? "OK" : s.ToString(); }

// A directory private to this process, created on first use and removed at exit.
class ScratchDir {
 public:
  static const std::string& Path() {
    static ScratchDir dir;
    return dir.path_;
  }

 private:
  ScratchDir() {
    const char* base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : nullptr;
    if (base == nullptr) base = std::getenv("TMPDIR");
    if (base == nullptr || *base == '\0') base = "/tmp";
    std::string pattern = std::string(base) + "/thdpack_fuzz_XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::perror("thdpack fuzz: mkdtemp");
      std::abort();
    }
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  std::string path_;
};

// Writes `bytes` to the file `name` in the scratch directory (replacing it) and returns its
// path. Aborts when the file cannot be written: that is the harness's failure, not an input's.
inline std::string WriteScratchFile(std::string_view name, const uint8_t* data, size_t size) {
  const std::string path = ScratchDir::Path() + "/" + std::string(name);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::perror(("thdpack fuzz: cannot write " + path).c_str());
    std::abort();
  }
  return path;
}

}  // namespace thdpack::fuzz

#endif  // THDPACK_FUZZ_FUZZ_UTIL_H_
