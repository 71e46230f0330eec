"""Token masks as bitwise selects (device functions only; the masked loss kernels
``column_sums.py``, ``aux_loss_bwd.py`` and ``z_loss_unit.py`` use them):

- ``all_ones_if(bit)``: ``0xFFFFFFFF`` for 1, 0 for 0;
- ``keep_if(v, m)``: fp32 ``v`` where ``m`` is all ones, +0.0 where it is 0,
  whatever ``v`` is (NaN and inf too): a select on the bits, no branch, so no
  load is made to wait on a mask byte.

Until 2026-11-29 the aux loss forward staged its block's mask here as bits in
shared memory; a mask byte loaded with each row's values (``column_sums``) is
faster on an H200 once ptxas keeps the loads in flight (docs/kernels.md,
"Token masks in the loss kernels").
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import numpy as np
from numba import cuda

#: every bit of a uint32 (``all_ones_if``)
ALL_ONES = np.uint32(0xFFFFFFFF)


@cuda.jit(device=True)
def all_ones_if(bit):
    """``0xFFFFFFFF`` for ``bit`` 1, 0 for 0 (a uint32 0 or 1)."""
    return np.uint32(ALL_ONES * np.uint32(bit))


@cuda.jit(device=True)
def keep_if(v, m):
    """fp32 ``v`` where ``m`` is ``0xFFFFFFFF``, +0.0 where it is 0: a select on
    the bits (no branch, so no load is made conditional on the mask; a masked
    NaN or inf becomes +0.0, what a zeroed row adds)."""
    return np.uint32(np.float32(v).view(np.uint32) & m).view(np.float32)
