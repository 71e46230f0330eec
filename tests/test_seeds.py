"""The package's seeds (gpurouter/kernels/_base/seeds.py): the presets' kernels
as numba's LTO-IR (or PTX), linked by numba's linker on a miss of an empty cache. On the CPU: the
seed key, the seed file, the lookup with the GPU steps faked, the workers
skipping seeded kernels, and the shipped seeds being those of today's kernel
sources. The real link runs on the GPU
(tests/test_kernel_cache.py::test_an_empty_cache_links_the_shipped_seeds_with_the_bits_of_a_compile,
test_a_linked_seed_is_the_cubin_of_numbas_compile)."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from test_kernel_cache import ARGS, factory, source_and_toolchain_variants  # noqa: E402

from gpurouter.kernels._base import disk_cache, kernel_cache, keys, parallel, seeds  # noqa: E402

PTX = ".version 8.5\n.target sm_90\n.address_size 64\n// a kernel\n"


def seed_key(kernel=None, args=ARGS, cc=(9, 0)):
    return keys.seed_key(kernel or factory(4, True), args, cc)


def test_seed_key_holds_the_kernel_and_numba_but_not_the_driver_or_cuda_packages(monkeypatch):
    base = seed_key()
    assert base == seed_key() and len(base) == 64
    assert base != keys.kernel_key(factory(4, True), ARGS, (9, 0), 12080)
    variants = {"factory int": seed_key(factory(5, True)), "argument types": seed_key(args=("int32",)),
                "ptx target": seed_key(cc=(10, 0))}
    variants.update(source_and_toolchain_variants(monkeypatch, seed_key, "seed_toolchain"))
    assert len(set(variants.values())) == len(variants) and base not in variants.values(), variants
    monkeypatch.setattr(keys, "toolchain", lambda: "nvidia-nvvm=99")  # NVVM, the runtime, paths: not in it
    assert seed_key() == base
    assert "numba=" in keys.seed_toolchain() and "nvvm" not in keys.seed_toolchain()


def test_the_cache_modules_are_out_of_the_source_digest(tmp_path):
    """An edit of the cache's own lookup code keeps every key (and the seeds)."""
    root = keys.Path(keys.__file__).resolve().parents[1]
    for name in keys.CACHE_MODULES:
        assert (root / name).is_file(), name
    assert "_base/plan.py" not in keys.CACHE_MODULES  # launch code stays in: coarse, never stale


def test_seed_file_round_trips_and_rejects_garbage():
    data = seeds.pack("_Z6kernel", PTX, 64)
    assert seeds.unpack(data) == ("_Z6kernel", PTX.encode(), 64, "ptx")
    assert seeds.unpack(seeds.pack("e", PTX, None))[2] is None
    assert seeds.unpack(seeds.pack("e", b"\x00LTO", None, "ltoir")) == ("e", b"\x00LTO", None, "ltoir")
    with pytest.raises(ValueError, match="kind"):
        seeds.pack("e", PTX, None, "cubin")
    head = b'{"entry": "e", "kind": "cubin"}'  # a kind this version does not know: not a seed
    assert seeds.unpack(seeds._MAGIC + len(head).to_bytes(4, "little") + head + seeds.lzma.compress(b"x")) is None
    for bad in (b"", b"GRS1", data[:20], b"XXXX" + data[4:], data[:-5], seeds._MAGIC + b"\x02\x00\x00\x00{}"):
        assert seeds.unpack(bad) is None, bad


@pytest.fixture
def seed_dir(tmp_path, monkeypatch):
    """A folder with the seed of ``factory(4, True)`` for cc 9.0; seeds on."""
    folder = tmp_path / "seeds"
    folder.mkdir()
    (folder / f"{seed_key()}.seed").write_bytes(seeds.pack("entry_k", PTX, None))
    monkeypatch.delenv("GPUROUTER_SEEDS", raising=False)
    seeds.index.cache_clear()
    yield folder
    seeds.index.cache_clear()


def test_cubin_of_links_a_seed_and_none_without_one(seed_dir, monkeypatch):
    linked = []

    def link(code, regs, ordinal, cc, kind):
        linked.append((code, regs, ordinal, cc, kind))
        return b"CUBIN"

    before = dict(seeds.STATS)
    got = seeds.cubin_of(factory(4, True), ARGS, (9, 0), 1, folder=seed_dir, link_fn=link)
    assert got == ("entry_k", b"CUBIN") and linked == [(PTX.encode(), None, 1, (9, 0), "ptx")]
    assert seeds.STATS["linked"] == before["linked"] + 1
    assert seeds.cubin_of(factory(5, True), ARGS, (9, 0), 0, folder=seed_dir, link_fn=link) is None
    assert seeds.cubin_of(factory(4, True), ARGS, (8, 0), 0, folder=seed_dir, link_fn=link) is None
    assert seeds.cubin_of(factory(4, True), ARGS, (9, 0), 0, folder=seed_dir, link_fn=lambda *a: None) is None
    assert seeds.STATS["refused"] == before["refused"] + 1
    assert seeds.has(factory(4, True), ARGS, (9, 0), seed_dir)
    monkeypatch.setenv("GPUROUTER_SEEDS", "0")
    assert seeds.cubin_of(factory(4, True), ARGS, (9, 0), 0, folder=seed_dir, link_fn=link) is None
    assert not seeds.has(factory(4, True), ARGS, (9, 0), seed_dir)


