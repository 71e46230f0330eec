"""A plan launched on raw device pointers: the kernel-parameter ABI of numba.

``compile_steps(plan, ordinal)`` compiles each step of a plan for one GPU and
lays out its parameters the way numba's ``@cuda.jit`` kernels take them; both
pointer executors use it: :class:`PointerLaunch` (ctypes ``cuLaunchKernel``,
called by the zero-copy transport's Python callback) and the FFI transport's
launch table (``gpurouter/_transport/ffi.py``, no Python per call).
"""

from __future__ import annotations

import ctypes

import numpy as np

from . import parallel
from . import plan as _plan
from .context import libcuda, primary_context
from .kernel_cache import function_handle
from .plan import Counter, Plan, Ref, counter_array, counter_key, plan_counters


def _numba_type(arg, specs):
    from numba.cuda import types as nbt
    from numba.cuda.np.numpy_support import from_dtype

    if isinstance(arg, Ref):
        sp = arg.view or specs[arg.role][arg.index]
        return nbt.Array(from_dtype(sp.dtype), max(1, len(sp.shape)), "C")
    if isinstance(arg, Counter):
        return nbt.Array(from_dtype(np.dtype(np.uint32)), 1, "C")
    if isinstance(arg, (bool, np.bool_)):
        return nbt.boolean
    if isinstance(arg, np.float32):
        return nbt.float32
    if isinstance(arg, (int, np.integer)):
        return nbt.int64
    raise TypeError(f"no kernel parameter type for {arg!r}")


class CompiledStep:
    """One step of a plan compiled for one GPU, its parameters laid out.

    ``params`` is the parameter block: one 8-byte slot per kernel parameter
    (cuLaunchKernel reads ``kernelParams[i]`` as a pointer to parameter i; a
    slot holds an int64, a pointer, a float32 or a bool in its first bytes,
    little-endian), ``holes`` the ``(slot, array)`` pairs whose slot takes the
    data pointer of array ``array`` (ins, then outs, then tmps, in plan
    order) at each launch.
    """

    __slots__ = ("handle", "grid", "block", "shared", "params", "holes", "name")

    def __init__(self, handle, grid, block, shared, params: bytes, holes, name: str):
        self.handle, self.grid, self.block, self.shared = int(handle), int(grid), int(block), int(shared)
        self.params, self.holes, self.name = params, tuple(holes), name


def _slots(arg, specs, slot_of, counters) -> tuple[list[bytes], list[tuple[int, int]]]:
    """The 8-byte parameter slots of one kernel argument and, for an array,
    the hole of its data pointer (relative to the argument's first slot).

    numba's ABI for an array argument: meminfo, parent, nitems, itemsize,
    data, shape..., strides... (all pointer-sized); scalars as themselves.
    A ``Counter``: its pointer in ``counters`` (``id -> address``: written into
    the block), else a hole for array ``slot_of["counter"] + k`` (the plan's
    k-th counter, after its ins, outs and tmps).
    """
    def q(v) -> bytes:
        return int(v).to_bytes(8, "little", signed=True)

    if isinstance(arg, Counter):
        ptr = counters.get(id(arg), 0) if counters is not None else 0
        slots = [q(0), q(0), q(arg.words), q(4), q(ptr), q(arg.words), q(4)]
        if counters is not None:
            return slots, []
        return slots, [(4, slot_of["counter"] + slot_of["counters"].index(id(arg)))]
    if isinstance(arg, Ref):
        sp = arg.view or specs[arg.role][arg.index]
        shape = sp.shape or (1,)
        strides = [sp.dtype.itemsize] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        slots = [q(0), q(0), q(np.prod(shape, dtype=np.int64)), q(sp.dtype.itemsize), q(0)]
        slots += [q(v) for v in (*shape, *strides)]
        return slots, [(4, slot_of[arg.role] + arg.index)]
    if isinstance(arg, (bool, np.bool_)):
        return [bytes([int(bool(arg))]) + bytes(7)], []
    if isinstance(arg, np.float32):
        return [np.float32(arg).tobytes() + bytes(4)], []
    return [q(arg)], []


