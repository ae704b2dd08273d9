# cmake/gtest_suites.cmake: one ctest per GoogleTest suite of a test program, instead of one
# per test (gtest_discover_tests).
#
#   thdpack_add_gtest_suites(<target>)
#
# After each build of <target>, its --gtest_list_tests is read and a ctest `<Suite>` runs
# `<target> --gtest_filter=<Suite>.*` (a parameterised suite `Prefix/Suite` keeps its name).
# A suite whose tests all skip reports Passed (GoogleTest's output says which skipped): ctest's
# SKIP_REGULAR_EXPRESSION would also mark a suite skipped where one test skipped and another
# failed, so it is not used; the GPU program, whose tests skip without a device, keeps one ctest
# per test (gtest_discover_tests, tests/CMakeLists.txt).
# A test process costs about 0.16 s under ASan + UBSan (the shadow memory mapped, LeakSanitizer at
# exit) and 0.01 s without: 493 tests in as many processes spent about 130 CPU-s on that alone in
# the sanitizer build (docs/testing.md), 94 suites spend a fifth of it. A failing test is still
# named by GoogleTest's output, which ctest --output-on-failure prints; run one test with
# `<build>/tests/thdpack_tests --gtest_filter=Suite.Test`.
#
# Run as a script (cmake -P) by the build: TEST_EXECUTABLE, CTEST_FILE, WORKING_DIR.

if(CMAKE_SCRIPT_MODE_FILE)
  execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests
                  WORKING_DIRECTORY "${WORKING_DIR}" TIMEOUT 60
                  OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${TEST_EXECUTABLE} --gtest_list_tests failed (${status}): ${errors}")
  endif()
  string(REPLACE "\n" ";" lines "${listing}")
  set(script "")
  set(count 0)
  foreach(line IN LISTS lines)
    # A suite's line starts in the first column: "Suite.  # TypeParam = ..." or "Prefix/Suite.".
    if(line MATCHES "^([A-Za-z_][A-Za-z0-9_/]*)\\.")
      set(suite "${CMAKE_MATCH_1}")
      string(APPEND script
        "add_test([=[${suite}]=] [=[${TEST_EXECUTABLE}]=] [=[--gtest_filter=${suite}.*]=])\n"
        "set_tests_properties([=[${suite}]=] PROPERTIES WORKING_DIRECTORY [=[${WORKING_DIR}]=])\n")
      math(EXPR count "${count} + 1")
    endif()
  endforeach()
  if(count EQUAL 0)
    message(FATAL_ERROR "${TEST_EXECUTABLE} lists no test suite")
  endif()
  file(WRITE "${CTEST_FILE}" "${script}")
  return()
endif()

set(_thdpack_gtest_suites_script ${CMAKE_CURRENT_LIST_FILE})

function(thdpack_add_gtest_suites target)
  set(ctest_file ${CMAKE_CURRENT_BINARY_DIR}/${target}_suites.cmake)
  set(include_file ${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_include.cmake)
  add_custom_command(TARGET ${target} POST_BUILD
    BYPRODUCTS ${ctest_file}
    COMMAND ${CMAKE_COMMAND} -DTEST_EXECUTABLE=$<TARGET_FILE:${target}>
            -DCTEST_FILE=${ctest_file}
            -DWORKING_DIR=${CMAKE_CURRENT_BINARY_DIR} -P ${_thdpack_gtest_suites_script}
    VERBATIM)
  # Before the program is built, ctest shows one failing placeholder instead of no test at all.
  file(WRITE ${include_file}
    "if(EXISTS [=[${ctest_file}]=])\n"
    "  include([=[${ctest_file}]=])\n"
    "else()\n"
    "  add_test([=[${target}_NOT_BUILT]=] [=[${target}_NOT_BUILT]=])\n"
    "endif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${include_file})
endfunction()
