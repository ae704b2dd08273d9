# Run by CTest with -DTHDPACK=<thdpack binary> -DWORK_DIR=<scratch> [-DMPIRUN=<mpirun command,
# ;-separated>]: the exit-code contract of docs/errors.md for every verb - 0 success, 2 bad
# usage or bad input (option parse errors included), 1 a failure while running - the same code
# from `plan` and `run` (and every MPI rank) for the same cause, options that make no sense
# together, and `megatron:PREFIX.idx` taken as the prefix.

cmake_minimum_required(VERSION 3.20)
file(MAKE_DIRECTORY ${WORK_DIR})

# expect(<code> <regex the stderr must match> <command...>)
function(expect code pattern)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc STREQUAL "${code}")
    message(FATAL_ERROR "${ARGN}: exit ${rc}, expected ${code}\nstdout: ${out}\nstderr: ${err}")
  endif()
  if(NOT pattern STREQUAL "" AND NOT err MATCHES "${pattern}")
    message(FATAL_ERROR "${ARGN}: stderr does not match \"${pattern}\":\n${err}")
  endif()
  # One line of error, not CLI11's banner.
  if(NOT code EQUAL 0)
    string(REGEX MATCHALL "\n" newlines "${err}")
    list(LENGTH newlines n)
    if(n GREATER 2)
      message(FATAL_ERROR "${ARGN}: the error takes ${n} lines:\n${err}")
    endif()
  endif()
  set(last_out "${out}" PARENT_SCOPE)
  set(last_err "${err}" PARENT_SCOPE)
endfunction()

set(small --global-batch 8 --steps 1 --mock-samples 16 --max-tokens-per-rank 8192)

# ---- 0: success, for each verb (and --help, --version, no verb).
expect(0 "" ${THDPACK} layout --lengths 7,3 --cp 2)
expect(0 "" ${THDPACK} plan ${small})
expect(0 "" ${THDPACK} run ${small})
expect(0 "" ${THDPACK} --version)
expect(0 "" ${THDPACK} --help)
# --help describes every verb.
foreach(verb plan run layout)
  if(NOT last_out MATCHES "\n  ${verb} ")
    message(FATAL_ERROR "--help does not describe ${verb}:\n${last_out}")
  endif()
endforeach()
expect(0 "" ${THDPACK} run --help)
if(NOT last_out MATCHES "--timeout")
  message(FATAL_ERROR "run --help has no --timeout:\n${last_out}")
endif()

# ---- 2: bad usage (CLI11's parse errors were 104-109) - for each verb.
expect(2 "--dp: Value x could not be converted|--dp.*x" ${THDPACK} plan --dp x)
expect(2 "--cp" ${THDPACK} run --cp 1.5)
expect(2 "--lengths is required" ${THDPACK} layout)
expect(2 "not expected: --bogus|--bogus" ${THDPACK} run --bogus)
expect(2 "" ${THDPACK} no-such-verb)
# An option of another verb says whose it is.
expect(2 "--verify is an option of `thdpack run`" ${THDPACK} plan --verify)
expect(2 "--svg is an option of `thdpack plan`" ${THDPACK} run --svg x.svg)

# ---- 2: bad input - for each verb.
expect(2 "--lengths: item 1" ${THDPACK} layout --lengths 7,0)
expect(2 "--dp: must be >= 1, got 0" ${THDPACK} plan --dp 0)
expect(2 "--dp: must be >= 1, got 0" ${THDPACK} run --dp 0)
expect(2 "cannot open" ${THDPACK} plan --data lengths:${WORK_DIR}/missing.txt)
expect(2 "cannot open" ${THDPACK} run --data lengths:${WORK_DIR}/missing.txt)

# The same cause gives the same code from plan and run: a sample over the budget (here read by
# the loader of replica 1, so on run it reaches rank 0 through the status agreement).
file(WRITE ${WORK_DIR}/oversize.txt "50\n5000\n50\n50\n")
set(oversize --data lengths:${WORK_DIR}/oversize.txt --dp 2 --cp 1 --max-tokens-per-rank 1000
             --global-batch 4 --steps 1)
expect(2 "sample id 1.*over the microbatch budget" ${THDPACK} plan ${oversize})
expect(2 "sample id 1.*over the microbatch budget" ${THDPACK} run ${oversize})
expect(2 "sample id 1.*over the microbatch budget" ${THDPACK} run ${oversize} --data-on all)
if(MPIRUN)
  # Every rank exits 2, so mpirun does.
  set(np2 ${MPIRUN})
  list(TRANSFORM np2 REPLACE "^8$" "2")
  execute_process(COMMAND ${np2} ${THDPACK} run --backend mpi ${oversize}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 2 OR NOT err MATCHES "over the microbatch budget")
    message(FATAL_ERROR "mpirun run with an oversize sample: exit ${rc}, expected 2:\n${err}")
  endif()
endif()

# ---- Options that make no sense together: one-line errors, exit 2.
expect(2 "--sp: .*needs --tp > 1, got --tp 1" ${THDPACK} plan --sp)
expect(2 "--sp: .*needs --tp > 1, got --tp 1" ${THDPACK} run --sp)
expect(2 "--sp: .*needs --tp > 1, got --tp 1" ${THDPACK} layout --lengths 7,3 --cp 2 --sp)
expect(2 "--probe-layers requires --verify" ${THDPACK} run --probe-layers 2)
expect(2 "--verify-tolerance requires --verify" ${THDPACK} run --verify-tolerance 0.1)
expect(2 "--memory-profile-dir requires --memory-profile-steps" ${THDPACK} run
       --memory-profile-dir ${WORK_DIR}/prof)
expect(2 "--summary-only requires --json" ${THDPACK} run --summary-only)
expect(2 "--mock-samples: only a mock source" ${THDPACK} plan --mock-samples 10
       --data lengths:${WORK_DIR}/oversize.txt)
expect(2 "--fused-grad: there are no logits figures without a vocabulary" ${THDPACK} plan
       --cost tokens --fused-grad)
expect(2 "--logits-dtype: there are no logits figures without a vocabulary" ${THDPACK} run
       --cost 1,0 --logits-dtype fp32)
expect(2 "--timeout: must be > 0" ${THDPACK} run --timeout 0)
# ... and what does make sense is still accepted.
expect(0 "" ${THDPACK} plan ${small} --cost tokens --vocab-size 1000 --fused-grad)
expect(0 "" ${THDPACK} plan ${small} --tp 2 --sp)

# ---- 1: a failure while running. 512 thread ranks and a 1 ms timeout: the first rank to reach
# a collective waits longer than that for the last thread to start, so the step fails naming
# the ranks that had not arrived.
expect(1 "not complete after 1 ms \\(the timeout\\): members .* did not arrive" ${THDPACK} run
       --dp 256 --cp 2 --timeout 0.001 --steps 1)

# ---- megatron:PREFIX.idx / .bin are taken as the prefix, with a note.
foreach(ext idx bin)
  execute_process(COMMAND ${THDPACK} plan --data megatron:${WORK_DIR}/corpus.${ext}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT err MATCHES "note: --data megatron:[^ ]*/corpus\\.${ext}: taking [^ ]*/corpus as the prefix"
     OR err MATCHES "corpus\\.${ext}\\.(idx|bin)")
    message(FATAL_ERROR "megatron:corpus.${ext} is not taken as the prefix:\n${err}")
  endif()
  if(NOT rc EQUAL 2)
    message(FATAL_ERROR "megatron: a missing data set: exit ${rc}, expected 2:\n${err}")
  endif()
endforeach()

message(STATUS "thdpack exit codes: all checks passed")
