"""Launch plumbing: the ONLY place that moves arrays between host and device,
reinterprets bfloat16, allocates outputs and resolves streams (grids and tile
sizes: each family's ``tiling.py``; plans and their executor: ``plan.py``).  The launcher
modules (``topk.py``, ``aux_scores.py``, ``aux_loss.py``, ``z_loss.py``) call
the helpers below; they never call ``cuda.to_device`` themselves.

Array conventions:

- Host inputs are NumPy arrays (``ml_dtypes.bfloat16`` for bf16).  When every
  array input of a launcher is on the host (and no ``out=`` is given), the
  launcher returns NumPy arrays.
- Device inputs are numba device arrays or anything with
  ``__cuda_array_interface__``; then the launcher returns numba device arrays.
- On the device, bfloat16 travels as its raw 16-bit words: a ``uint16`` array
  (or a CAI typestr ``<V2``) *is* a bf16 array here; integer logits are not a
  legal input anyway.  bf16 outputs on the device are ``uint16`` arrays.
"""

from __future__ import annotations

from . import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import warnings

import ml_dtypes  # ships with jax; no jax import
import numpy as np
from numba import cuda

# Element kinds as the kernels see them.  The kernel factories are specialised
# on these (compile-time conversion code), never on NumPy dtypes.
F32 = "f32"
BF16 = "bf16"  # raw uint16 words, converted in the kernel
F16 = "f16"  # native float16 (numba converts on the GPU and in the simulator)
INT = "int"  # integer counts (tokens_per_expert only)

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: the numba dtype a kernel sees for each kind of float.
DEVICE_DTYPE = {F32: np.dtype(np.float32), BF16: np.dtype(np.uint16), F16: np.dtype(np.float16)}


# ----------------------------------------------------------------------------
# Scalars and config
# ----------------------------------------------------------------------------

SIGMOID, SOFTMAX, SQRTSOFTPLUS = 0, 1, 2  # TE's codes (gpurouter.ScoreFunction)


def score_function_code(score_function, op: str) -> int:
    """``"softmax"``/``"sigmoid"``/``"sqrtsoftplus"``, 0/1/2 or a ScoreFunction -> code.

    The parsing and its error text are gpurouter._checks' (NumPy-only, no jax).
    """
    from ..._checks import score_function_of

    return int(score_function_of(op, score_function))


#: TE's ``routing_map_format`` codes: BYTEMAP, the ``[T, E]`` bool map; BITMAP_U8,
#: ``uint8[T, ceil(E/8)]`` with bit ``e % 8`` of byte ``e // 8`` set iff the token
#: routes to expert ``e`` (``np.packbits(map, axis=-1, bitorder="little")``),
#: the last byte's padding bits 0.
BYTEMAP, BITMAP_U8 = 0, 1


def map_format_code(map_format, op: str, name: str = "routing_map_format") -> int:
    """0 (BYTEMAP) or 1 (BITMAP_U8), as an int (any integer type, an IntEnum
    included; not a bool); anything else is a ValueError naming ``op`` and
    ``name``."""
    if isinstance(map_format, (int, np.integer)) and not isinstance(map_format, (bool, np.bool_)):
        if int(map_format) in (BYTEMAP, BITMAP_U8):
            return int(map_format)
    raise ValueError(f"{op}: {name} must be 0 (BYTEMAP: a [T, E] bool map) or 1 (BITMAP_U8: a "
                     f"uint8[T, ceil(E/8)] bitmap), got {map_format!r}.")


