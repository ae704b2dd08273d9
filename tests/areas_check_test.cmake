# Run by CTest: the area check (cmake/check_areas.cmake) passes on a small fixture tree that
# keeps to its table, and fails, naming the file and line and the rule, on each kind of
# forbidden include and each gap in the table. Proves that a passing areas.check means something.
#
#   cmake -DCHECK=<cmake/check_areas.cmake> -DWORK_DIR=<scratch folder> -P areas_check_test.cmake
cmake_minimum_required(VERSION 3.20)
set(tree ${WORK_DIR}/tree)

# The fixture: common <- low <- high, common <- side; an umbrella header and a tools/ consumer.
set(fixture_table [=[
thdpack_area(common HEADERS status.h SHARED)
thdpack_area(low    DEPS common HEADERS low.h)
thdpack_area(side   DEPS common HEADERS side.h)
thdpack_area(high   DEPS low HEADERS high.h)
thdpack_umbrella(all.h)
thdpack_consumer(tools)
]=])

function(write_tree)
  file(REMOVE_RECURSE ${tree})
  file(WRITE ${tree}/cmake/areas.cmake "${fixture_table}")
  file(WRITE ${tree}/include/thdpack/status.h "#include <string>\n")
  file(WRITE ${tree}/include/thdpack/low.h "#include \"thdpack/status.h\"\n")
  file(WRITE ${tree}/include/thdpack/side.h "#include \"thdpack/status.h\"\n")
  file(WRITE ${tree}/include/thdpack/high.h "#include \"thdpack/low.h\"\n")
  file(WRITE ${tree}/include/thdpack/all.h
       "#include \"thdpack/high.h\"\n#include \"thdpack/side.h\"\n")
  file(WRITE ${tree}/src/common/check.h "#include <cstdio>\n")
  file(WRITE ${tree}/src/common/status.cc "#include \"thdpack/status.h\"\n")
  file(WRITE ${tree}/src/low/low_internal.h "#include \"thdpack/low.h\"\n")
  file(WRITE ${tree}/src/low/low_test_util.h "#include \"thdpack/low.h\"\n")
  file(WRITE ${tree}/src/low/low.cc
       "#include \"thdpack/low.h\"\n\n#include <vector>\n\n"
       "#include \"common/check.h\"\n#include \"low/low_internal.h\"\n")
  file(WRITE ${tree}/src/side/side.cc "#include \"thdpack/side.h\"\n")
  # high reaches common through low: its public and shared headers are allowed.
  file(WRITE ${tree}/src/high/high.cc
       "#include \"thdpack/high.h\"\n#include \"thdpack/status.h\"\n#include \"common/check.h\"\n")
  file(WRITE ${tree}/src/high/high_test.cc
       "#include <gtest/gtest.h>\n#include \"helpers.h\"\n#include \"low/low_test_util.h\"\n"
       "#include \"thdpack/high.h\"\n")
  file(WRITE ${tree}/tests/helpers.h "#include \"thdpack/all.h\"\n")
  file(WRITE ${tree}/tools/local.h "#include \"thdpack/low.h\"\n")
  file(WRITE ${tree}/tools/main.cc "#include \"local.h\"\n#include \"thdpack/all.h\"\n")
endfunction()

function(run_check out_rc out_text)
  execute_process(COMMAND ${CMAKE_COMMAND} -DSOURCE_DIR=${tree} -P ${CHECK}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \t\r\n]+" " " text "${out} ${err}")
  set(${out_rc} ${rc} PARENT_SCOPE)
  set(${out_text} "${text}" PARENT_SCOPE)
endfunction()

set_property(GLOBAL PROPERTY failures "")

# The control: the fixture as written passes (so each failure below is the injected line's).
write_tree()
run_check(rc text)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the area check fails on the clean fixture tree: ${text}")
endif()

