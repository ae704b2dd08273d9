# Fuzzing builds (THDPACK_BUILD_FUZZ=ON; docs/testing.md, "Fuzzing").
#
# libFuzzer and its coverage instrumentation come with clang only. A fuzzing build instruments
# every area of the library with coverage and comparison tracing plus ASan and UBSan (UBSan
# aborting, so libFuzzer sees every report), on those targets only: no global flags. The fuzz
# targets themselves (fuzz/CMakeLists.txt) add libFuzzer's main.
#
#   thdpack_fuzz_check_compiler()               fails the configure unless the compiler is clang
#   thdpack_fuzz_instrument(<target> [LIBFUZZER]) adds the flags to <target>; LIBFUZZER also
#                                                links libFuzzer's main

set(THDPACK_FUZZ_SANITIZERS address,undefined)

function(thdpack_fuzz_check_compiler)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "THDPACK_BUILD_FUZZ needs clang (libFuzzer), not ${CMAKE_CXX_COMPILER_ID}: "
                        "configure with -DCMAKE_CXX_COMPILER=clang++ in a build folder of its own "
                        "(`make fuzz` does)")
  endif()
endfunction()

function(thdpack_fuzz_instrument target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "LIBFUZZER" "" "")
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "INTERFACE_LIBRARY")
    return()
  endif()
  if(arg_LIBFUZZER)
    set(fuzzer fuzzer)
  else()
    set(fuzzer fuzzer-no-link)
  endif()
  target_compile_options(${target} PRIVATE -fsanitize=${fuzzer},${THDPACK_FUZZ_SANITIZERS}
    -fno-sanitize-recover=all -fno-omit-frame-pointer)
  if(NOT type STREQUAL "OBJECT_LIBRARY")
    target_link_options(${target} PRIVATE -fsanitize=${fuzzer},${THDPACK_FUZZ_SANITIZERS})
  endif()
endfunction()

# Instruments every area of the library (call after they are defined); whatever links
# thdpack::thdpack then links the sanitizer runtimes too.
function(thdpack_fuzz_instrument_library)
  thdpack_fuzz_check_compiler()
  get_property(areas GLOBAL PROPERTY THDPACK_AREAS)
  foreach(area IN LISTS areas)
    thdpack_fuzz_instrument(thdpack_area_${area})
  endforeach()
  target_link_options(thdpack INTERFACE -fsanitize=${THDPACK_FUZZ_SANITIZERS})
endfunction()
