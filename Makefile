# thdpack: the two commands a new machine needs.
#   make demo   install what is missing, build, and run the main job on built-in defaults
#   make test   install what is missing, build, and pass every test on Debian's stack (the
#               current PyPI stack's environment is made meanwhile, once); then the current
#               stack: the wheel pip builds, in fresh environments, with the whole Python suite;
#               then everything under ASan + UBSan (the Python suite's binding and one-world-
#               per-path subset on the current stack); then the library and the fuzz targets
#               with clang, each run briefly. docs/testing.md has the parts and their times.
#   make fuzz   the fuzz targets for FUZZ_SECONDS each (docs/testing.md)
# A user installs the Python package with `pip install .` (pyproject.toml).
JOBS ?= $(shell nproc)
BUILD ?= build
WITH_MPI ?= ON
ASAN_BUILD ?= build-asan
CLANG_BUILD ?= build-clang
CLANG_CXX ?= clang++
FUZZ_SECONDS ?= 60
FUZZ_SMOKE_SECONDS ?= 3
# Debug information of the builds: line tables (file, line and function in every backtrace,
# sanitizer report and profile) without the variable and type records of -g, which made each
# translation unit about a third slower to compile (docs/testing.md). DEBUG_INFO=-g for a
# debugger session.
DEBUG_INFO ?= -g1
# build/ compiles with the flags of the wheel pip builds (pyproject.toml: Release, -O2) plus
# DEBUG_INFO, and the wheel of make test gets the same DEBUG_INFO (which install.strip removes,
# and which never changes the code gcc generates) and build/'s compiler: the two share every
# library object through ccache.
RELEASE_FLAGS = -O2 $(DEBUG_INFO) -DNDEBUG
CMAKE_FLAGS ?=
# Every build: Ninja, and ccache in front of the C++ and CUDA compilers (scripts/ccache_launch.sh:
# keyed by paths relative to the checkout, so that another clone hits what this one compiled).
GENERATOR ?= Ninja
LAUNCHER := $(CURDIR)/scripts/ccache_launch.sh
CMAKE_COMMON = -G "$(GENERATOR)" -DCMAKE_CXX_COMPILER_LAUNCHER=$(LAUNCHER) \
  -DCMAKE_CUDA_COMPILER_LAUNCHER=$(LAUNCHER)
# make test writes the time of each part here (scripts/timed.sh; scripts/time_test.sh reads it).
TIMINGS ?= $(CURDIR)/build-timings.txt
# The Python module is built for Debian's interpreter (NumPy and PyTorch live there), whatever
# python3 comes first on PATH.
PYTHON ?= /usr/bin/python3
# The current stack: a virtual environment of Debian's interpreter with the newest NumPy 2,
# pybind11 3, PyTorch, megatron-core, transformers and TRL from PyPI
# (python/requirements-current.txt), made once by scripts/make_venv.sh and reused; `make clean`
# keeps it (a 3.4 GB download).
VENV ?= .venv
WHEEL_BUILD ?= build-wheel

.PHONY: all deps venv build test test-unit test-current test-asan test-fuzz build-clang fuzz demo bench clean

all: build

deps:
	@bash scripts/install_deps.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) $(CMAKE_COMMON) -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE=$(PYTHON) \
	  -DCMAKE_CXX_FLAGS_RELEASE="$(RELEASE_FLAGS)" \
	  -DTHDPACK_WITH_MPI=$(WITH_MPI) $(CMAKE_FLAGS)

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test-unit: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

venv: deps
	bash scripts/make_venv.sh $(VENV) $(PYTHON)

# The wheel as pip builds it, installed into fresh environments (NumPy alone; the current
# stack), and the whole Python suite against it (scripts/test_current_stack.sh).
test-current: venv build
	RELEASE_FLAGS="$(RELEASE_FLAGS)" LAUNCHER=$(LAUNCHER) \
	  bash scripts/test_current_stack.sh $(VENV) $(BUILD) $(WHEEL_BUILD)

