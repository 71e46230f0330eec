"""Launch plumbing: the ONLY place that computes grids and tile sizes, moves
arrays between host and device, reinterprets bfloat16, allocates outputs and
resolves streams.  The op modules (``topk.py``, ``aux_scores.py``,
``aux_loss.py``) describe kernels and call the helpers below; they never call
``cuda.to_device`` themselves.

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

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import warnings

import ml_dtypes  # ships with jax; no jax import
import numpy as np
from numba import cuda

from ._limits import SMEM_BUDGET

# Element kinds as the kernels see them.  The kernel factories are specialised
# on these (compile-time conversion code), never on NumPy dtypes.
F32 = "f32"
BF16 = "bf16"  # raw uint16 words, converted in the kernel
F16 = "f16"  # native float16 (numba converts on the GPU and in the simulator)
INT = "int"  # integer counts (tokens_per_expert only)

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: the numba dtype a kernel sees for each kind of float.
DEVICE_DTYPE = {F32: np.dtype(np.float32), BF16: np.dtype(np.uint16), F16: np.dtype(np.float16)}
#: the host dtype the caller sees.
HOST_DTYPE = {F32: np.dtype(np.float32), BF16: BFLOAT16, F16: np.dtype(np.float16)}



# ----------------------------------------------------------------------------
# Scalars and config
# ----------------------------------------------------------------------------

SIGMOID, SOFTMAX, SQRTSOFTPLUS = 0, 1, 2  # TE's codes (gpurouter.ScoreFunction)


def score_function_code(score_function, op: str) -> int:
    """``"softmax"``/``"sigmoid"``/``"sqrtsoftplus"``, 0/1/2 or a ScoreFunction -> code.

    The parsing and its error text are gpurouter._checks' (NumPy-only, no jax).
    """
    from .._checks import score_function_of

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


# ----------------------------------------------------------------------------
# Grids
# ----------------------------------------------------------------------------


#: threads per block of the row forward kernels (top-k, aux scores)
#: before shared memory forces fewer: several tokens of W lanes each.
ROW_THREADS = 128
#: W doubles (up to 32) while a lane would scan more experts than this.
ROW_EXPERTS_PER_LANE = 32


def row_lanes(num_experts: int) -> int:
    """W, the lanes (threads) per token of the row kernels: a power of two in
    [1, 32], the smallest with ``W * 32 >= E`` (E <= 32: 1, E=128: 4,
    E=256: 8, E >= 1024: 32).  Fewer lanes cost fewer merge levels (the
    per-token instruction count of the selection falls with W) but need
    more tokens per block for the same threads, i.e. more shared memory."""
    w = 1
    while w < 32 and w * ROW_EXPERTS_PER_LANE < num_experts:
        w *= 2
    return w


def row_stride(num_experts: int, lanes: int = 1) -> int:
    """Shared-memory row stride P (4-byte words) of a tile row.

    Lane ``l`` of the token in tile row ``t`` reads words ``t*P + l + i*W``;
    a warp holds ``32/W`` tokens.  With ``P`` a multiple of ``W`` and ``P/W``
    odd, ``(t*P + l) % 32`` differs for every thread of a warp: the lane
    scans are bank-conflict-free.  (W = 32: one token per warp, any P.)
    """
    if lanes >= 32:
        return num_experts
    m = -(-num_experts // lanes)
    return (m | 1) * lanes


class RowLayout:
    """Launch shape and dynamic shared-memory layout of one row kernel.

    ``tb`` tokens per block, ``lanes`` (W) threads per token, ``threads = tb*W``.
    Word offsets (fp32 / int32 views of the one dynamic allocation):

    - forward (``select_layout``)::

        [0, tb*P)        fp32 tile: the scores of the block's tokens, row stride P
        o_list  + [threads * LS]   fp32 per-lane top-K values (LS = K | 1);
                                    also the lane partials of the row statistics
        o_idx   + [threads * LS]   int32 per-lane top-K expert indices
        o_cnt   + [threads]        int32 per-lane list lengths
        o_grp   + [tb * G]         fp32 group scores (grouped only)
        o_keep  + [tb * G]         int32 kept-group flags (grouped only)
        o_flag  (bytes) + [tb*P]   uint8 selection flags

    (The backward kernels stream their rows from global memory and need no
    tile: ``stream_tiling``.)
    """

    __slots__ = ("grid", "threads", "tb", "lanes", "stride", "list_stride", "group_lanes",
                 "o_list", "o_idx", "o_cnt", "o_grp", "o_keep", "o_flag", "shared")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k, -1))

    def __repr__(self):
        return "RowLayout(" + ", ".join(f"{k}={getattr(self, k)}" for k in self.__slots__) + ")"


def _select_words(tb: int, lanes: int, p: int, ls: int, groups: int):
    threads = tb * lanes
    o_list = tb * p
    o_idx = o_list + threads * ls
    o_cnt = o_idx + threads * ls
    o_grp = o_cnt + threads
    o_keep = o_grp + tb * groups
    end = o_keep + tb * groups
    return o_list, o_idx, o_cnt, o_grp, o_keep, end


def select_layout(num_tokens: int, num_experts: int, topk: int, num_groups: int = 0,
                  lanes: int | None = None) -> RowLayout:
    """Layout of the forward row kernels (top-k fwd, aux scores fwd).

    ``num_groups``: G when grouping is on, else 0.  W = ``row_lanes(E)``
    (or ``lanes``); the block takes ``ROW_THREADS / W`` tokens, fewer (then
    fewer lanes) until the shared memory fits ``SMEM_BUDGET``.  Group lanes:
    ``W / G`` lanes share a group in the group-score pass when G divides W,
    else 1 lane takes whole groups.
    """
    w = row_lanes(num_experts) if lanes is None else int(lanes)
    ls = topk | 1  # odd list stride: lanes reading slot q of their lists hit distinct banks
    g = max(0, int(num_groups))
    tb = max(1, ROW_THREADS // w)
    while True:
        p = row_stride(num_experts, w)
        end = _select_words(tb, w, p, ls, g)[-1]
        if end * 4 + tb * p <= SMEM_BUDGET:
            break
        if tb > 1:
            tb //= 2
        elif w > 1:
            w //= 2
        else:
            raise NotImplementedError(f"E={num_experts}, K={topk}: one token does not fit "
                                      f"{SMEM_BUDGET} bytes of shared memory")
    tb = max(1, min(tb, num_tokens))
    o_list, o_idx, o_cnt, o_grp, o_keep, end = _select_words(tb, w, p, ls, g)
    glanes = w // g if 0 < g <= w and w % g == 0 else 1
    return RowLayout(grid=-(-num_tokens // tb), threads=tb * w, tb=tb, lanes=w, stride=p,
                     list_stride=ls, group_lanes=glanes, o_list=o_list, o_idx=o_idx,
                     o_cnt=o_cnt, o_grp=o_grp, o_keep=o_keep, o_flag=end * 4,
                     shared=end * 4 + tb * p)


#: the thread-per-token forward kernels (``token_rows.py``) take K <= this
#: (their top-K lists live in registers) and E a multiple of 4
TOKEN_MAX_TOPK = 16
#: tokens per block of the thread-per-token kernels at most, threads at least
TOKEN_MAX_TOKENS = 256
TOKEN_MIN_THREADS = 256  # H200, DeepSeek-V3 fwd: 213 us; 128: 233, 512: 310 (tools/tiling_sweep.py)


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1)."""
    c = 1
    while c < n:
        c *= 2
    return c


