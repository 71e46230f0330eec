"""``python -m gpurouter cache info|clear``: the persistent kernel cache
(``gpurouter/kernels/_base/disk_cache.py``; docs/cache.md)."""

from __future__ import annotations

import argparse
import json

from ._cli import comma_list
from .presets import PRESETS

USAGE = ("python -m gpurouter cache {info,clear} [--json]\n"
         "       python -m gpurouter cache make-seeds [--presets P,...|all] [--dtypes D,...] [--out DIR]")


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpurouter cache", usage=USAGE,
        description="The compiled kernels gpurouter keeps on disk: GPUROUTER_CACHE_DIR, else "
                    "$XDG_CACHE_HOME/gpurouter, else ~/.cache/gpurouter (GPUROUTER_CACHE=0: off; "
                    "GPUROUTER_CACHE_MAX_MB: the size bound; GPUROUTER_CACHE_WAIT_S: the longest wait for "
                    "another process's compile of a kernel).")
    parser.add_argument("action", choices=["info", "clear", "make-seeds"],
                        help="info: where the cache is, its entries and size; clear: delete every entry; "
                             "make-seeds (on a GPU): the package's seeds, the presets' kernels as numba's LTO-IR "
                             "(docs/cache.md, \"Seeds\")")
    parser.add_argument("--json", action="store_true", help="print info as one JSON object")
    parser.add_argument("--presets", type=comma_list([*PRESETS, "all"], "preset"), default=["all"],
                        help="make-seeds: comma-separated presets, or all (default)")
    parser.add_argument("--dtypes", type=comma_list(["bfloat16", "float32", "float16"], "dtype"),
                        default=["bfloat16", "float32"],
                        help="make-seeds: the logits dtypes (default bfloat16,float32)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="make-seeds: the folder to write (default: the package's gpurouter/seeds)")
    args = parser.parse_args(argv)
    if args.action == "make-seeds":
        from . import _make_seeds
        from .kernels._base import seeds

        presets = list(PRESETS) if "all" in args.presets else args.presets
        return _make_seeds.main(presets, args.dtypes, args.out or seeds.SEED_DIR)
    from .kernels._base import disk_cache

    cache = disk_cache.DiskCache(disk_cache.cache_dir())
    if args.action == "clear":
        gone = cache.clear()
        print(f"gpurouter kernel cache: deleted {gone} entries from {cache.folder}")
        return 0
    info = cache.info()
    if args.json:
        from .kernels._base import seeds

        info["seeds"] = seeds.status()
        print(json.dumps(info))
        return 0
    state = "on" if info["enabled"] else "off (GPUROUTER_CACHE=0)"
    print(f"gpurouter kernel cache: {state}\n"
          f"  dir      {info['dir']}\n"
          f"  entries  {info['entries']}\n"
          f"  size     {_human(info['bytes'])} of at most {_human(info['max_bytes'])}")
    from .kernels._base import seeds

    st = seeds.status()
    made = st["made"] or {}
    print(f"  seeds    {st['count']} in the package ({', '.join(st['targets']) or '-'}; made "
          f"{made.get('date', '?')} on {made.get('gpu', '?')}): "
          + (f"not used here: {st['unusable']}" if st["unusable"] else "used on a miss"))
    if info["compiling"]:
        print(f"  locks    {info['compiling']} (compiles in progress, or left by a process that "
              "ended; a waiting process takes over a lock whose process is gone)")
    return 0
