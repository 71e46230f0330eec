"""What the transports share: vmap batches as launches, the plan memo, bf16 words.

- ``launches(ins, n_token)``: the launches that cover one call whose arrays
  may carry leading vmap batch dims (``vmap_method="expand_dims"``): per-token
  arrays fold the batch into the token axis when every per-call array
  (biases, counts, scalars) is unbatched; otherwise one launch per batch
  element. Works on NumPy arrays and on raw pointers (``buffer.Ptr``).
- ``plan_of(planner, arrays)``: the kernel plan for arrays' shapes, memoised.
- ``to_words``/``word_spec``: bfloat16 crosses to the kernels as its raw
  16-bit words (a ``uint16`` bitcast): the CUDA array interface and XLA's FFI
  buffers carry no bf16 type the kernels could take.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# numba's own state (its device list, compilation) is set up on first use
# from whichever XLA thread gets there first: serialised.
COMPILE_LOCK = threading.Lock()


def launches(ins: Sequence, n_token: int):
    """The launches that cover one callback whose arrays may carry vmap batch dims.

    Returns ``(batch, launches)``: ``batch`` is the leading batch shape (``()``
    when unbatched) and ``launches`` yields ``(args, view)`` pairs: the
    plan's inputs, and a function that maps a whole output array
    (``batch + unbatched shape``) to the part this launch fills. Works on
    NumPy arrays and on numba device arrays alike (reshape and indexing give
    views on both). One launch when unbatched or when the batch folds into
    the token axis (every per-token array carries the whole batch and no
    per-call array is batched); else one launch per batch element.
    """
    token, call = ins[:n_token], ins[n_token:]
    # Batch dims = leading dims before [T, E] of the first per-token array
    # (expand_dims gives every argument the same number of them). Ops with no
    # per-token arrays use vmap_method="sequential" and never see batch dims.
    nb = len(token[0].shape) - 2 if token else 0
    batch = _batch_shape(ins, nb)

    def generate():
        if nb == 0:
            yield list(ins), lambda o: o
        elif _foldable(token, call, batch, nb):
            rows = int(np.prod(batch)) * token[0].shape[nb]
            yield ([a.reshape((rows,) + tuple(a.shape[nb + 1 :])) for a in token]
                   + [a.reshape(tuple(a.shape[nb:])) for a in call],
                   lambda o: o.reshape((rows,) + tuple(o.shape[nb + 1 :])))
        else:
            for idx in np.ndindex(*batch):
                args = [a[tuple(i if a.shape[d] > 1 else 0 for d, i in enumerate(idx))] for a in ins]
                yield args, lambda o, idx=idx: o[idx]

    return batch, generate()


def _foldable(token, call, batch: tuple[int, ...], nb: int) -> bool:
    """The batch folds into tokens iff every per-token array carries all of it
    and no per-call array (bias, ...) is batched."""
    return all(tuple(a.shape[:nb]) == batch for a in token) and all(
        int(np.prod(a.shape[:nb])) == 1 for a in call
    )


def _batch_shape(args: Sequence[np.ndarray], nb: int) -> tuple[int, ...]:
    shape = [1] * nb
    for a in args:
        for i in range(nb):
            shape[i] = max(shape[i], a.shape[i])
    return tuple(shape)


_PLANS: dict = {}


def plan_of(planner, arrays):
    """``planner(*specs of arrays)``, memoised per planner and input shapes/dtypes."""
    key = (planner, *((a.shape, a.dtype) for a in arrays))
    plan = _PLANS.get(key)
    if plan is None:
        from ..kernels._base.plan import spec_for

        if len(_PLANS) > 4096:  # one entry per traced call site and shape: bounded anyway
            _PLANS.clear()
        plan = _PLANS[key] = planner(*(spec_for(a.shape, a.dtype) for a in arrays))
    return plan


def to_words(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def word_spec(spec: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    if spec.dtype == jnp.bfloat16:
        return jax.ShapeDtypeStruct(spec.shape, jnp.uint16)
    return spec
