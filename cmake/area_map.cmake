# The functions the table of areas (cmake/areas.cmake) is written with, and the loader that
# validates it. Used at configure time by CMakeLists.txt and in script mode (cmake -P) by
# cmake/check_areas.cmake, so it needs nothing but CMake.
#
# After thdpack_load_area_map(<table>), global properties hold the map:
#   THDPACK_AREAS                   the areas, in table order (every arrow points to the left)
#   THDPACK_AREA_<a>_DEPS           the arrows of <a>, as written
#   THDPACK_AREA_<a>_REACH          every area <a> may use (the arrows followed transitively)
#   THDPACK_AREA_<a>_HEADERS        the public headers <a> owns
#   THDPACK_AREA_<a>_LIBS           third-party targets of <a>
#   THDPACK_AREA_<a>_SHARED         TRUE when <a>'s private headers are open to its users
#   THDPACK_HEADER_OWNER_<header>   the area owning include/thdpack/<header>, or "*umbrella*"
#   THDPACK_UMBRELLA_HEADERS        public headers that may include every public header
#   THDPACK_CONSUMER_DIRS           folders that may include public headers only
#   THDPACK_AREA_TABLE              the table's path (for messages)
include_guard(GLOBAL)

function(_thdpack_area_error message)
  get_property(table GLOBAL PROPERTY THDPACK_AREA_TABLE)
  message(FATAL_ERROR "${table}: ${message}")
endfunction()

function(_thdpack_claim_header header owner)
  if(NOT header MATCHES "^[A-Za-z0-9_]+\\.h$")
    _thdpack_area_error("public header \"${header}\" (${owner}): give the file name only, as "
                        "include/thdpack/<name>.h")
  endif()
  get_property(previous GLOBAL PROPERTY THDPACK_HEADER_OWNER_${header})
  if(previous)
    _thdpack_area_error("public header ${header} is claimed by ${previous} and by ${owner}: "
                        "a public header has exactly one owner")
  endif()
  set_property(GLOBAL PROPERTY THDPACK_HEADER_OWNER_${header} ${owner})
endfunction()

# thdpack_area(<area> [DEPS <area>...] [HEADERS <header>...] [LIBS <target>...] [SHARED])
function(thdpack_area area)
  cmake_parse_arguments(PARSE_ARGV 1 arg "SHARED" "" "DEPS;HEADERS;LIBS")
  if(arg_UNPARSED_ARGUMENTS)
    _thdpack_area_error("thdpack_area(${area}): unknown arguments \"${arg_UNPARSED_ARGUMENTS}\" "
                        "(expected DEPS, HEADERS, LIBS or SHARED)")
  endif()
  if(NOT area MATCHES "^[a-z][a-z0-9_]*$")
    _thdpack_area_error("area \"${area}\": an area is named as its folder src/<area>/ "
                        "(lower case letters, digits, _)")
  endif()
  get_property(areas GLOBAL PROPERTY THDPACK_AREAS)
  if(area IN_LIST areas)
    _thdpack_area_error("area ${area} is declared twice")
  endif()
  set(reach "")
  foreach(dep IN LISTS arg_DEPS)
    if(dep STREQUAL area)
      _thdpack_area_error("area ${area}: an arrow to itself")
    endif()
    if(NOT dep IN_LIST areas)
      _thdpack_area_error("area ${area}: DEPS ${dep} is not an area declared above it (an arrow "
                          "points up the table only, which keeps the map free of cycles)")
    endif()
    get_property(dep_reach GLOBAL PROPERTY THDPACK_AREA_${dep}_REACH)
    list(APPEND reach ${dep} ${dep_reach})
  endforeach()
  list(REMOVE_DUPLICATES reach)
  foreach(header IN LISTS arg_HEADERS)
    _thdpack_claim_header(${header} ${area})
  endforeach()
  set_property(GLOBAL APPEND PROPERTY THDPACK_AREAS ${area})
  set_property(GLOBAL PROPERTY THDPACK_AREA_${area}_DEPS "${arg_DEPS}")
  set_property(GLOBAL PROPERTY THDPACK_AREA_${area}_REACH "${reach}")
  set_property(GLOBAL PROPERTY THDPACK_AREA_${area}_HEADERS "${arg_HEADERS}")
  set_property(GLOBAL PROPERTY THDPACK_AREA_${area}_LIBS "${arg_LIBS}")
  set_property(GLOBAL PROPERTY THDPACK_AREA_${area}_SHARED ${arg_SHARED})
endfunction()

# thdpack_umbrella(<header>...): public headers that may include every public header.
function(thdpack_umbrella)
  foreach(header IN LISTS ARGN)
    _thdpack_claim_header(${header} "*umbrella*")
    set_property(GLOBAL APPEND PROPERTY THDPACK_UMBRELLA_HEADERS ${header})
  endforeach()
endfunction()

# thdpack_consumer(<folder>...): folders (from the repository root) of public-header users.
function(thdpack_consumer)
  set_property(GLOBAL APPEND PROPERTY THDPACK_CONSUMER_DIRS ${ARGN})
endfunction()

# Reads and validates the table; a second call is a no-op.
function(thdpack_load_area_map table)
  get_property(loaded GLOBAL PROPERTY THDPACK_AREA_TABLE)
  if(loaded)
    return()
  endif()
  set_property(GLOBAL PROPERTY THDPACK_AREA_TABLE ${table})
  set_property(GLOBAL PROPERTY THDPACK_AREAS "")
  include(${table})
  get_property(areas GLOBAL PROPERTY THDPACK_AREAS)
  if(NOT areas)
    _thdpack_area_error("declares no area")
  endif()
endfunction()

# Sets <out> to property THDPACK_AREA_<area>_<field>.
function(thdpack_area_get out area field)
  get_property(value GLOBAL PROPERTY THDPACK_AREA_${area}_${field})
  set(${out} "${value}" PARENT_SCOPE)
endfunction()
