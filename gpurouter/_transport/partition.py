"""Per-shard kernels on meshes whose sharding JAX does not expose at trace time.

Under ``jit`` on a mesh with Auto axes (what ``jax.sharding.Mesh(devices,
names)`` gives) a custom call whose operands are token-sharded would get every
token gathered onto one device. :func:`token_parallel` wraps a token-parallel
call (every per-token operand and every result has the tokens on axis 0; the
other operands are per call) in ``jax.experimental.custom_partitioning``: XLA's
partitioner asks it, at compile time, how to split the call, and it answers
"the token axis as the first operand is split, everything else whole"; the
call is then traced again on one shard's shapes (a plan for the local token
count). No Python runs per call. Explicit-axes meshes and ``shard_map`` keep
their own route (``gpurouter._sharding``).

Used by the ``"ffi"`` transport only: the Python callbacks cannot run inside
a partitioned call (jax 0.10.2 crashes when the compiled program runs).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _token_axes(sharding):
    """The mesh axes the leading dim of ``sharding`` is split over (None: whole)."""
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return spec[0] if spec else None


def _rule(n_token: int, ranks_in, ranks_out) -> str:
    """A Shardy rule: factor ``t`` for axis 0 of the per-token operands and of
    every result, a factor of its own for every other dim."""
    count = iter(range(10_000))

    def dims(rank, tokens):
        names = ["t"] if tokens and rank else []
        names += [f"d{next(count)}" for _ in range(rank - len(names))]
        return " ".join(names) or "()"  # "()" : a scalar

    ins = [dims(r, i < n_token) for i, r in enumerate(ranks_in)]
    outs = [dims(r, True) for r in ranks_out]
    return ", ".join(ins) + " -> " + ", ".join(outs)


def token_parallel(fn: Callable, n_token: int, args, out_shapes) -> tuple[jax.Array, ...]:
    """``fn(*args)``, split over the token axis by XLA's partitioner.

    ``args[:n_token]`` are per-token (axis 0), the rest per call (kept whole);
    ``out_shapes`` the results (``jax.ShapeDtypeStruct``, tokens on axis 0).
    ``fn`` is traced again with each shard's shapes.
    """
    from jax.experimental.custom_partitioning import custom_partitioning

    @custom_partitioning
    def call(*xs):
        return tuple(fn(*xs))

    def shardings(mesh, arg_shapes):
        tok = _token_axes(arg_shapes[0].sharding)
        arg = [NamedSharding(mesh, P(tok, *[None] * (len(a.shape) - 1)) if i < n_token else P())
               for i, a in enumerate(arg_shapes)]
        out = tuple(NamedSharding(mesh, P(tok, *[None] * (len(o.shape) - 1))) for o in out_shapes)
        return arg, out

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[1]

    def partition(mesh, arg_shapes, result_shape):
        arg, out = shardings(mesh, arg_shapes)
        return mesh, lambda *xs: tuple(fn(*xs)), out, tuple(arg)

    call.def_partition(partition, infer_sharding_from_operands=infer,
                       sharding_rule=_rule(n_token, [a.ndim for a in args], [len(o.shape) for o in out_shapes]))
    return call(*args)
