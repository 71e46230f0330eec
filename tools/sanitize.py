"""Runs every kernel op and mode once at small shapes: the workload for
``compute-sanitizer --tool memcheck|racecheck python tools/sanitize.py [--quick]``.

Every launcher is called on NumPy inputs (fp32, bf16, fp16; T not a multiple
of the tile; E not a multiple of 32) and its result is compared with the
reference, so a sanitizer run is also a correctness run.
"""

from __future__ import annotations

import itertools
import sys

import ml_dtypes
import numpy as np

from gpurouter import kernels as K
from gpurouter import reference as ref


def main(argv: list[str]) -> int:
    quick = "--quick" in argv  # racecheck is ~10x slower than memcheck
    rng = np.random.default_rng(0)
    failures = 0
    cases = 0
    shapes = ((40, 37),) if quick else ((8, 5), (40, 37), (256, 70))
    dtypes = (np.float32, ml_dtypes.bfloat16) if quick else (np.float32, ml_dtypes.bfloat16, np.float16)
    for e, t in shapes:
        for dtype in dtypes:
            x = rng.standard_normal((t, e)).astype(np.float32).astype(dtype)
            bias = np.linspace(-0.1, 0.1, e, dtype=np.float32)
            for sf, pre, grouped, k in itertools.product(
                    ("softmax", "sigmoid", "sqrtsoftplus"), (False, True), (False, True), (1, 4)):
                if (pre and sf != "softmax") or (grouped and (e % 4 or k % 2)):
                    continue
                kw = dict(use_pre_softmax=pre, num_groups=4 if grouped else -1,
                          group_topk=2 if grouped else -1, scaling_factor=1.5, score_function=sf,
                          expert_bias=None if sf == "softmax" else bias)
                probs, rmap, saved = K.topk_with_score_function_fwd(x, k, **kw)
                want = ref.topk_with_score_function_fwd(x, k, **kw)
                grad = K.topk_with_score_function_bwd(rmap, saved, probs, k, pre, 1.5, sf)
                want_g = ref.topk_with_score_function_bwd(want[1], want[2], want[0], k, pre, 1.5, sf)
                cases += 1
                if not (np.array_equal(rmap, np.asarray(want[1])) and np.allclose(
                        np.asarray(grad, np.float32), np.asarray(want_g, np.float32), atol=5e-2, rtol=5e-2)):
                    failures += 1
                    print("MISMATCH topk", e, t, dtype, kw, k)
            for sf in ("softmax", "sigmoid", "sqrtsoftplus"):
                scores, rmap, saved = K.score_for_aux_loss_fwd(x, 4, sf)
                g = K.score_for_aux_loss_bwd(saved, scores, sf, dtype)
                want = ref.score_for_aux_loss_fwd(x, 4, sf)
                cases += 1
                if not np.allclose(scores, np.asarray(want[0]), atol=1e-5, rtol=1e-4):
                    failures += 1
                    print("MISMATCH aux scores", e, t, dtype, sf)
                del g
            tpe = rng.integers(0, 100, e).astype(np.int32)
            loss, c = K.moe_aux_loss_fwd(x, tpe, 4, 0.01)
            gp = K.moe_aux_loss_bwd(c, tpe, np.ones((), dtype), t)
            want, _ = ref.moe_aux_loss_fwd(x, tpe, 4, 0.01)
            cases += 1
            if not np.allclose(np.float32(loss), np.float32(want), rtol=1e-2):
                failures += 1
                print("MISMATCH aux loss", e, t, dtype)
            del gp
    print(f"sanitize workload: {cases} cases, {failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
