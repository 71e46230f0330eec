"""The jnp reference of the switch aux loss against the NumPy oracle (docs/contract.md section 4)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.test_util import check_grads

from gpurouter import reference as ref
from gpurouter.testing import oracle as oracles
from gpurouter.testing.strategies import AuxLossConfig, as_jnp, aux_loss_configs, aux_loss_inputs, np_dtype
from gpurouter.testing.tolerances import assert_close, assert_dtype


@functools.lru_cache(maxsize=256)
def _bundle(key: tuple):
    kw = dict(key)

    def run(probs, tpe, g):
        loss, c = ref.moe_aux_loss_fwd(probs, tpe, **kw)
        p_loss = ref.fused_moe_aux_loss(probs, tpe, **kw)
        dp = ref.moe_aux_loss_bwd(c, tpe, g, probs.shape[0])
        _, pullback = jax.vjp(lambda p, t: ref.fused_moe_aux_loss(p, t, **kw), probs, tpe)
        vjp_dp, vjp_dt = pullback(g)
        return loss, c, p_loss, dp, vjp_dp, vjp_dt

    return jax.jit(run)


def check_against_oracle(cfg: AuxLossConfig, probs: np.ndarray, tpe: np.ndarray, g: float):
    pj = as_jnp(probs, cfg.dtype)
    tj = jnp.asarray(np.asarray(tpe).astype(np_dtype(cfg.tpe_dtype)))
    gj = jnp.asarray(g, pj.dtype)
    loss, c, p_loss, dp, vjp_dp, vjp_dt = _bundle(tuple(sorted(cfg.kwargs().items())))(pj, tj, gj)
    e_loss, e_c = oracles.aux_loss_fwd(probs, tpe, **cfg.kwargs())
    assert_dtype(loss, cfg.dtype, "loss")
    assert_dtype(c, np.float32, "saved coeff")
    assert loss.shape == ()
    assert_close(loss, e_loss, "aux_loss", cfg.dtype, err_msg=f"loss {cfg}")
    assert_close(c, e_c, "aux_loss", "float32", err_msg=f"C {cfg}")
    np.testing.assert_array_equal(np.asarray(p_loss, np.float32), np.asarray(loss, np.float32))
    e_dp = oracles.aux_loss_bwd(e_c, tpe, float(np.float32(gj)), cfg.num_tokens)
    assert_dtype(dp, cfg.dtype, "grad_probs")
    assert_close(dp, e_dp, "grads", cfg.dtype, E=cfg.num_cols, err_msg=f"bwd {cfg}")
    assert_close(vjp_dp, dp, "grads", cfg.dtype, E=cfg.num_cols, err_msg=f"vjp {cfg}")
    # tokens_per_expert gets no gradient (float0 for integer counts)
    if jnp.issubdtype(tj.dtype, jnp.floating):
        np.testing.assert_array_equal(np.asarray(vjp_dt, np.float32), 0.0)


@given(st.data())
def test_aux_loss_matches_oracle(data):
    cfg = data.draw(aux_loss_configs(), label="cfg")
    probs, tpe = data.draw(aux_loss_inputs(cfg), label="inputs")
    g = data.draw(st.sampled_from([1.0, -0.5, 3.0]), label="grad_loss")
    check_against_oracle(cfg, probs, tpe, g)


def _cfg(**kw) -> AuxLossConfig:
    base = dict(num_tokens=6, num_experts=4, seq_blocks=1, topk=2, coeff=1e-2,
                total_num_tokens=None, pass_num_experts=False, dtype="float32",
                tpe_dtype="int32")
    cfg = AuxLossConfig(**{**base, **kw})
    cfg.check()
    return cfg


def _inputs(cfg: AuxLossConfig, seed: int = 0):
    rng = np.random.default_rng(seed)
    probs = rng.uniform(0, 1, (cfg.num_tokens, cfg.num_cols)).astype(np.float32)
    probs = probs.astype(np_dtype(cfg.dtype)).astype(np.float32)
    return probs, rng.integers(0, 20, cfg.num_cols).astype(np.float32)


def test_sequence_aux_loss_c_is_b_times_e():
    # C = B * E columns with num_experts = E: C uses E, not the column count.
    cfg = _cfg(num_experts=4, seq_blocks=3, pass_num_experts=True)
    probs, tpe = _inputs(cfg)
    check_against_oracle(cfg, probs, tpe, 1.0)
    loss = ref.fused_moe_aux_loss(jnp.asarray(probs), jnp.asarray(tpe, jnp.int32), 2, 1e-2,
                                  num_experts=4)
    loss_c = ref.fused_moe_aux_loss(jnp.asarray(probs), jnp.asarray(tpe, jnp.int32), 2, 1e-2)
    np.testing.assert_allclose(float(loss_c), 3 * float(loss), rtol=1e-5)


@pytest.mark.parametrize("total", [1, 7, 1000])
def test_total_num_tokens_differs_from_rows(total):
    cfg = _cfg(total_num_tokens=total)
    probs, tpe = _inputs(cfg)
    check_against_oracle(cfg, probs, tpe, 2.0)


@pytest.mark.parametrize("tpe_dtype", ["int32", "int64", "float32", "bfloat16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_tokens_per_expert_dtypes(tpe_dtype, dtype):
    cfg = _cfg(tpe_dtype=tpe_dtype, dtype=dtype)
    probs, tpe = _inputs(cfg, seed=1)
    if tpe_dtype == "int64":
        with jax.enable_x64(True):  # int64 exists only under x64
            tj = jnp.asarray(tpe.astype(np.int64))
            assert tj.dtype == jnp.int64
            loss = ref.fused_moe_aux_loss(as_jnp(probs, dtype), tj, cfg.topk, cfg.coeff)
            assert_dtype(loss, dtype, "loss")
            assert_close(loss, oracles.aux_loss_fwd(probs, tpe, cfg.topk, cfg.coeff)[0],
                         "aux_loss", dtype)
    else:
        check_against_oracle(cfg, probs, tpe, 1.0)


def test_aux_loss_is_deterministic():
    cfg = _cfg(num_tokens=64, num_experts=32, topk=4)
    probs, tpe = _inputs(cfg, seed=2)
    pj, tj = jnp.asarray(probs), jnp.asarray(tpe, jnp.int32)
    first = np.asarray(ref.fused_moe_aux_loss(pj, tj, 4, 1e-2))
    f = jax.jit(functools.partial(ref.fused_moe_aux_loss, topk=4, coeff=1e-2))
    for _ in range(3):
        assert np.asarray(ref.fused_moe_aux_loss(pj, tj, 4, 1e-2)).tobytes() == first.tobytes()
        assert np.asarray(f(pj, tj)).tobytes() == np.asarray(f(pj, tj)).tobytes()


def test_check_grads_float64():
    cfg = _cfg(seq_blocks=2, pass_num_experts=True, total_num_tokens=10)
    probs, tpe = _inputs(cfg, seed=3)
    with jax.enable_x64(True):
        tj = jnp.asarray(tpe, jnp.float32)

        def f(p):
            return ref.fused_moe_aux_loss(p, tj, **cfg.kwargs())

        # linear in probs; computed in float32 inside, hence eps and tolerance
        check_grads(f, (jnp.asarray(probs, jnp.float64),), order=1, modes=["fwd", "rev"],
                    eps=1e-2, atol=1e-4, rtol=1e-4)
