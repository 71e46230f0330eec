"""A grouped GEMM as a Pallas kernel (Triton lowering on GPUs), with
``jax.lax.ragged_dot``'s signature and result.

``lhs [N, K]`` holds rows sorted by group (``group_sizes [G]``), ``rhs [G, K, M]``
one matrix per group; row ``r`` of group ``g`` gives ``lhs[r] @ rhs[g]``, rows past
``sum(group_sizes)`` give zeros. No rows are gathered into slots (the cost of
``batched_ragged_dot``): the kernels read the sorted rows in place.

The design is megablox's GMM (the JAX grouped matmul of MaxText/megablox, on
TPUs): a tile schedule computed in jnp from ``group_sizes``: every ``block_m``
row tile is visited once per group it holds rows of (a tile across a group
boundary twice or more), each visit multiplies the whole tile by its group's
matrix with fp32 accumulation and stores only that group's rows (a masked
store). Rows past the groups form a last, phantom group whose visits store
zeros without a K loop. The grid is (visits, ``M / block_n``), the visits a
static ``ceil(N / block_m) + G`` (unused ones store nothing).

The backward is a custom VJP: ``d lhs`` is the same kernel on ``dy`` and
``rhs`` read transposed in place (its tiles ``[block_n, block_k]`` of
``rhs[g]``, a transposed dot; no copy of the weights); ``d rhs[g] = lhs_g^T dy_g`` is a transposed
grouped GEMM: a grid over (groups, ``K / block_k``, ``M / block_n``), each
program looping over its group's row tiles (rows outside the group masked to
0), fp32 accumulation; an empty group gives zeros.

Operands that are not multiples of the tiles are padded with zeros (a copy);
the MoE shapes (``N`` a multiple of 128, ``K`` and ``M`` of 64 and 128) are not.
On a CPU backend the kernels run in Pallas' interpreter (``interpret=None``
picks it), for tests.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._checks import check_pallas_ragged_dot_args


def _triton():
    from jax.experimental.pallas import triton as plgpu

    return plgpu


def _compiler_params(num_warps: int, num_stages: int):
    """The Triton compiler parameters: ``plgpu.CompilerParams`` (jax 0.10,
    0.11) or ``plgpu.TritonCompilerParams`` (older jax)."""
    plgpu = _triton()
    cls = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    return cls(num_warps=num_warps, num_stages=num_stages)


def _masked_store(ref, value, mask):
    """``ref[...] = value`` where ``mask`` (Triton's masked store:
    ``plgpu.store`` in jax 0.10 and 0.11, ``pl.store`` before)."""
    store = getattr(_triton(), "store", None) or pl.store
    store(ref, value, mask=mask)


class _Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    interpret: bool
    precision: object


def _cdiv(a, b):
    return (a + b - 1) // b


def _pad_to(x, axis: int, multiple: int):
    size = x.shape[axis]
    extra = -size % multiple
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _acc_dtype(dtype):
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int):
    """The visits of the forward kernel: ``(tile, group, lo, hi)``, int32
    ``[V]`` each, ``V = num_rows / block_m + G`` (``num_rows`` a multiple of
    ``block_m``). Visit ``v`` multiplies row tile ``tile[v]`` by ``rhs[group[v]]``
    and stores rows ``[lo[v], hi[v])``; ``group[v] == G`` is the phantom group
    of the rows past ``sum(group_sizes)`` (zeros), and unused visits have
    ``lo == hi == 0`` (nothing stored)."""
    g = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
    total = ends[-1] if g else jnp.int32(0)
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    starts = starts.at[g].set(total)
    first = starts // block_m
    count = jnp.where(ends > starts, _cdiv(ends, block_m) - first, 0)
    cum = jnp.cumsum(count)
    num_visits = num_rows // block_m + g
    v = jnp.arange(num_visits, dtype=jnp.int32)
    group = jnp.searchsorted(cum, v, side="right").astype(jnp.int32)
    used = group <= g
    group_c = jnp.minimum(group, g)
    tile = first[group_c] + v - (cum[group_c] - count[group_c])
    tile = jnp.where(used, tile, 0).astype(jnp.int32)
    lo = jnp.where(used, starts[group_c], 0).astype(jnp.int32)
    hi = jnp.where(used, ends[group_c], 0).astype(jnp.int32)
    return tile, group_c.astype(jnp.int32), lo, hi


def _gmm(cfg: _Config, lhs, rhs, group_sizes, out_dtype, transpose_rhs: bool = False):
    """``[N, K] x [G, K, M] -> [N, M]`` by groups (the forward kernel);
    ``transpose_rhs``: ``rhs`` is ``[G, M, K]``, read transposed in place
    (``d lhs = dy rhs_g^T`` without a copy of the weights)."""
    n, k = lhs.shape
    g = rhs.shape[0]
    m = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    lhs_p = _pad_to(_pad_to(lhs, 0, bm), 1, bk)
    if transpose_rhs:
        rhs_p = _pad_to(_pad_to(rhs, 1, bn), 2, bk)
    else:
        rhs_p = _pad_to(_pad_to(rhs, 1, bk), 2, bn)
    np_, kp = lhs_p.shape
    mp = rhs_p.shape[1] if transpose_rhs else rhs_p.shape[2]
    tile, group, lo, hi = tile_schedule(group_sizes, np_, bm)
    acc_dtype = _acc_dtype(lhs.dtype)
    num_k = kp // bk

    def kernel(tile_ref, group_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref):
        v = pl.program_id(0)
        j = pl.program_id(1)
        gv = group_ref[v]
        phantom = gv >= g
        gw = jnp.minimum(gv, g - 1)
        r0 = pl.multiple_of(tile_ref[v] * bm, bm)
        n0 = pl.multiple_of(j * bn, bn)

        def body(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            a = lhs_ref[pl.ds(r0, bm), pl.ds(k0, bk)]
            if transpose_rhs:
                b = rhs_ref[gw, pl.ds(n0, bn), pl.ds(k0, bk)]
                return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=cfg.precision,
                                             preferred_element_type=acc_dtype)
            b = rhs_ref[gw, pl.ds(k0, bk), pl.ds(n0, bn)]
            return acc + lax.dot(a, b, precision=cfg.precision, preferred_element_type=acc_dtype)

        # both bounds int32 values: Triton's loop wants one type for its bounds
        steps = jnp.where(phantom, jnp.int32(0), jnp.int32(num_k))
        acc = lax.fori_loop(jnp.int32(0), steps, body, jnp.zeros((bm, bn), acc_dtype))
        rows = r0 + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
        mask = (rows >= lo_ref[v]) & (rows < hi_ref[v])
        _masked_store(out_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], acc.astype(out_dtype), mask)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((np_, mp), out_dtype),
        grid=(tile.shape[0], mp // bn),
        interpret=cfg.interpret,
        compiler_params=None if cfg.interpret else _compiler_params(cfg.num_warps, cfg.num_stages),
        name="pallas_gmm",
    )(tile, group, lo, hi, lhs_p, rhs_p)
    return out[:n, :m]


def _tgmm(cfg: _Config, lhs, dy, group_sizes, out_dtype):
    """``d rhs[g] = lhs_g^T dy_g``: ``[N, K] x [N, M] -> [G, K, M]`` (the
    transposed grouped GEMM; empty groups give zeros)."""
    n, k = lhs.shape
    m = dy.shape[1]
    g = group_sizes.shape[0]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    lhs_p = _pad_to(_pad_to(lhs, 0, bm), 1, bk)
    dy_p = _pad_to(_pad_to(dy, 0, bm), 1, bn)
    np_, kp = lhs_p.shape
    mp = dy_p.shape[1]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), n).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    acc_dtype = _acc_dtype(lhs.dtype)

    def kernel(starts_ref, ends_ref, lhs_ref, dy_ref, out_ref):
        gi = pl.program_id(0)
        k0 = pl.multiple_of(pl.program_id(1) * bk, bk)
        n0 = pl.multiple_of(pl.program_id(2) * bn, bn)
        s = starts_ref[gi]
        e = ends_ref[gi]
        c0 = s // bm
        c1 = jnp.where(e > s, _cdiv(e, bm), c0)

        def body(c, acc):
            r0 = pl.multiple_of(c * bm, bm)
            rows = r0 + lax.broadcasted_iota(jnp.int32, (bm, bk), 0)
            a = lhs_ref[pl.ds(r0, bm), pl.ds(k0, bk)]
            a = jnp.where((rows >= s) & (rows < e), a, jnp.zeros_like(a))
            d = dy_ref[pl.ds(r0, bm), pl.ds(n0, bn)]
            return acc + lax.dot_general(a, d, (((0,), (0,)), ((), ())), precision=cfg.precision,
                                         preferred_element_type=acc_dtype)

        acc = lax.fori_loop(c0, c1, body, jnp.zeros((bk, bn), acc_dtype))
        out_ref[gi, pl.ds(k0, bk), pl.ds(n0, bn)] = acc.astype(out_dtype)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((g, kp, mp), out_dtype),
        grid=(g, kp // bk, mp // bn),
        interpret=cfg.interpret,
        compiler_params=None if cfg.interpret else _compiler_params(cfg.num_warps, cfg.num_stages),
        name="pallas_tgmm",
    )(starts, ends, lhs_p, dy_p)
    return out[:, :k, :m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ragged(cfg, out_dtype, lhs, rhs, group_sizes):
    return _gmm(cfg, lhs, rhs, group_sizes, out_dtype)


def _ragged_fwd(cfg, out_dtype, lhs, rhs, group_sizes):
    return _gmm(cfg, lhs, rhs, group_sizes, out_dtype), (lhs, rhs, group_sizes)


def _ragged_bwd(cfg, out_dtype, res, dy):
    lhs, rhs, group_sizes = res
    dy = dy.astype(lhs.dtype)
    d_lhs = _gmm(cfg, dy, rhs, group_sizes, lhs.dtype, transpose_rhs=True)
    d_rhs = _tgmm(cfg, lhs, dy, group_sizes, rhs.dtype)
    return d_lhs, d_rhs, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def pallas_ragged_dot(
    lhs: jax.typing.ArrayLike,
    rhs: jax.typing.ArrayLike,
    group_sizes: jax.typing.ArrayLike,
    precision=None,
    preferred_element_type=None,
    group_offset=None,
    *,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    interpret: bool | None = None,
) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` as a Pallas grouped GEMM.

    Args:
      lhs: ``[N, K]`` rows sorted by group.
      rhs: ``[G, K, M]``, one matrix per group.
      group_sizes: ``[G]`` integers ``>= 0`` summing to at most ``N`` (rows past
        the sum give zeros).
      precision: as for ``jax.lax.dot_general``, passed to the kernels' dots.
      preferred_element_type: the output dtype (default: ``lhs`` and ``rhs``
        promoted); the kernels accumulate in fp32 (float64 for float64).
      group_offset: None only (as ``ragged_dot`` without sharded groups).
      block_m, block_n, block_k: the tiles (rows, output columns, the
        contraction), powers of two >= 16; the backward's transposed GEMM uses
        ``block_k x block_n`` output tiles over ``block_m`` row steps.
      num_warps, num_stages: Triton's launch parameters (GPU only).
      interpret: run the kernels in Pallas' interpreter (default: on a CPU
        backend).

    Returns:
      ``[N, M]``; differentiable in ``lhs`` and ``rhs`` (custom VJP, the
      same kernels).
    """
    check_pallas_ragged_dot_args(lhs, rhs, group_sizes, block_m, block_n, block_k, num_warps, num_stages,
                                 precision, preferred_element_type, group_offset, interpret)
    lhs = jnp.asarray(lhs)
    rhs = jnp.asarray(rhs)
    group_sizes = jnp.asarray(group_sizes)
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    out_dtype = jnp.dtype(preferred_element_type or dtype)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    cfg = _Config(block_m, block_n, block_k, num_warps, num_stages, bool(interpret), precision)
    if group_sizes.shape[0] == 0 or lhs.shape[0] == 0:
        return jnp.zeros((lhs.shape[0], rhs.shape[2]), out_dtype)
    return _ragged(cfg, out_dtype, lhs.astype(dtype), rhs.astype(dtype), group_sizes)


