# Run by CTest with -DTHDPACK=<thdpack binary> [-DMPIRUN=<mpirun command, ;-separated>]:
# `thdpack run` as a user sees it. The figures of `run --json` (everything but time_*) must be
# identical between the thread and MPI backends, bytes_sent included (its rule depends only on
# what is sent), and between runs; each step object must be `thdpack plan --json`'s for the
# same inputs plus bytes_sent and time_*; bad arguments give a clear error and a non-zero exit.

cmake_minimum_required(VERSION 3.20)

# The i-th line (from 0) of text. (JSON holds brackets, so lines are not handled as a CMake list.)
function(get_line out_var text i)
  set(k 0)
  while(TRUE)
    string(FIND "${text}" "\n" pos)
    if(pos EQUAL -1)
      set(line "${text}")
      set(text "")
    else()
      string(SUBSTRING "${text}" 0 ${pos} line)
      math(EXPR pos "${pos} + 1")
      string(SUBSTRING "${text}" ${pos} -1 text)
    endif()
    if(k EQUAL i)
      set(${out_var} "${line}" PARENT_SCOPE)
      return()
    endif()
    math(EXPR k "${k} + 1")
    if(text STREQUAL "")
      set(${out_var} "" PARENT_SCOPE)
      return()
    endif()
  endwhile()
endfunction()

# The output with time_* removed from every line (one JSON object per step).
function(strip_times out_var text)
  set(result "")
  set(i 0)
  while(TRUE)
    get_line(line "${text}" ${i})
    if(line STREQUAL "")
      break()
    endif()
    string(JSON n LENGTH "${line}")
    math(EXPR last "${n} - 1")
    set(keys "")
    foreach(k RANGE ${last})
      string(JSON key MEMBER "${line}" ${k})
      if(key MATCHES "^time_")
        list(APPEND keys ${key})
      endif()
    endforeach()
    foreach(key IN LISTS keys)
      string(JSON line REMOVE "${line}" ${key})
    endforeach()
    string(REGEX REPLACE "\n *" "" line "${line}")  # REMOVE pretty-prints: back to one line
    string(APPEND result "${line}\n")
    math(EXPR i "${i} + 1")
  endwhile()
  set(${out_var} "${result}" PARENT_SCOPE)
endfunction()

function(run_json out_var)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${ARGN} failed (${rc}): ${err}")
  endif()
  strip_times(stripped "${out}")
  set(${out_var} "${stripped}" PARENT_SCOPE)
endfunction()

set(common --tp 2 --cp 2 --dp 2 --global-batch 32 --steps 3 --max-tokens-per-rank 8192
           --mock-samples 64 --cost llama2-7b --json)
run_json(threads ${THDPACK} run --backend threads ${common})
run_json(threads_again ${THDPACK} run --backend threads ${common})
if(NOT threads STREQUAL threads_again)
  message(FATAL_ERROR "two thread runs differ:\n${threads}\n---\n${threads_again}")
endif()

# Three steps of 32 from 64 samples a epoch: the third starts epoch 1.
get_line(third "${threads}" 2)
string(JSON epoch GET "${third}" epoch)
string(JSON n GET "${third}" n_samples)
if(NOT epoch EQUAL 1 OR NOT n EQUAL 32)
  message(FATAL_ERROR "step 2: epoch ${epoch}, n_samples ${n}; expected 1 and 32")
endif()
# flops present with a model cost; bytes_sent per rank (8 ranks) per phase.
string(JSON flops TYPE "${third}" flops)
string(JSON ranks LENGTH "${third}" bytes_sent total)
if(NOT flops STREQUAL "NUMBER" OR NOT ranks EQUAL 8)
  message(FATAL_ERROR "flops ${flops}, bytes_sent.total has ${ranks} entries: ${third}")
endif()
# Only loaders (ranks 0 and 4 at tp=cp=pp=0) send in the length exchange.
foreach(r 1 2 3 5 6 7)
  string(JSON b GET "${third}" bytes_sent lengths ${r})
  if(NOT b EQUAL 0)
    message(FATAL_ERROR "rank ${r} sent ${b} bytes in the length exchange")
  endif()
endforeach()

if(MPIRUN)
  run_json(mpi ${MPIRUN} ${THDPACK} run --backend mpi ${common})
  if(NOT mpi STREQUAL threads)
    message(FATAL_ERROR "MPI and thread backends differ:\n${mpi}\n---\n${threads}")
  endif()
  # data-on all as well.
  run_json(t_all ${THDPACK} run --backend threads ${common} --data-on all --sp)
  run_json(m_all ${MPIRUN} ${THDPACK} run --backend mpi ${common} --data-on all --sp)
  if(NOT t_all STREQUAL m_all)
    message(FATAL_ERROR "--data-on all: MPI and thread backends differ")
  endif()