def test_a_corrupt_seed_is_refused_and_compiled(seed_dir):
    (seed_dir / f"{seed_key()}.seed").write_bytes(b"GRS1 not a seed")
    assert seeds.cubin_of(factory(4, True), ARGS, (9, 0), 0, folder=seed_dir, link_fn=lambda *a: b"C") is None


def fake_compile(kernel, argtypes, ordinal):
    fake_compile.calls += 1
    return 7, "entry_c", b"COMPILED"


def test_resolve_links_the_seed_stores_it_and_loads_it_next_time(tmp_path):
    cache = disk_cache.DiskCache(tmp_path / "cache")
    fake_compile.calls = 0
    loads = []

    def load(entry, cubin, ordinal):
        loads.append((entry, cubin))
        return 11

    def seed_fn(kernel, argtypes, cc, ordinal):
        assert cc == (9, 0)
        return "entry_s", b"SEEDED"

    k = factory(4, True)
    before = kernel_cache.STATS["seeded"]
    kw = dict(compile_fn=fake_compile, load_fn=load, cc=(9, 0), driver=12080)
    assert kernel_cache.resolve(k, ARGS, 0, cache, seed_fn=seed_fn, **kw) == 11
    assert fake_compile.calls == 0 and loads == [("entry_s", b"SEEDED")]
    assert kernel_cache.STATS["seeded"] == before + 1
    key = keys.kernel_key(k, ARGS, (9, 0), 12080)
    assert kernel_cache.unpack_payload(cache.load(key)) == ("entry_s", b"SEEDED")
    # the next lookup loads the stored cubin: no seed asked for
    assert kernel_cache.resolve(k, ARGS, 0, cache, seed_fn=lambda *a: pytest.fail("seed again"), **kw) == 11


def test_resolve_compiles_when_there_is_no_seed_or_the_driver_refuses_it(tmp_path):
    fake_compile.calls = 0
    kw = dict(compile_fn=fake_compile, cc=(9, 0), driver=12080)
    cache = disk_cache.DiskCache(tmp_path / "a")
    assert kernel_cache.resolve(factory(4, True), ARGS, 0, cache, load_fn=lambda *a: 11,
                                seed_fn=lambda *a: None, **kw) == 7
    cache = disk_cache.DiskCache(tmp_path / "b")
    refused = kernel_cache.resolve(factory(4, True), ARGS, 0, cache, load_fn=lambda e, c, o: 0 if c == b"S" else 11,
                                   seed_fn=lambda *a: ("e", b"S"), **kw)
    assert refused == 7 and fake_compile.calls == 2
    key = keys.kernel_key(factory(4, True), ARGS, (9, 0), 12080)
    assert kernel_cache.unpack_payload(cache.load(key)) == ("entry_c", b"COMPILED")


def test_workers_skip_kernels_with_a_seed(tmp_path, seed_dir, monkeypatch):
    monkeypatch.setattr(seeds, "SEED_DIR", seed_dir)
    seeded, plain = factory(4, True), factory(5, True)
    for k in (seeded, plain):
        setattr(k, parallel.RECIPE_ATTR, ("tests.test_kernel_cache", "factory", (4, True), ()))
    cache = disk_cache.DiskCache(tmp_path / "cache")
    jobs = parallel.pending([(seeded, ARGS), (plain, ARGS)], 0, cache, cc=(9, 0), driver=12080)
    assert [j[2] for j in jobs] == [keys.kernel_key(plain, ARGS, (9, 0), 12080)]
    monkeypatch.setenv("GPUROUTER_SEEDS", "0")
    assert len(parallel.pending([(seeded, ARGS), (plain, ARGS)], 0, cache, cc=(9, 0), driver=12080)) == 2


