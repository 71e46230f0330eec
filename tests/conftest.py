"""Test setup shared by every gpurouter test (reference, kernels, public API).

- Hypothesis profiles, picked by ``GPUROUTER_HYPOTHESIS_PROFILE`` (default
  ``suite``; pytest's ``--hypothesis-profile`` overrides it): ``suite``
  (``ci`` at 10 examples: the test suite's own),
  ``ci`` (derandomized, 25 examples), ``dev`` (10, random), ``fuzz``
  (3000, random; run by hand or nightly): ``gpurouter.testing.profiles``.
- ``GPUROUTER_TEST_DEVICE=i`` makes ``jax.devices()[i]`` JAX's default device
  (the public suite on a second GPU: tools/ci/two_gpu.sh).
- Strict JAX promotion: ``jax_numpy_dtype_promotion="strict"`` and
  ``jax_numpy_rank_promotion="raise"`` (x64 stays off; tests that need
  float64 use ``with jax.enable_x64(True):`` locally).
- Markers (declared in pyproject.toml): ``gpu`` tests are skipped, with the
  reason, unless numba-cuda sees a real GPU; ``cuda`` tests are skipped
  unless numba-cuda imports and either sees a GPU or runs the simulator
  (``NUMBA_ENABLE_CUDASIM=1``). numba is only imported when such a test is
  collected.
"""

from __future__ import annotations

import functools
import os
import sys

# Eight host devices for the sharding tests (tests/sharding/test_sharding.py); must be
# set before JAX initialises. It only affects the CPU platform: on a GPU host
# the sharding tests use the GPUs (and skip with fewer than two).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
# XLA:CPU's collective timeouts raised (also before JAX starts): on the CUDA
# simulator a sharded jit's callbacks queue on one launch lock for minutes on a
# busy machine, and the devices waiting in an all-reduce would otherwise end
# the whole process after about 60 s (docs/testing.md). The library does the
# same when it is imported first; here it is done for every test process.
from gpurouter._backend import SIMULATOR_XLA_FLAGS  # noqa: E402  (imports no jax backend)

for _flag in SIMULATOR_XLA_FLAGS:
    if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + _flag
# With the simulator on (a machine without a GPU: CI), XLA:CPU's LLVM runs at -O0. Most of
# the suite's time there is XLA compiling small programs: -O0 took 13-20% off the wall time
# of the jnp-heavy test files on the 2-core CI machine (2026-11-29), and XLA:CPU does not
# reassociate float arithmetic at any level, so the bit-exact tests hold. A level already
# in XLA_FLAGS is kept.
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from gpurouter.testing import profiles  # noqa: E402

# The profiles are the public ones (gpurouter/testing/profiles.py): no deadline,
# the reproduction blob printed, slow examples allowed.
profiles.register()
# "suite": the derandomised "ci" profile at 10 examples a property instead of
# 25, to keep `make test` on a 2-core CPU near 25 minutes (16 until
# 2026-11-28, when the suite had grown to 30 minutes there;
# GPUROUTER_HYPOTHESIS_PROFILE=ci runs 25; "fuzz" runs thousands).
settings.register_profile("suite", parent=settings.get_profile("ci"), max_examples=10)
settings.load_profile(os.environ.get("GPUROUTER_HYPOTHESIS_PROFILE", "suite"))

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def _default_device_from_env():
    """``GPUROUTER_TEST_DEVICE=i``: run the tests with ``jax.devices()[i]`` as JAX's
    default device (``jax_default_device``), e.g. the public suite on a host's second
    GPU, where a launch in the wrong CUDA context would show (issue #19,
    tools/ci/two_gpu.sh). Unset: JAX's own default (the first device)."""
    raw = os.environ.get("GPUROUTER_TEST_DEVICE")
    if raw is None or raw == "":
        return
    devices = jax.devices()
    try:
        index = int(raw)
    except ValueError:
        raise pytest.UsageError(f"GPUROUTER_TEST_DEVICE must be a device index, got {raw!r}") from None
    if not 0 <= index < len(devices):
        raise pytest.UsageError(f"GPUROUTER_TEST_DEVICE={index}: JAX has {len(devices)} device(s): {devices}")
    jax.config.update("jax_default_device", devices[index])


_default_device_from_env()


def _simulator() -> bool:
    from gpurouter._backend import simulator_enabled  # imports no numba

    return simulator_enabled()


@functools.cache
def _numba_cuda_importable() -> bool:
    try:
        from gpurouter import _backend

        _backend.kernels()
        import numba.cuda  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


@functools.cache
def _real_gpu() -> bool:
    """numba-cuda sees a real CUDA GPU (never true under the simulator)."""
    if _simulator() or not _numba_cuda_importable():
        return False
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # noqa: BLE001 - a driver failure means "no GPU"
        return False


#: CPython's GIL switch interval under the simulator (default 5 ms). The simulator
#: runs a block's threads as Python threads and its block manager polls them in a
#: busy loop: with 5 ms every hand-over of the GIL to and from the poller (at each
#: barrier, each block's start) waited up to 5 ms, most of a tiny kernel's time.
SIM_SWITCH_INTERVAL = 1e-4
if _simulator():
    sys.setswitchinterval(SIM_SWITCH_INTERVAL)


def _atomic_simulator_shared():
    """numba-cuda's simulator makes a static ``cuda.shared.array`` at its first call in a
    launch by a check-then-set on a dict (``kernelapi.FakeCUDAShared.array``): threads of a
    block that get there together can each get an array of their own, and the block's sums
    come out wrong (seen with ``SIM_SWITCH_INTERVAL``: the aux-loss partial sums, 2 runs in 6;
    possible, if rarer, at 5 ms). Here one ``dict.setdefault`` (atomic under the GIL) gives
    every thread the same array; the rest is numba's code (same key: the caller's file, line)."""
    from numba.cuda.simulator import kernelapi

    original = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or numba's error
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)
        return self._allocations.setdefault((caller.f_code.co_filename, caller.f_lineno),
                                            np.empty(shape, dtype))

    kernelapi.FakeCUDAShared.array = array


_SIMULATOR_READY = []


def _simulator_setup():
    """Under the simulator, once, where kernel tests were collected: ``_atomic_simulator_shared``.
    (The chunk lanes' ``lanes_min_blocks`` needs nothing here: ``TokenTiling``'s default is
    the simulator's own figure there; tests that need a GPU's take ``library_lane_blocks``.)"""
    if _SIMULATOR_READY:
        return
    _SIMULATOR_READY.append(True)
    _atomic_simulator_shared()


def pytest_collection_modifyitems(config, items):
    simulated = False
    for item in items:
        if item.get_closest_marker("gpu") is not None and not _real_gpu():
            why = ("NUMBA_ENABLE_CUDASIM is set (simulator, no real GPU)" if _simulator()
                   else "numba-cuda sees no CUDA GPU (or is not installed)")
            item.add_marker(pytest.mark.skip(reason=f"needs a real GPU: {why}"))
        elif item.get_closest_marker("cuda") is not None:
            if not _numba_cuda_importable():
                item.add_marker(pytest.mark.skip(
                    reason="needs numba-cuda: pip install 'gpurouter[cuda13]' (or [sim])"))
            elif not (_simulator() or _real_gpu()):
                item.add_marker(pytest.mark.skip(
                    reason="needs a CUDA GPU or the simulator (NUMBA_ENABLE_CUDASIM=1)"))
            else:
                simulated = _simulator()
    if simulated:
        _simulator_setup()
