# The area check: every #include line of the library, its public headers and its consumers
# against the table of areas (cmake/areas.cmake). Run by the build before any area compiles and
# by ctest (areas.check); docs/architecture.md explains the rules.
#
#   cmake -DSOURCE_DIR=<repository root> [-DTABLE=<areas.cmake>] [-DSTAMP=<file>]
#         -P cmake/check_areas.cmake
#
# Checked, with the file and line of each include that breaks a rule (all are listed at once):
#   src/<area>/**      a public header of an area outside <area>'s reach; a private header
#                      (src/<b>/*.h) of another area, unless <b> is SHARED and within reach;
#                      the umbrella header. Tests beside the code (*_test.cc, *_test_util.h)
#                      may also include tests/*.h and *_test_util.h of the areas within reach.
#   include/thdpack/*  a public header of an area outside its owner's reach, or anything that
#                      is not a public header (they are installed without src/).
#   consumers          (tools/, python/src/) anything but a public header from src/.
#   the table itself   a folder under src/ or a public header that no table line names, or a
#                      table line naming a public header that does not exist.
# On success it writes STAMP (when given), so the build runs it again only when a file changes.
cmake_minimum_required(VERSION 3.20)

if(NOT SOURCE_DIR)
  message(FATAL_ERROR "usage: cmake -DSOURCE_DIR=<repository root> [-DTABLE=<areas.cmake>] "
                      "[-DSTAMP=<file>] -P check_areas.cmake")
endif()
if(NOT TABLE)
  set(TABLE ${SOURCE_DIR}/cmake/areas.cmake)
endif()
include(${CMAKE_CURRENT_LIST_DIR}/area_map.cmake)
thdpack_load_area_map(${TABLE})
file(RELATIVE_PATH table_rel ${SOURCE_DIR} ${TABLE})
get_property(areas GLOBAL PROPERTY THDPACK_AREAS)
get_property(consumers GLOBAL PROPERTY THDPACK_CONSUMER_DIRS)

set_property(GLOBAL PROPERTY THDPACK_AREA_PROBLEMS "")
function(problem)
  string(CONCAT text ${ARGV})
  set_property(GLOBAL APPEND_STRING PROPERTY THDPACK_AREA_PROBLEMS "  ${text}\n")
endfunction()

# <out> = "<file>:<line>" of the first line of <file> holding <text>.
function(where out file text)
  file(READ ${file} content)
  string(FIND "${content}" "${text}" pos)
  string(SUBSTRING "${content}" 0 ${pos} head)
  string(REGEX MATCHALL "\n" newlines "${head}")
  list(LENGTH newlines n)
  math(EXPR n "${n} + 1")
  file(RELATIVE_PATH rel ${SOURCE_DIR} ${file})
  set(${out} "${rel}:${n}" PARENT_SCOPE)
endfunction()

# <out> = "a, b, c" or "nothing".
function(joined out)
  set(items ${ARGN})
  list(SORT items)
  string(REPLACE ";" ", " text "${items}")
  if(text STREQUAL "")
    set(text "nothing")
  endif()
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

