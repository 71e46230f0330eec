"""CUDA contexts for the pointer executors (zero-copy, ffi): which GPU a call
is on, and running host code on a GPU without disturbing the caller's context.

Every GPU is used through its primary context (XLA's and numba's alike).

Why not numba's ``with cuda.gpus[i]``: on 2 x H200 (issue #19), on a thread
where XLA had made GPU 1's context current, ``with cuda.gpus[0]`` around a
compile (numba-cuda 0.30.4) left *no* context current after it, and XLA's
next CUDA call on that thread failed. (numba-cuda fetches a device's primary
context with cuda.core's ``Device.set_current`` and pushes through it; the
net effect on the stack is what was seen.) :func:`on_gpu` pushes the primary
context itself, pops it, and sets the caller's context back if anything in
the block changed the thread's stack. Kernel handles are resolved in a block
of their own (:func:`function_of` checks the context): a function of another
GPU's context fails its launches with CUresult 400.

At exit: numba-cuda 0.30.4 links a kernel once per compute capability and
loads that one library (one ``cuLibrary`` handle) for every context that
asks, but gives each context's module its own finalizer, and each unloads
the handle. Two GPUs of one kind: two ``cuLibraryUnload`` of one library at
interpreter exit, and on 2 x H200 every process that had used both ended in
a glibc abort ("double free or corruption", exit status 134) after its work.
:func:`primary_context` registers :func:`hold_numba_frees_at_exit`: at exit
numba's pending frees are held (the driver frees the process's memory and
modules when it ends).

The GPU of a zero-copy call comes from XLA's stream (:func:`stream_ordinal`):
on 2 x H200 ``cuPointerGetAttribute(DEVICE_ORDINAL)`` named GPU 0 for XLA's
buffers on GPU 1.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import threading
import weakref

_VP = ctypes.c_void_p


@functools.cache
def libcuda():
    """The CUDA driver through ctypes: a ctypes call costs well under a
    microsecond, a cuda-python binding call a few."""
    lib = ctypes.CDLL("libcuda.so.1")
    u, i, pvp = ctypes.c_uint, ctypes.c_int, ctypes.POINTER(_VP)
    for name, args in (("cuInit", [u]),
                       ("cuDeviceGet", [ctypes.POINTER(i), i]),
                       ("cuDevicePrimaryCtxRetain", [pvp, i]),
                       ("cuLaunchKernel", [_VP, u, u, u, u, u, u, u, _VP, _VP, _VP]),
                       ("cuCtxGetCurrent", [pvp]),
                       ("cuCtxSetCurrent", [_VP]),
                       ("cuCtxPushCurrent_v2", [_VP]),
                       ("cuCtxPopCurrent_v2", [pvp]),
                       ("cuCtxGetDevice", [ctypes.POINTER(i)]),
                       ("cuStreamGetCtx", [_VP, pvp])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    if hasattr(lib, "cuKernelGetFunction"):  # CUDA 12.0+ drivers
        lib.cuKernelGetFunction.argtypes = [pvp, _VP]
        lib.cuKernelGetFunction.restype = ctypes.c_int
    lib.cuInit(0)
    return lib


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"gpurouter: {what} failed with CUresult {rc}")


def current_context() -> int:
    """The calling thread's current CUDA context (0: none)."""
    ctx = _VP()
    _check(libcuda().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    return ctx.value or 0


_PRIMARY: dict[int, int] = {}
_LOCK = threading.Lock()
_HELD: list = []  # entered disable() blocks, kept: a collected generator would leave its block


def hold_numba_frees_at_exit(gpus=None) -> None:
    """numba's pending frees (modules, memory) of every context it made, held
    from now on: its finalizers still queue them, nothing is flushed. For the
    interpreter's exit (see the module docstring); ``gpus``: numba's device
    list (default ``numba.cuda.cudadrv.devices.gpus``)."""
    if gpus is None:
        from numba.cuda.cudadrv import devices

        gpus = devices.gpus
    for gpu in gpus:
        ctx = getattr(gpu, "primary_context", None)
        if ctx is None:
            continue
        for pending in (ctx.deallocations, getattr(ctx.memory_manager, "deallocations", None)):
            if pending is not None and not any(pending is p for p, _ in _HELD):
                block = pending.disable()
                block.__enter__()
                _HELD.append((pending, block))


def _register_exit_hook() -> None:
    # atexit runs the last registered first; weakref's exit hook (which runs
    # numba's finalizers) is registered with the first finalize object made
    weakref.finalize(_register_exit_hook, lambda: None)
    atexit.register(hold_numba_frees_at_exit)


def primary_context(ordinal: int) -> int:
    """GPU ``ordinal``'s primary context (XLA's and numba's), retained once."""
    ctx = _PRIMARY.get(ordinal)
    if ctx is None:
        lib = libcuda()
        with _LOCK:
            ctx = _PRIMARY.get(ordinal)
            if ctx is None:
                dev, handle = ctypes.c_int(), _VP()
                _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
                _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), dev), "cuDevicePrimaryCtxRetain")
                if not _PRIMARY:
                    _register_exit_hook()
                ctx = _PRIMARY[ordinal] = int(handle.value)
    return ctx


