"""Seeds: the presets' kernels shipped as PTX, so that an empty cache's first step compiles nothing.

With an empty cache, a first router step pays numba's compile of each kernel
it launches: 5.5 s for the largest, mostly numba's typing and lowering in
Python (docs/cache.md). What that part makes is PTX, and PTX depends on the
kernel, its argument types, numba's, numba-cuda's and llvmlite's versions and
the PTX target: not on the driver or the GPU's serial. The package ships, in
``gpurouter/seeds/``, the PTX of the kernels that each preset's first router
step launches (``python -m gpurouter cache make-seeds``, run on a GPU).

On a miss of the disk cache, ``kernel_cache.resolve`` looks for the kernel's
seed before it compiles: the driver's linker (``cuLinkAddData``) turns the
PTX into a cubin in a fraction of a second, and that cubin is stored under
the kernel's own key and loaded like any entry. A later process loads the
cubin.

The seed's key (``keys.seed_key``) is the kernel's key without the CUDA
packages (NVVM, nvJitLink, the runtime) and the driver, and with the PTX
target ``compute_<major><minor>`` of the GPU in place of its compute
capability. So a seed that another NVVM made is used: its PTX compiles the
same IR, and this driver links it. No seed, an unreadable one or one that
the driver refuses (a PTX ISA newer than the driver knows) means numba's
compile, as before. ``GPUROUTER_SEEDS=0`` turns seeds off;
``GPUROUTER_CACHE=0`` does too (every kernel compiled in the process).

Only a kernel whose cubin numba links from one PTX module (after link-time
optimisation where numba uses it) and no other file gets a seed: the
others' cubins are not what one PTX makes.
"""

from __future__ import annotations

import ctypes
import functools
import json
import lzma
import os
from pathlib import Path

from . import keys

#: where the package's seeds live: ``<key>.seed`` files and ``MANIFEST.json``
SEED_DIR = Path(__file__).resolve().parents[2] / "seeds"
_MAGIC = b"GRS1"
#: what this process did: seeds ``linked`` into cubins, ``refused`` by the driver or unreadable
STATS = {"linked": 0, "refused": 0}
#: ``make-seeds`` sets a list here, and every kernel numba compiles in the process is appended (:func:`record`)
RECORDING: list | None = None


def enabled() -> bool:
    """False when ``GPUROUTER_SEEDS`` is ``0`` (or ``false``/``off``/``no``)."""
    return os.environ.get("GPUROUTER_SEEDS", "1").strip().lower() not in ("0", "false", "off", "no")


@functools.cache
def index(folder: Path) -> frozenset:
    """The keys of the seeds in ``folder``."""
    try:
        return frozenset(p.stem for p in folder.glob("*.seed"))
    except OSError:
        return frozenset()


def pack(entry: str, ptx: str, max_registers: int | None) -> bytes:
    """A seed file: magic, a JSON header (entry name, register bound), the xz-compressed PTX."""
    head = json.dumps({"entry": entry, "max_registers": max_registers}).encode()
    return _MAGIC + len(head).to_bytes(4, "little") + head + lzma.compress(ptx.encode())


def unpack(data: bytes) -> tuple[str, bytes, int | None] | None:
    """``(entry, ptx, max_registers)`` of a seed file; None when it is not one."""
    try:
        if data[:4] != _MAGIC:
            return None
        n = int.from_bytes(data[4:8], "little")
        head = json.loads(data[8:8 + n])
        ptx = lzma.decompress(data[8 + n:])
        entry, regs = head["entry"], head.get("max_registers")
    except (ValueError, KeyError, TypeError, lzma.LZMAError):
        return None
    if not isinstance(entry, str) or not entry or not (regs is None or isinstance(regs, int)):
        return None
    return entry, ptx, regs


def cubin_of(kernel, argtypes, cc, ordinal: int, *, folder: Path | None = None, link_fn=None):
    """``(entry, cubin)`` of the kernel's seed linked for GPU ``ordinal``; None
    when there is no seed, it is unreadable or the driver refuses it.
    ``folder``: the seeds' (default :data:`SEED_DIR`)."""
    if not enabled():
        return None
    folder = folder or SEED_DIR
    key = keys.seed_key(kernel, argtypes, cc)
    if key is None or key not in index(folder):
        return None
    try:
        parsed = unpack((folder / f"{key}.seed").read_bytes())
    except OSError:
        parsed = None
    cubin = (link_fn or link)(parsed[1], parsed[2], ordinal) if parsed is not None else None
    if not cubin:
        STATS["refused"] += 1
        return None
    STATS["linked"] += 1
    return parsed[0], cubin


def has(kernel, argtypes, cc, folder: Path | None = None) -> bool:
    """Whether the kernel has a seed for ``cc`` (``parallel`` sends no worker for it)."""
    if not enabled():
        return False
    key = keys.seed_key(kernel, argtypes, cc)
    return key is not None and key in index(folder or SEED_DIR)


