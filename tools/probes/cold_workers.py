"""Issue #36 on a GPU: a cold DeepSeek-V3 first call with the compile workers
off (GPUROUTER_COMPILE_WORKERS=0) and on (the default), each over a fresh
kernel cache (``python -m gpurouter coldstart`` makes one), then warm.

Prints both runs' rows and PASS/FAIL: with workers on, the cold run's
kernels were compiled by workers (``by_workers >= 2``) and loaded by the
parent, and the warm runs of both compile nothing. About 40-60 s on an H200.

    python tools/probes/cold_workers.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def run(workers: str | None) -> list[dict]:
    env = dict(os.environ)
    env.pop("GPUROUTER_COMPILE_WORKERS", None)
    if workers is not None:
        env["GPUROUTER_COMPILE_WORKERS"] = workers
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        subprocess.run([sys.executable, "-m", "gpurouter", "coldstart", "--presets", "deepseek-v3",
                        "--backends", "numba", "--json", out], env=env, check=True)
        with open(out) as f:
            return json.load(f)["rows"]


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    off, on = run("0"), run(None)
    cold_off, warm_off = off
    cold_on, warm_on = on
    print(f"cold first call: workers off {cold_off['first_s']:.2f} s, "
          f"on ({cold_on['workers']} workers, {cold_on['by_workers']} kernels) {cold_on['first_s']:.2f} s; "
          f"warm: {warm_off['first_s']:.2f} s / {warm_on['first_s']:.2f} s")
    checks = {
        "workers off: none started": cold_off["workers"] == 0 and cold_off["by_workers"] == 0,
        "workers on: >= 2 kernels compiled by workers": cold_on["by_workers"] >= 2,
        "workers on: the parent compiled only what workers did not": cold_on["compiled"] < cold_off["compiled"],
        "warm runs compile nothing": warm_off["compiled"] == 0 and warm_on["compiled"] == 0,
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    print("cold_workers:", "PASS" if all(checks.values()) else "FAIL")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
