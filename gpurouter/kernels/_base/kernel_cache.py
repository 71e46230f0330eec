"""Compiled kernels from disk: a warm process skips numba's typing, LLVM and ptxas.

:func:`function_handle` gives the ``CUfunction`` of a ``@cuda.jit`` kernel
for argument types and a GPU. Its first call in a process for a
(kernel, types, GPU) computes the kernel's key (:func:`kernel_key`) and looks
it up in the disk cache (``disk_cache``): a hit loads the stored cubin with
``cuModuleLoadData`` and takes its entry with ``cuModuleGetFunction``; on
a miss, the kernel's shipped seed (``seeds``: linked as numba links)
or else numba's compile (``dispatcher.compile``) gives the cubin, which is
stored with its entry name. Later calls are a dict lookup.

Why not numba's ``cache=True`` (docs/cache.md): numba-cuda keys a closure
by a cloudpickle of its cells, and for the factories' kernels (closures over
device functions and intrinsics) that pickle differs from one process to the
next, so a fresh process would never hit; and its invalidation does not see
edits to device functions in other files (numba's "Notes on Caching").

The key (``keys.kernel_key``) is a SHA-256 of everything that changes the machine code:

- the source of every module of ``gpurouter/kernels`` but the cache's own
  (``keys.CACHE_MODULES``; any edit elsewhere there makes every key new:
  coarse, never stale);
- the kernel's module and qualified name, and every value it closes over or
  reads as a global, recursively through the device functions and numba
  intrinsics it calls (ints, floats, flags, dtypes, numba and llvmlite
  types): the factory's specialisation;
- numba's compile options of the kernel (``targetoptions``: max_registers,
  fastmath, ...) and the argument types;
- the versions of gpurouter, numba, numba-cuda, llvmlite and the CUDA
  packages installed next to them (NVVM, nvJitLink, the runtime), a few of
  numba's config values, the CUDA driver's version and the GPU's compute
  capability.

A value the key cannot describe (an object whose repr holds an address)
makes the kernel uncacheable: it is compiled as before, never guessed.
"""

from __future__ import annotations

import ctypes
import functools
import threading

from . import disk_cache, seeds
from .keys import kernel_key

#: what this process did: ``compiled`` by numba, ``loaded`` from disk, ``seeded``:
#: linked from a shipped seed, ``uncacheable`` kernels compiled without the disk cache
STATS = {"compiled": 0, "loaded": 0, "seeded": 0, "uncacheable": 0, "load_failed": 0}
_HANDLES: dict = {}
_LOCK = threading.RLock()
#: kernels a background worker is compiling (``parallel.prefetch``): key -> a
#: ``threading.Event`` set when the worker is done (stored or not)
INFLIGHT: dict = {}
_PAYLOAD_MAGIC = b"GRK1"


def pack_payload(entry: str, cubin: bytes) -> bytes:
    """An entry's payload: magic, the kernel's entry name, its cubin."""
    name = entry.encode()
    return _PAYLOAD_MAGIC + len(name).to_bytes(4, "little") + name + bytes(cubin)


def unpack_payload(payload: bytes) -> tuple[str, bytes] | None:
    if len(payload) < 8 or payload[:4] != _PAYLOAD_MAGIC:
        return None
    n = int.from_bytes(payload[4:8], "little")
    if n == 0 or len(payload) <= 8 + n:
        return None
    return payload[8:8 + n].decode(errors="replace"), payload[8 + n:]


# ----------------------------------------------------------------------------
# The driver side (GPU only)
# ----------------------------------------------------------------------------


