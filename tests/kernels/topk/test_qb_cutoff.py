"""The QB cutoff kernels (gpurouter/kernels/topk/qb_cutoff.py) on the CUDA
simulator: ``alpha [T]`` of the plan's first launch equals the reference's
``qb_cutoff`` of the same fp32 scores, the (K+1)-th largest biased sigmoid
among the kept groups' experts (NaN as -inf), for the lanes kernel (quad and
scalar loads, several lane counts) and the grouped kernel (each group-score
rule); masked rows are not compared (the kernels write 0 there, never read).
The counts built on it: tests/kernels/topk/test_qb.py."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
from numba import cuda  # noqa: E402

from gpurouter._checks import ScoreFunction, TopkConfig  # noqa: E402
from gpurouter.kernels._base import launch as L  # noqa: E402
from gpurouter.kernels._base import plan as _plan  # noqa: E402
from gpurouter.kernels.topk import qb as kqb  # noqa: E402
from gpurouter.kernels.topk import qb_cutoff  # noqa: E402
from gpurouter.kernels.topk.qb_math import default_exp_mode  # noqa: E402
from gpurouter.reference._route import _eligible, _scores  # noqa: E402
from gpurouter.reference.variants import qb_cutoff as ref_cutoff  # noqa: E402

pytestmark = pytest.mark.cuda


def _alpha(x, bias, topk, mask, tiling, groups=0, group_topk=0, rule="sum_topk"):
    """The cutoff step of the QB plan alone: ``alpha [T]`` and the kernel it ran."""
    plan = kqb.qb_counts_plan(_plan.spec_for(x.shape, x.dtype), mask is not None, topk, 5, groups, group_topk,
                              rule, tiling=tiling)
    step = plan.steps[0]
    ins = [L.host_words(x), cuda.to_device(np.asarray(bias, np.float32)),
           cuda.to_device(np.asarray([-1.0, 1.0], np.float32))]
    if mask is not None:
        ins.append(cuda.to_device(np.asarray(mask, np.bool_)))
    arrays = {"in": ins, "out": [cuda.to_device(np.zeros(sp.shape, sp.dtype)) for sp in plan.outs],
              "tmp": [cuda.to_device(np.full(sp.shape, -7, sp.dtype)) for sp in plan.tmps]}
    L.launch(step.kernel, step.grid, step.block, 0, step.shared, *(_plan._resolve(a, arrays) for a in step.args))
    return arrays["tmp"][0].copy_to_host(), step.kernel


def _want(x, bias, topk, groups=-1, group_topk=-1, rule="sum_topk"):
    cfg = TopkConfig(topk, False, groups, group_topk, 1.0, ScoreFunction.SIGMOID, False)
    _, r = _scores(jnp.asarray(x).astype(jnp.float32), jnp.asarray(bias, jnp.float32), cfg)
    return np.asarray(ref_cutoff(r, topk, _eligible(r, cfg, rule)))


def _logits(t, e, dtype, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, e)) * 2).astype(dtype)
    x[0, 3] = np.nan
    x[1, :5] = 1.5  # five equal scores (zero bias there): a tie at the cutoff
    x[2, :] = -np.inf  # every score 0: the cutoff is the largest bias among the rest
    bias = (rng.standard_normal(e) * 0.1).astype(np.float32)
    bias[:5] = 0.0
    return x, bias


@pytest.mark.parametrize("lanes,quads,experts", [(2, True, 20), (2, False, 20), (4, True, 16), (1, False, 12),
                                                 (2, True, 18)])
def test_lanes_kernel_is_the_reference_cutoff(lanes, quads, experts):
    x, bias = _logits(7, experts, ml_dtypes.bfloat16, lanes + experts)
    mask = np.arange(7) != 5
    tiling = kqb.QbTiling(cutoff_threads=8, cutoff_lanes=lanes, cutoff_quads=quads)
    got, kernel = _alpha(x, bias, 3, mask, tiling)
    if lanes > 1:
        assert kernel is qb_cutoff.qb_cutoff_lanes_kernel(kqb.BF16, 3, lanes, True, default_exp_mode(),
                                                          quads and experts % 4 == 0)
    np.testing.assert_array_equal(got[mask], _want(x, bias, 3)[mask])


@pytest.mark.parametrize("rule", ["sum_topk", "top2_sum", "max"])
def test_grouped_kernel_is_the_reference_cutoff(rule):
    x, bias = _logits(6, 16, np.float32, 3)
    got, kernel = _alpha(x, bias, 4, None, kqb.QbTiling(cutoff_threads=8), 4, 2, rule)
    assert kernel is qb_cutoff.qb_cutoff_kernel(kqb.F32, 4, 4, 2, rule, False, default_exp_mode())
    np.testing.assert_array_equal(got, _want(x, bias, 4, 4, 2, rule))

