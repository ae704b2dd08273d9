"""pytest setup: the module is imported from the build tree (PYTHONPATH=<build>/python, as
ctest sets it); a clear error otherwise instead of a confusing ImportError deep in a test."""
import atexit
import os
import shutil
import sys
import tempfile

# Decoded Parquet (thdpack/arrow.h, CachedParquet) goes to a folder of this session's, not the
# user's cache; the processes the tests spawn inherit it.
if not os.environ.get("THDPACK_CACHE"):
    os.environ["THDPACK_CACHE"] = tempfile.mkdtemp(prefix="thdpack-cache-")
    atexit.register(shutil.rmtree, os.environ["THDPACK_CACHE"], True)

try:
    import thdpack  # noqa: F401
except ImportError as e:  # pragma: no cover
    raise SystemExit(f"cannot import thdpack ({e}); run with PYTHONPATH=<build>/python "
                     f"(sys.executable={sys.executable}, PYTHONPATH={os.environ.get('PYTHONPATH')})")


def pytest_configure(config):
    config.addinivalue_line("markers", "no_sanitizer: a larger spawned world of a distributed "
                            "path that a smaller world of the same test runs under ASan + UBSan; "
                            "the sanitized suite leaves it out (-m 'not no_sanitizer', "
                            "docs/testing.md), the two uninstrumented suites run it")
    # pytest-xdist's own marker, declared here too so that the suite runs without xdist.
    config.addinivalue_line("markers", "xdist_group(name): tests that share a module's "
                            "fixture run in one pytest-xdist worker (--dist loadgroup)")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped where torch sees none)")
    config.addinivalue_line("markers", "one_read: the one-read CUDA kernel (thread-block "
                            "clusters); scripts/device_check.sh runs these in a process of their "
                            "own, after the other cuda tests")
