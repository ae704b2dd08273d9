// bench_data.h: where the benchmark programs find the real data files (data/ of the repository,
// data/README.md lists them). Header-only, for the programs in bench/.
//
// The folder is found from this file's path as the compiler wrote it. A compiler cache may write
// that path relative to the build folder (ccache's base_dir), so the candidates are tried in
// order and the first that exists wins: <repo>/data from the path, then data/ and ../data of the
// working directory (the repository root, as `make bench` runs them, or the build folder).
//
// Thread-safety: pure functions.
#ifndef THDPACK_BENCH_BENCH_DATA_H_
#define THDPACK_BENCH_BENCH_DATA_H_

#include <filesystem>
#include <string>

namespace thdpack_bench {

inline std::string DataDir() {
  const std::string here = __FILE__;  // <repo>/bench/bench_data.h
  const size_t slash = here.rfind("/bench/");
  const std::string from_path = slash == std::string::npos ? "" : here.substr(0, slash) + "/data";
  for (const std::string& dir : {from_path, std::string("data"), std::string("../data")}) {
    if (!dir.empty() && std::filesystem::is_directory(dir)) return dir;
  }
  return from_path.empty() ? "data" : from_path;  // missing: the caller reports the path
}

}  // namespace thdpack_bench

#endif  // THDPACK_BENCH_BENCH_DATA_H_
