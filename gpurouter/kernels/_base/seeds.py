"""Seeds: the presets' kernels shipped as numba's compiler output, so that an empty cache's first step compiles nothing.

With an empty cache, a first router step pays numba's compile of each kernel
it launches: 5.5 s for the largest, mostly numba's typing and lowering in
Python (docs/cache.md). What that part makes is NVVM's output: LTO-IR, which
numba-cuda links with link-time optimisation (nvJitLink) into the cubin, or
PTX where it links without. It depends on the kernel, its argument types,
numba's, numba-cuda's and llvmlite's versions and the GPU architecture: not
on the driver or the GPU's serial. The package ships, in ``gpurouter/seeds/``,
that code of the kernels that each preset's first router step launches
(``python -m gpurouter cache make-seeds``, run on a GPU).

On a miss of the disk cache, ``kernel_cache.resolve`` looks for the kernel's
seed before it compiles: numba's own linker (``link``: the step numba's
compile ends with) turns it into the cubin a compile makes, byte for byte, in
a fraction of a second, and that cubin is stored under the kernel's own key
and loaded like any entry. A later process loads the cubin.

The seed's key (``keys.seed_key``) is the kernel's key without the CUDA
packages (NVVM, nvJitLink, the runtime) and the driver, and with the target
``compute_<major><minor>`` of the GPU in place of its compute capability. A
seed that another NVVM made is tried: a linker that refuses its code (an
LTO-IR or PTX version newer than it knows) means numba's compile, as does
no seed or an unreadable one. ``GPUROUTER_SEEDS=0`` turns seeds off;
``GPUROUTER_CACHE=0`` does too (every kernel compiled in the process).

Only a kernel whose cubin numba links from one module (its LTO-IR, or one PTX
module) and no other file gets a seed: the others' cubins are not what one
module makes.
"""

from __future__ import annotations

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


#: what a seed's code is: numba's LTO-IR (``ltoir``: numba-cuda links its kernels
#: with link-time optimisation where nvJitLink is found) or PTX (``ptx``: without it)
KINDS = ("ltoir", "ptx")


def pack(entry: str, code: bytes | str, max_registers: int | None, kind: str = "ptx") -> bytes:
    """A seed file: magic, a JSON header (entry name, register bound, kind), the xz-compressed code."""
    if kind not in KINDS:
        raise ValueError(f"gpurouter: a seed's kind is one of {KINDS}, not {kind!r}")
    head = json.dumps({"entry": entry, "max_registers": max_registers, "kind": kind}).encode()
    data = code.encode() if isinstance(code, str) else bytes(code)
    return _MAGIC + len(head).to_bytes(4, "little") + head + lzma.compress(data)


def unpack(data: bytes) -> tuple[str, bytes, int | None, str] | None:
    """``(entry, code, max_registers, kind)`` of a seed file; None when it is not one."""
    try:
        if data[:4] != _MAGIC:
            return None
        n = int.from_bytes(data[4:8], "little")
        head = json.loads(data[8:8 + n])
        code = lzma.decompress(data[8 + n:])
        entry, regs, kind = head["entry"], head.get("max_registers"), head.get("kind", "ptx")
    except (ValueError, KeyError, TypeError, lzma.LZMAError):
        return None
    if not isinstance(entry, str) or not entry or not (regs is None or isinstance(regs, int)) or kind not in KINDS:
        return None
    return entry, code, regs, kind


def cubin_of(kernel, argtypes, cc, ordinal: int, *, folder: Path | None = None, link_fn=None):
    """``(entry, cubin)`` of the kernel's seed linked for GPU ``ordinal``; None
    when there is no seed, it is unreadable or the linker refuses it.
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
    cubin = (link_fn or link)(parsed[1], parsed[2], ordinal, cc, parsed[3]) if parsed is not None else None
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


def numba_target(cc) -> tuple:
    """The target numba compiles and links for compute capability ``cc``: ``(major,
    minor, "a")`` from 9.0 on (sm_90a), else ``(major, minor, "")``: numba-cuda's
    ``CUDACodeLibrary._ensure_cc`` rule."""
    return (int(cc[0]), int(cc[1]), "a" if tuple(cc[:2]) >= (9, 0) else "")


def link(code: bytes, max_registers: int | None, ordinal: int, cc, kind: str = "ptx") -> bytes | None:
    """The cubin of a seed's ``code`` (``kind``: ``KINDS``) for GPU ``ordinal``
    (compute capability ``cc``), made as numba makes its own: numba-cuda's
    linker (``cuda.core``'s, on nvJitLink), numba's target and register bound,
    and link-time optimisation of LTO-IR. So a seeded kernel is the machine code
    of a compiled one. Until 5a31770 the seeds were the PTX after LTO, linked by
    the driver until 648ed78: other code, DeepSeek-V3's top-k forward 7% slower
    (docs/cache.md, "Seeds"). numba-cuda's ``_Linker`` is not public API: the
    seeds are only used with the numba-cuda they were made with (their key).
    None when the linker refuses (numba compiles the kernel then)."""
    from numba.cuda.cudadrv import driver as numba_driver

    from .context import on_gpu

    try:
        with on_gpu(ordinal):
            linker = numba_driver._Linker(max_registers=max_registers, cc=numba_target(cc), lto=kind == "ltoir")
            if kind == "ltoir":
                linker.add_ltoir(bytes(code))
            else:
                linker.add_ptx(bytes(code))
            return cubin_bytes(linker.complete()) or None
    except Exception:  # noqa: BLE001  (any refusal: numba compiles the kernel instead)
        return None


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



def record(kernel, argtypes, cc, library) -> None:
    """Called by ``make-seeds`` after numba compiled ``kernel``: while
    :data:`RECORDING` is a list, a dict of the kernel, its argument types,
    ``cc``, entry name, register bound, code and its kind is appended to it;
    ``skipped`` says why a kernel has no code to ship (module docstring), "" when it has.
    Never raises: a compile does not fail for its record."""
    if RECORDING is None:
        return
    try:
        code, kind, why = _code_of(library)
    except Exception as e:  # noqa: BLE001  (reported by make-seeds)
        code, kind, why = None, "", f"{type(e).__name__}: {e}"
    RECORDING.append({"kernel": kernel, "argtypes": tuple(argtypes), "cc": tuple(cc),
                      "entry": str(getattr(library, "_entry_name", "")), "code": code, "kind": kind,
                      "max_registers": getattr(library, "_max_registers", None), "skipped": why})


def _code_of(library) -> tuple[bytes | None, str, str]:
    """``(code, kind, "")``: what numba makes ``library``'s cubin of (its LTO-IR, or
    its one PTX module without LTO); or ``(None, "", why not)``."""
    files = getattr(library, "_linking_files", None)
    if files or getattr(library, "needs_cudadevrt", False):
        return None, "", f"links files ({sorted(map(str, files or ()))}, cudadevrt={library.needs_cudadevrt})"
    if getattr(library, "_lto", False):
        return bytes(library.get_ltoir()), "ltoir", ""  # numba's target (sm_90a on 9.0), as get_cubin links it
    ptxes = library.get_asm_strs()
    if len(ptxes) != 1:
        return None, "", f"{len(ptxes)} PTX modules"
    return ptxes[0].encode(), "ptx", ""


def status(folder: Path | None = None) -> dict:
    """The package's seeds: ``count``, their ``targets``, when and where they were
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
    targets = sorted({s.get("target", s.get("ptx", "?")) for s in manifest.get("seeds", {}).values()})
    return {"count": count, "targets": targets, "made": manifest.get("made"), "unusable": why}
