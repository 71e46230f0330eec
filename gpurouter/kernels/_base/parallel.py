"""A cold first call in fewer seconds: the missing kernels compiled in worker processes.

numba compiles one kernel at a time in a process (its global compiler lock;
typing and lowering are Python), so a cold DeepSeek-V3 step pays the sum of
its kernels' compiles (docs/cache.md). :func:`precompile` takes the kernels a
plan needs, finds those in neither the process's memo nor the disk cache, and
compiles them in worker processes at once: fresh ``python -m`` processes
(not ``fork``, which CUDA forbids, nor multiprocessing's spawn, which
reruns the caller's ``__main__``).
Each worker rebuilds its kernel from a picklable recipe, computes the kernel's
key (:func:`kernel_cache.kernel_key`), checks it is the key the parent
computed, compiles for the same GPU and stores the cubin in the disk cache;
the parent then loads every kernel from disk as a warm process does
(``kernel_cache.function_handle``).

A recipe is ``(module, qualname, args, kwargs)`` of the module-level factory
that made the kernel: :func:`recipe` decorates a factory (over its
``functools.cache``) and records it on the kernel returned.

Nothing here changes a result: whatever is not compiled by a worker is
compiled in the process as before. :func:`prefetch` does the same without waiting: the
kernels of a plan the trace reaches later (a backward's, submitted while its
forward is traced) compile in the background, and a lookup of one of them
waits for its worker and loads it (``kernel_cache.resolve``). The workers are
skipped when the cache is
off (``GPUROUTER_CACHE=0``) or not writable, under the simulator, with fewer
than two missing kernels (no gain), with ``GPUROUTER_COMPILE_WORKERS=0``, or
for a kernel without a recipe or key; a worker that fails or crashes, or
stores nothing, is warned about once a process and its kernels compile in
the process.

``GPUROUTER_COMPILE_WORKERS``: the number of worker processes; 0 compiles in
the process; unset: ``min(cpus, missing kernels, 8)``.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import importlib
import os
import pickle
import subprocess
import sys
import threading

from . import disk_cache, kernel_cache, keys, seeds

#: what :func:`precompile` did in this process: kernels ``submitted`` to
#: workers, ``stored`` by them, ``failed``; ``workers``: the last pool's size
STATS = {"submitted": 0, "stored": 0, "failed": 0, "workers": 0, "prefetched": 0}
RECIPE_ATTR = "_gpurouter_recipe"
MAX_WORKERS = 8


def recipe(factory):
    """Decorates a module-level kernel factory (put it over ``@functools.cache``):
    the kernel returned carries ``(module, qualname, args, kwargs)``, from
    which :func:`rebuild` makes it again in another process. The arguments
    must pickle (ints, floats, strings, tuples, numpy dtypes: the factories'
    hashable specialisation)."""

    @functools.wraps(factory)
    def make(*args, **kwargs):
        kernel = factory(*args, **kwargs)
        try:
            setattr(kernel, RECIPE_ATTR, (factory.__module__, factory.__qualname__, tuple(args),
                                         tuple(sorted(kwargs.items()))))
        except (AttributeError, TypeError):  # an object without a __dict__: no recipe, compiled in-process
            pass
        return kernel

    for name in ("cache_clear", "cache_info"):  # the functools.cache's, as before
        if hasattr(factory, name):
            setattr(make, name, getattr(factory, name))
    return make


def recipe_of(kernel):
    """The kernel's recipe, or None."""
    return getattr(kernel, RECIPE_ATTR, None)


def rebuild(rec):
    """The kernel of recipe ``rec`` (in this process: the factory's module imported)."""
    module, qualname, args, kwargs = rec
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj(*args, **dict(kwargs))


def workers_wanted(pending: int) -> int:
    """How many worker processes for ``pending`` missing kernels (module docstring)."""
    raw = os.environ.get("GPUROUTER_COMPILE_WORKERS", "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            disk_cache.warn_once("workers-env", f"GPUROUTER_COMPILE_WORKERS={raw!r} is not an integer; "
                                 "compiling in the process.")
            return 0
        return max(0, min(n, pending))
    return max(0, min(os.cpu_count() or 1, pending, MAX_WORKERS))


def _simulator() -> bool:
    from numba import config

    return bool(getattr(config, "ENABLE_CUDASIM", False))


