"""The group-score rules inside the warp-per-token forward (``gpurouter/kernels/topk/warp/groups.py``,
``group_dropper(..., group_score)``; docs/contract.md section 9): the selection of each rule
against the reference's (ties of groups to the lower group, NaN groups as -inf), the values
bit for bit those of the kernels' replay of that selection, the rule in the kernel's cache key,
and a rule the token and lane kernels do not compute naming the op.  Tiny shapes (simulator)."""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

import jax.numpy as jnp  # noqa: E402

import gpurouter  # noqa: E402
from gpurouter.kernels._base.keys import kernel_text  # noqa: E402
from gpurouter.kernels._base.launch import BF16, SIGMOID  # noqa: E402
from gpurouter.kernels.topk.warp.fwd import warp_topk_fwd_kernel  # noqa: E402

from ..._helpers import host  # noqa: E402

pytestmark = pytest.mark.cuda

E, TOPK, G, KG = 128, 4, 8, 2  # groups of 16; sum_topk sums K // Kg = 2, like top2_sum


def _rows(rng, n=6):
    x = rng.standard_normal((n, E)).astype(np.float32)
    x[0] = np.tile(np.arange(16, dtype=np.float32) / 16, G)  # every group tied: the lower ones kept
    x[1] = -4.0
    x[1, 5], x[1, 20], x[1, 21], x[1, 40], x[1, 41] = 3.0, 2.0, 2.0, 2.5, 0.1  # max vs top2_sum differ
    x[2, 16:32] = np.nan  # a NaN group: -inf
    x[3] = np.round(x[3] * 2) / 2  # ties inside and across groups
    x[4, 32:48] = x[4, 64:80]  # two groups with the same values: the lower kept
    return x


@pytest.mark.parametrize("rule", ["max", "top2_sum"])
@pytest.mark.parametrize("biased", [False, True])
def test_rule_selects_as_the_reference(rule, biased):
    rng = np.random.default_rng(37)
    x = _rows(rng)
    bias = (rng.standard_normal(E) * 0.05).astype(np.float32) if biased else None
    kw = dict(score_function="sigmoid", num_groups=G, group_topk=KG, scaling_factor=2.0)
    got = [host(a) for a in K.topk_with_score_function_fwd(x, TOPK, expert_bias=bias, return_indices=True,
                                                            path="warp", group_score=rule, **kw)]
    ref = gpurouter.fused_topk_with_score_function(
        jnp.asarray(x), TOPK, num_groups=G, group_topk=KG, scaling_factor=2.0, score_function="sigmoid",
        expert_bias=None if bias is None else jnp.asarray(bias), return_indices=True, group_score=rule,
        backend="jax")
    np.testing.assert_array_equal(got[3], np.asarray(ref[2]))
    np.testing.assert_array_equal(got[1], np.asarray(ref[1]))
    np.testing.assert_allclose(got[0], np.asarray(ref[0]), rtol=1e-6, atol=1e-7)
    # the values: the kernels' replay of this selection, bit for bit
    rep = [host(a) for a in K.topk_with_score_function_fwd(x, TOPK, expert_bias=bias, forced_indices=got[3],
                                                            path="token", **kw)]
    for g, w in zip(got[:3], rep, strict=True):
        assert g.dtype == w.dtype and g.tobytes() == w.tobytes()


def test_rule_differs_where_it_should():
    """Row 1: group 0's max (3.0) beats group 2's (2.5) and group 1's (2.0), while by the top-2
    sum group 1 (4.0) and group 2 (2.6) beat group 0 (3.0 - 4.0)."""
    x = _rows(np.random.default_rng(37))[1:2]
    ids = {rule: host(K.topk_with_score_function_fwd(x, TOPK, num_groups=G, group_topk=KG, score_function="sigmoid",
                                                    return_indices=True, path="warp", group_score=rule)[3])
           for rule in ("max", "top2_sum")}
    assert set(ids["max"][0] // 16) == {0, 2} and set(ids["top2_sum"][0] // 16) == {1, 2}


def test_rule_in_the_cache_key():
    texts = {rule: kernel_text(warp_topk_fwd_kernel(BF16, E, TOPK, SIGMOID, False, False, False, G, KG, rule))
             for rule in ("sum_topk", "top2_sum", "max")}
    assert texts["max"] != texts["sum_topk"] and texts["max"] != texts["top2_sum"]


def test_other_paths_name_the_op():
    x = np.zeros((2, E), np.float32)
    with pytest.raises(ValueError, match="topk_with_score_function_fwd_plan: group_score=.max."):
        K.topk_with_score_function_fwd(x, TOPK, num_groups=G, group_topk=KG, score_function="sigmoid",
                                       path="token", group_score="max")
    with pytest.raises(ValueError, match="group_score must be one of"):
        K.topk_with_score_function_fwd(x, TOPK, num_groups=G, group_topk=KG, score_function="sigmoid",
                                       path="warp", group_score="mean")
