"""The persistent kernel cache (gpurouter/kernels/_base/disk_cache.py and
kernel_cache.py; docs/cache.md).

CPU: the cache's logic with the compile step faked (the simulator compiles
nothing): keys, bad entries, two real processes on one key, read-only and
unusable folders, the size bound, GPUROUTER_CACHE=0, the CLI, and one
compile for concurrent processes (the key's lock: two real processes, gone,
stale and live owners). GPU (marked
``gpu``): a fresh process with a warm cache loads every kernel from disk,
compiles none, and gives the bits of a fresh compile.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter.kernels._base import disk_cache, kernel_cache, keys, seeds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DISK_CACHE_PY = ROOT / "gpurouter" / "kernels" / "_base" / "disk_cache.py"


def key_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each test sees the cache's once-a-process warnings anew."""
    monkeypatch.setattr(disk_cache, "_WARNED", set())


def bad_warnings(record) -> list:
    return [w for w in record if "gpurouter kernel cache" in str(w.message)]


# ----------------------------------------------------------------------------
# disk_cache
# ----------------------------------------------------------------------------


def test_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("GPUROUTER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.cache_dir() == tmp_path / "xdg" / "gpurouter"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert disk_cache.cache_dir() == tmp_path / "home" / ".cache" / "gpurouter"
    monkeypatch.setenv("GPUROUTER_CACHE_DIR", str(tmp_path / "mine"))
    assert disk_cache.cache_dir() == tmp_path / "mine"
    assert disk_cache.default_cache().root == tmp_path / "mine"
    for off in ("0", "off", "false"):
        monkeypatch.setenv("GPUROUTER_CACHE", off)
        assert not disk_cache.enabled() and disk_cache.default_cache() is None
    monkeypatch.setenv("GPUROUTER_CACHE", "1")
    assert disk_cache.enabled()


def test_round_trip_and_miss_then_hit(tmp_path):
    cache = disk_cache.DiskCache(tmp_path)
    calls = []

    def compile_fn():
        calls.append(1)
        return b"cubin bytes \x00\xff" * 100

    key = key_of("a")
    first = cache.get_or_compile(key, compile_fn)
    again = disk_cache.DiskCache(tmp_path).get_or_compile(key, compile_fn)  # as a new process would
    assert first == again == b"cubin bytes \x00\xff" * 100
    assert len(calls) == 1
    assert not list(cache.folder.glob("*.tmp"))  # the temporary file was renamed


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign key", "not an entry", "empty"])
def test_bad_entry_recompiles_overwrites_and_warns_once(tmp_path, fresh_warnings, damage):
    cache = disk_cache.DiskCache(tmp_path)
    keys = [key_of("k1"), key_of("k2")]
    for k in keys:
        cache.store(k, b"good " + k.encode())
    for k in keys:
        path = cache.path_of(k)
        data = path.read_bytes()
        if damage == "flip":
            data = data[:-3] + bytes([data[-3] ^ 1]) + data[-2:]
        elif damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "foreign key":
            data = disk_cache.pack(key_of("other"), b"good " + k.encode())
        elif damage == "not an entry":
            data = b"\x7fELF" + data[4:]
        else:
            data = b""
        path.write_bytes(data)
    compiled = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for k in keys:
            got = cache.get_or_compile(k, lambda k=k: compiled.append(k) or b"fresh " + k.encode())
            assert got == b"fresh " + k.encode()
    assert compiled == keys  # both recompiled: never the bad bytes
    assert len(bad_warnings(record)) == 1  # one warning for the process
    for k in keys:  # overwritten with good entries
        assert disk_cache.DiskCache(tmp_path).load(k) == b"fresh " + k.encode()


def test_unusable_folder_compiles_without_caching(tmp_path, fresh_warnings):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cache = disk_cache.DiskCache(blocker / "cache")  # mkdir fails whoever runs the test
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i in range(3):
            assert cache.get_or_compile(key_of(str(i)), lambda i=i: bytes([i])) == bytes([i])
    assert len(bad_warnings(record)) == 1
    assert not cache.writable and cache.info()["entries"] == 0


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into a read-only folder anyway (the unusable-folder test covers it)")
def test_read_only_folder_still_reads(tmp_path, fresh_warnings):
    cache = disk_cache.DiskCache(tmp_path)
    cache.store(key_of("old"), b"old")
    os.chmod(cache.folder, 0o555)
    try:
        ro = disk_cache.DiskCache(tmp_path)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert ro.load(key_of("old")) == b"old"
            assert ro.get_or_compile(key_of("new"), lambda: b"new") == b"new"
            assert ro.get_or_compile(key_of("new2"), lambda: b"new2") == b"new2"
        assert len(bad_warnings(record)) == 1
    finally:
        os.chmod(cache.folder, 0o755)


def test_size_bound_evicts_least_recently_used(tmp_path):
    cache = disk_cache.DiskCache(tmp_path, limit=3 * (disk_cache.HEADER.size + 1000))
    keys = [key_of(str(i)) for i in range(4)]
    for i, k in enumerate(keys[:3]):
        cache.store(k, bytes(1000))
        os.utime(cache.path_of(k), (1000 + i, 1000 + i))  # 0 oldest
    assert cache.load(keys[0]) is not None  # a hit: 0 is now the most recent
    cache.store(keys[3], bytes(1000))  # over the bound: the least recently used (1) goes
    assert sorted(p.name for p, _, _ in cache.entries()) == sorted(
        cache.path_of(k).name for k in (keys[0], keys[2], keys[3]))
    assert cache.info()["bytes"] <= cache.limit


def test_clear_and_keys_are_checked(tmp_path):
    cache = disk_cache.DiskCache(tmp_path)
    for i in range(3):
        cache.store(key_of(str(i)), b"x")
    (cache.folder / ".leftover.tmp").write_bytes(b"half")
    cache.lock_of(key_of("4")).write_text("1 elsewhere")
    assert cache.info()["compiling"] == 1
    assert cache.clear() == 3
    assert cache.info()["entries"] == 0 and not list(cache.folder.iterdir())
    with pytest.raises(ValueError, match="64 lowercase hex"):
        cache.path_of("../../etc/passwd")


WRITER = textwrap.dedent("""
    import importlib.util, sys, time, warnings
    spec = importlib.util.spec_from_file_location("dc", sys.argv[1])
    dc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dc)
    warnings.simplefilter("error")  # a bad entry would raise here
    cache = dc.DiskCache(sys.argv[2])
    mine, key, start = sys.argv[3].encode() * 300_000, sys.argv[4], float(sys.argv[5])
    while time.time() < start:
        pass
    seen = {}
    for _ in range(60):
        cache.store(key, mine)
        got = cache.load(key)
        assert got is not None and len(set(got)) == 1, "a mixed or bad entry"
        seen[got[:1]] = seen.get(got[:1], 0) + 1
    print(sorted(seen.items()))
""")


def test_two_processes_write_one_key(tmp_path):
    """Two real processes store 300 KB payloads (one all "a", one all "b")
    under one key at once and read it back each time: every read is one
    whole payload, never a mix, never a bad entry."""
    key = key_of("shared")
    start = time.time() + 1.5
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(DISK_CACHE_PY), str(tmp_path), ch, key,
                               str(start)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for ch in "ab"]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert sum(n for _, n in eval(out)) == 60  # (payload, reads) pairs: every read whole
    final = disk_cache.DiskCache(tmp_path).load(key)
    assert final in (b"a" * 300_000, b"b" * 300_000)
    assert not list((tmp_path / disk_cache.SUBDIR).glob("*.tmp"))


