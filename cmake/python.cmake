# cmake/python.cmake: what the Python module needs, found for the interpreter it is built for.
#
#   thdpack_find_python_module_deps(<out-var>)
#
# Finds Python3 (Interpreter and Development.Module: a module needs the headers, not the
# embedding library, which many virtual environments lack) and pybind11, preferring the
# pybind11 installed in that interpreter (`python -m pybind11 --cmakedir`) over a system copy.
# NumPy is not needed to build: pybind11 loads NumPy's C API when the module runs.
#
# A pybind11 older than 2.12 reads arrays with NumPy 1's struct layout; against NumPy 2 it gets
# wrong sizes and strides, and the module returns garbage or crashes. So, when the interpreter
# has NumPy 2 or newer and the pybind11 found is older than 2.12, configuring fails and says how
# to fix it (the module also refuses to import in that case, module.cc).
#
# Sets <out-var> TRUE when the module can be built. When something is missing, a message says
# what and the module is skipped - except under pip (SKBUILD), where the module is the point of
# the build and a missing piece is an error.
macro(thdpack_find_python_module_deps thdpack_out)
  set(${thdpack_out} FALSE)
  set(thdpack_required "")
  if(SKBUILD)
    set(thdpack_required REQUIRED)
  endif()
  find_package(Python3 COMPONENTS Interpreter Development.Module ${thdpack_required})
  if(NOT Python3_FOUND)
    message(STATUS "thdpack: Python module not built (needs a Python3 interpreter and its "
                   "headers: scripts/install_deps.sh installs Debian's python3-dev)")
  else()
    execute_process(COMMAND ${Python3_EXECUTABLE} -m pybind11 --cmakedir
                    OUTPUT_VARIABLE thdpack_pybind11_hint OUTPUT_STRIP_TRAILING_WHITESPACE
                    RESULT_VARIABLE thdpack_rc ERROR_QUIET)
    if(NOT thdpack_rc EQUAL 0)
      set(thdpack_pybind11_hint "")
    endif()
    find_package(pybind11 2.6 CONFIG ${thdpack_required} HINTS ${thdpack_pybind11_hint})
    if(NOT pybind11_FOUND)
      message(STATUS "thdpack: Python module not built (no pybind11 for ${Python3_EXECUTABLE}: "
                     "`pip install pybind11` there, or Debian's pybind11-dev)")
    else()
      execute_process(COMMAND ${Python3_EXECUTABLE} -c "import numpy; print(numpy.__version__)"
                      OUTPUT_VARIABLE thdpack_numpy_version OUTPUT_STRIP_TRAILING_WHITESPACE
                      RESULT_VARIABLE thdpack_rc ERROR_QUIET)
      if(thdpack_rc EQUAL 0 AND thdpack_numpy_version VERSION_GREATER_EQUAL 2
         AND pybind11_VERSION VERSION_LESS 2.12)
        message(FATAL_ERROR
          "thdpack: pybind11 ${pybind11_VERSION} (${pybind11_DIR}) cannot read the arrays of "
          "NumPy ${thdpack_numpy_version}, which ${Python3_EXECUTABLE} has: NumPy 2 support came "
          "in pybind11 2.12. `${Python3_EXECUTABLE} -m pip install 'pybind11>=2.12'` (found "
          "first from then on), or -Dpybind11_DIR=<a newer one>, or -DTHDPACK_BUILD_PYTHON=OFF.")
      endif()
      message(STATUS "thdpack: Python module for ${Python3_EXECUTABLE} (Python "
                     "${Python3_VERSION}) with pybind11 ${pybind11_VERSION} from ${pybind11_DIR}")
      set(${thdpack_out} TRUE)
    endif()
  endif()
endmacro()