def _writable(cache) -> bool:
    if not cache.writable:
        return False
    try:
        cache.folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(cache.folder, os.W_OK)


def _worker(rec, argtypes, ordinal, root, key, cc, driver, compile_fn):
    """In a worker: the recipe's kernel compiled and stored under ``key``; True when stored."""
    kernel = rebuild(rec)
    if keys.kernel_key(kernel, argtypes, cc, driver) != key:
        return False  # another kernel than the parent's: left to the parent
    cache = disk_cache.DiskCache(root)
    held = cache.claim(key)  # another process compiling it: its entry instead
    try:
        if not held and cache.path_of(key).exists():
            return True
        _, entry, cubin = (compile_fn or kernel_cache._compile)(kernel, argtypes, ordinal)
        return cache.store(key, kernel_cache.pack_payload(entry, cubin))
    finally:
        if held:
            cache.release(key)


#: a worker's bootstrap: a lower CPU priority (``os.nice``: the process that
#: started it compiles the kernel its trace waits for), ``gpurouter`` a bare
#: package (its ``__init__`` imports jax and the ops, about two seconds of a
#: worker's start, and no kernel needs them), then the module run as ``__main__``
_BOOT = ("import os, runpy, sys, types; os.nice(5) if hasattr(os, 'nice') else None; "
         "pkg = types.ModuleType('gpurouter'); pkg.__path__ = [sys.argv[1]]; "
         "sys.modules['gpurouter'] = pkg; runpy.run_module(sys.argv[2], run_name='__main__', alter_sys=True)")


