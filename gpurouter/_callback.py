"""The callback plumbing between JAX and the numba kernels: the one place that
calls ``jax.pure_callback``.

``kernel_call(launcher, out_specs, token_args, call_args, ...)`` runs a kernel
launcher on host copies of JAX arrays and returns JAX arrays:

- results are declared once, by ``out_specs`` (``jax.ShapeDtypeStruct``\\ s of
  the unbatched call);
- inputs are copied out of JAX's read-only host buffers (``np.array``) before a
  launcher sees them (numba and the simulator write back into their
  arguments);
- ``vmap`` uses ``vmap_method="expand_dims"``: batch dims arrive as leading
  axes. Per-token arrays (``token_args``, rows independent) fold the batch into
  the token axis when every per-call array (``call_args``: biases, counts,
  scalars) is unbatched; otherwise the launcher runs once per batch element.
  Ops whose rows are not independent (the aux loss) pass everything as
  ``call_args``.

Nothing here validates input: the ops check everything at trace time, before
they get here, because an exception inside a callback is undefined behaviour
in JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

Launcher = Callable[..., Sequence[np.ndarray]]


def _host(x) -> np.ndarray:
    """A writable, C-contiguous NumPy copy of a JAX host buffer."""
    return np.array(x, copy=True, order="C")


def _run_batched(
    launcher: Launcher,
    out_specs: Sequence[jax.ShapeDtypeStruct],
    n_token: int,
    args: Sequence[np.ndarray],
) -> tuple[np.ndarray, ...]:
    """Runs ``launcher`` on arrays that may carry leading vmap batch dims."""
    token, call = args[:n_token], args[n_token:]
    # Batch dims = leading dims before [T, E] of the first per-token array
    # (expand_dims gives every argument the same number of them). Ops with no
    # per-token arrays use vmap_method="sequential" and never see batch dims.
    nb = len(token[0].shape) - 2 if token else 0
    batch = _batch_shape(args, nb)
    if nb == 0:
        return tuple(np.asarray(o, dtype=s.dtype) for o, s in zip(launcher(*args), out_specs, strict=True))
    if token and all(int(np.prod(a.shape[:nb])) == 1 for a in call):
        rows = int(np.prod(batch)) * token[0].shape[nb]
        flat = [np.ascontiguousarray(a.reshape((rows,) + a.shape[nb + 1 :])) for a in token]
        outs = launcher(*flat, *(a.reshape(a.shape[nb:]) for a in call))
        return tuple(
            np.asarray(o, dtype=s.dtype).reshape(batch + tuple(s.shape))
            for o, s in zip(outs, out_specs, strict=True)
        )
    results = [np.empty(batch + tuple(s.shape), s.dtype) for s in out_specs]
    for idx in np.ndindex(*batch):
        sliced = [np.ascontiguousarray(np.broadcast_to(a, batch + a.shape[nb:])[idx]) for a in args]
        for r, o in zip(results, launcher(*sliced), strict=True):
            r[idx] = o
    return tuple(results)


def _batch_shape(args: Sequence[np.ndarray], nb: int) -> tuple[int, ...]:
    shape = [1] * nb
    for a in args:
        for i in range(nb):
            shape[i] = max(shape[i], a.shape[i])
    return tuple(shape)


def kernel_call(
    launcher: Launcher,
    out_specs: Sequence[jax.ShapeDtypeStruct],
    token_args: Sequence[jax.Array],
    call_args: Sequence[jax.Array] = (),
) -> tuple[jax.Array, ...]:
    """Calls ``launcher(*token_args, *call_args)`` on host copies through ``jax.pure_callback``.

    Args:
      launcher: takes NumPy arrays, returns a sequence of NumPy arrays matching
        ``out_specs``; all static configuration is bound into it already.
      out_specs: shapes and dtypes of the outputs of one unbatched call.
      token_args: arrays whose leading axis is tokens (rows independent); empty
        for ops that reduce over rows, which then run once per vmap element.
      call_args: the other array arguments (biases, counts, scalars).
    """
    n_token = len(token_args)

    def host_fn(*args):
        return _run_batched(launcher, out_specs, n_token, [_host(a) for a in args])

    vmap_method = "expand_dims" if n_token else "sequential"
    return tuple(
        jax.pure_callback(
            host_fn, tuple(out_specs), *token_args, *call_args, vmap_method=vmap_method
        )
    )
