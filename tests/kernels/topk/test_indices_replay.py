"""``return_indices`` and ``forced_indices`` (routing replay) of the kernel
launchers against the reference: the indices are
``reference.fused_topk_with_score_function(..., return_indices=True)``'s
(selection order, ties to the lower index, NaN as -inf, fillers of -inf / NaN
rows included) on both forward paths (thread-per-token and W-lane) and both
map formats, for the top-k and the aux scores; a replay of the indices a
normal call returned is that call bit for bit (probs, map, saved, and the
backward from them); out-of-range and repeated forced entries give the
reference's result; the bias values play no part in a replay.  Tiny shapes,
several blocks and partial last tiles: the simulator runs them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from numba import cuda  # noqa: E402

from gpurouter import reference as ref  # noqa: E402
from gpurouter.testing.strategies import np_dtype  # noqa: E402
from gpurouter.testing.tolerances import assert_close  # noqa: E402

pytestmark = pytest.mark.cuda


def _logits(T, E, seed, dtype="float32"):
    """A coarse grid (ties, also across the K-th place), an all -inf row, a
    row with two finite logits (-inf fillers), a row with NaNs."""
    rng = np.random.default_rng(seed)
    x = (rng.integers(-12, 13, (T, E)) / 4).astype(np.float32)
    x[0] = -np.inf
    x[1, :] = -np.inf
    x[1, [1, E - 1]] = [0.5, 1.0]
    x[2, ::3] = np.nan
    return x.astype(np_dtype(dtype))


def _bias(E):
    return (np.arange(E) % 5 / 16 - 0.125).astype(np.float32)


def _same_bits(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert (a.dtype, a.shape) == (b.dtype, b.shape), what
    assert a.tobytes() == b.tobytes(), f"{what}: not the same bits"


def _path(plan):
    return "token" if plan.steps[0].kernel.py_func.__module__.startswith("gpurouter.kernels.topk.token.") else "lanes"


def _plan(K, x, k, kw, fmt, **extra):
    from gpurouter.kernels._base import launch as L
    from gpurouter.kernels._base import plan as _plan

    sf = L.score_function_code(kw.get("score_function", "softmax"), "test")
    return K.topk_with_score_function_fwd_plan(
        _plan.spec_for(x.shape, x.dtype), kw.get("expert_bias") is not None, k, kw.get("use_pre_softmax", False),
        kw.get("num_groups", -1), kw.get("group_topk", -1), np.float32(kw.get("scaling_factor", 1.0)), sf, fmt,
        **extra)


def _ref_indices(x, k, kw):
    kw = {a: (jnp.asarray(b) if a == "expert_bias" else b) for a, b in kw.items()}
    return np.asarray(ref.fused_topk_with_score_function(jnp.asarray(x), k, **kw, return_indices=True)[2])


# (T, E, K, kwargs, dtype, path, map format): every score function, pre and
# post softmax, groups, bias, K = 1, K > 16 (both paths) and E % 4 != 0 (W-lane).
CASES = [
    (5, 16, 4, dict(), "bfloat16", "token", 0),
    (5, 12, 3, dict(use_pre_softmax=True, scaling_factor=1.5), "float32", "token", 1),
    (5, 16, 4, dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5,
                    expert_bias=_bias(16)), "bfloat16", "token", 1),
    (5, 12, 5, dict(score_function="sqrtsoftplus", expert_bias=_bias(12)), "float16", "token", 0),
    (5, 8, 3, dict(score_function="sigmoid"), "float32", "token", 0),
    (5, 8, 1, dict(score_function="sigmoid", expert_bias=_bias(8)), "float32", "token", 1),
    (5, 10, 3, dict(score_function="sigmoid", expert_bias=_bias(10), num_groups=5, group_topk=3),
     "bfloat16", "lanes", 0),
    (5, 10, 4, dict(), "float32", "lanes", 1),
    (4, 20, 17, dict(score_function="sqrtsoftplus", scaling_factor=2.5), "float32", "lanes", 0),
    (4, 20, 17, dict(score_function="sqrtsoftplus", scaling_factor=2.5), "float32", "token", 1),
    (4, 24, 18, dict(score_function="sigmoid", expert_bias=_bias(24)), "bfloat16", "token", 0),
    (4, 18, 1, dict(use_pre_softmax=True), "bfloat16", "lanes", 1),
]


# the token path's cases twice: the library's selection on tiny T (the chunk lanes) and the
# row scan (``token_tiling``'s ``lanes="row"``: every T above the lanes' caps on a GPU)
LANE_CASES = [c + (lanes,) for c in CASES for lanes in ((None, "row") if c[5] == "token" else (None,))]


@pytest.mark.parametrize("T,E,k,kw,dtype,path,fmt,lanes", LANE_CASES,
                         ids=[f"E{c[1]}K{c[2]}-{c[3].get('score_function', 'softmax')}"
                              f"{'-pre' if c[3].get('use_pre_softmax') else ''}"
                              f"{'-groups' if 'num_groups' in c[3] else ''}"
                              f"{'-bias' if 'expert_bias' in c[3] else ''}-{c[4]}-{c[5]}-fmt{c[6]}"
                              f"{'-' + c[7] if c[7] else ''}" for c in LANE_CASES])
def test_indices_and_replay(token_tiling, tiling, T, E, k, kw, dtype, path, fmt, lanes):
    kern = K  # (E % 4 != 0: the W-lane path, the library's tiling)
    if path == "token":
        kern = token_tiling(2, lanes=lanes)  # several blocks, a partial last tile
    elif E % 4 == 0:
        kern = tiling(2, 4)  # the W-lane path: 2 lanes, 2 tokens per block
    x = _logits(T, E, 31 * E + k, dtype)
    assert _path(_plan(kern, x, k, kw, fmt, return_indices=True)) == path
    assert _path(_plan(kern, x, k, kw, fmt, forced=True)) == path
    p, m, s, idx = kern.topk_with_score_function_fwd(x, k, **kw, routing_map_format=fmt, return_indices=True)
    assert idx.dtype == np.int32 and idx.shape == (T, k)
    np.testing.assert_array_equal(idx, _ref_indices(x, k, dict(kw, routing_map_format=fmt)))
    # the plain call: the same outputs
    p0, m0, s0 = kern.topk_with_score_function_fwd(x, k, **kw, routing_map_format=fmt)
    _same_bits(p, p0, "probs")
    _same_bits(m, m0, "routing_map")
    _same_bits(s, s0, "saved")
    # the replay: the same call, bit for bit (the bias only says the order of the sums)
    p2, m2, s2 = kern.topk_with_score_function_fwd(x, k, **kw, routing_map_format=fmt, forced_indices=idx)
    _same_bits(p2, p, "replayed probs")
    _same_bits(m2, m, "replayed routing_map")
    _same_bits(s2, s, "replayed saved")
    g = np.random.default_rng(E).standard_normal((T, E)).astype(x.dtype)
    bk = dict(use_pre_softmax=kw.get("use_pre_softmax", False), scaling_factor=kw.get("scaling_factor", 1.0),
              score_function=kw.get("score_function", "softmax"))
    _same_bits(kern.topk_with_score_function_bwd(m2, s2, g, k, **bk),
               kern.topk_with_score_function_bwd(m, s, g, k, **bk), "grad_logits")


@pytest.mark.parametrize("path", ["token", "lanes"])
def test_out_of_range_and_repeated_forced_entries(token_tiling, tiling, path):
    if path == "token":
        K = token_tiling(2)
        E = 12
    else:
        K = tiling(2, 4)
        E = 10
    x = _logits(5, E, 5)
    x[0] = np.linspace(-1, 1, E)  # finite rows: the reference's softmax is defined
    forced = np.array([[1, 1, 3], [E, -1, 2], [0, 4, E - 1], [2, 2, 2], [-7, 5, 5]], np.int32)
    for kw in (dict(score_function="sigmoid"), dict(), dict(use_pre_softmax=True),
               dict(score_function="sqrtsoftplus", expert_bias=_bias(E))):
        p, m, s = K.topk_with_score_function_fwd(x, 3, **kw, forced_indices=forced)
        rkw = {a: (jnp.asarray(b) if a == "expert_bias" else b) for a, b in kw.items()}
        # traced indices: the reference's defined result (concrete ones are a ValueError there)
        rp, rm = jax.jit(lambda x, f, rkw=rkw: ref.fused_topk_with_score_function(
            x, 3, **rkw, forced_indices=f))(jnp.asarray(x), jnp.asarray(forced))
        np.testing.assert_array_equal(m, np.asarray(rm))
        assert m.sum(1).tolist() == [2, 1, 3, 1, 1]
        assert_close(p, np.asarray(rp), "probs", np.float32, err_msg=str(kw))


def test_replay_ignores_bias_values_and_groups(token_tiling):
    K = token_tiling(4)
    x = _logits(5, 16, 9)
    forced = np.array([[0, 5, 9, 15]] * 5, np.int32)
    kw = dict(score_function="sigmoid", scaling_factor=2.0)
    a = K.topk_with_score_function_fwd(x, 4, **kw, expert_bias=_bias(16), forced_indices=forced)
    b = K.topk_with_score_function_fwd(x, 4, **kw, expert_bias=np.full(16, -5, np.float32), num_groups=4,
                                       group_topk=1, forced_indices=forced)
    for u, v, what in zip(a, b, ("probs", "map", "saved"), strict=True):
        _same_bits(u, v, what)
    c = K.topk_with_score_function_fwd(x, 4, **kw, forced_indices=forced)  # no bias: within rounding
    np.testing.assert_array_equal(c[1], a[1])
    np.testing.assert_allclose(c[0], a[0], rtol=1e-6)
    assert a[1][:, [0, 5, 9, 15]].all() and int(a[1].sum()) == 20


@pytest.mark.parametrize("E,k,sf,dtype,fmt", [(12, 3, "softmax", "bfloat16", 0), (16, 4, "sigmoid", "float32", 1),
                                              (12, 5, "sqrtsoftplus", "float16", 0), (10, 3, "sigmoid", "float32", 1),
                                              (10, 17, "softmax", "float32", 0)])
def test_aux_score_indices(token_tiling, E, k, sf, dtype, fmt):
    K = token_tiling(2)
    if E < k:
        E = 20
    x = _logits(5, E, E * k, dtype)
    sc, m, s, idx = K.score_for_aux_loss_fwd(x, k, sf, fmt, return_indices=True)
    _, rm, ridx = ref.fused_topk_with_score_function(jnp.asarray(x), k, score_function=sf, compute_aux_scores=True,
                                                    routing_map_format=fmt, return_indices=True)
    np.testing.assert_array_equal(idx, np.asarray(ridx))
    sc0, m0, s0 = K.score_for_aux_loss_fwd(x, k, sf, fmt)
    _same_bits(sc, sc0, "scores")
    _same_bits(m, m0, "map")


def test_device_arrays_and_plans(token_tiling):
    K = token_tiling(2)
    from gpurouter.kernels._base import launch as L
    from gpurouter.kernels._base import plan as plans  # (``_plan`` is this module's plan helper)

    x = _logits(3, 8, 2)
    p, m, s, idx = K.topk_with_score_function_fwd(cuda.to_device(x), 2, return_indices=True)
    assert idx.dtype == np.int32 and tuple(idx.shape) == (3, 2)
    p2, _, _ = K.topk_with_score_function_fwd(cuda.to_device(x), 2, forced_indices=idx)
    _same_bits(p2.copy_to_host(), p.copy_to_host(), "probs")
    plan = _plan(K, x, 2, dict(expert_bias=_bias(8), score_function="sigmoid"), 0, forced=True)
    assert plan.ins == (plans.spec_of((3, 8), L.F32), plans.Spec((3, 2), np.int32))
    assert _plan(K, x, 2, {}, 1, return_indices=True).outs[3] == plans.Spec((3, 2), np.int32)
    assert len(_plan(K, x, 2, {}, 0).outs) == 3
    with pytest.raises(ValueError, match="return_indices with forced_indices"):
        K.topk_with_score_function_fwd(x, 2, return_indices=True, forced_indices=np.zeros((3, 2), np.int32))
    with pytest.raises(ValueError, match="shape"):
        K.topk_with_score_function_fwd(x, 2, forced_indices=np.zeros((3, 3), np.int32))
    with pytest.raises(TypeError, match="int32"):
        K.topk_with_score_function_fwd(x, 2, forced_indices=cuda.to_device(np.zeros((3, 2), np.int64)))


@pytest.mark.parametrize("lanes", ["group", "row"])
@pytest.mark.parametrize("way", [1, 2])
@pytest.mark.parametrize("fmt", [0, 1])
def test_token_indices_ways(token_tiling, way, fmt, lanes):
    """Every way the thread-per-token forward writes its indices (hit lists in
    local memory, packed in a register) gives the
    reference's indices and the plain call's outputs, on ties, -inf fillers
    and NaN rows, with groups and a bias. The ways belong to the token thread's
    selection (the grouped lanes' and the row scan's; the chunk lanes write
    their indices from their masks), so those two are forced."""
    from gpurouter.kernels.topk.token.tiling import token_lanes

    K = token_tiling(2, lanes=lanes, indices_way=way)
    assert token_lanes(5, 16, 4, 4, True, K.tiling.token)[0] == {"group": 1, "row": 0}[lanes]
    kw = dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5, expert_bias=_bias(16))
    x = _logits(5, 16, 7 + way, "bfloat16")
    p, m, s, idx = K.topk_with_score_function_fwd(x, 4, **kw, routing_map_format=fmt, return_indices=True)
    np.testing.assert_array_equal(idx, _ref_indices(x, 4, dict(kw, routing_map_format=fmt)))
    for a, b, what in zip((p, m, s), K.topk_with_score_function_fwd(x, 4, **kw, routing_map_format=fmt),
                          ("probs", "routing_map", "saved"), strict=True):
        _same_bits(a, b, what)
