"""Plans: what a kernel launcher launches, decided once per shape and configuration.

A launcher validates its arguments, asks its op's ``*_plan`` function for a
:class:`Plan` (a pure function of shapes, dtypes and static configuration:
cacheable) and hands it to an executor:

- :func:`execute` (here): numba device arrays; allocates missing outputs and
  the scratch arrays; on a GPU it launches through ``pointer.PointerLaunch``
  (the kernels' handles from ``kernel_cache``: compiled once, kept on disk)
  whenever the arrays are the plan's (shapes, dtypes, C order), else, and on
  the CUDA simulator, through numba's dispatcher;
- ``_pointer.PointerLaunch``: raw device pointers (the zero-copy transport);
- the FFI transport's launch table (``gpurouter/_transport/ffi.py``), which
  runs a plan from XLA with no Python at all.

A plan names its arrays by role (:func:`In`, :func:`Out`, :func:`Tmp`): the
executors alone turn them into device arrays or pointers.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import cuda

from .context import on_gpu
from .launch import (
    BITMAP_U8,
    DEVICE_DTYPE,
    _kind_of,
    bitmap_bytes,
    finish,
    host_words,
    launch,
    output,
    outs_tuple,
    simulator_enabled,
)


class Spec:
    """Shape, device dtype and kind of one array of a plan (``kind`` None: not a float)."""

    __slots__ = ("shape", "dtype", "kind")

    def __init__(self, shape, dtype, kind=None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.kind = kind

    def __eq__(self, other):
        return isinstance(other, Spec) and (self.shape, self.dtype, self.kind) == (
            other.shape, other.dtype, other.kind)

    def __hash__(self):
        return hash((self.shape, self.dtype, self.kind))

    def __repr__(self):
        return f"Spec({self.shape}, {self.dtype}, {self.kind})"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def spec_of(shape, kind) -> Spec:
    """The Spec of a float array of ``kind`` (F32, BF16 or F16)."""
    return Spec(shape, DEVICE_DTYPE[kind], kind)


def spec_for(shape, dtype) -> Spec:
    """The Spec of an array with host or device dtype ``dtype`` (bfloat16 -> its words)."""
    dtype = np.dtype(dtype)
    if dtype in (np.bool_, np.uint8):  # routing maps: BYTEMAP bool, BITMAP_U8 bytes
        return Spec(shape, dtype, None)
    kind = _kind_of(dtype, True, "array", "spec_for", True)
    return Spec(shape, DEVICE_DTYPE.get(kind, dtype), kind)


def as_spec(a) -> Spec:
    """``a`` itself when it is a Spec, else the Spec of an array (anything with
    ``shape`` and ``dtype``: NumPy, JAX, a device array or a raw pointer)."""
    return a if isinstance(a, Spec) else spec_for(a.shape, a.dtype)


class Ref:
    """A step argument that names an array of the plan: ``role`` is "in", "out"
    or "tmp", ``index`` its position there; ``view`` (a Spec) reinterprets its
    first bytes with another shape and, maybe, another dtype (bf16 words or
    bools read four at a time as uint64 / uint32)."""

    __slots__ = ("role", "index", "view")

    def __init__(self, role: str, index: int, view: Spec | None = None):
        self.role, self.index, self.view = role, index, view

    def __eq__(self, other):
        return isinstance(other, Ref) and (self.role, self.index, self.view) == (
            other.role, other.index, other.view)

    def __hash__(self):
        return hash((self.role, self.index, self.view))


def In(i, view=None):  # noqa: N802  (reads as a type in the plans)
    return Ref("in", i, view)


def Out(i, view=None):  # noqa: N802
    return Ref("out", i, view)


def Tmp(i, view=None):  # noqa: N802
    return Ref("tmp", i, view)


class Counter:
    """A step argument: ``words`` uint32 words that are zero whenever no launch
    of its plan runs (a kernel's last block leaves them zero again, as
    ``cuda.atomic.inc`` does when it wraps).  Not plan scratch: the executors
    allocate it zeroed, once, and keep it for the process (``counter_array``):
    one per GPU and stream for ``execute`` and ``_pointer.PointerLaunch``
    (launches on one stream never overlap), one per GPU for the ffi transport
    (``_transport/ffi_record.py``: XLA runs a GPU's work on one compute
    stream).  Two launches of one plan at once on one counter would be wrong:
    that is what the per-stream copies rule out."""

    __slots__ = ("words",)

    def __init__(self, words: int = 1):
        self.words = int(words)


_COUNTERS: dict = {}
_COUNTERS_LOCK = threading.Lock()


def counter_key(stream):
    """The stream part of a counter's key: 0 for the default stream (and on the
    simulator, which runs launches one at a time); else the stream's handle,
    with the host thread for the per-thread default stream (handle 2: one
    handle, a stream per thread)."""
    if stream is None or simulator_enabled():
        return 0
    handle = int(stream)
    return (handle, threading.get_ident()) if handle == 2 else handle


def counter_array(counter: Counter, ordinal: int, key):
    """The zeroed uint32 array of ``counter`` on GPU ``ordinal`` for stream key
    ``key`` (``counter_key``, or any tag an executor owns), allocated on first
    use and kept for the process."""
    full = (counter, ordinal, key)
    hit = _COUNTERS.get(full)
    if hit is None:
        with _COUNTERS_LOCK:
            hit = _COUNTERS.get(full)
            if hit is None:
                if simulator_enabled():
                    hit = cuda.to_device(np.zeros(counter.words, np.uint32))
                else:
                    with on_gpu(ordinal):  # not numba's cuda.gpus[ordinal]: _context says why
                        hit = cuda.to_device(np.zeros(counter.words, np.uint32))
                        cuda.synchronize()
                _COUNTERS[full] = hit
    return hit


def plan_counters(plan) -> list:
    """The plan's ``Counter`` arguments, each once, in order of first use."""
    seen = []
    for st in plan.steps:
        for a in st.args:
            if isinstance(a, Counter) and not any(a is c for c in seen):
                seen.append(a)
    return seen


