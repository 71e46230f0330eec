"""Warp instructions a token, block by block, from Nsight Compute's per-instruction
counts: where a kernel's instructions go (lab/journal/benchmarks.md, "The warp forward's
instructions").

    ncu --kernel-name regex:warp_topk_fwd --launch-count 1 --section SourceCounters \\
        -o rep python3 tools/probes/path_probe.py --cases nemotron-3-super --paths warp --tokens 65536 --repeats 1
    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 tools/probes/ncu_blocks.py rep.csv --tokens 65536 [--min 6]

A block is a run of consecutive SASS instructions executed the same number of times
(straight-line code); each printed line: its first instruction's row, its length, its
executions a token, its instructions a token, its share of the stall samples and its
commonest opcodes.  Blocks under ``--min`` instructions a token are left out.
"""

from __future__ import annotations

import argparse
import csv


def opcode(text: str) -> str:
    words = [w for w in text.replace("{", " ").split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--tokens", type=int, required=True, help="the tokens the profiled launch routed")
    ap.add_argument("--min", type=float, default=6.0, help="leave out blocks under this many instructions a token")
    a = ap.parse_args()
    with open(a.csv) as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if "Instructions Executed" in r)
    hdr, data = rows[head], rows[head + 1:]
    ex, src = hdr.index("Instructions Executed"), hdr.index("Source")
    smp = hdr.index("Warp Stall Sampling (All Samples)")
    count = [int(r[ex] or 0) for r in data]
    samples = [int(r[smp] or 0) for r in data]
    total, all_samples = sum(count), max(1, sum(samples))
    print(f"{total / a.tokens:.1f} warp instructions a token ({total} in all)")
    start = 0
    for i in range(1, len(data) + 1):
        if i < len(data) and count[i] == count[start]:
            continue
        n = sum(count[start:i]) / a.tokens
        if n >= a.min:
            ops: dict[str, int] = {}
            for r in data[start:i]:
                op = opcode(r[src])
                ops[op] = ops.get(op, 0) + 1
            top = ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:5])
            share = 100 * sum(samples[start:i]) / all_samples
            print(f"row {start:5d}  {i - start:4d} instr  x{count[start] / a.tokens:6.3f}  {n:7.1f} a token  "
                  f"{share:5.1f}% of samples  {top}")
        start = i


if __name__ == "__main__":
    main()
