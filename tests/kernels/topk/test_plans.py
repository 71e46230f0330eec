"""Kernel vs reference: ``topk_with_score_function_fwd/_bwd`` (GPU or the CUDA simulator).

Tiny shapes (T <= 4, E <= 32): the simulator runs one OS thread per CUDA
thread.  The big TE shapes are in test_gpu.py.  The launcher's plans pick the
kernels; each kernel's own tests are in ``test_<kernel module>.py``
(``test_token_topk_fwd.py``, ``test_lane_topk_fwd.py``, ``test_quad_bwd.py``,
``test_stream_bwd.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter import reference as ref  # noqa: E402
from gpurouter.testing.strategies import (  # noqa: E402
    arbitrary_logits,
    biases,
    random_cotangent,
    router_configs,
    tie_free_logits,
    tie_free_rows_np,
)

from .._helpers import FWD_MODES, check_special_rows, check_topk_bwd, check_topk_fwd, host  # noqa: E402
from .._helpers import bias as _bias  # noqa: E402
from .._helpers import cfg as _cfg  # noqa: E402
from .._helpers import sel as _sel  # noqa: E402

pytestmark = pytest.mark.cuda

DTYPES = ("float32", "bfloat16", "float16")


# (T, E, K, G, Kg, scale, bias): plain with E not a multiple of 32, groups,
# K = 1, K = E, scaling.
SHAPES = [
    (3, 20, 3, -1, -1, 1.0, False),
    (4, 16, 4, 4, 2, 2.5, True),
    (2, 12, 1, -1, -1, 1.0, True),
    (2, 6, 6, -1, -1, 0.5, False),
]


# Each shape with two of the four modes in the fast suite (by turns: every mode meets two shapes,
# one of them grouped or K = 1), the other two under slow (``make test-slow``); every mode on the
# grouped shape runs in the fast suite in test_fwd_bwd_half (bf16 and fp16).
FP32_CASES = [
    pytest.param(sf, pre, shape, id="T{}E{}K{}G{}Kg{}s{}b{}-{}-{}".format(*shape, sf, pre),
                 marks=() if (i + j) % 2 == 0 else pytest.mark.slow)
    for j, shape in enumerate(SHAPES) for i, (sf, pre) in enumerate(FWD_MODES)
]


@pytest.mark.parametrize("sf,pre,shape", FP32_CASES)
def test_fwd_bwd_fp32(sf, pre, shape):
    T, E, k, G, Kg, scale, with_bias = shape
    cfg = _cfg(T, E, k, sf, pre, G, Kg, scale, with_bias and sf != "softmax")
    bias = _bias(E) if cfg.has_bias else None
    x = tie_free_rows_np(1, cfg, bias)
    _, m, s = check_topk_fwd(K, x, "float32", cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(2, x.shape), "float32", cfg.kwargs())


@pytest.mark.parametrize("sf,pre", FWD_MODES)
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_fwd_bwd_half(sf, pre, dtype):
    cfg = _cfg(3, 16, 4, sf, pre, 4, 2, 2.5, sf != "softmax", dtype)
    bias = _bias(16, 3) if cfg.has_bias else None
    x = tie_free_rows_np(4, cfg, bias)
    _, m, s = check_topk_fwd(K, x, dtype, cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(5, x.shape, dtype), dtype, cfg.kwargs())


@settings(max_examples=6)
@given(data=st.data())
def test_matches_reference_hypothesis(data):
    cfg = data.draw(router_configs(max_tokens=3, max_experts=24))
    bias = data.draw(biases(cfg))
    x = data.draw(tie_free_logits(cfg, bias))
    _, m, s = check_topk_fwd(K, x, cfg.dtype, cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(0, x.shape, cfg.dtype), cfg.dtype, cfg.kwargs())


# ----------------------------------------------------------------------------
# Ties, -inf, NaN, signed zeros (docs/contract.md section 2: lower index wins; NaN is
# -inf for selection; exactly K per row)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_ties_lower_index_wins(sf):
    x = np.zeros((2, 8), np.float32)
    x[1] = [1, 2, 2, 0, 2, 2, 1, 0]
    p, m, _ = K.topk_with_score_function_fwd(x, 3, score_function=sf)
    assert _sel(m) == [[0, 1, 2], [1, 2, 4]]
    rp, rm, _ = ref.topk_with_score_function_fwd(x, 3, score_function=sf)
    np.testing.assert_array_equal(m, host(rm))


def test_group_ties_lower_group_wins():
    # 4 groups of 2, all equal: groups 0 and 1 kept, then experts 0, 1.
    x = np.zeros((1, 8), np.float32)
    _, m, _ = K.topk_with_score_function_fwd(x, 2, num_groups=4, group_topk=2,
                                             score_function="sigmoid")
    assert _sel(m) == [[0, 1]]
    # experts of dropped groups are never selected, even as fillers
    x = np.full((1, 8), -np.inf, np.float32)
    x[0, 6:] = [1.0, 2.0]  # group 3 scores 3; groups 0..2 tie at -inf: group 0 kept
    _, m, _ = K.topk_with_score_function_fwd(x, 4, num_groups=4, group_topk=2)
    assert _sel(m) == [[0, 1, 6, 7]]
    np.testing.assert_array_equal(m, host(ref.topk_with_score_function_fwd(
        x, 4, num_groups=4, group_topk=2)[1]))


def test_signed_zero_ties():
    x = np.array([[-0.0, 0.0, -1.0], [0.0, -0.0, -1.0]], np.float32)
    _, m, _ = K.topk_with_score_function_fwd(x, 1)
    assert _sel(m) == [[0], [0]]


@pytest.mark.parametrize("sf,pre", FWD_MODES)
def test_neg_inf_and_nan_rows(sf, pre):
    ninf, nan = -np.inf, np.nan
    x = np.array([
        [ninf] * 6,                               # all -inf
        [ninf, 1.0, ninf, 2.0, ninf, ninf],       # 2 finite < K: fillers 0, 2
        [nan, 0.5, 0.25, 0.75, ninf, -1.0],       # NaN counts as -inf
        [0.5, nan, nan, nan, nan, nan],           # mostly NaN
    ], np.float32)
    check_special_rows(K, x, 4, pre, sf, [[0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3, 5]])


@settings(max_examples=4)
@given(data=st.data())
def test_exactly_k_per_row_any_input(data):
    cfg = data.draw(router_configs(max_tokens=3, max_experts=12, dtypes=("float32",)))
    x = data.draw(arbitrary_logits(cfg))
    p, m, s = K.topk_with_score_function_fwd(x, **cfg.kwargs())
    assert (m.sum(-1) == cfg.topk).all()
    assert (p[~m] == 0).all()
    if cfg.grouped:
        size = cfg.num_experts // cfg.num_groups
        groups = m.reshape(m.shape[0], cfg.num_groups, size).any(-1).sum(-1)
        assert (groups <= cfg.group_topk).all()


# ----------------------------------------------------------------------------
# Launcher contract: T == 0, float64, limits, device arrays, out=, streams
# ----------------------------------------------------------------------------


def test_empty_tokens():
    x = np.zeros((0, 8), np.float32)
    p, m, s = K.topk_with_score_function_fwd(x, 2)
    assert p.shape == m.shape == s.shape == (0, 8)
    assert (p.dtype, m.dtype, s.dtype) == (np.float32, np.bool_, np.float32)
    g = K.topk_with_score_function_bwd(m, s, p, 2)
    assert g.shape == (0, 8)


def test_float64_is_rejected():
    with pytest.raises(TypeError, match="float64"):
        K.topk_with_score_function_fwd(np.zeros((2, 4)), 2)


def test_limits():
    with pytest.raises(NotImplementedError, match="kernel limit"):
        K.check_limits("fused_topk_with_score_function", K.MAX_EXPERTS + 1, 1, 1)
    with pytest.raises(NotImplementedError, match="topk"):
        K.check_limits("fused_topk_with_score_function", 128, K.MAX_TOPK + 1, 1)
    with pytest.raises(NotImplementedError, match="num_groups"):
        K.check_limits("fused_topk_with_score_function", 128, 8, K.MAX_GROUPS + 1)


def test_device_arrays_out_and_stream():
    from numba import cuda

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 10)).astype(np.float32)
    hp, hm, hs = K.topk_with_score_function_fwd(x, 3, score_function=1)
    stream = cuda.stream()
    dx = cuda.to_device(x)
    outs = (cuda.device_array((2, 10), np.float32), cuda.device_array((2, 10), np.bool_),
            cuda.device_array((2, 10), np.float32))
    res = K.topk_with_score_function_fwd(dx, 3, score_function=1, out=outs, stream=stream)
    assert all(r is o for r, o in zip(res, outs, strict=True))
    stream.synchronize()
    np.testing.assert_array_equal(outs[0].copy_to_host(), hp)
    np.testing.assert_array_equal(outs[1].copy_to_host(), hm)
    g = K.topk_with_score_function_bwd(outs[1], outs[2], outs[0], 3)  # device in -> device out
    assert hasattr(g, "copy_to_host")
    np.testing.assert_array_equal(g.copy_to_host(), K.topk_with_score_function_bwd(hm, hs, hp, 3))


@pytest.mark.parametrize("kwargs,msg", [
    (dict(topk=9), "topk_with_score_function_fwd: topk (9) must be <= num_experts (8)."),
    (dict(topk=2, num_groups=3, group_topk=1), "topk_with_score_function_fwd: num_experts (8) must be divisible "
                                               "by num_groups (3)."),
    (dict(topk=2, scaling_factor=float("inf")), "topk_with_score_function_fwd: scaling_factor (inf) must be finite."),
    (dict(topk=2, expert_bias=np.zeros(8, np.float32)), "topk_with_score_function_fwd: expert_bias (shape (8,)) "
                                                        "must be None with score_function ('softmax')"),
])
def test_launcher_config_errors_are_the_checks_module_s(kwargs, msg):
    """The kernel launchers apply the rules of gpurouter._checks (written once)."""
    import re

    with pytest.raises((ValueError, TypeError), match="^" + re.escape(msg)):
        K.topk_with_score_function_fwd(np.zeros((2, 8), np.float32), **kwargs)
    if "topk" in kwargs and len(kwargs) == 1:
        with pytest.raises(ValueError, match=re.escape("score_for_aux_loss_fwd: topk (9) must be <= num_experts (8).")):
            K.score_for_aux_loss_fwd(np.zeros((2, 8), np.float32), 9)


@pytest.mark.parametrize("sf,grouped", [("sigmoid", True), ("softmax", False), ("sqrtsoftplus", False)])
def test_the_kernel_family_is_an_explicit_argument(sf, grouped):
    """``path=`` picks the thread-per-token or the W-lane forward (no patched
    globals; the warp path: test_warp_topk_fwd.py): both agree with the reference and with each other; the aux
    scores too; a bad path and "token" where those kernels cannot run are
    ValueErrors naming the op."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 16)).astype(np.float32)
    bias = np.linspace(-0.1, 0.1, 16, dtype=np.float32) if sf != "softmax" else None
    kw = dict(num_groups=4 if grouped else -1, group_topk=2 if grouped else -1, scaling_factor=1.5,
              score_function=sf, expert_bias=bias)
    want = ref.topk_with_score_function_fwd(x, 4, **kw)
    got = {path: K.topk_with_score_function_fwd(x, 4, **kw, path=path) for path in ("token", "lane")}
    for outs in got.values():
        np.testing.assert_array_equal(outs[1], np.asarray(want[1]))
        np.testing.assert_allclose(outs[0], np.asarray(want[0]), rtol=1e-6, atol=1e-7)
    aux = {path: K.score_for_aux_loss_fwd(x, 4, sf, path=path) for path in ("token", "lane")}
    np.testing.assert_array_equal(aux["token"][1], aux["lane"][1])
    np.testing.assert_allclose(aux["token"][0], aux["lane"][0], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="topk_with_score_function_fwd_plan: path must be one of 'auto', "
                                         "'warp', 'token', 'lane', got 'fast'"):
        K.topk_with_score_function_fwd(x, 4, **kw, path="fast")
    with pytest.raises(ValueError, match="path='token' needs K <= 64, E a multiple of 4"):
        K.topk_with_score_function_fwd(x[:, :14], 4, score_function="softmax", path="token")
