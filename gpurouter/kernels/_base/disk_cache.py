"""A persistent, process-safe cache of compiled kernels (bytes on disk).

Where: ``$GPUROUTER_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/gpurouter``,
else ``~/.cache/gpurouter``; the entries live in its ``kernels-v1/``
folder. ``GPUROUTER_CACHE=0`` switches the cache off (every process compiles
for itself, as before). ``GPUROUTER_CACHE_MAX_MB`` bounds its size (default
:data:`DEFAULT_MAX_MB`); beyond it the least recently used entries (oldest
modification time: a hit touches its entry) are deleted.

An entry is one file, ``<key>.bin`` (the key: 64 hex digits, a SHA-256 of
everything that changes the machine code: ``keys.kernel_key``)::

    MAGIC (8 bytes) | key (64 ASCII bytes) | payload length (8, little-endian)
    | SHA-256 of the payload (32) | payload

Safety:

- writes are atomic: a temporary file in the same folder, then ``os.replace``
  (readers see the old entry or the new one, never half of one); two
  processes that write one key write the same bytes, the last rename wins;
- an entry whose magic, key, length or checksum is wrong (corrupt, truncated,
  written by something else) is a miss: the caller compiles and overwrites
  it, with one warning a process at most (:func:`warn_once`);
- a folder that cannot be created or written (read-only) still works, with no
  caching of new entries (one warning a process at most); a readable one is
  still read;
- eviction and ``clear`` ignore files that another process removed first;
- one compile for concurrent processes: a process about to compile a
  missing key first creates ``<key>.lock`` (``O_EXCL``, holding its pid and
  host); another process that misses the same key meanwhile waits for the
  entry instead of compiling it too (:meth:`DiskCache.claim`). A lock whose
  process is gone (same host), one older than the wait bound, or one the
  folder will not let us create is no reason to wait: the waiter compiles for
  itself, as without the lock. ``GPUROUTER_CACHE_WAIT_S`` bounds a wait
  (default :data:`DEFAULT_WAIT_S`; past it, one warning a process).

The compile step is the caller's (``get_or_compile(key, compile_fn)``), so
the logic runs (and is tested) without a GPU.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import tempfile
import threading
import time
import warnings
from pathlib import Path

MAGIC = b"GPRKC\x00\x01\x00"
#: the folder of the entries in the cache dir (a new layout gets a new folder)
SUBDIR = "kernels-v1"
SUFFIX = ".bin"
#: a compile in progress (:meth:`DiskCache.claim`)
LOCK_SUFFIX = ".lock"
#: default bound (seconds) of a wait for another process's compile of one kernel
DEFAULT_WAIT_S = 300.0
#: how often a waiter looks for the entry (seconds)
POLL_S = 0.05
KEY_LEN = 64
HEADER = struct.Struct(f"<8s{KEY_LEN}sQ32s")
#: default size bound, MB (a compiled router kernel is 10-200 KB)
DEFAULT_MAX_MB = 512

_WARNED: set = set()
_WARN_LOCK = threading.Lock()


def warn_once(what: str, message: str) -> None:
    """``message`` as a RuntimeWarning, once a process for each ``what``."""
    with _WARN_LOCK:
        if what in _WARNED:
            return
        _WARNED.add(what)
    warnings.warn(f"gpurouter kernel cache: {message}", RuntimeWarning, stacklevel=3)


def enabled() -> bool:
    """False when ``GPUROUTER_CACHE`` is ``0`` (or ``false``/``off``/``no``)."""
    return os.environ.get("GPUROUTER_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    """The cache's root folder (module docstring); not created here."""
    explicit = os.environ.get("GPUROUTER_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "gpurouter"


def max_bytes() -> int:
    """The size bound in bytes (``GPUROUTER_CACHE_MAX_MB``; a bad value: the default)."""
    text = os.environ.get("GPUROUTER_CACHE_MAX_MB", "")
    try:
        mb = float(text) if text else DEFAULT_MAX_MB
    except ValueError:
        mb = DEFAULT_MAX_MB
    return max(0, int(mb * 1024 * 1024))


def wait_bound() -> float:
    """``GPUROUTER_CACHE_WAIT_S`` (a bad or negative value: the default)."""
    try:
        wait = float(os.environ.get("GPUROUTER_CACHE_WAIT_S", "") or DEFAULT_WAIT_S)
    except ValueError:
        return DEFAULT_WAIT_S
    return wait if wait >= 0 else DEFAULT_WAIT_S


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


def pack(key: str, payload: bytes) -> bytes:
    """An entry's bytes: header, then ``payload``."""
    return HEADER.pack(MAGIC, key.encode("ascii"), len(payload), hashlib.sha256(payload).digest()) + payload


def unpack(key: str, data: bytes) -> bytes | None:
    """The payload of entry bytes ``data`` for ``key``; None when anything is off."""
    if len(data) < HEADER.size:
        return None
    magic, echo, length, digest = HEADER.unpack_from(data)
    payload = data[HEADER.size:]
    if magic != MAGIC or echo != key.encode("ascii") or length != len(payload):
        return None
    if hashlib.sha256(payload).digest() != digest:
        return None
    return payload


class DiskCache:
    """The entries under ``root/SUBDIR`` (module docstring), bounded to ``limit`` bytes."""

    def __init__(self, root: Path | str, limit: int | None = None):
        self.root = Path(root)
        self.folder = self.root / SUBDIR
        self.limit = max_bytes() if limit is None else int(limit)
        self.writable = True
        self.stats = {"hits": 0, "misses": 0, "bad": 0, "writes": 0, "evicted": 0}

    def path_of(self, key: str) -> Path:
        if len(key) != KEY_LEN or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"gpurouter kernel cache: a key is {KEY_LEN} lowercase hex digits, got {key!r}")
        return self.folder / (key + SUFFIX)

    def load(self, key: str) -> bytes | None:
        """The payload stored for ``key``, or None (no entry, or a bad one: warned once)."""
        path = self.path_of(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            self.stats["misses"] += 1
            return None
        except OSError as e:
            self.stats["misses"] += 1
            warn_once("unreadable", f"cannot read {path} ({e}); compiling instead.")
            return None
        payload = unpack(key, data)
        if payload is None:
            self.stats["bad"] += 1
            warn_once("bad", f"{path} is corrupt, truncated or not an entry of this key; "
                      "compiling again and overwriting it (further bad entries are not reported).")
            return None
        self.stats["hits"] += 1
        try:
            os.utime(path)  # the LRU clock: a hit is a use
        except OSError:
            pass
        return payload

    def store(self, key: str, payload: bytes) -> bool:
        """Writes ``payload`` for ``key`` atomically; False (warned once) where the
        folder is not writable, and no further writes are tried by this object."""
        if not self.writable:
            return False
        path = self.path_of(key)
        tmp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=self.folder)
            with os.fdopen(fd, "wb") as f:
                f.write(pack(key, payload))
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the entry from another user of the folder
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            self.writable = False
            warn_once("unwritable", f"cannot write to {self.folder} ({e}); kernels are compiled "
                      "but not cached in this process (GPUROUTER_CACHE_DIR picks another folder, "
                      "GPUROUTER_CACHE=0 turns the cache off).")
            return False
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self.stats["writes"] += 1
        self.evict()
        return True

    def lock_of(self, key: str) -> Path:
        return self.path_of(key).with_suffix(LOCK_SUFFIX)

    def _stale(self, lock: Path, wait: float) -> bool:
        """Whether ``lock`` is no compile in progress: its process is this one or
        gone (same host), or it is older than ``wait`` (an unreadable or
        half-written one too, after a second)."""
        try:
            text, age = lock.read_text(), time.time() - lock.stat().st_mtime
        except OSError:
            return False  # just released (the entry is there) or just taken
        pid, _, host = text.partition(" ")
        if pid.isdigit() and host.strip() == socket.gethostname():
            return int(pid) == os.getpid() or not _alive(int(pid))
        return age > (wait if pid.isdigit() else 1.0)

    def claim(self, key: str, wait: float | None = None) -> bool:
        """Before compiling a missing ``key``: True when this process now holds its
        lock and the entry is still missing (compile, :meth:`store`, then
        :meth:`release`). False when another process held it and its entry is
        there now, or it held it longer than ``wait`` seconds (default
        :func:`wait_bound`; warned once), or no lock can be made here (a
        read-only folder). On False, look the entry up again and compile
        without the lock when it is still missing."""
        wait = wait_bound() if wait is None else wait
        lock, entry = self.lock_of(key), self.path_of(key)
        deadline = time.monotonic() + wait
        try:
            if not self.writable:
                return False
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False  # no lock here (an unusable folder): compile as without one
        while True:
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if entry.exists():
                    return False
                if self._stale(lock, wait):
                    try:
                        lock.unlink()
                    except OSError:
                        pass
                    continue
                if time.monotonic() > deadline:
                    warn_once("wait", f"waited {wait:.0f} s for another process's compile of "
                              f"{key[:16]}... (its lock {lock}); compiling here instead "
                              "(GPUROUTER_CACHE_WAIT_S sets the bound).")
                    return False
                time.sleep(POLL_S)
                continue
            except OSError:
                return False  # no lock here (read-only): compile as without one
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()} {socket.gethostname()}")
            if entry.exists():  # stored by a process that released its lock just now
                self.release(key)
                return False
            return True

    def release(self, key: str) -> None:
        """Removes this process's lock of ``key`` (:meth:`claim`), if still its own."""
        lock = self.lock_of(key)
        try:
            if lock.read_text().partition(" ")[0] == str(os.getpid()):
                lock.unlink()
        except OSError:
            pass

    def get_or_compile(self, key: str, compile_fn) -> bytes:
        """The payload for ``key``: from disk, else ``compile_fn()`` (bytes),
        stored; concurrent processes compile it once (:meth:`claim`)."""
        payload = self.load(key)
        if payload is not None:
            return payload
        held = self.claim(key)
        try:
            payload = None if held else self.load(key)
            if payload is None:
                payload = compile_fn()
                self.store(key, payload)
        finally:
            if held:
                self.release(key)
        return payload

    def entries(self) -> list[tuple[Path, int, float]]:
        """``(path, bytes, mtime)`` of every entry (files removed meanwhile skipped)."""
        out = []
        try:
            names = os.listdir(self.folder)
        except OSError:
            return out
        for name in names:
            if not name.endswith(SUFFIX):
                continue
            path = self.folder / name
            try:
                st = path.stat()
            except OSError:
                continue
            out.append((path, int(st.st_size), float(st.st_mtime)))
        return out

    def evict(self) -> int:
        """Deletes the least recently used entries until the total is at most
        ``limit``; returns how many this call deleted."""
        items = self.entries()
        total = sum(size for _, size, _ in items)
        if total <= self.limit:
            return 0
        gone = 0
        for path, size, _ in sorted(items, key=lambda it: it[2]):
            if total <= self.limit:
                break
            try:
                path.unlink()
                gone += 1
            except FileNotFoundError:
                pass  # another process evicted it first
            except OSError:
                break  # read-only: nothing more to do
            total -= size
        self.stats["evicted"] += gone
        return gone

    def info(self) -> dict:
        """The folder, the entry count and bytes, the bound, whether it is on, and
        the compiles in progress (``compiling``: lock files, :meth:`claim`)."""
        items = self.entries()
        try:
            locks = sum(name.endswith(LOCK_SUFFIX) for name in os.listdir(self.folder))
        except OSError:
            locks = 0
        return {"dir": str(self.folder), "enabled": enabled(), "entries": len(items),
                "bytes": sum(size for _, size, _ in items), "max_bytes": self.limit, "compiling": locks}

    def clear(self) -> int:
        """Deletes every entry, leftover temporary file and lock; returns the entries deleted."""
        gone = 0
        try:
            names = os.listdir(self.folder)
        except OSError:
            return 0
        for name in names:
            if not name.endswith((SUFFIX, ".tmp", LOCK_SUFFIX)):
                continue
            try:
                os.unlink(self.folder / name)
                gone += name.endswith(SUFFIX)
            except FileNotFoundError:
                pass
        return gone


_DEFAULT: list = []
_DEFAULT_LOCK = threading.Lock()


def default_cache() -> DiskCache | None:
    """The process's cache (the environment as of its first use), or None
    when ``GPUROUTER_CACHE=0``."""
    if not enabled():
        return None
    with _DEFAULT_LOCK:
        root = cache_dir()
        if not _DEFAULT or _DEFAULT[0].root != root:
            _DEFAULT[:] = [DiskCache(root)]
        return _DEFAULT[0]
