"""The warp forward's QB cutoff (``warp_topk_fwd_kernel(..., cutoff=exp_mode)``,
``topk_with_score_function_fwd_plan(..., qb_cutoff=)``): ``alpha`` bit for bit
the QB cutoff kernel's (``qb.qb_cutoff_kernel``), with and without groups, ties,
NaN / +-inf logits, both bounds (K <= 12 and above) and the arg-max rounds; the
route's map unchanged by the option, its weights within fp32 rounding; ``qb_counts_plan(cutoff_given=True)`` fed
that alpha (and, ``scores_given``, the route's saved scores instead of the logits)
gives the counts of the plan that computes its own; the public op's QB
histogram on that path (the route's cutoff) equal to jax's.  Tiny shapes on the
simulator (a block of one warp there); a ``gpu`` test at T = 4096, E = 384.
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import gpurouter  # noqa: E402
from gpurouter.kernels._base import launch as L  # noqa: E402
from gpurouter.kernels._base.plan import In, Out, Plan, Step, execute_host, spec_for, spec_of  # noqa: E402
from gpurouter.kernels.topk import plans as topk  # noqa: E402
from gpurouter.kernels.topk import qb as kqb  # noqa: E402
from gpurouter.kernels.topk import warp_paths  # noqa: E402
from gpurouter.kernels.topk.qb_math import default_exp_mode  # noqa: E402
from gpurouter.kernels.topk.warp import fwd as warp_fwd  # noqa: E402

pytestmark = pytest.mark.cuda


def _route(x, bias, k, G=-1, Kg=-1, rule="sum_topk", cutoff="", indices=False):
    """The warp forward's outputs (alpha last with ``cutoff``)."""
    plan = topk.topk_with_score_function_fwd_plan(spec_for(x.shape, x.dtype), bias is not None, k, False, G, Kg,
                                                  np.float32(1.0), L.SIGMOID, 0, indices, False, "warp",
                                                  None, rule, False, cutoff)
    return execute_host(plan, [x] if bias is None else [x, bias])


