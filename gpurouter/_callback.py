"""The callback plumbing between JAX and the numba kernels: the one place that
calls ``jax.pure_callback`` and ``jax.experimental.buffer_callback``.

``kernel_call(launcher, out_specs, token_args, call_args, transport=...)`` runs a
kernel launcher and returns JAX arrays, through one of two transports:

- ``"callback"``: ``jax.pure_callback`` on host copies of the arrays (JAX on
  the CPU with numba on a GPU or on the CUDA simulator; two host round trips);
- ``"zero-copy"``: ``jax.experimental.buffer_callback`` when JAX runs on a
  CUDA GPU: the launcher's cached ``Plan`` is launched on the raw pointers of
  XLA's own device buffers, on XLA's stream, inside ``jit`` (one
  ``cuLaunchKernel`` per step, parameters prepared once per plan and GPU);
  nothing crosses to the host, nothing is allocated: scratch arrays are extra
  XLA outputs.

For both:

- results are declared once, by ``out_specs`` (``jax.ShapeDtypeStruct``\\ s of
  the unbatched call);
- (callback) inputs are copied out of JAX's read-only host buffers
  (``np.array``) before a launcher sees them (numba and the simulator write
  back into their arguments);
- (zero-copy) bfloat16 crosses as its raw 16-bit words (a ``uint16``
  bitcast, which the kernels read as bf16): the CUDA array interface has no
  bf16 type;
- ``vmap`` uses ``vmap_method="expand_dims"``: batch dims arrive as leading
  axes. Per-token arrays (``token_args``, rows independent) fold the batch into
  the token axis when every per-call array (``call_args``: biases, counts,
  scalars) is unbatched; otherwise the launcher runs once per batch element.
  Ops whose rows are not independent (the aux loss) pass everything as
  ``call_args``.

Nothing here validates input: the ops check everything at trace time, before
they get here, because an exception inside a callback is undefined behaviour
in JAX.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Launcher = Callable[..., Sequence[np.ndarray]]

# XLA runs the callbacks of different devices (shards) on different threads at
# once. The CUDA simulator is not thread-safe (its thread indices live in
# per-launch globals): host-callback launches are serialised here. (Zero-copy
# launches need no lock: cuLaunchKernel is thread-safe; only their one-time
# compilation is serialised, by _COMPILE_LOCK.)
_LAUNCH_LOCK = threading.Lock()
# numba's own state (its device list, compilation) is set up on first use
# from whichever XLA thread gets there first: serialised.
_COMPILE_LOCK = threading.Lock()


def _host(x) -> np.ndarray:
    """A writable, C-contiguous NumPy copy of a JAX host buffer."""
    return np.array(x, copy=True, order="C")


def _launches(ins: Sequence, n_token: int):
    """The launches that cover one callback whose arrays may carry vmap batch dims.

    Returns ``(batch, launches)``: ``batch`` is the leading batch shape (``()``
    when unbatched) and ``launches`` yields ``(args, view)`` pairs: the
    launcher's inputs, and a function that maps a whole output array
    (``batch + unbatched shape``) to the part this launch fills. Works on
    NumPy arrays and on numba device arrays alike (reshape and indexing give
    views on both). One launch when unbatched or when the batch folds into
    the token axis (every per-token array carries the whole batch and no
    per-call array is batched); else one launch per batch element.
    """
    token, call = ins[:n_token], ins[n_token:]
    # Batch dims = leading dims before [T, E] of the first per-token array
    # (expand_dims gives every argument the same number of them). Ops with no
    # per-token arrays use vmap_method="sequential" and never see batch dims.
    nb = len(token[0].shape) - 2 if token else 0
    batch = _batch_shape(ins, nb)

    def generate():
        if nb == 0:
            yield list(ins), lambda o: o
        elif _foldable(token, call, batch, nb):
            rows = int(np.prod(batch)) * token[0].shape[nb]
            yield ([a.reshape((rows,) + tuple(a.shape[nb + 1 :])) for a in token]
                   + [a.reshape(tuple(a.shape[nb:])) for a in call],
                   lambda o: o.reshape((rows,) + tuple(o.shape[nb + 1 :])))
        else:
            for idx in np.ndindex(*batch):
                args = [a[tuple(i if a.shape[d] > 1 else 0 for d, i in enumerate(idx))] for a in ins]
                yield args, lambda o, idx=idx: o[idx]

    return batch, generate()


def _run_batched(
    launcher: Launcher,
    out_specs: Sequence[jax.ShapeDtypeStruct],
    n_token: int,
    args: Sequence[np.ndarray],
) -> tuple[np.ndarray, ...]:
    """Runs ``launcher`` on host arrays that may carry leading vmap batch dims."""
    batch, launches = _launches(args, n_token)
    results = [np.empty(batch + tuple(s.shape), s.dtype) for s in out_specs]
    for inputs, view in launches:
        for r, o in zip(results, launcher(*(np.ascontiguousarray(a) for a in inputs)), strict=True):
            view(r)[...] = np.asarray(o, r.dtype)
    return tuple(results)


def _foldable(token, call, batch: tuple[int, ...], nb: int) -> bool:
    """The batch folds into tokens iff every per-token array carries all of it
    and no per-call array (bias, ...) is batched."""
    return all(tuple(a.shape[:nb]) == batch for a in token) and all(
        int(np.prod(a.shape[:nb])) == 1 for a in call
    )


def _batch_shape(args: Sequence[np.ndarray], nb: int) -> tuple[int, ...]:
    shape = [1] * nb
    for a in args:
        for i in range(nb):
            shape[i] = max(shape[i], a.shape[i])
    return tuple(shape)


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

        with _COMPILE_LOCK:
            if not _GPU_COUNT:
                _GPU_COUNT.append(len(cuda.gpus))
    return _GPU_COUNT[0]


def _ordinal(ptr: int) -> int:
    """The GPU that holds device pointer ``ptr`` (XLA's ExecutionContext names
    no device; on a multi-GPU host each shard's buffers live on its own GPU)."""
    if _gpu_count() == 1:
        return 0
    from cuda.bindings import driver

    err, ordinal = driver.cuPointerGetAttribute(
        driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"gpurouter: cannot place device pointer {ptr:#x}: {err!r}")
    return int(ordinal)


_POINTER_LAUNCHES: dict = {}


def _pointer_launch(plan, ordinal: int):
    """The plan compiled for GPU ``ordinal`` (once; later calls are a dict lookup)."""
    key = (id(plan), ordinal)
    hit = _POINTER_LAUNCHES.get(key)
    if hit is None:
        from .kernels._launch import PointerLaunch

        with _COMPILE_LOCK:
            hit = _POINTER_LAUNCHES.get(key)
            if hit is None:
                # the plan is kept alive with its launch, so its id stays unique
                hit = _POINTER_LAUNCHES[key] = (PointerLaunch(plan, ordinal), plan)
    return hit[0]


_PLANS: dict = {}


def _plan_of(planner, arrays):
    """``planner(*specs of arrays)``, memoised per planner and input shapes/dtypes."""
    key = (planner, *((a.shape, a.dtype) for a in arrays))
    plan = _PLANS.get(key)
    if plan is None:
        from .kernels._launch import spec_for

        if len(_PLANS) > 4096:  # one entry per traced call site and shape: bounded anyway
            _PLANS.clear()
        plan = _PLANS[key] = planner(*(spec_for(a.shape, a.dtype) for a in arrays))
    return plan


def _run_plans(planner, n_token: int, n_out: int, ins, outs, stream: int) -> None:
    """Launches the plans of one zero-copy call on raw pointers (batch dims by ``_launches``).

    ``outs`` holds the op's outputs, then its scratch arrays (unbatched ops only).
    """
    placed = [a.ptr for a in (*ins, *outs) if a.ptr]
    if not placed:  # every array empty: nothing to launch
        return
    ordinal = _ordinal(placed[0])
    _, launches = _launches(ins, n_token)
    for inputs, view in launches:
        plan = _plan_of(planner, inputs)
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
    _, launches = _launches(ins, n_token)
    launches = list(launches)
    if len(launches) != 1:
        return None
    inputs, view = launches[0]
    if any(view(o).ptr != o.ptr for o in outs[:n_out]):
        return None
    plan = _plan_of(planner, inputs)
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
    placed = [p for p in ptrs if p]
    if not placed:  # every array empty: nothing to launch
        return
    ordinal = _ordinal(placed[0])
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


def _to_words(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def _word_spec(spec: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    if spec.dtype == jnp.bfloat16:
        return jax.ShapeDtypeStruct(spec.shape, jnp.uint16)
    return spec


def _zero_copy_call(planner, out_specs, token_args, call_args):
    from jax.experimental.buffer_callback import buffer_callback

    from .kernels._launch import spec_for

    n_token, n_out = len(token_args), len(out_specs)
    args = [_to_words(jnp.asarray(a)) for a in (*token_args, *call_args)]
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
        tuple(_word_spec(s) for s in out_specs) + tuple(jax.ShapeDtypeStruct(t.shape, t.dtype)
                                                          for t in tmps),
        vmap_method="expand_dims" if n_token else "sequential",
    )
    results = call(*args)[:n_out]
    return tuple(
        lax.bitcast_convert_type(r, jnp.bfloat16) if s.dtype == jnp.bfloat16 else r
        for r, s in zip(results, out_specs, strict=True)
    )


@functools.cache
def zero_copy_available() -> bool:
    """True when JAX runs on a CUDA GPU, buffer_callback exists and numba sees a real GPU."""
    from . import _backend

    if jax.default_backend() != "gpu" or _backend.simulator_enabled():
        return False
    try:
        from jax.experimental import buffer_callback  # noqa: F401
    except ImportError:
        return False
    return _backend.numba_gpu_available()


def resolve_transport(op: str, transport: str) -> str:
    """``"auto"`` -> ``"zero-copy"`` where available, else ``"callback"``."""
    if transport == "auto":  # (the value was checked by _checks.check_transport)
        return "zero-copy" if zero_copy_available() else "callback"
    if transport == "zero-copy" and not zero_copy_available():
        raise RuntimeError(
            f"{op}: transport=\"zero-copy\" needs JAX on a CUDA GPU (jax.default_backend() == "
            f"\"gpu\", now {jax.default_backend()!r}), jax.experimental.buffer_callback and "
            "numba-cuda on a real GPU; use transport=\"callback\"."
        )
    return transport


def _varying(x) -> frozenset:
    """The manual mesh axes ``x`` varies along (empty outside shard_map)."""
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):  # jax < 0.10 spelling
        return frozenset(aval.vma)
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10+
    return frozenset(getattr(mat, "varying", ()) or ())


def _match_varying_axes(outs, ins):
    """Marks the outputs varying over every manual mesh axis an input varies over.

    Inside ``shard_map`` JAX types each value with the manual axes it varies
    along; a callback's outputs come out typed invariant, which would break
    ``custom_vjp`` (cotangent types must match the primal inputs) and any
    later collective. The outputs of a per-shard kernel vary as its inputs do.
    """
    vma = frozenset().union(*(_varying(a) for a in ins))
    fixed = []
    for o in outs:
        missing = tuple(sorted(vma - _varying(o)))
        fixed.append(lax.pcast(o, missing, to="varying") if missing else o)
    return tuple(fixed)


def kernel_call(
    launcher: Launcher,
    planner: Callable,
    out_specs: Sequence[jax.ShapeDtypeStruct],
    token_args: Sequence[jax.Array],
    call_args: Sequence[jax.Array] = (),
    transport: str = "callback",
) -> tuple[jax.Array, ...]:
    """Calls ``launcher(*token_args, *call_args)`` through the chosen transport.

    Args:
      launcher: a kernel launcher with all static configuration bound; NumPy
        arrays in, NumPy arrays out (callback transport).
      planner: the launcher's plan function with all static configuration
        bound: ``planner(*specs)`` of the arrays' ``kernels._launch.Spec`` objects
        gives the ``Plan`` the zero-copy transport launches on XLA's buffers.
      out_specs: shapes and dtypes of the outputs of one unbatched call.
      token_args: arrays whose leading axis is tokens (rows independent); empty
        for ops that reduce over rows, which then run once per vmap element.
      call_args: the other array arguments (biases, counts, scalars).
      transport: ``"callback"`` or ``"zero-copy"`` (already resolved).
    """
    args = (*token_args, *call_args)
    if transport == "zero-copy":
        return _match_varying_axes(_zero_copy_call(planner, out_specs, token_args, call_args), args)
    n_token = len(token_args)

    def host_fn(*args):
        with _LAUNCH_LOCK:
            return _run_batched(launcher, out_specs, n_token, [_host(a) for a in args])

    vmap_method = "expand_dims" if n_token else "sequential"
    outs = jax.pure_callback(host_fn, tuple(out_specs), *args, vmap_method=vmap_method)
    return _match_varying_axes(outs, args)
