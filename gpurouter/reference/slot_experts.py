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

``C`` is the smallest of ``batched_ragged_dot``'s capacities (multiples of 8)
up to ``SLOTS_MAX_FACTOR`` (1.5) times the mean group size that
holds the largest group (a ``lax.switch``: one branch runs). When none holds
it (a skewed routing), every group's first ``C`` rows (the largest ``C``) go
to the slots and the rows past them to ``TILE``-row tiles of one expert
each, the whole FFN per tile, ``CHUNK`` tiles at a time in a loop over the
chunks that have rows (each tile gathers its expert's weights): no cliff,
bounded memory, as :func:`~gpurouter.reference.grouped_matmul.tiled_ragged_dot`.

The block (:func:`slots_token_ffn`) goes further: it fills the slots straight
from the tokens ``[T, H]`` and sums the slots straight back into them, so
neither the ``[T K, H]`` rows nor a dispatch or combine exist, forward or
backward (gpurouter/reference/slot_frame.py: the rows or the tokens as the
FFN's input and output). :func:`slots_expert_ffn` keeps the rows (expert
parallelism, whose rows come from other devices).

The backward is its own (a custom VJP: differentiating through the switch
would keep every branch's slots alive): the forward keeps the two projections
``a`` and ``b`` read back as rows ``[N, M]``; the backward gathers the output
cotangent into the same slots, once, and differentiates the slot FFN from
``a`` and ``b`` (the forward GEMMs are not recomputed), reading ``d xs`` back
once; the tiles' FFN is differentiated tile by tile (its forward recomputed,
a few tiles). The values are those of the row-by-row FFN
(:func:`gpurouter.reference.moe._expert_ffn`) on any grouped GEMM, up to the
GEMMs' summation order (and the tiles' weight gradients added into the
slots' in the weights' dtype).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .grouped_matmul import TILED_MAX_FACTOR, _round_rows, _take_rows, _tile_plan, _tiled_capacities
from .slot_frame import Frame, read_back_op

#: the largest slot capacity, as a multiple of the mean group size (as for
#: tiled_ragged_dot's slots); the rows of a group past it go to tiles
SLOTS_MAX_FACTOR = TILED_MAX_FACTOR
#: rows of a tile (one expert's), and tiles per step of the tiles' loop
TILE, CHUNK = 128, 8


