"""The MoE block's forward + backward step, several ``grouped_matmul``s at one
shape, timed in alternating rounds in one process (issue #38): a quicker A/B
than ``moe-bench`` (no stages, no jax-backend block), fair to drift.

    python tools/probes/block_ab.py --shape deepseek-v3-like --grouped-matmul batched,slots --rounds 5
    python tools/probes/block_ab.py --shape qwen3-like --scale 0.25     # T and M scaled, as moe-bench --scale
    python tools/probes/block_ab.py --tiny     # a toy shape (checks the script)

Each round times every block ``--repeats`` times (median wall ms of jitted
calls, ``moe-bench``'s ``median_ms``); printed: each round's times, then
each block's median over the rounds and its speed-up over the first. A
block that fails to compile or run is printed with its error and left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="deepseek-v3-like")
    parser.add_argument("--grouped-matmul", default="batched,slots")
    parser.add_argument("--backend", default="numba")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies T and M, as moe-bench's (default 1)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 1:
        parser.error(f"--scale must be in (0, 1], got {args.scale}")
    import jax

    from gpurouter.bench.moe import block_steps, median_ms

    names = args.grouped_matmul.split(",")
    steps, operands = block_steps(None if args.tiny else args.shape, args.backend, names, args.scale)
    failed = {}
    for n in names:  # a block that fails to compile or run (XLA's ragged_dot at large shapes) is left out
        try:
            jax.block_until_ready(steps[n](*operands))
        except Exception as e:  # noqa: BLE001  (reported, not hidden: printed and in the JSON)
            failed[n] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            print(json.dumps({"failed": n, "error": failed[n]}), flush=True)
    names = [n for n in names if n not in failed]
    if not names:
        return 1
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names:
            times[n].append(median_ms(steps[n], operands, args.repeats))
        print(json.dumps({"round": r, **{n: round(v[-1], 3) for n, v in times.items()}}), flush=True)
    med = {n: statistics.median(v) for n, v in times.items()}
    out = dict(shape="tiny" if args.tiny else args.shape, scale=args.scale, backend=args.backend,
               device=jax.devices()[0].device_kind,
               median_ms={n: round(v, 3) for n, v in med.items()},
               speedup_over_first={n: round(med[names[0]] / v, 4) for n, v in med.items()}, failed=failed,
               rounds=times)
    print(json.dumps({k_: v for k_, v in out.items() if k_ != "rounds"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
