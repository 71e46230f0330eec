""":func:`check_aux_loss`: the MoE aux loss (contract section 4) and its gradient."""

from __future__ import annotations

from collections.abc import Sequence

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis.extra import numpy as hnp

from .. import oracle
from ..strategies import (
    DTYPES,
    as_jnp,
    np_dtype,
)
from ._compare import (
    _arr,
    _call,
    _close,
    _scalar,
    _scalar_vjp,
)
from ._draws import draw_loss_cotangent
from ._report import CheckReport, _run, _Skip, _Violation

# ----------------------------------------------------------------------------
# check_aux_loss
# ----------------------------------------------------------------------------


@st.composite
def _aux_loss_case(draw, dtypes):
    num_tokens = draw(st.integers(1, 8), label="T")
    num_experts = draw(st.integers(1, 16), label="E")
    topk = draw(st.integers(1, num_experts), label="topk")
    coeff = draw(st.sampled_from([1e-2, 1.0, 0.5, 2.0]), label="coeff")
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    tpe_dtype = draw(st.sampled_from(["int32", "float32"]), label="tokens_per_expert dtype")
    probs = draw(hnp.arrays(
        np.float32, (num_tokens, num_experts), elements=st.floats(0, 1, width=16, allow_subnormal=False)))
    probs = probs.astype(np_dtype(dtype)).astype(np.float32)
    tpe = draw(hnp.arrays(np.int32, (num_experts,), elements=st.integers(0, 64)))
    return probs, tpe, topk, coeff, dtype, tpe_dtype


def _aux_loss_ctx(probs, tpe, topk, coeff, dtype, tpe_dtype, extra="") -> str:
    t, e = probs.shape
    return "\n".join([f"config: fn(probs={dtype}[{t}, {e}], tokens_per_expert={tpe_dtype}[{e}], topk={topk}, "
                      f"coeff={coeff})", "smallest counterexample (hypothesis):", f"  probs = {_arr(probs)}",
                      f"  tokens_per_expert = {np.asarray(tpe).tolist()}"] + ([extra] if extra else []))


def check_aux_loss(fn, *, max_examples: int = 100, dtypes: Sequence[str] = DTYPES, grads: bool = True,
                   seed=None, properties: Sequence[str] | None = None) -> CheckReport:
    """Checks the MoE aux loss (contract section 4) and its gradient.

    ``fn(probs, tokens_per_expert, topk, coeff)`` must return a scalar of the
    dtype of ``probs``: ``C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c]``
    with ``C = E * coeff / (topk * T * T)``, ``T`` = rows and ``E`` = columns of
    ``probs``; its gradient with respect to ``probs`` is ``C * tokens_per_expert[c]``
    times the cotangent (none to the counts).

    Properties (``max_examples`` each): value and dtype; gradient (``grads``);
    ``jit``.
    """
    dtypes = tuple(dtypes)
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"check_aux_loss: dtypes must be among {DTYPES}; got {dtypes}")

    def draw_case(data):
        return data.draw(_aux_loss_case(dtypes), label="inputs")

    def args_of(case):
        probs, tpe, topk, coeff, dtype, tpe_dtype = case
        return as_jnp(probs, dtype), jnp.asarray(tpe.astype(tpe_dtype)), topk, coeff

    def value_check(case, out, ctx):
        probs, tpe, topk, coeff, dtype, _ = case
        loss = _scalar(out, np_dtype(dtype), ctx)
        want, _ = oracle.aux_loss_fwd(probs, tpe, topk, coeff)
        msg = _close(np.asarray(loss.astype(jnp.float32)), np.float64(want), "aux_loss", dtype, what="loss")
        if msg:
            raise _Violation(f"{ctx}\n{msg}")

    def values():
        def body(data):
            case = draw_case(data)
            ctx = _aux_loss_ctx(*case)
            value_check(case, _call(fn, args_of(case), ctx), ctx)
        return body

    def gradient():
        if not grads:
            raise _Skip("grads=False")

        def body(data):
            case = draw_case(data)
            probs, tpe, topk, coeff, dtype, _ = case
            g = draw_loss_cotangent(data)
            ctx = _aux_loss_ctx(*case, extra=f"  cotangent of the loss = {g}")
            a, n, k, c = args_of(case)
            dp = _scalar_vjp(lambda p: fn(p, n, k, c), a, np_dtype(dtype), g, ctx, "grad_probs", dtype)
            _, cc = oracle.aux_loss_fwd(probs, tpe, topk, coeff)
            want = oracle.aux_loss_bwd(cc, tpe, g, probs.shape[0])
            msg = _close(dp, want, "grads", dtype, E=probs.shape[1], what="grad_probs")
            if msg:
                raise _Violation(f"{ctx}\n{msg}")
        return body

    def jitted():
        def body(data):
            case = draw_case(data)
            ctx = _aux_loss_ctx(*case, extra="  under jax.jit")
            a, n, k, c = args_of(case)
            value_check(case, _call(jax.jit(lambda p, q: fn(p, q, k, c)), (a, n), ctx), ctx)
        return body

    props = [("value and dtype", values), ("gradient", gradient), ("jit", jitted)]
    return _run("check_aux_loss", props, properties, max_examples, seed)
