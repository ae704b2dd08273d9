# Run by CTest with -DTHDPACK=<thdpack binary> -DWORK_DIR=<scratch>: `thdpack calibrate` fits a
# profile from timings whose seconds are a known function of the lengths and writes it; `plan`
# and `run` take it as --cost profile:FILE and say the cost is measured; a plan without one says
# it is not; a missing, foreign or broken profile, and bad timings, are exit 2 naming the file.

cmake_minimum_required(VERSION 3.20)
file(MAKE_DIRECTORY ${WORK_DIR})

function(expect code pattern)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc STREQUAL "${code}")
    message(FATAL_ERROR "${ARGN}: exit ${rc}, expected ${code}\nstdout: ${out}\nstderr: ${err}")
  endif()
  if(NOT pattern STREQUAL "" AND NOT "${out}${err}" MATCHES "${pattern}")
    message(FATAL_ERROR "${ARGN}: output does not match \"${pattern}\":\n${out}\n${err}")
  endif()
  set(last_out "${out}" PARENT_SCOPE)
endfunction()

# Seconds = 2e-6 P + 4e-11 P^2 + 3e-5 per sequence, exactly (as 1e-12 units: 2e6 P + 40 P^2 + 3e7
# per sequence, printed with CMake's integer arithmetic), at T = 2048, 4096, 8192.
set(csv "seconds,lengths\n")
foreach(t 2048 4096 8192)
  math(EXPR half "${t} / 2")
  math(EXPR quarter "${t} / 4")
  math(EXPR eighth "${t} / 8")
  math(EXPR n_short "${t} / 256")
  set(short "")
  foreach(i RANGE 1 ${n_short})
    list(APPEND short 256)
  endforeach()
  math(EXPR n_half_short "${half} / 256")
  set(mixed ${half})
  foreach(i RANGE 1 ${n_half_short})
    list(APPEND mixed 256)
  endforeach()
  foreach(pack "${short}" "${t}" "${mixed}" "${quarter};${quarter};${quarter};${quarter}"
               "${half};${quarter};${eighth};${eighth}")
    set(ps 0)
    set(sq 0)
    set(n 0)
    foreach(p IN LISTS pack)
      math(EXPR ps "${ps} + ${p}")
      math(EXPR sq "${sq} + ${p} * ${p}")
      math(EXPR n "${n} + 1")
    endforeach()
    # picoseconds: 2e6 ps a token, 40 ps a squared token, 3e7 ps a sequence.
    math(EXPR ps_time "2000000 * ${ps} + 40 * ${sq} + 30000000 * ${n}")
    string(REPLACE ";" " " lengths "${pack}")
    string(APPEND csv "${ps_time}e-12,${lengths}\n")
  endforeach()
endforeach()
file(WRITE ${WORK_DIR}/timings.csv "${csv}")

expect(0 "a P \\+ b P\\^2 \\+ c +2\\.0000e-06 +4\\.0000e-11 +3\\.0000e-05"
       ${THDPACK} calibrate --timings ${WORK_DIR}/timings.csv --out ${WORK_DIR}/p.json
       --model llama2-7b --device "test device" --no-refine)
if(NOT last_out MATCHES "held-out microbatches" OR NOT last_out MATCHES "wrote ")
  message(FATAL_ERROR "calibrate printed no held-out report:\n${last_out}")
endif()
file(READ ${WORK_DIR}/p.json profile)
string(JSON format GET "${profile}" format)
string(JSON device GET "${profile}" measured_on device)
string(JSON n_held GET "${profile}" fit abc held_out n)
if(NOT format STREQUAL "thdpack-cost-profile" OR NOT device STREQUAL "test device" OR
   NOT n_held EQUAL 3)
  message(FATAL_ERROR "profile: format ${format}, device ${device}, held out ${n_held}:\n${profile}")
endif()

# plan and run with it: the cost is measured, in seconds; the imbalance says so.
set(job --global-batch 16 --steps 1 --mock-samples 32 --max-tokens-per-rank 8192 --dp 2 --cp 2)
expect(0 "cost measured: profile:.*p\\.json \\(test device\\), seconds"
       ${THDPACK} plan ${job} --cost profile:${WORK_DIR}/p.json)
expect(0 "lower bound; cost measured" ${THDPACK} run ${job} --cost profile:${WORK_DIR}/p.json)
expect(0 "cost from FLOPs \\(llama2-7b\\), not measured" ${THDPACK} plan ${job})
expect(0 "" ${THDPACK} plan ${job} --cost profile:${WORK_DIR}/p.json --scheduler dynamic --json)
# Read twice, the same plan (the file is the whole of it).
expect(0 "" ${THDPACK} plan ${job} --cost profile:${WORK_DIR}/p.json --json)
set(first "${last_out}")
expect(0 "" ${THDPACK} plan ${job} --cost profile:${WORK_DIR}/p.json --json)
if(NOT first STREQUAL last_out)
  message(FATAL_ERROR "two plans with one profile differ")
endif()
string(JSON t TYPE "${first}" steps 0 sim_step_time)
if(NOT t STREQUAL "NUMBER")
  message(FATAL_ERROR "a profile gives no modelled step time: ${t}")
endif()

# Bad profiles: exit 2, naming the file and the field.
file(WRITE ${WORK_DIR}/foreign.json "{\"format\": \"something\", \"a\": 1}")
expect(2 "--cost: .*foreign\\.json.*not a thdpack cost profile"
       ${THDPACK} plan ${job} --cost profile:${WORK_DIR}/foreign.json)
string(REPLACE "\"b\":" "\"bb\":" no_b "${profile}")
file(WRITE ${WORK_DIR}/no_b.json "${no_b}")
expect(2 "no_b\\.json: missing field \"b\"" ${THDPACK} plan ${job} --cost profile:${WORK_DIR}/no_b.json)
string(REGEX REPLACE "\"c\": [0-9.e+-]+" "\"c\": -1" negative "${profile}")
file(WRITE ${WORK_DIR}/negative.json "${negative}")
expect(2 "negative\\.json: field \"c\" = -1" ${THDPACK} run ${job} --cost profile:${WORK_DIR}/negative.json)
expect(2 "--cost: .*missing\\.json.*cannot open" ${THDPACK} plan ${job} --cost profile:${WORK_DIR}/missing.json)
# A free-text model: no dimensions for the dynamic scheduler's K/V exchange.
string(REPLACE "\"llama2-7b\"" "\"a layer\"" free "${profile}")
file(WRITE ${WORK_DIR}/free.json "${free}")
expect(2 "--scheduler: .*names no model with dimensions"
       ${THDPACK} plan ${job} --cost profile:${WORK_DIR}/free.json --scheduler dynamic)
expect(0 "" ${THDPACK} plan ${job} --cost profile:${WORK_DIR}/free.json)

# Bad timings: exit 2 naming the file and line.
file(WRITE ${WORK_DIR}/bad.csv "seconds,lengths\n0.1,256\n0.2,256 -4\n")
expect(2 "bad\\.csv:3: length \"-4\"" ${THDPACK} calibrate --timings ${WORK_DIR}/bad.csv --out ${WORK_DIR}/x.json)
file(WRITE ${WORK_DIR}/few.csv "seconds,lengths\n0.1,256\n0.2,512\n")
expect(2 "at least 4" ${THDPACK} calibrate --timings ${WORK_DIR}/few.csv --out ${WORK_DIR}/x.json)
expect(2 "" ${THDPACK} calibrate --out ${WORK_DIR}/x.json)
