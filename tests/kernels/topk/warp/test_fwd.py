"""The warp-per-token top-k forward (``gpurouter/kernels/topk/warp/fwd.py``) and its
exchanges and sorts (``topk/warp/lanes.py``): the dispatch to it, the same bits as the
thread-per-token kernel (which test_token_topk_fwd.py checks against the reference) in
every dtype, map format, K and score function it takes (softmax after the top-k
included), ties, specials, the arg-max
rounds alone, the replay of its indices, and a float64 oracle.  Tiny shapes: the
simulator runs them (a block of one warp there; four on a GPU).
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from numba import cuda  # noqa: E402
from numba import float32 as nb_f32  # noqa: E402
from numba import int32 as nb_i32  # noqa: E402

from gpurouter.kernels._base import launch as L  # noqa: E402
from gpurouter.kernels._base import plan as _plan  # noqa: E402
from gpurouter.kernels.topk import plans as topk  # noqa: E402
from gpurouter.kernels.topk.warp import fwd as warp_topk_fwd  # noqa: E402
from gpurouter.kernels.topk.warp.lanes import warp_auto, warp_scans, warp_sorts  # noqa: E402

from ..._helpers import host  # noqa: E402

pytestmark = pytest.mark.cuda


def _module_of(plan):
    return plan.steps[0].kernel.py_func.__module__.removeprefix("gpurouter.kernels.topk.")  # e.g. "warp.fwd"


def _fwd(x, k, path, **kw):
    kw.setdefault("score_function", "sigmoid")
    return [host(a) for a in K.topk_with_score_function_fwd(x, k, path=path, **kw)]


def _same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes()


def test_dispatch():
    """sigmoid / sqrtsoftplus / softmax after the top-k, E % 128 == 0 up to 512, K <= 31,
    groups that ``warp_groups`` takes, take the warp kernel (``path="auto"``: on a GPU at
    any T); softmax-pre, other groups, other E, larger K and the replay the token kernels."""

    def fwd(E, k, fn=L.SIGMOID, G=-1, Kg=-1, forced=False, path="auto", T=5, pre=False):
        return topk.topk_with_score_function_fwd_plan(_plan.spec_of((T, E), L.BF16), fn != L.SOFTMAX, k, pre,
                                                      G, Kg, np.float32(1), fn, 0, False, forced, path)

    big = 1 << 16
    auto = "token.fwd" if L.simulator_enabled() else "warp.fwd"  # (never on the simulator)
    assert _module_of(fwd(512, 22)) == auto and _module_of(fwd(384, 31)) == auto
    assert _module_of(fwd(256, 6, L.SQRTSOFTPLUS, T=big)) == auto
    assert _module_of(fwd(128, 1)) == auto and _module_of(fwd(128, 8, L.SOFTMAX, T=big)) == auto
    assert _module_of(fwd(128, 1, L.SQRTSOFTPLUS, path="warp", T=big)) == "warp.fwd"
    assert _module_of(fwd(256, 8, L.SIGMOID, 8, 4, path="warp")) == "warp.fwd"  # DeepSeek-V3
    assert _module_of(fwd(128, 4, L.SIGMOID, 32, 2, path="warp")) == "warp.fwd"  # groups of one quad
    assert _module_of(fwd(256, 8, L.SOFTMAX)) == auto  # softmax after the top-k
    assert _module_of(fwd(128, 8, L.SOFTMAX, path="warp")) == "warp.fwd"
    # the GPU's rule
    assert warp_auto(simulator=False) and not warp_auto(simulator=True)  # (the backward's rule too)
    for plan in (fwd(512, 32), fwd(640, 8), fwd(260, 8), fwd(256, 8, L.SOFTMAX, pre=True), fwd(256, 8, L.SIGMOID, 8, 2),
                 fwd(256, 8, L.SIGMOID, 1, 1), fwd(512, 8, L.SIGMOID, 64, 8), fwd(384, 8, L.SIGMOID, 3, 2),
                 fwd(512, 22, forced=True), fwd(512, 22, forced=True, path="warp")):
        assert _module_of(plan) == "token.fwd"


@pytest.mark.parametrize("bad", [dict(k=32), dict(E=132), dict(pre=True), dict(groups=(8, 1)),
                                 dict(groups=(1, 1))])
def test_forced_warp_path_names_the_op(bad):
    E, k = bad.get("E", 128), bad.get("k", 4)
    G, Kg = bad.get("groups", (-1, -1))
    x = np.zeros((2, E), np.float32)
    fn = "softmax" if "pre" in bad else "sigmoid"
    with pytest.raises(ValueError, match="topk_with_score_function.*path='warp'"):
        K.topk_with_score_function_fwd(x, k, num_groups=G, group_topk=Kg, path="warp", score_function=fn,
                                       use_pre_softmax=bad.get("pre", False))


CASES = [  # (E, K, score function, bias, dtype, map format, indices, (groups, group_topk) or None)
    (128, 1, "sigmoid", True, np.float32, 0, True, None),
    (128, 12, "sigmoid", True, np.float32, 0, True, None),  # E = 128: K <= 12 placed by ranks
    (128, 16, "sigmoid", True, np.float32, 0, True, None),  # K > 12: the bound from a 64-sort, sorted
    (128, 4, "sqrtsoftplus", False, np.float32, 1, False, (32, 2)),  # a group a lane's quad
    (256, 8, "sigmoid", False, "bfloat16", 0, True, None),
    (256, 8, "sigmoid", True, "bfloat16", 0, True, (8, 4)),  # DeepSeek-V3
    (128, 8, "softmax", False, "bfloat16", 0, True, None),  # Qwen3: softmax after the top-k
    (128, 1, "softmax", False, np.float32, 1, False, None),
    (256, 6, "softmax", False, np.float16, 1, True, (8, 3)),  # groups, softmax after
    # the large ones on a GPU only: 40-90 s each on the simulator
    pytest.param(384, 22, "sigmoid", True, "bfloat16", 1, True, None, marks=pytest.mark.gpu),
    pytest.param(512, 31, "sqrtsoftplus", True, np.float16, 0, False, None, marks=pytest.mark.gpu),
    pytest.param(512, 6, "sqrtsoftplus", True, np.float32, 1, True, (4, 3), marks=pytest.mark.gpu),  # 128 a group
    pytest.param(256, 5, "sigmoid", False, np.float16, 0, True, (16, 5), marks=pytest.mark.gpu),
    pytest.param(512, 22, "softmax", False, "bfloat16", 0, True, None, marks=pytest.mark.gpu),
]


def _logits(T, E, dtype, rng, scale=1.0):
    x = (rng.standard_normal((T, E)) * scale).astype(np.float32)
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


def _tokens():
    """A block's warps (tokens) and one: a partial last block of warps on a GPU (4 warps a block:
    5 tokens); on the simulator (a warp a block) 2 blocks, the fewest rows for its cost
    (5 tokens there too until 2026-11-28)."""
    return warp_topk_fwd.warp_launch(1)[1] // 32 + 1


@pytest.mark.parametrize("E,k,fn,has_bias,dtype,fmt,indices,groups", CASES)
def test_same_bits_as_the_token_kernel(E, k, fn, has_bias, dtype, fmt, indices, groups):
    """probs, map, saved (and indices) equal the thread-per-token kernel's bit for bit,
    the weights' sum included (``_tokens()`` tokens: a partial last block of warps on a GPU)."""
    rng = np.random.default_rng(E + k)
    x = _logits(_tokens(), E, dtype, rng)
    bias = (rng.standard_normal(E) * 0.05).astype(np.float32) if has_bias else None  # (never with softmax)
    G, Kg = groups or (-1, -1)
    kw = dict(score_function=fn, expert_bias=bias, scaling_factor=2.5, routing_map_format=fmt,
              return_indices=indices, num_groups=G, group_topk=Kg)
    _same(_fwd(x, k, "warp", **kw), _fwd(x, k, "token", **kw))


