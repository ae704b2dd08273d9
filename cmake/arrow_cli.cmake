# The command line's readers of parquet: and arrow: files (tools/arrow_readers.h): Apache Arrow's
# C++ readers when found, else none (the library then refuses those specs by name).
#
# Where Arrow C++ comes from, first found:
#   THDPACK_ARROW_PYTHON  a Python whose pyarrow wheel ships Arrow C++ (headers, libarrow and
#                         libparquet, versioned): `pip install pyarrow` is the one install of
#                         Arrow C++ most machines have (Debian packages none). The command line
#                         then needs that pyarrow's libraries at run time (an RPATH to them).
#   find_package(Arrow/Parquet CONFIG)  an Arrow C++ install of its own (conda, Arrow's apt
#                         repository, a source build).
# Defines thdpack_add_arrow_readers(target): the readers' source, and Arrow's headers and
# libraries, added to `target`.
set(THDPACK_ARROW_PYTHON "" CACHE FILEPATH
    "A Python whose pyarrow's Arrow C++ the command line reads Parquet and Arrow files with (empty: find_package, else none)")

set(_thdpack_arrow_found OFF)
if(THDPACK_ARROW_PYTHON)
  execute_process(
    COMMAND ${THDPACK_ARROW_PYTHON} -c
      "import pyarrow as pa; print(pa.get_include()); print(pa.get_library_dirs()[0]); print(pa.__version__)"
    OUTPUT_VARIABLE _pa OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _pa_rc ERROR_QUIET)
  if(NOT _pa_rc EQUAL 0)
    message(FATAL_ERROR "THDPACK_ARROW_PYTHON=${THDPACK_ARROW_PYTHON}: no pyarrow there (pip install pyarrow)")
  endif()
  string(REPLACE "\n" ";" _pa "${_pa}")
  list(GET _pa 0 _pa_include)
  list(GET _pa 1 _pa_libdir)
  list(GET _pa 2 _pa_version)
  # The wheel's libraries carry their ABI version only (libarrow.so.2600): link them by path.
  file(GLOB _pa_arrow "${_pa_libdir}/libarrow.so.[0-9]*")
  file(GLOB _pa_parquet "${_pa_libdir}/libparquet.so.[0-9]*")
  list(FILTER _pa_arrow EXCLUDE REGEX "\\.so\\.[0-9]+\\.")
  list(FILTER _pa_parquet EXCLUDE REGEX "\\.so\\.[0-9]+\\.")
  if(NOT _pa_arrow OR NOT _pa_parquet OR NOT EXISTS "${_pa_include}/parquet/arrow/reader.h")
    message(FATAL_ERROR "THDPACK_ARROW_PYTHON: pyarrow ${_pa_version} at ${_pa_libdir} ships no "
            "Arrow C++ libraries or headers (libarrow.so.N, libparquet.so.N, parquet/arrow/reader.h)")
  endif()
  add_library(thdpack_arrow_cpp INTERFACE)
  target_include_directories(thdpack_arrow_cpp SYSTEM INTERFACE "${_pa_include}")
  target_link_libraries(thdpack_arrow_cpp INTERFACE ${_pa_parquet} ${_pa_arrow})
  set(_thdpack_arrow_rpath "${_pa_libdir}")
  set(_thdpack_arrow_found ON)
  message(STATUS "thdpack: the command line reads Parquet and Arrow files with pyarrow ${_pa_version}'s Arrow C++ (${_pa_libdir})")
else()
  find_package(Arrow CONFIG QUIET)
  find_package(Parquet CONFIG QUIET)
  if(TARGET Arrow::arrow_shared AND TARGET Parquet::parquet_shared)
    add_library(thdpack_arrow_cpp INTERFACE)
    target_link_libraries(thdpack_arrow_cpp INTERFACE Parquet::parquet_shared Arrow::arrow_shared)
    set(_thdpack_arrow_rpath "")
    set(_thdpack_arrow_found ON)
    message(STATUS "thdpack: the command line reads Parquet and Arrow files with Arrow C++ ${Arrow_VERSION}")
  else()
    message(STATUS "thdpack: no Arrow C++ (THDPACK_ARROW_PYTHON or find_package(Arrow)): the command line refuses parquet: and arrow: specs by name")
  endif()
endif()

function(thdpack_add_arrow_readers target)
  if(_thdpack_arrow_found)
    target_sources(${target} PRIVATE ${PROJECT_SOURCE_DIR}/tools/arrow_readers_arrow.cc)
    target_link_libraries(${target} PRIVATE thdpack_arrow_cpp)
    if(_thdpack_arrow_rpath)
      set_property(TARGET ${target} APPEND PROPERTY BUILD_RPATH "${_thdpack_arrow_rpath}")
      set_property(TARGET ${target} APPEND PROPERTY INSTALL_RPATH "${_thdpack_arrow_rpath}")
    endif()
  else()
    target_sources(${target} PRIVATE ${PROJECT_SOURCE_DIR}/tools/arrow_readers_none.cc)
  endif()
endfunction()
