# thdpack: the two commands a new machine needs.
#   make demo   install what is missing, build, and run the main job on built-in defaults
#   make test   install what is missing, build, and pass every test on Debian's stack (the
#               current PyPI stack's environment is made meanwhile, once); then the current
#               stack: the wheel pip builds, in fresh environments, with the whole Python suite;
#               then everything under ASan + UBSan in one clang build whose library is also
#               instrumented for libFuzzer (the Python suite's binding and one-world-per-path
#               subset on the current stack), and its fuzz targets, each run briefly.
#               docs/testing.md has the parts and their times.
#   make fuzz   the fuzz targets for FUZZ_SECONDS each (docs/testing.md)
# A user installs the Python package with `pip install .` (pyproject.toml).
JOBS ?= $(shell nproc)
BUILD ?= build
WITH_MPI ?= ON
# The sanitized build (clang: ASan + UBSan, the library instrumented for libFuzzer too).
SAN_BUILD ?= build-san
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

.PHONY: all deps venv build test test-unit test-current test-asan test-fuzz build-san fuzz demo bench clean

all: build

deps:
	@bash scripts/install_deps.sh

# build/'s unit-test program is built on demand (`cmake --build build --target thdpack_tests`):
# make test runs the unit tests once, under ASan + UBSan in $(SAN_BUILD); build/ runs the rest
# (the Python suite on Debian's stack, the command line, MPI, the corpus replays, the package).
$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) $(CMAKE_COMMON) -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE=$(PYTHON) \
	  -DCMAKE_CXX_FLAGS_RELEASE="$(RELEASE_FLAGS)" -DTHDPACK_UNIT_TESTS_IN_ALL=OFF \
	  -DTHDPACK_WITH_MPI=$(WITH_MPI) $(CMAKE_FLAGS)

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test-unit: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -E '^thdpack_tests_NOT_BUILT$$'

venv: deps
	bash scripts/make_venv.sh $(VENV) $(PYTHON)

# The wheel as pip builds it, installed into fresh environments (NumPy alone; the current
# stack), and the Python suite against it (scripts/test_current_stack.sh): the whole suite, or
# the tests of CURRENT_MARKERS. make test passes "no_sanitizer": the other tests run on the same
# stack's interpreter in $(SAN_BUILD) (test-asan), so that each test runs once on each stack.
CURRENT_MARKERS ?=
test-current: venv build
	RELEASE_FLAGS="$(RELEASE_FLAGS)" LAUNCHER=$(LAUNCHER) PYTEST_MARKERS="$(CURRENT_MARKERS)" \
	  bash scripts/test_current_stack.sh $(VENV) $(BUILD) $(WHEEL_BUILD)

# One clang build for the sanitizers and the fuzzers: ASan + UBSan on every object, and the
# library instrumented for libFuzzer as well (THDPACK_BUILD_FUZZ: fuzzer-no-link, cmake/fuzz.cmake),
# so that the sanitized unit tests, the CLI, the Python module (for the current stack's
# interpreter, ctest running the Python suite with clang's ASan runtime preloaded:
# python/CMakeLists.txt) and the libFuzzer targets share one compile of the library - two
# builds before (gcc for the sanitizers, clang for the fuzzers). Flags are given here, never
# forced by CMakeLists. No CUDA objects: nvcc does not instrument them, and the kernels'
# arithmetic runs on the CPU (ce_host.cc) in every build. Debug without NDEBUG keeps the
# library's internal checks on while fuzzing.
# Every program links clang's ASan runtime as the shared library the Python suite preloads
# (python/CMakeLists.txt), so that a program the suite starts (the CLI) finds one runtime, not
# its own static copy beside the preloaded one.
# -O0: measured from a cold cache on 2 cores, -O1 compiled build-san in 281 s against 153 s and
# ran its ctest in 74 s against about 140 s: -O0 is the shorter loop (docs/testing.md).
SAN_OPT ?= -O0
CLANG_ASAN_DIR = $(dir $(shell $(CLANG_CXX) -print-file-name=libclang_rt.asan-x86_64.so 2>/dev/null))
$(SAN_BUILD)/CMakeCache.txt: | venv
	cmake -S . -B $(SAN_BUILD) $(CMAKE_COMMON) -DCMAKE_CXX_COMPILER=$(CLANG_CXX) \
	  -DCMAKE_BUILD_TYPE=Debug -DTHDPACK_BUILD_BENCH=OFF -DTHDPACK_WITH_CUDA=OFF \
	  -DTHDPACK_BUILD_FUZZ=ON -DPython3_EXECUTABLE=$(abspath $(VENV))/bin/python \
	  -DTHDPACK_WITH_MPI=$(WITH_MPI) -DCMAKE_CXX_FLAGS_DEBUG="$(SAN_OPT) $(DEBUG_INFO)" \
	  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" \
	  -DCMAKE_EXE_LINKER_FLAGS="-shared-libasan -Wl,-rpath,$(CLANG_ASAN_DIR)"

build-san: deps venv $(SAN_BUILD)/CMakeCache.txt
	cmake --build $(SAN_BUILD) -j $(JOBS) --target thdpack_tests thdpack_cli fuzz_targets thdpack_python

test-asan: build-san
	cd $(SAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j $(JOBS) -E '^package\.' -LE mpi

# Each fuzz target for a few seconds from the checked-in seeds (and the corpus, which libFuzzer
# runs first: the replay of every input kept): a smoke, not a fuzzing campaign.
test-fuzz: build-san
	bash fuzz/run_fuzzers.sh --smoke $(SAN_BUILD) $(FUZZ_SMOKE_SECONDS)

fuzz: build-san
	bash fuzz/run_fuzzers.sh $(SAN_BUILD) $(FUZZ_SECONDS)

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
	@bash scripts/timed.sh $(TIMINGS) test-current $(MAKE) --no-print-directory test-current \
	  CURRENT_MARKERS=no_sanitizer
	@bash scripts/timed.sh $(TIMINGS) test-asan $(MAKE) --no-print-directory test-asan
	@bash scripts/timed.sh $(TIMINGS) test-fuzz $(MAKE) --no-print-directory test-fuzz
	@bash scripts/timed.sh --summary $(TIMINGS)

# Only what the demo runs: the command line and the Python module (the example it trains).
demo: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS) --target thdpack_cli thdpack_python
	bash scripts/demo.sh $(BUILD)

bench: build
	bash scripts/bench.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(SAN_BUILD) build-asan build-clang $(WHEEL_BUILD) $(TIMINGS)
