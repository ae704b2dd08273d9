// Internal invariant checks. THDPACK_DCHECK(cond) aborts with file and line in debug builds
// (NDEBUG unset) and compiles to nothing otherwise. It guards thdpack's own invariants only;
// bad input from callers is reported through Status, never through this macro.
#ifndef THDPACK_COMMON_CHECK_H_
#define THDPACK_COMMON_CHECK_H_

#include <cstdio>
#include <cstdlib>

#ifndef NDEBUG
#define THDPACK_DCHECK(cond)                                                             \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: thdpack internal check failed: %s\n", __FILE__,       \
                   __LINE__, #cond);                                                     \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)
#else
#define THDPACK_DCHECK(cond) \
  do {                       \
  } while (0 && (cond))
#endif

#endif  // THDPACK_COMMON_CHECK_H_
