# The map of areas: the one table of what each area of the library may use.
#
# Read by CMakeLists.txt (one OBJECT library per area, linked only to its arrows) and by
# cmake/check_areas.cmake (the include check run by the build and by ctest `areas.check`).
# docs/architecture.md describes each area and must be kept true to this table.
#
#   thdpack_area(<area> [DEPS <area>...] [HEADERS <header>...] [LIBS <target>...] [SHARED])
#     <area>   the folder src/<area>/; every folder under src/ must be declared here.
#     DEPS     the arrows: the areas <area> uses directly. An arrow points up the table only (to
#              an area declared above), so the map has no cycles. An area may use every area
#              its arrows reach (transitively), and nothing else.
#     HEADERS  the public headers (include/thdpack/<header>) <area> owns; every public header
#              has exactly one owner.
#     LIBS     third-party targets its sources need (linked privately, build tree only).
#     SHARED   its private headers (src/<area>/*.h) may be included by every area that may use
#              it; other areas' private headers are for their own area only.
#   thdpack_umbrella(<header>...)   public headers that may include every public header.
#   thdpack_consumer(<folder>...)   folders that may include public headers only.
#
# Adding an area or an arrow is one line here. Tests beside the code (src/<area>/*_test.cc)
# may use what their area may use, plus the test utilities (tests/*.h and *_test_util.h of
# the areas they may use). bench/, tests/ and fuzz/ are not checked: they may include anything.

thdpack_area(common   HEADERS status.h sample.h version.h parallel_layout.h SHARED)
thdpack_area(topology DEPS common HEADERS topology.h)
thdpack_area(comm     DEPS common HEADERS comm.h comm_checks.h)
thdpack_area(data     DEPS common HEADERS data.h megatron_dataset.h blend.h arrow.h
             LIBS nlohmann_json::nlohmann_json)
thdpack_area(cost     DEPS common HEADERS cost.h profile.h LIBS nlohmann_json::nlohmann_json)
thdpack_area(shard    DEPS common HEADERS shard.h)
thdpack_area(kernels  DEPS common HEADERS cuda_loss.h)
thdpack_area(wire     DEPS data HEADERS wire.h step_wire.h)
thdpack_area(schedule DEPS data cost HEADERS schedule.h)
thdpack_area(pack     DEPS shard HEADERS pack.h fields.h columns.h)
thdpack_area(loss     DEPS pack shard HEADERS loss.h memory.h)
thdpack_area(media    DEPS pack shard cost data HEADERS media.h)
thdpack_area(step     DEPS data schedule HEADERS step.h figures.h run_state.h LIBS nlohmann_json::nlohmann_json)
thdpack_area(runtime  DEPS comm topology schedule pack shard wire step loss media
                      HEADERS rank_step.h step_runner.h memory_report.h LIBS nlohmann_json::nlohmann_json)
thdpack_area(probe    DEPS runtime loss shard comm data topology HEADERS probe.h)
thdpack_area(job      DEPS probe runtime step schedule cost data comm topology HEADERS job.h)

thdpack_umbrella(thdpack.h)
thdpack_consumer(tools python/src)
