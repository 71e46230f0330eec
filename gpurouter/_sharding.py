"""Token sharding of the callback transports: run the numba ops once per token shard.

XLA does not partition a callback on its own: under ``jit`` a callback whose
operand is sharded gets the whole array gathered onto one device. gpurouter
therefore wraps each kernel op in ``jax.shard_map`` over the token axis when
the operand's type carries its sharding (JAX's explicit sharding, which
``jax.make_mesh`` gives by default): every device routes its own tokens, the
outputs (probs, routing map, gradients) stay token-sharded, and no logits
cross devices. The expert axis is always made whole first (``reshard`` to
replicated experts): a kernel never routes over a slice of the experts.

``jax.experimental.custom_partitioning`` cannot hold the Python callbacks:
with a callback inside its partitioned body, jax 0.10.2 segfaults when the
compiled program runs (both pure_callback and buffer_callback, checked on 8
CPU devices). The ``"ffi"`` transport, which runs no Python per call, does use
it on meshes with Auto axes (``_transport/partition.py``).

Inside ``shard_map`` the ops already see their shard and run per shard as
they are. Arrays whose sharding JAX does not expose at trace time (mesh axes of
type ``Auto``) fall back to XLA's behaviour: correct results, gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def token_axes(x: jax.Array):
    """``(mesh, token axes)`` when ``x`` carries an explicit sharding of its
    leading (token) axis at trace time; ``None`` otherwise (replicated, Auto
    axes, or inside a shard_map where the axes are manual)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    mesh = sharding.mesh
    if mesh.empty or any(t == AxisType.Manual for t in mesh.axis_types):
        return None
    spec = tuple(sharding.spec)
    tok = spec[0] if spec else None
    if tok is None:
        return None
    return mesh, tok


def _axis_names(tok) -> tuple[str, ...]:
    return tok if isinstance(tok, tuple) else (tok,)


def per_token_shard(
    fn: Callable[..., tuple[jax.Array, ...]],
    token_args: Sequence[jax.Array],
    call_args: Sequence[jax.Array],
    num_outputs: int,
) -> tuple[jax.Array, ...]:
    """``fn(*token_args, *call_args)``, run once per token shard when sharded.

    ``token_args`` are ``[T, E]`` arrays sharded (or not) on T; they are
    resharded to ``P(token_axes, None)`` (experts whole). ``call_args`` are
    replicated. Every output is ``[T, ...]`` and keeps the token sharding.
    """
    info = token_axes(token_args[0])
    if info is None:
        return fn(*token_args, *call_args)
    mesh, tok = info
    tok_spec, rep_spec = P(tok, None), P()
    args = [jax.sharding.reshard(a, NamedSharding(mesh, tok_spec)) for a in token_args]
    args += [jax.sharding.reshard(a, NamedSharding(mesh, rep_spec)) for a in call_args]
    in_specs = (tok_spec,) * len(token_args) + (rep_spec,) * len(call_args)
    out_specs = (tok_spec,) * num_outputs
    return jax.shard_map(lambda *a: tuple(fn(*a)), mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs)(*args)


def per_row_shard_sum(
    fn: Callable[..., jax.Array],
    rows: jax.Array,
    call_args: Sequence[jax.Array],
    row_args: Sequence[jax.Array] = (),
) -> jax.Array:
    """``fn(rows, *row_args, *call_args)`` for a loss that is a sum over rows, per row shard.

    Each shard computes its partial loss and the partials are psum'd over the
    token axes, so the result is the loss of the whole ``rows`` and its
    gradient flows back to each shard's rows. ``row_args`` (e.g. a token mask
    ``[T]``) are sharded along the rows with them; ``call_args`` replicated.
    """
    info = token_axes(rows)
    if info is None:
        return fn(rows, *row_args, *call_args)
    mesh, tok = info
    tok_spec, rep_spec = P(tok, None), P()
    rows = jax.sharding.reshard(rows, NamedSharding(mesh, tok_spec))
    row_args = [jax.sharding.reshard(a, NamedSharding(mesh, P(tok))) for a in row_args]
    call_args = [jax.sharding.reshard(a, NamedSharding(mesh, rep_spec)) for a in call_args]

    def local(r, *c):
        return lax.psum(fn(r, *c), _axis_names(tok))

    in_specs = (tok_spec,) + (P(tok),) * len(row_args) + (rep_spec,) * len(call_args)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=rep_spec)(rows, *row_args, *call_args)


def axis_size(op: str, axis_name) -> int:
    """The number of shards along ``axis_name`` (a name or tuple), checked to be
    bound; 1 for ``None``."""
    if axis_name is None:
        return 1
    size = 1
    for name in _axis_names(axis_name):
        try:
            size *= lax.axis_size(name)
        except NameError:
            from ._checks import unbound_axis_error

            raise unbound_axis_error(op, axis_name) from None
    return size
