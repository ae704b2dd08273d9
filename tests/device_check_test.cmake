# Run by CTest (python/CMakeLists.txt) with -DSCRIPT=<scripts/device_check.sh>
# -DWORK_DIR=<scratch>, PYTHON and PYTHONPATH (the built module) in the environment: the
# rehearsal of the device run on a machine without a GPU (--rehearse). It must end with status
# 0, list every step in its summary (run, or skipped with a reason), pack every log into the one
# tarball a device sends back, and its benchmark must have measured the torch methods on the CPU
# and recorded the CUDA kernel's methods as failed, each row written.

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/out")
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env OUT=${WORK_DIR}/out bash ${SCRIPT} --rehearse --budget 170
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "device_check.sh --rehearse failed (${rc}):\n${out}\n${err}")
endif()

file(READ "${WORK_DIR}/out/summary.txt" summary)
foreach(ran env import cuda-fused cuda-one-read selections loss-bench nccl)
  if(NOT summary MATCHES "device_check: ${ran}: rc 0, ")
    message(FATAL_ERROR "step ${ran} did not run and pass:\n${summary}\n${out}")
  endif()
endforeach()
foreach(skipped install kernels sanitizer-memcheck sanitizer-racecheck sanitizer-synccheck linear-bench
        nccl-dynamic balance cuda-ctest)
  if(NOT summary MATCHES "device_check: ${skipped}: skipped: [a-z]")
    message(FATAL_ERROR "step ${skipped} is not listed as skipped with its reason:\n${summary}")
  endif()
endforeach()
if(NOT summary MATCHES "end: [0-9]+ s, 0 step\\(s\\) failed")
  message(FATAL_ERROR "no end line:\n${summary}")
endif()

# Everything in the one tarball: the logs, the summary, the benchmark's rows.
file(MAKE_DIRECTORY "${WORK_DIR}/unpacked")
execute_process(COMMAND ${CMAKE_COMMAND} -E tar xzf "${WORK_DIR}/out/device_check_logs.tar.gz"
                WORKING_DIRECTORY "${WORK_DIR}/unpacked" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the logs' tarball does not unpack (${rc})")
endif()
foreach(f summary.txt env.log cuda-fused.log cuda-one-read.log selections.log loss-bench.log
        nccl.log loss_cuda.json)
  if(NOT EXISTS "${WORK_DIR}/unpacked/${f}")
    message(FATAL_ERROR "${f} is not in the logs' tarball")
  endif()
endforeach()
file(GLOB sent RELATIVE "${WORK_DIR}/out" "${WORK_DIR}/out/*")
list(SORT sent)
if(NOT sent STREQUAL "device_check_logs.tar.gz;summary.txt")
  message(FATAL_ERROR "OUT must hold the tarball and the summary alone, holds: ${sent}")
endif()

# The benchmark: F.cross_entropy measured on the CPU (a time, an exact zero gradient on ignored
# rows), thdpack's CUDA methods failed with their error and skipped, not the end of the run.
file(READ "${WORK_DIR}/unpacked/loss_cuda.json" rows)
string(JSON n LENGTH "${rows}")
set(measured 0)
set(failed 0)
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  string(JSON method GET "${rows}" ${i} method)
  string(JSON ms ERROR_VARIABLE no_ms GET "${rows}" ${i} ms)
  string(JSON error ERROR_VARIABLE no_error GET "${rows}" ${i} error)
  # ERROR_VARIABLE is NOTFOUND when the key is there.
  if(method STREQUAL "F.cross_entropy bf16" AND NOT no_ms STREQUAL "NOTFOUND")
    message(FATAL_ERROR "F.cross_entropy bf16 was not measured: ${rows}")
  endif()
  if(method STREQUAL "F.cross_entropy bf16")
    string(JSON zeros GET "${rows}" ${i} ignored_nonzero)
    if(NOT zeros EQUAL 0)
      message(FATAL_ERROR "F.cross_entropy's ignored rows have ${zeros} nonzero gradients")
    endif()
    math(EXPR measured "${measured} + 1")
  endif()
  if(method MATCHES "^thdpack kernel v[12]" AND no_error STREQUAL "NOTFOUND")
    math(EXPR failed "${failed} + 1")
  endif()
endforeach()
if(NOT measured EQUAL 1 OR NOT failed EQUAL 4)
  message(FATAL_ERROR "expected F.cross_entropy bf16 measured once and the 4 thdpack kernel "
                      "rows failed, got ${measured} and ${failed}:\n${rows}")
endif()
