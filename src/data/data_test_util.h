// src/data/data_test_util.h: helpers for the data source tests (a scratch folder, file I/O).
#ifndef THDPACK_SRC_DATA_DATA_TEST_UTIL_H_
#define THDPACK_SRC_DATA_DATA_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "thdpack/data.h"

namespace thdpack::testing_util {

// A fresh folder under $TMPDIR (or /tmp), removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/thdpack_data_XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) != nullptr) path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

inline std::vector<uint8_t> ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void WriteBytes(const std::string& path, const std::vector<uint8_t>& bytes, size_t n) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(n));
}
inline void WriteBytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  WriteBytes(path, bytes, bytes.size());
}

// True when `text` contains `part` (for readable EXPECTs on messages).
inline bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The folder of real data files: $THDPACK_DATA_DIR when set, else the repository's data/.
inline std::string DataDir() {
  if (const char* env = std::getenv("THDPACK_DATA_DIR"); env != nullptr && *env != '\0') {
    return env;
  }
  return THDPACK_TEST_DATA_DIR;
}

// The real data file `name` (data/README.md lists them). It is part of the repository, so a
// test that reads it fails when it is missing (the reader's error names the path).
inline std::string DataFile(const std::string& name) { return DataDir() + "/" + name; }

// The reference reading of a stream: `samples` samples read one at a time with NextLength,
// a Reset at each end of an epoch.
inline void ReadSamples(SampleSource& s, int64_t samples) {
  for (int64_t k = 0; k < samples;) {
    auto next = s.NextLength();
    ASSERT_TRUE(next.ok()) << next.status().ToString();
    if (!next->has_value()) {
      ASSERT_TRUE(s.Reset().ok());
      continue;
    }
    ++k;
  }
}

// The next `n` whole samples, wrapping around.
inline std::vector<Sample> Take(SampleSource& s, int64_t n) {
  std::vector<Sample> out;
  while (static_cast<int64_t>(out.size()) < n) {
    auto next = s.Next();
    EXPECT_TRUE(next.ok()) << next.status().ToString();
    if (!next.ok()) break;
    if (!next->has_value()) {
      EXPECT_TRUE(s.Reset().ok());
      continue;
    }
    out.push_back(std::move(**next));
  }
  return out;
}

}  // namespace thdpack::testing_util

#endif  // THDPACK_SRC_DATA_DATA_TEST_UTIL_H_
