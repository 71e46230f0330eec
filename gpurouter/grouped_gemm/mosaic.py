"""A grouped GEMM on jax's Mosaic-GPU kernels (Hopper's wgmma and TMA), with
``jax.lax.ragged_dot``'s signature and result.

jax ships two grouped GEMM kernels written in Pallas' Mosaic-GPU dialect,
``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot`` (``out[r] =
lhs[r] @ rhs[g(r)]``, optionally reading ``rhs`` transposed in place) and
``transposed_ragged_dot_mgpu.transposed_ragged_dot`` (``out[g] = lhs_g^T
rhs_g``). Both are persistent kernels (a program per SM), pipeline their
operand tiles through shared memory with TMA and multiply with wgmma into an
fp32 accumulator. :func:`mosaic_ragged_dot` puts them behind ragged_dot's
signature:

- forward: ``ragged_dot(lhs, rhs)``;
- ``d lhs = ragged_dot(dy, rhs, transpose_rhs=True)`` (``dy_g rhs_g^T``,
  no copy of the weights);
- ``d rhs = transposed_ragged_dot(lhs, dy)`` (an empty group: zeros).

Their tiles are picked per call by :func:`forward_tiles` and
:func:`weight_grad_tiles` from a sweep on an H200 (docs/moe.md, "Mosaic GPU").

What the wrapper adds to the kernels, so that the result is ragged_dot's:

- rows past ``sum(group_sizes)`` are zeros (the kernel leaves them unwritten);
- ``N`` is padded with zero rows to a multiple of 128 where it is not one
  (a copy);
- ``group_sizes`` are int32.

Where the kernels cannot give ragged_dot's result (no Hopper GPU: compute
capability 9.x; operands not both bfloat16 or both float16;
``preferred_element_type`` other than the operands' dtype; ``K`` or ``M`` not a
multiple of 64; jax's two modules not importable: they need ``absl-py``, in
the ``cuda12``/``cuda13`` extras), the call is
:func:`gpurouter.reference.grouped_matmul.tiled_ragged_dot`, the jnp
composition, and :func:`mosaic_supported` says why.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._checks import check_batched_ragged_dot_args
from ..reference.grouped_matmul import tiled_ragged_dot

OP = "mosaic_ragged_dot"

#: rows are padded to a multiple of this (the largest ``block_m`` and ``block_k`` used)
ROW_ALIGN = 128


class Tiles(NamedTuple):
    """A kernel configuration: the output tile ``block_m x block_n``, the
    contraction step ``block_k``, the pipeline depth ``max_concurrent_steps``
    and ``grid_block_n`` (output column tiles walked together, for L2 reuse)."""

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int
    grid_block_n: int


#: the forward's (and ``d lhs``'s) candidates, best first, by rows per group
#: (the H200 sweep at a07152b, lab/results/h200-a07152b-mosaic-gemm-sweep.txt:
#: 64 x 256 at 128 rows a group, DeepSeek-V3-like; 128 x 192 at 512, Qwen3-like)
_FEW_ROWS = (Tiles(64, 256, 64, 4, 4), Tiles(128, 128, 64, 4, 4), Tiles(64, 128, 64, 4, 4), Tiles(64, 64, 64, 4, 1))
_MANY_ROWS = (Tiles(128, 192, 64, 4, 4), Tiles(128, 128, 64, 6, 8), Tiles(128, 128, 64, 4, 4),
              Tiles(64, 128, 64, 4, 4), Tiles(64, 64, 64, 4, 1))
#: ``d rhs``'s candidates (the sweep: 128 x 128 x 64 best at both shapes)
_WEIGHT_GRAD = (Tiles(128, 128, 64, 4, 4), Tiles(64, 128, 64, 4, 4), Tiles(64, 64, 64, 4, 1))
#: groups of at least this many rows on average take ``_MANY_ROWS``
MANY_ROWS = 256


def _grid_block_n(tiles: Tiles, n: int) -> Tiles:
    """``tiles`` with ``grid_block_n`` lowered until it divides ``n / block_n``."""
    g = tiles.grid_block_n
    while g > 1 and (n // tiles.block_n) % g:
        g //= 2
    return tiles._replace(grid_block_n=g)


def forward_tiles(rows: int, groups: int, k: int, n: int) -> Tiles | None:
    """The tiles of ``ragged_dot`` over ``rows x k`` times ``groups`` matrices
    ``k x n`` (the forward and ``d lhs``), or None when none divides ``k``, ``n``."""
    table = _MANY_ROWS if rows >= MANY_ROWS * max(groups, 1) else _FEW_ROWS
    for t in table:
        if k % t.block_k == 0 and n % t.block_n == 0:
            return _grid_block_n(t, n)
    return None


def weight_grad_tiles(k: int, n: int) -> Tiles | None:
    """The tiles of ``transposed_ragged_dot`` giving ``[G, k, n]``, or None."""
    for t in _WEIGHT_GRAD:
        if k % t.block_m == 0 and n % t.block_n == 0:
            return _grid_block_n(t, n)
    return None


@functools.cache
def _kernels():
    """jax's two Mosaic-GPU kernels, or the reason they are unavailable."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except ImportError as err:  # jax without the Mosaic GPU ops, or without absl-py (they import it)
        return None, f"jax {jax.__version__}'s Mosaic-GPU ragged_dot does not import ({err})"
    return (ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot), None