# Sanitizers in a build folder of their own; flags are given here, never forced by CMakeLists.
# The Python module is built for the current stack's interpreter, and ctest runs the Python
# suite with the ASan runtime preloaded (python/CMakeLists.txt), so a read past an array's
# buffer under NumPy 2 is a report, not a silent wrong value. No CUDA objects: nvcc does not
# instrument them, and the kernels' arithmetic runs on the CPU (ce_host.cc) in every build.
$(ASAN_BUILD)/CMakeCache.txt: | venv
	cmake -S . -B $(ASAN_BUILD) $(CMAKE_COMMON) -DCMAKE_BUILD_TYPE=Debug -DTHDPACK_BUILD_BENCH=OFF \
	  -DTHDPACK_WITH_CUDA=OFF \
	  -DPython3_EXECUTABLE=$(abspath $(VENV))/bin/python \
	  -DTHDPACK_WITH_MPI=$(WITH_MPI) -DCMAKE_CXX_FLAGS_DEBUG="$(DEBUG_INFO)" \
	  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"

test-asan: deps venv $(ASAN_BUILD)/CMakeCache.txt
	cmake --build $(ASAN_BUILD) -j $(JOBS) --target thdpack_tests thdpack_cli fuzz_targets thdpack_python
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j $(JOBS) -E '^package\.' -LE mpi

# The clang build: the library and the libFuzzer targets (fuzz/), instrumented by
# THDPACK_BUILD_FUZZ; -O1 without NDEBUG keeps the library's internal checks on while fuzzing.
# No CUDA: the fuzz targets read files and messages, and nvcc would take clang as its host
# compiler.
$(CLANG_BUILD)/CMakeCache.txt:
	cmake -S . -B $(CLANG_BUILD) $(CMAKE_COMMON) -DCMAKE_CXX_COMPILER=$(CLANG_CXX) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 $(DEBUG_INFO)" -DTHDPACK_BUILD_FUZZ=ON -DTHDPACK_BUILD_TESTS=OFF \
	  -DTHDPACK_BUILD_BENCH=OFF -DTHDPACK_BUILD_PYTHON=OFF -DTHDPACK_BUILD_TOOLS=OFF \
	  -DTHDPACK_WITH_MPI=$(WITH_MPI) -DTHDPACK_WITH_CUDA=OFF

build-clang: deps $(CLANG_BUILD)/CMakeCache.txt
	cmake --build $(CLANG_BUILD) -j $(JOBS)

# Each target for a few seconds from the checked-in seeds: a smoke, not a fuzzing campaign.
test-fuzz: build-clang
	bash fuzz/run_fuzzers.sh --smoke $(CLANG_BUILD) $(FUZZ_SMOKE_SECONDS)

fuzz: build-clang
	bash fuzz/run_fuzzers.sh $(CLANG_BUILD) $(FUZZ_SECONDS)

# The parts one after the other, each timed (scripts/timed.sh), but the current stack's
# environment, made while Debian's build compiles and its tests run (a download, mostly).
test:
	@rm -f $(TIMINGS)
	@bash scripts/timed.sh $(TIMINGS) deps $(MAKE) --no-print-directory deps
	@bash scripts/timed.sh $(TIMINGS) venv $(MAKE) --no-print-directory venv > $(TIMINGS).venv 2>&1 & \
	  venv_pid=$$!; \
	  bash scripts/timed.sh $(TIMINGS) test-unit $(MAKE) --no-print-directory test-unit; unit=$$?; \
	  wait $$venv_pid; venv=$$?; cat $(TIMINGS).venv; rm -f $(TIMINGS).venv; \
	  [ $$venv -eq 0 ] && exit $$unit; exit 1
	@bash scripts/timed.sh $(TIMINGS) test-current $(MAKE) --no-print-directory test-current
	@bash scripts/timed.sh $(TIMINGS) test-asan $(MAKE) --no-print-directory test-asan
	@bash scripts/timed.sh $(TIMINGS) test-fuzz $(MAKE) --no-print-directory test-fuzz
	@bash scripts/timed.sh --summary $(TIMINGS)

demo: build
	bash scripts/demo.sh $(BUILD)

bench: build
	bash scripts/bench.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(CLANG_BUILD) $(WHEEL_BUILD) $(TIMINGS)