# Sets `includes` to the includes of <file>, each as its delimiter followed by its path
# ("<vector" or "\"thdpack/status.h").
macro(read_includes file)
  file(STRINGS ${file} _lines REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]")
  set(includes "")
  foreach(_line IN LISTS _lines)
    if(_line MATCHES "^([ \t]*#[ \t]*include[ \t]*)([<\"])([^>\"]+)[>\"]")
      list(APPEND includes "${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
    endif()
  endforeach()
endmacro()

# Splits an entry of `includes` into delim, path and quoted (as written: "x.h" or <x.h>).
macro(split_include inc)
  string(SUBSTRING "${inc}" 0 1 delim)
  string(SUBSTRING "${inc}" 1 -1 path)
  if(delim STREQUAL "<")
    set(quoted "<${path}>")
  else()
    set(quoted "\"${path}\"")
  endif()
endmacro()

# ---------------------------------------------------------------------------------------------
# The table against the tree: every public header and every folder under src/ has an owner.
file(GLOB public_headers RELATIVE ${SOURCE_DIR}/include/thdpack ${SOURCE_DIR}/include/thdpack/*.h)
foreach(header IN LISTS public_headers)
  get_property(owner GLOBAL PROPERTY THDPACK_HEADER_OWNER_${header})
  if(NOT owner)
    problem("include/thdpack/${header}: no area owns this public header: add it to HEADERS of "
            "its area in ${table_rel}")
  endif()
endforeach()
foreach(area IN LISTS areas)
  thdpack_area_get(headers ${area} HEADERS)
  foreach(header IN LISTS headers)
    if(NOT EXISTS ${SOURCE_DIR}/include/thdpack/${header})
      problem("${table_rel}: area ${area} owns include/thdpack/${header}, which does not exist")
    endif()
  endforeach()
  if(NOT IS_DIRECTORY ${SOURCE_DIR}/src/${area} AND NOT headers)
    problem("${table_rel}: area ${area} has neither a folder src/${area}/ nor a public header")
  endif()
endforeach()
get_property(umbrellas GLOBAL PROPERTY THDPACK_UMBRELLA_HEADERS)
foreach(header IN LISTS umbrellas)
  if(NOT EXISTS ${SOURCE_DIR}/include/thdpack/${header})
    problem("${table_rel}: umbrella header include/thdpack/${header} does not exist")
  endif()
endforeach()
file(GLOB src_children RELATIVE ${SOURCE_DIR}/src LIST_DIRECTORIES true ${SOURCE_DIR}/src/*)
set(checked_areas "")
foreach(child IN LISTS src_children)
  if(NOT IS_DIRECTORY ${SOURCE_DIR}/src/${child})
    problem("src/${child}: files live in the folder of their area (src/<area>/)")
  elseif(NOT child IN_LIST areas)
    problem("src/${child}/: not an area: declare it in ${table_rel} with "
            "thdpack_area(${child} DEPS <areas it uses> HEADERS <its public headers>)")
  else()
    list(APPEND checked_areas ${child})
  endif()
endforeach()

# A public header named by an include (path as thdpack/<name>.h, quoted as written): sets
# <out> to its owner, or reports and sets "".
function(public_owner out at path quoted)
  string(REGEX REPLACE "^thdpack/" "" header "${path}")
  get_property(owner GLOBAL PROPERTY THDPACK_HEADER_OWNER_${header})
  if(NOT owner)
    problem("${at}: ${quoted}: not a public header in ${table_rel} (include/thdpack/${header} "
            "has no owner or does not exist)")
  endif()
  set(${out} "${owner}" PARENT_SCOPE)
endfunction()

# ---------------------------------------------------------------------------------------------
# The library: src/<area>/.
foreach(area IN LISTS checked_areas)
  thdpack_area_get(reach ${area} REACH)
  joined(reach_text ${reach})
  file(GLOB_RECURSE files ${SOURCE_DIR}/src/${area}/*.cc ${SOURCE_DIR}/src/${area}/*.h
       ${SOURCE_DIR}/src/${area}/*.cu ${SOURCE_DIR}/src/${area}/*.cuh)
  foreach(file IN LISTS files)
    get_filename_component(dir ${file} DIRECTORY)
    set(is_test FALSE)
    if(file MATCHES "(_test\\.cc|_test_util\\.h)$")
      set(is_test TRUE)
    endif()
    read_includes(${file})
    foreach(inc IN LISTS includes)
      split_include("${inc}")
      if(path MATCHES "^thdpack/")
        where(at ${file} "${quoted}")
        public_owner(owner "${at}" "${path}" "${quoted}")
        if(owner STREQUAL "*umbrella*")
          problem("${at}: ${quoted} is the umbrella header: include the headers of the areas "
                  "${area} uses")
        elseif(owner AND NOT owner STREQUAL area AND NOT owner IN_LIST reach)
          problem("${at}: ${quoted} is a public header of area ${owner}, outside the arrows "
                  "of ${area} (${area} may use only ${reach_text}, as drawn in ${table_rel})")
        endif()
      elseif(delim STREQUAL "\"" AND path MATCHES "^([^/]+)/")
        set(other ${CMAKE_MATCH_1})
        if(NOT other IN_LIST areas)
          if(IS_DIRECTORY ${SOURCE_DIR}/src/${other})
            where(at ${file} "${quoted}")
            problem("${at}: ${quoted} is in src/${other}/, which is not an area")
          endif()
          continue()  # a third-party header written with quotes
        endif()
        if(other STREQUAL area)
          continue()
        endif()
        thdpack_area_get(shared ${other} SHARED)
        if(other IN_LIST reach AND (shared OR (is_test AND path MATCHES "_test_util\\.h$")))
          continue()
        endif()
        where(at ${file} "${quoted}")
        if(NOT other IN_LIST reach)
          problem("${at}: ${quoted} is a private header of area ${other}, outside the arrows "
                  "of ${area} (${area} may use only ${reach_text}, as drawn in ${table_rel})")
        else()
          problem("${at}: ${quoted} is a private header of area ${other}: private headers are "
                  "for their own area only (a helper used across areas belongs in src/common/, "
                  "or ${other} offers it in a public header)")
        endif()
      elseif(delim STREQUAL "\"")
        if(EXISTS ${dir}/${path} OR (is_test AND EXISTS ${SOURCE_DIR}/tests/${path}))
          continue()
        endif()
        where(at ${file} "${quoted}")
        problem("${at}: ${quoted} names no file of src/${area}/ (private headers are written "
                "\"<area>/<file>.h\"; test utilities of tests/ are for *_test.cc files only)")
      endif()
    endforeach()
  endforeach()
endforeach()

# ---------------------------------------------------------------------------------------------
# The public headers: each includes only public headers within its owner's reach.
foreach(header IN LISTS public_headers)
  get_property(owner GLOBAL PROPERTY THDPACK_HEADER_OWNER_${header})
  if(NOT owner)
    continue()  # reported above
  endif()
  set(reach "")
  if(NOT owner STREQUAL "*umbrella*")
    thdpack_area_get(reach ${owner} REACH)
  endif()
  joined(reach_text ${reach})
  set(file ${SOURCE_DIR}/include/thdpack/${header})
  read_includes(${file})
  foreach(inc IN LISTS includes)
    split_include("${inc}")
    if(path MATCHES "^thdpack/")
      where(at ${file} "${quoted}")
      public_owner(other "${at}" "${path}" "${quoted}")
      if(owner STREQUAL "*umbrella*" OR NOT other)
        continue()
      endif()
      if(other STREQUAL "*umbrella*")
        problem("${at}: ${quoted} is the umbrella header: a header of area ${owner} includes "
                "the headers of the areas it uses")
      elseif(NOT other STREQUAL owner AND NOT other IN_LIST reach)
        problem("${at}: ${quoted} is a public header of area ${other}, outside the arrows of "
                "${owner}, which owns ${header} (${owner} may use only ${reach_text}, as drawn "
                "in ${table_rel})")
      endif()
    elseif(delim STREQUAL "\"")
      where(at ${file} "${quoted}")
      problem("${at}: ${quoted}: a public header includes only public headers "
              "(\"thdpack/<name>.h\"): it is installed without src/")
    endif()
  endforeach()
endforeach()

# ---------------------------------------------------------------------------------------------
# The consumers: public headers only.
foreach(consumer IN LISTS consumers)
  if(NOT IS_DIRECTORY ${SOURCE_DIR}/${consumer})
    continue()  # e.g. a checkout without the Python module
  endif()
  file(GLOB_RECURSE files ${SOURCE_DIR}/${consumer}/*.cc ${SOURCE_DIR}/${consumer}/*.h)
  foreach(file IN LISTS files)
    read_includes(${file})
    foreach(inc IN LISTS includes)
      split_include("${inc}")
      if(path MATCHES "^thdpack/")
        where(at ${file} "${quoted}")
        public_owner(owner "${at}" "${path}" "${quoted}")
      elseif(delim STREQUAL "\"" AND path MATCHES "^([^/]+)/"
             AND (CMAKE_MATCH_1 IN_LIST areas OR IS_DIRECTORY ${SOURCE_DIR}/src/${CMAKE_MATCH_1}))
        where(at ${file} "${quoted}")
        problem("${at}: ${quoted} is a private header of the library: ${consumer}/ uses the "
                "public headers only (\"thdpack/<name>.h\")")
      endif()
    endforeach()
  endforeach()
endforeach()

get_property(problems GLOBAL PROPERTY THDPACK_AREA_PROBLEMS)
if(NOT "${problems}" STREQUAL "")
  message(FATAL_ERROR "thdpack area check failed (the map of areas is ${table_rel}; "
                      "docs/architecture.md explains it):\n${problems}")
endif()
if(STAMP)
  file(TOUCH ${STAMP})
endif()
