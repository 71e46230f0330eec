"""The experts' whole gated FFN in capacity slots: ``moe(...,
grouped_matmul="slots")``.

With a grouped GEMM of ``jax.lax.ragged_dot``'s signature (say
:func:`~gpurouter.reference.grouped_matmul.batched_ragged_dot`), the block's
three expert GEMMs each gather their rows into slots ``[G, C, .]`` and read
their output rows back, forward and backward: six gathers and six read-backs
around the GEMMs (docs/moe.md measures them at about as much time as the
GEMMs themselves). Here the rows are gathered into slots once, the three
batched GEMMs, the activation, the mask and the routing weight all run on
the slots, and the output is read back once:

    x_s = slots(xs)                                   [G, C, H]
    a_s = x_s @ wi_0 + b0,   b_s = x_s @ wi_1 + b1      [G, C, M]
    h_s = act(a_s) * b_s   (0 on empty slots; times the weight when early)
    z   = rows(h_s @ wo) + bo                         [N, H]

``C`` is the smallest of :func:`~gpurouter.reference.grouped_matmul._capacities`
(rounded up to 8) up to ``SLOTS_MAX_FACTOR`` times the mean group size that
holds the largest group (a ``lax.switch``: one branch runs). When no such
capacity holds it (a skewed routing), the rows stay where they are and the
three GEMMs are :func:`~gpurouter.reference.grouped_matmul.tiled_ragged_dot`
(slots capped, the rest in tiles): no cliff, bounded memory.

The backward is its own (a custom VJP: differentiating through the switch
would keep every branch's slots alive): the forward keeps the two projections
``a`` and ``b`` read back as rows ``[N, M]``; the backward gathers the output
cotangent into the same slots, once, and differentiates the slot FFN from
``a`` and ``b`` (the forward GEMMs are not recomputed), reading ``d xs`` back
once. The values are those of the row-by-row FFN
(:func:`gpurouter.reference.moe._expert_ffn`) on any grouped GEMM, up to the
GEMMs' summation order.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .grouped_matmul import _capacities, _read_back, _round_rows, _take_rows, tiled_ragged_dot

#: the largest slot capacity, as a multiple of the mean group size; a routing
#: whose largest group is past it runs the row-by-row FFN on tiled GEMMs
SLOTS_MAX_FACTOR = 1.5


def slot_capacities(num_rows: int, num_groups: int) -> tuple[int, ...]:
    """The slot capacities a ``[num_rows]`` buffer of ``num_groups`` groups
    may use, smallest first: :func:`_capacities` of the mean group size up to
    ``SLOTS_MAX_FACTOR`` times it."""
    first = max(1, -(-num_rows // num_groups))
    top = -(-math.ceil(first * SLOTS_MAX_FACTOR) // 8) * 8
    return tuple(c for c in _capacities(first) if c <= top)


def slots_expert_ffn(xs, rows_e, group_sizes, w_rows, *, wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias,
                     activation, early: bool, dtype):
    """The block's expert FFN on rows sorted by expert, in slots.

    Args and result as :func:`gpurouter.reference.moe._expert_ffn` (without
    ``align_size``, which changes no value, and ``grouped_matmul``): ``xs [N,
    H]`` (``rows_e [N]`` their experts, ``group_sizes [G]``, ``w_rows [N]``
    their routing weights) -> ``z [N, H]`` in fp32 (at least),
    ``act(x wi_0 + b0) * (x wi_1 + b1) @ wo + bo``, the weight multiplied
    into ``h`` (and ``bo``) when ``early``; rows past ``sum(group_sizes)``
    give 0."""
    params = dict(wi_0=jnp.asarray(wi_0).astype(dtype), wi_1=jnp.asarray(wi_1).astype(dtype),
                  wo=jnp.asarray(wo).astype(dtype),
                  b0=None if wi_0_bias is None else jnp.asarray(wi_0_bias).astype(dtype),
                  b1=None if wi_1_bias is None else jnp.asarray(wi_1_bias).astype(dtype),
                  bo=None if wo_bias is None else jnp.asarray(wo_bias))
    acc = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    del rows_e  # recomputed from the sizes where needed (the same rows)
    return _slot_ffn(jnp.asarray(xs), jnp.asarray(w_rows).astype(acc), params, sizes, (activation, bool(early)))


# --- the layouts: slots of one capacity, or the rows themselves on tiled GEMMs --------------------

class _Slots:
    """Rows <-> slots ``[G, C, .]`` of capacity ``C`` (every group fits)."""

    def __init__(self, sizes, width: int, num_rows: int):
        self.sizes, self.width, self.num_rows = sizes, width, num_rows
        self.rows = _round_rows(sizes, 0, width, num_rows)  # [G, C], num_rows on empty slots
        self.valid = (self.rows < num_rows)[..., None]

    def gather(self, v):
        """Rows ``[N, ...]`` into slots ``[G, C, ...]`` (0 on empty slots)."""
        return _take_rows(v, self.rows)

    def read_back(self, v):
        """Slots ``[G, C, D]`` back to rows ``[N, D]`` (0 past the groups);
        differentiable, its transpose being :meth:`gather`."""
        return _read_back_op(v, self.sizes, self.width, self.num_rows)

    def gmm(self, v, w):
        return jnp.einsum("gcd,gdm->gcm", v, w, preferred_element_type=v.dtype)

    def bias(self, b):
        return b[:, None, :]


class _Rows:
    """The rows as they are, the GEMMs :func:`tiled_ragged_dot`."""

    def __init__(self, sizes, num_rows: int):
        self.sizes = sizes
        ends = jnp.cumsum(sizes)
        i = jnp.arange(num_rows, dtype=jnp.int32)
        self.group = jnp.minimum(jnp.searchsorted(ends, i, side="right"), sizes.shape[0] - 1).astype(jnp.int32)
        self.valid = (i < ends[-1])[:, None]

    def gather(self, v):
        return v

    def read_back(self, v):
        return v

    def gmm(self, v, w):
        return tiled_ragged_dot(v, w, self.sizes)

    def bias(self, b):
        return b[self.group]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _read_back_op(v, sizes, width, num_rows):
    return _read_back(v.reshape(-1, v.shape[-1]), sizes, width, num_rows)


def _read_back_fwd(v, sizes, width, num_rows):
    return _read_back_op(v, sizes, width, num_rows), sizes


def _read_back_bwd(width, num_rows, sizes, d):
    # each filled slot is read by exactly one row, an empty slot by none
    return _take_rows(d, _round_rows(sizes, 0, width, num_rows)), None


_read_back_op.defvjp(_read_back_fwd, _read_back_bwd)


# --- the FFN in a layout, in two halves (the backward differentiates each alone) ------------------

def _head(lay, x_l, p):
    """The two projections ``(a, b)`` in the layout (``p``: ``wi_0``, ``wi_1``,
    ``b0``, ``b1``)."""
    a = lay.gmm(x_l, p["wi_0"])
    b = lay.gmm(x_l, p["wi_1"])
    if p["b0"] is not None:
        a = a + lay.bias(p["b0"]).astype(a.dtype)
    if p["b1"] is not None:
        b = b + lay.bias(p["b1"]).astype(b.dtype)
    return a, b


def _tail(lay, rows, a, b, w_l, w_rows, p, cfg):
    """``z`` rows from the projections in the layout: the activation, the
    mask, the weight (``early``), ``wo``; ``bo`` added on the rows (``p``:
    ``wo``, ``bo``; ``rows``: :class:`_Rows` of the same buffer)."""
    activation, early = cfg
    acc = w_rows.dtype
    h = jnp.where(lay.valid, activation(a) * b, 0)
    if early:
        h = (h.astype(acc) * jnp.where(lay.valid[..., 0], w_l, 0)[..., None]).astype(h.dtype)
    z = lay.read_back(lay.gmm(h, p["wo"])).astype(acc)
    if p["bo"] is not None:
        bo = jnp.where(rows.valid, rows.bias(p["bo"]).astype(acc), 0)
        z = z + (bo * jnp.where(rows.valid[:, 0], w_rows, 0)[:, None] if early else bo)
    return z


def _split(p):
    return {k: p[k] for k in ("wi_0", "wi_1", "b0", "b1")}, {k: p[k] for k in ("wo", "bo")}


def _branches(xs, sizes):
    """One layout maker per ``lax.switch`` branch, the branch index, and the
    rows' own layout."""
    n, g = xs.shape[0], sizes.shape[0]
    caps = slot_capacities(n, g)
    rows = _Rows(sizes, n)
    makers = [functools.partial(_Slots, sizes, c, n) for c in caps] + [lambda: rows]
    branch = jnp.sum(jnp.max(sizes) > jnp.asarray(caps, jnp.int32)).astype(jnp.int32)
    return makers, branch, rows