COMPILER = textwrap.dedent("""
    import importlib.util, os, sys, time
    spec = importlib.util.spec_from_file_location("dc", sys.argv[1])
    dc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dc)
    root, key, log, start = sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])

    def compile_fn():  # a slow compile, logged
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(1.0)
        return b"cubin" * 1000

    while time.time() < start:
        pass
    print(dc.DiskCache(root).get_or_compile(key, compile_fn) == b"cubin" * 1000)
""")


def test_two_processes_compile_a_missing_kernel_once(tmp_path):
    """Two real processes miss one key at the same moment: one compiles (a
    1 s fake compile), the other waits for its entry; both get it, and no
    lock is left behind."""
    key, log = key_of("once"), tmp_path / "compiles.log"
    start = time.time() + 1.5
    procs = [subprocess.Popen([sys.executable, "-c", COMPILER, str(DISK_CACHE_PY), str(tmp_path / "c"), key,
                               str(log), str(start)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and out.strip() == "True", err
    assert len(log.read_text().split()) == 1
    assert not list((tmp_path / "c" / disk_cache.SUBDIR).glob("*.lock"))


def write_lock(cache, key, pid, host, age=0.0):
    lock = cache.lock_of(key)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(f"{pid} {host}")
    if age:
        then = time.time() - age
        os.utime(lock, (then, then))
    return lock


def test_a_lock_of_a_gone_process_or_past_the_bound_is_taken_over(tmp_path, fresh_warnings):
    cache, host = disk_cache.DiskCache(tmp_path), disk_cache.socket.gethostname()
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    cases = {"gone": (int(done.stdout), host, 0.0), "mine": (os.getpid(), host, 0.0),
             "old, other host": (12345, "another-host", 100.0), "half-written": ("", "", 5.0)}
    for name, (pid, where, age) in cases.items():
        key = key_of(name)
        write_lock(cache, key, pid, where, age)
        t0 = time.monotonic()
        assert cache.claim(key, wait=30.0) is True, name
        assert time.monotonic() - t0 < 5.0, name
        assert cache.lock_of(key).read_text().split()[0] == str(os.getpid())
        cache.release(key)
        assert not cache.lock_of(key).exists()


def test_a_live_lock_is_waited_for_up_to_the_bound(tmp_path, fresh_warnings, monkeypatch):
    """A lock of a live process on this host: the claim waits, then gives up
    with one warning; the caller compiles, and the lock is left to its owner.
    A fresh lock from another host (no pid to ask) is waited for as long, then
    taken over (older than the bound: stale)."""
    cache = disk_cache.DiskCache(tmp_path)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setenv("GPUROUTER_CACHE_WAIT_S", "0.3")
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for name, owner, kept in (("live", (sleeper.pid, disk_cache.socket.gethostname()), True),
                                      ("fresh, other host", (12345, "another-host"), False)):
                key = key_of(name)
                lock = write_lock(cache, key, *owner)
                t0 = time.monotonic()
                assert cache.get_or_compile(key, lambda: b"here") == b"here"
                assert 0.3 <= time.monotonic() - t0 < 5.0
                assert lock.exists() is kept, name
        assert len(bad_warnings(record)) == 1 and "GPUROUTER_CACHE_WAIT_S" in str(record[0].message)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_wait_ends_when_the_entry_appears(tmp_path):
    cache, key = disk_cache.DiskCache(tmp_path), key_of("appears")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(cache, key, sleeper.pid, disk_cache.socket.gethostname())
        cache.store(key, b"theirs")  # the other process's store; its lock not yet released
        assert cache.claim(key, wait=30.0) is False
        assert cache.get_or_compile(key, lambda: b"mine") == b"theirs"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_wait_bound_reads_the_environment(monkeypatch):
    for text, want in (("", disk_cache.DEFAULT_WAIT_S), ("12.5", 12.5), ("0", 0.0), ("-1", disk_cache.DEFAULT_WAIT_S),
                       ("soon", disk_cache.DEFAULT_WAIT_S)):
        monkeypatch.setenv("GPUROUTER_CACHE_WAIT_S", text)
        assert disk_cache.wait_bound() == want


# ----------------------------------------------------------------------------
# kernel_cache: keys and the lookup, the GPU steps faked
# ----------------------------------------------------------------------------


class FakeDispatcher:
    """What the key reads of a numba dispatcher: ``py_func``, ``targetoptions``."""

    def __init__(self, py_func, **options):
        self.py_func = py_func
        self.targetoptions = {"opt": True, **options}


def factory(n, flag, helper_scale=2.0, **options):
    def helper(x):
        return x * helper_scale

    device = FakeDispatcher(helper, device=True)

    def kernel(out, x):
        out[0] = device(x) + n if flag else x

    return FakeDispatcher(kernel, **options)


ARGS = ("array(float32, 2d, C)", "int64")


def key(kernel=None, args=ARGS, cc=(9, 0), driver=12080):
    return keys.kernel_key(kernel or factory(4, True), args, cc, driver)


def source_and_toolchain_variants(monkeypatch, key_fn, toolchain: str) -> dict:
    """``key_fn()`` with the kernel sources' digest, then ``keys.<toolchain>()``, replaced."""
    out = {}
    for name, attr, value in (("kernel sources", "source_digest", "0" * 64), ("toolchain", toolchain, "numba=9.9")):
        monkeypatch.setattr(keys, attr, lambda value=value: value)
        out[name] = key_fn()
        monkeypatch.undo()
    return out


def test_key_is_stable_and_changes_with_every_component(monkeypatch):
    base = key()
    assert base == key() and len(base) == 64
    variants = {
        "factory int": key(factory(5, True)),
        "factory flag": key(factory(4, False)),
        "a device function's closure": key(factory(4, True, helper_scale=3.0)),
        "compile options": key(factory(4, True, max_registers=64)),
        "argument types": key(args=("array(bfloat16, 2d, C)", "int64")),
        "compute capability": key(cc=(8, 0)),
        "driver": key(driver=12090),
    }
    variants.update(source_and_toolchain_variants(monkeypatch, key, "toolchain"))
    assert key() == base
    assert len(set(variants.values())) == len(variants) and base not in variants.values(), variants


def test_key_of_a_value_with_an_address_is_none():
    marker = object()

    def kernel(out):
        out[0] = marker is None

    assert key(FakeDispatcher(kernel)) is None


def test_toolchain_names_the_versions():
    text = keys.toolchain()
    for name in ("gpurouter=", "numba=", "numba-cuda=", "llvmlite="):
        assert name in text


NEW_T_PRESETS = ("deepseek-v3", "qwen3", "mixtral", "nemotron-3-super")


def test_real_kernels_in_fresh_processes():
    """Without the simulator (the GPU's plans), in two fresh processes:

    - the key of a real factory kernel (numba's dispatcher) is the same in
      both; another E is another key;
    - a new token count of a family already used needs no new kernel: the
      token count is a run-time argument of every router kernel, so the plans
      of the demo's routing step for T = 64, 333 and 1000 use the kernels
      (same objects, same argument types) of T = 4096 (docs/cache.md lists
      what stays a compile-time constant).
    """
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_kernel_cache import preset_kernels
        from gpurouter.presets import PRESETS
        from gpurouter.kernels.topk.warp.fwd import warp_topk_fwd_kernel as f
        from gpurouter.kernels._base.kernel_cache import kernel_key
        args = ("array(uint16, 2d, C)", "int64")
        keys = [kernel_key(f("bf16", e, 8, 0, True, num_groups=8, group_topk=4), args, (9, 0), 1)
                for e in (256, 512)]
        new_t = {{}}
        for name in {NEW_T_PRESETS!r}:
            used = preset_kernels(PRESETS[name], 4096)
            new_t[name] = [t for t in (64, 333, 1000) if preset_kernels(PRESETS[name], t) != used]
        print(json.dumps([keys, new_t]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    (keys, new_t), (keys2, _) = outs
    assert keys == keys2
    assert None not in keys and keys[0] != keys[1]
    assert new_t == {name: [] for name in NEW_T_PRESETS}, "token counts that need other kernels"


KEYS_CHILD = textwrap.dedent("""
    import json, os
    if os.environ.get("REDIRECT") == "1":  # what a numba compile does mid-process: numba.types becomes
        import numba.types  # noqa: F401  # numba's redirect module (_RedirectSubpackage), not numba.core.types
    import numpy as np
    from gpurouter._checks import score_function_of
    from gpurouter.kernels._base.kernel_cache import kernel_key
    from gpurouter.kernels._base.launch import BF16, F32
    from gpurouter.kernels._base.plan import Spec, spec_of
    from gpurouter.kernels._base.pointer import _numba_type
    from gpurouter.kernels.losses.z_loss import router_z_loss_bwd_plan, router_z_loss_fwd_plan
    from gpurouter.kernels.topk.bwd_plans import topk_with_score_function_bwd_plan
    from gpurouter.kernels.topk.plans import topk_with_score_function_fwd_plan
    sf, scale, x = int(score_function_of("t", "sigmoid")), np.float32(2.5), spec_of((300, 256), BF16)
    plans = {"topk_fwd": topk_with_score_function_fwd_plan(x, True, 8, False, 8, 4, scale, sf),
             "topk_bwd": topk_with_score_function_bwd_plan(x, 8, False, scale, sf),
             "z_fwd": router_z_loss_fwd_plan(x, np.float32(1e-3), 300),
             "z_bwd": router_z_loss_bwd_plan(x, np.float32(1e-3), 300)}
    keys = {}
    for name, plan in plans.items():
        specs = {"in": plan.ins, "out": plan.outs, "tmp": plan.tmps}
        for i, st in enumerate(plan.steps):
            keys[f"{name}.{i}"] = kernel_key(st.kernel, [_numba_type(a, specs) for a in st.args], (9, 0), 12080)
    print(json.dumps(keys))
""")


def test_keys_of_the_gpu_childs_kernels_are_the_same_in_two_processes():
    """The keys of the kernels the GPU test's child runs (top-k forward and
    backward, z-loss, at its shapes; real dispatchers, nothing compiled) are
    the same in two fresh processes with different string hashes
    (PYTHONHASHSEED), one of them with ``numba.types`` imported first: a numba
    compile imports it, so in a cold process the factories called after the
    first compile (the z-loss's ``from numba import types``) got numba's
    redirect module ``numba.types`` and a warm one (nothing compiled)
    ``numba.core.types``; the key named the module by ``__name__`` and the
    z-loss kernel was compiled again in every warm process (found on an H200)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", KEYS_CHILD],
                              env={**env, "PYTHONHASHSEED": seed, "REDIRECT": redirect},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed, redirect in (("1", "0"), ("2", "1"))]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0] and None not in outs[0].values(), outs[0]
    assert outs[0] == outs[1]


class FakeGpu:
    """The GPU steps of ``kernel_cache.resolve``: a compile makes a "cubin"
    from the key's kernel; a load gives a handle unless told to refuse."""

    def __init__(self):
        self.compiles, self.loads, self.refuse = 0, 0, False

    def compile_fn(self, kernel, argtypes, ordinal):
        self.compiles += 1
        return 1000 + self.compiles, "_Z6kernelPf", b"CUBIN:" + kernel.py_func.__qualname__.encode()

    def load_fn(self, entry, cubin, ordinal):
        self.loads += 1
        assert entry == "_Z6kernelPf" and cubin.startswith(b"CUBIN:")
        return 0 if self.refuse else 2000 + self.loads


def resolve(kernel, cache, gpu):
    return kernel_cache.resolve(kernel, ARGS, 0, cache, compile_fn=gpu.compile_fn, load_fn=gpu.load_fn,
                                cc=(9, 0), driver=12080)


def test_resolve_compiles_once_then_loads(tmp_path, fresh_warnings):
    gpu, k = FakeGpu(), factory(4, True)
    assert resolve(k, disk_cache.DiskCache(tmp_path), gpu) == 1001  # cold: numba's handle
    assert resolve(k, disk_cache.DiskCache(tmp_path), gpu) == 2001  # warm: loaded
    assert resolve(factory(5, True), disk_cache.DiskCache(tmp_path), gpu) == 1002  # another kernel
    assert (gpu.compiles, gpu.loads) == (2, 1)
    gpu.refuse = True  # the driver refuses the stored cubin: compile, overwrite, warn once
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert resolve(k, disk_cache.DiskCache(tmp_path), gpu) == 1003
        assert resolve(factory(5, True), disk_cache.DiskCache(tmp_path), gpu) == 1004
    assert len(bad_warnings(record)) == 1
    assert disk_cache.DiskCache(tmp_path).info()["entries"] == 2


def test_resolve_waits_for_another_processes_compile(tmp_path):
    """A live process holds the key's lock (it is compiling): resolve waits,
    then loads that process's entry and compiles nothing."""
    gpu, k, cache = FakeGpu(), factory(4, True), disk_cache.DiskCache(tmp_path)
    key = keys.kernel_key(k, ARGS, (9, 0), 12080)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = write_lock(cache, key, sleeper.pid, disk_cache.socket.gethostname())
        other = threading.Timer(0.5, lambda: (cache.store(key, kernel_cache.pack_payload(
            "_Z6kernelPf", b"CUBIN:theirs")), lock.unlink()))
        other.start()
        t0 = time.monotonic()
        assert resolve(k, cache, gpu) == 2001
        assert time.monotonic() - t0 >= 0.4 and (gpu.compiles, gpu.loads) == (0, 1)
        other.join()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_resolve_with_the_cache_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUROUTER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("GPUROUTER_CACHE", "0")
    gpu = FakeGpu()
    for _ in range(2):
        resolve(factory(4, True), disk_cache.default_cache(), gpu)
    assert (gpu.compiles, gpu.loads) == (2, 0)
    assert not (tmp_path / disk_cache.SUBDIR).exists()


def test_payload_round_trip_and_junk():
    assert kernel_cache.unpack_payload(kernel_cache.pack_payload("_Z1k", b"\x7fELF..")) == ("_Z1k", b"\x7fELF..")
    for junk in (b"", b"GRK1", b"GRK1\x05\x00\x00\x00ab", b"XXXX" + bytes(20)):
        assert kernel_cache.unpack_payload(junk) is None


# ----------------------------------------------------------------------------
# The CLI
# ----------------------------------------------------------------------------


def test_cli_info_and_clear(tmp_path, monkeypatch, capsys):
    from gpurouter.__main__ import main

    monkeypatch.setenv("GPUROUTER_CACHE_DIR", str(tmp_path))
    cache = disk_cache.DiskCache(tmp_path)
    for i in range(2):
        cache.store(key_of(str(i)), bytes(10))
    assert main(["cache", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["entries"] == 2 and info["dir"] == str(tmp_path / disk_cache.SUBDIR)
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "entries  2" in out and "locks" not in out
    cache.lock_of(key_of("2")).write_text("1 elsewhere")
    assert main(["cache", "info"]) == 0
    assert "locks    1" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "deleted 2 entries" in capsys.readouterr().out
    assert cache.info()["entries"] == 0


def test_coldstart_numba_rows_need_a_gpu(capsys, monkeypatch):
    from gpurouter import coldstart
    from gpurouter.__main__ import main

    monkeypatch.setattr(coldstart, "_gpu_problem", lambda: "no GPU here")
    with pytest.raises(SystemExit) as exc:
        main(["coldstart", "--backends", "numba"])
    assert exc.value.code == 2
    assert "the numba rows need a CUDA GPU: no GPU here" in capsys.readouterr().err


# ----------------------------------------------------------------------------
# GPU: a warm cache in a fresh process
# ----------------------------------------------------------------------------

GPU_CHILD = textwrap.dedent("""
    import hashlib, json
    import numpy as np
    from numba.cuda import dispatcher
    numba_compiles = []
    original = dispatcher.CUDADispatcher.compile
    def counted(self, sig):
        if not getattr(self, "targetoptions", {}).get("device"):
            numba_compiles.append(1)
        return original(self, sig)
    dispatcher.CUDADispatcher.compile = counted
    import jax, jax.numpy as jnp, ml_dtypes
    import gpurouter as gr
    from gpurouter import kernels as K
    from gpurouter.kernels._base import kernel_cache
    rng = np.random.default_rng(0)
    h = hashlib.sha256()
    x = rng.standard_normal((300, 256)).astype(ml_dtypes.bfloat16)
    bias = np.linspace(-0.05, 0.05, 256, dtype=np.float32)
    for out in K.topk_with_score_function_fwd(x, 8, False, 8, 4, 2.5, "sigmoid", expert_bias=bias):
        h.update(np.ascontiguousarray(out).tobytes())
    for out in K.router_z_loss_fwd(x, 1e-3):
        h.update(np.ascontiguousarray(out).tobytes())
    def loss(x):
        p, _ = gr.fused_topk_with_score_function(x, 8, num_groups=8, group_topk=4, scaling_factor=2.5,
                                                 score_function="sigmoid", expert_bias=jnp.asarray(bias),
                                                 backend="numba")
        return jnp.sum(p.astype(jnp.float32))
    val, grad = jax.jit(jax.value_and_grad(loss))(jnp.asarray(x))
    h.update(np.asarray(val).tobytes()); h.update(np.asarray(grad).tobytes())
    print(json.dumps({"digest": h.hexdigest(), "stats": kernel_cache.STATS, "numba_compiles": len(numba_compiles)}))
""")


def run_gpu_child(tmp_path, **env_extra):
    """The child in a fresh process over the cache folder ``tmp_path``; the
    package's seeds off unless ``GPUROUTER_SEEDS`` is given (its kernels are
    DeepSeek-V3's, which have seeds: with them an empty cache compiles less)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "GPUROUTER_CACHE")}
    env.update(PYTHONPATH=str(ROOT), GPUROUTER_CACHE_DIR=str(tmp_path), XLA_PYTHON_CLIENT_PREALLOCATE="false",
               GPUROUTER_SEEDS="0")
    env.update(env_extra)
    proc = subprocess.run([sys.executable, "-c", GPU_CHILD], env=env, capture_output=True, text=True,
                          timeout=540, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_warm_cache_loads_from_disk_with_the_bits_of_a_fresh_compile(tmp_path):
    cold = run_gpu_child(tmp_path)
    assert cold["stats"]["compiled"] > 0, cold
    warm = run_gpu_child(tmp_path)
    assert warm["stats"]["compiled"] == 0 and warm["numba_compiles"] == 0, warm
    # (two kernel objects with one key: the second is loaded even in the cold process)
    assert warm["stats"]["loaded"] == cold["stats"]["compiled"] + cold["stats"]["loaded"], (cold, warm)
    off = run_gpu_child(tmp_path, GPUROUTER_CACHE="0")
    assert off["stats"]["loaded"] == 0 and off["stats"]["compiled"] > 0, off
    assert cold["digest"] == warm["digest"] == off["digest"]


@pytest.mark.gpu
def test_an_empty_cache_links_the_shipped_seeds_with_the_bits_of_a_compile(tmp_path):
    """The child's top-k kernels are DeepSeek-V3's, whose PTX the package ships
    (kernels/_base/seeds.py): with an empty cache they are linked from their
    seeds, not compiled, and give the same bits as numba's compile; the next
    process loads them from disk."""

    why = seeds.status()["unusable"]
    if why:
        pytest.skip(f"the package's seeds are not usable here: {why}")
    one = {"GPUROUTER_COMPILE_WORKERS": "0"}  # every compile counted in the child
    bare = run_gpu_child(tmp_path / "bare", **one)
    seeded = run_gpu_child(tmp_path / "seeded", GPUROUTER_SEEDS="1", **one)
    assert seeded["stats"]["seeded"] > 0, seeded
    assert seeded["stats"]["compiled"] + seeded["stats"]["seeded"] == bare["stats"]["compiled"], (seeded, bare)
    assert seeded["digest"] == bare["digest"]
    warm = run_gpu_child(tmp_path / "seeded", GPUROUTER_SEEDS="1", **one)
    assert warm["stats"]["compiled"] == warm["stats"]["seeded"] == 0 and warm["digest"] == bare["digest"], warm


def _code_sections(cubin: bytes) -> list[bytes]:
    """The machine code of an ELF cubin: its ``.text.<entry>`` sections' bytes, in order."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def section(i):  # (name offset, file offset, size) of section i
        name, _, _, _, off, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        return name, off, size

    names = section(shstrndx)[1]
    out = []
    for i in range(shnum):
        name, off, size = section(i)
        if cubin[names + name:cubin.index(b"\0", names + name)].startswith(b".text."):
            out.append(cubin[off:off + size])
    return out


@pytest.mark.gpu
def test_a_linked_seed_is_the_cubin_of_numbas_compile():
    """DeepSeek-V3's top-k forward and backward kernels: the seed linked
    (``seeds.link``) is the machine code of numba's own compile, byte for byte
    (the entry names aside: numba's mangled names hold a per-process counter).
    The seeds of before, the PTX after LTO linked again, made other machine
    code: that forward ran 7% slower (docs/cache.md, "Seeds")."""
    import numpy as np

    from gpurouter._checks import score_function_of
    from gpurouter.kernels._base.launch import BF16
    from gpurouter.kernels._base.plan import spec_of
    from gpurouter.kernels._base.pointer import _numba_type
    from gpurouter.kernels.topk.bwd_plans import topk_with_score_function_bwd_plan
    from gpurouter.kernels.topk.plans import topk_with_score_function_fwd_plan
    from gpurouter.presets import PRESETS

    why = seeds.status()["unusable"]
    if why:
        pytest.skip(f"the package's seeds are not usable here: {why}")
    p = PRESETS["deepseek-v3"]
    cc = kernel_cache.compute_capability(0)
    sf, logits = int(score_function_of("test", p.score_function)), spec_of((4096, p.num_experts), BF16)
    plans = [topk_with_score_function_fwd_plan(logits, p.expert_bias, p.topk, p.use_pre_softmax, p.num_groups,
                                               p.group_topk, np.float32(p.scaling_factor), sf),
             topk_with_score_function_bwd_plan(logits, p.topk, p.use_pre_softmax, np.float32(p.scaling_factor), sf)]
    checked = 0
    for plan in plans:
        specs = {"in": plan.ins, "out": plan.outs, "tmp": plan.tmps}
        for st in plan.steps:
            argtypes = tuple(_numba_type(a, specs) for a in st.args)
            if not seeds.has(st.kernel, argtypes, cc):
                continue
            _, cubin = seeds.cubin_of(st.kernel, argtypes, cc, 0)
            _, _, compiled = kernel_cache._compile(st.kernel, argtypes, 0)
            assert _code_sections(cubin) == _code_sections(compiled) != [], (len(cubin), len(compiled))
            checked += 1
    if not checked:
        pytest.skip(f"the package has no seed of these kernels for compute capability {cc}")


# ----------------------------------------------------------------------------
# A new token count of a family already used: no new kernel
# ----------------------------------------------------------------------------


def preset_kernels(preset, tokens: int) -> set:
    """(kernel, argument types) of every step of a preset's router plans at ``tokens``."""
    import numpy as np

    from gpurouter._checks import score_function_of
    from gpurouter.kernels._base.launch import BF16, F32
    from gpurouter.kernels._base.plan import Spec, spec_of
    from gpurouter.kernels._base.pointer import _numba_type
    from gpurouter.kernels.losses.aux_loss import moe_aux_loss_bwd_plan, moe_aux_loss_fwd_plan
    from gpurouter.kernels.topk.aux_plans import score_for_aux_loss_bwd_plan, score_for_aux_loss_fwd_plan
    from gpurouter.kernels.topk.bwd_plans import topk_with_score_function_bwd_plan
    from gpurouter.kernels.topk.plans import topk_with_score_function_fwd_plan

    p, t = preset, tokens
    sf = int(score_function_of("test", p.score_function))
    logits, scale = spec_of((t, p.num_experts), BF16), np.float32(p.scaling_factor)
    plans = [
        topk_with_score_function_fwd_plan(logits, p.expert_bias, p.topk, p.use_pre_softmax, p.num_groups,
                                          p.group_topk, scale, sf),
        topk_with_score_function_bwd_plan(logits, p.topk, p.use_pre_softmax, scale, sf),
        score_for_aux_loss_fwd_plan(logits, p.topk, sf),
        score_for_aux_loss_bwd_plan(spec_of((t, p.num_experts), F32), sf, BF16),
        moe_aux_loss_fwd_plan(spec_of((t, p.num_experts), F32), Spec((p.num_experts,), np.int32, "int"),
                              np.float32(1e-3)),
        moe_aux_loss_bwd_plan(Spec((p.num_experts,), np.int32, "int"), spec_of((), F32), t),
    ]
    out = set()
    for plan in plans:
        specs = {"in": plan.ins, "out": plan.outs, "tmp": plan.tmps}
        for st in plan.steps:
            out.add((st.kernel, tuple(str(_numba_type(a, specs)) for a in st.args)))
    return out


# ----------------------------------------------------------------------------
# execute's GPU path (pointer.launch_plan), the launch faked
# ----------------------------------------------------------------------------


class FakeArray:
    """A device array as ``launch_plan`` reads it: its CUDA array interface."""

    def __init__(self, shape, typestr, ptr, strides=None):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
                                         "strides": strides, "version": 3}


class FakeLaunch:
    made: list = []

    def __init__(self, plan, ordinal):
        FakeLaunch.made.append((plan, ordinal))
        self.calls = []

    def __call__(self, ptrs, stream):
        self.calls.append((list(ptrs), stream))


@pytest.fixture
def fake_gpu_executor(monkeypatch):
    from gpurouter.kernels._base import plan as plan_mod
    from gpurouter.kernels._base import pointer

    FakeLaunch.made = []
    monkeypatch.setattr(pointer, "PointerLaunch", FakeLaunch)
    monkeypatch.setattr(pointer, "_POINTER_PLANS", {})
    monkeypatch.setattr(plan_mod, "_ordinal_now", lambda: 0)
    return pointer.launch_plan


def a_plan():
    import numpy as np

    from gpurouter.kernels._base.plan import In, Out, Plan, Spec, Step, Tmp

    x = Spec((4, 8), np.uint16, "bf16")
    steps = [Step(object(), 1, 32, 0, (In(0, Spec((8,), np.uint64)), In(1), Out(0), Tmp(0), 7))]
    return Plan("op", (x, Spec((8,), np.float32)), (Spec((4, 8), np.float32),), (Spec((3,), np.int32),), steps)


def arrays(**change):
    a = {"in": [FakeArray((4, 8), "<u2", 4096), FakeArray((8,), "<f4", 8192)],
         "out": [FakeArray((4, 8), "<f4", 12288)], "tmp": [FakeArray((3,), "<i4", 16384)]}
    for role, items in change.items():
        a[role] = items
    return a


def test_execute_gpu_path_launches_the_plans_arrays(fake_gpu_executor):
    import ctypes

    plan = a_plan()
    assert fake_gpu_executor(plan, arrays(), 0)
    assert fake_gpu_executor(plan, arrays(**{"in": [FakeArray((4, 8), "<u2", 4096), None]}),
                             type("S", (), {"handle": ctypes.c_void_p(0x1234)})())
    c_strides = arrays(**{"in": [FakeArray((4, 8), "<u2", 4096, strides=(16, 2)), FakeArray((8,), "<f4", 8192)]})
    assert fake_gpu_executor(plan, c_strides, 0)  # explicit C-order strides are C order
    assert len(FakeLaunch.made) == 1 and FakeLaunch.made[0][0] is plan  # one PointerLaunch, kept
    calls = fake_gpu_executor.__globals__["_POINTER_PLANS"][(id(plan), 0)][0].calls
    assert calls[0][0] == [4096, 8192, 12288, 16384]  # ins, outs, tmps in plan order
    assert calls[1] == ([4096, 0, 12288, 16384], 0x1234)  # an input the plan does not read: 0


def test_execute_gpu_path_leaves_unknown_argument_types_to_numba(fake_gpu_executor, monkeypatch):
    from gpurouter.kernels._base import pointer

    def refuse(plan, ordinal):
        raise TypeError("no kernel parameter type for 1.5")

    monkeypatch.setattr(pointer, "PointerLaunch", refuse)
    plan = a_plan()
    assert not fake_gpu_executor(plan, arrays(), 0)
    assert not fake_gpu_executor(plan, arrays(), 0)  # remembered


@pytest.mark.parametrize("bad", ["shape", "dtype", "strides", "misaligned view", "missing"])
def test_execute_gpu_path_leaves_other_arrays_to_numba(fake_gpu_executor, bad):
    x = {"shape": FakeArray((8, 4), "<u2", 4096), "dtype": FakeArray((4, 8), "<f2", 4096),
         "strides": FakeArray((4, 8), "<u2", 4096, strides=(32, 4)),
         "misaligned view": FakeArray((4, 8), "<u2", 4098)}.get(bad)
    ins = [] if bad == "missing" else [x, FakeArray((8,), "<f4", 8192)]
    assert not fake_gpu_executor(a_plan(), arrays(**{"in": ins}), 0)
    assert FakeLaunch.made == []


# ----------------------------------------------------------------------------
# The FFI handler (a CPU cfunc) from the cache, in a fresh process
# ----------------------------------------------------------------------------


def probe_handler(address: int) -> list:
    """What the handler at ``address`` does with three hand-made call frames:
    XLA's metadata query, a call frame too small, an API of another major
    version (the last two: the error message it hands XLA)."""
    import ctypes

    import numpy as np

    from gpurouter._transport import ffi_abi as abi

    fn = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(address)
    out = []
    ext, md, frame = np.zeros(16, np.int64), np.zeros(16, np.int64), np.zeros(64, np.int64)
    ext.view(np.int32)[abi.EXT_TYPE // 4] = abi.EXTENSION_METADATA
    ext[abi.EXT_METADATA // 8] = md.ctypes.data
    md[abi.MD_STRUCT_SIZE // 8] = 64
    frame[abi.CF_EXTENSION // 8] = ext.ctypes.data
    out.append([int(fn(frame.ctypes.data)), md.tolist()])
    messages = []

    @ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)
    def error_create(args):
        messages.append(ctypes.string_at(ctypes.c_int64.from_address(args + abi.ERR_MESSAGE).value).decode())
        return 77

    api = np.zeros(64, np.int64)
    api[abi.API_STRUCT_SIZE // 8] = api.nbytes
    api[abi.API_ERROR_CREATE // 8] = ctypes.cast(error_create, ctypes.c_void_p).value
    for size, major in ((8, abi.ABI_MAJOR), (abi.CF_MIN_SIZE, abi.ABI_MAJOR + 1)):
        frame = np.zeros(64, np.int64)
        frame[abi.CF_API // 8] = api.ctypes.data
        frame[abi.CF_STRUCT_SIZE // 8] = size
        api.view(np.int32)[abi.API_MAJOR // 4] = major
        out.append([int(fn(frame.ctypes.data)), messages[-1:] if messages else None])
        messages.clear()
    return out


def test_the_ffi_handler_loads_from_the_cache_in_a_fresh_process(tmp_path):
    """The handler compiled here (stored in a fresh cache folder) and the one a
    fresh process loads from it (no compile) answer the same frames alike."""
    pytest.importorskip("jax")
    from gpurouter._transport import ffi, ffi_cache

    compiled = ffi_cache.cached_cfunc(ffi._compile_handler, cache=disk_cache.DiskCache(tmp_path))
    want = probe_handler(compiled.address)
    assert want[0][0] == 0 and want[1][0] == want[2][0] == 77
    assert "older than the handler reads" in want[1][1][0] and "major version" in want[2][1][0]
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_kernel_cache import probe_handler
        from gpurouter._transport import ffi, ffi_cache
        h = ffi._handler()
        print(json.dumps([type(h).__name__, ffi_cache.STATS, probe_handler(h.address)]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "GPUROUTER_CACHE"}
    env.update(PYTHONPATH=str(ROOT), GPUROUTER_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kind, stats, got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (kind, stats) == ("LoadedCFunc", {"compiled": 0, "loaded": 1, "seeded": 0, "worker": 0})
    assert got == want


def test_the_ffi_handler_from_its_seed_answers_as_the_compiled_one(tmp_path, monkeypatch):
    """The handler's seed (numba's bitcode for a generic CPU, made by a fresh
    process) gives, with an empty cache, a handler that LLVM makes for this
    host without numba's compile; it answers the probe frames as the compiled
    one does, and its machine code is stored, so a fresh process loads it."""
    pytest.importorskip("jax")
    from gpurouter._transport import ffi, ffi_cache

    want = probe_handler(ffi_cache.cached_cfunc(ffi._compile_handler, cache=disk_cache.DiskCache(tmp_path / "a"))
                         .address)
    folder = tmp_path / "seeds"
    folder.mkdir()
    ffi_cache.make_seed(folder)
    monkeypatch.setattr(seeds, "SEED_DIR", folder)
    monkeypatch.setattr(ffi_cache, "STATS", dict.fromkeys(ffi_cache.STATS, 0))
    monkeypatch.delenv("GPUROUTER_SEEDS", raising=False)
    cache = disk_cache.DiskCache(tmp_path / "b")
    handler = ffi_cache.cached_cfunc(lambda: pytest.fail("compiled, not made from the seed"), cache=cache)
    assert type(handler).__name__ == "LoadedCFunc" and ffi_cache.STATS["seeded"] == 1
    assert probe_handler(handler.address) == want
    assert cache.load(ffi_cache.handler_key(ffi_cache._codegen())) is not None  # stored for the next process
    assert not ffi_cache.compile_in_worker([sys.executable, "-c", "raise SystemExit(1)"],
                                           disk_cache.DiskCache(tmp_path / "c"))  # a seed: no worker


def test_cubin_bytes_reads_every_form_numba_returns(tmp_path):
    """numba-cuda 0.30 on a GPU returns a ``cuda.core`` ``ObjectCode`` from ``get_cubin``
    (found on an H200: ``bytes()`` of it raised TypeError); older ones return bytes."""
    blob = b"\x7fELF-not-really-a-cubin"
    assert seeds.cubin_bytes(blob) == blob
    assert seeds.cubin_bytes(bytearray(blob)) == blob
    path = tmp_path / "k.cubin"
    path.write_bytes(blob)

    class FromFile:  # ObjectCode's ``code`` may be a path
        code = str(path)

    assert seeds.cubin_bytes(FromFile()) == blob
    core = pytest.importorskip("cuda.core", reason="cuda.core (numba-cuda's ObjectCode) is not installed")
    assert seeds.cubin_bytes(core.ObjectCode.from_cubin(blob)) == blob
    with pytest.raises(TypeError, match="cannot read a cubin"):
        seeds.cubin_bytes(object())