def test_ties_and_specials():
    """Rows of ties (bf16-like steps: more than 32 candidates, the arg-max rounds), all
    equal, NaN, +-inf and a -inf bias: the token kernel's selection and bits."""
    rng = np.random.default_rng(7)
    E, k = 128, 8
    x = np.round(rng.standard_normal((6, E)) * 2).astype(np.float32) / 2
    x[1] = 0.25
    x[2, ::3] = np.nan
    x[3, :40] = np.inf
    x[4, :] = -np.inf
    x[4, 100:104] = 1.0
    x[5] = np.nan
    bias = np.zeros(E, np.float32)
    bias[5] = -np.inf
    for fn, b in (("sigmoid", None), ("sigmoid", bias), ("softmax", None)):
        kw = dict(score_function=fn, expert_bias=b, return_indices=True)
        _same(_fwd(x, k, "warp", **kw), _fwd(x, k, "token", **kw))


def test_groups_ties_and_specials():
    """Groups (8 of 16 experts, 3 kept, 2 summed): tied group scores (the lower group
    kept), NaN and -inf groups, kept groups with fewer than K finite scores (the fillers:
    the kept groups' -inf experts, never a dropped group's), +inf pairs (inf - inf: NaN
    group scores, ranked as -inf): the token kernel's selection and bits."""
    rng = np.random.default_rng(9)
    E, k = 128, 6
    x = rng.standard_normal((7, E)).astype(np.float32)
    x[0] = np.tile(np.arange(16, dtype=np.float32) / 16, 8)  # every group tied
    x[1, :] = -np.inf
    x[1, [3, 40, 41, 100]] = [1.0, 2.0, 0.5, 3.0]  # 3 kept groups, 4 finite scores: fillers
    x[2, 16:32] = np.nan
    x[2, 64:80] = -np.inf
    x[3, [0, 1]] = np.inf
    x[3, 20] = -np.inf
    x[4] = np.nan
    x[5] = np.round(x[5] * 2) / 2  # ties inside the groups
    x[6, 96:112] = 5.0
    inf_bias = np.zeros(E, np.float32)
    inf_bias[40:48] = -np.inf  # -inf ranking scores in a finite row
    inf_bias[112], inf_bias[113:] = np.inf, -np.inf  # group 7: inf + -inf, a NaN group score
    # (a random bias with groups: test_same_bits_as_the_token_kernel's DeepSeek-V3 case; here
    # until 2026-11-28 too, a fourth pass of both kernels on the simulator)
    for fn, b in (("sigmoid", None), ("sigmoid", inf_bias), ("softmax", None)):
        kw = dict(score_function=fn, expert_bias=b, num_groups=8, group_topk=3, return_indices=True,
                  scaling_factor=1.5)
        _same(_fwd(x, k, "warp", **kw), _fwd(x, k, "token", **kw))


