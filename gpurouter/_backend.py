"""Backend choice (docs/contract.md section 5) and the lazy import of the numba kernels.

``import gpurouter`` never imports numba; the kernel layer is imported the
first time an op is traced with ``backend="numba"`` (or ``"auto"`` picks it).
"""

from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Callable

from ._checks import check_backend

# XLA:CPU ends the whole process ("Termination timeout for 'all reduce ...'
# exceeded") when a collective's participants wait longer than these timeouts
# for each other. On the CUDA simulator one kernel launch can take seconds and
# launches are serialised (_transport.host._LAUNCH_LOCK), so a sharded jit on
# several CPU devices can leave devices waiting for minutes: with the
# simulator, gpurouter raises the timeouts before JAX's CPU backend starts.
SIMULATOR_XLA_FLAGS = (
    "--xla_cpu_collective_call_terminate_timeout_seconds=3600",
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=600",
    "--xla_cpu_collective_timeout_seconds=3600",
)


def guard_simulator_collectives() -> None:
    """With the simulator on, adds :data:`SIMULATOR_XLA_FLAGS` to ``XLA_FLAGS``
    while JAX's backends have not started yet; warns once if they have (the
    flags are read once, when the CPU backend starts). Nothing without the
    simulator, or when the flags are already set."""
    if not simulator_enabled():
        return
    flags = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in SIMULATOR_XLA_FLAGS if f.split("=")[0] not in flags]
    if not missing:
        return
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
    elif not _warned_collectives:
        import warnings

        from ._checks import simulator_collectives_warning

        _warned_collectives.append(True)
        warnings.warn(simulator_collectives_warning(missing), RuntimeWarning, stacklevel=3)


_warned_collectives: list[bool] = []


def _numba_import_error() -> ImportError:
    return ImportError(
        "backend=\"numba\" needs numba-cuda: pip install 'gpurouter[cuda13]' "
        "(or 'gpurouter[cuda12]'; 'gpurouter[sim]' for the CUDA simulator)."
    )


@functools.cache
def kernels() -> types.ModuleType:
    """The numba kernel layer, imported on first use."""
    guard_simulator_collectives()
    try:
        from . import kernels as k
    except ImportError as e:
        raise _numba_import_error() from e
    return k


def simulator_enabled() -> bool:
    """True when numba runs (or, once imported, will run) on the CUDA simulator
    (``NUMBA_ENABLE_CUDASIM=1``).

    The one answer is the kernel layer's (``kernels/_base/launch.simulator_enabled``:
    numba's config, fixed when numba is imported). This module must answer before
    numba is imported and without importing it (``import gpurouter`` never does: it
    costs seconds, and the XLA flags of ``guard_simulator_collectives`` must be set
    before JAX's backends start), so while numba is not imported it reads the
    environment variable, as numba will at its import; once numba is imported it
    reads numba's config, which later changes of the environment do not touch."""
    config = sys.modules.get("numba.core.config")
    if config is not None:
        return bool(config.ENABLE_CUDASIM)
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


@functools.cache
def numba_gpu_available() -> bool:
    """True when numba-cuda imports and sees a real CUDA GPU (not the simulator)."""
    if simulator_enabled():
        return False
    try:
        kernels()  # applies the numpy-2.5 shim before numba.cuda is imported
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # any import or driver failure means "no"
        return False


@functools.cache
def zero_copy_available() -> bool:
    """True when JAX runs on a CUDA GPU, ``buffer_callback`` exists and numba
    sees a real GPU: the device transports can run ("ffi" also needs its ABI
    check, ``_transport.ffi.available``)."""
    import jax

    if jax.default_backend() != "gpu" or simulator_enabled():
        return False
    try:
        from jax.experimental import buffer_callback  # noqa: F401
    except ImportError:
        return False
    return numba_gpu_available()


def numba_usable() -> bool:
    """True when ``backend="numba"`` can run here: numba-cuda imports and sees a
    GPU, or runs on the simulator."""
    try:
        kernels()
    except ImportError:
        return False
    return simulator_enabled() or numba_gpu_available()


def resolve(op: str, backend: str, *, faster: Callable[[], bool] | None = None) -> str:
    """Returns ``"jax"`` or ``"numba"`` for the requested ``backend``.

    ``"auto"`` picks numba only where it is expected to beat the jnp
    reference: JAX itself on a CUDA GPU with the zero-copy transport and a
    working numba-cuda (never the simulator), and ``faster()`` (asked only
    then) says the kernels take this call and measured faster for its kind
    (``gpurouter._auto``: the rule and its measurements). Without ``faster``: jax.
    """
    check_backend(op, backend)
    if backend == "auto":
        if faster is not None and zero_copy_available() and faster():
            return "numba"
        return "jax"
    if backend == "numba":
        kernels()
        if not (simulator_enabled() or numba_gpu_available()):
            raise RuntimeError(
                f"{op}: backend=\"numba\" needs a CUDA GPU visible to numba-cuda, or the "
                "CUDA simulator (NUMBA_ENABLE_CUDASIM=1, for tests); use backend=\"jax\"."
            )
    return backend