def _hopper() -> str | None:
    """None if the default device is a Hopper GPU, else why not."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return f"the default device is {dev.platform}, not a GPU"
    cc = str(getattr(dev, "compute_capability", ""))
    if not cc.startswith("9."):
        return f"the GPU's compute capability is {cc or 'unknown'}; the kernels use Hopper's wgmma (9.x)"
    return None


def mosaic_supported(lhs, rhs, preferred_element_type=None) -> str | None:
    """None if :func:`mosaic_ragged_dot` runs these operands on the Mosaic-GPU
    kernels, else the reason it runs ``tiled_ragged_dot`` instead."""
    why = _hopper()
    if why:
        return why
    dt = jnp.dtype(lhs.dtype)
    if dt != jnp.dtype(rhs.dtype) or dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the operands are {lhs.dtype} and {rhs.dtype}; the kernels take two bfloat16 or two float16"
    if preferred_element_type is not None and jnp.dtype(preferred_element_type) != dt:
        return f"preferred_element_type {jnp.dtype(preferred_element_type)} differs from the operands' {dt}"
    _, k, n = rhs.shape
    if forward_tiles(lhs.shape[0], rhs.shape[0], k, n) is None or forward_tiles(
            lhs.shape[0], rhs.shape[0], n, k) is None or weight_grad_tiles(k, n) is None:
        return f"K ({k}) and M ({n}) must be multiples of 64"
    return _kernels()[1]


def _pad_rows(x, rows: int):
    return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def _zero_tail(out, group_sizes):
    """Rows past ``sum(group_sizes)`` set to 0 (the kernels leave them
    unwritten): an elementwise select that XLA fuses into the consumer (in the
    MoE block, the activation); alone it is one pass over the output. (With a
    ``lax.cond`` that skipped it when the groups cover every row, the
    Qwen3-like forward took 0.574 ms against 0.460 ms for the kernel alone,
    H200, 6e5cf33.)"""
    total = jnp.sum(group_sizes)
    return jnp.where(lax.broadcasted_iota(jnp.int32, out.shape, 0) < total, out, jnp.zeros((), out.dtype))


def _forward(lhs, rhs, group_sizes, transpose_rhs: bool):
    """``ragged_dot`` of the kernels on padded rows: ``[rows, n]``."""
    (rd, _), _ = _kernels()
    g = rhs.shape[0]
    k = lhs.shape[1]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tiles = forward_tiles(lhs.shape[0], g, k, n)
    out = rd(lhs, rhs, group_sizes=group_sizes, transpose_rhs=transpose_rhs, **tiles._asdict())
    return _zero_tail(out, group_sizes)


def _weight_grad(lhs, dy, group_sizes):
    """``[G, K, M]``: ``lhs_g^T dy_g`` (zeros for an empty group)."""
    (_, trd), _ = _kernels()
    tiles = weight_grad_tiles(lhs.shape[1], dy.shape[1])
    return trd(lhs, dy, group_sizes=group_sizes, **tiles._asdict())


@jax.custom_vjp
def _mosaic(lhs, rhs, group_sizes):
    return _forward(lhs, rhs, group_sizes, False)


def _mosaic_fwd(lhs, rhs, group_sizes):
    return _forward(lhs, rhs, group_sizes, False), (lhs, rhs, group_sizes)


def _mosaic_bwd(res, dy):
    lhs, rhs, group_sizes = res
    dy = _zero_tail(dy.astype(lhs.dtype), group_sizes)
    d_lhs = _forward(dy, rhs, group_sizes, True)
    # rows past the groups are zero in lhs's gradient and read by no group here
    d_rhs = _weight_grad(lhs, dy, group_sizes)
    return d_lhs, d_rhs.astype(rhs.dtype), None


_mosaic.defvjp(_mosaic_fwd, _mosaic_bwd)


def mosaic_ragged_dot(
    lhs: jax.typing.ArrayLike,
    rhs: jax.typing.ArrayLike,
    group_sizes: jax.typing.ArrayLike,
    precision=None,
    preferred_element_type=None,
    group_offset=None,
) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` on jax's Mosaic-GPU
    grouped GEMM kernels (the module docstring), differentiable in ``lhs`` and
    ``rhs``; ``tiled_ragged_dot`` where :func:`mosaic_supported` says no.

    Args:
      lhs: ``[N, K]`` rows sorted by group.
      rhs: ``[G, K, M]``, one matrix per group.
      group_sizes: ``[G]`` integer rows per group (``sum <= N``; rows past the
        sum give zeros).
      precision: accepted for the signature; the kernels multiply 16-bit
        operands exactly and accumulate in fp32.
      preferred_element_type: None or the operands' dtype for the kernels
        (another dtype runs the jnp composition).
      group_offset: must be None.

    Returns:
      ``[N, M]`` in the operands' dtype (``preferred_element_type`` if given).
    """
    check_batched_ragged_dot_args(lhs, rhs, group_sizes, None, precision, preferred_element_type, op=OP)
    if group_offset is not None:
        raise ValueError(f"{OP}: group_offset must be None (every group of rhs is local).")
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    if mosaic_supported(lhs, rhs, preferred_element_type) is not None:
        return tiled_ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type)
    n = lhs.shape[0]
    if n == 0 or rhs.shape[0] == 0:
        return jnp.zeros((n, rhs.shape[2]), lhs.dtype)
    rows = -(-n // ROW_ALIGN) * ROW_ALIGN
    out = _mosaic(_pad_rows(lhs, rows), rhs, group_sizes.astype(jnp.int32))
    return out[:n]


__all__ = ["Tiles", "forward_tiles", "mosaic_ragged_dot", "mosaic_supported", "weight_grad_tiles"]
