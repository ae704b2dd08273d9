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

# Memory profiles (docs/memory.md): with --memory-profile-steps 0,1 every rank writes
# DIR/step_<N>/rank<R>_pp<p>_dp<d>_cp<c>_tp<t>.json at steps 0 and 1, and only there. At TP=2
# CP=2 DP=2 (tp fastest) rank r is tp r%2, cp (r/2)%2, dp r/4: 2 steps x 8 ranks = 16 files.
# Each file's figures follow from the step's JSON: a rank of replica d holds, per microbatch m of
# padded length P and n sequences, P/2 tokens (CP = 2): tokens, position_ids and labels 4 bytes
# each, loss_mask 1, metadata 2 x (n+1) x 4. Logits (llama2-7b: V = 32000, bf16, TP = 2:
# 16000 columns) of its largest microbatch T: T/2 x 16000 x 2 = 16000 T CP-local, 32000 T
# gathered.
function(check_profiles dir run_out ranks_in_process)
  file(GLOB_RECURSE files RELATIVE ${dir} ${dir}/*)
  list(SORT files)
  set(expected "")
  foreach(s 0 1)
    foreach(r RANGE 0 7)
      math(EXPR tp "${r} % 2")
      math(EXPR cp "(${r} / 2) % 2")
      math(EXPR dp "${r} / 4")
      list(APPEND expected "step_${s}/rank${r}_pp0_dp${dp}_cp${cp}_tp${tp}.json")
    endforeach()
  endforeach()
  list(SORT expected)
  if(NOT files STREQUAL expected)
    message(FATAL_ERROR "profile files in ${dir}:\n${files}\nexpected:\n${expected}")
  endif()
  foreach(s 0 1)
    get_line(line "${run_out}" ${s})
    foreach(r RANGE 0 7)
      math(EXPR tp "${r} % 2")
      math(EXPR cp "(${r} / 2) % 2")
      math(EXPR dp "${r} / 4")
      set(sum 0)
      set(largest 0)
      set(metadata 0)
      string(JSON n_mb LENGTH "${line}" replicas ${dp} microbatches)
      math(EXPR last_mb "${n_mb} - 1")
      foreach(m RANGE ${last_mb})
        string(JSON p GET "${line}" replicas ${dp} microbatches ${m} padded_tokens)
        string(JSON n LENGTH "${line}" replicas ${dp} microbatches ${m} samples)
        math(EXPR sum "${sum} + ${p}")
        # cu_seqlens and cu_seqlens_padded (int32 [n+1]), sample ids and loss-token counts
        # (int64 [n]).
        math(EXPR metadata "${metadata} + 2 * (${n} + 1) * 4 + 2 * ${n} * 8")
        if(p GREATER largest)
          set(largest ${p})
        endif()
      endforeach()
      file(READ "${dir}/step_${s}/rank${r}_pp0_dp${dp}_cp${cp}_tp${tp}.json" f)
      math(EXPR tokens "${sum} / 2 * 4")
      math(EXPR mask "${sum} / 2")
      math(EXPR total "3 * ${tokens} + ${mask} + ${metadata}")
      math(EXPR local "16000 * ${largest}")
      math(EXPR gathered "32000 * ${largest}")
      foreach(check "${s};step" "${r};rank" "0;pp" "${dp};dp" "${cp};cp" "${tp};tp"
                    "${n_mb};num_microbatches"
                    "${tokens};held_bytes;tokens" "${tokens};held_bytes;position_ids"
                    "${tokens};held_bytes;labels" "${mask};held_bytes;loss_mask"
                    "${metadata};held_bytes;metadata" "0;held_bytes;fields"
                    "${total};held_bytes;total"
                    "${largest};logits;largest_microbatch_tokens" "32000;logits;vocab_size"
                    "bfloat16;logits;dtype" "2;logits;tp_size" "${local};logits;local_bytes"
                    "${gathered};logits;gathered_bytes"
                    "${ranks_in_process};process;ranks_in_process")
        list(GET check 0 want)
        list(SUBLIST check 1 -1 path)
        string(JSON got GET "${f}" ${path})
        if(NOT got STREQUAL want)
          message(FATAL_ERROR "step ${s} rank ${r}: ${path} is ${got}, expected ${want}:\n${f}")
        endif()
      endforeach()
      string(JSON peak GET "${f}" process peak_rss_bytes)
      string(JSON rss GET "${f}" process rss_bytes)
      if(NOT rss GREATER 0 OR peak LESS rss)
        message(FATAL_ERROR "step ${s} rank ${r}: peak ${peak}, rss ${rss}")
      endif()
      string(JSON note ERROR_VARIABLE no_note GET "${f}" process note)
      if(ranks_in_process GREATER 1 AND no_note)
        message(FATAL_ERROR "${ranks_in_process} ranks in one process and no note: ${f}")
      elseif(ranks_in_process EQUAL 1 AND NOT no_note)
        message(FATAL_ERROR "a note with one rank a process: ${f}")
      endif()
    endforeach()
  endforeach()
endfunction()

set(profile --tp 2 --cp 2 --dp 2 --global-batch 32 --steps 3 --max-tokens-per-rank 8192
            --mock-samples 64 --json --memory-profile-steps 1,0)
file(REMOVE_RECURSE ${WORK_DIR}/profile_threads)
run_json(out ${THDPACK} run --backend threads ${profile}
         --memory-profile-dir ${WORK_DIR}/profile_threads)
check_profiles(${WORK_DIR}/profile_threads "${out}" 8)
# The step JSON carries plan's memory object (same V, dtype and TP).
get_line(first "${out}" 0)
string(JSON v GET "${first}" memory logits vocab_size)
string(JSON tp GET "${first}" memory logits tp_size)
if(NOT v EQUAL 32000 OR NOT tp EQUAL 2)
  message(FATAL_ERROR "step memory object: V ${v}, TP ${tp}: ${first}")
endif()
if(MPIRUN)
  file(REMOVE_RECURSE ${WORK_DIR}/profile_mpi)
  run_json(out ${MPIRUN} ${THDPACK} run --backend mpi ${profile}
           --memory-profile-dir ${WORK_DIR}/profile_mpi)
  check_profiles(${WORK_DIR}/profile_mpi "${out}" 1)
endif()

# PP = 2 (TP = 1, CP = 2, DP = 1: rank = cp + 2 pp): the first stage holds tokens and
# position_ids and no logits; the last stage labels, loss_mask and the logits.
file(REMOVE_RECURSE ${WORK_DIR}/profile_pp)
execute_process(COMMAND ${THDPACK} run --dp 1 --cp 2 --pp 2 --global-batch 16 --steps 1
                --mock-samples 40 --memory-profile-steps 0
                --memory-profile-dir ${WORK_DIR}/profile_pp
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "run --pp 2 with a memory profile: ${rc} ${err}")
endif()
file(GLOB_RECURSE files RELATIVE ${WORK_DIR}/profile_pp ${WORK_DIR}/profile_pp/*)
list(SORT files)
if(NOT files STREQUAL "step_0/rank0_pp0_dp0_cp0_tp0.json;step_0/rank1_pp0_dp0_cp1_tp0.json;step_0/rank2_pp1_dp0_cp0_tp0.json;step_0/rank3_pp1_dp0_cp1_tp0.json")
  message(FATAL_ERROR "PP = 2 profile files: ${files}")
endif()
file(READ ${WORK_DIR}/profile_pp/step_0/rank1_pp0_dp0_cp1_tp0.json first_stage)
file(READ ${WORK_DIR}/profile_pp/step_0/rank3_pp1_dp0_cp1_tp0.json last_stage)
string(JSON labels GET "${first_stage}" held_bytes labels)
string(JSON tokens GET "${first_stage}" held_bytes tokens)
string(JSON logits TYPE "${first_stage}" logits)
if(NOT labels EQUAL 0 OR NOT tokens GREATER 0 OR NOT logits STREQUAL "NULL")
  message(FATAL_ERROR "first stage: labels ${labels}, tokens ${tokens}, logits ${logits}")
endif()
string(JSON labels GET "${last_stage}" held_bytes labels)
string(JSON position_ids GET "${last_stage}" held_bytes position_ids)
string(JSON logits TYPE "${last_stage}" logits)
if(NOT labels EQUAL tokens OR NOT position_ids EQUAL 0 OR NOT logits STREQUAL "OBJECT")
  message(FATAL_ERROR "last stage: labels ${labels}, position_ids ${position_ids}, logits ${logits}")
endif()

# The table form.
execute_process(COMMAND ${THDPACK} run --tp 2 --cp 2 --dp 2 --global-batch 16 --steps 1
                --mock-samples 40 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "^step 0 \\(epoch 0\\): 16 samples -> ([0-9]+) (microbatch|microbatches) x 2 replicas")
  message(FATAL_ERROR "table form: rc=${rc}\n${out}\n${err}")
endif()
# Plurals agree with the count ("1 microbatch", "2 microbatches"), and the bytes are in MiB/KiB.
set(word "${CMAKE_MATCH_2}")
set(want microbatches)
if(CMAKE_MATCH_1 EQUAL 1)
  set(want microbatch)
endif()
if(NOT word STREQUAL want OR NOT out MATCHES "sent [0-9.]+ (B|KiB|MiB|GiB) max/rank")
  message(FATAL_ERROR "table form: plural or unit: ${out}")
endif()
# Then plan's summary block, the same lines as `plan` prints for the same options.
execute_process(COMMAND ${THDPACK} plan --tp 2 --cp 2 --dp 2 --global-batch 16 --steps 1
                --mock-samples 40 RESULT_VARIABLE rc OUTPUT_VARIABLE plan_out ERROR_VARIABLE err)
string(FIND "${plan_out}" "\nsummary over" at)
string(SUBSTRING "${plan_out}" ${at} -1 plan_summary)
string(FIND "${out}" "${plan_summary}" found)
if(at EQUAL -1 OR found EQUAL -1 OR NOT out MATCHES "\n  step time  +[0-9.]+ ms in all")
  message(FATAL_ERROR "run does not end with plan's summary block:\n${out}\n---\n${plan_summary}")
endif()

# Errors: a bad argument, and a sample over the budget (exit 2 as in plan: bad input, the
# failing loader named; docs/errors.md).
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
execute_process(COMMAND ${THDPACK} run --dp 2 --cp 1 --tp 2 --max-tokens-per-rank 2000
                --global-batch 64 RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_VARIABLE out)
if(NOT rc EQUAL 2 OR NOT err MATCHES "over the microbatch budget")
  message(FATAL_ERROR "expected a budget error: rc=${rc} ${err}")
endif()
execute_process(COMMAND ${THDPACK} run --memory-profile-steps 0,x RESULT_VARIABLE rc
                ERROR_VARIABLE err OUTPUT_VARIABLE out)
if(rc EQUAL 0 OR NOT err MATCHES "--memory-profile-steps: \"0,x\"")
  message(FATAL_ERROR "expected an error for --memory-profile-steps 0,x: rc=${rc} ${err}")
endif()
execute_process(COMMAND ${THDPACK} run --steps 2 --memory-profile-steps 2 RESULT_VARIABLE rc
                ERROR_VARIABLE err OUTPUT_VARIABLE out)
if(rc EQUAL 0 OR NOT err MATCHES "--memory-profile-steps: step 2 is not run")
  message(FATAL_ERROR "expected an error for a step past --steps: rc=${rc} ${err}")
endif()
execute_process(COMMAND ${THDPACK} run --logits-dtype fp16 RESULT_VARIABLE rc
                ERROR_VARIABLE err OUTPUT_VARIABLE out)
if(rc EQUAL 0 OR NOT err MATCHES "--logits-dtype")
  message(FATAL_ERROR "expected an error for --logits-dtype fp16: rc=${rc} ${err}")
endif()
# A profile folder that cannot be made (a file is in the way): every rank stops, the path named.
file(WRITE ${WORK_DIR}/not_a_folder "x")
# A path that cannot be used is bad input: exit 2 (docs/errors.md).
execute_process(COMMAND ${THDPACK} run --dp 1 --cp 1 --tp 2 --steps 1 --memory-profile-steps 0
                --memory-profile-dir ${WORK_DIR}/not_a_folder RESULT_VARIABLE rc
                ERROR_VARIABLE err OUTPUT_VARIABLE out)
if(NOT rc EQUAL 2 OR NOT err MATCHES "--memory-profile-dir: .*not_a_folder/step_0")
  message(FATAL_ERROR "expected an error naming the profile folder: rc=${rc} ${err}")
endif()
message(STATUS "thdpack run: all checks passed")
