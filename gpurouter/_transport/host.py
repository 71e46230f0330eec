"""Transport ``"callback"``: ``jax.pure_callback`` on host copies of the arrays.

The CPU path (JAX on the CPU with numba on a GPU or on the CUDA simulator) and
an explicit host callback: two host round trips per call. Inputs
are copied out of JAX's read-only host buffers (``np.array``) before a
launcher sees them (numba and the simulator write back into their arguments).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ._shared import launches

Launcher = Callable[..., Sequence[np.ndarray]]

# XLA runs the callbacks of different devices (shards) on different threads at
# once. The CUDA simulator is not thread-safe (its thread indices live in
# per-launch globals): host-callback launches are serialised here. (Zero-copy
# launches need no lock: cuLaunchKernel is thread-safe; only their one-time
# compilation is serialised, by _shared.COMPILE_LOCK.)
_LAUNCH_LOCK = threading.Lock()


def _host(x) -> np.ndarray:
    """A writable, C-contiguous NumPy copy of a JAX host buffer."""
    return np.array(x, copy=True, order="C")


def _run_batched(
    launcher: Launcher,
    out_specs: Sequence[jax.ShapeDtypeStruct],
    n_token: int,
    args: Sequence[np.ndarray],
) -> tuple[np.ndarray, ...]:
    """Runs ``launcher`` on host arrays that may carry leading vmap batch dims."""
    batch, calls = launches(args, n_token)
    results = [np.empty(batch + tuple(s.shape), s.dtype) for s in out_specs]
    for inputs, view in calls:
        for r, o in zip(results, launcher(*(np.ascontiguousarray(a) for a in inputs)), strict=True):
            view(r)[...] = np.asarray(o, r.dtype)
    return tuple(results)


def host_call(launcher: Launcher, out_specs, n_token: int, args):
    """``launcher`` through ``jax.pure_callback`` (batch dims by ``launches``)."""

    def host_fn(*args):
        with _LAUNCH_LOCK:
            return _run_batched(launcher, out_specs, n_token, [_host(a) for a in args])

    vmap_method = "expand_dims" if n_token else "sequential"
    return jax.pure_callback(host_fn, tuple(out_specs), *args, vmap_method=vmap_method)
