"""Token dispatch and combine (public in :mod:`gpurouter.moe`,
docs/ops/moe_ops.md): the backend choice and, for ``backend="numba"``,
``jax.custom_vjp`` around the kernels of ``gpurouter/kernels/moe/permute.py``
(launched through ``gpurouter/kernels/moe/plans.py``).

- ``token_combine``: forward one kernel call, backward one kernel call that
  computes ``d_inp`` and ``d_merging_probs`` together;
- ``token_dispatch``: the integer index maps (``row_id_map``, counts,
  ``pad_offsets``) and the small ``permuted_probs`` scatter in jnp, the row
  copy on the kernels (the unweighted combine backward's), its backward the
  unweighted combine forward (the K copies summed in fp32).

Every array is a per-call argument (``vmap`` runs one launch per batch
element); every launch goes through :func:`gpurouter._transport.kernel_call`.

Each public function takes the arguments of its pure-jnp reference in
:mod:`gpurouter.reference.permute` (same name, same signature) plus the
keyword-only ``backend`` and ``transport``; the choice between them is
``gpurouter/_auto.py``'s ``moe_op_on_kernels``. ``block_dispatch`` and
``block_combine`` are the MoE block's pair on the kernels
(:func:`gpurouter.moe.moe` calls them by name).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._auto import moe_op_on_kernels
from .._checks import (
    TOKEN_COMBINE_OP,
    TOKEN_DISPATCH_OP,
    check_kernel_dtype,
    check_moe_kernel_limit,
    check_token_combine_args,
    check_token_dispatch_args,
)
from .._transport import kernel_call, resolve_transport
from ..reference import permute as _ref
from ..reference.moe import rows_of_groups

F32 = jnp.float32
I32 = jnp.int32

# ----------------------------------------------------------------------------
# Token combine
# ----------------------------------------------------------------------------


def _cf_plan(*specs):
    from ..kernels.moe import plans

    return plans.token_combine_fwd_plan(*specs)


def _cb_plan(*specs):
    from ..kernels.moe import plans

    return plans.token_combine_bwd_plan(*specs)


def _combine_call(inp, rid, w, transport):
    t = rid.shape[0]
    args = [inp, rid] + ([w] if w is not None else [])
    (out,) = kernel_call(_cf_plan, [jax.ShapeDtypeStruct((t, inp.shape[1]), inp.dtype)], [], args,
                         transport)
    return out


def _combine_bwd_call(dy, inp, rid, w, transport):
    specs = [jax.ShapeDtypeStruct(inp.shape, inp.dtype)]
    if w is not None:
        specs.append(jax.ShapeDtypeStruct(w.shape, w.dtype))
    args = [dy.astype(inp.dtype), inp, rid] + ([w] if w is not None else [])
    return kernel_call(_cb_plan, specs, [], args, transport)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine_weighted(inp, merging_probs, rid, transport):
    return _combine_call(inp, rid, merging_probs, transport)


def _combine_weighted_fwd(inp, merging_probs, rid, transport):
    return _combine_call(inp, rid, merging_probs, transport), (inp, merging_probs, rid)


def _combine_weighted_bwd(transport, res, dy):
    inp, merging_probs, rid = res
    d_inp, d_w = _combine_bwd_call(dy, inp, rid, merging_probs, transport)  # one pass, both
    return d_inp, d_w, None


_combine_weighted.defvjp(_combine_weighted_fwd, _combine_weighted_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _combine_plain(inp, rid, transport):
    return _combine_call(inp, rid, None, transport)


def _combine_plain_fwd(inp, rid, transport):
    return _combine_call(inp, rid, None, transport), (inp, rid)


def _combine_plain_bwd(transport, res, dy):
    inp, rid = res
    (d_inp,) = _combine_bwd_call(dy, inp, rid, None, transport)
    return d_inp, None


_combine_plain.defvjp(_combine_plain_fwd, _combine_plain_bwd)


def _kernel_token_combine(inp, row_id_map, merging_probs, transport: str):
    """``[T, H]`` in ``inp.dtype`` by the kernels (arguments checked)."""
    from ..kernels.moe.permute import CMB_MAX_EXPERTS

    op = TOKEN_COMBINE_OP
    transport = resolve_transport(op, transport)
    inp, rid = jnp.asarray(inp), jnp.asarray(row_id_map)
    check_kernel_dtype(op, "inp", inp.dtype)
    if merging_probs is not None:
        merging_probs = jnp.asarray(merging_probs)
        check_kernel_dtype(op, "merging_probs", merging_probs.dtype)
    check_moe_kernel_limit(op, "num_experts", rid.shape[1], CMB_MAX_EXPERTS)
    if inp.shape[0] == 0 or inp.shape[1] == 0 or rid.shape[0] == 0:
        return _ref.token_combine(inp, rid, merging_probs)
    rid = rid.astype(I32)
    if merging_probs is None:
        return _combine_plain(inp, rid, transport)
    return _combine_weighted(inp, merging_probs, rid, transport)


# ----------------------------------------------------------------------------
# Token dispatch: the index maps in jnp (integer, exact), the row copy on the kernels
# ----------------------------------------------------------------------------


def _df_plan(num_rows, inp, *rest):
    """The dispatch's plan for arrays (or Specs) of these shapes and dtypes."""
    from ..kernels._base.plan import as_spec
    from ..kernels.moe import plans

    return plans.token_dispatch_fwd_plan(as_spec(inp), *(as_spec(a) for a in rest), num_rows)


