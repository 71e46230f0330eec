"""Grouped GEMMs as Pallas kernels (``jax.lax.ragged_dot``'s signature);
separate from ``gpurouter.kernels`` (Numba-CUDA)."""

from .pallas import pallas_ragged_dot as pallas_ragged_dot

__all__ = ["pallas_ragged_dot"]
