# Run by CTest with -DTHDPACK=<thdpack binary> -DWORK_DIR=<scratch folder>: checks `thdpack plan`
# as a user sees it. Every expected figure is worked out by hand in the comments.

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
file(WRITE "${WORK_DIR}/four.txt" "3\n5\n2\n6\n")
file(WRITE "${WORK_DIR}/five.txt" "3\n5\n2\n6\n40\n")

function(run_plan out_var)
  execute_process(COMMAND ${THDPACK} plan ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "thdpack plan ${ARGN} failed (${rc}): ${err}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

# Expects a nonzero exit and every remaining argument after `--expect` in stderr.
function(expect_error)
  cmake_parse_arguments(E "" "" "ARGS;EXPECT" ${ARGN})
  execute_process(COMMAND ${THDPACK} plan ${E_ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "thdpack plan ${E_ARGS} should fail; printed: ${out}")
  endif()
  foreach(part IN LISTS E_EXPECT)
    string(FIND "${err}" "${part}" pos)
    if(pos EQUAL -1)
      message(FATAL_ERROR "thdpack plan ${E_ARGS}: message lacks \"${part}\": ${err}")
    endif()
  endforeach()
endfunction()

function(expect_json json expected)
  string(JSON got GET "${json}" ${ARGN})
  string(REGEX REPLACE "[ \n]" "" got "${got}")
  if(NOT got STREQUAL "${expected}")
    message(FATAL_ERROR "${ARGN}: expected ${expected}, got ${got}\nin ${json}")
  endif()
endfunction()

# Lengths 3, 5, 2, 6 (ids 0..3, loss tokens L - 1 = 12 in all) at DP=2, CP=2: padded to
# multiples of 2*CP = 4 -> 4, 8, 4, 8 (24 padded tokens, sum P^2 = 160); a replica's microbatch
# holds CP * 8 = 16. Scheduling order: loader 0 reads ids 0, 2; loader 1 reads 1, 3 -> 0, 2, 1, 3.
# sequential (next-fit, capacity 16): [0, 2, 1] (4+4+8 = 16), then [3] (8); 2 groups = DP, so
# M = 1: replica 0 = [0, 2, 1] cost (16)/CP = 8 per rank, replica 1 = [3] cost 4. Lower bound
# max(24/2/2, 8/2) = 6: imbalance 8/6. pad_fraction 1 - 16/24, fill 24 / (1*2*2*8) = 0.75.
set(shape --data lengths:${WORK_DIR}/four.txt --dp 2 --cp 2 --max-tokens-per-rank 8
          --global-batch all --steps 1)
set(common ${shape} --cost tokens)
run_plan(j ${common} --scheduler sequential --json)
expect_json("${j}" 1 steps 0 num_microbatches)
expect_json("${j}" 4 steps 0 n_samples)
expect_json("${j}" 0 steps 0 n_skipped)
expect_json("${j}" 16 steps 0 real_tokens)
expect_json("${j}" 24 steps 0 padded_tokens)
expect_json("${j}" 160 steps 0 sum_sq)
expect_json("${j}" 12 steps 0 n_loss_tokens)
expect_json("${j}" 1.3333333333333333 steps 0 imbalance)
expect_json("${j}" 0.75 steps 0 fill)
string(JSON flops_type TYPE "${j}" steps 0 flops)
if(NOT flops_type STREQUAL "NULL")
  message(FATAL_ERROR "flops with the tokens cost: expected null, got ${flops_type}")
endif()
expect_json("${j}" [0,2,1] steps 0 replicas 0 microbatches 0 samples)
expect_json("${j}" 10 steps 0 replicas 0 microbatches 0 real_tokens)
expect_json("${j}" 16 steps 0 replicas 0 microbatches 0 padded_tokens)
expect_json("${j}" 8.0 steps 0 replicas 0 cost)
expect_json("${j}" [3] steps 0 replicas 1 microbatches 0 samples)
expect_json("${j}" 4.0 steps 0 replicas 1 cost)
expect_json("${j}" 1 summary n_steps)

# The same plan with --rank-multiple 8: T/CP a multiple of 8, so T a multiple of lcm(4, 16) =
# 16. Replica 0's [0, 2, 1] holds 16 already; replica 1's [3] (P = 8) takes an 8-token tail on
# its last (only) sequence: T = 16, P = 16. Padded 32, sum P^2 = 16+16+64 + 256 = 352, and the
# tail is charged: cost 16/CP = 8 on both replicas.
run_plan(j ${common} --scheduler sequential --rank-multiple 8 --json)
expect_json("${j}" [3] steps 0 replicas 1 microbatches 0 samples)
expect_json("${j}" 16 steps 0 replicas 1 microbatches 0 padded_tokens)
expect_json("${j}" 8.0 steps 0 replicas 1 cost)
expect_json("${j}" 32 steps 0 padded_tokens)
expect_json("${j}" 352 steps 0 sum_sq)
# blockwise (128) at CP 2 needs T a multiple of 256, over the budget of 16.
expect_error(ARGS ${common} --rank-multiple blockwise
             EXPECT "--max-tokens-per-rank: CP * max tokens per rank = 16 is below the token quantum 256")
expect_error(ARGS ${common} --rank-multiple 0
             EXPECT "--rank-multiple: rank multiple \"0\": expected fp8 (16)")

# balanced: the split 12 / 12 (P) exists ([0, 1] and [2, 3], or [0, 3] and [1, 2]): imbalance 1,
# still one microbatch, every id once.
run_plan(j ${common} --json --svg ${WORK_DIR}/plan.svg)
expect_json("${j}" 1.0 steps 0 imbalance)
expect_json("${j}" 1 steps 0 num_microbatches)
expect_json("${j}" 6.0 steps 0 replicas 0 cost)
expect_json("${j}" 6.0 steps 0 replicas 1 cost)
string(JSON a GET "${j}" steps 0 replicas 0 microbatches 0 samples)
string(JSON b GET "${j}" steps 0 replicas 1 microbatches 0 samples)
string(REGEX MATCHALL "[0-9]+" ids "${a} ${b}")
list(SORT ids)
if(NOT ids STREQUAL "0;1;2;3")
  message(FATAL_ERROR "balanced plan does not hold every id once: ${a} ${b}")
endif()

# The chart: a well-formed SVG with one <rect class="mb"> per (replica, microbatch) = 2.
file(READ "${WORK_DIR}/plan.svg" svg)
string(FIND "${svg}" "<svg xmlns=\"http://www.w3.org/2000/svg\"" pos)
if(pos EQUAL -1)
  message(FATAL_ERROR "no <svg> root in plan.svg")
endif()
string(FIND "${svg}" "</svg>" pos)
if(pos EQUAL -1)
  message(FATAL_ERROR "plan.svg is not closed")
endif()
string(REGEX MATCHALL "<rect class=\"mb\"" rects "${svg}")
list(LENGTH rects n)
if(NOT n EQUAL 2)
  message(FATAL_ERROR "expected 2 microbatch rects, got ${n}")
endif()
foreach(word "lower bound" "DP replica" "cost per rank" "microbatch")
  string(FIND "${svg}" "${word}" pos)
  if(pos EQUAL -1)
    message(FATAL_ERROR "plan.svg lacks the label \"${word}\"")
  endif()
endforeach()
find_program(XMLLINT xmllint)
if(XMLLINT)
  execute_process(COMMAND ${XMLLINT} --noout "${WORK_DIR}/plan.svg" RESULT_VARIABLE rc
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "plan.svg is not well-formed XML: ${err}")
  endif()
endif()

# Steps and epochs: global batch 2 at DP=1 over 4 samples: steps read ids 0-1, 2-3, then the
# source wraps: ids 4-5 (lengths 3, 5 again) in epoch 1. Step 2: P 4 + 8 on one replica.
run_plan(j --data lengths:${WORK_DIR}/four.txt --dp 1 --cp 2 --max-tokens-per-rank 8
         --global-batch 2 --steps 3 --cost tokens --json)
expect_json("${j}" 0 steps 1 epoch)
expect_json("${j}" 1 steps 2 epoch)
expect_json("${j}" [4,5] steps 2 replicas 0 microbatches 0 samples)
expect_json("${j}" 12 steps 2 padded_tokens)
expect_json("${j}" 24 summary real_tokens)  # (3+5) + (2+6) + (3+5)

# Oversize: length 40 (id 4) exceeds 16. Default policy: an error naming the sample and the
# options to change. With skip, every epoch (global batch all, 2 steps) reports the skipped id:
# 4, then 9 (ids keep counting), and the four others are planned as above.
expect_error(ARGS --data lengths:${WORK_DIR}/five.txt --dp 2 --cp 2 --max-tokens-per-rank 8
                  --global-batch all
             EXPECT "sample id 4" "--max-tokens-per-rank" "--oversize skip")
run_plan(j --data lengths:${WORK_DIR}/five.txt --dp 2 --cp 2 --max-tokens-per-rank 8
         --global-batch all --steps 2 --oversize skip --cost tokens --json --summary-only)
expect_json("${j}" 1 steps 0 n_skipped)
expect_json("${j}" [4] steps 0 skipped)
expect_json("${j}" [9] steps 1 skipped)
expect_json("${j}" 1 steps 1 epoch)
expect_json("${j}" 24 steps 1 padded_tokens)
expect_json("${j}" 2 summary n_skipped)
expect_json("${j}" 8 summary n_samples)
string(FIND "${j}" "replicas" pos)
if(NOT pos EQUAL -1)
  message(FATAL_ERROR "--summary-only JSON still has replicas: ${j}")
endif()

# FLOPs with llama2-7b: 39642464256 per padded token + 786432 per squared padded token
# (docs/design.md section 3 with l=32, h=4096, f=11008, V=32000): 39642464256*24 + 786432*160.
run_plan(j ${shape} --cost llama2-7b --json --summary-only)
expect_json("${j}" 951544971264.0 steps 0 flops)

# The readable table and summary.
run_plan(t ${common} --scheduler sequential)
foreach(part "imbalance" "1.3333" "75.00" "summary over 1 step" "33.33%")
  string(FIND "${t}" "${part}" pos)
  if(pos EQUAL -1)
    message(FATAL_ERROR "table lacks \"${part}\":\n${t}")
  endif()
endforeach()
run_plan(t ${common} --summary-only)
string(FIND "${t}" "padded tokens" pos)
if(NOT pos EQUAL -1)
  message(FATAL_ERROR "--summary-only still prints the per-step table:\n${t}")
endif()

# The defaults run (built-in mock) and print 3 steps.
run_plan(j --json --summary-only)
expect_json("${j}" 3 summary n_steps)
expect_json("${j}" 768 summary n_samples)

# A JSONL source with a loss mask: sample 0 has tokens 1,2,3 and mask 0,1,1 (targets: tokens 1
# and 2, token 0 is never predicted) -> 2 loss tokens; sample 1 (no mask) has L - 1 = 1. Both fit
# one microbatch of 8 at DP=1: real 5, padded 5, sum_sq 9 + 4 = 13.
file(WRITE "${WORK_DIR}/two.jsonl"
  "{\"input_ids\":[1,2,3],\"loss_mask\":[0,1,1]}\n{\"input_ids\":[4,5]}\n")
run_plan(j --data jsonl:${WORK_DIR}/two.jsonl --dp 1 --cp 1 --max-tokens-per-rank 8
         --global-batch all --steps 1 --cost tokens --json)
expect_json("${j}" 3 steps 0 n_loss_tokens)
expect_json("${j}" 5 steps 0 real_tokens)
expect_json("${j}" 13 steps 0 sum_sq)
expect_json("${j}" [0,1] steps 0 replicas 0 microbatches 0 samples)

# Memory figures (docs/memory.md). One sequence of 131,072 tokens at CP = 2 fills one microbatch
# of 2 x 65,536 tokens (131072 is a multiple of 2*CP = 4: no padding). Logits of a last-stage
# rank, V = 151,936, bf16 (2 bytes): gathered over CP, T x V x 2 = 131072 x 151936 x 2 =
# 39,829,110,784 bytes = 37.09375 GiB; CP-local, T/2 x V x 2 = 19,914,555,392 = 18.546875 GiB.
# Buffers of the 65,536 local tokens: tokens, position_ids, labels 65536 x 4 = 262,144 each,
# loss_mask 65,536, metadata 2 arrays x 2 offsets x 4 = 16, loss outputs 65536 x 17 =
# 1,114,112: 1,966,096 bytes = 1.88 MiB.
file(WRITE "${WORK_DIR}/long.txt" "131072\n")
set(long --data lengths:${WORK_DIR}/long.txt --dp 1 --cp 2 --max-tokens-per-rank 65536
         --global-batch all --steps 1)
run_plan(t ${long} --vocab-size 151936 --logits-dtype bf16)
foreach(part "logits per rank    37.09 GiB gathered over CP, 18.55 GiB CP-local (largest microbatch T=131072, V=151936, bf16)"
             "buffers per rank   1.88 MiB held by thdpack (step 0, replica 0, 1 microbatch)")
  string(FIND "${t}" "${part}" pos)
  if(pos EQUAL -1)
    message(FATAL_ERROR "summary lacks \"${part}\":\n${t}")
  endif()
endforeach()
run_plan(j ${long} --vocab-size 151936 --logits-dtype bf16 --json)
expect_json("${j}" 39829110784 steps 0 memory logits gathered_bytes)
expect_json("${j}" 19914555392 steps 0 memory logits local_bytes)
expect_json("${j}" 0 steps 0 memory logits local_grad_bytes)
expect_json("${j}" 131072 steps 0 memory logits largest_microbatch_tokens)
expect_json("${j}" 151936 steps 0 memory logits vocab_size)
expect_json("${j}" bfloat16 steps 0 memory logits dtype)
expect_json("${j}" 2 steps 0 memory logits cp_size)
expect_json("${j}" 262144 steps 0 memory buffers_per_rank tokens)
expect_json("${j}" 65536 steps 0 memory buffers_per_rank loss_mask)
expect_json("${j}" 16 steps 0 memory buffers_per_rank metadata)
expect_json("${j}" 1114112 steps 0 memory buffers_per_rank loss_outputs)
expect_json("${j}" 1966096 steps 0 memory buffers_per_rank total)
# The standard keys come first, unchanged; memory right after replicas, the last of them.
# (CMake's JSON reader sorts members, so the order is checked on the text.)
string(FIND "${j}" "}]}],\"memory\":{\"logits\":{" pos)
if(pos EQUAL -1)
  message(FATAL_ERROR "memory does not follow replicas: ${j}")
endif()
# The fused gradient doubles the totals; fp32 doubles the bytes; vocab-parallel TP = 2 holds
# ceil(151936 / 2) = 75,968 columns: 65536 x 75968 x 2 = 9,957,277,696 CP-local.
run_plan(j ${long} --vocab-size 151936 --fused-grad --json)
expect_json("${j}" 39829110784 steps 0 memory logits local_total_bytes)
expect_json("${j}" 79658221568 steps 0 memory logits gathered_total_bytes)
run_plan(j ${long} --vocab-size 151936 --logits-dtype fp32 --json)
expect_json("${j}" 79658221568 steps 0 memory logits gathered_bytes)
run_plan(j ${long} --vocab-size 151936 --tp 2 --json)
expect_json("${j}" 9957277696 steps 0 memory logits local_bytes)
# V from the cost model: llama3-8b has 128,256 (131072/2 x 128256 x 2 = 16,810,770,432);
# dimensions give their v=; tokens has none (logits null, and the summary says so).
run_plan(j ${long} --cost llama3-8b --json)
expect_json("${j}" 128256 steps 0 memory logits vocab_size)
expect_json("${j}" 16810770432 steps 0 memory logits local_bytes)
run_plan(j ${long} --cost l=2,h=64,nh=4,nkv=4,f=128,v=1000 --json)
expect_json("${j}" 1000 steps 0 memory logits vocab_size)
run_plan(j ${long} --cost tokens --json)
string(JSON type TYPE "${j}" steps 0 memory logits)
if(NOT type STREQUAL "NULL")
  message(FATAL_ERROR "logits without a vocabulary: expected null, got ${type}")
endif()
run_plan(t ${long} --cost tokens)
string(FIND "${t}" "logits per rank    - (no vocabulary" pos)
if(pos EQUAL -1)
  message(FATAL_ERROR "summary without a vocabulary:\n${t}")
endif()

# Errors name the option.
expect_error(ARGS --logits-dtype fp16 EXPECT "--logits-dtype" "fp16")
expect_error(ARGS --vocab-size -1 EXPECT "--vocab-size")
expect_error(ARGS --data lengths:${WORK_DIR}/missing.txt EXPECT "--data" "missing.txt")
expect_error(ARGS --data bogus:x EXPECT "--data" "bogus:x")
expect_error(ARGS --cost bogus EXPECT "--cost" "bogus")
expect_error(ARGS --global-batch ten EXPECT "--global-batch" "ten")
expect_error(ARGS --global-batch 3 EXPECT "too few samples" "--global-batch")
expect_error(ARGS --max-tokens-per-rank 0 EXPECT "--max-tokens-per-rank")
expect_error(ARGS --dp 0 EXPECT "--dp")
expect_error(ARGS --scheduler fastest EXPECT "--scheduler" "fastest")
expect_error(ARGS --oversize drop EXPECT "--oversize" "drop")
expect_error(ARGS --steps 0 EXPECT "--steps")
expect_error(ARGS --microbatch-multiple 2 --num-microbatches 3 EXPECT "--num-microbatches")
expect_error(ARGS --svg ${WORK_DIR}/no/such/dir/x.svg EXPECT "--svg")

# The step-time model (docs/scheduling.md). Lengths 3, 5, 2, 6 as above, sequential plan:
# replica 0 = [0, 2, 1] with P = 4, 4, 8 and replica 1 = [3] with P = 8, CP = 2. Model
# l=2,h=8,nh=2,nkv=1,f=16,v=10 (a = 7392, b = 96, K+V bytes a token 2*4*8*1/2 = 32) on
# R = 1000, B = 10: t(4, 2) = max((7392*4 + 96*16)/2000, 3*1/2*4*32/10) = max(15.552, 19.2)
# = 19.2; t(8, 2) = max(65280/2000, 38.4) = 38.4. Replica 0: 19.2 + 19.2 + 38.4 = 76.8, replica
# 1: 38.4; the step: 76.8.
set(small_model --cost l=2,h=8,nh=2,nkv=1,f=16,v=10 --hw 1000,10)
run_plan(j ${shape} ${small_model} --scheduler sequential --json)
# (plan prints 76.8; CMake's JSON reader renders that double with 17 digits.)
expect_json("${j}" 76.799999999999997 steps 0 sim_step_time)
expect_json("${j}" 76.799999999999997 summary sim_step_time)
run_plan(j ${common} --json)
foreach(where "steps;0" "summary")
  string(JSON type TYPE "${j}" ${where} sim_step_time)
  if(NOT type STREQUAL "NULL")
    message(FATAL_ERROR "sim_step_time with --cost tokens (${where}): expected null, got ${type}")
  endif()
endforeach()
run_plan(t ${shape} ${small_model} --scheduler sequential)
string(FIND "${t}" "76.8" pos)
if(pos EQUAL -1)
  message(FATAL_ERROR "the table lacks the modelled step time 76.8:\n${t}")
endif()

# The dynamic scheduler on lengths 3, 5, 2, 6, 40 over D = 2*2 = 4 ranks of 16 tokens: the
# 40-token sequence needs a group of at least 3 ranks (padded to 42 <= 48 on 3, 40 > 32 on 2);
# every sample is planned once, and the groups are in the JSON.
set(dyn --data lengths:${WORK_DIR}/five.txt --dp 2 --cp 2 --max-tokens-per-rank 16
        --global-batch all --steps 1 ${small_model} --scheduler dynamic)
run_plan(j ${dyn} --json)
expect_json("${j}" 5 steps 0 n_samples)
expect_json("${j}" 0 steps 0 n_skipped)
string(JSON n_mb LENGTH "${j}" steps 0 groups)
set(seen "")
math(EXPR last_mb "${n_mb} - 1")
foreach(m RANGE ${last_mb})
  string(JSON n_g LENGTH "${j}" steps 0 groups ${m})
  if(n_g EQUAL 0)
    continue()
  endif()
  math(EXPR last_g "${n_g} - 1")
  foreach(g RANGE ${last_g})
    string(JSON ranks GET "${j}" steps 0 groups ${m} ${g} ranks)
    string(JSON n_r LENGTH "${j}" steps 0 groups ${m} ${g} ranks)
    string(JSON n_s LENGTH "${j}" steps 0 groups ${m} ${g} samples)
    math(EXPR last_s "${n_s} - 1")
    foreach(s RANGE ${last_s})
      string(JSON id GET "${j}" steps 0 groups ${m} ${g} samples ${s})
      list(APPEND seen ${id})
      if(id EQUAL 4 AND n_r LESS 3)
        message(FATAL_ERROR "sample 4 (40 tokens) on ${n_r} ranks ${ranks}:\n${j}")
      endif()
    endforeach()
  endforeach()
endforeach()
list(SORT seen)
if(NOT seen STREQUAL "0;1;2;3;4")
  message(FATAL_ERROR "dynamic plan: samples ${seen}, expected each of 0..4 once:\n${j}")
endif()
string(JSON t_type TYPE "${j}" steps 0 sim_step_time)
if(NOT t_type STREQUAL "NUMBER")
  message(FATAL_ERROR "dynamic plan: sim_step_time is ${t_type}")
endif()
string(JSON n_ranks LENGTH "${j}" steps 0 replicas)
if(NOT n_ranks EQUAL 4)
  message(FATAL_ERROR "dynamic plan: ${n_ranks} rank entries, expected D = 4")
endif()
run_plan(t ${dyn} --svg ${WORK_DIR}/dynamic.svg)
string(FIND "${t}" "CP degree:sequences" pos)
if(pos EQUAL -1)
  message(FATAL_ERROR "dynamic table lacks the CP-degree histogram:\n${t}")
endif()
file(READ ${WORK_DIR}/dynamic.svg svg)
string(FIND "${svg}" "class=\"group\"" pos)
if(pos EQUAL -1)
  message(FATAL_ERROR "dynamic SVG draws no group")
endif()
expect_error(ARGS ${shape} --cost tokens --scheduler dynamic EXPECT "--scheduler" "model --cost")
expect_error(ARGS --hw fast EXPECT "--hw" "fast")
expect_error(ARGS --cp-sizes odd EXPECT "--cp-sizes" "odd")
expect_error(ARGS --data lengths:${WORK_DIR}/five.txt --dp 2 --cp 2 --max-tokens-per-rank 8
             --global-batch all --steps 1 ${small_model} --scheduler dynamic
             EXPECT "sample id 4" "oversize")

# Ranks idle in a microbatch: 40 tokens need all 4 ranks of 12 (padded to 40 <= 48), and the
# two 1-token sequences then leave ranks without work; the memory figures skip those.
file(WRITE "${WORK_DIR}/idle.txt" "40\n1\n1\n")
run_plan(j --data lengths:${WORK_DIR}/idle.txt --dp 4 --cp 1 --max-tokens-per-rank 12
         --global-batch all --steps 1 ${small_model} --scheduler dynamic --json)
expect_json("${j}" 3 steps 0 n_samples)
expect_json("${j}" "{\"1\":2,\"4\":1}" steps 0 cp_degrees)
