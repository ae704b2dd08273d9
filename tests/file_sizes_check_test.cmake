# The size check fails where it should (so that a passing check means something): a fixture
# tree with a file over 900 lines, a cut file's successor over 600, and a test over both, which
# is not checked. Run by ctest `areas.file_sizes_rejects_long_files`.
#   cmake -DCHECK=cmake/check_file_sizes.cmake -DWORK_DIR=<dir> -P tests/file_sizes_check_test.cmake
file(REMOVE_RECURSE ${WORK_DIR})
string(REPEAT "x\n" 901 long)
string(REPEAT "x\n" 601 cut)
file(WRITE ${WORK_DIR}/src/area/long.cc "${long}")
file(WRITE ${WORK_DIR}/src/runtime/step_new_phase.cc "${cut}")
file(WRITE ${WORK_DIR}/src/area/long_test.cc "${long}")
file(WRITE ${WORK_DIR}/python/thdpack/torch/fine.py "${cut}")
execute_process(COMMAND ${CMAKE_COMMAND} -DSOURCE_DIR=${WORK_DIR} -P ${CHECK}
                RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_QUIET)
if(rc EQUAL 0)
  message(FATAL_ERROR "the size check passed a tree with files over their bounds")
endif()
foreach(expected "src/area/long.cc: 901 lines, over 900"
                 "src/runtime/step_new_phase.cc: 601 lines, over 600")
  string(FIND "${err}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the size check did not name '${expected}':\n${err}")
  endif()
endforeach()
foreach(unexpected "long_test.cc" "fine.py")
  string(FIND "${err}" "${unexpected}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "the size check named '${unexpected}', within its rules:\n${err}")
  endif()
endforeach()
