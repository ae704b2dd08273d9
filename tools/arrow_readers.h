// The command line's readers of `parquet:` and `arrow:` files (thdpack/arrow.h, ArrowReaders):
// Apache Arrow's C++ readers when the build found them (arrow_readers_arrow.cc: -D
// THDPACK_ARROW_PYTHON=a Python with pyarrow, whose wheel ships Arrow C++, or an Arrow C++
// install CMake finds), none otherwise (arrow_readers_none.cc: the library then refuses those
// specs by name).
#ifndef THDPACK_TOOLS_ARROW_READERS_H_
#define THDPACK_TOOLS_ARROW_READERS_H_

namespace thdpack::tools {

// Sets the process's ArrowReaders, when this build has them.
void InstallArrowReaders();

}  // namespace thdpack::tools

#endif  // THDPACK_TOOLS_ARROW_READERS_H_