def _forward(xs, w_rows, p, sizes, cfg):
    makers, branch, rows = _branches(xs, sizes)
    head_p, tail_p = _split(p)

    def run(make):
        lay = make()
        a, b = _head(lay, lay.gather(xs), head_p)
        z = _tail(lay, rows, a, b, lay.gather(w_rows), w_rows, tail_p, cfg)
        return z, lay.read_back(a), lay.read_back(b)

    return lax.switch(branch, [functools.partial(run, m) for m in makers])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _slot_ffn(xs, w_rows, p, sizes, cfg):
    return _forward(xs, w_rows, p, sizes, cfg)[0]


def _slot_ffn_fwd(xs, w_rows, p, sizes, cfg):
    z, a, b = _forward(xs, w_rows, p, sizes, cfg)
    return z, (xs, w_rows, p, sizes, a, b)


def _slot_ffn_bwd(cfg, res, dz):
    xs, w_rows, p, sizes, a_rows, b_rows = res
    makers, branch, rows = _branches(xs, sizes)
    head_p, tail_p = _split(p)

    def run(make):
        lay = make()
        a, b, w_l = lay.gather(a_rows), lay.gather(b_rows), lay.gather(w_rows)
        _, tail_vjp = jax.vjp(lambda a_, b_, wl_, wr_, p_: _tail(lay, rows, a_, b_, wl_, wr_, p_, cfg),
                              a, b, w_l, w_rows, tail_p)
        da, db, dw_l, dw_rows, d_tail = tail_vjp(dz)
        _, head_vjp = jax.vjp(lambda x_, p_: _head(lay, x_, p_), lay.gather(xs), head_p)
        dx_l, d_head = head_vjp((da, db))
        if isinstance(lay, _Slots):  # the slots' cotangents back to rows
            dx_l = lay.read_back(dx_l)
            dw_l = _read_back(dw_l.reshape(-1, 1), sizes, lay.width, xs.shape[0])[:, 0]
        return dx_l, dw_l + dw_rows, {**d_head, **d_tail}

    dxs, dw, dp = lax.switch(branch, [functools.partial(run, m) for m in makers])
    return dxs, dw, dp, None


_slot_ffn.defvjp(_slot_ffn_fwd, _slot_ffn_bwd)

__all__ = ["SLOTS_MAX_FACTOR", "slot_capacities", "slots_expert_ffn"]