@functools.cache
def _linker():
    from .context import libcuda

    lib = libcuda()
    vp, ui, sz = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
    for name, args in (("cuLinkCreate_v2", [ui, vp, vp, ctypes.POINTER(vp)]),
                       ("cuLinkAddData_v2", [vp, ctypes.c_int, ctypes.c_char_p, sz, ctypes.c_char_p, ui, vp, vp]),
                       ("cuLinkComplete", [vp, ctypes.POINTER(vp), ctypes.POINTER(sz)]),
                       ("cuLinkDestroy", [vp])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def link(ptx: bytes, max_registers: int | None, ordinal: int) -> bytes | None:
    """The cubin the driver's linker makes of ``ptx`` for GPU ``ordinal`` (with
    numba's register bound, as numba links it); None when it refuses."""
    from .context import on_gpu

    lib = _linker()
    opts = (ctypes.c_int * 1)(0)  # CU_JIT_MAX_REGISTERS
    vals = (ctypes.c_void_p * 1)(max_registers or 0)
    state, out, size = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t(0)
    text = bytes(ptx) + b"\0"
    with on_gpu(ordinal):
        if lib.cuLinkCreate_v2(1 if max_registers else 0, opts, vals, ctypes.byref(state)) != 0:
            return None
        try:
            if lib.cuLinkAddData_v2(state, 1, text, len(text), b"seed.ptx", 0, None, None) != 0:  # ..._INPUT_PTX
                return None
            if lib.cuLinkComplete(state, ctypes.byref(out), ctypes.byref(size)) != 0 or not out.value:
                return None
            return ctypes.string_at(out.value, size.value)  # copied before the state (which owns it) goes
        finally:
            lib.cuLinkDestroy(state)


def record(kernel, argtypes, cc, library) -> None:
    """Called by ``make-seeds`` after numba compiled ``kernel``: while
    :data:`RECORDING` is a list, a dict of the kernel, its argument types,
    ``cc``, entry name, register bound and PTX is appended to it; ``skipped``
    says why a kernel has no PTX to ship (module docstring), "" when it has.
    Never raises: a compile does not fail for its record."""
    if RECORDING is None:
        return
    try:
        ptx, why = _ptx_of(library)
    except Exception as e:  # noqa: BLE001  (reported by make-seeds)
        ptx, why = None, f"{type(e).__name__}: {e}"
    RECORDING.append({"kernel": kernel, "argtypes": tuple(argtypes), "cc": tuple(cc),
                      "entry": str(getattr(library, "_entry_name", "")), "ptx": ptx,
                      "max_registers": getattr(library, "_max_registers", None), "skipped": why})


def _ptx_of(library) -> tuple[str | None, str]:
    """The one PTX module that makes ``library``'s cubin, and "" ; or None and why not."""
    files = getattr(library, "_linking_files", None)
    if files or getattr(library, "needs_cudadevrt", False):
        return None, f"links files ({sorted(map(str, files or ()))}, cudadevrt={library.needs_cudadevrt})"
    if getattr(library, "_lto", False):
        return library.get_lto_ptx(), ""  # the PTX after link-time optimisation: what the cubin is made of
    ptxes = library.get_asm_strs()  # numba's own target (compute_90a on 9.0): the PTX it linked
    if len(ptxes) != 1:
        return None, f"{len(ptxes)} PTX modules"
    return ptxes[0], ""


def status(folder: Path | None = None) -> dict:
    """The package's seeds: ``count``, PTX ``targets``, when and where they were
    ``made``, and ``unusable``: why this process cannot use them ("" when it can;
    the GPU's compute capability aside)."""
    folder = folder or SEED_DIR
    try:
        manifest = json.loads((folder / "MANIFEST.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    count = len(index(folder))
    why = ""
    if not enabled():
        why = "GPUROUTER_SEEDS=0"
    elif not count:
        why = "the package has no seeds"
    else:
        try:
            digest, toolchain = keys.source_digest(), keys.seed_toolchain()
        except ImportError:
            digest = toolchain = None
        if toolchain is None:
            why = "numba is not installed"
        elif manifest.get("source_digest") != digest:
            why = "stale: made for other kernel sources (python -m gpurouter cache make-seeds, on a GPU)"
        elif manifest.get("seed_toolchain") != toolchain:
            theirs, ours = str(manifest.get("seed_toolchain")).split(";"), toolchain.split(";")
            why = (f"made with {';'.join(t for t in theirs if t not in ours) or '?'}; this process has "
                   f"{';'.join(t for t in ours if t not in theirs)}")
    targets = sorted({s.get("ptx", "?") for s in manifest.get("seeds", {}).values()})
    return {"count": count, "targets": targets, "made": manifest.get("made"), "unusable": why}
