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
import lzma
import os
import subprocess
import sys
import threading
from pathlib import Path

from ..kernels._base import disk_cache, keys, seeds

#: what this process did with the handler: compiled, loaded from disk,
#: ``seeded``: made from the package's seed, and ``worker``: 1 once a worker
#: was started to compile it
STATS = {"compiled": 0, "loaded": 0, "seeded": 0, "worker": 0}
#: the worker's end (``compile_in_worker``): set when it exits
_WORKER_DONE: list = []
_MAGIC = b"GRF1"
_SEED_MAGIC = b"GRH1"
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


def _sources_into(h) -> None:
    here = Path(__file__).resolve().parent
    for name in _SOURCES:
        h.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")


def handler_key(codegen) -> str:
    """The cache key of the handler for numba's CPU ``codegen``."""
    h = hashlib.sha256(b"gpurouter ffi handler v1\0")
    _sources_into(h)
    h.update(keys.toolchain().encode() + b"\0")
    h.update(repr(codegen.magic_tuple()).encode())
    return h.hexdigest()


def sources_digest() -> str:
    """SHA-256 of the handler's three source files (the seed's manifest keeps it)."""
    h = hashlib.sha256()
    _sources_into(h)
    return h.hexdigest()


def seed_key(codegen) -> str:
    """The key of the handler's seed: its sources, ``keys.seed_toolchain`` and
    the target triple (not the CPU: the seed is bitcode for a generic one)."""
    h = hashlib.sha256(b"gpurouter ffi handler seed v1\0")
    _sources_into(h)
    h.update(keys.seed_toolchain().encode() + b"\0")
    h.update(str(codegen.magic_tuple()[0]).encode())
    return h.hexdigest()


def seed_path(codegen, folder: Path | None = None) -> Path:
    """Where the handler's seed for ``codegen`` is (or would be) in the package."""
    return (folder or seeds.SEED_DIR) / f"handler-{seed_key(codegen)}.hseed"


def pack_seed(library_name: str, entry: str, bitcode: bytes) -> bytes:
    return _SEED_MAGIC + lzma.compress(pack(library_name, entry, b"bitcode", bitcode))


def unpack_seed(data: bytes) -> tuple[str, str, bytes] | None:
    if data[:4] != _SEED_MAGIC:
        return None
    try:
        parsed = unpack(lzma.decompress(data[4:]))
    except lzma.LZMAError:
        return None
    return None if parsed is None or parsed[2] != b"bitcode" else (parsed[0], parsed[1], parsed[3])


def _from_seed(codegen, folder: Path | None = None):
    """``(library, entry, address)`` of the handler made from the package's
    seed by LLVM for this host (object caching on, so that the result can be
    stored); None without a usable seed."""
    if not seeds.enabled():
        return None
    try:
        parsed = unpack_seed(seed_path(codegen, folder).read_bytes())
    except OSError:
        return None
    if parsed is None:
        return None
    library_name, entry, bitcode = parsed
    try:
        import llvmlite.binding as ll

        library = codegen.create_library(library_name)
        library.enable_object_caching()
        library._final_module = ll.parse_bitcode(bitcode)  # what numba's unserialize of "bitcode" does
        library._finalize_final_module()
        address = library.get_pointer_to_function(entry)
    except Exception:  # noqa: BLE001 - LLVM refused it: compile instead
        return None
    return (library, entry, address) if address else None


def _store(cache, key: str, library, entry: str) -> None:
    """The handler's machine code stored under ``key`` (a library with numba
    dynamic globals is never stored: module docstring)."""
    if not library.has_dynamic_globals:
        name, kind, (object_code, bitcode) = library.serialize_using_object_code()
        if kind == "object":
            cache.store(key, pack(name, entry, object_code, bitcode))


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
    seeded = _from_seed(codegen)
    if seeded is not None:
        library, entry, address = seeded
        STATS["seeded"] += 1
        _store(cache, key, library, entry)
        return LoadedCFunc(address, library)
    handler = compile_fn()
    STATS["compiled"] += 1
    _store(cache, key, handler._library, handler._wrapper_name)
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
        codegen = _codegen()
        if cache.path_of(handler_key(codegen)).exists():
            return False
        if seeds.enabled() and seed_path(codegen).exists():  # made from it in the process, in 0.1 s
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


def write_seed(folder, compile_fn) -> Path:
    """Compiles the handler in this process (``compile_fn``: ``ffi._compile_handler``)
    and writes its seed (numba's bitcode) into ``folder``, replacing older
    handler seeds; the path. Run it in a process with ``NUMBA_CPU_NAME=generic``
    (:func:`make_seed`), so that the bitcode is not optimised for this machine's CPU."""
    handler = compile_fn()
    library = handler._library
    if library.has_dynamic_globals:
        raise RuntimeError("gpurouter: the FFI handler holds dynamic globals; it cannot be seeded")
    name, _, bitcode = library.serialize_using_bitcode()
    folder = Path(folder)
    path = seed_path(_codegen(), folder)
    for old in folder.glob("handler-*.hseed"):
        if old != path:
            old.unlink()
    path.write_bytes(pack_seed(name, handler._wrapper_name, bitcode))
    return path


def make_seed(folder) -> Path:
    """:func:`write_seed` in a fresh process for a generic CPU (``cache make-seeds``)."""
    package = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NUMBA_CPU_NAME="generic", GPUROUTER_CACHE="0",
               PYTHONPATH=os.pathsep.join([str(package), *(p for p in sys.path if p)]))
    env.pop("NUMBA_CPU_FEATURES", None)  # numba's default for "generic": none
    code = ("import sys; from gpurouter._transport import ffi, ffi_cache; "
            "print(ffi_cache.write_seed(sys.argv[1], ffi._compile_handler))")
    proc = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError("gpurouter: the FFI handler's seed was not made: "
                           + (proc.stderr.strip().splitlines() or ["?"])[-1])
    return Path(proc.stdout.strip().splitlines()[-1])
