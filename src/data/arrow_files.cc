// Columnar sources (thdpack/arrow.h), their files: which files a `parquet:` or `arrow:` spec
// names (ColumnarFiles), Parquet decoded once into the cache (CachedParquet), and each file's
// rows imported through the process's ArrowReaders (OpenArrowFiles).
#include <fcntl.h>
#include <glob.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "common/hash64.h"
#include "common/publish_file.h"
#include "data/arrow_internal.h"

namespace thdpack {

using arrow_internal::kColumns;
using arrow_internal::Str;

namespace {

namespace fs = std::filesystem;

// A file descriptor closed on every path out.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::string Errno(int err) { return std::strerror(err); }

bool EndsWith(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(),
                                                suffix) == 0;
}

}  // namespace

Result<std::vector<std::string>> ColumnarFiles(std::string_view kind, std::string_view path_view) {
  const std::string path(path_view);
  std::vector<std::string_view> ext;
  if (kind == "parquet") {
    ext = {".parquet", ".pq"};
  } else if (kind == "arrow") {
    ext = {".arrow", ".feather", ".ipc"};
  } else {
    return Status::InvalidArgument("columnar files of kind '" + std::string(kind) +
                                   "': expected parquet or arrow");
  }
  std::vector<std::string> files;
  std::error_code ec;
  if (path.find_first_of("*?[") != std::string::npos) {
    glob_t g{};
    const int rc = ::glob(path.c_str(), 0, nullptr, &g);
    if (rc != 0 && rc != GLOB_NOMATCH) {
      ::globfree(&g);
      return Status::IOError(path + ": cannot expand the glob (glob error " + Str(rc) + ")");
    }
    for (size_t i = 0; i < g.gl_pathc; ++i) {
      if (fs::is_regular_file(g.gl_pathv[i], ec)) files.emplace_back(g.gl_pathv[i]);
    }
    ::globfree(&g);
  } else if (fs::is_directory(path, ec)) {
    for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
      const std::string name = e.path().filename().string();
      if (!e.is_regular_file(ec)) continue;
      for (std::string_view x : ext) {
        if (EndsWith(name, x)) {
          files.push_back((fs::path(path) / name).string());
          break;
        }
      }
    }
    if (ec) return Status::IOError(path + ": cannot list the folder: " + ec.message());
  } else if (fs::is_regular_file(path, ec)) {
    files.push_back(path);
  } else {
    return Status::NotFound(path + ": no such file or folder");
  }
  if (files.empty()) {
    std::string want;
    for (std::string_view x : ext) want += (want.empty() ? "" : " or ") + std::string(x);
    return Status::NotFound(path + ": no " + want + " files in it");
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string ThdpackCacheDir() {
  if (const char* c = std::getenv("THDPACK_CACHE"); c != nullptr && *c != '\0') return c;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    return std::string(x) + "/thdpack";
  }
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr && *home != '\0' ? home : "/tmp") + "/.cache/thdpack";
}

Result<std::string> CachedParquet(const std::string& file, std::span<const std::string> columns,
                                  const ArrowReaders& readers) {
  std::error_code ec;
  const fs::path real = fs::canonical(file, ec);
  struct stat st{};
  if (ec || ::stat(file.c_str(), &st) != 0) {
    return Status::NotFound(file + ": cannot read it: " + (ec ? ec.message() : Errno(errno)));
  }
  // The cache file's name: the Parquet file's stem (to be found by a person) and a hash of
  // what makes its decoded rows (a format version first: a change of this layout starts over).
  std::vector<std::string> cols(columns.begin(), columns.end());
  std::sort(cols.begin(), cols.end());
  std::string key = "thdpack parquet cache 1\n" + real.string() + "\n" + Str(st.st_size) + "\n" +
                    Str(static_cast<int64_t>(st.st_mtim.tv_sec)) + "." +
                    Str(static_cast<int64_t>(st.st_mtim.tv_nsec));
  for (const std::string& c : cols) key += "\n" + c;
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%016llx",
                static_cast<unsigned long long>(internal::Hash64(key)));
  const fs::path dir = fs::path(ThdpackCacheDir()) / "parquet";
  const std::string out = (dir / (real.stem().string() + "-" + hash + ".arrow")).string();
  if (fs::is_regular_file(out, ec)) return out;
  fs::create_directories(dir, ec);
  if (ec) {
    return Status::IOError("the cache of decoded Parquet, " + dir.string() +
                           ": cannot create it: " + ec.message() +
                           " (set THDPACK_CACHE to a folder this process can write)");
  }
  // One decode per machine: the others wait on the lock, then map what it wrote.
  const std::string lock_path = out + ".lock";
  Fd lock{::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)};
  if (lock.fd < 0) {
    return Status::IOError(lock_path + ": cannot open the cache's lock: " + Errno(errno) +
                           " (set THDPACK_CACHE to a folder this process can write)");
  }
  while (::flock(lock.fd, LOCK_EX) != 0) {
    if (errno != EINTR) return Status::IOError(lock_path + ": cannot lock: " + Errno(errno));
  }
  if (fs::is_regular_file(out, ec)) return out;  // another process decoded it meanwhile
  // Only the lock's holder writes the temporary file: one left here is a killed decode's.
  const std::string tmp = out + ".tmp";
  fs::remove(tmp, ec);
  if (Status s = readers.parquet_to_ipc(file, cols, tmp); !s.ok()) {
    fs::remove(tmp, ec);
    return s;
  }
  THDPACK_RETURN_IF_ERROR(
      internal::PublishFile(tmp, out).WithContext("the decoded rows of " + file + ", " + out));
  return out;
}

namespace arrow_internal {

Result<std::shared_ptr<const ArrowRows>> OpenArrowFiles(const std::string& spec,
                                                        std::span<const std::string> columns,
                                                        const ArrowReaders& readers) {
  const size_t colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  const std::string path = spec.substr(colon + 1);
  Result<std::vector<std::string>> files = ColumnarFiles(kind, path);
  if (!files.ok()) return files.status().WithContext("data source " + spec);
  std::vector<std::shared_ptr<const ArrowRows>> parts;
  for (const std::string& f : *files) {
    // Messages name the spec, and the file when the spec names several.
    const std::string where = "data source " + spec + (f == path ? "" : ": " + f);
    std::string mapped = f;
    if (kind == "parquet") {
      // The columns read: those asked for that the file has; all of them when it has no
      // input_ids, so that the import names them in its error.
      Result<std::vector<std::string>> names = readers.parquet_columns(f);
      if (!names.ok()) return names.status().WithContext("data source " + spec);
      std::vector<std::string> read;
      if (std::find(names->begin(), names->end(), kColumns[0]) == names->end()) {
        read = *names;
      } else {
        for (const std::string& n : *names) {
          if (std::find(columns.begin(), columns.end(), n) != columns.end()) read.push_back(n);
        }
      }
      Result<std::string> cached = CachedParquet(f, read, readers);
      if (!cached.ok()) return cached.status().WithContext(where);
      mapped = *cached;
    }
    Result<ArrowArrayStream> stream = readers.read_ipc(mapped);
    if (!stream.ok()) return stream.status().WithContext("data source " + spec);
    Result<std::shared_ptr<const ArrowRows>> rows =
        ImportArrowStream(&*stream, where, kind == "parquet" ? "row group" : "record batch");
    if (!rows.ok()) return rows.status();
    parts.push_back(*std::move(rows));
  }
  return ConcatArrowRows(parts, "data source " + spec);
}

}  // namespace arrow_internal
}  // namespace thdpack
