"""Manual-axis types inside ``jax.shard_map``: which mesh axes a value varies
over, and marking outputs varying like their inputs. Shared by the
transports (a callback's outputs come out invariant) and expert parallelism
(``ragged_all_to_all``'s result takes its output buffer's type)."""

from __future__ import annotations

import jax
from jax import lax


def varying(x) -> frozenset:
    """The manual mesh axes ``x`` varies along (empty outside shard_map)."""
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):  # jax < 0.10 spelling
        return frozenset(aval.vma)
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10+
    return frozenset(getattr(mat, "varying", ()) or ())


def match_varying_axes(outs, ins, also=()):
    """Marks the outputs varying over every manual mesh axis an input varies over.

    Inside ``shard_map`` JAX types each value with the manual axes it varies
    along; a callback's outputs come out typed invariant, which would break
    ``custom_vjp`` (cotangent types must match the primal inputs) and any
    later collective. The outputs of a per-shard kernel vary as its inputs do;
    ``also`` names more axes (a name or a tuple) they vary over.
    """
    vma = frozenset().union(*(varying(a) for a in ins), (also,) if isinstance(also, str) else also)
    fixed = []
    for o in outs:
        missing = tuple(sorted(vma - varying(o)))
        fixed.append(lax.pcast(o, missing, to="varying") if missing else o)
    return tuple(fixed)