def slot_capacities(num_rows: int, num_groups: int) -> tuple[int, ...]:
    """The slot capacities a ``[num_rows]`` buffer of ``num_groups`` groups
    may use, smallest first: ``tiled_ragged_dot``'s, the capacities of
    ``batched_ragged_dot`` for the mean group size up to
    ``SLOTS_MAX_FACTOR`` times it."""
    return _tiled_capacities(max(1, -(-num_rows // num_groups)))


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
    acc = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    p = _params(wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias, dtype)
    return _slots_or_none(jnp.asarray(xs), jnp.asarray(w_rows).astype(acc), p, sizes,
                          jnp.asarray(rows_e).astype(jnp.int32), None, (activation, bool(early)))


def slots_token_ffn(xf, idx, weights, *, wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias, activation, dtype):
    """The block's expert FFN and combine from tokens to tokens, in slots:
    no ``[T K, H]`` rows at all.

    ``xf [T, H]`` tokens, ``idx [T, K]`` their experts (distinct in a row),
    ``weights [T, K]`` their routing weights -> ``[T, H]`` in fp32 (at
    least), ``sum_k (w_tk act(x wi_0 + b0) * (x wi_1 + b1)) @ wo_e + w_tk
    bo_e``: the dispatch and the weighted combine around the FFN, the slots
    filled straight from the tokens and summed straight back into them
    (forward and backward). The weight always multiplies ``h`` before ``wo``
    (``apply_topk_weights_early``; without it the block's value is the same
    function, rounded once more at bf16). The rows behind the slots are the
    pairs sorted by expert, stable (the argsort dispatch's order)."""
    idx = jnp.asarray(idx).astype(jnp.int32)
    t, k = idx.shape
    n = t * k
    acc = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # row -> pair
    sizes = jnp.bincount(flat, length=jnp.shape(wi_0)[0]).astype(jnp.int32)
    pair_row = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32)).reshape(t, k)
    w_rows = jnp.asarray(weights).astype(acc).reshape(-1)[order]
    p = _params(wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias, dtype)
    return _slots_or_none(jnp.asarray(xf), w_rows, p, sizes, flat[order], (order // k, pair_row), (activation, True))


def _slots_or_none(x, w_rows, p, sizes, rows_e, tokens, cfg):
    """:func:`_slot_ffn`, or its zero output (``x``'s shape, ``w_rows``' dtype) when there
    are no rows at all (no tokens): no slot to fill, and the slots' gathers need a row."""
    if rows_e.shape[0] == 0:
        return jnp.zeros(x.shape, w_rows.dtype)
    return _slot_ffn(x, w_rows, p, sizes, rows_e, tokens, cfg)


def _params(wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias, dtype):
    return dict(wi_0=jnp.asarray(wi_0).astype(dtype), wi_1=jnp.asarray(wi_1).astype(dtype),
                wo=jnp.asarray(wo).astype(dtype),
                b0=None if wi_0_bias is None else jnp.asarray(wi_0_bias).astype(dtype),
                b1=None if wi_1_bias is None else jnp.asarray(wi_1_bias).astype(dtype),
                bo=None if wo_bias is None else jnp.asarray(wo_bias))


# --- the slots of one capacity, and the rows (for the biases on rows) -----------------------------

class _Slots:
    """Rows <-> slots ``[G, C, .]``: every group's first ``C`` rows (all of
    them unless ``capped``); ``frame``: where the ``[., H]`` arrays live."""

    def __init__(self, sizes, width: int, frame: Frame, capped: bool = False):
        self.sizes, self.width, self.frame, self.capped = sizes, width, frame, capped
        self.num_rows = frame.num_rows
        self.rows = _round_rows(sizes, 0, width, self.num_rows)  # [G, C], num_rows on empty slots
        self.valid = (self.rows < self.num_rows)[..., None]
        self.rows_in = frame.index(self.rows)  # each slot's place in the frame's input (rows or tokens)

    def gather(self, v):
        """Rows ``[N, ...]`` into slots ``[G, C, ...]`` (0 on empty slots)."""
        return _take_rows(v, self.rows)

    def gather_in(self, v):
        """The frame's input (rows or tokens) into slots ``[G, C, D]``."""
        return _take_rows(v, self.rows_in)

    def read_back(self, v):
        """Slots ``[G, C, D]`` back to rows ``[N, D]`` (0 past the groups, and
        past the slots when ``capped``); differentiable, its transpose being
        :meth:`gather`."""
        return read_back_op(v, self.sizes, self.width, self.num_rows, self.capped)

    def out(self, v, dtype):
        """Slots ``[G, C, D]`` to the frame's output (rows, or tokens summed)."""
        return self.frame.out(v, self.rows_in, self.sizes, self.width, self.capped, dtype)

    def gmm(self, v, w):
        return jnp.einsum("gcd,gdm->gcm", v, w, preferred_element_type=v.dtype)

    def bias(self, b):
        return b[:, None, :]


class _Rows:
    """Each row's group (``rows_e``) and whether it is in one (``valid [N, 1]``)."""

    def __init__(self, sizes, rows_e):
        self.group = rows_e
        self.valid = (jnp.arange(rows_e.shape[0], dtype=jnp.int32) < jnp.sum(sizes, dtype=jnp.int32))[:, None]

    def bias(self, b):
        return b[self.group]


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


def _hidden(valid, a, b, w_l, cfg):
    """``act(a) * b``, 0 on empty slots, times the weight when ``early``."""
    activation, early = cfg
    h = jnp.where(valid, activation(a) * b, 0)
    if early:
        h = (h.astype(w_l.dtype) * jnp.where(valid[..., 0], w_l, 0)[..., None]).astype(h.dtype)
    return h


def _tail(lay, rows, a, b, w_l, w_rows, p, cfg):
    """The output (rows or tokens: ``lay.frame``) from the projections in the
    slots: the hidden rows, ``wo``; ``bo`` added on the output (``p``:
    ``wo``, ``bo``; ``rows``: :class:`_Rows` of the same buffer)."""
    z = lay.out(lay.gmm(_hidden(lay.valid, a, b, w_l, cfg), p["wo"]), w_rows.dtype)
    if p["bo"] is not None:
        z = z + lay.frame.out_bias(p["bo"], w_rows, rows, cfg[1])
    return z


def _split(p):
    return {k: p[k] for k in ("wi_0", "wi_1", "b0", "b1")}, {k: p[k] for k in ("wo", "bo")}


# --- the tiles: a group's rows past the largest capacity ------------------------------------------

class _Tiles:
    """``[B, TILE]`` rows of one group a tile (``num_rows``: no row)."""

    def __init__(self, rows, num_rows: int):
        self.valid = (rows < num_rows)[..., None]

    def gmm(self, v, w):
        return jnp.einsum("btd,bdm->btm", v, w, preferred_element_type=v.dtype)

    def bias(self, b):
        return b[:, None, :]


TILE_KEYS = ("wi_0", "wi_1", "wo", "b0", "b1")  # bo is added on the rows, with the slots'


def _tile_ffn(tiles, x_t, w_t, pt, cfg):
    """The FFN of a chunk of tiles, each with its group's weights ``pt``
    (``[B, ...]``): ``[B, TILE, H]`` in ``w_t``'s dtype, without ``bo``."""
    a, b = _head(tiles, x_t, pt)
    return tiles.gmm(_hidden(tiles.valid, a, b, w_t, cfg), pt["wo"]).astype(w_t.dtype)


def _tile_steps(x, w_rows, p, sizes, base: int, frame: Frame):
    """The tiles past the first ``base`` rows of every group: a function of a
    chunk number giving ``(tiles, at [B * TILE] (the rows' places in the
    frame's input and output), rows [B, TILE], x_t, w_t, pt, groups)``, and the
    number of chunks with tiles."""
    n = frame.num_rows
    chunk_of, num = _tile_plan(sizes, base, TILE, CHUNK, n)

    def step(c):
        groups, rows = chunk_of(c)
        at = frame.index(rows)
        pt = {k: None if p[k] is None else jnp.take(p[k], groups, axis=0) for k in TILE_KEYS}
        return _Tiles(rows, n), at.reshape(-1), rows, _take_rows(x, at), _take_rows(w_rows, rows), pt, groups

    return step, num


def _tiles_forward(z, x, w_rows, p, sizes, base: int, frame: Frame, cfg):
    steps, num = _tile_steps(x, w_rows, p, sizes, base, frame)

    def body(c, z):
        tiles, at, _, x_t, w_t, pt, _ = steps(c)
        y = _tile_ffn(tiles, x_t, w_t, pt, cfg)
        return z.at[at].add(y.reshape(-1, y.shape[-1]).astype(z.dtype), mode="drop")

    return lax.fori_loop(0, num, body, z)


def _tiles_backward(state, x, w_rows, p, sizes, base: int, frame: Frame, dz, cfg):
    """``(d x, d w_rows, d params)`` with the tiles' parts added: their rows'
    (or tokens') ``d x``, their ``d w_rows`` and the groups' weight gradients."""
    steps, num = _tile_steps(x, w_rows, p, sizes, base, frame)
    keys = [k for k in TILE_KEYS if p[k] is not None]

    def body(c, carry):
        dx, dw, dp = carry
        tiles, at, rows, x_t, w_t, pt, groups = steps(c)
        _, vjp = jax.vjp(lambda x_, w_, p_: _tile_ffn(tiles, x_, w_, p_, cfg), x_t, w_t, pt)
        dx_t, dw_t, dpt = vjp(_take_rows(dz, at.reshape(rows.shape)).astype(w_t.dtype))
        dx = dx.at[at].add(dx_t.reshape(-1, dx_t.shape[-1]).astype(dx.dtype), mode="drop")
        dw = dw.at[rows.reshape(-1)].add(dw_t.reshape(-1), mode="drop")
        return dx, dw, {**dp, **{k: dp[k].at[groups].add(dpt[k].astype(dp[k].dtype)) for k in keys}}

    return lax.fori_loop(0, num, body, state)


# --- the switch over the capacities, and the custom VJP -------------------------------------------

def _branches(sizes, rows_e, tokens):
    """``(width, tiles)`` per ``lax.switch`` branch, the branch index, the
    rows' layout and the frame: each capacity alone, then the largest with
    tiles."""
    n = rows_e.shape[0]
    caps = slot_capacities(n, sizes.shape[0])
    branch = jnp.sum(jnp.max(sizes) > jnp.asarray(caps, jnp.int32)).astype(jnp.int32)
    return [(c, False) for c in caps] + [(caps[-1], True)], branch, _Rows(sizes, rows_e), Frame(tokens, rows_e, n)


def _forward(x, w_rows, p, sizes, rows_e, tokens, cfg):
    plans, branch, rows, frame = _branches(sizes, rows_e, tokens)
    head_p, tail_p = _split(p)

    def run(width, tiles):
        lay = _Slots(sizes, width, frame, capped=tiles)
        a, b = _head(lay, lay.gather_in(x), head_p)
        z = _tail(lay, rows, a, b, lay.gather(w_rows), w_rows, tail_p, cfg)
        if tiles:
            z = _tiles_forward(z, x, w_rows, p, sizes, width, frame, cfg)
        return z, lay.read_back(a), lay.read_back(b)

    return lax.switch(branch, [functools.partial(run, *plan) for plan in plans])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _slot_ffn(x, w_rows, p, sizes, rows_e, tokens, cfg):
    """The FFN from ``x`` (rows ``[N, H]``, or tokens ``[T, H]`` with
    ``tokens``) to the output in the same frame, in fp32 (at least)."""
    return _forward(x, w_rows, p, sizes, rows_e, tokens, cfg)[0]


def _slot_ffn_fwd(x, w_rows, p, sizes, rows_e, tokens, cfg):
    z, a, b = _forward(x, w_rows, p, sizes, rows_e, tokens, cfg)
    return z, (x, w_rows, p, sizes, rows_e, tokens, a, b)


def _slot_ffn_bwd(cfg, res, dz):
    x, w_rows, p, sizes, rows_e, tokens, a_rows, b_rows = res
    plans, branch, rows, frame = _branches(sizes, rows_e, tokens)
    head_p, tail_p = _split(p)
    # rows: d x in x's dtype, as the read-back gives it; tokens: summed in fp32 (at least), then cast
    dx_dtype = x.dtype if tokens is None else w_rows.dtype

    def run(width, tiles):
        lay = _Slots(sizes, width, frame, capped=tiles)
        a, b, w_l = lay.gather(a_rows), lay.gather(b_rows), lay.gather(w_rows)
        _, tail_vjp = jax.vjp(lambda a_, b_, wl_, wr_, p_: _tail(lay, rows, a_, b_, wl_, wr_, p_, cfg),
                              a, b, w_l, w_rows, tail_p)
        da, db, dw_l, dw_rows, d_tail = tail_vjp(dz)
        _, head_vjp = jax.vjp(lambda x_, p_: _head(lay, x_, p_), lay.gather_in(x), head_p)
        dx_l, d_head = head_vjp((da, db))
        state = (lay.out(dx_l, dx_dtype), lay.read_back(dw_l[..., None])[:, 0] + dw_rows, {**d_head, **d_tail})
        return _tiles_backward(state, x, w_rows, p, sizes, width, frame, dz, cfg) if tiles else state

    dx, dw, dp = lax.switch(branch, [functools.partial(run, *plan) for plan in plans])
    return dx.astype(x.dtype), dw, dp, None, None, None


_slot_ffn.defvjp(_slot_ffn_fwd, _slot_ffn_bwd)

__all__ = ["CHUNK", "SLOTS_MAX_FACTOR", "TILE", "slot_capacities", "slots_expert_ffn", "slots_token_ffn"]
