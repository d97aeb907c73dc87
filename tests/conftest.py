"""Test configuration: the device the suite runs on, quiet TensorFlow,
deterministic seeds per test.

The suite tests the CPU's rules (per-model convolutions, XLA only for arrays
without convolutions, products on the Eigen kernel) and holds every array to
stock Keras in float32. On a machine with a GPU it therefore hides the GPU,
from its subprocesses too, so that the README's test command passes there
as on a CPU. `HFTATF_TEST_GPU=1` runs the tests marked `gpu` instead, on the
GPU, with TF32 off: stock Keras and the array would otherwise each round
their products to TF32 in their own order, far above the suite's float32
tolerances.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ON_GPU = os.environ.get("HFTATF_TEST_GPU", "") not in ("", "0")
if not ON_GPU:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # The suite compiles thousands of small programs and runs each for a
    # few steps: XLA's CPU code generation at optimisation level 1 (of 3)
    # takes 10-14% less of a zoo test's time, and computes what level 3
    # does to float32 rounding. (Level 0 takes a third less, but it sent
    # the gradient of a stock PointNet's max over points elsewhere: the
    # gradients below it were off level 3's by up to 70% of their size.)
    # The array and its stock twins are compiled alike. Set in the
    # environment, the level reaches the tests' subprocesses too.
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in _flags:
        os.environ["XLA_FLAGS"] = (
            f"{_flags} --xla_backend_optimization_level=1".strip())

import keras  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()
# On JAX most of the suite's time is XLA compiling the tests' steps, which
# then run a few times each: the test processes share one compilation
# cache, so that a program one test worker compiled, the others read (the
# same program: a cache hit changes no result).
_OWN_JAX_CACHE = "HFTATF_TESTS_OWN_JAX_CACHE"
if BACKEND == "jax":
    import tempfile

    import jax

    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
            prefix="hftatf-tests-jax-")
        os.environ[_OWN_JAX_CACHE] = str(os.getpid())
    jax.config.update("jax_compilation_cache_dir",
                      os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
if ON_GPU and BACKEND == "tensorflow":
    import tensorflow as tf

    tf.config.experimental.enable_tensor_float_32_execution(False)
elif ON_GPU and BACKEND == "jax":
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu():
    if BACKEND == "jax":
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("backends")
        if marker is not None and BACKEND not in marker.args:
            item.add_marker(pytest.mark.skip(reason=(
                f"runs on {', '.join(marker.args)} only (Keras runs on "
                f"{BACKEND}): {marker.kwargs.get('reason', '')}")))
    if not ON_GPU:
        return
    if not _has_gpu():
        raise pytest.UsageError(
            f"HFTATF_TEST_GPU=1 runs the GPU tests, but {BACKEND} sees no "
            "GPU here. Unset it to run the suite on the CPU.")
    # The rest of the suite asserts the CPU's rules.
    config.hook.pytest_deselected(
        items=[item for item in items if "gpu" not in item.keywords])
    items[:] = [item for item in items if "gpu" in item.keywords]


# A test worker drops JAX's compiled programs after a test once its resident
# memory is past this, and past it by this much again since the last drop:
# clearing returns little of the memory to the system, so a worker that
# cleared after every test once past the limit would lower and load every
# operation again in each test (63 clears were 20 of test_attention's 110 s).
_JAX_CACHE_LIMIT = 2 * 2**30
_JAX_CACHE_GROWTH = 2**30
_next_clear = [_JAX_CACHE_LIMIT]


def _resident_bytes():
    """This process's resident memory (Linux; elsewhere as if past the
    limit)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _next_clear[0] + 1


def _return_freed_memory():
    """Hands the memory the C allocator keeps after frees back to the
    system (glibc; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    yield
    if BACKEND == "jax" and _resident_bytes() > _next_clear[0]:
        # JAX keeps every program it compiled: a worker running hundreds
        # of tests would grow by gigabytes. Dropped only past a limit, as
        # the next tests compile many of the same programs again.
        import jax

        jax.clear_caches()
        _return_freed_memory()
        _next_clear[0] = max(_JAX_CACHE_LIMIT,
                             _resident_bytes() + _JAX_CACHE_GROWTH)


def pytest_unconfigure(config):
    # The process that made the tests' JAX compilation cache removes it.
    if os.environ.get(_OWN_JAX_CACHE) == str(os.getpid()):
        import shutil

        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"],
                      ignore_errors=True)
