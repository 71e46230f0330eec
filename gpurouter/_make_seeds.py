"""``python -m gpurouter cache make-seeds``: the package's seeds, made on a GPU.

Runs each preset's first router step (``coldstart.router_step``: the top-k
forward and backward with the preset's bias, the aux scores and the aux
loss) for each logits dtype in this process, with the disk cache off so that
numba compiles every kernel, and writes what numba links of each kernel (its LTO-IR, or PTX)
(``kernels/_base/seeds.py``) to ``gpurouter/seeds/``: ``<key>.seed`` files,
the FFI handler's bitcode for a generic CPU (``handler-<key>.hseed``,
``_transport/ffi_cache.py``) and ``MANIFEST.json`` (the source digest and toolchain they were made with,
the GPU, and what each seed is). The folder's old seeds are replaced.

Run it again after any edit of ``gpurouter/kernels`` (the seeds' key holds
the source digest: ``tests/test_seeds.py`` fails while they are stale) or a
change of numba's version.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_DTYPES = ("bfloat16", "float32")
TOKENS = 4096


def make(presets, dtypes, folder: Path, tokens: int = TOKENS, say=print) -> dict:
    """Compiles and records (module docstring); returns the manifest written."""
    os.environ["GPUROUTER_CACHE"] = "0"  # every kernel compiled here, none loaded or linked
    import jax

    from .kernels._base import keys, seeds

    seeds.RECORDING = []
    configs = []
    t_all = time.perf_counter()
    restore = _record_numba_compiles(seeds)
    try:
        _run(presets, dtypes, tokens, configs, say)
    finally:
        restore()

    recorded, seeds.RECORDING = seeds.RECORDING, None
    skipped = [r for r in recorded if r["skipped"]]
    for r in skipped[:5]:
        say(f"no seed for {_name(r['kernel'])}: {r['skipped']}")
    if not recorded or len(skipped) == len(recorded):
        say(f"no seed made: {len(recorded)} kernels recorded, {len(skipped)} without code to ship; "
            f"{folder} left as it was")
        return {}
    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    for r in recorded:
        key = None if r["skipped"] else keys.seed_key(r["kernel"], r["argtypes"], r["cc"])
        if key is None or key in made:
            continue
        data = seeds.pack(r["entry"], r["code"], r["max_registers"], r["kind"])
        (folder / f"{key}.seed").write_bytes(data)
        made[key] = {"kernel": _name(r["kernel"]), "args": [str(t) for t in r["argtypes"]],
                     "target": f"compute_{r['cc'][0]}{r['cc'][1]}", "kind": r["kind"], "bytes": len(data)}
    for old in folder.glob("*.seed"):
        if old.stem not in made:
            old.unlink()
    from ._transport import ffi_cache

    handler = ffi_cache.make_seed(folder)
    manifest = {
        "source_digest": keys.source_digest(),
        "seed_toolchain": keys.seed_toolchain(),
        "made": {"date": datetime.date.today().isoformat(), "gpu": jax.devices()[0].device_kind, "tokens": tokens,
                 "seconds": round(time.perf_counter() - t_all, 1)},
        "configs": configs,
        "seeds": dict(sorted(made.items())),
        "handler": {"file": handler.name, "bytes": handler.stat().st_size,
                    "sources_digest": ffi_cache.sources_digest()},
    }
    (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    seeds.index.cache_clear()
    say(f"{len(made)} seeds, {sum(m['bytes'] for m in made.values()) / 1e6:.2f} MB, in {folder}; "
        f"{len(skipped)} kernels without one; the FFI handler's: {handler.name}")
    return manifest


def _run(presets, dtypes, tokens, configs, say) -> None:
    import jax

    from .coldstart import router_step
    from .kernels._base import kernel_cache, seeds

    for i, preset in enumerate(presets):
        for dtype in dtypes:
            t0 = time.perf_counter()
            before = len(seeds.RECORDING)
            step, logits = router_step(preset, "numba", dtype)
            jax.block_until_ready(step(logits(tokens)))
            configs.append({"preset": preset, "dtype": dtype, "kernels": len(seeds.RECORDING) - before})
            say(f"[{i + 1}/{len(presets)}] {preset} {dtype}: {len(seeds.RECORDING) - before} kernels "
                f"recorded in {time.perf_counter() - t0:.1f} s (this process so far: {kernel_cache.STATS})")


def _record_numba_compiles(seeds):
    """numba's kernel compiles, each recorded (``seeds.record``) with the
    argument types it was compiled for; returns the undo."""
    from numba import cuda
    from numba.cuda import dispatcher

    original = dispatcher.CUDADispatcher.compile

    def compile_and_record(self, sig):
        compiled = original(self, sig)
        if not self.targetoptions.get("device"):
            argtypes = tuple(sig) if isinstance(sig, (tuple, list)) else tuple(getattr(sig, "args", ()))
            seeds.record(self, argtypes, cuda.get_current_device().compute_capability, compiled._codelibrary)
        return compiled

    dispatcher.CUDADispatcher.compile = compile_and_record
    return lambda: setattr(dispatcher.CUDADispatcher, "compile", original)


def _name(kernel) -> str:
    fn = getattr(kernel, "py_func", kernel)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def main(presets, dtypes, folder) -> int:
    from .coldstart import _gpu_problem

    problem = _gpu_problem()
    if problem:
        print(f"python -m gpurouter cache make-seeds needs a CUDA GPU: {problem}", file=sys.stderr)
        return 2
    made = make(presets, dtypes, Path(folder), say=lambda m: print(m, file=sys.stderr, flush=True))
    return 0 if made else 1
