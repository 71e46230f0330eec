"""Expert parallelism for the MoE block: rows to their experts' devices and back.

Inside ``jax.shard_map`` over the expert-parallel axis (``P`` devices, each
with its own tokens and ``E_l = E / P`` experts' weights, shard ``j`` holding
experts ``[j E_l, (j + 1) E_l)``):

1. each device sorts its (token, expert) rows by global expert, so the rows
   for shard ``j`` are one contiguous chunk; the per-expert counts of every
   device are all-gathered (``counts [P, E]``);
2. ``ragged_all_to_all`` sends chunk ``j`` to shard ``j``, which receives
   the chunks source-major into a buffer of static size ``P * T_l * K``
   (the worst case: every row of every device to one shard);
3. the receiver sorts its rows by local expert (stable: source order kept),
   runs its experts, restores the source-major order, and the inverse
   ``ragged_all_to_all`` returns each row to its token's device.

XLA:CPU has no ``ragged_all_to_all``: on the CPU an exact stand-in with the
same offsets (an all-gather and a masked gather) runs instead; tests and CI
use it, GPUs the real collective.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ._vma import match_varying_axes


def _exclusive_cumsum(v: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(v, axis=axis) - v


def a2a_params(counts: jax.Array, me: jax.Array, num_shards: int):
    """``ragged_all_to_all`` parameters of shard ``me`` from every shard's
    per-expert counts ``counts [P, E]`` (rows sorted by global expert).

    Returns ``(input_offsets, send_sizes, output_offsets, recv_sizes)``, each
    ``[P]`` int32: what ``me`` sends to each shard (from where in its sorted
    rows, how many, to where in the receiver's buffer) and receives from each.
    """
    per_shard = counts.reshape(num_shards, num_shards, -1).sum(-1)  # [src, dst] rows
    send_sizes = per_shard[me]
    input_offsets = _exclusive_cumsum(send_sizes)
    # the receiver j stacks its sources in order: my chunk lands after sources < me
    output_offsets = _exclusive_cumsum(per_shard, axis=0)[me]
    recv_sizes = per_shard[:, me]
    return (input_offsets.astype(jnp.int32), send_sizes.astype(jnp.int32),
            output_offsets.astype(jnp.int32), recv_sizes.astype(jnp.int32))


def ragged_all_to_all(operand, num_rows: int, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name, num_shards: int):
    """``jax.lax.ragged_all_to_all`` into a zero buffer of ``num_rows`` rows
    (or its exact stand-in on XLA:CPU) with its own backward: the cotangent rows travel back the way they came, a
    second ragged all-to-all with the offsets mirrored. (JAX's own transpose
    of the collective gave wrong gradients on two H200s with jax 0.11.2,
    while the forward was right; the CPU stand-in differentiated by JAX was
    right: tests/ops/test_moe.py, docs/moe.md.)"""
    params = (input_offsets, send_sizes, output_offsets, recv_sizes)
    return _exchange(operand, params, axis_name, num_shards, (operand.shape, int(num_rows)))


def has_ragged_all_to_all() -> bool:
    """Whether the default backend runs ``lax.ragged_all_to_all`` (XLA:CPU
    does not: the stand-in runs there). The one switch between the two, so
    that tests can trace the GPU branch on the CPU."""
    return jax.default_backend() != "cpu"


def _exchange_raw(operand, params, num_rows: int, axis_name, num_shards: int):
    input_offsets, send_sizes, output_offsets, recv_sizes = params
    output = jnp.zeros((num_rows,) + operand.shape[1:], operand.dtype)
    if has_ragged_all_to_all():
        # the result takes the buffer's type: a fresh zero buffer is invariant,
        # and the backward's cotangent must vary like its operand (check_vma)
        (output,) = match_varying_axes((output,), (operand,), also=axis_name)
        return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis_name)
    me = lax.axis_index(axis_name)
    ops = lax.all_gather(operand, axis_name)  # [P, N, ...]
    in_off = lax.all_gather(input_offsets, axis_name)  # [P(src), P(dst)]
    out_off = lax.all_gather(output_offsets, axis_name)
    sizes = lax.all_gather(send_sizes, axis_name)
    rows = jnp.arange(output.shape[0], dtype=jnp.int32)
    for src in range(num_shards):
        start, size, src_start = out_off[src, me], sizes[src, me], in_off[src, me]
        hit = (rows >= start) & (rows < start + size)
        take = jnp.clip(src_start + rows - start, 0, operand.shape[0] - 1)
        output = jnp.where(hit.reshape((-1,) + (1,) * (output.ndim - 1)), ops[src][take], output)
    return output


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _exchange(operand, params, axis_name, num_shards: int, shapes):
    return _exchange_raw(operand, params, shapes[1], axis_name, num_shards)


def _exchange_fwd(operand, params, axis_name, num_shards: int, shapes):
    return _exchange_raw(operand, params, shapes[1], axis_name, num_shards), params


def _exchange_bwd(axis_name, num_shards: int, shapes, params, ct):
    """Operand row ``input_offsets[j] + i`` went to shard j's row
    ``output_offsets[j] + i``: its cotangent comes back from there."""
    input_offsets, send_sizes, output_offsets, recv_sizes = params
    me = lax.axis_index(axis_name)
    landed = lax.all_gather(output_offsets, axis_name)[:, me]  # where each source's rows are in mine
    came_from = lax.all_gather(input_offsets, axis_name)[:, me]  # where they were in the source's operand
    back = (landed.astype(jnp.int32), recv_sizes, came_from.astype(jnp.int32), send_sizes)
    d_operand = _exchange_raw(ct, back, shapes[0][0], axis_name, num_shards)
    return d_operand, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def dispatch(xs, rows_expert, group_sizes, *, axis_name, num_shards: int, num_experts: int):
    """Sends the expert-sorted rows ``xs [N, H]`` (``rows_expert [N]`` their
    global experts, ``group_sizes [E]`` this device's counts) to their experts'
    shards. Returns ``(received [P*N, H] sorted by local expert, local_sizes
    [E_l], state)``; ``state`` undoes it in :func:`combine`."""
    e_local = num_experts // num_shards
    me = lax.axis_index(axis_name)
    counts = lax.all_gather(group_sizes, axis_name)  # [P, E]
    params = a2a_params(counts, me, num_shards)
    n_buf = num_shards * xs.shape[0]
    received = ragged_all_to_all(xs, n_buf, *params, axis_name=axis_name, num_shards=num_shards)
    # local expert of each received row: source-major chunks, each expert-major
    mine = lax.dynamic_slice_in_dim(counts, me * e_local, e_local, axis=1)  # [P, E_l]
    ends = jnp.cumsum(mine.reshape(-1))
    n_recv = ends[-1]
    rows = jnp.arange(n_buf, dtype=jnp.int32)
    slot = jnp.searchsorted(ends, rows, side="right")  # the (source, local expert) slot of each row
    local_e = jnp.where(rows < n_recv, slot % e_local, e_local)  # the unused tail sorts last
    order = jnp.argsort(local_e, stable=True)
    return received[order], mine.sum(0).astype(jnp.int32), (order, params, xs.shape[0])


def combine(z, state, *, axis_name, num_shards: int):
    """The inverse of :func:`dispatch` for the expert outputs ``z [P*N, H']``."""
    order, (input_offsets, send_sizes, output_offsets, recv_sizes), n = state
    back = jnp.zeros_like(z).at[order].set(z)  # source-major again
    # reverse: send back what was received from each source, to where it came from
    me = lax.axis_index(axis_name)
    rev_in = _exclusive_cumsum(recv_sizes)
    # the source shard s expects its rows at its own input_offsets[me]
    all_in = lax.all_gather(input_offsets, axis_name)  # [src, dst]
    rev_out = all_in[:, me]
    return ragged_all_to_all(back, n, rev_in.astype(jnp.int32), recv_sizes, rev_out.astype(jnp.int32),
                             send_sizes, axis_name=axis_name, num_shards=num_shards)
