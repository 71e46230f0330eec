"""kernels/_base/parallel.py: the missing kernels compiled in spawn worker
processes into the disk cache, then loaded by the parent.

CPU: the compile step is faked by module-level functions of
``_parallel_fakes`` (the workers import them); the workers are real spawn
processes. GPU (``-m gpu``): a real plan's kernels compiled by workers, then
loaded, with the same results as an in-process compile.
"""

from __future__ import annotations

import os
import pickle
import warnings

import _parallel_fakes as fakes
import pytest

from gpurouter.kernels._base import disk_cache, kernel_cache, parallel
from gpurouter.kernels._base.keys import kernel_key

ARGS = ("array(float32, 2d, C)", "int64")
CC, DRIVER = (9, 0), 12080


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(disk_cache, "_WARNED", set())
    monkeypatch.setattr(parallel, "STATS", dict.fromkeys(parallel.STATS, 0))
    monkeypatch.setattr(parallel, "_simulator", lambda: False)
    monkeypatch.delenv("GPUROUTER_COMPILE_WORKERS", raising=False)


def key(kernel):
    return kernel_key(kernel, ARGS, CC, DRIVER)


def requests(*ns):
    return [(fakes.factory(n), ARGS) for n in ns]


def load_all(cache, reqs):
    """The parent's lookups after the workers: (compiles in the parent, payloads)."""
    compiled = []

    def compile_fn(kernel, argtypes, ordinal):
        compiled.append(kernel)
        return fakes.compile_ok(kernel, argtypes, ordinal)

    def load_fn(entry, cubin, ordinal):
        return 7

    for kernel, argtypes in reqs:
        kernel_cache.resolve(kernel, argtypes, 0, cache, compile_fn=compile_fn, load_fn=load_fn,
                             cc=CC, driver=DRIVER)
    payloads = [kernel_cache.unpack_payload(cache.load(key(k))) for k, _ in reqs]
    return compiled, payloads


def test_recipe_round_trips_to_a_kernel_of_the_same_key():
    kernel = fakes.factory(3, flag=False)
    rec = parallel.recipe_of(kernel)
    assert rec == ("_parallel_fakes", "factory", (3,), (("flag", False),))
    again = parallel.rebuild(pickle.loads(pickle.dumps(rec)))
    assert again is kernel  # the factory's functools.cache: the same object in one process
    assert key(again) == key(kernel) != key(fakes.factory(3))
    assert parallel.recipe_of(fakes.no_recipe(2)) is None


def test_workers_wanted_follows_the_switch(monkeypatch):
    monkeypatch.delenv("GPUROUTER_COMPILE_WORKERS", raising=False)
    assert parallel.workers_wanted(3) == min(os.cpu_count() or 1, 3)
    assert parallel.workers_wanted(100) <= parallel.MAX_WORKERS
    monkeypatch.setenv("GPUROUTER_COMPILE_WORKERS", "0")
    assert parallel.workers_wanted(5) == 0
    monkeypatch.setenv("GPUROUTER_COMPILE_WORKERS", "2")
    assert parallel.workers_wanted(5) == 2 and parallel.workers_wanted(1) == 1


def test_workers_store_every_key_and_the_parent_loads_them(tmp_path, fresh):
    cache = disk_cache.DiskCache(tmp_path)
    reqs = requests(1, 2, 3) + [(fakes.no_recipe(4), ARGS)]
    stored = parallel.precompile(reqs + requests(1), 0, cache, cc=CC, driver=DRIVER,
                                 compile_fn=fakes.compile_ok)
    assert stored == 3 and parallel.STATS["submitted"] == 3 and parallel.STATS["failed"] == 0
    assert 1 <= parallel.STATS["workers"] <= 3
    for k, _ in requests(1, 2, 3):
        assert cache.path_of(key(k)).exists()
    compiled, payloads = load_all(cache, reqs)
    assert compiled == [reqs[3][0]]  # only the kernel without a recipe compiled in the parent
    for (k, _), (_entry, cubin) in zip(reqs, payloads, strict=True):
        assert cubin == fakes.cubin_of(k)
    assert all(int(e.split("_")[1]) != os.getpid() for e, _ in payloads[:3])  # by the workers
    # nothing missing: no pool, nothing submitted again
    assert parallel.precompile(reqs, 0, cache, cc=CC, driver=DRIVER, compile_fn=fakes.compile_ok) == 0
    assert parallel.STATS["submitted"] == 3


@pytest.mark.parametrize("bad", [fakes.compile_raises, fakes.compile_crashes])
def test_a_failing_worker_falls_back_in_process_with_one_warning(tmp_path, fresh, bad, monkeypatch):
    monkeypatch.setenv("GPUROUTER_COMPILE_WORKERS", "1")  # one process a round: CI's 2 cores
    cache = disk_cache.DiskCache(tmp_path)
    reqs = requests(11, 12)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert parallel.precompile(reqs, 0, cache, cc=CC, driver=DRIVER, compile_fn=bad) == 0
        assert parallel.precompile(requests(13, 14), 0, cache, cc=CC, driver=DRIVER, compile_fn=bad) == 0
    mine = [w for w in record if "worker processes" in str(w.message)]
    assert len(mine) == 1 and issubclass(mine[0].category, RuntimeWarning)
    assert parallel.STATS["failed"] == 4
    compiled, payloads = load_all(cache, reqs)  # the parent compiles them, results as ever
    assert compiled == [k for k, _ in reqs]
    assert [c for _, c in payloads] == [fakes.cubin_of(k) for k, _ in reqs]


