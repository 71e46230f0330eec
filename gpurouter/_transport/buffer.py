"""Transport ``"zero-copy"``: ``jax.experimental.buffer_callback`` on XLA's buffers.

JAX on a CUDA GPU: the op's cached plan is launched on the raw pointers
of XLA's own device buffers, on XLA's stream, inside ``jit`` (one
``cuLaunchKernel`` per step from Python, parameters prepared once per plan and
GPU: ``kernels._pointer.PointerLaunch``). Nothing crosses to the host, nothing
is allocated: scratch arrays are extra XLA outputs. The per-call Python inside
XLA is this transport's cost (lab/journal/benchmarks.md); ``"ffi"`` has none.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._shared import COMPILE_LOCK, launches, plan_of, to_words, word_spec


class _Ptr:
    """A device array as a raw pointer, shape and dtype: what ``_launches``
    needs to reshape and index (views, no data moved) and a plan launch needs."""

    __slots__ = ("ptr", "shape", "dtype")

    def __init__(self, ptr: int, shape, dtype):
        self.ptr, self.shape, self.dtype = int(ptr), tuple(shape), np.dtype(dtype)

    def reshape(self, shape):
        return _Ptr(self.ptr, shape, self.dtype)

    def __getitem__(self, idx: tuple):
        size = self.dtype.itemsize * int(np.prod(self.shape[len(idx):], dtype=np.int64))
        flat = int(np.ravel_multi_index(idx, self.shape[: len(idx)])) if idx else 0
        return _Ptr(self.ptr + flat * size, self.shape[len(idx):], self.dtype)


@functools.cache
def _dtype_of(typestr: str) -> np.dtype:
    return np.dtype("<u2" if typestr in ("<V2", "|V2") else typestr)  # bf16 words


def _ptr(buf) -> _Ptr:
    cai = buf.__cuda_array_interface__
    return _Ptr(cai["data"][0], cai["shape"], _dtype_of(cai["typestr"]))


_GPU_COUNT: list[int] = []


def _gpu_count() -> int:
    """How many GPUs numba sees. First asked from several XLA threads at once
    (one per device): numba's lazy device list is not thread-safe, so the
    first call holds the lock."""
    if not _GPU_COUNT:
        from numba import cuda

        with COMPILE_LOCK:
            if not _GPU_COUNT:
                _GPU_COUNT.append(len(cuda.gpus))
    return _GPU_COUNT[0]


def _ordinal(stream: int) -> int:
    """The GPU of a zero-copy call: its XLA stream's (the ExecutionContext names
    no device; on a multi-GPU host each shard runs on its own GPU's stream)."""
    if _gpu_count() == 1:
        return 0
    from ..kernels._base.context import stream_ordinal

    return stream_ordinal(int(stream or 0))


_POINTER_LAUNCHES: dict = {}


def _pointer_launch(plan, ordinal: int):
    """The plan compiled for GPU ``ordinal`` (once; later calls are a dict lookup)."""
    key = (id(plan), ordinal)
    hit = _POINTER_LAUNCHES.get(key)
    if hit is None:
        from ..kernels._base.pointer import PointerLaunch

        with COMPILE_LOCK:
            hit = _POINTER_LAUNCHES.get(key)
            if hit is None:
                # the plan is kept alive with its launch, so its id stays unique
                hit = _POINTER_LAUNCHES[key] = (PointerLaunch(plan, ordinal), plan)
    return hit[0]


def _run_plans(planner, n_token: int, n_out: int, ins, outs, stream: int) -> None:
    """Launches the plans of one zero-copy call on raw pointers (batch dims by ``_launches``).

    ``outs`` holds the op's outputs, then its scratch arrays (unbatched ops only).
    """
    if not any(a.ptr for a in (*ins, *outs)):  # every array empty: nothing to launch
        return
    ordinal = _ordinal(stream)
    _, calls = launches(ins, n_token)
    for inputs, view in calls:
        plan = plan_of(planner, inputs)
        if not plan.steps:
            continue
        ptrs = [a.ptr for a in inputs]
        ptrs += [view(o).ptr for o in outs[:n_out]]
        ptrs += [t.ptr for t in outs[n_out:]]
        _pointer_launch(plan, ordinal)(ptrs, stream)