def worker_argv(module: str) -> list:
    """The argv of a worker process that runs ``module`` (a ``gpurouter``
    module) as ``__main__`` without the package's ``__init__`` (``_BOOT``)."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [sys.executable, "-c", _BOOT, package, module]


def _run_batch(batch, ordinal, root, cc, driver, compile_fn) -> list:
    """One worker: a fresh Python running this module (``worker_argv``; a spawn:
    no fork of a process holding CUDA, and no rerun of the caller's ``__main__``
    as multiprocessing's spawn would do) compiling ``batch`` one after the other;
    each job's True, False, or the text of what went wrong."""
    jobs = [(rec, argtypes, ordinal, root, key, cc, driver, compile_fn) for rec, argtypes, key in batch]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        proc = subprocess.run(worker_argv(__name__), input=pickle.dumps(jobs), env=env,
                              capture_output=True, timeout=600, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return [f"{type(e).__name__}: {e}"] * len(batch)
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        return [f"a worker exited with {proc.returncode}: {tail[0]}"] * len(batch)
    try:
        out = pickle.loads(proc.stdout)
    except Exception as e:  # noqa: BLE001  (garbage on the worker's stdout)
        return [f"unreadable worker output ({type(e).__name__})"] * len(batch)
    return out if isinstance(out, list) and len(out) == len(batch) else ["bad worker output"] * len(batch)


def _serve() -> None:
    """A worker's main: the pickled jobs from stdin, their results to stdout."""
    jobs = pickle.loads(sys.stdin.buffer.read())
    results = []
    for job in jobs:
        try:
            results.append(bool(_worker(*job)))
        except Exception as e:  # noqa: BLE001  (reported to the parent, which compiles it)
            results.append(f"{type(e).__name__}: {e}")
    sys.stdout.buffer.write(pickle.dumps(results))
    sys.stdout.buffer.flush()


def pending(requests, ordinal, cache, *, cc=None, driver=None) -> list:
    """``(recipe, argtypes, key)`` of every request ``(kernel, argtypes)`` that a
    worker could compile: not in the process's memo, with a recipe and a key,
    not on disk, without a shipped seed (``seeds``) and not being compiled by a
    background worker (each key once)."""
    out, seen = [], set()
    for kernel, argtypes in requests:
        argtypes = tuple(argtypes)
        if (id(kernel), argtypes, ordinal) in kernel_cache._HANDLES:
            continue
        rec = recipe_of(kernel)
        if rec is None:
            continue
        if cc is None:
            cc = kernel_cache.compute_capability(ordinal)
        if driver is None:
            driver = kernel_cache.driver_version()
        key = keys.kernel_key(kernel, argtypes, cc, driver)
        if key is None or key in seen or key in kernel_cache.INFLIGHT or cache.path_of(key).exists():
            continue
        if seeds.has(kernel, argtypes, cc):  # linked from its seed in the process: no compile to spread
            continue
        seen.add(key)
        out.append((rec, argtypes, key))
    return out


def _start(requests, ordinal, cache, cc, driver, compile_fn, least: int):
    """``(cache, batches, cc, driver)`` for the missing kernels of ``requests``
    (one batch a worker), or None when no worker should start (fewer than
    ``least`` missing, and the module docstring's cases)."""
    cache = cache if cache is not None else disk_cache.default_cache()
    if cache is None or (_simulator() and compile_fn is None):
        return None
    jobs = pending(requests, ordinal, cache, cc=cc, driver=driver)
    if len(jobs) < least or not _writable(cache):
        return None
    n = workers_wanted(len(jobs))
    if n == 0:
        return None
    if cc is None:
        cc = kernel_cache.compute_capability(ordinal)
    if driver is None:
        driver = kernel_cache.driver_version()
    return cache, [jobs[i::n] for i in range(n)], cc, driver


def _account(batches, results) -> int:
    """Counts the workers' results (``STATS``) and warns once about a failure; the number stored."""
    jobs = sum(len(b) for b in batches)
    stored = 0
    problem = None
    for batch_results in results:
        for ok in batch_results:
            if ok is True:
                stored += 1
            else:
                problem = problem or (ok or "a worker stored nothing (its kernel's key differed)")
    STATS["stored"] += stored
    STATS["failed"] += jobs - stored
    if problem is not None:
        disk_cache.warn_once("workers", f"{jobs - stored} of {jobs} kernels were not compiled "
                             f"by the worker processes ({problem}); they compile in this process "
                             "(GPUROUTER_COMPILE_WORKERS=0 skips the workers).")
    return stored


def precompile(requests, ordinal: int, cache=None, *, cc=None, driver=None, compile_fn=None) -> int:
    """Compiles the missing kernels of ``requests`` (``(kernel, argtypes)``
    pairs, numba types) in worker processes, into the disk cache, and waits;
    returns how many were stored. Never raises for a worker's failure (module
    docstring). ``cc``, ``driver`` and ``compile_fn`` (module-level, picklable:
    ``(kernel, argtypes, ordinal) -> (handle, entry, cubin)``) are the tests'."""
    started = _start(requests, ordinal, cache, cc, driver, compile_fn, least=2)
    if started is None:
        return 0
    cache, batches, cc, driver = started
    STATS["workers"] = len(batches)
    STATS["submitted"] += sum(len(b) for b in batches)
    with cf.ThreadPoolExecutor(len(batches)) as pool:
        results = list(pool.map(lambda b: _run_batch(b, ordinal, str(cache.root), cc, driver, compile_fn),
                                batches))
    return _account(batches, results)


def prefetch(requests, ordinal: int, cache=None, *, cc=None, driver=None, compile_fn=None) -> int:
    """Starts compiling the missing kernels of ``requests`` in worker processes
    and returns at once (module docstring); the number submitted. Each key is
    in ``kernel_cache.INFLIGHT`` until its worker ends, so that a lookup waits
    for it instead of compiling it a second time. The workers' threads are
    daemons: a process that ends first leaves them (an entry is written whole
    or not at all). Arguments as :func:`precompile`'s."""
    started = _start(requests, ordinal, cache, cc, driver, compile_fn, least=1)
    if started is None:
        return 0
    cache, batches, cc, driver = started
    STATS["prefetched"] += sum(len(b) for b in batches)
    for batch in batches:
        done = threading.Event()
        for _, _, key in batch:
            kernel_cache.INFLIGHT[key] = done
        threading.Thread(target=_background, args=(batch, done, ordinal, str(cache.root), cc, driver, compile_fn),
                         name="gpurouter-prefetch", daemon=True).start()
    return sum(len(b) for b in batches)


def _background(batch, done, ordinal, root, cc, driver, compile_fn) -> None:
    try:
        _account([batch], [_run_batch(batch, ordinal, root, cc, driver, compile_fn)])
    finally:
        for _, _, key in batch:
            kernel_cache.INFLIGHT.pop(key, None)
        done.set()


if __name__ == "__main__":
    _serve()