def test_status_says_why_seeds_are_not_used(seed_dir, monkeypatch):
    manifest = {"source_digest": keys.source_digest(), "seed_toolchain": keys.seed_toolchain(),
                "made": {"date": "2026-11-28", "gpu": "H200"},
                "seeds": {seed_key(): {"target": "compute_90", "kind": "ltoir"}}}
    (seed_dir / "MANIFEST.json").write_text(json.dumps(manifest))
    st = seeds.status(seed_dir)
    assert st["count"] == 1 and st["targets"] == ["compute_90"] and st["unusable"] == ""
    (seed_dir / "MANIFEST.json").write_text(json.dumps({**manifest, "source_digest": "0" * 64}))
    assert seeds.status(seed_dir)["unusable"].startswith("stale")
    other = keys.seed_toolchain().replace("numba=", "numba=0.1+", 1)
    (seed_dir / "MANIFEST.json").write_text(json.dumps({**manifest, "seed_toolchain": other}))
    why = seeds.status(seed_dir)["unusable"]
    assert why.startswith("made with numba=0.1+") and "llvmlite" not in why, why  # only what differs
    monkeypatch.setenv("GPUROUTER_SEEDS", "off")
    assert seeds.status(seed_dir)["unusable"] == "GPUROUTER_SEEDS=0"
    assert seeds.status(seed_dir / "none")["unusable"] in ("GPUROUTER_SEEDS=0",)
    monkeypatch.delenv("GPUROUTER_SEEDS")
    assert seeds.status(seed_dir / "none")["unusable"] == "the package has no seeds"


def test_the_shipped_seeds_are_those_of_todays_kernels():
    """``gpurouter/seeds`` holds the seeds that ``python -m gpurouter cache
    make-seeds`` wrote for the kernel sources of this commit: after an edit of
    ``gpurouter/kernels`` they are stale (never used, so an empty cache
    compiles again) until they are made again on a GPU."""
    manifest = json.loads((seeds.SEED_DIR / "MANIFEST.json").read_text())
    assert manifest["source_digest"] == keys.source_digest(), (
        "gpurouter/seeds is stale: run `python -m gpurouter cache make-seeds` on a GPU and commit gpurouter/seeds")
    files = {p.stem for p in seeds.SEED_DIR.glob("*.seed")}
    assert files == set(manifest["seeds"]) and files, "MANIFEST.json and the .seed files differ"
    for key in sorted(files)[:5]:
        entry, code, _, kind = seeds.unpack((seeds.SEED_DIR / f"{key}.seed").read_bytes())
        assert entry and kind == manifest["seeds"][key]["kind"]
        assert (b".entry" in code and b".target sm_" in code) if kind == "ptx" else len(code) > 1000


