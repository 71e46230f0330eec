"""Kernel vs reference at TransformerEngine's test shapes (real GPU only).

T in {2048, 7168, 14234}, E in {32, 128, 256, 1024}, K in {1, 4, 8, 16, 32}
(K <= E), ungrouped and 8 groups / 4 kept, every score function, plus model
configs.  Routing maps are compared exactly on rows whose selection is
tie-free at float32 rounding (rows are random draws of distinct values, the
few near-tied rows are left out of the exact comparison); the backward runs on
the kernel's own saved state, so it is compared on every row.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter import reference as ref  # noqa: E402
from gpurouter.testing.strategies import np_dtype, random_cotangent  # noqa: E402
from gpurouter.testing.tolerances import assert_close  # noqa: E402

from ._helpers import FWD_MODES, cast, check_topk_bwd, check_topk_fwd, host  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.gpu]

TOKENS = (2048, 7168, 14234)


def _values(dtype: str) -> np.ndarray:
    """Distinct values of ``dtype`` in [-2, 2], |x| >= 1/16 (or 0).

    [-2, 2] keeps sigmoid / sqrtsoftplus away from saturation, so distinct
    logits stay clearly distinct scores (few near-tied rows)."""
    grid = np.linspace(-2, 2, 1 << 16, dtype=np.float32).astype(np_dtype(dtype))
    grid = np.unique(grid.astype(np.float32))
    return grid[(np.abs(grid) >= 1 / 16) | (grid == 0)]


def _logits(T, E, dtype, seed):
    """[T, E]: every row a random permutation of E distinct values of ``dtype``."""
    cand = _values(dtype)
    base = cand[np.linspace(0, len(cand) - 1, E).astype(np.int64)]
    return np.random.default_rng(seed).permuted(np.tile(base, (T, 1)), axis=1)


def _selection_scores(x, sf, pre, bias):
    x = x.astype(np.float64)
    if sf == "softmax":
        if not pre:
            return x
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if sf == "sigmoid":
        s = 1 / (1 + np.exp(-x))
    else:
        s = np.sqrt(np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))))
    return s if bias is None else s + bias[None, :]


def _gap_ok(sorted_desc, k):
    """Rows whose k-th and (k+1)-th values are clearly apart (100x fp32 rounding)."""
    if sorted_desc.shape[-1] <= k:
        return np.ones(sorted_desc.shape[0], bool)
    a, b = sorted_desc[:, k - 1], sorted_desc[:, k]
    with np.errstate(invalid="ignore"):  # b = -inf: nothing left to tie with
        return np.isneginf(b) | ((a - b) > 1e-5 * np.maximum(np.abs(a), np.abs(b)) + 1e-7)


def tie_free_rows(r, k, G=-1, Kg=-1):
    """Boolean [T]: rows whose selection is tie-free at both stages."""
    T, E = r.shape
    if Kg <= 0:
        return _gap_ok(-np.sort(-r, axis=1), k)
    per = k // Kg
    grouped = -np.sort(-r.reshape(T, G, E // G), axis=2)
    gs = grouped[:, :, :per].sum(-1)
    ok = _gap_ok(-np.sort(-gs, axis=1), Kg)
    kept = np.argsort(-gs, axis=1, kind="stable")[:, :Kg]
    elig = np.zeros((T, G), bool)
    np.put_along_axis(elig, kept, True, axis=1)
    masked = np.where(np.repeat(elig, E // G, axis=1), r, -np.inf)
    return ok & _gap_ok(-np.sort(-masked, axis=1), k)


def _run_topk(T, E, k, G, Kg, sf, pre, scale, with_bias, dtype, seed):
    x = _logits(T, E, dtype, seed)
    bias = None
    if with_bias:
        bias = (np.random.default_rng(seed + 1).integers(-32, 33, E) / 256).astype(np.float32)
    rows = tie_free_rows(_selection_scores(x, sf, pre, bias), k, G, Kg)
    assert rows.mean() > 0.5, "too many near-tied rows to compare"
    kwargs = dict(topk=k, use_pre_softmax=pre, num_groups=G, group_topk=Kg,
                  scaling_factor=scale, score_function=sf)
    _, m, s = check_topk_fwd(K, x, dtype, kwargs, bias, rows=rows)
    check_topk_bwd(K, m, s, random_cotangent(seed + 2, x.shape, dtype), dtype, kwargs)


def _cases():
    """Every (E, K, grouping) of TE's matrix, each with one score function
    (cycling), T cycling over TOKENS, some in bf16 / fp16; plus every score
    function at E=256, K=8, 8 groups / 4."""
    out = []
    combos = [(E, k, g) for E, k in itertools.product((32, 128, 256, 1024), (1, 4, 8, 16, 32))
              for g in (False, True)
              if k <= E and (not g or (E % 8 == 0 and k % 4 == 0 and k // 4 <= E // 8))]
    combos += [(256, 8, True)] * 3
    for i, (E, k, grouped) in enumerate(combos):
        sf, pre = FWD_MODES[i % 4]
        T = TOKENS[i % 3]
        dtype = ("float32", "bfloat16", "float32", "float16")[(i // 4) % 4]
        out.append(pytest.param(
            T, E, k, 8 if grouped else -1, 4 if grouped else -1, sf, pre, dtype,
            id=f"T{T}-E{E}-K{k}-{'g8x4' if grouped else 'flat'}-{sf}"
               f"{'-pre' if pre else ''}-{dtype}"))
    return out


@pytest.mark.parametrize("T,E,k,G,Kg,sf,pre,dtype", _cases())
def test_te_shapes(T, E, k, G, Kg, sf, pre, dtype):
    _run_topk(T, E, k, G, Kg, sf, pre, 1.0 if sf == "softmax" else 2.5, sf != "softmax",
              dtype, seed=E * 100 + k)


MODELS = {  # name: (E, K, G, Kg, score_function, bias, scaling)
    "deepseek_v3": (256, 8, 8, 4, "sigmoid", True, 2.5),
    "qwen3": (128, 8, -1, -1, "softmax", False, 1.0),
    "mixtral": (8, 2, -1, -1, "softmax", False, 1.0),
    "nemotron": (512, 22, -1, -1, "sigmoid", True, 5.0),
}


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_models(model, dtype):
    E, k, G, Kg, sf, with_bias, scale = MODELS[model]
    _run_topk(7168, E, k, G, Kg, sf, False, scale, with_bias, dtype, seed=11)


@pytest.mark.parametrize("sf,E,T,dtype", [
    ("softmax", 32, 2048, "float32"), ("sigmoid", 128, 7168, "bfloat16"),
    ("sqrtsoftplus", 256, 14234, "float32"), ("softmax", 1024, 2048, "float16"),
    ("sigmoid", 256, 2048, "float32"), ("sqrtsoftplus", 1024, 7168, "bfloat16")])
def test_aux_scores(sf, E, T, dtype):
    x = cast(_logits(T, E, dtype, E), dtype)
    sc, m, sv = K.score_for_aux_loss_fwd(x, 8, sf)
    rsc, rm, rsv = (host(a) for a in ref.score_for_aux_loss_fwd(x, 8, sf))
    rows = tie_free_rows(rsc.astype(np.float64), 8)
    np.testing.assert_array_equal(m[rows], rm[rows])
    assert (m.sum(-1) == 8).all()
    assert_close(sc, rsc, "probs", np.float32, err_msg="aux scores")
    g = random_cotangent(3, x.shape)
    dx = K.score_for_aux_loss_bwd(sv, g, sf, np_dtype(dtype))
    rdx = host(ref.score_for_aux_loss_bwd(sv, g, sf, np_dtype(dtype)))
    assert_close(dx, rdx, "grads", np_dtype(dtype), E=E, err_msg="aux grad")


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("dtype,C,E", [("float32", 256, None), ("bfloat16", 512, 256)])
def test_aux_loss(T, dtype, C, E):
    rng = np.random.default_rng(T)
    probs = cast(rng.random((T, C)), dtype)
    tpe = rng.integers(0, 2 * T, C).astype(np.int32)
    loss, coeff = K.moe_aux_loss_fwd(probs, tpe, 8, 1e-2, None, E)
    rloss, rcoeff = (host(a) for a in ref.moe_aux_loss_fwd(probs, tpe, 8, 1e-2, None, E))
    np.testing.assert_allclose(coeff, rcoeff, rtol=3e-7)  # XLA:GPU division: ~1 ulp
    assert_close(loss, rloss, "aux_loss", np_dtype(dtype), err_msg="aux loss")
    for _ in range(3):  # deterministic: no float atomics
        assert K.moe_aux_loss_fwd(probs, tpe, 8, 1e-2, None, E)[0].tobytes() == loss.tobytes()
    g = np.asarray(0.75, np_dtype(dtype))
    assert_close(K.moe_aux_loss_bwd(coeff, tpe, g, T),
                 host(ref.moe_aux_loss_bwd(rcoeff, tpe, g, T)), "probs", np_dtype(dtype))


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_misaligned_fp32_outputs_take_the_scalar_path(dtype):
    """fp32 outputs written through ``out=`` views that are not 16-byte aligned
    (``saved``; fp32 ``probs``) give the same results as aligned ones: their
    quads fall back to elements."""
    from numba import cuda

    T, E, k = 300, 256, 8
    x = cast(np.random.default_rng(5).standard_normal((T, E)), dtype)
    bias = np.linspace(-0.1, 0.1, E, dtype=np.float32)
    kw = dict(num_groups=8, group_topk=4, scaling_factor=2.5, score_function="sigmoid", expert_bias=bias)
    want = [np.asarray(a) for a in K.topk_with_score_function_fwd(x, k, **kw)]
    d_x = cuda.to_device(x.view(np.uint16) if dtype == "bfloat16" else x)
    if dtype == "bfloat16":
        probs = cuda.device_array((T, E), np.uint16)
    else:
        probs = cuda.device_array(T * E + 1, np.float32)[1:].reshape(T, E)
    rmap = cuda.device_array((T, E), np.bool_)
    saved = cuda.device_array(T * E + 3, np.float32)[3:].reshape(T, E)
    K.topk_with_score_function_fwd(d_x, k, **kw, out=(probs, rmap, saved))
    np.testing.assert_array_equal(probs.copy_to_host().view(want[0].dtype), want[0])
    np.testing.assert_array_equal(rmap.copy_to_host(), want[1])
    np.testing.assert_array_equal(saved.copy_to_host(), want[2])
