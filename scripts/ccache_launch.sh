#!/bin/sh
# The compiler launcher of the builds make test configures (C++ and CUDA): ccache, keyed by
# paths relative to this checkout, so that a clone in another folder (CI's) and a build folder
# beside build/ (the wheel's) hit what was compiled here. Without ccache, the compiler itself.
#   base_dir   absolute paths under the checkout are rewritten relative to the build folder
#   hash_dir   off: the build folder's absolute path is not part of the key (with -g1 the
#              object then names the folder of whichever build compiled it first)
#   sloppiness the precompiled headers (cmake's target_precompile_headers) are cacheable
# Usage (cmake): -DCMAKE_CXX_COMPILER_LAUNCHER=scripts/ccache_launch.sh
if command -v ccache >/dev/null 2>&1; then
  here=$(cd "${0%/*}/.." && pwd -P)
  CCACHE_BASEDIR=$here CCACHE_NOHASHDIR=1 \
    CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime} \
    exec ccache "$@"
fi
exec "$@"
