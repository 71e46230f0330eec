""":func:`check_router_z_loss`: the router z-loss of ST-MoE."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from .. import oracle
from ..strategies import (
    DTYPES,
    as_jnp,
    z_loss_logits,
)
from ._compare import (
    _arr,
    _call,
    _close,
    _scalar,
    _scalar_vjp,
)
from ._draws import MAX_EXPERTS, draw_loss_cotangent
from ._report import CheckReport, _run, _Skip, _Violation

# ----------------------------------------------------------------------------
# check_router_z_loss
# ----------------------------------------------------------------------------


def _z_ctx(x, dtype, coeff, extra="", shape=None) -> str:
    shape = list(np.shape(x)) if shape is None else list(shape)
    return "\n".join([f"config: fn(logits={dtype}{shape}, coeff={coeff})",
                      "smallest counterexample (hypothesis):", f"  logits = {_arr(x)}"] + ([extra] if extra else []))


def _z_close(got, want, coeff, what="loss") -> str | None:
    got = float(np.asarray(got, np.float32))
    bound = 1e-5 * abs(want) + 1e-6 * abs(coeff)
    if not abs(got - want) <= bound:  # NaN fails
        return f"{what}: |got - expected| = {abs(got - want)!r} > bound {bound!r}; expected {want!r}, got {got!r}"
    return None


def check_router_z_loss(fn, *, max_examples: int = 100, dtypes: Sequence[str] = DTYPES, grads: bool = True,
                        seed=None, properties: Sequence[str] | None = None) -> CheckReport:
    """Checks the router z-loss of ST-MoE (``coeff * sum_t lse_t^2 / T``, float32).

    ``fn(logits, coeff)`` takes ``[..., E]`` logits (every leading dim a token)
    and returns a float32 scalar; a row of all ``-inf`` contributes 0 and gets a
    zero gradient (finite), and still counts in ``T``.

    Properties (``max_examples`` each): value and dtype (``-inf`` masks and
    all-``-inf`` rows included); gradient (``grads``); ``jit`` and leading dims.
    """
    dtypes = tuple(dtypes)
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"check_router_z_loss: dtypes must be among {DTYPES}; got {dtypes}")

    def draw(data):
        return data.draw(z_loss_logits(max_tokens=6, max_experts=MAX_EXPERTS, dtypes=dtypes), label="inputs")

    def values():
        def body(data):
            x, dtype, coeff = draw(data)
            ctx = _z_ctx(x, dtype, coeff)
            loss = _scalar(_call(fn, (as_jnp(x, dtype), coeff), ctx), np.float32, ctx)
            msg = _z_close(loss, oracle.z_loss(x, coeff), coeff)
            if msg:
                raise _Violation(f"{ctx}\n{msg}")
        return body

    def gradient():
        if not grads:
            raise _Skip("grads=False")

        def body(data):
            x, dtype, coeff = draw(data)
            g = draw_loss_cotangent(data)
            ctx = _z_ctx(x, dtype, coeff, f"  cotangent of the loss = {g}")
            dx = _scalar_vjp(lambda a: fn(a, coeff), as_jnp(x, dtype), np.float32, g, ctx, "grad_logits", dtype)
            want = g * oracle.z_loss_grad(x, coeff)
            msg = _close(dx, want, "grads", dtype, E=x.shape[1], what="grad_logits")
            if msg:
                raise _Violation(f"{ctx}\n{msg}")
        return body

    def transforms():
        def body(data):
            x, dtype, coeff = draw(data)
            want = oracle.z_loss(x, coeff)
            ctx = _z_ctx(x, dtype, coeff, "  under jax.jit")
            out = _scalar(_call(jax.jit(lambda a: fn(a, coeff)), (as_jnp(x, dtype),), ctx), np.float32, ctx)
            msg = _z_close(out, want, coeff)
            if msg:
                raise _Violation(f"{ctx}\n{msg}")
            t = x.shape[0]
            if t % 2 == 0:
                shape = (2, t // 2, x.shape[1])
                ctx = _z_ctx(x, dtype, coeff, f"  with leading dims {shape}", shape=shape)
                out = _scalar(_call(jax.jit(lambda a: fn(a, coeff)), (as_jnp(x.reshape(shape), dtype),), ctx),
                              np.float32, ctx)
                msg = _z_close(out, want, coeff)
                if msg:
                    raise _Violation(f"{ctx}\n{msg}")
        return body

    props = [("value and dtype", values), ("gradient", gradient), ("jit, leading dims", transforms)]
    return _run("check_router_z_loss", props, properties, max_examples, seed)
