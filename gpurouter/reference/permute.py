"""Pure-jnp reference of token dispatch and combine (docs/ops/moe_ops.md),
public through :mod:`gpurouter.reference.moe_ops`: :func:`token_dispatch`
and :func:`token_combine`, the signatures and meaning of
``transformer_engine.jax.permutation.token_dispatch`` / ``token_combine``.

Deterministic as the grouped bias ops are (:mod:`gpurouter.reference.grouped_bias`
says why and how): the float sums over a token's K copies are its fixed-order
segment sums; the integer index maps may use scatters (integer sums are exact
in any order), and the scatters that move floats write each element at most
once. Padding rows (alignment, an unused tail) are excluded with
``jnp.where``, never with a multiply by a 0/1 mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._checks import DispatchConfig, check_token_combine_args, check_token_dispatch_args
from .grouped_bias import _segment_sum
from .routing_map import unpack_routing_map

F32 = jnp.float32
I32 = jnp.int32


# ----------------------------------------------------------------------------
# Token dispatch / combine
# ----------------------------------------------------------------------------
# row_id_map: int32 [T, E], row_id_map[t, e] = the row of the dispatched
# output that holds token t for expert e (alignment padding included), or -1
# when t is not routed to e (or its row fell past the output). Two integer
# maps are derived from it (exact, order-free):
#   src [R]      : for each row r, the flat pair t * E + e it holds, or -1
#                  (padding / unused rows): what the gathers read;
#   pairs_tm [R] : the routed flat pairs in token-major order (expert ascending
#                  within a token), with tok_off [T + 1] the start of each
#                  token's run: what the fixed-order per-token sums read.


def _row_maps(row_id_map: jax.Array, num_rows: int):
    """``(src [R], pairs_tm [R], tok_off [T + 1], routed [T, E])`` of a row_id_map."""
    t, e = row_id_map.shape
    rid = row_id_map.astype(I32)
    routed = (rid >= 0) & (rid < num_rows)
    flat_rows = jnp.where(routed, rid, num_rows).reshape(-1)
    # Integer scatter of unique rows (ids past R dropped): exact in any order.
    src = jnp.full((num_rows,), -1, I32).at[flat_rows].set(
        jnp.arange(t * e, dtype=I32), mode="drop")
    counts = jnp.sum(routed, axis=1, dtype=I32)
    tok_off = jnp.concatenate([jnp.zeros((1,), I32), jnp.cumsum(counts, dtype=I32)])
    # Row-major nonzero = token-major pairs, expert ascending within a token;
    # a valid map routes at most R pairs (distinct rows), so size R holds them.
    (pairs_tm,) = jnp.nonzero(routed.reshape(-1), size=num_rows, fill_value=0)
    return src, pairs_tm.astype(I32), tok_off, routed


def _per_token_sum(rows: jax.Array, weights, rid_flat, pairs_tm, tok_off) -> jax.Array:
    """``out[t] = sum_{e: t routed to e} w[t, e] * rows[rid[t, e]]`` (no ``w``: 1), fp32.

    ``rows [R, H]`` float32 (rows no pair points to are never read), ``weights``
    ``[T * E]`` float32 or None. Fixed order: each token's rows in ascending
    expert order, summed by the segmented scan.
    """
    r = rows.shape[0]
    picked = rows[jnp.clip(rid_flat[pairs_tm], 0, max(r - 1, 0))]
    if weights is not None:
        picked = picked * weights[pairs_tm][:, None]
    return _segment_sum(picked, tok_off)  # positions >= tok_off[T] are not owned: masked


def _gather_rows(x: jax.Array, src: jax.Array, num_experts: int, weights=None) -> jax.Array:
    """``out[r] = w[src[r]] * x[src[r] // E]`` for held rows, exactly 0 elsewhere; fp32."""
    held = src >= 0
    tok = jnp.where(held, src // num_experts, 0)
    vals = x.astype(F32)[tok]
    if weights is not None:
        vals = vals * weights[jnp.where(held, src, 0)][:, None]
    return jnp.where(held[:, None], vals, 0.0)


def _dispatch_maps(m: jax.Array, cfg: DispatchConfig):
    """Index maps of a bool ``[T, E]`` map: ``(row_id_map, pad_offsets, tokens_per_expert)``."""
    counts = jnp.sum(m, axis=0, dtype=I32)  # [E]
    if cfg.align_size is None:
        padded = counts
    else:
        a = cfg.align_size
        padded = ((counts + (a - 1)) // a) * a
    # Each expert's block starts at the exclusive cumsum of the padded counts
    # (= unpadded start + pad_offsets[e]); tokens keep their order inside it.
    starts = jnp.cumsum(padded, dtype=I32) - padded
    pad_offsets = jnp.cumsum(padded - counts, dtype=I32) - (padded - counts)
    rank = jnp.cumsum(m.astype(I32), axis=0, dtype=I32) - 1  # [T, E]
    dest = starts[None, :] + rank
    r = cfg.num_rows
    row_id_map = jnp.where(m & (dest < r), dest, -1).astype(I32)
    return row_id_map, pad_offsets, padded


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch_apply(inp, probs, row_id_map, num_rows):
    return _dispatch_apply_fwd(inp, probs, row_id_map, num_rows)[0]


def _dispatch_apply_fwd(inp, probs, row_id_map, num_rows):
    e = row_id_map.shape[1]
    src, pairs_tm, tok_off, _ = _row_maps(row_id_map, num_rows)
    out = _gather_rows(inp, src, e).astype(inp.dtype)
    pp = None
    if probs is not None:
        held = src >= 0
        pp = jnp.where(held, probs.reshape(-1)[jnp.where(held, src, 0)], 0).astype(probs.dtype)
    like = jnp.zeros((0,), inp.dtype)  # carries inp's dtype into the backward
    return (out, pp), (row_id_map, pairs_tm, tok_off, like, None if probs is None else probs[:0, :0])


def _dispatch_apply_bwd(num_rows, res, cts):
    row_id_map, pairs_tm, tok_off, like, probs_like = res
    d_out, d_pp = cts
    rid_flat = row_id_map.reshape(-1)
    # dx[t] = sum of the K copies' cotangents, fp32, fixed order; padding rows are never read.
    d_inp = _per_token_sum(d_out.astype(F32), None, rid_flat, pairs_tm, tok_off).astype(like.dtype)
    d_probs = None
    if probs_like is not None:
        routed = (row_id_map >= 0) & (row_id_map < num_rows)
        d_pp = jnp.zeros((num_rows,), probs_like.dtype) if d_pp is None else d_pp
        d_probs = jnp.where(routed, d_pp[jnp.where(routed, row_id_map, 0)], 0).astype(probs_like.dtype)
    return d_inp, d_probs, None


_dispatch_apply.defvjp(_dispatch_apply_fwd, _dispatch_apply_bwd)


def token_dispatch(
    inp: jax.typing.ArrayLike,
    routing_map: jax.typing.ArrayLike,
    num_out_tokens: int,
    probs: jax.typing.ArrayLike | None = None,
    align_size: int | None = None,
    *,
    num_experts: int | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array | None, jax.Array]:
    """Permute tokens into expert-major rows (TE's ``permutation.token_dispatch``).

    1. ``c[e]`` = tokens routed to expert ``e``; with ``align_size = A``,
       ``p[e] = ceil(c[e] / A) * A`` and ``pad_offsets[e] = sum_{e' < e}
       (p[e'] - c[e'])``; without, ``p = c``;
    2. expert ``e``'s block starts at row ``S[e] = sum_{e' < e} p[e']``; the
       tokens routed to ``e`` take rows ``S[e], S[e] + 1, ...`` in ascending
       token order: ``row_id_map[t, e] = S[e] + #{t' <= t routed to e} - 1``
       (``-1`` where not routed);
    3. ``output[row_id_map[t, e]] = inp[t]``, ``permuted_probs[row] =
       probs[t, e]``; every other row (alignment padding, the unused tail
       when fewer than ``num_out_tokens`` pairs are routed) is exactly 0.

    The output has ``R = num_out_tokens`` rows, or TE's aligned worst case
    ``R = ((num_out_tokens + E * (A - 1)) // A) * A``. A map that routes more
    pairs than fit drops those whose rows fall at/after ``R`` (the last
    experts' last tokens): ``row_id_map = -1`` there, no output row, no
    gradient. For gpurouter's router ``num_out_tokens = T * K``.

    Backward (``jax.custom_vjp``): ``d_inp[t] = sum_e d_output[row_id_map[t, e]]``
    over the routed ``e`` (the K copies summed in fp32, ascending expert
    order, cast to ``inp.dtype``); ``d_probs[t, e] = d_permuted_probs[row]``
    where routed, else 0. Cotangents on padding rows are never read.

    Args:
      inp: ``[T, H]`` float.
      routing_map: ``[T, E]`` bool (BYTEMAP) or ``[T, ceil(E / 8)]`` uint8
        (BITMAP_U8, unpacked with :func:`gpurouter.unpack_routing_map`;
        ``E`` from ``num_experts``, else ``probs.shape[1]``).
      num_out_tokens: static int > 0, the routed pairs (``T * K``).
      probs: optional ``[T, E]`` float (sparse probs, as the router returns).
      align_size: optional static int >= 1: each expert's block padded to a
        multiple of it with zero rows.
      num_experts: ``E``; needed for a BITMAP_U8 map without ``probs``.

    Returns:
      ``(output [R, H] inp.dtype, permuted_probs [R] probs.dtype or None,
      row_id_map [T, E] int32, pad_offsets [E] int32 or None (without
      align_size), tokens_per_expert [E] int32)``; ``tokens_per_expert`` are
      the padded counts ``p`` (the expert block sizes, ``group_sizes`` of a
      grouped GEMM).

    Raises:
      ValueError, TypeError: bad shapes, dtypes or config (trace time).

    Notes:
      ``row_id_map`` is ``[T, E]`` (TE's is the compact ``[T, 2E + 1]``
      whose rows exclude padding and need ``pad_offsets`` in the combine; this
      one holds the final rows, so :func:`token_combine` needs no
      ``pad_offsets``). The row of a routed pair whose prob is 0 still holds
      the token (TE's kernel writes zeros there). Deterministic: the forward
      is gathers, the backward fixed-order fp32 sums (TE: atomics-free too,
      but in warp order).

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter.reference.moe_ops import token_dispatch
      >>> x = jnp.array([[1.0], [2.0], [3.0]])
      >>> m = jnp.array([[True, False], [True, True], [False, True]])
      >>> out, _, rid, _, tpe = token_dispatch(x, m, 4)
      >>> out[:, 0].tolist(), rid.tolist(), tpe.tolist()
      ([1.0, 2.0, 2.0, 3.0], [[0, -1], [1, 2], [-1, 3]], [2, 2])
    """
    cfg = check_token_dispatch_args(inp, routing_map, num_out_tokens, probs, align_size, num_experts)
    m = unpack_routing_map(jnp.asarray(routing_map), cfg.num_experts)
    return _dispatch(jnp.asarray(inp), m, None if probs is None else jnp.asarray(probs), cfg)


@functools.partial(jax.jit, static_argnums=(3,))
def _dispatch(inp, m, probs, cfg: DispatchConfig):
    row_id_map, pad_offsets, tpe = _dispatch_maps(m, cfg)
    out, pp = _dispatch_apply(inp, probs, row_id_map, cfg.num_rows)
    return out, pp, row_id_map, (None if cfg.align_size is None else pad_offsets), tpe


@jax.custom_vjp
def _combine_weighted(inp, merging_probs, row_id_map):
    return _combine_weighted_fwd(inp, merging_probs, row_id_map)[0]


def _combine_weighted_fwd(inp, merging_probs, row_id_map):
    r = inp.shape[0]
    src, pairs_tm, tok_off, _ = _row_maps(row_id_map, r)
    w = merging_probs.astype(F32).reshape(-1)
    out = _per_token_sum(inp.astype(F32), w, row_id_map.reshape(-1), pairs_tm, tok_off)
    return out.astype(inp.dtype), (inp, merging_probs, row_id_map, src)


def _combine_weighted_bwd(res, dy):
    inp, merging_probs, row_id_map, src = res
    r, e = inp.shape[0], row_id_map.shape[1]
    w = merging_probs.astype(F32).reshape(-1)
    # dz[r] = w[t, e] * dy[t] for the pair (t, e) held by row r; padding rows exactly 0.
    d_inp = _gather_rows(dy, src, e, w).astype(inp.dtype)
    # dw[t, e] = <z[row(t, e)], dy[t]> (fp32 row reduction), 0 where not routed.
    held = src >= 0
    dot = jnp.sum(inp.astype(F32) * _gather_rows(dy, src, e), axis=1)
    dot = jnp.where(held, dot, 0.0)
    routed = (row_id_map >= 0) & (row_id_map < r)
    d_w = jnp.where(routed, dot[jnp.where(routed, row_id_map, 0)], 0.0).astype(merging_probs.dtype)
    return d_inp, d_w, None


_combine_weighted.defvjp(_combine_weighted_fwd, _combine_weighted_bwd)


@jax.custom_vjp
def _combine_plain(inp, row_id_map):
    return _combine_plain_fwd(inp, row_id_map)[0]


def _combine_plain_fwd(inp, row_id_map):
    r = inp.shape[0]
    src, pairs_tm, tok_off, _ = _row_maps(row_id_map, r)
    out = _per_token_sum(inp.astype(F32), None, row_id_map.reshape(-1), pairs_tm, tok_off)
    return out.astype(inp.dtype), (src, row_id_map, jnp.zeros((0,), inp.dtype))


def _combine_plain_bwd(res, dy):
    src, row_id_map, like = res
    return _gather_rows(dy, src, row_id_map.shape[1]).astype(like.dtype), None


_combine_plain.defvjp(_combine_plain_fwd, _combine_plain_bwd)


def token_combine(
    inp: jax.typing.ArrayLike,
    row_id_map: jax.typing.ArrayLike,
    merging_probs: jax.typing.ArrayLike | None = None,
    pad_offsets: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """Un-permute expert rows back to tokens (TE's ``permutation.token_combine``).

    ``out[t] = sum_{e: row_id_map[t, e] >= 0} merging_probs[t, e] * inp[row_id_map[t, e]]``
    (without ``merging_probs``: a plain sum), accumulated in fp32 in
    ascending expert order and cast once to ``inp.dtype``. Rows that no
    ``(t, e)`` points to (alignment padding, an unused tail) are never read:
    NaN there reaches nothing.

    Backward (``jax.custom_vjp``, one pass, fp32):
    ``d_inp[row(t, e)] = merging_probs[t, e] * dy[t]`` (``dy[t]`` without
    probs), cast to ``inp.dtype``, and exactly 0 on rows no pair points to
    (``jnp.where``, never a multiply by a mask);
    ``d_merging_probs[t, e] = sum_h inp[row(t, e), h] * dy[t, h]`` where
    routed, else 0, in ``merging_probs.dtype``.

    Args:
      inp: ``[R, H]`` float, the expert outputs in :func:`token_dispatch`'s
        row order.
      row_id_map: ``[T, E]`` integers from :func:`token_dispatch` (each row
        at most once; ``-1`` = not routed).
      merging_probs: optional ``[T, E]`` float, typically the router's probs.
      pad_offsets: optional ``[E]`` integers, accepted for TE's signature and
        checked, otherwise unused: this ``row_id_map`` already holds the
        padded rows.

    Returns:
      ``[T, H]`` in ``inp.dtype``.

    Raises:
      ValueError, TypeError: bad shapes or dtypes (trace time).

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter.reference.moe_ops import token_combine
      >>> rid = jnp.array([[0, -1], [1, 2], [-1, 3]], jnp.int32)
      >>> z = jnp.array([[1.0], [2.0], [20.0], [3.0]])
      >>> token_combine(z, rid, jnp.array([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]]))[:, 0].tolist()
      [1.0, 11.0, 3.0]
    """
    check_token_combine_args(inp, row_id_map, merging_probs, pad_offsets)
    return _combine(jnp.asarray(inp), jnp.asarray(row_id_map),
                    None if merging_probs is None else jnp.asarray(merging_probs))


@jax.jit
def _combine(inp, row_id_map, merging_probs):
    row_id_map = row_id_map.astype(I32)
    if merging_probs is None:
        return _combine_plain(inp, row_id_map)
    return _combine_weighted(inp, merging_probs, row_id_map)


__all__ = [
    "token_combine",
    "token_dispatch",
]