_dispatch_maps = jax.jit(_ref._dispatch_maps, static_argnums=(1,))  # integer maps, one program eagerly


def _routed(rid, num_rows):
    return (rid >= 0) & (rid < num_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dispatch_apply(inp, probs, rid, num_rows, transport):
    return _dispatch_apply_fwd(inp, probs, rid, num_rows, transport)[0]


def _dispatch_apply_fwd(inp, probs, rid, num_rows, transport):
    # The plan of this call's shapes, built at trace time (and cached): a plan's
    # error raises here, never inside a host callback, and its kernels compile
    # before the first launch on every transport.
    _df_plan(num_rows, inp, rid)
    (out,) = kernel_call(functools.partial(_df_plan, num_rows),
                         [jax.ShapeDtypeStruct((num_rows, inp.shape[1]), inp.dtype)], [], [inp, rid], transport)
    pp = None
    if probs is not None:
        # permuted_probs[row(t, e)] = probs[t, e]: an integer-indexed scatter of
        # unique rows (each written once: deterministic), padding rows 0.
        dest = jnp.where(_routed(rid, num_rows), rid, num_rows).reshape(-1)
        pp = jnp.zeros((num_rows,), probs.dtype).at[dest].set(probs.reshape(-1), mode="drop")
    like = jnp.zeros((0,), inp.dtype)
    return (out, pp), (rid, like, None if probs is None else probs[:0, :0])


def _dispatch_apply_bwd(num_rows, transport, res, cts):
    rid, like, probs_like = res
    d_out, d_pp = cts
    # d_inp[t] = sum of the K copies' cotangents: the unweighted combine forward
    # (fp32, ascending expert order); padding rows are never read.
    d_inp = _combine_call(d_out.astype(like.dtype), rid, None, transport)
    d_probs = None
    if probs_like is not None:
        routed = _routed(rid, num_rows)
        d_pp = jnp.zeros((num_rows,), probs_like.dtype) if d_pp is None else d_pp
        d_probs = jnp.where(routed, d_pp[jnp.where(routed, rid, 0)], 0).astype(probs_like.dtype)
    return d_inp, d_probs, None


_dispatch_apply.defvjp(_dispatch_apply_fwd, _dispatch_apply_bwd)


def _kernel_token_dispatch(inp, routing_map, probs, cfg, transport: str):
    """``(output, permuted_probs, row_id_map, pad_offsets, tokens_per_expert)``
    with the row copy on the kernels (``cfg``: the checked DispatchConfig)."""
    from ..kernels.moe.permute import CMB_MAX_EXPERTS
    from ..reference.routing_map import unpack_routing_map

    op = TOKEN_DISPATCH_OP
    transport = resolve_transport(op, transport)
    inp = jnp.asarray(inp)
    check_kernel_dtype(op, "inp", inp.dtype)
    if probs is not None:
        probs = jnp.asarray(probs)
        check_kernel_dtype(op, "probs", probs.dtype)
    check_moe_kernel_limit(op, "num_experts", cfg.num_experts, CMB_MAX_EXPERTS)
    if inp.shape[0] == 0 or inp.shape[1] == 0:
        return _ref.token_dispatch(inp, routing_map, cfg.num_out_tokens, probs, cfg.align_size,
                                   num_experts=cfg.num_experts)
    m = unpack_routing_map(jnp.asarray(routing_map), cfg.num_experts)
    rid, pad_offsets, tpe = _dispatch_maps(m, cfg)
    out, pp = _dispatch_apply(inp, probs, rid, cfg.num_rows, transport)
    return out, pp, rid, (None if cfg.align_size is None else pad_offsets), tpe


# ----------------------------------------------------------------------------
# The public functions (gpurouter.moe): the backend choice, then the
# reference or the kernels above; the MoE block's pair on the kernels
# ----------------------------------------------------------------------------


def token_dispatch(
    inp: jax.typing.ArrayLike,
    routing_map: jax.typing.ArrayLike,
    num_out_tokens: int,
    probs: jax.typing.ArrayLike | None = None,
    align_size: int | None = None,
    *,
    num_experts: int | None = None,
    backend: str = "auto",
    transport: str = "auto",
) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array | None, jax.Array]:
    """Tokens to expert-major rows; drop-in for TE's ``permutation.token_dispatch``.

    Returns ``(output, permuted_probs, row_id_map, pad_offsets,
    tokens_per_expert)``; see :func:`gpurouter.reference.permute.token_dispatch`
    (``row_id_map`` is ``int32 [T, E]``, the padded output row or -1).

    Args:
      num_experts: ``E`` for a BITMAP_U8 ``routing_map`` without ``probs``.
      backend: ``"jax"``, ``"numba"`` (the index maps in jnp, the row copy on
        the kernels, the backward's K copies summed by the combine kernel) or
        ``"auto"`` (the measured rule, ``gpurouter/_auto.py``: from 2^27 output row elements).
      transport: as for :func:`gpurouter.moe.compute_grouped_dbias_dscales`.
    """
    if not moe_op_on_kernels(TOKEN_DISPATCH_OP, backend, transport, num_out_tokens,
                             *([] if probs is None else [probs]), inp, maps=(routing_map, probs)):
        return _ref.token_dispatch(inp, routing_map, num_out_tokens, probs, align_size,
                                   num_experts=num_experts)
    cfg = check_token_dispatch_args(inp, routing_map, num_out_tokens, probs, align_size, num_experts)
    return _kernel_token_dispatch(inp, routing_map, probs, cfg, transport)


