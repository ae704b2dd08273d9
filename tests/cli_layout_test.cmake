# Run by CTest with -DTHDPACK=<path to the thdpack binary>: checks `thdpack layout` as a user
# sees it. Expected indices are worked out by hand from the zigzag rule (docs/design.md section 5).

function(run_layout out_var)
  execute_process(COMMAND ${THDPACK} layout ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "thdpack layout ${ARGN} failed (${rc}): ${err}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

function(expect_json json path expected)
  string(JSON got GET "${json}" ${path})
  if(NOT got STREQUAL expected)
    message(FATAL_ERROR "${path}: expected ${expected}, got ${got}\nin ${json}")
  endif()
endfunction()

function(expect_rank json i cp tp indices)
  expect_json("${json}" "ranks;${i};cp_rank" ${cp})
  expect_json("${json}" "ranks;${i};tp_rank" ${tp})
  string(JSON got GET "${json}" ranks ${i} indices)
  string(REGEX REPLACE "[ \n]" "" got "${got}")
  if(NOT got STREQUAL "${indices}")
    message(FATAL_ERROR "ranks[${i}] (cp ${cp}, tp ${tp}): expected ${indices}, got ${got}")
  endif()
endfunction()

function(expect_count json n)
  string(JSON len LENGTH "${json}" ranks)
  if(NOT len EQUAL n)
    message(FATAL_ERROR "expected ${n} ranks, got ${len}")
  endif()
endfunction()

# Lengths 7,3 at CP=2: padded to multiples of 4 -> 8, 4. Sequence 0 is cut into chunks of 2,
# sequence 1 (offset 8) into chunks of 1; rank r keeps chunks r and 3-r of each.
run_layout(j --lengths 7,3 --cp 2 --json)
string(JSON cu GET "${j}" cu_seqlens)
string(REGEX REPLACE "[ \n]" "" cu "${cu}")
if(NOT cu STREQUAL "[0,7,10]")
  message(FATAL_ERROR "cu_seqlens: ${cu}")
endif()
string(JSON cup GET "${j}" cu_seqlens_padded)
string(REGEX REPLACE "[ \n]" "" cup "${cup}")
if(NOT cup STREQUAL "[0,8,12]")
  message(FATAL_ERROR "cu_seqlens_padded: ${cup}")
endif()
expect_count("${j}" 2)
expect_rank("${j}" 0 0 0 "[0,1,6,7,8,11]")
expect_rank("${j}" 1 1 0 "[2,3,4,5,9,10]")

# With SP over TP=2: each CP shard (6 tokens) is cut into 2 contiguous parts of 3.
run_layout(j --lengths 7,3 --cp 2 --tp 2 --sp --json)
expect_count("${j}" 4)
expect_rank("${j}" 0 0 0 "[0,1,6]")
expect_rank("${j}" 1 0 1 "[7,8,11]")
expect_rank("${j}" 2 1 0 "[2,3,4]")
expect_rank("${j}" 3 1 1 "[5,9,10]")

# TP=4 with SP: T/CP must be a multiple of 4, so T goes from 12 to 16 and the last sequence
# absorbs the 4-token tail: cu_seqlens_padded [0,8,16], docs/design.md's first worked example.
run_layout(j --lengths 7,3 --cp 2 --tp 4 --sp --json)
string(JSON cup GET "${j}" cu_seqlens_padded)
string(REGEX REPLACE "[ \n]" "" cup "${cup}")
if(NOT cup STREQUAL "[0,8,16]")
  message(FATAL_ERROR "SP tail: cu_seqlens_padded ${cup}")
endif()
expect_count("${j}" 8)
expect_rank("${j}" 0 0 0 "[0,1]")
expect_rank("${j}" 1 0 1 "[6,7]")
expect_rank("${j}" 2 0 2 "[8,9]")
expect_rank("${j}" 3 0 3 "[14,15]")
expect_rank("${j}" 4 1 0 "[2,3]")
expect_rank("${j}" 7 1 3 "[12,13]")

# --rank-multiple 16 (the fp8 preset) at CP=2: T/CP must be a multiple of 16, so T goes from 12
# to 32 and only the last sequence grows (to 24, still 4 chunks of 6): every rank holds 16
# tokens, sequence 0 keeps its P = 8.
foreach(r 16 fp8)
  run_layout(j --lengths 7,3 --cp 2 --rank-multiple ${r} --json)
  string(JSON cup GET "${j}" cu_seqlens_padded)
  string(REGEX REPLACE "[ \n]" "" cup "${cup}")
  if(NOT cup STREQUAL "[0,8,32]")
    message(FATAL_ERROR "--rank-multiple ${r}: cu_seqlens_padded ${cup}")
  endif()
  expect_json("${j}" rank_multiple 16)
  expect_count("${j}" 2)
  expect_rank("${j}" 0 0 0 "[0,1,6,7,8,9,10,11,12,13,26,27,28,29,30,31]")
  expect_rank("${j}" 1 1 0 "[2,3,4,5,14,15,16,17,18,19,20,21,22,23,24,25]")
endforeach()
# With SP over TP=2 each TP rank's part is the multiple: T/(CP*TP) = 16, T = 64.
run_layout(j --lengths 7,3 --cp 2 --tp 2 --sp --rank-multiple 16 --json)
string(JSON cup GET "${j}" cu_seqlens_padded)
string(REGEX REPLACE "[ \n]" "" cup "${cup}")
if(NOT cup STREQUAL "[0,8,64]")
  message(FATAL_ERROR "--sp --rank-multiple 16: cu_seqlens_padded ${cup}")
endif()
execute_process(COMMAND ${THDPACK} layout --lengths 7,3 --cp 2 --rank-multiple fp9
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 2 OR NOT err MATCHES "--rank-multiple: rank multiple \"fp9\": expected fp8")
  message(FATAL_ERROR "--rank-multiple fp9: rc ${rc}, stderr ${err}")
endif()

# The readable table names the ranks and marks padding.
run_layout(text --lengths 7,3 --cp 2)
if(NOT text MATCHES "cp_rank 1 tp_rank 0: 6 tokens: 2-5 9-10")
  message(FATAL_ERROR "unexpected table:\n${text}")
endif()
if(NOT text MATCHES "seq 0  L=7 P=8  \\[0,8\\): 0 0 1 1 1 1 0 0\\*")
  message(FATAL_ERROR "unexpected strip:\n${text}")
endif()

# Bad input: a clear error naming the input, and a non-zero exit.
execute_process(COMMAND ${THDPACK} layout --lengths 7,0 --cp 2 RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "--lengths: item 1 \"0\" is not a positive integer")
  message(FATAL_ERROR "expected an error for --lengths 7,0, got rc=${rc} err=${err}")
endif()
execute_process(COMMAND ${THDPACK} layout --lengths 7,3 --cp 0 RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "cp")
  message(FATAL_ERROR "expected an error for --cp 0, got rc=${rc} err=${err}")
endif()
message(STATUS "thdpack layout: all checks passed")
