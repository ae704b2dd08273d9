#include "common/publish_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

namespace thdpack::internal {

Status PublishFile(const std::string& tmp, const std::string& path) {
  auto fail = [&](const char* what) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    return Status::IOError(std::string("cannot ") + what + " (" + why + ")");
  };
  const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail("sync");
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced) return fail("sync");
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail("rename its temporary file over it");
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return Status::Ok();
}

}  // namespace thdpack::internal
