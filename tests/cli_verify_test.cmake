# Run by CTest with -DTHDPACK=<thdpack> -DJSON_CLOSE=<thdpack_json_close> -DWORK_DIR=<dir>
# [-DMPIEXEC=<mpirun>]: `thdpack run --verify --json` gives the same loss, ppl, entropy and token
# counts (relative difference below 1e-9) at every topology as on one rank, on the thread
# backend and under mpirun. Each run also checks itself against a single-rank computation of
# the same global batch (the run fails otherwise); this test compares the runs with each other.

cmake_minimum_required(VERSION 3.20)
file(MAKE_DIRECTORY ${WORK_DIR})

# 40 JSON-lines samples, lengths 2..91, tokens from arithmetic, a prompt mask on every third.
set(text "")
foreach(i RANGE 0 39)
  math(EXPR len "(${i} * 37) % 90 + 2")
  math(EXPR last "${len} - 1")
  set(ids "")
  set(mask "")
  math(EXPR prompt "${len} / 3")
  foreach(j RANGE 0 ${last})
    math(EXPR t "(${i} * 131 + ${j} * 17 + (${j} * ${j}) % 7) % 1000")
    if(j LESS prompt)
      set(m 0)
    else()
      set(m 1)
    endif()
    if(j EQUAL 0)
      set(ids "${t}")
      set(mask "${m}")
    else()
      string(APPEND ids ",${t}")
      string(APPEND mask ",${m}")
    endif()
  endforeach()
  math(EXPR third "${i} % 3")
  if(third EQUAL 1)
    string(APPEND text "{\"input_ids\":[${ids}],\"loss_mask\":[${mask}]}\n")
  else()
    string(APPEND text "{\"input_ids\":[${ids}]}\n")
  endif()
endforeach()
file(WRITE ${WORK_DIR}/verify.jsonl "${text}")

set(common --data jsonl:${WORK_DIR}/verify.jsonl --global-batch 16 --steps 3
           --max-tokens-per-rank 256 --verify --json --summary-only)
set(keys loss,ppl,entropy,n_tokens,n_loss_tokens,real_tokens)

function(verify_run name)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name}: ${ARGN}\nfailed (${rc}): ${err}")
  endif()
  if(NOT out MATCHES "\"loss\":" OR NOT out MATCHES "\"ppl\":[0-9]")
    message(FATAL_ERROR "${name}: no loss or ppl in the output:\n${out}")
  endif()
  file(WRITE ${WORK_DIR}/${name}.json "${out}")
endfunction()

function(expect_close name)
  execute_process(COMMAND ${JSON_CLOSE} 1e-9 ${keys} ${WORK_DIR}/one.json ${WORK_DIR}/${name}.json
                  RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name} differs from one rank:\n${err}")
  endif()
endfunction()

# One rank (run's default topology is plan's, DP=4 CP=2: one rank is asked for).
verify_run(one ${THDPACK} run --backend threads --dp 1 --cp 1 ${common})

# "tp,cp,dp,pp[,sp]"
foreach(topo "1,2,2,1" "2,2,2,1,sp" "1,1,2,4" "2,2,1,2")
  string(REPLACE "," ";" t "${topo}")
  list(GET t 0 tp)
  list(GET t 1 cp)
  list(GET t 2 dp)
  list(GET t 3 pp)
  set(args --tp ${tp} --cp ${cp} --dp ${dp} --pp ${pp})
  list(LENGTH t n)
  if(n EQUAL 5)
    list(APPEND args --sp)
  endif()
  string(REPLACE "," "_" name "${topo}")
  math(EXPR world "${tp} * ${cp} * ${dp} * ${pp}")
  verify_run(threads_${name} ${THDPACK} run --backend threads ${args} ${common})
  expect_close(threads_${name})
  verify_run(threads_all_${name} ${THDPACK} run --backend threads ${args} ${common} --data-on all)
  expect_close(threads_all_${name})
  if(MPIEXEC)
    verify_run(mpi_${name} ${MPIEXEC} --allow-run-as-root --oversubscribe --mca btl self,vader
               -np ${world} ${THDPACK} run --backend mpi ${args} ${common})
    expect_close(mpi_${name})
  endif()
