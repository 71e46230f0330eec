"""Shared helpers of the kernel tests: run a launcher and the jnp reference on
the same inputs and compare them with the contract tolerances."""

from __future__ import annotations

import numpy as np

from gpurouter import reference as ref
from gpurouter.testing.strategies import RouterConfig, np_dtype
from gpurouter.testing.tolerances import assert_close, assert_dtype

FWD_MODES = (  # (score_function, use_pre_softmax)
    ("softmax", False),
    ("softmax", True),
    ("sigmoid", False),
    ("sqrtsoftplus", False),
)


def host(a):
    """A reference (jax) or kernel result as a NumPy array."""
    return np.asarray(a)


def cast(x: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np_dtype(dtype))


def check_topk_fwd(kern, x, dtype, kwargs, bias=None, *, exact_map=True, rows=None):
    """Kernel vs reference forward; returns the kernel's (probs, map, saved)."""
    xl = cast(x, dtype)
    p, m, s = kern.topk_with_score_function_fwd(xl, expert_bias=bias, **kwargs)
    rp, rm, rs = (host(a) for a in ref.topk_with_score_function_fwd(xl, expert_bias=bias, **kwargs))
    assert_dtype(p, np_dtype(dtype), "probs")
    assert m.dtype == np.bool_ and s.dtype == np.float32
    assert (m.sum(-1) == kwargs["topk"]).all(), "exactly K experts per token"
    sel = slice(None) if rows is None else rows
    if exact_map:
        np.testing.assert_array_equal(m[sel], rm[sel], err_msg=f"routing_map {kwargs}")
    assert_close(p[sel], rp[sel], "probs", np_dtype(dtype), err_msg=f"probs {kwargs}")
    assert_close(s[sel], rs[sel], "probs", np.float32, err_msg=f"saved {kwargs}")
    return p, m, s


def check_topk_bwd(kern, m, s, g, dtype, kwargs):
    """Kernel vs reference backward on the kernel's own saved state."""
    bk = dict(topk=kwargs["topk"], use_pre_softmax=kwargs.get("use_pre_softmax", False),
              scaling_factor=kwargs.get("scaling_factor", 1.0),
              score_function=kwargs.get("score_function", "softmax"))
    gl = cast(g, dtype)
    dx = kern.topk_with_score_function_bwd(m, s, gl, **bk)
    rdx = host(ref.topk_with_score_function_bwd(m, s, gl, **bk))
    assert_close(dx, rdx, "grads", np_dtype(dtype), E=m.shape[-1], err_msg=f"grad {bk}")
    return dx


def check_special_rows(kern, x, k, pre, sf, first_selected):
    """Rows of -inf, NaN and fillers: kernel vs reference forward.

    For sigmoid / sqrtsoftplus the -inf logits become -30 first (the same
    ranks, finite activations).  Checks exactly K per row, the map, the NaN
    pattern and values of probs and saved, and (outside softmax-pre) that
    the first rows select ``first_selected``.  Returns the kernel's
    ``(probs, map, saved)``.
    """
    if sf != "softmax":
        x = np.where(np.isneginf(x), np.float32(-30.0), x)
    p, m, s = kern.topk_with_score_function_fwd(x, k, pre, score_function=sf)
    rp, rm, rs = (host(a) for a in ref.topk_with_score_function_fwd(x, k, pre, score_function=sf))
    assert (m.sum(-1) == k).all()
    np.testing.assert_array_equal(m, rm)
    if not pre:
        got = [np.flatnonzero(r).tolist() for r in m[:len(first_selected)]]
        assert got == first_selected
    np.testing.assert_array_equal(np.isnan(p), np.isnan(rp))
    np.testing.assert_allclose(p, rp, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(s, rs, atol=1e-6, rtol=1e-5)
    return p, m, s


def cfg(T, E, k, sf="softmax", pre=False, G=-1, Kg=-1, scale=1.0, bias=False, dtype="float32"):
    return RouterConfig(num_tokens=T, num_experts=E, topk=k, use_pre_softmax=pre,
                        num_groups=G, group_topk=Kg, scaling_factor=scale,
                        score_function=sf, expert_bias=bias, dtype=dtype)


def bias(E, seed=0):
    return ((np.random.default_rng(seed).integers(-32, 33, E)) / 64).astype(np.float32)


def sel(m):
    return [np.flatnonzero(r).tolist() for r in np.asarray(m)]


def tie_free(T, E, seed):
    rng = np.random.default_rng(seed)
    return np.stack([(rng.permutation(E) - E // 2) / 8 for _ in range(T)]).astype(np.float32)


def check_specials(x, k, first_row_selected, kern=None):
    """Ties, -inf, NaN and all -inf rows: map, NaN pattern and scores equal the
    reference's, exactly K per row, ties of row 0 to the lower indices (``kern``:
    ``gpurouter.kernels`` (None) or a tiling fixture's ``Tiled``)."""
    if kern is None:
        import gpurouter.kernels as kern
    for sf in ("softmax", "sigmoid"):
        sc, m, _ = kern.score_for_aux_loss_fwd(x, k, sf)
        rsc, rm, _ = (host(a) for a in ref.score_for_aux_loss_fwd(x, k, sf))
        assert (m.sum(-1) == k).all()
        np.testing.assert_array_equal(m, rm)
        np.testing.assert_array_equal(np.isnan(sc), np.isnan(rsc))
        np.testing.assert_allclose(sc, rsc, atol=1e-6, rtol=1e-5)
        assert np.flatnonzero(m[0]).tolist() == first_row_selected
