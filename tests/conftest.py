import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# the fp64 references (tests/gpu/ref_*.py) are shared by the GPU tests and their own CPU tests
GPU_TESTS = os.path.join(ROOT, "tests", "gpu")
UNIT_TESTS = os.path.join(ROOT, "tests", "unit")  # the stand-in driver (stand_in.py)
if UNIT_TESTS not in sys.path:
    sys.path.insert(0, UNIT_TESTS)
if GPU_TESTS not in sys.path:
    sys.path.insert(0, GPU_TESTS)
# kept members and compiled launchers go to a cache of this test session, not the user's (dsa_aot/runtime/cache.py;
# the unit tests give each test its own: tests/unit/conftest.py)
if "AOT_CACHE" not in os.environ:
    import tempfile

    os.environ["AOT_CACHE"] = tempfile.mkdtemp(prefix="dsa-aot-cache-")
