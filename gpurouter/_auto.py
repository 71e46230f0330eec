"""``backend="auto"``: where the kernels measured faster than the jnp reference.

The one rule (docs/contract.md section 5; the measurements behind each
threshold, GPU, date and commit: docs/performance.md, "Where
`backend="auto"` picks the kernels"). ``backend="auto"`` picks the numba
kernels only when JAX runs on a CUDA GPU with a device transport and:

- the call has at least ``AUTO_MIN_ELEMENTS[transport]`` logits (tokens x
  experts): below that the launch cost (one per forward, one per backward)
  outweighs the work. The zero-copy transport costs more per call (its
  Python), so its threshold is twice as high;
- for the router top-k: K <= ``AUTO_MAX_TOPK``, the largest K measured end
  to end (Nemotron-3 Super, E=512, K=22), and neither ``return_indices``
  nor ``forced_indices`` (not measured end to end).

The token-level MoE ops (``moe_kernels_faster``): the kernels from
``AUTO_MOE_MIN_ELEMENTS`` elements of the op's row buffer (rows x hidden;
the dispatch's output, the combine's input, the bias gradients' ``dy``),
``token_dispatch`` from ``AUTO_DISPATCH_MIN_ELEMENTS``, where its forward
alone stops losing. Below 2^23 nothing is measured. The z-loss has no
end-to-end measurement yet: "auto" keeps it on jax.

The MoE ops' whole backend choice lives here too: ``moe_op_on_kernels`` (one
token-level op: the backend and transport checked, then the rule above) and
``moe_block_on_kernels`` (the MoE block's dispatch and combine).
"""

from __future__ import annotations

import math

import jax
import numpy as np

from . import _backend
from ._checks import TOKEN_COMBINE_OP, check_moe_kernel_backend, check_transport

AUTO_MAX_TOPK = 22
AUTO_MIN_ELEMENTS = {"ffi": 1 << 19, "zero-copy": 1 << 20}
AUTO_MOE_MIN_ELEMENTS = 1 << 23
AUTO_DISPATCH_MIN_ELEMENTS = 1 << 27


def kernels_faster(op: str, transport: str, num_tokens: int, num_experts: int,
                   topk: int | None = None) -> bool:
    """True where the kernels measured faster for this call (asked only when
    JAX runs on a CUDA GPU, see ``_backend.resolve``)."""
    from ._transport import resolve_transport

    if topk is not None and topk > AUTO_MAX_TOPK:
        return False
    try:
        transport = resolve_transport(op, transport)
    except RuntimeError:  # an explicit transport that cannot run here
        return False
    return num_tokens * num_experts >= AUTO_MIN_ELEMENTS.get(transport, float("inf"))


def moe_kernels_faster(op: str, transport: str, row_elements: int, dtypes, num_experts: int | None = None) -> bool:
    """True where the MoE kernels measured faster for this call and take it:
    float32/bfloat16/float16 ``dtypes``, at most the combine kernel's experts,
    a device transport (asked only when JAX runs on a CUDA GPU)."""
    from ._checks import TOKEN_DISPATCH_OP
    from ._transport import resolve_transport

    if not moe_kernels_take(dtypes, num_experts):
        return False
    try:
        if resolve_transport(op, transport) == "callback":
            return False
    except RuntimeError:  # an explicit transport that cannot run here
        return False
    floor = AUTO_DISPATCH_MIN_ELEMENTS if op == TOKEN_DISPATCH_OP else AUTO_MOE_MIN_ELEMENTS
    return row_elements >= floor


def moe_kernels_take(dtypes, num_experts: int | None = None) -> bool:
    """True when the MoE kernels take these arrays: float32/bfloat16/float16
    ``dtypes`` and at most the combine kernel's ``num_experts`` (None: no
    experts involved; -1: not known here, so no)."""
    import jax.numpy as jnp

    from .kernels.moe.permute import CMB_MAX_EXPERTS

    if any(jnp.dtype(d) not in (jnp.float32, jnp.bfloat16, jnp.float16) for d in dtypes):
        return False
    return num_experts is None or 0 <= num_experts <= CMB_MAX_EXPERTS


def moe_op_on_kernels(op: str, backend: str, transport: str, rows: int | None, *arrays, maps=None) -> bool:
    """True when the token-level MoE op ``op`` runs on the kernels:
    ``backend`` and ``transport`` checked first; ``"auto"`` where they
    measured faster (:func:`moe_kernels_faster`) for ``rows`` (None: the last
    array's) x hidden (the last array's last axis) elements, ``arrays``'
    dtypes and the E of ``maps`` = ``(index_map, probs or None)``. Anything
    that is not a concrete, well-formed call (a list, a traced size, a wrong
    rank) stays on the reference, whose checks say what is wrong."""
    check_moe_kernel_backend(op, backend)
    check_transport(op, transport)

    def faster() -> bool:
        if not all(isinstance(a, jax.Array | np.ndarray) for a in arrays) or np.ndim(arrays[-1]) < 1:
            return False
        n = arrays[-1].shape[0] if rows is None else rows
        if not isinstance(n, int | np.integer):
            return False
        experts = None if maps is None else _experts(*maps)
        return moe_kernels_faster(op, transport, int(n) * arrays[-1].shape[-1], [a.dtype for a in arrays], experts)

    return _backend.resolve(op, backend, faster=faster) == "numba"


def _experts(index_map, probs) -> int:
    """E of a ``[T, E]`` map (a packed BITMAP_U8 map: ``probs``' E), -1 where not known."""
    if isinstance(probs, jax.Array | np.ndarray) and probs.ndim == 2:
        return probs.shape[1]
    if isinstance(index_map, jax.Array | np.ndarray) and index_map.ndim == 2 and index_map.dtype != np.uint8:
        return index_map.shape[1]
    return -1


def moe_block_on_kernels(x, num_experts: int, topk: int, backend: str) -> bool:
    """True when the MoE block's dispatch and combine run on the kernels:
    ``"numba"`` where they take the rows, ``"auto"`` where the combine's
    measured rule (:func:`moe_kernels_faster`) picks them for the ``T K x H``
    rows (the backend and transport were checked by the block)."""
    if not isinstance(x, jax.Array | np.ndarray) or x.ndim < 1 or not isinstance(num_experts, int):
        return False  # the block's checks say what is wrong
    if math.prod(x.shape[:-1]) == 0:
        return False  # no tokens: the argsort form's empty rows (a dispatch of 0 rows has no kernel launch)
    if backend == "numba":
        return moe_kernels_take([x.dtype], num_experts)
    rows = math.prod(x.shape[:-1]) * topk * x.shape[-1]
    return backend == "auto" and _backend.resolve(TOKEN_COMBINE_OP, "auto", faster=lambda: moe_kernels_faster(
        TOKEN_COMBINE_OP, "auto", rows, [x.dtype], num_experts)) == "numba"