@pytest.mark.parametrize("fmt", [0, 1])
def test_arg_max_rounds_alone(fmt):
    """Every token through the K arg-max rounds (``fallback_only``) gives the plan's answer."""
    rng = np.random.default_rng(3)
    T, E, k = 2, 256, 6  # (3 tokens until 2026-11-28: the simulator's cost)
    x = rng.standard_normal((T, E)).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.05).astype(np.float32)
    want = _fwd(x, k, "warp", expert_bias=bias, routing_map_format=fmt, return_indices=True)
    kern = warp_topk_fwd.warp_topk_fwd_kernel(L.F32, E, k, L.SIGMOID, True, fmt == 1, True)
    nb = (E + 7) // 8
    outs = [cuda.device_array(T * E, np.float32), cuda.device_array(T * nb if fmt else T * E // 4,
                                                                    np.uint8 if fmt else np.uint32),
            cuda.device_array(T * E, np.float32), cuda.device_array(T * k, np.int32)]
    grid, threads = warp_topk_fwd.warp_launch(T)
    L.launch(kern, grid, threads, 0, 0, cuda.to_device(x.reshape(-1)), cuda.to_device(bias), *outs, T,
             np.float32(1.0), 1, cuda.device_array(1, np.float32), 1)
    got = [o.copy_to_host() for o in outs]
    assert got[0].tobytes() == want[0].tobytes()
    assert got[1].tobytes() == want[1].tobytes()
    assert got[2].tobytes() == want[2].tobytes() and got[3].tobytes() == want[3].tobytes()


