"""Where the slot FFN's ``[., H]`` arrays live (gpurouter/reference/slot_experts.py):
the rows sorted by expert (``[N, H]``, the rows' own buffer), or the tokens
behind them (``[T, H]``, a token's output the sum of its K rows), and the two
differentiable maps from slots ``[G, C, D]`` to them: the read-back to rows
and the sum into tokens, each the transpose of a gather into the slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .grouped_matmul import _read_back, _round_rows, _take_rows


class Frame:
    """The FFN's ``[., H]`` input and output: the rows themselves (``tokens``
    None: ``[N, H]``), or the tokens behind them (``tokens = (tok_of_row [N],
    pair_row [T, K])``: ``[T, H]``, a token's output the sum of its K rows)."""

    def __init__(self, tokens, rows_e, num_rows: int):
        self.tokens, self.rows_e, self.num_rows = tokens, rows_e, num_rows

    def index(self, rows):
        """Row indices (``num_rows``: none) -> indices into the input (out of range: none)."""
        if self.tokens is None:
            return rows
        tok_of_row, pair_row = self.tokens
        return jnp.where(rows < self.num_rows, tok_of_row[jnp.minimum(rows, self.num_rows - 1)], pair_row.shape[0])

    def out(self, v, slots_in, sizes, width: int, capped: bool, dtype):
        """Slots ``[G, C, D]`` to the output (rows, or tokens summed in ``dtype``);
        differentiable, its transpose the gather of the output's cotangent
        (``slots_in [G, C]``: each slot's place in the input, :meth:`index`)."""
        if self.tokens is None:
            return read_back_op(v, sizes, width, self.num_rows, capped).astype(dtype)
        _, pair_row = self.tokens
        starts = jnp.cumsum(sizes) - sizes
        e = self.rows_e[pair_row]
        local = pair_row - starts[e]
        slot = jnp.where(local < width, e * width + local, v.shape[0] * width)
        return _collect_op(v, slot, slots_in, jnp.dtype(dtype))

    def out_bias(self, bo, w_rows, rows, early: bool):
        """``bo`` of every row's expert (times its weight when ``early``), on the output."""
        acc = w_rows.dtype
        if self.tokens is None:
            b = jnp.where(rows.valid, rows.bias(bo).astype(acc), 0)
            return b * jnp.where(rows.valid[:, 0], w_rows, 0)[:, None] if early else b
        _, pair_row = self.tokens
        return jnp.sum(bo.astype(acc)[self.rows_e[pair_row]] * w_rows[pair_row][..., None], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _collect_op(v, slot, tok_slots, dtype):
    """``out[t] = sum_k v[slot[t, k]]`` in ``dtype`` (``slot [T, K]``, past the
    slots: none); each filled slot belongs to one pair, ``tok_slots [G, C]``
    their tokens (``T``: empty)."""
    flat = v.reshape(-1, v.shape[-1])
    return jnp.sum(_take_rows(flat, slot).astype(dtype), axis=1)


def _collect_fwd(v, slot, tok_slots, dtype):
    return _collect_op(v, slot, tok_slots, dtype), (tok_slots, jnp.zeros((0,), v.dtype))  # v's dtype, no data


def _collect_bwd(dtype, res, d):
    tok_slots, like = res
    # cast first, gather after: the same values, and the gather moves the slots' dtype, not fp32
    return _take_rows(d.astype(like.dtype), tok_slots), None, None


_collect_op.defvjp(_collect_fwd, _collect_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def read_back_op(v, sizes, width, num_rows, capped):
    return _read_back(v.reshape(-1, v.shape[-1]), sizes, width, num_rows, capped)


def _read_back_fwd(v, sizes, width, num_rows, capped):
    return read_back_op(v, sizes, width, num_rows, capped), sizes


def _read_back_bwd(width, num_rows, capped, sizes, d):
    # each filled slot is read by exactly one row, an empty slot by none
    return _take_rows(d, _round_rows(sizes, 0, width, num_rows)), None


read_back_op.defvjp(_read_back_fwd, _read_back_bwd)

__all__ = ["Frame", "read_back_op"]