def _token_words(tb: int, num_experts: int, num_groups: int, has_bias: bool) -> int:
    """Shared-memory words of a thread-per-token block (see ``TokenLayout``)."""
    g = (num_groups | 1) if num_groups > 0 else 0
    return tb * ((num_experts | 1) + token_flag_stride(num_experts) + g + 4) + (num_experts if has_bias else 0)


def token_flag_stride(num_experts: int) -> int:
    """Words per token of the thread-per-token kernels' selection bits (a bit
    per expert; odd, so a warp's rows hit distinct banks)."""
    return -(-num_experts // 32) | 1


def token_path(num_experts: int, topk: int, num_groups: int = 0, has_bias: bool = False) -> bool:
    """True when the thread-per-token forward kernels take ``(E, K)``: K <=
    ``TOKEN_MAX_TOPK``, E a multiple of 4, and one token's block fits
    ``SMEM_BUDGET``."""
    return (1 <= topk <= TOKEN_MAX_TOPK and num_experts % 4 == 0
            and 4 * _token_words(1, num_experts, max(0, int(num_groups)), has_bias) <= SMEM_BUDGET)


class TokenLayout:
    """Launch shape and shared memory of a thread-per-token kernel: ``tb``
    tokens per block (thread t owns tile row t), ``threads >= tb``.  Word
    offsets of the fp32 / int32 views of the one dynamic allocation::

        [0, tb*P)              fp32 tile, row stride P = E | 1
        o_flag + [tb * F]      selection bits (the bit way only), a bit per expert,
                               row stride F = ceil(E/32) | 1 words
        o_gs   + [tb * (G|1)]  fp32 group scores (grouped only), row stride G | 1
        o_red  + [2 * tb]      fp32 row statistics (softmax / normalisation / weights)
        o_thr  + [2 * tb]      per token: fp32 selection threshold (NaN: read the bits),
                               then int32 tie cutoff (token_rows._selector)
        o_bias + [E]           fp32 expert bias

    (Odd row strides: a warp's threads, one per row, hit distinct banks.)
    """

    __slots__ = ("grid", "threads", "tb", "stride", "o_flag", "o_gs", "o_red", "o_thr", "o_bias",
                 "shared")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw[k])

    def __repr__(self):
        return "TokenLayout(" + ", ".join(f"{k}={getattr(self, k)}" for k in self.__slots__) + ")"