def test_replay_of_its_indices_is_the_call():
    """The replay (the token kernel) of the indices the warp kernel returned: the same bits."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((_tokens(), 256)).astype(np.float32)
    for fn, bias, G, Kg in (("sigmoid", None, -1, -1),
                            ("sigmoid", (rng.standard_normal(256) * 0.05).astype(np.float32), -1, -1),
                            ("sigmoid", (rng.standard_normal(256) * 0.05).astype(np.float32), 8, 4),
                            ("softmax", None, -1, -1), ("softmax", None, 8, 4)):
        kw = dict(score_function=fn, expert_bias=bias, scaling_factor=1.5, num_groups=G, group_topk=Kg)
        probs, rmap, saved, idx = _fwd(x, 8, "warp", return_indices=True, **kw)
        again = _fwd(x, 8, "auto", forced_indices=idx, **kw)
        _same(again, [probs, rmap, saved])


def test_float64_oracle():
    """Selection and weights against float64 NumPy (distinct scores: no ties)."""
    rng = np.random.default_rng(5)
    T, E, k = 4, 384, 10
    x = rng.permutation(T * E).reshape(T, E).astype(np.float32) / (T * E) * 8 - 4
    bias = np.linspace(-0.01, 0.01, E, dtype=np.float32)
    probs, rmap, saved, idx = _fwd(x, k, "warp", expert_bias=bias, scaling_factor=3.0, return_indices=True)
    s = 1 / (1 + np.exp(-x.astype(np.float64)))
    order = np.argsort(-(s + bias), axis=1, kind="stable")[:, :k]
    want_map = np.zeros((T, E), bool)
    np.put_along_axis(want_map, order, True, axis=1)
    assert (rmap == want_map).all() and (idx == order).all()
    want = np.where(want_map, 3.0 * s / (np.take_along_axis(s, order, 1).sum(1, keepdims=True) + 1e-20), 0)
    np.testing.assert_allclose(probs, want, rtol=2e-6, atol=0)
    np.testing.assert_allclose(saved, s, rtol=2e-6)


def test_float64_oracle_softmax_after_topk():
    """Softmax after the top-k: the top K logits, their softmax (saved, -inf elsewhere) and
    its scaled probs against float64 NumPy (distinct logits)."""
    rng = np.random.default_rng(6)
    T, E, k = 3, 256, 8
    x = rng.permutation(T * E).reshape(T, E).astype(np.float32) / (T * E) * 16 - 8
    probs, rmap, saved, idx = _fwd(x, k, "warp", score_function="softmax", scaling_factor=2.0,
                                   return_indices=True)
    order = np.argsort(-x, axis=1, kind="stable")[:, :k]
    want_map = np.zeros((T, E), bool)
    np.put_along_axis(want_map, order, True, axis=1)
    assert (rmap == want_map).all() and (idx == order).all()
    top = np.take_along_axis(x.astype(np.float64), order, 1)
    soft = np.exp(top - top.max(1, keepdims=True))
    soft /= soft.sum(1, keepdims=True)
    want = np.full((T, E), -np.inf)
    np.put_along_axis(want, order, soft, axis=1)
    np.testing.assert_allclose(saved, want, rtol=2e-6)
    np.testing.assert_allclose(probs, np.where(want_map, 2.0 * want, 0), rtol=2e-6)


def test_warp_sorts_and_scans():
    """``sort64`` sorts 64 values descending, ``sort32v`` 32, ``sort32`` 32 (score, expert)
    pairs in the selection order, ``inclusive_sum`` and ``arg_max`` over a warp (GPU: shuffles; simulator: their
    shared-memory twins)."""
    sort64, sort32, sort32v = warp_sorts()
    inclusive_sum, arg_max = warp_scans()

    @cuda.jit
    def run(a, v, e, c, out_a, out_v, out_e, out_c, out_m, out_s):
        red = cuda.shared.array(32, nb_f32)
        redi = cuda.shared.array(32, nb_i32)
        tid = np.int32(cuda.threadIdx.x)
        a0, a1 = sort64(a[2 * tid], a[2 * tid + 1], red, tid)
        out_a[2 * tid] = a0
        out_a[2 * tid + 1] = a1
        sv, se = sort32(v[tid], e[tid], red, redi, tid)
        out_v[tid] = sv
        out_e[tid] = se
        out_c[tid] = inclusive_sum(c[tid], redi, tid)
        mv, me = arg_max(v[tid], e[tid], red, redi, tid)
        out_m[tid] = me if mv == mv else -1
        out_s[tid] = sort32v(a[tid], red, tid)

    rng = np.random.default_rng(2)
    a = rng.standard_normal(64).astype(np.float32)
    v = np.round(rng.standard_normal(32) * 2).astype(np.float32)  # ties: the lower expert first
    e = rng.permutation(32).astype(np.int32)
    c = rng.integers(0, 5, 32).astype(np.int32)
    outs = [cuda.device_array(64, np.float32), cuda.device_array(32, np.float32), cuda.device_array(32, np.int32),
            cuda.device_array(32, np.int32), cuda.device_array(32, np.int32), cuda.device_array(32, np.float32)]
    L.launch(run, 1, 32, 0, 0, *(cuda.to_device(z) for z in (a, v, e, c)), *outs)
    got_a, got_v, got_e, got_c, got_m, got_s = (o.copy_to_host() for o in outs)
    assert (got_a == np.sort(a)[::-1]).all() and (got_s == np.sort(a[:32])[::-1]).all()
    order = sorted(range(32), key=lambda i: (-v[i], e[i]))
    assert (got_v == v[order]).all() and (got_e == e[order]).all()
    assert (got_c == np.cumsum(c)).all() and (got_m == e[order[0]]).all()


def test_forward_without_saved_scores():
    """``save=False`` (a forward without a gradient) on the warp kernel: no saved
    output (its stores skipped), every other output the same bits, indices and the
    QB cutoff too; the token and lane kernels refuse it (a ValueError naming it)."""
    from gpurouter.kernels.topk.qb_math import default_exp_mode

    rng = np.random.default_rng(22)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    bias = (rng.standard_normal(128) * 0.1).astype(np.float32)
    for cut in ("", default_exp_mode()):
        args = (_plan.spec_for(x.shape, x.dtype), True, 4, False, -1, -1, np.float32(1.0), L.SIGMOID, 0, not cut,
                False, "warp", None, "sum_topk", False, cut)
        full = _plan.execute_host(topk.topk_with_score_function_fwd_plan(*args), [x, bias])
        part = _plan.execute_host(topk.topk_with_score_function_fwd_plan(*args, save=False), [x, bias])
        assert len(part) == len(full) - 1 == 3
        for g, w in zip(part, full[:2] + full[3:], strict=True):
            assert g.dtype == w.dtype and g.tobytes() == w.tobytes()
    for path in ("token", "lane"):
        with pytest.raises(ValueError, match="save=False runs on the warp kernel only"):
            topk.topk_with_score_function_fwd_plan(_plan.spec_for(x.shape, x.dtype), True, 4, False, -1, -1,
                                                   np.float32(1.0), L.SIGMOID, 0, False, False, path, save=False)