@contextlib.contextmanager
def on_gpu(ordinal: int):
    """GPU ``ordinal``'s primary context current for the block (numba compiles,
    loads and allocates there); afterwards the caller's current context again,
    whatever the block did to the thread's context stack."""
    lib = libcuda()
    before = current_context()
    _check(lib.cuCtxPushCurrent_v2(primary_context(ordinal)), "cuCtxPushCurrent")
    try:
        yield
    finally:
        popped = _VP()
        lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
        if current_context() != before:
            _check(lib.cuCtxSetCurrent(before or None), "cuCtxSetCurrent")


def _device_of_current() -> int:
    dev = ctypes.c_int(-1)
    _check(libcuda().cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
    return dev.value


_STREAM_ORDINAL: dict[int, int] = {}


def stream_ordinal(stream: int) -> int:
    """The GPU of CUDA stream ``stream`` (its context's device; cached per
    handle: XLA's streams live as long as the process). The default streams
    (0, 1, 2) are each thread's current context's, so they are not cached."""
    hit = _STREAM_ORDINAL.get(stream)
    if hit is not None:
        return hit
    if stream in (0, 1, 2):
        return _device_of_current()
    lib = libcuda()
    ctx = _VP()
    _check(lib.cuStreamGetCtx(_VP(stream), ctypes.byref(ctx)), "cuStreamGetCtx")
    _check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
        ordinal = _device_of_current()
    finally:
        lib.cuCtxPopCurrent_v2(ctypes.byref(_VP()))
    _STREAM_ORDINAL[stream] = ordinal
    return ordinal


def function_of(kernel: int, ordinal: int) -> int:
    """GPU ``ordinal``'s ``CUfunction`` of numba's kernel handle (a ``CUkernel``,
    context-independent: ``cuLaunchKernel`` takes it but resolves it to the
    context's function on every launch: host time, lab/journal/benchmarks.md). Called
    inside ``on_gpu(ordinal)``; an error if another context is current (a
    function of another GPU's context fails its launches with CUresult 400).
    The handle as it is where the driver lacks ``cuKernelGetFunction`` or
    refuses it (a ``CUfunction`` already)."""
    if current_context() != primary_context(ordinal):
        raise RuntimeError(f"gpurouter: GPU {ordinal}'s context is not current to resolve a kernel "
                           f"(current {current_context():#x}, GPU {ordinal}'s {primary_context(ordinal):#x})")
    lib = libcuda()
    if not hasattr(lib, "cuKernelGetFunction"):
        return kernel
    out = _VP(0)
    if lib.cuKernelGetFunction(ctypes.byref(out), _VP(kernel)) != 0 or not out.value:
        return kernel
    return int(out.value)
