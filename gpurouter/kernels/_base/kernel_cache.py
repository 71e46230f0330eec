"""Compiled kernels from disk: a warm process skips numba's typing, LLVM and ptxas.

:func:`function_handle` gives the ``CUfunction`` of a ``@cuda.jit`` kernel
for argument types and a GPU. Its first call in a process for a
(kernel, types, GPU) computes the kernel's key (:func:`kernel_key`) and looks
it up in the disk cache (``disk_cache``): a hit loads the stored cubin with
``cuModuleLoadData`` and takes its entry with ``cuModuleGetFunction``; a
miss compiles with numba (``dispatcher.compile``), stores the linked cubin
and its entry name, and returns numba's own function. Later calls are a dict
lookup.

Why not numba's ``cache=True`` (docs/cache.md): numba-cuda keys a closure
by a cloudpickle of its cells, and for the factories' kernels (closures over
device functions and intrinsics) that pickle differs from one process to the
next, so a fresh process would never hit; and its invalidation does not see
edits to device functions in other files (numba's "Notes on Caching").

The key is a SHA-256 of everything that changes the machine code:

- the source of every module of ``gpurouter/kernels`` (any edit there makes
  every key new: coarse, never stale);
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
import hashlib
import os
import threading
import types as pytypes
from pathlib import Path

import numpy as np

from . import disk_cache

#: what this process did: ``compiled`` by numba, ``loaded`` from disk,
#: ``uncacheable`` kernels compiled without the disk cache
STATS = {"compiled": 0, "loaded": 0, "uncacheable": 0, "load_failed": 0}
_HANDLES: dict = {}
_LOCK = threading.RLock()
#: kernels a background worker is compiling (``parallel.prefetch``): key -> a
#: ``threading.Event`` set when the worker is done (stored or not)
INFLIGHT: dict = {}
_PAYLOAD_MAGIC = b"GRK1"


class Uncacheable(Exception):
    """A kernel whose key cannot be computed (it is compiled without the cache)."""


@functools.cache
def source_digest() -> str:
    """SHA-256 of every ``.py`` file of ``gpurouter/kernels`` (path and bytes, sorted)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


#: distributions whose versions go into every key (absent ones count as "-")
DISTRIBUTIONS = ("numba", "numba-cuda", "llvmlite", "cuda-bindings", "cuda-python", "cuda-toolkit",
                 "nvidia-nvvm", "nvidia-cuda-nvcc", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-nvrtc",
                 "nvidia-cuda-nvrtc-cu12", "nvidia-nvjitlink", "nvidia-nvjitlink-cu12",
                 "nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13")


@functools.cache
def toolchain() -> str:
    """gpurouter's, numba's and the CUDA packages' versions and numba's
    config values that change code generation, as one string."""
    import re

    from numba import config

    init = (Path(__file__).resolve().parents[2] / "__init__.py").read_text()
    version = re.search(r"^__version__ = ['\"]([^'\"]+)", init, re.M)
    parts = [f"gpurouter={version.group(1) if version else '-'}"]
    parts += [f"{d}={_dist_version(d)}" for d in DISTRIBUTIONS]
    import os

    parts += [f"{v}={os.environ.get(v, '-')}" for v in ("CUDA_HOME", "CUDA_PATH")]
    for name in ("OPT", "CUDA_DEBUGINFO_DEFAULT", "CUDA_ENABLE_PYNVJITLINK", "CUDA_DEFAULT_PTX_CC",
                 "CUDA_USE_NVIDIA_BINDING", "FASTMATH", "CUDA_ARRAY_INTERFACE_SYNC"):
        parts.append(f"{name}={getattr(config, name, '-')!r}")
    return ";".join(parts)


_SIMPLE = (type(None), bool, int, float, str, bytes, complex)


def _describe(obj, seen: dict, depth: int = 0) -> str:
    """A text that is equal for two values iff they compile the same (module docstring)."""
    if depth > 64:
        raise Uncacheable("closures nested too deep")
    if isinstance(obj, _SIMPLE) or isinstance(obj, (np.generic, np.dtype)):
        return f"{type(obj).__name__}:{obj!r}"
    if isinstance(obj, (tuple, list, frozenset, set)):
        items = [_describe(v, seen, depth + 1) for v in obj]
        if isinstance(obj, (set, frozenset)):
            items.sort()
        return f"{type(obj).__name__}({','.join(items)})"
    if isinstance(obj, dict):
        items = sorted(f"{_describe(k, seen, depth + 1)}:{_describe(v, seen, depth + 1)}" for k, v in obj.items())
        return "dict(" + ",".join(items) + ")"
    if isinstance(obj, pytypes.ModuleType):
        return f"module:{_module_name(obj)}"
    inner = getattr(obj, "py_func", None) or getattr(obj, "_defn", None)
    if inner is not None and isinstance(inner, pytypes.FunctionType):
        opts = getattr(obj, "targetoptions", None)
        tail = f"|opts={_describe(_plain_options(opts), seen, depth + 1)}" if opts else ""
        return f"{type(obj).__name__}[{_function(inner, seen, depth + 1)}{tail}]"
    if isinstance(obj, pytypes.FunctionType):
        return _function(obj, seen, depth + 1)
    if isinstance(obj, type):
        return f"class:{obj.__module__}.{obj.__qualname__}"
    mod = type(obj).__module__ or ""
    if mod.startswith(("numba", "llvmlite")):
        text = repr(obj) if mod.startswith("llvmlite") else str(obj)
        if "0x" in text:
            raise Uncacheable(f"{type(obj).__qualname__} has no address-free text")
        return f"{mod}.{type(obj).__qualname__}:{text}"
    raise Uncacheable(f"a closure or global of type {type(obj).__qualname__}")