endif()

# run --json against plan --json for the same inputs: run prints plan's step object byte for
# byte and only appends bytes_sent and time_* (both use thdpack/figures.h). A lengths file of
# 100 samples, 5 steps of 25: the last step starts epoch 1. Both data-on modes, SP on and off.
file(MAKE_DIRECTORY ${WORK_DIR})
set(lengths_text "")
foreach(i RANGE 1 100)
  math(EXPR v "(${i} * 7919) % 3000 + 1")
  string(APPEND lengths_text "${v}\n")
endforeach()
file(WRITE ${WORK_DIR}/lengths.txt "${lengths_text}")
# Each variant: "<options of both>|<data-on mode of run>".
foreach(variant "--sp|tp0" "--sp|all" "--scheduler;sequential|all" "--summary-only|tp0")
  string(REPLACE "|" ";" parts "${variant}")
  list(GET parts -1 data_on)
  list(REMOVE_AT parts -1)
  set(extra ${parts})
  set(inputs --data lengths:${WORK_DIR}/lengths.txt --tp 2 --cp 2 --dp 2 --global-batch 25
             --steps 5 --max-tokens-per-rank 4096 --json ${extra})
  execute_process(COMMAND ${THDPACK} plan ${inputs} RESULT_VARIABLE rc OUTPUT_VARIABLE plan_out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "plan ${inputs}: ${rc} ${err}")
  endif()
  execute_process(COMMAND ${THDPACK} run ${inputs} --data-on ${data_on} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE run_out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "run ${inputs}: ${rc} ${err}")
  endif()
  foreach(k RANGE 0 4)
    math(EXPR plan_line "${k} + 1")  # line 0 of plan's report is {"steps":[
    get_line(p "${plan_out}" ${plan_line})
    string(REGEX REPLACE "\\]?,$" "" p "${p}")
    get_line(r "${run_out}" ${k})
    string(FIND "${r}" ",\"bytes_sent\":" cut)
    if(cut EQUAL -1)
      message(FATAL_ERROR "run step ${k} has no bytes_sent: ${r}")
    endif()
    string(SUBSTRING "${r}" 0 ${cut} r_figures)
    string(APPEND r_figures "}")
    if(NOT r_figures STREQUAL p)
      message(FATAL_ERROR "${variant}: step ${k} of run differs from plan:\nrun:  ${r_figures}\nplan: ${p}")
    endif()
  endforeach()
  string(JSON epoch GET "${r}" epoch)
  if(NOT epoch EQUAL 1)
    message(FATAL_ERROR "step 4 should start epoch 1: ${r}")
  endif()
endforeach()

# The table form.
execute_process(COMMAND ${THDPACK} run --tp 2 --cp 2 --dp 2 --global-batch 16 --steps 1
                --mock-samples 40 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "^step 0 \\(epoch 0\\): 16 samples -> [0-9]+ microbatches x 2 replicas")
  message(FATAL_ERROR "table form: rc=${rc}\n${out}\n${err}")
endif()

# Errors: a bad argument, and a sample over the budget (exit 1, the failing loader named).
execute_process(COMMAND ${THDPACK} run --global-batch 0 RESULT_VARIABLE rc ERROR_VARIABLE err
                OUTPUT_VARIABLE out)
if(rc EQUAL 0 OR NOT err MATCHES "--global-batch: \"0\"")
  message(FATAL_ERROR "expected an error for --global-batch 0: rc=${rc} ${err}")
endif()
execute_process(COMMAND ${THDPACK} run --backend nccl RESULT_VARIABLE rc ERROR_VARIABLE err
                OUTPUT_VARIABLE out)
if(rc EQUAL 0 OR NOT err MATCHES "--backend")
  message(FATAL_ERROR "expected an error for --backend nccl: rc=${rc} ${err}")
endif()
execute_process(COMMAND ${THDPACK} run --dp 2 --tp 2 --max-tokens-per-rank 2000 --global-batch 64
                RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_VARIABLE out)
if(NOT rc EQUAL 1 OR NOT err MATCHES "over the microbatch budget")
  message(FATAL_ERROR "expected a budget error: rc=${rc} ${err}")
endif()
message(STATUS "thdpack run: all checks passed")