# expect_rejected(<name> <file> <text appended> <regex the message must match>)
function(expect_rejected name file append expected)
  write_tree()
  file(APPEND ${tree}/${file} "${append}")
  run_check(rc text)
  if(rc EQUAL 0)
    set_property(GLOBAL APPEND_STRING PROPERTY failures "  ${name}: the check passed\n")
  elseif(NOT text MATCHES "${expected}")
    set_property(GLOBAL APPEND_STRING PROPERTY failures
                 "  ${name}: expected /${expected}/, got: ${text}\n")
  else()
    message(STATUS "rejected as expected: ${name}")
  endif()
endfunction()

expect_rejected(private_header_of_another_area src/high/high.cc "#include \"low/low_internal.h\"\n"
  "src/high/high.cc:4: \"low/low_internal.h\" is a private header of area low: private headers are for their own area only")
expect_rejected(private_header_outside_arrows src/side/side.cc "#include \"low/low_internal.h\"\n"
  "src/side/side.cc:2: \"low/low_internal.h\" is a private header of area low, outside the arrows of side")
expect_rejected(public_header_up_the_map src/low/low.cc "#include \"thdpack/high.h\"\n"
  "src/low/low.cc:7: \"thdpack/high.h\" is a public header of area high, outside the arrows of low \\(low may use only common,")
expect_rejected(public_header_of_a_sibling src/side/side.cc "#include <thdpack/low.h>\n"
  "src/side/side.cc:2: <thdpack/low.h> is a public header of area low, outside the arrows of side")
expect_rejected(test_util_outside_arrows src/side/side_test.cc "#include \"low/low_test_util.h\"\n"
  "src/side/side_test.cc:1: \"low/low_test_util.h\" is a private header of area low, outside the arrows of side")
expect_rejected(test_util_in_library_code src/high/high.cc "#include \"low/low_test_util.h\"\n"
  "src/high/high.cc:4: \"low/low_test_util.h\" is a private header of area low: private headers")
expect_rejected(test_helper_in_library_code src/high/high.cc "#include \"helpers.h\"\n"
  "src/high/high.cc:4: \"helpers.h\" names no file of src/high/")
expect_rejected(umbrella_in_library_code src/high/high.cc "#include \"thdpack/all.h\"\n"
  "src/high/high.cc:4: \"thdpack/all.h\" is the umbrella header")
expect_rejected(public_header_outside_arrows include/thdpack/low.h "#include \"thdpack/side.h\"\n"
  "include/thdpack/low.h:2: \"thdpack/side.h\" is a public header of area side, outside the arrows of low, which owns low.h")
expect_rejected(public_header_includes_private include/thdpack/high.h "#include \"low/low_internal.h\"\n"
  "include/thdpack/high.h:2: \"low/low_internal.h\": a public header includes only public headers")
expect_rejected(tool_includes_private tools/main.cc "#include \"low/low_internal.h\"\n"
  "tools/main.cc:3: \"low/low_internal.h\" is a private header of the library: tools/ uses the public headers only")
expect_rejected(unknown_public_header src/low/low.cc "#include \"thdpack/gone.h\"\n"
  "src/low/low.cc:7: \"thdpack/gone.h\": not a public header")
expect_rejected(folder_that_is_no_area src/job/job.cc "#include \"thdpack/low.h\"\n"
  "src/job/: not an area: declare it in cmake/areas.cmake with thdpack_area\\(job")
expect_rejected(public_header_without_owner include/thdpack/job.h "#include \"thdpack/low.h\"\n"
  "include/thdpack/job.h: no area owns this public header")
expect_rejected(owned_header_missing cmake/areas.cmake "thdpack_area(extra DEPS low HEADERS gone.h)\n"
  "area extra owns include/thdpack/gone.h, which does not exist")
expect_rejected(arrow_up_the_table cmake/areas.cmake "thdpack_area(top DEPS later)\nthdpack_area(later DEPS common)\n"
  "area top: DEPS later is not an area declared above it")
expect_rejected(header_with_two_owners cmake/areas.cmake "thdpack_area(copy DEPS common HEADERS low.h)\n"
  "public header low.h is claimed by low and by copy")

get_property(failures GLOBAL PROPERTY failures)
if(NOT "${failures}" STREQUAL "")
  message(FATAL_ERROR "the area check let through or misreported:\n${failures}")
endif()
file(REMOVE_RECURSE ${tree})
