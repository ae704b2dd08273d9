# cmake/nlohmann_json.cmake: the nlohmann_json target the library's sources use.
#
#   thdpack_find_nlohmann_json(<min-version>)
#
# Defines nlohmann_json::nlohmann_json from, in order:
#   1. the system's package (find_package: Debian's nlohmann-json3-dev, a prefix, nlohmann_json_DIR);
#   2. the headers of PyPI's `nlohmann-json` package in the Python environment: it ships
#      nlohmann_json/include/nlohmann/*.hpp and no CMake files, so an imported target is made over
#      that folder. pyproject.toml lists it among the build requirements, so `pip install .`
#      finds it in its build environment; the interpreter is Python3_EXECUTABLE (what pip and
#      scikit-build-core set), else the first python3 on PATH.
# Fails with a message naming both ways when neither has it at <min-version> or newer.
# -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON skips the first (the tests of the wheel use it).
macro(thdpack_find_nlohmann_json thdpack_min_json)
  find_package(nlohmann_json ${thdpack_min_json} QUIET)
  if(nlohmann_json_FOUND)
    message(STATUS "thdpack: nlohmann_json ${nlohmann_json_VERSION} from ${nlohmann_json_DIR}")
  else()
    if(NOT Python3_EXECUTABLE)
      find_package(Python3 COMPONENTS Interpreter QUIET)
    endif()
    set(thdpack_json_include "")
    if(Python3_EXECUTABLE)
      # find_spec locates the package without importing it (its __init__ imports
      # importlib_resources, which a build environment may lack).
      execute_process(
        COMMAND ${Python3_EXECUTABLE} -c
          "import importlib.util, os; s = importlib.util.find_spec('nlohmann_json'); print(os.path.join(list(s.submodule_search_locations)[0], 'include') if s else '')"
        OUTPUT_VARIABLE thdpack_json_include OUTPUT_STRIP_TRAILING_WHITESPACE
        RESULT_VARIABLE thdpack_json_rc ERROR_QUIET)
      if(NOT thdpack_json_rc EQUAL 0)
        set(thdpack_json_include "")
      endif()
    endif()
    set(thdpack_json_version "")
    if(thdpack_json_include AND EXISTS "${thdpack_json_include}/nlohmann/json.hpp")
      # The version macros: in detail/abi_macros.hpp since 3.11, in json.hpp before.
      set(thdpack_json_lines "")
      foreach(f nlohmann/json.hpp nlohmann/detail/abi_macros.hpp)
        if(EXISTS "${thdpack_json_include}/${f}")
          file(STRINGS "${thdpack_json_include}/${f}" thdpack_lines
               REGEX "#define NLOHMANN_JSON_VERSION_(MAJOR|MINOR|PATCH) [0-9]+")
          list(APPEND thdpack_json_lines ${thdpack_lines})
        endif()
      endforeach()
      foreach(part MAJOR MINOR PATCH)
        string(REGEX MATCH "NLOHMANN_JSON_VERSION_${part} ([0-9]+)" _ "${thdpack_json_lines}")
        list(APPEND thdpack_json_version "${CMAKE_MATCH_1}")
      endforeach()
      list(JOIN thdpack_json_version "." thdpack_json_version)
    endif()
    if(thdpack_json_version AND thdpack_json_version VERSION_GREATER_EQUAL ${thdpack_min_json})
      add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)
      set_target_properties(nlohmann_json::nlohmann_json PROPERTIES
        INTERFACE_INCLUDE_DIRECTORIES "${thdpack_json_include}")
      message(STATUS "thdpack: nlohmann_json ${thdpack_json_version} from the Python package "
                     "nlohmann-json (${thdpack_json_include})")
    else()
      message(FATAL_ERROR
        "thdpack needs nlohmann_json >= ${thdpack_min_json} (header only), found neither "
        "a CMake package nor the PyPI package nlohmann-json"
        "${thdpack_json_version}${thdpack_json_include}. Install one of: Debian's "
        "nlohmann-json3-dev (scripts/install_deps.sh), `pip install nlohmann-json` into the "
        "interpreter ${Python3_EXECUTABLE}, or give -Dnlohmann_json_DIR=<its CMake folder>.")
    endif()
  endif()
endmacro()
