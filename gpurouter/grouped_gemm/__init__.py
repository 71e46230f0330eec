"""Grouped GEMMs as Pallas kernels (``jax.lax.ragged_dot``'s signature);
separate from ``gpurouter.kernels`` (Numba-CUDA): ``pallas_ragged_dot`` (our
kernels, Triton lowering) and ``mosaic_ragged_dot`` (jax's Mosaic-GPU kernels
behind ragged_dot's signature and a custom VJP)."""

from .mosaic import mosaic_ragged_dot as mosaic_ragged_dot
from .pallas import pallas_ragged_dot as pallas_ragged_dot

__all__ = ["mosaic_ragged_dot", "pallas_ragged_dot"]
