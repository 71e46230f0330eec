"""The numba kernels' limits, in one place.

- ``MAX_EXPERTS``: one token's fp32 row (plus a one-byte selection flag per
  expert) must fit in the 48 KiB of shared memory a block gets without opt-in;
  the tile holds at least one token.
- ``MAX_TOPK``: the per-thread insertion top-K lives in a ``cuda.local.array``
  whose size is a compile-time constant (specialised to 8, 16, 32 or 64).
- ``MAX_GROUPS``: the per-thread group scores live in a local array too.
"""

from __future__ import annotations

MAX_EXPERTS = 8192
MAX_TOPK = 64
MAX_GROUPS = 64

#: shared-memory budget of one block (bytes), without the opt-in carve-out.
SMEM_BUDGET = 48 * 1024


def check_limits(op: str, num_experts: int, topk: int = 1, num_groups: int = 1) -> None:
    """Raises ``NotImplementedError`` when a valid config exceeds a kernel limit.

    Args:
      op: the public op's name, for the message.
      num_experts: E.
      topk: K.
      num_groups: G (1 when grouping is off).

    Raises:
      NotImplementedError: ``E > MAX_EXPERTS``, ``K > MAX_TOPK`` or ``G > MAX_GROUPS``.
    """
    for name, value, limit in (
        ("num_experts", num_experts, MAX_EXPERTS),
        ("topk", topk, MAX_TOPK),
        ("num_groups", num_groups, MAX_GROUPS),
    ):
        if value > limit:
            raise NotImplementedError(
                f"{op} (numba): {name} ({value}) exceeds the kernel limit of {limit}; "
                'use backend="jax".'
            )


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1)."""
    return 1 << max(0, n - 1).bit_length()
