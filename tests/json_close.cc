// thdpack_json_close: compares chosen keys of two files of JSON objects, one object per line
// (what `thdpack run --json` prints), line by line. Integers must be equal; other numbers may
// differ by a relative tolerance; null only matches null. Used by tests/cli_verify_test.cmake,
// where CMake alone cannot compare floating-point numbers.
//
// Usage: thdpack_json_close TOLERANCE KEY[,KEY...] FILE_A FILE_B
// Exit: 0 when every line and key agree; 1 with one line per difference on stderr; 2 on bad
// arguments or unreadable input.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<nlohmann::json> ReadLines(const char* path, bool* ok) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "json_close: cannot open %s\n", path);
    *ok = false;
    return out;
  }
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      std::fprintf(stderr, "json_close: %s:%d is not a JSON object\n", path, n);
      *ok = false;
      return out;
    }
    out.push_back(std::move(j));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s TOLERANCE KEY[,KEY...] FILE_A FILE_B\n", argv[0]);
    return 2;
  }
  char* end = nullptr;
  const double tol = std::strtod(argv[1], &end);
  if (end == argv[1] || *end != '\0' || !(tol >= 0)) {
    std::fprintf(stderr, "json_close: TOLERANCE \"%s\" must be a number >= 0\n", argv[1]);
    return 2;
  }
  std::vector<std::string> keys;
  std::stringstream ks(argv[2]);
  for (std::string k; std::getline(ks, k, ',');) keys.push_back(k);
  bool ok = true;
  const auto a = ReadLines(argv[3], &ok);
  const auto b = ReadLines(argv[4], &ok);
  if (!ok) return 2;
  int diffs = 0;
  if (a.size() != b.size() || a.empty()) {
    std::fprintf(stderr, "json_close: %zu objects in %s, %zu in %s (need the same, >= 1)\n",
                 a.size(), argv[3], b.size(), argv[4]);
    return 1;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    for (const std::string& k : keys) {
      if (!a[i].contains(k) || !b[i].contains(k)) {
        std::fprintf(stderr, "line %zu: key %s missing\n", i + 1, k.c_str());
        ++diffs;
        continue;
      }
      const auto& x = a[i][k];
      const auto& y = b[i][k];
      bool same = false;
      if (x.is_null() || y.is_null()) {
        same = x.is_null() && y.is_null();
      } else if (x.is_number_integer() && y.is_number_integer()) {
        same = x.get<int64_t>() == y.get<int64_t>();
      } else if (x.is_number() && y.is_number()) {
        const double u = x.get<double>(), v = y.get<double>();
        const double scale = std::max(std::fabs(u), std::fabs(v));
        same = scale == 0 || std::fabs(u - v) / scale <= tol;
      }
      if (!same) {
        std::fprintf(stderr, "line %zu: %s %s vs %s\n", i + 1, k.c_str(), x.dump().c_str(),
                     y.dump().c_str());
        ++diffs;
      }
    }
  }
  return diffs == 0 ? 0 : 1;
}