def _alpha_ref(x, bias, k, G=0, Kg=0, rule="sum_topk"):
    """``alpha`` by the QB cutoff kernel (a thread a token, groups or none)."""
    T, E = x.shape
    spec = spec_for(x.shape, x.dtype)
    kern = kqb.qb_cutoff_kernel(spec.kind, k, G, Kg, rule, False, default_exp_mode())
    plan = Plan("qb_alpha", (spec, spec_of((E,), L.F32)), (spec_of((T,), L.F32),), (),
                (Step(kern, -(-T // 32), 32, 0, (In(0), In(1), Out(0), Out(0), T, E)),))
    b = np.zeros(E, np.float32) if bias is None else bias
    return execute_host(plan, [x, b])[0]


def _check(x, bias, k, G=-1, Kg=-1, rule="sum_topk", same_route=False):
    """The route's alpha equals the QB cutoff kernel's bits (``same_route``: and its
    other outputs those of the route without the option: the same map, the weights
    and saved scores within fp32 rounding, as the route with the option scores by
    the QB sigmoid, jax's bits, and the one without by the kernels' own)."""
    got = _route(x, bias, k, G, Kg, rule, default_exp_mode())
    if same_route:
        plain = _route(x, bias, k, G, Kg, rule)
        for g, w in zip(got[:-1], plain, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            if g.dtype == ml_dtypes.bfloat16:  # an fp32 ulp apart can round to neighbouring bf16 values
                np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=8e-3, atol=1e-30)
            elif g.dtype.kind == "f":
                np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-30)
            else:
                assert g.tobytes() == w.tobytes()
    want = _alpha_ref(x, bias, k, max(G, 0), max(Kg, 0), rule)
    assert got[-1].dtype == np.float32 and got[-1].shape == (x.shape[0],)
    assert got[-1].view(np.uint32).tolist() == want.view(np.uint32).tolist()
    return got[-1]


def test_alpha_equals_the_qb_cutoff_kernel():
    """Random logits and bias, K <= 12 (a 32-sort bound) and K = 14 (a 64-sort); bf16 and f32."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((2, 256)) * 3).astype(ml_dtypes.bfloat16)  # (3 rows until 2026-11-28)
    bias = (rng.standard_normal(256) * 0.1).astype(np.float32)
    _check(x, bias, 8, same_route=True)
    _check(x.astype(np.float32), None, 14)


def test_alpha_ties_and_specials():
    """Equal scores around the cutoff, NaN / +-inf logits, a row of -inf (the arg-max
    rounds: every expert a candidate) and a row of equal logits."""
    x = np.zeros((4, 128), np.float32)
    x[0, :] = np.repeat(np.arange(32, dtype=np.float32), 4)[::-1] / 8  # fours of equal scores
    x[1, :5] = [np.nan, np.inf, -np.inf, 2.0, 2.0]
    x[1, 5:] = -3.0
    x[2, :] = -np.inf
    x[2, 7] = 1.0
    a = _check(x, None, 6, same_route=True)
    assert a[2] == 0.0  # sigmoid(-inf) + 0: the 7th largest of one 0.73 and 127 zeros
    bias = np.zeros(128, np.float32)
    bias[::3] = 0.5
    _check(x, bias, 3)


@pytest.mark.parametrize("rule", ["sum_topk", "max"])
def test_alpha_with_groups(rule):
    """Groups of 16 (8 groups, 2 kept) and of 4 (32 groups, 4 kept): the cutoff among
    the kept groups' experts, equal group scores kept to the lower group."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((2, 128)) * 2).astype(np.float32)  # (3 rows until 2026-11-28)
    x[1, 16:32] = x[1, 32:48]  # equal group scores: the lower group kept
    bias = (rng.standard_normal(128) * 0.2).astype(np.float32)
    _check(x, bias, 4, 8, 2, rule)
    _check(x, bias, 8, 32, 4, rule)


def test_counts_with_the_given_cutoff():
    """``qb_counts_plan(cutoff_given=True)`` on the route's alpha (and with
    ``scores_given=True`` on its saved scores): the counts of the plan that
    computes its own cutoff (masked and not; one slab, several slabs and
    their reduce, global atomics)."""
    rng = np.random.default_rng(2)
    T, E, k, B = 5, 128, 4, 7
    x = (rng.standard_normal((T, E)) * 2).astype(ml_dtypes.bfloat16)
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
    bounds = np.array([-1.0, 0.5], np.float32)
    routed = _route(x, bias, k, cutoff=default_exp_mode())
    alpha, scores = routed[-1], routed[2]  # the cutoff, and the saved scores (the QB sigmoid of x)
    assert scores.dtype == np.float32 and scores.shape == (T, E)
    mask = np.array([True, False, True, True, False])
    slabs = kqb.QbTiling(slab_tokens=2, target_blocks=64, smem_bytes=4 * 7 * 40)  # partials and their reduce
    zeroed = kqb.QbTiling(smem_bytes=0)  # no shared budget: zeroed counts, global atomics
    for m, tiling in ((None, None), (mask, None), (mask, slabs), (None, zeroed)):
        spec = spec_for(x.shape, x.dtype)
        own = kqb.qb_counts_plan(spec, m is not None, k, B, tiling=tiling)
        given = kqb.qb_counts_plan(spec, m is not None, k, B, tiling=tiling, cutoff_given=True)
        assert len(given.steps) == len(own.steps) - 1 and len(given.tmps) == len(own.tmps) - 1
        ins = [x, bias, bounds] + ([] if m is None else [m])
        want = execute_host(own, ins)[0]
        got = execute_host(given, ins + [alpha])[0]
        np.testing.assert_array_equal(got, want)
        assert int(got.sum()) == E * (T if m is None else int(m.sum()))
        # the route's scores read instead of the logits (no sigmoid in the histogram): the same counts
        scored = kqb.qb_counts_plan(spec_for(scores.shape, scores.dtype), m is not None, k, B, tiling=tiling,
                                    cutoff_given=True, scores_given=True)
        np.testing.assert_array_equal(execute_host(scored, [scores] + ins[1:] + [alpha])[0], want)
    with pytest.raises(ValueError, match="scores_given"):
        kqb.qb_counts_plan(spec_for(scores.shape, scores.dtype), False, k, B, scores_given=True)
    with pytest.raises(ValueError, match="scores_given"):
        kqb.qb_counts_plan(spec_for(x.shape, x.dtype), False, k, B, cutoff_given=True, scores_given=True)


def test_option_checked():
    """The option: sigmoid on the warp kernel only, never compact; without it, the
    kernel factory's key as before (no cutoff argument)."""
    x = np.zeros((2, 128), np.float32)
    with pytest.raises(ValueError, match="qb_cutoff"):
        topk.topk_with_score_function_fwd_plan(spec_for(x.shape, x.dtype), False, 2, False, -1, -1,
                                               np.float32(1), L.SQRTSOFTPLUS, 0, False, False, "warp", None,
                                               "sum_topk", False, default_exp_mode())
    with pytest.raises(ValueError, match="cutoff"):
        warp_fwd.warp_topk_fwd_kernel(L.F32, 128, 2, L.SIGMOID, False, compact=True, cutoff="cephes")
    plan = topk.topk_with_score_function_fwd_plan(spec_for(x.shape, x.dtype), False, 2, False, -1, -1,
                                                  np.float32(1), L.SIGMOID, 0, False, False, "warp")
    assert plan.steps[0].kernel is warp_fwd.warp_topk_fwd_kernel(L.F32, 128, 2, L.SIGMOID, False, False, False,
                                                                 0, 0, "sum_topk")


def _op_histograms(x, k, monkeypatch, jit=True, **kw):
    """The QB histogram of the public op on jax and on numba (the route on the warp
    kernel, as on a GPU: ``warp_auto`` forced on the simulator), and the QB plans
    numba built (``cutoff_given`` of each, which ``scores_given`` follows)."""
    given = []
    plan_fn = kqb.qb_counts_plan

    def spy(*a, **k2):
        # the route's cutoff comes with its scores: a plan takes both or neither
        assert bool(k2.get("cutoff_given", False)) == bool(k2.get("scores_given", False))
        given.append(bool(k2.get("cutoff_given", False)))
        return plan_fn(*a, **k2)

    monkeypatch.setattr(kqb, "qb_counts_plan", spy)
    monkeypatch.setattr(warp_paths, "warp_auto", lambda simulator=None: True)
    rng = np.random.default_rng(4)
    E = x.shape[-1]
    args = dict(score_function="sigmoid", expert_bias=jnp.asarray(rng.standard_normal(E) * 0.1, jnp.float32),
                qb_histogram=jnp.asarray(rng.integers(0, 9, (E, 10)), jnp.int32),
                qb_bin_bounds=jnp.array([-0.8, 0.9], jnp.float32), **kw)
    want = gpurouter.fused_topk_with_score_function(x, k, backend="jax", **args)

    def numba(v):
        return gpurouter.fused_topk_with_score_function(v, k, backend="numba", **args)

    got = (jax.jit(numba) if jit else numba)(x)
    return got, want, given


@pytest.mark.parametrize("kw", [
    {},
    {"token_mask": "mask", "return_indices": True},
    {"num_groups": 8, "group_topk": 2, "group_score": "max"},
])
def test_op_histogram_with_the_routes_cutoff(kw, monkeypatch):
    """``fused_topk_with_score_function(..., qb_histogram=, backend="numba")`` with the
    route on the warp kernel: the QB plan takes the route's cutoff (no cutoff pass),
    and the histogram, probs and map are jax's bit for bit."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((2, 2, 128)) * 2, jnp.bfloat16)  # ((2, 3, 128) until 2026-11-28)
    kw = dict(kw)
    if kw.get("token_mask") == "mask":
        kw["token_mask"] = jnp.asarray([[True, False], [False, True]])
    got, want, given = _op_histograms(x, 4, monkeypatch, **kw)
    assert given and all(given), "the QB plan took the route's cutoff"
    assert len(got) == len(want)
    np.testing.assert_array_equal(np.asarray(got[-1]), np.asarray(want[-1]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    if "return_indices" in kw:
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))


def test_op_gradient_with_the_routes_cutoff(monkeypatch):
    """Under ``jax.grad`` the route's extra output (alpha) takes no gradient: the
    logits' gradient is jax's (the sigmoid backward), the cutoff still the route's."""
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    given = []
    plan_fn = kqb.qb_counts_plan
    monkeypatch.setattr(kqb, "qb_counts_plan", lambda *a, **k2: given.append(k2.get("cutoff_given")) or plan_fn(
        *a, **k2))
    monkeypatch.setattr(warp_paths, "warp_auto", lambda simulator=None: True)
    kw = dict(score_function="sigmoid", expert_bias=jnp.asarray(rng.standard_normal(128) * 0.1, jnp.float32),
              qb_histogram=jnp.zeros((128, 4), jnp.int32), qb_bin_bounds=jnp.array([-1.0, 1.0], jnp.float32))
    grads = [jax.grad(lambda v, b=b: jnp.sum(gpurouter.fused_topk_with_score_function(v, 4, backend=b, **kw)[0]
                                             * cot))(x) for b in ("numba", "jax")]
    assert given and all(given)
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(grads[1]), rtol=1e-4, atol=1e-6)


def test_op_fallbacks_keep_the_cutoff_pass(monkeypatch):
    """The compact kernel, and E = 96 (the warp kernel does not take it): the QB plan
    runs its own cutoff pass; the histogram is jax's."""
    rng = np.random.default_rng(6)
    for x, kw in ((jnp.asarray(rng.standard_normal((4, 128)), jnp.float32), {"compact": True}),
                  (jnp.asarray(rng.standard_normal((4, 96)), jnp.float32), {})):
        got, want, given = _op_histograms(x, 4, monkeypatch, jit=False, **kw)
        assert given and not any(given)
        np.testing.assert_array_equal(np.asarray(got[-1]), np.asarray(want[-1]))


@pytest.mark.gpu
def test_alpha_on_gpu_t4096_e384():
    """T = 4096, E = 384, K = 8, bf16, with a bias, without groups and with 12 groups
    of 32 (4 kept): the route's alpha equals the QB cutoff kernel's, bit for bit, on
    the device (and the route's outputs are those without the option)."""
    if L.simulator_enabled():
        pytest.skip("a GPU test: the simulator would take hours at T = 4096")
    rng = np.random.default_rng(37)
    x = (rng.standard_normal((4096, 384)) * 2).astype(ml_dtypes.bfloat16)
    x[::97, 5] = np.nan
    bias = (rng.standard_normal(384) * 0.05).astype(np.float32)
    _check(x, bias, 8, same_route=True)
    _check(x, bias, 8, 12, 4, same_route=True)


@pytest.mark.gpu
def test_op_on_gpu_t4096_e384(monkeypatch):
    """T = 4096, E = 384, K = 8, bf16, a tenth of the tokens masked: the public op's QB
    histogram on numba (the route's cutoff, no cutoff pass) equals jax's (the maps may
    differ at near-ties: the route's sigmoid is not XLA's)."""
    if L.simulator_enabled():
        pytest.skip("a GPU test: the simulator would take hours at T = 4096")
    rng = np.random.default_rng(38)
    x = jnp.asarray(rng.standard_normal((4096, 384)) * 2, jnp.bfloat16)
    mask = jnp.asarray(rng.random(4096) > 0.1)
    got, want, given = _op_histograms(x, 8, monkeypatch, token_mask=mask)
    assert given and all(given), "the QB plan took the route's cutoff"
    np.testing.assert_array_equal(np.asarray(got[-1]), np.asarray(want[-1]))