def bitmap_bytes(num_experts: int) -> int:
    """Bytes per token of a BITMAP_U8 routing map: ``ceil(E / 8)``."""
    return -(-int(num_experts) // 8)


def is_device_array(x) -> bool:
    """True for numba device arrays (real or simulated) and CAI objects."""
    if isinstance(x, np.ndarray) or x is None:
        return False
    return hasattr(x, "copy_to_host") or hasattr(x, "__cuda_array_interface__")


def any_on_device(*xs) -> bool:
    return any(is_device_array(x) for x in xs)


# ----------------------------------------------------------------------------
# Streams and launches
# ----------------------------------------------------------------------------


def resolve_stream(stream):
    """0/None -> the default stream (0); an int -> ``cuda.external_stream``; else as given.

    The simulator runs every launch synchronously and has no external
    streams, so there an int handle means the default stream.
    """
    if stream is None or (isinstance(stream, (int, np.integer)) and int(stream) == 0):
        return 0
    if isinstance(stream, (int, np.integer)) and simulator_enabled():
        return 0
    if isinstance(stream, (int, np.integer)):
        return cuda.external_stream(int(stream))
    return stream


def launch(kernel, grid: int, block: int, stream, shared_bytes: int, *args) -> None:
    """``kernel[grid, block, stream, shared_bytes](*args)``.

    Silences two warnings that say nothing about correctness here:
    numba's ``NumbaPerformanceWarning`` for small grids (tests, tiny T), and,
    on the simulator only, NumPy's ``RuntimeWarning`` for IEEE special values
    (the simulator computes on NumPy scalars, which warn on ``inf - inf``
    where the GPU silently gives NaN, as the contract wants).
    """
    with warnings.catch_warnings():
        # numba-cuda's NumbaPerformanceWarning (its own class, not numba.core's)
        warnings.filterwarnings(
            "ignore", message=r".*Grid size \d+ will likely result in GPU under-utilization")
        if simulator_enabled():
            warnings.simplefilter("ignore", RuntimeWarning)
        kernel[grid, block, stream, shared_bytes](*args)


def simulator_enabled() -> bool:
    """True when numba.cuda is the CUDA simulator (numba's own config, read at numba import)."""
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def kernel_jit(max_registers: int):
    """``cuda.jit``, with a register cap where one is asked for on a GPU (the
    simulator's ``jit`` takes none).  A cap is also a hint: without one, ptxas
    (CUDA 13.0, sm_90) may hold a kernel to fewer registers than it needs to
    keep a loop's loads in flight together (``losses/aux_loss.py``)."""
    if max_registers and not simulator_enabled():
        return cuda.jit(max_registers=int(max_registers))
    return cuda.jit


def sync(stream) -> None:
    if stream != 0:
        stream.synchronize()


# ----------------------------------------------------------------------------
# Arrays in
# ----------------------------------------------------------------------------


def _kind_of(dtype: np.dtype, on_device: bool, name: str, op: str, allow_int: bool) -> str:
    if dtype == np.float32:
        return F32
    if dtype == np.float16:
        return F16
    if dtype == BFLOAT16 or (on_device and dtype == np.uint16) or dtype.str in ("<V2", "|V2"):
        return BF16
    if allow_int and dtype in (np.int32, np.int64):
        return INT
    allowed = "float32, bfloat16 or float16"
    if allow_int:
        allowed = "int32, int64, float32 or bfloat16"
    raise TypeError(f"{op}: {name} must be {allowed}, got {dtype}.")


def kind_of_dtype(dtype, name: str, op: str) -> str:
    """The kind of a requested output dtype (float32, bfloat16 or float16)."""
    return _kind_of(np.dtype(dtype), False, name, op, False)


def _wrap_cai(x):
    """A numba device array over a CAI object (zero-copy); bf16 typestr -> uint16."""
    desc = dict(x.__cuda_array_interface__)
    if desc["typestr"] in ("<V2", "|V2"):
        desc["typestr"] = "<u2"
    return cuda.from_cuda_array_interface(desc, owner=x, sync=False)


def device_input(x, name: str, op: str, stream, *, allow_int: bool = False,
                 ndim: int | None = None):
    """Returns ``(device_array, kind)`` for an input, copying host data over.

    Raises:
      TypeError: float64 (or any other unsupported dtype).
      ValueError: wrong rank.
    """
    if is_device_array(x):
        if hasattr(x, "copy_to_host"):
            d = x
            if d.dtype == BFLOAT16:
                d = d.view(np.uint16)
        else:
            d = _wrap_cai(x)
        kind = _kind_of(np.dtype(d.dtype), True, name, op, allow_int)
    else:
        h = np.ascontiguousarray(np.asarray(x))
        kind = _kind_of(h.dtype, False, name, op, allow_int)
        if kind == BF16:
            h = h.view(np.uint16)
        d = cuda.to_device(h, stream=stream)
    if ndim is not None and len(d.shape) != ndim:
        raise ValueError(f"{op}: {name} must have rank {ndim}, got shape {tuple(d.shape)}.")
    return d, kind


def host_words(h, stream=0):
    """A host array (NumPy; bfloat16 as its 16-bit words) on the device, as the
    plans read it: the host transport's inputs, any dtype a plan takes."""
    h = np.ascontiguousarray(np.atleast_1d(np.asarray(h)))  # a 0-d scalar as (1,)
    if h.dtype == BFLOAT16:
        h = h.view(np.uint16)
    return cuda.to_device(h, stream=stream)


def scalar_input(x, name: str, op: str, stream, *, allow_int: bool = False):
    """A host scalar / 0-d array / device array -> ``((1,) device array, kind)``.

    Python floats become float32 (the kernels compute in fp32).
    """
    if not is_device_array(x) and isinstance(x, (float, int)) and not isinstance(x, bool):
        x = np.float32(x)
    d, kind = device_input(x, name, op, stream, allow_int=allow_int)
    if int(np.prod(d.shape)) != 1:
        raise ValueError(f"{op}: {name} must be a scalar, got shape {tuple(d.shape)}.")
    return d.reshape((1,)), kind


def map_input(x, name: str, op: str, stream, shape):
    """A routing map (host or device) for tokens x experts ``shape`` -> ``(device
    array, format)``: a bool ``[T, E]`` map is BYTEMAP, a uint8 ``[T, ceil(E/8)]``
    bitmap BITMAP_U8 (the format is the dtype's).  Any other dtype is a
    TypeError, a wrong shape a ValueError; both name ``op``, ``name``, what
    was seen and the rule."""
    if is_device_array(x):
        d = x if hasattr(x, "copy_to_host") else _wrap_cai(x)
    else:
        d = np.ascontiguousarray(np.asarray(x))
    dtype = np.dtype(d.dtype)
    t, e = (int(v) for v in shape)
    rule = (f"a bool [T, E] = [{t}, {e}] map (BYTEMAP) or a uint8 [T, ceil(E/8)] = "
            f"[{t}, {bitmap_bytes(e)}] bitmap (BITMAP_U8)")
    if dtype == np.bool_:
        fmt = BYTEMAP
    elif dtype == np.uint8:
        fmt = BITMAP_U8
    else:
        raise TypeError(f"{op}: {name} must be {rule}, got dtype {dtype} (shape {tuple(d.shape)}).")
    want = (t, bitmap_bytes(e)) if fmt == BITMAP_U8 else (t, e)
    if tuple(int(v) for v in d.shape) != want:
        raise ValueError(f"{op}: {name} must be {rule}, got shape {tuple(d.shape)} {dtype}.")
    if not is_device_array(x):
        d = cuda.to_device(d, stream=stream)
    return d, fmt


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


def index_input(x, name: str, op: str, stream, shape):
    """Expert indices ``[T, K]`` (the routing replay's ``forced_indices``) -> a
    device int32 array: host integers are converted (values outside int32
    become -1: they select nothing either way); a device array must already
    be int32.  A wrong shape is a ValueError, a non-integer dtype a TypeError."""
    shape = tuple(int(v) for v in shape)
    if is_device_array(x):
        d = x if hasattr(x, "copy_to_host") else _wrap_cai(x)
        if np.dtype(d.dtype) != np.int32:
            raise TypeError(f"{op}: a device {name} must be int32, got {d.dtype}.")
    else:
        h = np.asarray(x)
        if not np.issubdtype(h.dtype, np.integer):
            raise TypeError(f"{op}: {name} must be integers, got {h.dtype}.")
        big = (h < np.iinfo(np.int32).min) | (h > np.iinfo(np.int32).max)
        d = np.ascontiguousarray(np.where(big, -1, h).astype(np.int32))
    if tuple(int(v) for v in d.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {shape} (tokens, topk), got {tuple(d.shape)}.")
    if not is_device_array(x):
        d = cuda.to_device(d, stream=stream)
    return d


# ----------------------------------------------------------------------------
# Arrays out
# ----------------------------------------------------------------------------


def output(shape, kind_or_dtype, out, name: str, op: str, stream):
    """A device output: ``out`` (validated, zero-copy) or a fresh allocation."""
    dtype = DEVICE_DTYPE.get(kind_or_dtype, None)
    if dtype is None:
        dtype = np.dtype(kind_or_dtype)
    shape = tuple(int(s) for s in shape)
    if out is None:
        return cuda.device_array(shape, dtype=dtype, stream=stream)
    d = out if hasattr(out, "copy_to_host") else _wrap_cai(out)
    if np.dtype(d.dtype) == BFLOAT16:
        d = d.view(np.uint16)
    if tuple(d.shape) != shape or np.dtype(d.dtype) != dtype:
        raise ValueError(
            f"{op}: out {name} must be a device array of shape {shape} and dtype {dtype}, "
            f"got {tuple(d.shape)} {d.dtype}."
        )
    return d


def outs_tuple(out, n: int, op: str):
    if out is None:
        return (None,) * n
    if n == 1 and not isinstance(out, (tuple, list)):
        return (out,)
    if len(out) != n:
        raise ValueError(f"{op}: out must hold {n} arrays, got {len(out)}.")
    return tuple(out)


def finish(results, kinds, to_host: bool, stream):
    """Device results -> NumPy (bf16 words viewed as ml_dtypes.bfloat16) when ``to_host``."""
    if not to_host:
        return results
    hosts = [d.copy_to_host(stream=stream) for d in results]
    sync(stream)
    return tuple(
        h.view(BFLOAT16) if kind == BF16 else h for h, kind in zip(hosts, kinds, strict=True)
    )
