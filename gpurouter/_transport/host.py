"""Transport ``"callback"``: ``jax.pure_callback`` on host copies of the arrays.

The CPU path (JAX on the CPU with numba on a GPU or on the CUDA simulator) and
an explicit host callback: two host round trips per call. It launches the
same plan as the device transports (``planner(*specs)``), on device copies of
the host arrays (``kernels._base.plan.execute_host``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import numpy as np

from ._shared import launches, plan_of

# XLA runs the callbacks of different devices (shards) on different threads at
# once. The CUDA simulator is not thread-safe (its thread indices live in
# per-launch globals): host-callback launches are serialised here. (Zero-copy
# launches need no lock: cuLaunchKernel is thread-safe; only their one-time
# compilation is serialised, by _shared.COMPILE_LOCK.)
_LAUNCH_LOCK = threading.Lock()


def _run_batched(
    planner,
    out_specs: Sequence[jax.ShapeDtypeStruct],
    n_token: int,
    args: Sequence[np.ndarray],
) -> tuple[np.ndarray, ...]:
    """Runs the plans of host arrays that may carry leading vmap batch dims."""
    from ..kernels._base.plan import execute_host

    batch, calls = launches(args, n_token)
    results = [np.empty(batch + tuple(s.shape), s.dtype) for s in out_specs]
    for inputs, view in calls:
        plan = plan_of(planner, inputs)
        for r, o in zip(results, execute_host(plan, inputs), strict=True):
            view(r)[...] = np.asarray(o, r.dtype)
    return tuple(results)


def host_call(planner, out_specs, n_token: int, args):
    """The plans of ``planner`` through ``jax.pure_callback`` (batch dims by ``launches``)."""

    def host_fn(*args):
        with _LAUNCH_LOCK:
            return _run_batched(planner, out_specs, n_token, [np.asarray(a) for a in args])

    vmap_method = "expand_dims" if n_token else "sequential"
    return jax.pure_callback(host_fn, tuple(out_specs), *args, vmap_method=vmap_method)