def pallas_ragged_dot_rhs_grad(
    lhs: jax.typing.ArrayLike,
    dy: jax.typing.ArrayLike,
    group_sizes: jax.typing.ArrayLike,
    *,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    interpret: bool | None = None,
) -> jax.Array:
    """``d rhs`` of :func:`pallas_ragged_dot` alone: ``[G, K, M]``,
    ``out[g] = lhs_g^T dy_g`` (the transposed grouped GEMM of its backward;
    an empty group gives zeros), in ``lhs``'s dtype; for the probes."""
    lhs = jnp.asarray(lhs)
    dy = jnp.asarray(dy)
    group_sizes = jnp.asarray(group_sizes)
    g = group_sizes.shape[0]
    rhs_shape = jax.ShapeDtypeStruct((g, lhs.shape[1], dy.shape[1]), lhs.dtype)
    check_pallas_ragged_dot_args(lhs, rhs_shape, group_sizes, block_m, block_n, block_k, num_warps, num_stages,
                                 interpret=interpret)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    cfg = _Config(block_m, block_n, block_k, num_warps, num_stages, bool(interpret), None)
    return _tgmm(cfg, lhs, dy.astype(lhs.dtype), group_sizes, lhs.dtype)


def pallas_ragged_dot_lhs_grad(
    dy: jax.typing.ArrayLike,
    rhs: jax.typing.ArrayLike,
    group_sizes: jax.typing.ArrayLike,
    *,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    interpret: bool | None = None,
) -> jax.Array:
    """``d lhs`` of :func:`pallas_ragged_dot` alone: ``[N, K]``, row ``r`` of
    group ``g`` is ``dy[r] @ rhs[g]^T`` (the forward kernel reading ``rhs``
    transposed in place), in ``dy``'s dtype; for the probes."""
    dy = jnp.asarray(dy)
    rhs = jnp.asarray(rhs)
    group_sizes = jnp.asarray(group_sizes)
    rhs_t = jax.ShapeDtypeStruct((rhs.shape[0], rhs.shape[2], rhs.shape[1]), rhs.dtype)
    check_pallas_ragged_dot_args(dy, rhs_t, group_sizes, block_m, block_n, block_k, num_warps, num_stages,
                                 interpret=interpret)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    cfg = _Config(block_m, block_n, block_k, num_warps, num_stages, bool(interpret), None)
    return _gmm(cfg, dy, rhs.astype(dy.dtype), group_sizes, dy.dtype, transpose_rhs=True)
