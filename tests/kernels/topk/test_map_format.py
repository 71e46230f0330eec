"""TE's BITMAP_U8 routing maps (``routing_map_format=1``) against the bool
maps (BYTEMAP, 0): the bitmap is ``np.packbits(bool_map, axis=-1,
bitorder="little")``, probs / scores and saved_scores are the same bits, and
the backward from the bitmap is the backward from the bool map, bit for bit.
Both kernel paths (thread-per-token and W-lane forwards; quad and streaming
backwards), every score function, groups, bias, -inf / NaN rows, E not a
multiple of 8; the aux-score forward; the bad inputs.  Tiny shapes: the
simulator runs them; the TE shapes are the ``gpu`` tests at the end.
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from numba import cuda  # noqa: E402

from gpurouter.testing.strategies import np_dtype  # noqa: E402

from .._helpers import FWD_MODES  # noqa: E402

pytestmark = pytest.mark.cuda


def _packed(m):
    return np.packbits(np.asarray(m), axis=-1, bitorder="little")


def _same_bits(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert (a.dtype, a.shape) == (b.dtype, b.shape), what
    assert a.tobytes() == b.tobytes(), f"{what}: the formats' bits differ"


def _logits(T, E, seed, dtype="float32", specials=True):
    """Random rows with ties (a coarse grid), and, with ``specials``: an all
    -inf row, a row with fewer finite logits than any K here (-inf fillers),
    a row with NaNs, an all-NaN row."""
    rng = np.random.default_rng(seed)
    x = (rng.integers(-24, 25, (T, E)) / 8).astype(np.float32)
    if specials:
        x[0] = -np.inf
        x[1, :] = -np.inf
        x[1, [1, E - 1]] = [0.5, 1.0]
        x[2, ::3] = np.nan
        x[3] = np.nan
    return x.astype(np_dtype(dtype))


def _path(plan):
    mod = plan.steps[0].kernel.py_func.__module__
    return "token" if mod.startswith("gpurouter.kernels.topk.token.") else "warp" if mod.endswith(".warp.fwd") \
        else "lanes"


def _check_topk(K, x, k, path, **kw):
    """Both formats' forwards and backwards: bitmap = packed bool map, the
    rest bit-identical; ``path``: the forward kernel the plan must take."""
    from gpurouter.kernels._base import launch as L
    from gpurouter.kernels._base import plan as _plan

    T, E = x.shape
    bias = kw.get("expert_bias")
    sf = L.score_function_code(kw.get("score_function", "softmax"), "test")
    plan = K.topk_with_score_function_fwd_plan(
        _plan.spec_for(x.shape, x.dtype), bias is not None, k, kw.get("use_pre_softmax", False),
        kw.get("num_groups", -1), kw.get("group_topk", -1), np.float32(kw.get("scaling_factor", 1.0)),
        sf, 1)
    assert _path(plan) == path
    assert plan.outs[1] == _plan.Spec((T, -(-E // 8)), np.uint8)
    p0, m0, s0 = K.topk_with_score_function_fwd(x, k, **kw)
    p1, m1, s1 = K.topk_with_score_function_fwd(x, k, **kw, routing_map_format=1)
    assert m1.dtype == np.uint8 and m1.shape == (T, -(-E // 8))
    np.testing.assert_array_equal(m1, _packed(m0))
    _same_bits(p1, p0, "probs")
    _same_bits(s1, s0, "saved_scores")
    g = np.random.default_rng(E).standard_normal((T, E)).astype(x.dtype)
    bk = dict(use_pre_softmax=kw.get("use_pre_softmax", False),
              scaling_factor=kw.get("scaling_factor", 1.0), score_function=kw.get("score_function", "softmax"))
    _same_bits(K.topk_with_score_function_bwd(m1, s1, g, k, **bk),
               K.topk_with_score_function_bwd(m0, s0, g, k, **bk), "grad_logits")
    return m1


def _bias(E):
    return (np.arange(E) % 5 / 16 - 0.125).astype(np.float32)


# (T, E, K, kwargs, dtype, path): E % 8 == 4 (a last half octet) and E % 8 == 0 (bf16: an
# octet's probs in one store)
# on the token path (K = 17 included); E % 4 != 0 on the W-lane path (the backward:
# streaming for E % 4 != 0, quads otherwise); E = 130: 17 bytes, 2 bits used
# in the last.
TOPK_CASES = [
    (5, 12, 3, dict(), "float32", "token"),
    (5, 20, 5, dict(use_pre_softmax=True), "float32", "token"),
    (5, 16, 4, dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5,
                    expert_bias=_bias(16)), "bfloat16", "token"),
    (5, 24, 6, dict(score_function="sqrtsoftplus", num_groups=3, group_topk=3, expert_bias=_bias(24)),
     "float16", "token"),
    (5, 16, 3, dict(), "bfloat16", "token"),
    (5, 28, 4, dict(score_function="sigmoid", expert_bias=_bias(28)), "bfloat16", "token"),
    (5, 10, 3, dict(), "float32", "lanes"),
    (5, 18, 4, dict(score_function="sigmoid", num_groups=3, group_topk=2, expert_bias=_bias(18)),
     "bfloat16", "lanes"),
    (4, 20, 17, dict(score_function="sqrtsoftplus", scaling_factor=2.5), "float32", "token"),
    (4, 130, 4, dict(use_pre_softmax=True), "float32", "lanes"),
]


@pytest.mark.parametrize("T,E,k,kw,dtype,path", TOPK_CASES,
                         ids=[f"E{c[1]}K{c[2]}-{c[3].get('score_function', 'softmax')}"
                              f"{'-pre' if c[3].get('use_pre_softmax') else ''}"
                              f"{'-groups' if 'num_groups' in c[3] else ''}-{c[4]}-{c[5]}" for c in TOPK_CASES])
def test_topk_bitmap_is_the_packed_bytemap(token_tiling, T, E, k, kw, dtype, path):
    K = token_tiling(2)  # several blocks, a partial last tile
    _check_topk(K, _logits(T, E, E + k, dtype), k, path, **kw)


@pytest.mark.parametrize("E,dtype", [(44, "bfloat16"), (40, "bfloat16"), (40, "float32")])
def test_octet_walk_groups_and_chunks(token_tiling, E, dtype):
    """The token kernels' octet walk (a warp: 4 octets of 8 tokens) with 16
    tokens per block and 2 warps: two token groups, two octet chunks (the
    second partial), a partial last tile (17 rows: one token in the second
    block; 21 until 2026-11-28), idle lanes; E % 8 == 4 and 0 (bf16: paired
    16-byte probs stores)."""
    K = token_tiling(16, 64)
    x = _logits(17, E, E)
    _check_topk(K, x, 4, "token", score_function="sigmoid", num_groups=4, group_topk=2, expert_bias=_bias(E))
    _check_topk(K, x, 5, "token", use_pre_softmax=False)
    sc0, m0, sv0 = K.score_for_aux_loss_fwd(x, 5, "sqrtsoftplus")
    sc1, m1, sv1 = K.score_for_aux_loss_fwd(x, 5, "sqrtsoftplus", routing_map_format=1)
    np.testing.assert_array_equal(m1, _packed(m0))
    _same_bits(sc1, sc0, "scores")


def test_topk_bitmap_lanes_partial_tile(tiling):
    """W-lane forward with 4 lanes and 2 tokens per block (a partial last tile),
    groups and a bias: the bytes of every block's tokens."""
    K = tiling(4, 8)
    _check_topk(K, _logits(5, 20, 3), 4, "lanes", score_function="sigmoid", num_groups=4, group_topk=2,
                expert_bias=_bias(20))


