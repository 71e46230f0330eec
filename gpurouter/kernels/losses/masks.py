"""The losses' token masks on the host side (plans and launchers only): the
Spec of the bool ``[T]`` mask the masked kernels read.  The launchers bring a
``token_mask`` (bool or uint8 ``[T]``, host or device; nonzero = a valid row)
and the count ``T`` over with ``_base.launch.mask_input`` (docs/contract.md
section 10: the caller's ``total_num_tokens``, else ``max(valid count, 1)``)."""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import numpy as np

from .._base.launch import mask_input as mask_input  # the launchers' import point
from .._base.plan import Spec


def mask_spec(num_rows: int) -> Spec:
    """The Spec of a masked plan's mask input: bool ``[T]``."""
    return Spec((int(num_rows),), np.bool_, None)
