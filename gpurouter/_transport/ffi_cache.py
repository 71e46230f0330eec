"""The FFI handler's machine code in the kernel cache (docs/cache.md).

The ``"ffi"`` transport's handler is one ``numba.cfunc`` a process (about
two seconds to compile on a GPU host). :func:`cached_cfunc` keeps its object
code in the kernel cache (``kernels/_base/disk_cache.py``): a miss compiles
it and stores numba's own serialisation of the library
(``CodeLibrary.serialize_using_object_code``: the object code and the
bitcode of its declarations, what numba's ``cache=True`` stores), a hit
hands that back to numba's CPU codegen (``unserialize_library``) and takes
the entry point's address. numba's own ``cache=True`` cannot be used: its
key pickles the closure (the handler's intrinsics), and that pickle is not
the same in two processes.

The key: the source of the three modules that make the handler (``ffi.py``,
``ffi_abi.py``, ``ffi_record.py``: the ABI offsets and the record layout are
constants in them), the toolchain's versions (``keys.toolchain``)
and numba's CPU codegen (target triple, CPU name and features). The
handler's code holds no address of the process that compiled it (its
static messages are built on its stack), and a library with numba dynamic
globals is never stored.

:func:`compile_in_worker`: on a miss, a worker process (``ffi.py`` run as
``__main__`` by ``parallel.worker_argv``, without the package's ``__init__``)
compiles and stores the handler while this process compiles the first
plan's kernels; :func:`cached_cfunc` waits for it,
then loads the entry (or compiles, if the worker stored nothing).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

from ..kernels._base import disk_cache, keys

#: what this process did with the handler: compiled, loaded from disk, and
#: ``worker``: 1 once a worker was started to compile it
STATS = {"compiled": 0, "loaded": 0, "worker": 0}
#: the worker's end (``compile_in_worker``): set when it exits
_WORKER_DONE: list = []
_MAGIC = b"GRF1"
_SOURCES = ("ffi.py", "ffi_abi.py", "ffi_record.py")


class LoadedCFunc:
    """The handler loaded from the cache: its ``address`` (as a cfunc's), and
    the numba library that holds its code (kept alive with it)."""

    def __init__(self, address: int, library):
        self.address, self.library = int(address), library


def _codegen():
    from numba.core.registry import cpu_target

    # numba's own cache does this before it loads: it registers the C library's
    # and numba's helper symbols with LLVM (without it, the loaded object's
    # calls to memset, numba_gil_ensure, ... were bound to address 0)
    cpu_target.target_context.refresh()
    return cpu_target.target_context.codegen()


def handler_key(codegen) -> str:
    """The cache key of the handler for numba's CPU ``codegen``."""
    h = hashlib.sha256(b"gpurouter ffi handler v1\0")
    here = Path(__file__).resolve().parent
    for name in _SOURCES:
        h.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    h.update(keys.toolchain().encode() + b"\0")
    h.update(repr(codegen.magic_tuple()).encode())
    return h.hexdigest()


def _field(data: bytes, at: int) -> tuple[bytes, int]:
    n = int.from_bytes(data[at:at + 8], "little")
    if at + 8 + n > len(data):
        raise ValueError("truncated")
    return data[at + 8:at + 8 + n], at + 8 + n


def pack(library_name: str, entry: str, object_code: bytes, bitcode: bytes) -> bytes:
    """A payload: magic, then four length-prefixed fields."""
    out = [_MAGIC]
    for b in (library_name.encode(), entry.encode(), bytes(object_code), bytes(bitcode)):
        out += [len(b).to_bytes(8, "little"), b]
    return b"".join(out)


def unpack(payload: bytes) -> tuple[str, str, bytes, bytes] | None:
    if payload[:4] != _MAGIC:
        return None
    try:
        fields, at = [], 4
        for _ in range(4):
            f, at = _field(payload, at)
            fields.append(f)
    except ValueError:
        return None
    if at != len(payload) or not all(fields):
        return None
    return fields[0].decode(), fields[1].decode(), fields[2], fields[3]


def cached_cfunc(compile_fn, cache=None):
    """The handler: loaded from the cache, else ``compile_fn()`` (a numba
    ``CFunc``) stored there. ``cache``: a ``DiskCache`` (default the
    process's; None when ``GPUROUTER_CACHE=0``: compiled, nothing stored)."""
    cache = cache if cache is not None else disk_cache.default_cache()
    if cache is None:
        STATS["compiled"] += 1
        return compile_fn()
    codegen = _codegen()
    key = handler_key(codegen)
    for done in _WORKER_DONE:  # a worker is compiling it (compile_in_worker): its entry, then the load
        done.wait()
    payload = cache.load(key)
    parsed = unpack(payload) if payload is not None else None
    if parsed is not None:
        library_name, entry, object_code, bitcode = parsed
        try:
            library = codegen.unserialize_library((library_name, "object", (object_code, bitcode)))
            address = library.get_pointer_to_function(entry)
        except Exception:  # noqa: BLE001 - numba or LLVM refused the entry: compile instead
            address = 0
        if address:
            STATS["loaded"] += 1
            return LoadedCFunc(address, library)
    if payload is not None:
        disk_cache.warn_once("bad", f"the FFI handler's entry {key[:16]}... did not load; "
                             "compiling again and overwriting it.")
    handler = compile_fn()
    STATS["compiled"] += 1
    library = handler._library
    if not library.has_dynamic_globals:
        name, kind, (object_code, bitcode) = library.serialize_using_object_code()
        if kind == "object":
            cache.store(key, pack(name, handler._wrapper_name, object_code, bitcode))
    return handler


def compile_in_worker(command, cache=None) -> bool:
    """Starts one worker process, ``command`` (an argv that compiles the
    handler with :func:`cached_cfunc`: ``ffi.py`` run as a script), when the
    handler is not in the cache (once a process; not with
    ``GPUROUTER_COMPILE_WORKERS=0``, the cache off or not writable). True
    when one started."""
    if _WORKER_DONE or os.environ.get("GPUROUTER_COMPILE_WORKERS", "").strip() == "0":
        return False
    cache = cache if cache is not None else disk_cache.default_cache()
    if cache is None or not cache.writable:
        return False
    try:
        if cache.path_of(handler_key(_codegen())).exists():
            return False
        cache.folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    done = threading.Event()
    _WORKER_DONE.append(done)
    STATS["worker"] = 1
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               GPUROUTER_CACHE_DIR=str(cache.root))

    def run():
        try:
            subprocess.run(list(command), env=env, capture_output=True, timeout=600, check=False)
        except (OSError, subprocess.SubprocessError):
            pass  # cached_cfunc then compiles it here
        finally:
            done.set()

    threading.Thread(target=run, name="gpurouter-ffi-handler", daemon=True).start()
    return True