def _ordinal_now() -> int:
    return 0 if simulator_enabled() else int(cuda.get_current_device().id)


class Step:
    """One launch: ``kernel[grid, block, stream, shared](*args)``."""

    __slots__ = ("kernel", "grid", "block", "shared", "args")

    def __init__(self, kernel, grid: int, block: int, shared: int, args: tuple):
        self.kernel, self.grid, self.block, self.shared = kernel, int(grid), int(block), int(shared)
        self.args = tuple(args)


class Plan:
    """The launches of one launcher call, over ``ins``, ``outs`` and scratch ``tmps``."""

    __slots__ = ("op", "ins", "outs", "tmps", "steps")

    def __init__(self, op: str, ins, outs, tmps=(), steps=()):
        self.op = op
        self.ins, self.outs, self.tmps = tuple(ins), tuple(outs), tuple(tmps)
        self.steps = tuple(steps)


def _address(a) -> int:
    """A device array's base address (the CUDA simulator's arrays: their host memory)."""
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is None:
        return int(a.__array_interface__["data"][0])
    return int(cai["data"][0])


def _resolve(arg, arrays, op: str = "", stream=0):
    if isinstance(arg, Counter):
        return counter_array(arg, _ordinal_now(), counter_key(stream))
    if not isinstance(arg, Ref):
        return arg
    a = arrays[arg.role][arg.index]
    if arg.view is not None:
        n = int(np.prod(arg.view.shape, dtype=np.int64))
        a = a.reshape(-1)
        if np.dtype(a.dtype) != arg.view.dtype:
            # A kernel reads bf16 quads as uint64, a map quad as uint32: a view
            # such as a[1:] would fault there (fp32 quads check for themselves).
            size = arg.view.dtype.itemsize
            ptr = _address(a)
            if ptr % size:
                what = "input" if arg.role == "in" else "output"
                raise ValueError(f"{op}: a device {what} array of shape {tuple(arrays[arg.role][arg.index].shape)} "
                                 f"starts at {ptr:#x}, not a multiple of {size} bytes (a view such as "
                                 f"a[1:]?); pass an array that starts at an allocation's base.")
            a = a.view(arg.view.dtype)
        a = a[:n].reshape(arg.view.shape)
    return a


def execute(plan: Plan, ins, out, stream, to_host: bool):
    """Runs ``plan`` on numba device arrays; returns the outputs (see ``finish``).

    ``ins`` are device arrays (as ``device_input`` returns them; ``None`` for
    inputs the plan does not read), ``out`` the caller's optional outputs.
    """
    outs = outs_tuple(out, len(plan.outs), plan.op)
    arrays = {
        "in": list(ins),
        "out": [output(sp.shape, sp.dtype, o, "output", plan.op, stream)
                for sp, o in zip(plan.outs, outs, strict=True)],
        "tmp": [cuda.device_array(sp.shape, dtype=sp.dtype, stream=stream) for sp in plan.tmps],
    }
    if simulator_enabled() or not (GPU_EXECUTOR and GPU_EXECUTOR[0](plan, arrays, stream)):
        for st in plan.steps:
            launch(st.kernel, st.grid, st.block, stream, st.shared,
                   *(_resolve(a, arrays, plan.op, stream) for a in st.args))
    return finish(arrays["out"], [sp.kind for sp in plan.outs], to_host, stream)


def execute_host(plan: Plan, arrays):
    """Runs ``plan`` on host arrays (NumPy, in the plan's input order) and
    returns NumPy outputs: the host transport's launch, the same plan the
    device transports launch on XLA's buffers."""
    return execute(plan, [host_words(a) for a in arrays], None, 0, True)


#: the GPU executor: ``pointer.launch_plan``, which ``pointer`` registers here
#: when it is imported (``gpurouter/kernels/__init__.py`` imports it; this
#: module cannot import it: ``pointer`` imports this one). Empty: numba's
#: dispatcher runs every plan.
GPU_EXECUTOR: list = []


def map_spec(num_tokens: int, num_experts: int, map_format: int) -> Spec:
    """The Spec of a routing map: ``bool [T, E]`` (BYTEMAP) or ``uint8 [T, ceil(E/8)]`` (BITMAP_U8)."""
    if map_format == BITMAP_U8:
        return Spec((num_tokens, bitmap_bytes(num_experts)), np.uint8)
    return Spec((num_tokens, num_experts), np.bool_)