def plan_requests(plan: Plan) -> list:
    """``(kernel, argtypes)`` (numba types) of each step of ``plan``."""
    specs = {"in": plan.ins, "out": plan.outs, "tmp": plan.tmps}
    return [(st.kernel, tuple(_numba_type(a, specs) for a in st.args)) for st in plan.steps]


def prefetch_plan(plan: Plan, ordinal: int) -> int:
    """Starts compiling ``plan``'s missing kernels for GPU ``ordinal`` in the
    background (``parallel.prefetch``); the number submitted."""
    return parallel.prefetch(plan_requests(plan), ordinal)


def compile_steps(plan: Plan, ordinal: int, counters: dict | None = None) -> list[CompiledStep]:
    """Every step of ``plan`` compiled for GPU ``ordinal`` (``kernel_cache.
    function_handle``: from the process's memo, the disk cache or numba's
    compile), with its parameter block.
    ``counters`` (``id(Counter) -> device address``): the plan's counters
    written into the blocks; None: holes after the tmps (``_slots``)."""
    specs = {"in": plan.ins, "out": plan.outs, "tmp": plan.tmps}
    slot_of = {"in": 0, "out": len(plan.ins), "tmp": len(plan.ins) + len(plan.outs),
               "counter": len(plan.ins) + len(plan.outs) + len(plan.tmps),
               "counters": [id(c) for c in plan_counters(plan)]}
    requests = plan_requests(plan)
    parallel.precompile(requests, ordinal)  # the missing ones compiled at once in workers (parallel.py)
    handles = [function_handle(kernel, argtypes, ordinal) for kernel, argtypes in requests]
    steps = []
    for st, handle in zip(plan.steps, handles, strict=True):
        params, holes = [], []
        for a in st.args:
            slots, arg_holes = _slots(a, specs, slot_of, counters)
            holes += [(len(params) + at, array) for at, array in arg_holes]
            params += slots
        name = getattr(st.kernel, "__name__", None) or getattr(getattr(st.kernel, "py_func", None),
                                                                "__name__", "kernel")
        steps.append(CompiledStep(handle, st.grid, st.block, st.shared, b"".join(params),
                                  holes, name))
    return steps


class PointerLaunch:
    """``plan`` compiled for one GPU and launched on raw device pointers from
    Python (ctypes ``cuLaunchKernel``, a few microseconds per step).

    Each step's parameter block lives in ctypes storage built here, with the
    ``void*[]`` array cuLaunchKernel reads; a call writes the data pointers
    into it and launches (the driver copies the parameters at launch, so the
    storage is reused at once; a lock keeps two host threads from
    interleaving). The kernel handle is the context's CUfunction of numba's
    CUkernel (``_context.function_of``) or of a cubin loaded from the disk cache
    (``kernel_cache``); the launch runs in the device's primary context,
    pushed only when another one is current.  The plan's counters
    (``_plan.Counter``): one per stream, appended to ``ptrs``.
    """

    def __init__(self, plan: Plan, ordinal: int):
        import ctypes
        import threading

        self._lib = libcuda()
        self._lock = threading.Lock()
        self._current = ctypes.c_void_p()
        self.steps = []
        for st in compile_steps(plan, ordinal):
            n = len(st.params) // 8
            block = (ctypes.c_int64 * n).from_buffer_copy(st.params)
            base = ctypes.addressof(block)
            argv = (ctypes.c_void_p * n)(*(base + 8 * i for i in range(n)))
            holes = tuple((slot, array) for slot, array in st.holes)
            self.steps.append((st.handle, st.grid, st.block, st.shared, ctypes.addressof(argv),
                               block, holes, argv))  # block and argv: the storage, kept alive
        self.context = primary_context(ordinal)
        self.ordinal = ordinal
        self.counters = plan_counters(plan)
        self._counter_ptrs: dict = {}

    def _with_counters(self, ptrs, stream: int):
        key = counter_key(stream or 0)
        extra = self._counter_ptrs.get(key)
        if extra is None:
            arrays = [counter_array(c, self.ordinal, key) for c in self.counters]
            extra = self._counter_ptrs[key] = [int(a.__cuda_array_interface__["data"][0]) for a in arrays]
        return [*ptrs, *extra]

    def __call__(self, ptrs, stream: int) -> None:
        """Launches every step on ``stream``; ``ptrs``: ins + outs + tmps, in plan order."""
        import ctypes

        if self.counters:
            ptrs = self._with_counters(ptrs, stream)
        lib = self._lib
        with self._lock:
            lib.cuCtxGetCurrent(ctypes.byref(self._current))
            push = self._current.value != self.context
            if push and lib.cuCtxPushCurrent_v2(self.context):
                raise RuntimeError("gpurouter: cuCtxPushCurrent failed")
            try:
                for handle, grid, block, shared, argv, params, holes, _ in self.steps:
                    for slot, array in holes:
                        params[slot] = ptrs[array]
                    err = lib.cuLaunchKernel(handle, grid, 1, 1, block, 1, 1, shared, stream or None,
                                             argv, None)
                    if err:
                        raise RuntimeError(f"gpurouter: cuLaunchKernel failed with CUresult {err}")
            finally:
                if push:
                    lib.cuCtxPopCurrent_v2(ctypes.byref(self._current))


