"""_transport/ffi_cache.py's worker: the FFI handler compiled by another
process while this one compiles the first plan's kernels (docs/cache.md).
CPU: the worker's command is faked (a short script); the handler's real
compile in a fresh process is ``tests/test_kernel_cache.py``'s."""

from __future__ import annotations

import sys

import pytest

from gpurouter._transport import ffi_cache
from gpurouter.kernels._base import disk_cache


class _Library:
    has_dynamic_globals = True  # never stored: the test's handler is not real code


class _Handler:  # the two attributes of a numba cfunc that the cache reads
    _library = _Library()
    _wrapper_name = "test_handler"


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(ffi_cache, "_WORKER_DONE", [])
    monkeypatch.setattr(ffi_cache, "STATS", dict.fromkeys(ffi_cache.STATS, 0))
    monkeypatch.delenv("GPUROUTER_COMPILE_WORKERS", raising=False)
    monkeypatch.setenv("GPUROUTER_SEEDS", "0")  # the package's handler seed would answer instead of a worker


def test_the_handler_waits_for_its_worker_then_compiles_when_it_stored_nothing(tmp_path, fresh):
    cache = disk_cache.DiskCache(tmp_path / "cache")
    marker = tmp_path / "worker-ended"
    # the worker: a pause, then a marker; it stores nothing
    command = [sys.executable, "-c", f"import time, pathlib; time.sleep(1.0); pathlib.Path({str(marker)!r}).touch()"]
    assert ffi_cache.compile_in_worker(command, cache)
    assert not ffi_cache.compile_in_worker(command, cache)  # once a process
    seen = []

    def compile_fn():
        seen.append(marker.exists())  # cached_cfunc waited for the worker's end
        return _Handler()

    assert isinstance(ffi_cache.cached_cfunc(compile_fn, cache=cache), _Handler)
    assert seen == [True]
    assert ffi_cache.STATS == {"compiled": 1, "loaded": 0, "seeded": 0, "worker": 1}


def test_no_worker_when_off_or_already_stored(tmp_path, fresh, monkeypatch):
    cache = disk_cache.DiskCache(tmp_path)
    command = [sys.executable, "-c", "raise SystemExit(1)"]
    monkeypatch.setenv("GPUROUTER_COMPILE_WORKERS", "0")
    assert not ffi_cache.compile_in_worker(command, cache)
    monkeypatch.delenv("GPUROUTER_COMPILE_WORKERS")
    cache.store(ffi_cache.handler_key(ffi_cache._codegen()), b"an entry")
    assert not ffi_cache.compile_in_worker(command, cache)  # on disk (a bad entry is cached_cfunc's to mend)
    unwritable = disk_cache.DiskCache(tmp_path / "other")
    unwritable.writable = False
    assert not ffi_cache.compile_in_worker(command, unwritable)
    assert ffi_cache.STATS["worker"] == 0 and not ffi_cache._WORKER_DONE
    assert ffi_cache.compile_in_worker(command, disk_cache.DiskCache(tmp_path / "empty"))
    ffi_cache._WORKER_DONE[0].wait(60)  # a worker that fails ends too
    assert ffi_cache._WORKER_DONE[0].is_set() and ffi_cache.STATS["worker"] == 1
