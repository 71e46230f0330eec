"""Backend choice (CONTRACT section 5) and the lazy import of the numba kernels.

``import gpurouter`` never imports numba; the kernel layer is imported the
first time an op is traced with ``backend="numba"`` (or ``"auto"`` picks it).
"""

from __future__ import annotations

import functools
import os
import types

from ._checks import check_backend

# "auto" picks the kernels only where they are expected to beat the jnp
# reference: JAX on a CUDA GPU with the zero-copy transport and a working
# numba-cuda. Measured on an H200 (docs/benchmarks.md, commit 1d86c62), the
# zero-copy kernels are still slower than the jitted reference for every
# model preset (0.07x-0.98x), so that expectation does not hold yet and "auto"
# stays on the reference. Flip this when the benchmark says otherwise.
KERNELS_BEAT_REFERENCE = False


def _numba_import_error() -> ImportError:
    return ImportError(
        "backend=\"numba\" needs numba-cuda: pip install 'gpurouter[cuda13]' "
        "(or 'gpurouter[cuda12]'; 'gpurouter[sim]' for the CUDA simulator)."
    )


@functools.cache
def kernels() -> types.ModuleType:
    """The numba kernel layer, imported on first use."""
    try:
        from . import kernels as k
    except ImportError as e:
        raise _numba_import_error() from e
    return k


def simulator_enabled() -> bool:
    """True when numba runs on the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
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


def numba_usable() -> bool:
    """True when ``backend="numba"`` can run here: numba-cuda imports and sees a
    GPU, or runs on the simulator."""
    try:
        kernels()
    except ImportError:
        return False
    return simulator_enabled() or numba_gpu_available()


def resolve(op: str, backend: str) -> str:
    """Returns ``"jax"`` or ``"numba"`` for the requested ``backend``.

    ``"auto"`` picks numba only where it is expected to beat the jnp
    reference: JAX itself on a CUDA GPU with the zero-copy transport and a
    working numba-cuda; never the simulator.
    """
    check_backend(op, backend)
    if backend == "auto":
        from ._callback import zero_copy_available

        if KERNELS_BEAT_REFERENCE and zero_copy_available():
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