@pytest.mark.parametrize("sf,pre", FWD_MODES)
def test_quad_bwd_bitmap_several_quads_per_lane(quad_lanes, sf, pre):
    """The quad backward with 2 lanes per token, 4 tokens per block (a partial
    last block), each lane several quads: a token's nibbles from its own bytes."""
    _check_topk(quad_lanes, _logits(5, 20, 6), 3, "token", use_pre_softmax=pre, score_function=sf)


def test_topk_bitmap_bit_order():
    """Expert e is bit e % 8 of byte e // 8 (LSB first), padding bits 0."""
    x = np.full((2, 12), -1.0, np.float32)
    x[0, [0, 9]] = [2.0, 1.0]
    x[1, [7, 11]] = [2.0, 1.0]
    _, m, _ = K.topk_with_score_function_fwd(x, 2, routing_map_format=1)
    np.testing.assert_array_equal(m, np.array([[0b00000001, 0b00000010], [0b10000000, 0b00001000]], np.uint8))


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("E,path", [(12, "token"), (10, "lanes")])
def test_aux_scores_bitmap_is_the_packed_bytemap(token_tiling, sf, E, path):
    from gpurouter.kernels._base import launch as L
    from gpurouter.kernels._base import plan as _plan

    K = token_tiling(2)
    x = _logits(5, E, 3 * E)
    if sf != "softmax":
        x = np.where(np.isneginf(x), np.float32(-30.0), x)
    plan = K.score_for_aux_loss_fwd_plan(_plan.spec_of(x.shape, L.F32), 3, L.score_function_code(sf, "t"), 1)
    assert _path(plan) == path and plan.outs[1] == _plan.Spec((5, 2), np.uint8)
    sc0, m0, sv0 = K.score_for_aux_loss_fwd(x, 3, sf)
    sc1, m1, sv1 = K.score_for_aux_loss_fwd(x, 3, sf, routing_map_format=1)
    assert m1.dtype == np.uint8 and m1.shape == (5, 2)
    np.testing.assert_array_equal(m1, _packed(m0))
    _same_bits(sc1, sc0, "scores")
    _same_bits(sv1, sv0, "saved_scores")