@functools.cache
def _driver():
    from .context import libcuda

    lib = libcuda()
    vp, i = ctypes.c_void_p, ctypes.c_int
    for name, args in (("cuModuleLoadData", [ctypes.POINTER(vp), ctypes.c_char_p]),
                       ("cuModuleGetFunction", [ctypes.POINTER(vp), vp, ctypes.c_char_p]),
                       ("cuDriverGetVersion", [ctypes.POINTER(i)]),
                       ("cuDeviceGetAttribute", [ctypes.POINTER(i), i, i])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


@functools.cache
def driver_version() -> int:
    """The CUDA driver's version (``cuDriverGetVersion``: 12080 for 12.8)."""
    v = ctypes.c_int(0)
    _driver().cuDriverGetVersion(ctypes.byref(v))
    return int(v.value)


@functools.cache
def compute_capability(ordinal: int) -> tuple[int, int]:
    """GPU ``ordinal``'s compute capability, from the driver."""
    lib, dev, major, minor = _driver(), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        raise RuntimeError(f"gpurouter: cuDeviceGet({ordinal}) failed")
    lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # ..._COMPUTE_CAPABILITY_MAJOR
    lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # ..._COMPUTE_CAPABILITY_MINOR
    return int(major.value), int(minor.value)


_MODULES: list = []  # loaded CUmodules: kept for the process (as numba keeps its own)


def _load(entry: str, cubin: bytes, ordinal: int) -> int:
    """The CUfunction ``entry`` of ``cubin`` loaded in GPU ``ordinal``'s primary
    context (0 where the driver refuses it)."""
    from .context import on_gpu

    lib = _driver()
    module, func = ctypes.c_void_p(), ctypes.c_void_p()
    with on_gpu(ordinal):
        if lib.cuModuleLoadData(ctypes.byref(module), cubin) != 0 or not module.value:
            return 0
        _MODULES.append(module.value)
        if lib.cuModuleGetFunction(ctypes.byref(func), module, entry.encode()) != 0:
            return 0
    return int(func.value or 0)


def _compile(kernel, argtypes, ordinal: int) -> tuple[int, str, bytes]:
    """numba's compile for GPU ``ordinal``: ``(CUfunction, entry name, cubin)``."""
    from .context import function_of, on_gpu

    with on_gpu(ordinal):  # numba compiles and loads; it may leave another GPU current
        compiled = kernel.compile(tuple(argtypes))
        lib = compiled._codelibrary
        cubin = seeds.cubin_bytes(lib.get_cubin())
        raw = int(lib.get_cufunc().handle)
    with on_gpu(ordinal):  # resolved in this GPU's context, nothing else run
        handle = function_of(raw, ordinal)
    STATS["compiled"] += 1
    return handle, str(lib._entry_name), cubin


def function_handle(kernel, argtypes, ordinal: int, cache=None) -> int:
    """GPU ``ordinal``'s CUfunction of ``kernel`` for ``argtypes`` (numba types):
    from the process's memo, else the disk cache, else compiled and stored
    (module docstring). ``cache``: a ``DiskCache`` (default: the process's
    ``disk_cache.default_cache()``, None when ``GPUROUTER_CACHE=0``)."""
    argtypes = tuple(argtypes)
    memo = (id(kernel), argtypes, ordinal)
    hit = _HANDLES.get(memo)
    if hit is not None:
        return hit[0]
    with _LOCK:
        hit = _HANDLES.get(memo)
        if hit is not None:
            return hit[0]
        handle = resolve(kernel, argtypes, ordinal, cache if cache is not None else disk_cache.default_cache())
        _HANDLES[memo] = (handle, kernel)  # the kernel kept: its id stays its own
        return handle


def resolve(kernel, argtypes, ordinal: int, cache, *, compile_fn=None, load_fn=None,
            cc=None, driver=None, seed_fn=None) -> int:
    """One lookup of :func:`function_handle` (no memo): the disk entry of the
    kernel's key loaded, else its shipped seed linked (``seeds``), else
    compiled; what was linked or compiled is stored. The GPU steps are
    injectable (the tests run this on a CPU): ``compile_fn(kernel, argtypes,
    ordinal) -> (handle, entry name, cubin)``, ``load_fn(entry, cubin,
    ordinal) -> handle`` (0: refused), ``seed_fn(kernel, argtypes, cc,
    ordinal) -> (entry, cubin) | None``, ``cc`` and ``driver`` the key's."""
    compile_fn = compile_fn or _compile
    load_fn = load_fn or _load
    if cache is None:
        return compile_fn(kernel, argtypes, ordinal)[0]
    cc = compute_capability(ordinal) if cc is None else cc
    key = kernel_key(kernel, argtypes, cc, driver_version() if driver is None else driver)
    if key is None:
        STATS["uncacheable"] += 1
        return compile_fn(kernel, argtypes, ordinal)[0]
    wait = INFLIGHT.get(key)
    if wait is not None:  # a worker is compiling it (parallel.prefetch): its entry, then the load
        wait.wait()
    handle = _load_entry(cache, key, load_fn, ordinal)
    if handle:
        return handle
    # a miss, or an entry the driver refused: compile, once for concurrent processes
    held = handle is None and cache.claim(key)
    try:
        if handle is None and not held:  # another process held it: its entry now, or a compile here
            handle = _load_entry(cache, key, load_fn, ordinal)
            if handle:
                return handle
        seeded = (seed_fn or seeds.cubin_of)(kernel, argtypes, cc, ordinal)
        handle = load_fn(*seeded, ordinal) if seeded is not None else 0
        if handle:
            STATS["seeded"] += 1
            cache.store(key, pack_payload(*seeded))
            return handle
        handle, entry, cubin = compile_fn(kernel, argtypes, ordinal)
        cache.store(key, pack_payload(entry, cubin))
    finally:
        if held:
            cache.release(key)
    return handle


def _load_entry(cache, key: str, load_fn, ordinal: int):
    """The handle of ``key``'s disk entry; None when there is none (or a bad
    one), 0 when the driver refused it (warned once)."""
    payload = cache.load(key)
    if payload is None:
        return None
    parsed = unpack_payload(payload)
    handle = load_fn(*parsed, ordinal) if parsed is not None else 0
    if handle:
        STATS["loaded"] += 1
        return handle
    STATS["load_failed"] += 1
    disk_cache.warn_once("bad", f"the entry {key[:16]}... did not load on GPU {ordinal}; "
                         "compiling again and overwriting it.")
    return 0
