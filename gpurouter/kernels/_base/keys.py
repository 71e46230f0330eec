"""The disk cache's key of a kernel: everything that changes its machine code
(``kernel_cache``'s module docstring says what goes in; docs/cache.md).

A value the key cannot describe (an object whose repr holds an address)
raises :class:`Uncacheable`: such a kernel is compiled, never guessed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import types as pytypes
from pathlib import Path

import numpy as np

#: modules of ``gpurouter/kernels`` left out of :func:`source_digest`: the
#: cache's own lookup code, which makes no machine code (an edit there keeps
#: every key, and the shipped seeds, valid)
CACHE_MODULES = frozenset({"_base/disk_cache.py", "_base/kernel_cache.py", "_base/keys.py",
                           "_base/parallel.py", "_base/seeds.py"})


#: in every kernel key: changed when the cubin stored under a key changes while
#: the key's other parts do not. "entries=2": a seed is linked by numba's own
#: linker (``seeds.link``); entries of before held the driver's link of a seed,
#: slower code (docs/cache.md), and are never read again.
ENTRIES = "entries=2"


class Uncacheable(Exception):
    """A kernel whose key cannot be computed (it is compiled without the cache)."""


@functools.cache
def source_digest() -> str:
    """SHA-256 of every ``.py`` file of ``gpurouter/kernels`` but ``CACHE_MODULES``
    (path and bytes, sorted)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in CACHE_MODULES:
            continue
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


def _gpurouter_version() -> str:
    import re

    init = (Path(__file__).resolve().parents[2] / "__init__.py").read_text()
    version = re.search(r"^__version__ = ['\"]([^'\"]+)", init, re.M)
    return version.group(1) if version else "-"


def _codegen_config() -> list:
    from numba import config

    return [f"{name}={getattr(config, name, '-')!r}"
            for name in ("OPT", "CUDA_DEBUGINFO_DEFAULT", "CUDA_ENABLE_PYNVJITLINK", "CUDA_DEFAULT_PTX_CC",
                         "CUDA_USE_NVIDIA_BINDING", "FASTMATH", "CUDA_ARRAY_INTERFACE_SYNC")]


@functools.cache
def toolchain() -> str:
    """gpurouter's, numba's and the CUDA packages' versions and numba's
    config values that change code generation, as one string."""
    parts = [f"gpurouter={_gpurouter_version()}"]
    parts += [f"{d}={_dist_version(d)}" for d in DISTRIBUTIONS]
    parts += [f"{v}={os.environ.get(v, '-')}" for v in ("CUDA_HOME", "CUDA_PATH")]
    return ";".join(parts + _codegen_config())


#: what a seed's PTX depends on besides the kernel (``seeds``): numba's
#: lowering, not NVVM, ptxas or the driver
SEED_DISTRIBUTIONS = ("numba", "numba-cuda", "llvmlite")


@functools.cache
def seed_toolchain() -> str:
    """:func:`toolchain` without the CUDA packages and paths (``seeds``'s key)."""
    parts = [f"gpurouter={_gpurouter_version()}"] + [f"{d}={_dist_version(d)}" for d in SEED_DISTRIBUTIONS]
    return ";".join(parts + _codegen_config())


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
    return _digest(kernel, argtypes, (toolchain(), f"cc={tuple(cc)}", f"driver={driver}", ENTRIES))


def seed_key(kernel, argtypes, cc) -> str | None:
    """The key of ``kernel``'s shipped seed (``seeds``) for ``argtypes`` and the
    PTX target of compute capability ``cc``; None: uncacheable."""
    return _digest(kernel, argtypes, (seed_toolchain(), f"ptx=compute_{cc[0]}{cc[1]}"))


def _digest(kernel, argtypes, parts) -> str | None:
    try:
        own = kernel_text(kernel)
    except Uncacheable:
        return None
    h = hashlib.sha256()
    for part in (source_digest(), *parts, "args=" + ",".join(str(t) for t in argtypes), own):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()
