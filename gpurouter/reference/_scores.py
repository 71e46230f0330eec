"""The score functions of the router reference, in fp32, and the row
normalisation of the weights, each with its derivative written out.

:func:`sqrtsoftplus` and :func:`_normalise_rows` carry a ``jax.custom_jvp``
(docs/contract.md section 3) so that plain autodiff of the reference is the
kernels' backward; :func:`_activation_and_grad` and :func:`_normalised_grad`
are the same derivatives written by hand for the low-level ``*_bwd``
functions of :mod:`gpurouter.reference.topk`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._checks import ScoreFunction

EPS = 1e-20  # TE's epsilon in every normalisation denominator
SOFTPLUS_THRESHOLD = 20.0  # softplus(x) = x above this (PyTorch's threshold)


def sigmoid(x: jax.Array) -> jax.Array:
    """``1 / (1 + exp(-x))`` with derivative ``a (1 - a)``."""
    return jax.nn.sigmoid(x)


@jax.custom_jvp
def sqrtsoftplus(x: jax.Array) -> jax.Array:
    """``sqrt(softplus(x))``, softplus taking ``x`` itself above 20, and
    ``exp(x / 2)`` below -20.

    Its derivative is docs/contract.md section 3's: ``sigmoid(x) / (2 v + eps)`` for
    ``x <= 20`` and ``1 / (2 v + eps)`` above (the ``eps`` keeps it finite
    where ``v`` underflows to 0).
    """
    big = x > SOFTPLUS_THRESHOLD
    tiny = x < -SOFTPLUS_THRESHOLD
    safe = jnp.where(big, jnp.zeros_like(x), x)  # keeps exp() finite in the unused branch
    # below -20 softplus(x) = exp(x) to fp32 rounding, and sqrt(exp(x)) = exp(x / 2)
    # stays a normal number down to x = -174.6 where exp(x) is subnormal below
    # -87.3 (flushed to 0 by XLA:CPU): docs/contract.md section 2
    return jnp.where(tiny, jnp.exp(x * 0.5), jnp.sqrt(jnp.where(big, x, jnp.log1p(jnp.exp(safe)))))


@sqrtsoftplus.defjvp
def _sqrtsoftplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    v = sqrtsoftplus(x)
    return v, t * sqrtsoftplus_grad(x, v)


def sqrtsoftplus_grad(x: jax.Array, v: jax.Array) -> jax.Array:
    """``d sqrtsoftplus / dx`` given ``v = sqrtsoftplus(x)``."""
    num = jnp.where(x > SOFTPLUS_THRESHOLD, jnp.ones_like(x), sigmoid(x))
    return num / (2 * v + EPS)


def _activation(x: jax.Array, sf: ScoreFunction) -> jax.Array:
    return sigmoid(x) if sf == ScoreFunction.SIGMOID else sqrtsoftplus(x)


def _normalise(v: jax.Array, mask: jax.Array | None) -> jax.Array:
    """``v / (sum v + eps)`` over the row, restricted to ``mask`` when given."""
    if mask is not None:
        v = jnp.where(mask, v, 0)
    return _normalise_rows(v)


@jax.custom_jvp
def _normalise_rows(v: jax.Array) -> jax.Array:
    """``v / (sum v + eps)`` over the last axis.

    Its derivative is written as ``(dv - t sum dv) / (S + eps)`` with
    ``t = v / (S + eps)``: autodiff of the quotient would form ``(S + eps)^2``,
    which underflows to 0 when every ``v`` is 0 (a row of -inf logits under
    sigmoid / sqrtsoftplus: ``S + eps = 1e-20``) and turned ``0 / 0`` into NaN
    gradients where the true derivative (and the kernels') is 0.
    """
    return v / (jnp.sum(v, axis=-1, keepdims=True) + EPS)


@_normalise_rows.defjvp
def _normalise_rows_jvp(primals, tangents):
    (v,), (dv,) = primals, tangents
    inv = 1 / (jnp.sum(v, axis=-1, keepdims=True) + EPS)
    t = v * inv
    return t, (dv - t * jnp.sum(dv, axis=-1, keepdims=True)) * inv


def _activation_and_grad(saved: jax.Array, sf: ScoreFunction):
    """``(v, dv/dx)`` from the saved intermediate (sigmoid(x), or x for sqrtsoftplus)."""
    if sf == ScoreFunction.SIGMOID:
        return saved, saved * (1 - saved)
    v = sqrtsoftplus(saved)
    return v, sqrtsoftplus_grad(saved, v)


def _normalised_grad(a, da, g, m, normalise: bool):
    """Backward of ``t = m a / (sum_m a + eps)`` (or ``t = m a``), times ``da``."""
    # masked after the product: an expert off the map gets exactly 0, even
    # where its logit (so da) is NaN (docs/contract.md section 2, "Edges")
    if not normalise:
        return jnp.where(m, g * da, 0)
    am = jnp.where(m, a, 0)
    s = jnp.sum(am, axis=-1, keepdims=True) + EPS
    d = jnp.sum(jnp.where(m, g, 0) * am, axis=-1, keepdims=True)
    # (g - d / s) / s, not g / s - d / s^2: s^2 underflows to 0 when every a
    # is 0 (s = eps), and d / 0 would be NaN (see _normalise_rows)
    return jnp.where(m, (g - d / s) / s * da, 0)