_POINTER_PLANS: dict = {}


def _c_contiguous(cai) -> bool:
    strides = cai.get("strides")
    if strides is None:
        return True
    itemsize = np.dtype(cai["typestr"]).itemsize
    want = itemsize
    for n, s in zip(reversed(cai["shape"]), reversed(strides), strict=True):
        if n > 1 and s != want:
            return False
        want *= n
    return True


def launch_plan(plan: Plan, arrays: dict, stream) -> bool:
    """``plan.execute``'s GPU path: runs ``plan`` on the arrays of ``execute``
    (``{"in": ..., "out": ..., "tmp": ...}``) through :class:`PointerLaunch`
    (the kernels' compiled handles: disk cache, no per-launch typing); False, launching
    nothing, where an array is not the plan's: a shape or dtype other than its
    Spec, strides not C-contiguous, or a reinterpreted view that is misaligned
    (numba's dispatcher then runs the plan, and raises what it raises)."""
    ptrs = []
    for role, specs in (("in", plan.ins), ("out", plan.outs), ("tmp", plan.tmps)):
        for a, sp in zip(arrays[role], specs, strict=False):
            if a is None:
                ptrs.append(0)
                continue
            cai = a.__cuda_array_interface__
            shape = tuple(int(n) for n in cai["shape"])
            if (shape not in (sp.shape, sp.shape or (1,)) or np.dtype(cai["typestr"]) != sp.dtype
                    or not _c_contiguous(cai)):
                return False
            ptrs.append(int(cai["data"][0]))
        if len(arrays[role]) < len(specs):
            return False
    starts = {"in": 0, "out": len(plan.ins), "tmp": len(plan.ins) + len(plan.outs)}
    for st in plan.steps:
        for a in st.args:
            if isinstance(a, Ref) and a.view is not None and ptrs[starts[a.role] + a.index] % a.view.dtype.itemsize:
                return False
    ordinal = _plan._ordinal_now()
    memo = (id(plan), ordinal)
    hit = _POINTER_PLANS.get(memo)
    if hit is None:
        if len(_POINTER_PLANS) > 4096:  # one entry per plan used: bounded anyway
            _POINTER_PLANS.clear()
        try:
            launcher = PointerLaunch(plan, ordinal)
        except TypeError:  # an argument with no kernel parameter type (_numba_type): numba's dispatcher
            launcher = None
        hit = _POINTER_PLANS[memo] = (launcher, plan)  # plan kept: its id stays its own
    if hit[0] is None:
        return False
    hit[0](ptrs, _stream_handle(stream))
    return True


def _stream_handle(stream) -> int:
    """A numba stream (or 0) as the handle cuLaunchKernel takes; 0 is numba's
    default stream: the per-thread one (2) where numba's config says so."""
    if stream is None or (isinstance(stream, (int, np.integer)) and int(stream) == 0):
        from numba import config

        return 2 if config.CUDA_PER_THREAD_DEFAULT_STREAM else 0
    handle = getattr(stream, "handle", stream)
    if isinstance(handle, ctypes.c_void_p):
        return int(handle.value or 0)
    return int(handle)


_plan.GPU_EXECUTOR[:] = [launch_plan]
