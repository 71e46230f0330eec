"""Per-check wall times of gpurouter's conformance suite (gpurouter.testing) on a backend.

    python tools/probes/conformance_times.py --backend numba [--examples 100]

Prints each check's table (properties, examples, seconds).
"""

from __future__ import annotations

import argparse
import time

import gpurouter as gr
from gpurouter.testing import check_aux_loss, check_aux_scores, check_router_z_loss, check_topk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["jax", "numba"], default="numba")
    ap.add_argument("--examples", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    b = a.backend
    fns = [
        (check_topk, lambda *x: gr.fused_topk_with_score_function(*x, backend=b)),
        (check_aux_scores, lambda x, k, sf: gr.fused_topk_with_score_function(
            x, k, score_function=sf, compute_aux_scores=True, backend=b)),
        (check_aux_loss, lambda p, n, k, c: gr.fused_moe_aux_loss(p, n, k, c, backend=b)),
        (check_router_z_loss, lambda x, c: gr.router_z_loss(x, c, backend=b)),
    ]
    for check, fn in fns:
        t0 = time.perf_counter()
        report = check(fn, max_examples=a.examples, seed=a.seed)
        print(report)
        print(f"{check.__name__} backend={b}: {time.perf_counter() - t0:.1f} s\n", flush=True)


if __name__ == "__main__":
    main()
