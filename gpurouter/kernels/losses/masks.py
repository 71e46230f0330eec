"""The losses' token masks on the host side (launchers only): a ``token_mask``
(bool or uint8 ``[T]``, host or device; nonzero = a valid row) as the bool
device array the masked kernels read, and the count ``T`` they divide by,
as a float32 ``[1]`` device array (docs/contract.md section 10: the caller's
``total_num_tokens``, else ``max(valid count, 1)``)."""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import numpy as np
from numba import cuda

from .._base.launch import _wrap_cai, is_device_array
from .._base.plan import Spec


def mask_spec(num_rows: int) -> Spec:
    """The Spec of a masked plan's mask input: bool ``[T]``."""
    return Spec((int(num_rows),), np.bool_, None)


def mask_input(token_mask, op: str, stream, num_rows: int, total_num_tokens):
    """``(mask bool [T] device array, n float32 [1] device array)``.

    ``token_mask``: bool or uint8 ``[T]`` (nonzero: valid), on the host or the
    device; another dtype is a ``TypeError``, another shape a ``ValueError``,
    both naming ``op`` and ``token_mask``.  ``total_num_tokens``: None (the
    valid count, at least 1: a device mask is copied to the host to count it),
    a number, or a device scalar (used as it is, cast to float32 on the host
    first if it is not float32)."""
    if is_device_array(token_mask):
        d = token_mask if hasattr(token_mask, "copy_to_host") else _wrap_cai(token_mask)
    else:
        d = np.ascontiguousarray(np.asarray(token_mask))
    dtype = np.dtype(d.dtype)
    if dtype not in (np.bool_, np.uint8):
        raise TypeError(f"{op}: token_mask must be bool or uint8 (nonzero = a valid row), got {dtype}.")
    if tuple(int(v) for v in d.shape) != (int(num_rows),):
        raise ValueError(f"{op}: token_mask shape {tuple(d.shape)} must be ({num_rows},).")
    if is_device_array(token_mask):
        host = None
        if dtype == np.uint8:
            d = d.view(np.bool_)
    else:
        host = d.astype(np.bool_)
        d = cuda.to_device(host, stream=stream)
    if total_num_tokens is None:
        if host is None:
            host = d.copy_to_host(stream=stream)
        n = np.float32(max(int(np.count_nonzero(host)), 1))
    elif is_device_array(total_num_tokens):
        t = total_num_tokens if hasattr(total_num_tokens, "copy_to_host") else _wrap_cai(total_num_tokens)
        if int(np.prod(t.shape)) != 1:
            raise ValueError(f"{op}: total_num_tokens must be a scalar, got shape {tuple(t.shape)}.")
        if np.dtype(t.dtype) == np.float32:
            return d, t.reshape((1,))
        n = np.float32(np.asarray(t.copy_to_host(stream=stream)).reshape(()))
    else:
        n = np.float32(total_num_tokens)
    return d, cuda.to_device(np.asarray([n], np.float32), stream=stream)
