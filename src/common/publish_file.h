// Internal: a file made visible under its name only once it is whole and on disk - the run
// state (WriteRunStateFile) and the cache of decoded Parquet (CachedParquet) are written this
// way, so that a process killed at any moment leaves the old file or the new one, never part.
//
// Thread-safety: none needed beyond the file system's (rename is atomic).
#ifndef THDPACK_SRC_COMMON_PUBLISH_FILE_H_
#define THDPACK_SRC_COMMON_PUBLISH_FILE_H_

#include <string>

#include "thdpack/status.h"

namespace thdpack::internal {

// Makes the written and closed file `tmp` the file `path`: tmp's data synced, renamed over
// path, and path's folder synced so that the rename itself survives a crash. On failure tmp
// is removed, path is untouched, and the IOError says what failed: "cannot sync (<errno
// text>)" or "cannot rename its temporary file over it (<errno text>)" (callers add the name).
[[nodiscard]] Status PublishFile(const std::string& tmp, const std::string& path);

}  // namespace thdpack::internal

#endif  // THDPACK_SRC_COMMON_PUBLISH_FILE_H_
