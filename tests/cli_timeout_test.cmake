# Run by CTest with -DMPI_CHECK=<thdpack_mpi_check> -DMPIRUN=<mpirun command, ;-separated, ending
# in the number of ranks>: the MPI collective timeout. In `thdpack_mpi_check --timeout-check`
# the last rank sleeps 60 s instead of calling an all-reduce that the others call with a 1 s
# timeout: a waiting rank must print the error naming the sleeper and end the job (MPI_Abort),
# so mpirun exits non-zero long before the sleeper wakes.

cmake_minimum_required(VERSION 3.20)
string(TIMESTAMP start "%s")
execute_process(COMMAND ${MPIRUN} ${MPI_CHECK} --timeout-check
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 50)
string(TIMESTAMP end "%s")
math(EXPR elapsed "${end} - ${start}")
if(rc EQUAL 0 OR rc MATCHES "timeout")
  message(FATAL_ERROR "mpirun exit ${rc} after ${elapsed} s: expected a non-zero exit, no hang\n${err}")
endif()
list(GET MPIRUN -1 np)
math(EXPR last "${np} - 1")
if(NOT err MATCHES "AllReduce on mpi group \\[[0-9,]+\\]: not complete after 1000 ms \\(the timeout\\): member ${last} \\(global rank ${last}\\)[^\n]* did not arrive")
  message(FATAL_ERROR "the timeout error does not name rank ${last}:\n${err}")
endif()
if(err MATCHES "the sleeper woke up|the all-reduce returned")
  message(FATAL_ERROR "the job was not ended by the timeout:\n${err}")
endif()
message(STATUS "MPI timeout: exit ${rc} after ${elapsed} s, the missing rank named")
