"""The two routing-map formats (TE #3009), in plain jnp: packing, unpacking, counting.

``RoutingMapFormat.BYTEMAP`` is ``bool [..., E]``; ``BITMAP_U8`` is
``uint8 [..., ceil(E / 8)]`` with bit ``e % 8`` of byte ``e // 8`` set iff
the token routes to expert ``e`` (least significant bit first, as
``np.packbits(..., bitorder="little")``) and the padding bits of the last
byte 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import RoutingMapFormat, check_routing_map, check_token_mask

_WEIGHTS = np.array([1 << b for b in range(8)], np.uint8)  # bit b of a byte


def _weights(ndim: int) -> jax.Array:
    """The eight bit weights along the last of ``ndim`` axes (explicit rank: no promotion)."""
    return jnp.asarray(_WEIGHTS).reshape((1,) * (ndim - 1) + (8,))


def pack_routing_map(routing_map: jax.typing.ArrayLike) -> jax.Array:
    """``bool [..., E]`` -> ``uint8 [..., ceil(E / 8)]`` (BYTEMAP -> BITMAP_U8).

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter import reference as ref
      >>> ref.pack_routing_map(jnp.array([[True, False, False, True, False, False, False, False, True]])).tolist()
      [[9, 1]]
    """
    _, num_experts = check_routing_map("pack_routing_map", routing_map, None, bytemap_only=True)
    m = jnp.asarray(routing_map)
    nbytes = -(-num_experts // 8)
    pad = [(0, 0)] * (m.ndim - 1) + [(0, 8 * nbytes - num_experts)]
    bits = jnp.pad(m, pad).reshape(m.shape[:-1] + (nbytes, 8)).astype(jnp.uint8)
    return jnp.sum(bits * _weights(bits.ndim), axis=-1, dtype=jnp.uint8)


def unpack_routing_map(routing_map: jax.typing.ArrayLike, num_experts: int) -> jax.Array:
    """``uint8 [..., ceil(E / 8)]`` -> ``bool [..., E]`` (BITMAP_U8 -> BYTEMAP).

    A bool map (BYTEMAP) of ``num_experts`` columns is returned unchanged, so
    code that takes either format can call this first.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter import reference as ref
      >>> ref.unpack_routing_map(jnp.array([[9, 1]], jnp.uint8), 9).astype(int).tolist()
      [[1, 0, 0, 1, 0, 0, 0, 0, 1]]
    """
    fmt, num_experts = check_routing_map("unpack_routing_map", routing_map, num_experts)
    m = jnp.asarray(routing_map)
    if fmt == RoutingMapFormat.BYTEMAP:
        return m
    bits = (m[..., None] & _weights(m.ndim + 1)) != 0  # [..., B, 8]
    return bits.reshape(m.shape[:-1] + (8 * m.shape[-1],))[..., :num_experts]


def tokens_per_expert(routing_map: jax.typing.ArrayLike, num_experts: int | None = None, *,
                      token_mask: jax.typing.ArrayLike | None = None) -> jax.Array:
    """Tokens routed to each expert, ``int32 [E]``, from either map format.

    What :func:`gpurouter.fused_moe_aux_loss` takes as ``tokens_per_expert``:
    the map's rows summed over every leading dim. ``num_experts`` is needed
    for a bitmap (its byte count only bounds E) and optional for a bool map.
    ``token_mask`` (bool, the map's leading shape or flat ``[T]``): masked
    rows count nowhere (docs/contract.md section 10).

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter import reference as ref
      >>> ref.tokens_per_expert(jnp.array([[True, False, True], [True, True, False]])).tolist()
      [2, 1, 1]
      >>> ref.tokens_per_expert(jnp.array([[5], [3]], jnp.uint8), num_experts=3).tolist()
      [2, 1, 1]
    """
    _, num_experts = check_routing_map("tokens_per_expert", routing_map, num_experts)
    m = unpack_routing_map(routing_map, num_experts).reshape(-1, num_experts)
    if token_mask is not None:
        check_token_mask("tokens_per_expert", token_mask, tuple(jnp.shape(routing_map)[:-1]))
        m = m & jnp.asarray(token_mask).reshape(-1, 1)
    return jnp.sum(m, axis=0, dtype=jnp.int32)


def map_of_format(mask: jax.Array, routing_map_format: RoutingMapFormat) -> jax.Array:
    """A bool mask in the requested format (the reference's last step)."""
    return pack_routing_map(mask) if routing_map_format == RoutingMapFormat.BITMAP_U8 else mask