def token_combine(
    inp: jax.typing.ArrayLike,
    row_id_map: jax.typing.ArrayLike,
    merging_probs: jax.typing.ArrayLike | None = None,
    pad_offsets: jax.typing.ArrayLike | None = None,
    *,
    backend: str = "auto",
    transport: str = "auto",
) -> jax.Array:
    """Expert rows back to ``[T, H]`` tokens, prob-weighted; drop-in for TE's ``token_combine``.

    See :func:`gpurouter.reference.permute.token_combine`.

    Args:
      backend: ``"jax"``, ``"numba"`` (a block per token; the backward gives
        ``d_inp`` and ``d_merging_probs`` in one pass) or ``"auto"`` (the measured rule, ``gpurouter/_auto.py``).
      transport: as for :func:`gpurouter.moe.compute_grouped_dbias_dscales`.
    """
    if not moe_op_on_kernels(TOKEN_COMBINE_OP, backend, transport, None,
                             *([] if merging_probs is None else [merging_probs]), inp, maps=(row_id_map, None)):
        return _ref.token_combine(inp, row_id_map, merging_probs, pad_offsets)
    check_token_combine_args(inp, row_id_map, merging_probs, pad_offsets)
    return _kernel_token_combine(inp, row_id_map, merging_probs, transport)


def block_dispatch(xf, probs, routing_map, idx, num_experts: int, transport: str = "auto"):
    """The MoE block's dispatch on the kernels (:func:`token_dispatch` with
    ``backend="numba"``), with :func:`gpurouter.reference.moe.argsort_dispatch`'s
    signature and results: ``(xs, rows_e, group_sizes, w_rows, state)``. The
    rows come out in the same order (expert-major, ascending token inside an
    expert); ``state`` is what :func:`block_combine` needs."""
    del num_experts  # the map's
    rows = idx.shape[0] * idx.shape[1]
    xs, w_rows, row_id_map, _, sizes = token_dispatch(xf, routing_map, rows, probs=probs, backend="numba",
                                                      transport=transport)
    return (xs, rows_of_groups(sizes, rows), sizes.astype(np.int32), w_rows.astype(np.float32),
            (row_id_map, probs))


def block_combine(z, state, weighted: bool, transport: str = "auto"):
    """The MoE block's combine on the kernels (:func:`token_combine` with
    ``backend="numba"``), :func:`gpurouter.reference.moe.argsort_combine`'s
    signature plus ``transport``: it sums a token's rows in ascending expert
    order, the argsort form in selection order (fp32 either way)."""
    row_id_map, probs = state
    return token_combine(z, row_id_map, probs if weighted else None, backend="numba", transport=transport)


__all__ = ["block_combine", "block_dispatch", "token_combine", "token_dispatch"]