_DIRECT: dict = {}


def _direct_launch(planner, n_token: int, n_out: int, ins: list, outs: list, ordinal: int):
    """The launch of a call that needs one plan on its arrays' own pointers
    (unbatched, or a vmap batch that folds into the tokens), as a function of
    those pointers in call order; None for the other calls (``_run_plans``)."""
    _, calls = launches(ins, n_token)
    calls = list(calls)
    if len(calls) != 1:
        return None
    inputs, view = calls[0]
    if any(view(o).ptr != o.ptr for o in outs[:n_out]):
        return None
    plan = plan_of(planner, inputs)
    if not plan.steps:
        return lambda ptrs, stream: None
    return _pointer_launch(plan, ordinal)


def _device_call(planner, n_token: int, n_out: int, bufs, outs, stream: int) -> None:
    """The body of a zero-copy callback: XLA's buffers -> raw pointers -> launches.

    The per-call Python is the zero-copy transport's overhead, so a call whose
    arrays (shapes, dtypes, GPU) were seen before goes straight to its cached
    launch with the new pointers; the others go through ``_run_plans``.
    """
    cais = [b.__cuda_array_interface__ for b in bufs] + [o.__cuda_array_interface__ for o in outs]
    ptrs = [c["data"][0] for c in cais]
    if not any(ptrs):  # every array empty: nothing to launch
        return
    ordinal = _ordinal(stream)
    key = (planner, n_token, n_out, ordinal, *((c["shape"], c["typestr"]) for c in cais))
    launch = _DIRECT.get(key, _DIRECT)
    if launch is _DIRECT:
        arrays = [_Ptr(c["data"][0], c["shape"], _dtype_of(c["typestr"])) for c in cais]
        if len(_DIRECT) > 4096:  # one entry per call site and shape: bounded anyway
            _DIRECT.clear()
        launch = _DIRECT[key] = _direct_launch(planner, n_token, n_out, arrays[: len(bufs)],
                                               arrays[len(bufs):], ordinal)
    if launch is None:
        _run_plans(planner, n_token, n_out, [_ptr(b) for b in bufs], [_ptr(o) for o in outs], stream)
    else:
        launch(ptrs, stream)


def buffer_call(planner, out_specs, token_args, call_args):
    from jax.experimental.buffer_callback import buffer_callback

    from ..kernels._base.plan import spec_for

    n_token, n_out = len(token_args), len(out_specs)
    args = [to_words(jnp.asarray(a)) for a in (*token_args, *call_args)]
    # Scratch arrays (per-block partial sums) come from XLA as extra outputs:
    # nothing is allocated (or freed: a cuMemFree waits for the whole GPU)
    # inside the callback.
    tmps = planner(*(spec_for(a.shape, a.dtype) for a in args)).tmps
    if tmps and n_token:
        raise AssertionError("plans with scratch arrays must not have per-token arrays")

    def device_fn(ctx, outs, *bufs):
        _device_call(planner, n_token, n_out, bufs, outs, ctx.stream)

    call = buffer_callback(
        device_fn,
        tuple(word_spec(s) for s in out_specs) + tuple(jax.ShapeDtypeStruct(t.shape, t.dtype)
                                                          for t in tmps),
        vmap_method="expand_dims" if n_token else "sequential",
    )
    results = call(*args)[:n_out]
    return tuple(
        lax.bitcast_convert_type(r, jnp.bfloat16) if s.dtype == jnp.bfloat16 else r
        for r, s in zip(results, out_specs, strict=True)
    )
