# The size rule of docs/architecture.md ("Files"): no non-test source file of the tree (C++,
# CUDA, Python: src, include, python with its examples, tools, bench, fuzz, scripts) over
# MAX_LINES lines (900), and none of the files cut by concern from the step runner, the balanced
# scheduler, the cross-entropy kernels and the torch iterator over CUT_MAX_LINES (600): a file
# that outgrows them is cut by concern, not let grow.
#   cmake -DSOURCE_DIR=<tree> -P cmake/check_file_sizes.cmake
# Fails naming every file over its bound, with its line count. Tests (*_test.cc, tests/,
# python/tests/, test_*.py) and the fuzz corpus are not checked.
if(NOT DEFINED MAX_LINES)
  set(MAX_LINES 900)
endif()
if(NOT DEFINED CUT_MAX_LINES)
  set(CUT_MAX_LINES 600)
endif()
file(GLOB_RECURSE files RELATIVE ${SOURCE_DIR}
  ${SOURCE_DIR}/src/*.cc ${SOURCE_DIR}/src/*.h ${SOURCE_DIR}/src/*.cu
  ${SOURCE_DIR}/include/*.h
  ${SOURCE_DIR}/python/*.py ${SOURCE_DIR}/python/*.cc ${SOURCE_DIR}/python/*.h
  ${SOURCE_DIR}/tools/*.cc ${SOURCE_DIR}/tools/*.h ${SOURCE_DIR}/tools/*.py
  ${SOURCE_DIR}/bench/*.cc ${SOURCE_DIR}/bench/*.h ${SOURCE_DIR}/bench/*.py
  ${SOURCE_DIR}/fuzz/*.cc ${SOURCE_DIR}/fuzz/*.h ${SOURCE_DIR}/fuzz/*.py
  ${SOURCE_DIR}/scripts/*.py)
# The successors of the four files cut by concern (the step runner's phases, the balanced
# scheduler's steps, the cross-entropy kernels, the torch iterator's modules).
set(cut_patterns
  "^src/runtime/step_[a-z_]+\\.(cc|h)$"
  "^src/schedule/scheduler_balanced[a-z_]*\\.(cc|h)$"
  "^src/loss/cross_entropy[a-z_0-9]*\\.(cc|h)$"
  "^python/thdpack/torch/(iterator|groups|fed|packed_step|batch|_dtypes)\\.py$")
set(over "")
set(checked 0)
foreach(f IN LISTS files)
  if(f MATCHES "(_test\\.cc|_test_util\\.h)$" OR f MATCHES "(^|/)tests/" OR
     f MATCHES "(^|/)test_[^/]*\\.py$" OR f MATCHES "/corpus/" OR f MATCHES "(^|/)build")
    continue()
  endif()
  set(bound ${MAX_LINES})
  foreach(p IN LISTS cut_patterns)
    if(f MATCHES "${p}")
      set(bound ${CUT_MAX_LINES})
    endif()
  endforeach()
  file(READ ${SOURCE_DIR}/${f} text)
  string(REGEX MATCHALL "\n" newlines "${text}")
  list(LENGTH newlines n)
  math(EXPR checked "${checked} + 1")
  if(n GREATER bound)
    string(APPEND over "\n  ${f}: ${n} lines, over ${bound}")
  endif()
endforeach()
if(checked EQUAL 0)
  message(FATAL_ERROR "check_file_sizes: no file found under ${SOURCE_DIR}")
endif()
if(over)
  message(FATAL_ERROR "Files over their size bound (docs/architecture.md, \"Files\"):${over}")
endif()
message(STATUS "check_file_sizes: ${checked} files within their bounds")