def test_the_extras_pin_the_versions_the_seeds_were_made_with():
    """pip's ``[cuda12]``, ``[cuda13]`` and ``[sim]`` extras install the numba, llvmlite
    and numba-cuda of the shipped seeds: another version never uses them (their key)."""
    import re

    made = dict(part.split("=", 1) for part in json.loads(
        (seeds.SEED_DIR / "MANIFEST.json").read_text())["seed_toolchain"].split(";") if "=" in part)
    text = (keys.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    for extra in ("cuda12", "cuda13", "sim"):
        line = re.search(rf"^{extra} = \[(.*?)\]\n(?=\S|#)", text, re.M | re.S).group(1)
        for name in ("numba", "llvmlite", "numba-cuda"):
            pin = re.search(rf'"{re.escape(name)}(\[\w+\])?==([^"]+)"', line)
            assert pin and pin.group(2) == made[name], (extra, name, made[name])


class FakeLibrary:
    def __init__(self, ptxes=("PTX",), files=(), lto=False, cudadevrt=False):
        self._ptxes, self._linking_files, self._lto, self.needs_cudadevrt = list(ptxes), set(files), lto, cudadevrt
        self._entry_name, self._max_registers = "entry_f", None

    def get_asm_strs(self, cc=None):
        if isinstance(self._ptxes[0], Exception):
            raise self._ptxes[0]
        return self._ptxes

    def get_ltoir(self, cc=None):
        return b"LTOIR"


def test_record_keeps_the_ltoir_or_one_ptx_and_says_why_not_otherwise(monkeypatch):
    monkeypatch.setattr(seeds, "RECORDING", [])
    cases = [FakeLibrary(), FakeLibrary(lto=True), FakeLibrary(ptxes=("a", "b")), FakeLibrary(files=("x.a",)),
             FakeLibrary(cudadevrt=True), FakeLibrary(ptxes=(RuntimeError("nvvm said no"),))]
    for lib in cases:
        seeds.record(factory(4, True), ARGS, (9, 0), lib)
    got = [(r["code"], r["skipped"]) for r in seeds.RECORDING]
    assert got[0] == (b"PTX", "") and got[1] == (b"LTOIR", "")
    assert [r["kind"] for r in seeds.RECORDING[:2]] == ["ptx", "ltoir"]
    assert got[2] == (None, "2 PTX modules") and "x.a" in got[3][1] and "cudadevrt=True" in got[4][1]
    assert got[5] == (None, "RuntimeError: nvvm said no")
    monkeypatch.setattr(seeds, "RECORDING", None)
    seeds.record(factory(4, True), ARGS, (9, 0), FakeLibrary())  # not recording: nothing, no error


def test_make_writes_the_seeds_and_manifest_and_replaces_old_ones(tmp_path, monkeypatch):
    from gpurouter import _make_seeds

    def fake_run(presets, dtypes, tokens, configs, say):
        for n in (4, 5):
            seeds.record(factory(n, True), ARGS, (9, 0), FakeLibrary())
        seeds.record(factory(6, True), ARGS, (9, 0), FakeLibrary(files=("x.a",)))
        configs.append({"preset": presets[0], "dtype": dtypes[0], "kernels": 3})

    monkeypatch.setattr(_make_seeds, "_run", fake_run)
    monkeypatch.setattr(_make_seeds, "_record_numba_compiles", lambda s: (lambda: None))
    from gpurouter._transport import ffi_cache

    def fake_handler_seed(folder):  # the real one: tests/transport/test_ffi_abi.py, test_kernel_cache.py
        path = folder / "handler-0.hseed"
        path.write_bytes(ffi_cache.pack_seed("lib", "entry", b"BC"))
        return path

    monkeypatch.setattr(ffi_cache, "make_seed", fake_handler_seed)
    monkeypatch.setenv("GPUROUTER_CACHE", "1")
    (tmp_path / "stale.seed").write_bytes(b"old")
    said = []
    manifest = _make_seeds.make(["deepseek-v3"], ["bfloat16"], tmp_path, say=said.append)
    monkeypatch.setenv("GPUROUTER_CACHE", "1")  # make() turned the cache off for its compiles
    keys_made = {seed_key(factory(4, True)), seed_key(factory(5, True))}
    assert set(manifest["seeds"]) == keys_made == {p.stem for p in tmp_path.glob("*.seed")}
    assert manifest["source_digest"] == keys.source_digest() and manifest["configs"][0]["kernels"] == 3
    assert json.loads((tmp_path / "MANIFEST.json").read_text()) == manifest
    assert seeds.unpack((tmp_path / f"{seed_key()}.seed").read_bytes()) == ("entry_f", b"PTX", None, "ptx")
    assert any("x.a" in m for m in said) and seeds.RECORDING is None
    assert manifest["handler"]["file"] == "handler-0.hseed" and manifest["handler"]["sources_digest"]

    monkeypatch.setattr(_make_seeds, "_run", lambda *a: seeds.record(factory(4, True), ARGS, (9, 0),
                                                                     FakeLibrary(files=("y",))))
    assert _make_seeds.make(["qwen3"], ["float32"], tmp_path, say=said.append) == {}
    assert {p.stem for p in tmp_path.glob("*.seed")} == keys_made  # nothing to ship: the folder kept


def test_the_shipped_handler_seed_is_that_of_todays_handler():
    """The FFI handler's seed (``_transport/ffi_cache.py``) was made from
    today's handler sources; with the seeds' toolchain it is the one this
    process would look for, and LLVM makes a handler of it."""
    from gpurouter._transport import ffi_cache

    h = json.loads((seeds.SEED_DIR / "MANIFEST.json").read_text())["handler"]
    assert h["sources_digest"] == ffi_cache.sources_digest(), (
        "the FFI handler's seed is stale: run `python -m gpurouter cache make-seeds` and commit gpurouter/seeds")
    data = (seeds.SEED_DIR / h["file"]).read_bytes()
    assert ffi_cache.unpack_seed(data) is not None and len(data) == h["bytes"]
    assert [p.name for p in seeds.SEED_DIR.glob("handler-*.hseed")] == [h["file"]]
    if seeds.status()["unusable"]:
        pytest.skip(f"the seeds are not for this process ({seeds.status()['unusable']}): key and load not checked")
    codegen = ffi_cache._codegen()
    assert ffi_cache.seed_path(codegen).name == h["file"]
    assert ffi_cache._from_seed(codegen) is not None


def test_handler_seed_file_rejects_garbage():
    from gpurouter._transport import ffi_cache

    good = ffi_cache.pack_seed("lib", "entry", b"BC")
    assert ffi_cache.unpack_seed(good) == ("lib", "entry", b"BC")
    for bad in (b"", good[:10], b"GRF1" + good[4:], ffi_cache._SEED_MAGIC + b"not xz",
                ffi_cache._SEED_MAGIC + seeds.lzma.compress(ffi_cache.pack("lib", "entry", b"object", b"BC"))):
        assert ffi_cache.unpack_seed(bad) is None, bad