def test_no_workers_when_off_single_readonly_or_simulated(tmp_path, fresh, monkeypatch):
    kw = {"cc": CC, "driver": DRIVER, "compile_fn": fakes.compile_raises}  # a pool would warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parallel.precompile(requests(21), 0, disk_cache.DiskCache(tmp_path), **kw) == 0  # one: no gain
        monkeypatch.setenv("GPUROUTER_COMPILE_WORKERS", "0")
        assert parallel.precompile(requests(21, 22), 0, disk_cache.DiskCache(tmp_path), **kw) == 0
        monkeypatch.delenv("GPUROUTER_COMPILE_WORKERS")
        monkeypatch.setenv("GPUROUTER_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("GPUROUTER_CACHE", "0")
        assert parallel.precompile(requests(21, 22), 0, **kw) == 0  # the cache is off
        ro = disk_cache.DiskCache(tmp_path / "ro")
        ro.writable = False  # what a failed write leaves (and a read-only folder's check)
        assert parallel.precompile(requests(21, 22), 0, ro, **kw) == 0
        monkeypatch.setattr(parallel, "_simulator", lambda: True)
        assert parallel.precompile(requests(21, 22), 0, disk_cache.DiskCache(tmp_path)) == 0
    assert parallel.STATS["submitted"] == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_folder_gets_no_workers(tmp_path, fresh):
    folder = tmp_path / disk_cache.SUBDIR
    folder.mkdir()
    folder.chmod(0o555)
    try:
        assert parallel.precompile(requests(31, 32), 0, disk_cache.DiskCache(tmp_path), cc=CC,
                                   driver=DRIVER, compile_fn=fakes.compile_raises) == 0
    finally:
        folder.chmod(0o755)
    assert parallel.STATS["submitted"] == 0


# ----------------------------------------------------------------------------
# prefetch: the workers in the background, the lookups wait for them
# ----------------------------------------------------------------------------


def test_prefetch_returns_before_its_workers_and_a_lookup_waits_for_them(tmp_path, fresh):
    cache = disk_cache.DiskCache(tmp_path)
    reqs = requests(21, 22)
    kw = {"cc": CC, "driver": DRIVER, "compile_fn": fakes.compile_slow}
    assert parallel.prefetch(reqs, 0, cache, **kw) == 2
    keys = [key(k) for k, _ in reqs]
    # back at once: the workers (a Python start, then a 1.5 s compile) have stored nothing yet
    assert all(k in kernel_cache.INFLIGHT for k in keys)
    assert not any(cache.path_of(k).exists() for k in keys)
    # in flight: neither a second prefetch nor a precompile submits them again
    assert parallel.prefetch(reqs, 0, cache, **kw) == 0
    assert parallel.precompile(reqs, 0, cache, **kw) == 0
    compiled, payloads = load_all(cache, reqs)
    assert compiled == []  # the parent waited for the workers and loaded their entries
    assert [c for _, c in payloads] == [fakes.cubin_of(k) for k, _ in reqs]
    assert all(int(e.split("_")[1]) != os.getpid() for e, _ in payloads)
    assert not any(k in kernel_cache.INFLIGHT for k in keys)
    assert parallel.STATS["prefetched"] == 2 and parallel.STATS["stored"] == 2


def test_a_failed_prefetch_compiles_in_the_parent_with_one_warning(tmp_path, fresh):
    cache = disk_cache.DiskCache(tmp_path)
    reqs = requests(23)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert parallel.prefetch(reqs, 0, cache, cc=CC, driver=DRIVER, compile_fn=fakes.compile_raises) == 1
        compiled, payloads = load_all(cache, reqs)
    assert compiled == [reqs[0][0]]
    assert payloads[0][1] == fakes.cubin_of(reqs[0][0])
    assert sum("not compiled by the worker" in str(w.message) for w in caught) == 1


def test_no_prefetch_when_off_cached_or_simulated(tmp_path, fresh, monkeypatch):
    cache = disk_cache.DiskCache(tmp_path)
    kw = {"cc": CC, "driver": DRIVER, "compile_fn": fakes.compile_raises}
    monkeypatch.setenv("GPUROUTER_COMPILE_WORKERS", "0")
    assert parallel.prefetch(requests(24), 0, cache, **kw) == 0
    monkeypatch.delenv("GPUROUTER_COMPILE_WORKERS")
    cache.store(key(fakes.factory(25)), kernel_cache.pack_payload("e", b"c"))
    assert parallel.prefetch(requests(25), 0, cache, **kw) == 0  # on disk already
    monkeypatch.setattr(parallel, "_simulator", lambda: True)
    assert parallel.prefetch(requests(26), 0, cache, cc=CC, driver=DRIVER) == 0
    assert parallel.STATS["prefetched"] == 0 and not kernel_cache.INFLIGHT