endforeach()

# --scheduler dynamic through the command line (the five topologies of the issue run in one
# process on threads, tests/dynamic_step_test.cc, and in one mpirun, tests/mpi_check.cc): a
# domain of 6 ranks, the same figures as one rank, groups made once and reused.
verify_run(threads_dynamic ${THDPACK} run --backend threads --tp 1 --cp 3 --dp 2 --pp 1
           --scheduler dynamic ${common})
expect_close(threads_dynamic)
file(READ ${WORK_DIR}/threads_dynamic.json dyn)
if(NOT dyn MATCHES "\"groups_made\":[1-9]" OR NOT dyn MATCHES "\"groups_reused\":[1-9]")
  message(FATAL_ERROR "dynamic run: no groups made or reused:\n${dyn}")
endif()

# A rank multiple (--rank-multiple, docs/layout.md): more padding on each microbatch's last
# sequence, the same loss and token counts as one rank without it, on static CP, CP with SP
# (the multiple per TP rank) and dynamic groups; under mpirun too.
foreach(case "fp8;--tp;1;--cp;2;--dp;2" "mxfp8;--tp;2;--cp;2;--dp;2;--sp"
        "24;--tp;1;--cp;3;--dp;2;--scheduler;dynamic")
  list(POP_FRONT case r)
  verify_run(rank_${r} ${THDPACK} run --backend threads ${case} --rank-multiple ${r} ${common})
  expect_close(rank_${r})
  file(READ ${WORK_DIR}/rank_${r}.json got)
  file(READ ${WORK_DIR}/one.json base)
  string(REGEX MATCH "\"padded_tokens\":[0-9]+" got_padded "${got}")
  string(REGEX MATCH "\"padded_tokens\":[0-9]+" base_padded "${base}")
  if(got_padded STREQUAL base_padded)
    message(FATAL_ERROR "--rank-multiple ${r}: padded tokens unchanged (${got_padded})")
  endif()
endforeach()
if(MPIEXEC)
  verify_run(mpi_rank ${MPIEXEC} --allow-run-as-root --oversubscribe --mca btl self,vader
             -np 8 ${THDPACK} run --backend mpi --tp 2 --cp 2 --dp 2 --sp --rank-multiple 16
             ${common})
  expect_close(mpi_rank)
endif()

# Static shapes (--pad-to-max-tokens, --max-seqs-per-microbatch): every microbatch holds
# CP * 256 tokens and at most 3 sequences, the loss and token counts still those of one rank
# (the probe reads the fixed tail as padding), at DP, CP with SP and TP x CP x PP.
foreach(case "static_dp;--dp;2" "static_sp;--tp;2;--cp;2;--dp;2;--sp"
        "static_pp;--tp;2;--cp;2;--pp;2")
  list(POP_FRONT case name)
  verify_run(${name} ${THDPACK} run --backend threads ${case} ${common} --pad-to-max-tokens
             --max-seqs-per-microbatch 3)
  expect_close(${name})
  file(READ ${WORK_DIR}/${name}.json got)
  if(NOT got MATCHES "\"pad_fraction\":0\.[5-9]")
    message(FATAL_ERROR "${name}: the fixed shapes' padding is not in the figures:\n${got}")
  endif()
endforeach()

# --oversize split: samples over 64 tokens are cut into pieces of 64 as they are read (each a
# sample of the stream); each run checks itself against the plain reader's own split, two
# topologies with the same longest piece (CP x max tokens per rank = 64) give the same figures,
# and the cuts are in the figures.
set(split_args --data jsonl:${WORK_DIR}/verify.jsonl --global-batch 16 --steps 3 --verify --json
               --summary-only --oversize split)
verify_run(split_one ${THDPACK} run --backend threads --dp 1 --cp 1 --max-tokens-per-rank 64
           ${split_args})
verify_run(split_sp ${THDPACK} run --backend threads --tp 2 --cp 2 --dp 2 --sp
           --max-tokens-per-rank 32 ${split_args})
