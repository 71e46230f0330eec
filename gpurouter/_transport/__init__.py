"""How the kernels reach JAX: the one package that calls ``jax.pure_callback``,
``jax.experimental.buffer_callback`` or ``jax.ffi.ffi_call``.

``kernel_call(planner, out_specs, token_args, call_args, transport)`` launches
the kernel plan ``planner`` gives for the arrays' shapes and returns JAX
arrays, through one of three transports, one module each (the same plan on
every one):

- ``"ffi"`` (``ffi.py``, ABI in ``ffi_abi.py``): XLA calls a compiled handler
  that launches the plan's kernels on XLA's stream: no Python per call;
- ``"zero-copy"`` (``buffer.py``): ``buffer_callback``, a Python launch on
  XLA's buffers;
- ``"callback"`` (``host.py``): ``pure_callback`` on host copies (the CPU and
  simulator path).

For all of them results are declared once, by ``out_specs``
(``jax.ShapeDtypeStruct``\\ s of the unbatched call), and ``vmap`` batch dims
fold into the token axis where the rows allow (``_shared.launches``).
Nothing here validates input: the ops check everything at trace time, before
they get here (an exception inside a callback is undefined behaviour in JAX).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from .. import _backend
from .._vma import match_varying_axes
from .host import host_call


def resolve_transport(op: str, transport: str) -> str:
    """``"auto"`` -> ``"ffi"`` where JAX runs on a CUDA GPU and the FFI ABI
    checks out, ``"zero-copy"`` where only buffer_callback does, else
    ``"callback"``. An explicit transport that cannot run here is a
    RuntimeError naming ``op`` and what it needs."""
    from . import ffi

    gpu = _backend.zero_copy_available()
    if transport == "auto":  # (the value was checked by _checks.check_transport)
        if gpu and ffi.available():
            return "ffi"
        return "zero-copy" if gpu else "callback"
    if transport in ("zero-copy", "ffi") and not gpu:
        raise RuntimeError(
            f"{op}: transport=\"{transport}\" needs JAX on a CUDA GPU (jax.default_backend() == "
            f"\"gpu\", now {jax.default_backend()!r}) and numba-cuda on a real GPU; "
            "use transport=\"callback\"."
        )
    if transport == "ffi" and ffi.unavailable_reason() is not None:
        raise RuntimeError(f"{op}: transport=\"ffi\" cannot run with this jaxlib: "
                           f"{ffi.unavailable_reason()} Use transport=\"zero-copy\".")
    return transport


def kernel_call(
    planner: Callable,
    out_specs: Sequence[jax.ShapeDtypeStruct],
    token_args: Sequence[jax.Array],
    call_args: Sequence[jax.Array] = (),
    transport: str = "callback",
) -> tuple[jax.Array, ...]:
    """Launches ``planner``'s plan for ``(*token_args, *call_args)`` through the chosen transport.

    Args:
      planner: a kernel plan function with all static configuration bound:
        ``planner(*specs)`` of the arrays' ``kernels._base.plan.Spec`` objects
        gives the ``Plan`` (its inputs: the arrays, in this order) that the
        ffi and zero-copy transports launch on XLA's buffers and the callback
        transport on device copies of the host arrays.
      out_specs: shapes and dtypes of the outputs of one unbatched call.
      token_args: arrays whose leading axis is tokens (rows independent); empty
        for ops that reduce over rows, which then run once per vmap element.
      call_args: the other array arguments (biases, counts, scalars).
      transport: ``"ffi"``, ``"zero-copy"`` or ``"callback"`` (already resolved).
    """
    args = (*token_args, *call_args)
    if transport == "ffi":
        from .ffi import ffi_call

        outs = ffi_call(planner, out_specs, token_args, call_args)
    elif transport == "zero-copy":
        from .buffer import buffer_call

        outs = buffer_call(planner, out_specs, token_args, call_args)
    else:
        outs = host_call(planner, out_specs, len(token_args), args)
    return match_varying_axes(outs, args)


def prefetch(planner: Callable, arrays: Sequence) -> int:
    """Starts compiling, in the background, the kernels of a call the trace
    makes later: a backward's, submitted by a forward rule of a
    ``jax.custom_vjp`` while the forward is traced (docs/cache.md, "A cold
    first call"). ``arrays``: what that call will pass (arrays or
    ``jax.ShapeDtypeStruct``\\ s, in ``kernel_call``'s order). Only on a real
    GPU with the kernel cache on (``kernels._base.parallel.prefetch``); a
    hint: when the plan cannot be made here, nothing starts, and the call
    itself reports the problem when it is traced. Returns the kernels submitted."""
    from numba import config

    if getattr(config, "ENABLE_CUDASIM", False):
        return 0
    from ..kernels._base.pointer import prefetch_plan
    from ._shared import plan_of

    words = [jax.ShapeDtypeStruct(a.shape, jax.numpy.uint16 if a.dtype == jax.numpy.bfloat16 else a.dtype)
             for a in arrays]
    try:
        plan = plan_of(planner, words)
        ordinals = sorted({int(d.local_hardware_id) for d in jax.local_devices(backend="gpu")}) or [0]
    except Exception:  # noqa: BLE001  (a hint only: the traced call raises what the planner raised)
        return 0
    return sum(prefetch_plan(plan, o) for o in ordinals)