def test_device_out_and_empty_tokens():
    """A preallocated device bitmap is written in place (the zero-copy way);
    T = 0 gives an empty bitmap; the bitmap's backward takes device arrays."""
    x = _logits(3, 12, 5, specials=False)
    hp, hm, hs = K.topk_with_score_function_fwd(x, 3, routing_map_format=1)
    outs = (cuda.device_array((3, 12), np.float32), cuda.device_array((3, 2), np.uint8),
            cuda.device_array((3, 12), np.float32))
    res = K.topk_with_score_function_fwd(cuda.to_device(x), 3, routing_map_format=1, out=outs)
    assert all(r is o for r, o in zip(res, outs, strict=True))
    np.testing.assert_array_equal(outs[1].copy_to_host(), hm)
    g = K.topk_with_score_function_bwd(outs[1], outs[2], outs[0], 3)
    np.testing.assert_array_equal(g.copy_to_host(), K.topk_with_score_function_bwd(hm, hs, hp, 3))
    with pytest.raises(ValueError, match=r"out output must be a device array of shape \(3, 2\) and dtype uint8"):
        K.topk_with_score_function_fwd(x, 3, routing_map_format=1,
                                       out=(outs[0], cuda.device_array((3, 12), np.bool_), outs[2]))
    p, m, s = K.topk_with_score_function_fwd(np.zeros((0, 12), np.float32), 2, routing_map_format=1)
    assert m.shape == (0, 2) and m.dtype == np.uint8
    assert K.topk_with_score_function_bwd(m, s, p, 2).shape == (0, 12)
    assert K.score_for_aux_loss_fwd(np.zeros((0, 9), np.float32), 2, routing_map_format=1)[1].shape == (0, 2)


@pytest.mark.parametrize("bad", [2, -1, "bitmap", True, 1.0, None])
def test_bad_routing_map_format(bad):
    x = np.zeros((2, 8), np.float32)
    for fn, name in ((K.topk_with_score_function_fwd, "topk_with_score_function_fwd"),
                     (K.score_for_aux_loss_fwd, "score_for_aux_loss_fwd")):
        with pytest.raises(ValueError, match=rf"{name}: routing_map_format must be 0 \(BYTEMAP.*or 1 "
                                             rf"\(BITMAP_U8"):
            fn(x, 2, routing_map_format=bad)


def test_bad_plan_map_format():
    from gpurouter.kernels._base import launch as L
    from gpurouter.kernels._base import plan as _plan

    spec = _plan.spec_of((2, 8), L.F32)
    with pytest.raises(ValueError, match="topk_with_score_function_fwd_plan: map_format must be 0"):
        K.topk_with_score_function_fwd_plan(spec, False, 2, False, -1, -1, np.float32(1), 1, 2)
    with pytest.raises(ValueError, match="topk_with_score_function_bwd_plan: map_format must be 0"):
        K.topk_with_score_function_bwd_plan(spec, 2, False, np.float32(1), 1, map_format=3)
    with pytest.raises(ValueError, match="score_for_aux_loss_fwd_plan: map_format must be 0"):
        K.score_for_aux_loss_fwd_plan(spec, 2, 1, map_format=-1)
    plan = K.topk_with_score_function_bwd_plan(_plan.spec_of((2, 12), L.F32), 2, False, np.float32(1), 1,
                                               map_format=1)
    assert plan.ins[0] == _plan.Spec((2, 2), np.uint8)


