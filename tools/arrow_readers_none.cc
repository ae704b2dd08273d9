// The command line built without Arrow C++: no readers, so that a `parquet:` or `arrow:` spec
// is refused by name (thdpack/arrow.h, OpenArrowSource), saying how to read it.
#include "arrow_readers.h"

namespace thdpack::tools {

void InstallArrowReaders() {}

}  // namespace thdpack::tools
