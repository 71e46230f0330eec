"""Per-check wall times of gpurouter's conformance suite (gpurouter.testing) on a backend.

    python tools/probes/conformance_times.py --backend numba [--examples 100] [--checks topk,token-dispatch]

Prints each check's table (properties, examples, seconds).
"""

from __future__ import annotations

import argparse
import time

import gpurouter as gr
import gpurouter.moe as gm
from gpurouter.testing import (
    check_aux_loss,
    check_aux_scores,
    check_router_z_loss,
    check_token_combine,
    check_token_dispatch,
    check_topk,
)

CHECKS = ("topk", "aux-scores", "aux-loss", "z-loss", "token-dispatch", "token-combine")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["jax", "numba"], default="numba")
    ap.add_argument("--examples", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    a = ap.parse_args()
    b = a.backend
    chosen = a.checks.split(",")
    if unknown := [c for c in chosen if c not in CHECKS]:
        ap.error(f"--checks: unknown {unknown}; choose from {list(CHECKS)}")

    def dispatch(inp, m, n, probs, align):
        return gm.token_dispatch(inp, m, n, probs, align, backend=b)

    fns = {
        "topk": (check_topk, (lambda *x: gr.fused_topk_with_score_function(*x, backend=b),)),
        "aux-scores": (check_aux_scores, (lambda x, k, sf: gr.fused_topk_with_score_function(
            x, k, score_function=sf, compute_aux_scores=True, backend=b),)),
        "aux-loss": (check_aux_loss, (lambda p, n, k, c: gr.fused_moe_aux_loss(p, n, k, c, backend=b),)),
        "z-loss": (check_router_z_loss, (lambda x, c: gr.router_z_loss(x, c, backend=b),)),
        "token-dispatch": (check_token_dispatch, (dispatch,)),
        "token-combine": (check_token_combine, (lambda y, rid, w, pad: gm.token_combine(y, rid, w, pad, backend=b),
                                                dispatch)),
    }
    for name in chosen:
        check, args = fns[name]
        t0 = time.perf_counter()
        report = check(*args, max_examples=a.examples, seed=a.seed)
        print(report)
        print(f"{check.__name__} backend={b}: {time.perf_counter() - t0:.1f} s\n", flush=True)


if __name__ == "__main__":
    main()