def token_layout(num_tokens: int, num_experts: int, num_groups: int = 0,
                 has_bias: bool = False) -> TokenLayout:
    """Layout of the thread-per-token kernels (``token_path``): as many tokens
    per block (a power of two, at most ``TOKEN_MAX_TOKENS``, at most T) as fit
    ``SMEM_BUDGET``; threads: the tokens, at least ``TOKEN_MIN_THREADS`` (the
    coalesced phases want them) unless the tile has fewer quads, a multiple of
    32.  The bias (``has_bias``) takes E words."""
    g = max(0, int(num_groups))
    tb = TOKEN_MAX_TOKENS
    while tb > 1 and 4 * _token_words(tb, num_experts, g, has_bias) > SMEM_BUDGET:
        tb //= 2
    if 4 * _token_words(tb, num_experts, g, has_bias) > SMEM_BUDGET:
        raise NotImplementedError(f"E={num_experts}: one token does not fit "
                                  f"{SMEM_BUDGET} bytes of shared memory")
    tb = max(1, min(tb, num_tokens))
    quads = tb * num_experts // 4
    threads = -(-max(tb, min(TOKEN_MIN_THREADS, quads)) // 32) * 32
    p = num_experts | 1
    o_flag = tb * p
    o_gs = o_flag + tb * token_flag_stride(num_experts)
    o_red = o_gs + tb * ((g | 1) if g else 0)
    o_thr = o_red + 2 * tb
    o_bias = o_thr + 2 * tb
    return TokenLayout(grid=-(-num_tokens // tb), threads=threads, tb=tb, stride=p, o_flag=o_flag,
                       o_gs=o_gs, o_red=o_red, o_thr=o_thr, o_bias=o_bias,
                       shared=4 * (o_bias + (num_experts if has_bias else 0)))


#: threads per block of the streaming backward kernels
STREAM_THREADS = 256


def stream_tiling(num_tokens: int, num_experts: int):
    """``(grid, threads, lanes)`` of the streaming backward kernels: W lanes per
    token read its row straight from global memory (no shared-memory tile),
    lane ``l`` experts ``l, l + W, ...``. W = 32 (a warp per token: each
    warp-wide access is one contiguous piece of a row) or, for E < 32, E
    rounded up to a power of two (a warp then covers whole consecutive rows).
    """
    w = 32
    if num_experts < 32:
        w = 1
        while w < num_experts:
            w *= 2
    tb = max(1, min(STREAM_THREADS // w, num_tokens))
    return -(-num_tokens // tb), tb * w, w


#: lanes per token of the quad backward kernels at most: the top-k backward
#: (sparse: most quads are skipped) and the aux-score backward (dense); and
#: threads per block.  Measured on an H200 (tools/tiling_sweep.py, T=65536):
#: DeepSeek-V3 top-k bwd 96.7 us at 8 lanes vs 104.9 at 16 and 128.5 at 32;
#: aux-score bwd 75.4 us at 16 lanes vs 85.0 at 8 (128 threads).
QUAD_LANES_SPARSE = 8
QUAD_LANES_DENSE = 16
QUAD_THREADS = 128
#: quads per lane held in registers by the aux-score backward (8 fp32 registers each)
QUAD_HOLD = 4


def quad_tiling(num_tokens: int, num_experts: int, dense: bool):
    """``(grid, threads, lanes)`` of the quad backward kernels (E a multiple of
    4): W lanes per token, lane ``l`` quads ``l, l + W, ...``; W the smallest
    power of two >= E/4, at most ``QUAD_LANES_DENSE`` or ``_SPARSE`` (fewer
    lanes: fewer tree-reduction levels per token), ``QUAD_THREADS`` per block."""
    cap = QUAD_LANES_DENSE if dense else QUAD_LANES_SPARSE
    w = min(cap, pow2_at_least(max(1, num_experts // 4)))
    tb = max(1, min(QUAD_THREADS // w, num_tokens))
    return -(-num_tokens // tb), tb * w, w


def quad_hold(num_experts: int, lanes: int) -> int:
    """Quads a lane of the aux-score backward loads at once and keeps in
    registers between its passes: all of its ``ceil(E / 4 / W)``, at most
    ``QUAD_HOLD``."""
    return min(QUAD_HOLD, -(-(num_experts // 4) // lanes))


#: threads per block of the column-sum kernels (aux loss) and of their final block
COLUMN_THREADS = 512
COLUMN_FINAL_THREADS = 1024
#: partial-sum blocks at most (~2 per SM on an H100/H200), rows per block at least
COLUMN_BLOCKS = 256
COLUMN_MIN_ROWS = 64


def column_tiling(num_rows: int, num_cols: int, block: int = COLUMN_THREADS):
    """``(grid, threads, col_lanes, rows_per_block)`` of a column-sum kernel over
    ``[num_rows, num_cols]``: blocks of RL row lanes x CL column lanes (CL a
    multiple of 32, at most 256; RL a power of two, RL * CL <= ``block``; no
    more row lanes than a block has rows, so tiny problems, e.g. under the
    simulator, get small blocks)."""
    cl = min(256, max(32, -(-num_cols // 32) * 32))
    grid = max(1, min(COLUMN_BLOCKS, -(-num_rows // COLUMN_MIN_ROWS)))
    rows = -(-max(num_rows, 1) // grid)
    rl = 1
    while rl * 2 * cl <= block and rl * 2 <= rows:
        rl *= 2
    return grid, rl * cl, cl, rows


#: the aux-loss backward's fill: threads per block, blocks at most.  Measured
#: on an H200 (T = 65536, E = 256, fp32: 67 MB; kernel time behind a sleep
#: kernel, ``python -m gpurouter bench``, scratch sweep at 8f2a26a): 528 x 128
#: threads 19.0 us, 132 x 128 or 256 19.1-19.2, 264 x 256 19.8-20.1, 512
#: threads per block 20.0-20.4; a contiguous chunk of rows per block (2048 x
#: 256, e8a8187) 19.7.  The driver's cuMemsetD32 takes 18.4-18.5 us for the
#: same bytes, a bare grid-strided fill 18.1 (tools/write_ceiling.py).
FILL_THREADS = 128
FILL_BLOCKS = 528


def fill_tiling(num_rows: int, num_quads: int):
    """``(grid, threads, col_lanes)`` of a kernel writing one row of
    ``num_quads`` column quads down ``num_rows`` rows, grid-strided: blocks of
    RL row lanes x CL column-quad lanes (CL as in ``column_tiling``; RL a
    power of two, RL * CL <= ``FILL_THREADS``, no more row lanes than rows),
    block b's lane rl writing rows ``b RL + rl + k grid RL``."""
    cl = min(256, max(32, -(-num_quads // 32) * 32))
    rl = 1
    while rl * 2 * cl <= FILL_THREADS and rl * 2 <= num_rows:
        rl *= 2
    return max(1, min(FILL_BLOCKS, -(-num_rows // rl))), rl * cl, cl