def test_bwd_map_errors():
    """The backward tells the format from the map's dtype: a uint8 map must be
    [T, ceil(E/8)], a bool map [T, E]; other dtypes are refused."""
    s = np.zeros((3, 12), np.float32)
    g = np.zeros((3, 12), np.float32)
    bwd = K.topk_with_score_function_bwd
    for bad in (np.zeros((3, 12), np.uint8), np.zeros((3, 1), np.uint8), np.zeros((2, 2), np.uint8),
                cuda.to_device(np.zeros((3, 3), np.uint8))):
        with pytest.raises(ValueError, match=r"topk_with_score_function_bwd: routing_map must be a bool "
                                             r"\[T, E\] = \[3, 12\] map \(BYTEMAP\) or a uint8 \[T, ceil\(E/8\)\]"
                                             r" = \[3, 2\] bitmap \(BITMAP_U8\), got shape"):
            bwd(bad, s, g, 2)
    with pytest.raises(ValueError, match=r"routing_map must be .*, got shape \(3, 2\) bool"):
        bwd(np.zeros((3, 2), np.bool_), s, g, 2)
    for bad in (np.zeros((3, 2), np.int8), np.zeros((3, 12), np.int32), np.zeros((3, 12), np.float32),
                cuda.to_device(np.zeros((3, 2), np.uint16))):
        with pytest.raises(TypeError, match=r"topk_with_score_function_bwd: routing_map must be a bool .* "
                                            r"\(BITMAP_U8\), got dtype"):
            bwd(bad, s, g, 2)


def test_bwd_ignores_padding_bits():
    """Padding bits of a caller's bitmap (past expert E - 1) are never read."""
    x = _logits(3, 12, 8, specials=False)
    p, m, s = K.topk_with_score_function_fwd(x, 3, routing_map_format=1)
    dirty = m.copy()
    dirty[:, -1] |= np.uint8(0xF0)
    _same_bits(K.topk_with_score_function_bwd(dirty, s, p, 3), K.topk_with_score_function_bwd(m, s, p, 3),
               "grad_logits")
    x = _logits(3, 10, 8, specials=False)  # the streaming backward
    p, m, s = K.topk_with_score_function_fwd(x, 3, routing_map_format=1)
    dirty = m.copy()
    dirty[:, -1] |= np.uint8(0xFC)
    _same_bits(K.topk_with_score_function_bwd(dirty, s, p, 3), K.topk_with_score_function_bwd(m, s, p, 3),
               "grad_logits")


# ----------------------------------------------------------------------------
# TE shapes (real GPU only)
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k,kw,dtype,path", [
    (7168, 256, 8, dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5,
                        expert_bias=_bias(256)), "bfloat16", "warp"),
    (2048, 132, 8, dict(use_pre_softmax=True), "float32", "token"),
    (7168, 128, 8, dict(), "bfloat16", "warp"),
    (7168, 512, 22, dict(score_function="sigmoid", scaling_factor=5.0, expert_bias=_bias(512)),
     "bfloat16", "warp"),
    (2048, 130, 6, dict(score_function="sqrtsoftplus"), "float16", "lanes"),
], ids=["deepseek_v3", "E132-pre", "qwen3", "nemotron", "E130"])
def test_gpu_shapes(T, E, k, kw, dtype, path):
    m = _check_topk(K, _logits(T, E, 1, dtype), k, path, **kw)
    assert (np.unpackbits(m, axis=-1, count=E, bitorder="little").sum(-1) == k).all()


@pytest.mark.gpu
@pytest.mark.parametrize("sf", ["softmax", "sigmoid"])
@pytest.mark.parametrize("E", [256, 130])
def test_gpu_aux_scores(sf, E):
    x = _logits(7168, E, 2, "bfloat16")
    sc0, m0, sv0 = K.score_for_aux_loss_fwd(x, 8, sf)
    sc1, m1, sv1 = K.score_for_aux_loss_fwd(x, 8, sf, routing_map_format=1)
    np.testing.assert_array_equal(m1, _packed(m0))
    _same_bits(sc1, sc0, "scores")
    _same_bits(sv1, sv0, "saved_scores")
