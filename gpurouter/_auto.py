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
"""

from __future__ import annotations

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

    from .kernels.moe.combine import CMB_MAX_EXPERTS

    if any(jnp.dtype(d) not in (jnp.float32, jnp.bfloat16, jnp.float16) for d in dtypes):
        return False
    return num_experts is None or 0 <= num_experts <= CMB_MAX_EXPERTS