def _module_name(mod) -> str:
    """A module's name, the same all through a process: numba's redirect modules
    (``numba.types``, a ``numba.core.utils._RedirectSubpackage``) by the module
    they stand for. ``from numba import types`` gives ``numba.core.types`` until
    something imports ``numba.types`` (a numba compile does), then the redirect
    module named ``numba.types``: a factory run after the first compile of a
    process closed over the other module, and its kernel's key differed
    between a cold process and a warm one (which compiles nothing)."""
    target = vars(mod).get("_RedirectSubpackage__new_module")
    return target if isinstance(target, str) else mod.__name__


def _plain_options(opts: dict) -> dict:
    return {k: v for k, v in opts.items() if k != "extensions" or v}


def _names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, pytypes.CodeType):
            names |= _names(c)
    return names


def _function(fn: pytypes.FunctionType, seen: dict, depth: int) -> str:
    """A function: its name, its closure's values and the globals it reads,
    recursively; each function described once (later: a reference)."""
    ident = f"{fn.__module__}.{fn.__qualname__}"
    if id(fn) in seen:
        return f"ref:{seen[id(fn)][0]}"
    seen[id(fn)] = (len(seen), fn)  # fn kept: its id stays its own while describing
    parts = [f"fn#{seen[id(fn)][0]}:{ident}"]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name bound later)
            value = None
        parts.append(f"{name}={_describe(value, seen, depth + 1)}")
    g = fn.__globals__
    for name in sorted(_names(fn.__code__)):
        if name in g:
            parts.append(f"g:{name}={_describe(g[name], seen, depth + 1)}")
    if fn.__defaults__:
        parts.append(f"defaults={_describe(fn.__defaults__, seen, depth + 1)}")
    return "{" + ";".join(parts) + "}"


def kernel_text(kernel) -> str:
    """The part of a kernel's key that is the kernel's own (module docstring)."""
    return _describe(kernel, {})


def kernel_key(kernel, argtypes, cc, driver: int) -> str | None:
    """The disk cache key of ``kernel`` for ``argtypes`` on compute capability
    ``cc`` under CUDA driver version ``driver``; None: uncacheable."""
    try:
        own = kernel_text(kernel)
    except Uncacheable:
        return None
    h = hashlib.sha256()
    for part in (source_digest(), toolchain(), f"cc={tuple(cc)}", f"driver={driver}",
                 "args=" + ",".join(str(t) for t in argtypes), own):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


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


def cubin_bytes(cubin) -> bytes:
    """The bytes of what numba's ``get_cubin`` returns: ``bytes`` in older numba-cuda, a
    ``cuda.core`` ``ObjectCode`` (its ``.code``: bytes, or a file's path) in 0.30 on a GPU."""
    if isinstance(cubin, (bytes, bytearray, memoryview)):
        return bytes(cubin)
    code = getattr(cubin, "code", None)
    if isinstance(code, (bytes, bytearray, memoryview)):
        return bytes(code)
    if isinstance(code, (str, os.PathLike)):
        with open(code, "rb") as f:
            return f.read()
    raise TypeError(f"gpurouter: cannot read a cubin from numba's {type(cubin).__name__}")


def _compile(kernel, argtypes, ordinal: int) -> tuple[int, str, bytes]:
    """numba's compile for GPU ``ordinal``: ``(CUfunction, entry name, cubin)``."""
    from .context import function_of, on_gpu

    with on_gpu(ordinal):  # numba compiles and loads; it may leave another GPU current
        compiled = kernel.compile(tuple(argtypes))
        lib = compiled._codelibrary
        cubin = cubin_bytes(lib.get_cubin())
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
            cc=None, driver=None) -> int:
    """One lookup of :func:`function_handle` (no memo): the disk entry of the
    kernel's key loaded, else compiled and stored. The GPU steps are
    injectable (the tests run this on a CPU): ``compile_fn(kernel, argtypes,
    ordinal) -> (handle, entry name, cubin)``, ``load_fn(entry, cubin,
    ordinal) -> handle`` (0: refused), ``cc`` and ``driver`` the key's."""
    compile_fn = compile_fn or _compile
    load_fn = load_fn or _load
    if cache is None:
        return compile_fn(kernel, argtypes, ordinal)[0]
    key = kernel_key(kernel, argtypes, compute_capability(ordinal) if cc is None else cc,
                     driver_version() if driver is None else driver)
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