execute_process(COMMAND ${JSON_CLOSE} 1e-9 ${keys} ${WORK_DIR}/split_one.json
                ${WORK_DIR}/split_sp.json RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "split runs differ between topologies:\n${err}")
endif()
file(READ ${WORK_DIR}/split_sp.json got)
if(NOT got MATCHES "\"n_split\":[1-9]" OR NOT got MATCHES "\"split_lost_targets\":[1-9]")
  message(FATAL_ERROR "split run: no cut in the figures:\n${got}")
endif()

# Token steps with a budget B = 150 below what DP x k microbatches need (design.md section 2):
# each step takes one sample for every microbatch of every replica, past B where needed, and
# still checks itself against the plain reader's rule. DP 2 x k 2 = 4 samples at least a step;
# DP 2 x M 4 = 8.
foreach(case "4;--microbatch-multiple;2" "8;--num-microbatches;4")
  list(POP_FRONT case least)
  execute_process(COMMAND ${THDPACK} run --backend threads --tp 1 --cp 2 --dp 2 --pp 2 ${case}
                  --data jsonl:${WORK_DIR}/verify.jsonl --global-batch-tokens 150 --steps 4
                  --max-tokens-per-rank 256 --verify --json --summary-only
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "token steps (${case}) failed (${rc}): ${err}")
  endif()
  string(REGEX MATCHALL "\"n_samples\":[0-9]+" counts "${out}")
  list(LENGTH counts n)
  if(NOT n EQUAL 4)  # one JSON line a step
    message(FATAL_ERROR "token steps (${case}): expected 4 steps:\n${out}")
  endif()
  foreach(c IN LISTS counts)
    string(REGEX REPLACE ".*:" "" c "${c}")
    if(c LESS least)
      message(FATAL_ERROR "token steps (${case}): a step of ${c} samples, fewer than ${least}")
    endif()
  endforeach()
  if(NOT out MATCHES "\"real_tokens\":(1[5-9][1-9]|[2-9][0-9][0-9]),")
    message(FATAL_ERROR "token steps (${case}): no step past B = 150:\n${out}")
  endif()
endforeach()

# The comparison itself can fail: another probe model gives other figures.
verify_run(other ${THDPACK} run --backend threads --dp 1 --cp 1 ${common} --probe-vocab 255)
execute_process(COMMAND ${JSON_CLOSE} 1e-9 ${keys} ${WORK_DIR}/one.json ${WORK_DIR}/other.json
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "json_close found no difference between two probe models")
endif()

# Bad probe options are clear errors.
execute_process(COMMAND ${THDPACK} run --verify --probe-hidden 30 --probe-heads 4
                RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_VARIABLE out)
if(NOT rc EQUAL 2 OR NOT err MATCHES "hidden = 30")
  message(FATAL_ERROR "expected an error for --probe-hidden 30: rc=${rc} ${err}")
endif()
message(STATUS "thdpack run --verify: all checks passed")

# --rank-order: another layout of ranks (DP fastest, then PP, TP, CP; and CP, DP, TP, PP), the
# same figures as one rank, static and dynamic, on threads and under mpirun.
foreach(case "dp-pp-tp-cp;--tp;2;--cp;2;--dp;2;--sp" "cp-dp-tp-pp;--tp;1;--cp;2;--dp;2;--pp;2"
        "dp-cp-tp-pp;--tp;1;--cp;3;--dp;2;--scheduler;dynamic")
  list(POP_FRONT case order)
  string(REPLACE "-" "_" name "${order}")
  verify_run(order_${name} ${THDPACK} run --backend threads ${case} --rank-order ${order} ${common})
  expect_close(order_${name})
endforeach()
if(MPIEXEC)
  verify_run(mpi_order ${MPIEXEC} --allow-run-as-root --oversubscribe --mca btl self,vader
             -np 8 ${THDPACK} run --backend mpi --tp 2 --cp 2 --dp 2 --rank-order dp-tp-cp-pp
             ${common})
  expect_close(mpi_order)
endif()
