"""The rules of the MoE ops: the token-level ops (grouped dbias / dscales,
the grouped scaled bias add, token dispatch and combine) with their numba
backend's limits, and the MoE block ``moe``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .common import (
    RoutingMapFormat,
    _as_int,
    _dtype_name,
    _is_traced,
    array_meta,
    check_backend,
    check_float_dtype,
)
from .topk import check_routing_map

# ----------------------------------------------------------------------------
# Token-level MoE ops (gpurouter/_ops/grouped_bias.py and permute.py, gpurouter/reference/moe_ops.py):
# grouped dbias / dscales, the grouped scaled bias add, token dispatch and combine.
# ----------------------------------------------------------------------------

GROUPED_DBIAS_DSCALES_OP = "compute_grouped_dbias_dscales"
GROUPED_DBIAS_OP = "compute_grouped_dbias"
SCALED_BIAS_ADD_OP = "grouped_scaled_bias_add"
TOKEN_DISPATCH_OP = "token_dispatch"
TOKEN_COMBINE_OP = "token_combine"


def moe_no_kernel_error(op: str) -> NotImplementedError:
    return NotImplementedError(f'{op} (numba): no kernel yet; use backend="jax".')


def check_moe_backend(op: str, backend: str) -> str:
    """``backend`` of a token-level MoE op: ``"auto"`` and ``"jax"`` give ``"jax"``;
    ``"numba"`` is a ``NotImplementedError`` (no kernels yet)."""
    check_backend(op, backend)
    if backend == "numba":
        raise moe_no_kernel_error(op)
    return "jax"


def _rank2(op: str, name: str, x, what: str) -> tuple[tuple[int, ...], np.dtype]:
    shape, dtype = array_meta(op, name, x)
    if len(shape) != 2:
        raise ValueError(f"{op}: {name} shape {shape} must have rank 2 ([{what}]).")
    return shape, dtype


def _check_int_dtype(op: str, name: str, dtype) -> None:
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{op}: {name} must be integers, got {_dtype_name(dtype)}.")


def _check_offsets(op: str, offsets, num_groups: int, num_rows: int, rows_name: str) -> None:
    """``offsets [G + 1]`` integers; where concrete, non-decreasing and within
    ``[0, num_rows]`` (a group past the rows would be truncated silently)."""
    shape, dtype = array_meta(op, "offsets", offsets)
    if tuple(shape) != (num_groups + 1,):
        raise ValueError(f"{op}: offsets shape {shape} must be (num_groups + 1,) = ({num_groups + 1},).")
    _check_int_dtype(op, "offsets", dtype)
    if _is_traced(offsets):
        return
    o = np.asarray(offsets)
    if (np.diff(o) < 0).any():
        raise ValueError(f"{op}: offsets ({o.tolist()}) must be non-decreasing.")
    if o.size and (o[0] < 0 or o[-1] > num_rows):
        raise ValueError(f"{op}: offsets ({o.tolist()}) must lie in [0, {rows_name}] = [0, {num_rows}].")


def _check_group_sizes(op: str, group_sizes, num_groups: int, total: tuple[int, str] | None = None) -> None:
    """``group_sizes [G]`` integers; where concrete, ``>= 0`` (and summing to
    at most ``total = (rows, its name)`` when given)."""
    shape, dtype = array_meta(op, "group_sizes", group_sizes)
    if tuple(shape) != (num_groups,):
        raise ValueError(f"{op}: group_sizes shape {shape} must be (num_groups,) = ({num_groups},).")
    _check_int_dtype(op, "group_sizes", dtype)
    if _is_traced(group_sizes):
        return
    sizes = np.asarray(group_sizes)
    if total is None and (sizes < 0).any():
        raise ValueError(f"{op}: group_sizes ({sizes.tolist()}) must be >= 0.")
    if total is not None and ((sizes < 0).any() or sizes.sum() > total[0]):
        raise ValueError(f"{op}: group_sizes ({sizes.tolist()}) must be >= 0 and sum to at most "
                         f"{total[1]} ({total[0]}).")


def _check_accumulator(op: str, name: str, x, want: tuple[int, ...]) -> None:
    """An optional fp32 accumulator (``dbias`` / ``dscales``), as TE asserts."""
    if x is None:
        return
    shape, dtype = array_meta(op, name, x)
    if tuple(shape) != want:
        raise ValueError(f"{op}: {name} shape {shape} must be {want} (it is accumulated into).")
    if _dtype_name(dtype) != "float32":
        raise TypeError(f"{op}: {name} must be float32 (it is accumulated into), got {_dtype_name(dtype)}.")


def _check_scales(op: str, scales, n: int) -> None:
    s_shape, s_dtype = array_meta(op, "scales", scales)
    if tuple(s_shape) != (n,):
        raise ValueError(f"{op}: scales shape {s_shape} must be (num_rows,) = ({n},).")
    check_float_dtype(op, "scales", s_dtype)


def _check_grouped_bias(op: str, bias, h: int, rows_name: str) -> int:
    """``bias [G, H]`` with ``G >= 1`` and the rows' ``H``; returns ``G``."""
    b_shape, b_dtype = _rank2(op, "bias", bias, "num_groups, hidden")
    if b_shape[1] != h or b_shape[0] < 1:
        raise ValueError(f"{op}: bias shape {b_shape} must be (num_groups, hidden) with num_groups >= 1 "
                         f"and hidden = {rows_name}.shape[1] ({h}).")
    check_float_dtype(op, "bias", b_dtype)
    return b_shape[0]


def check_grouped_dbias_dscales_args(dy, scales, bias, offsets, dbias, dscales,
                                     op: str = GROUPED_DBIAS_DSCALES_OP) -> tuple[int, int, int]:
    """Checks ``compute_grouped_dbias_dscales``; returns ``(N, H, G)``."""
    (n, h), dy_dtype = _rank2(op, "dy", dy, "num_rows, hidden")
    check_float_dtype(op, "dy", dy_dtype)
    _check_scales(op, scales, n)
    g = _check_grouped_bias(op, bias, h, "dy")
    _check_offsets(op, offsets, g, n, "dy.shape[0]")
    _check_accumulator(op, "dbias", dbias, (g, h))
    _check_accumulator(op, "dscales", dscales, (n,))
    return n, h, g


def check_grouped_dbias_args(dy, offsets, num_groups, dbias,
                             op: str = GROUPED_DBIAS_OP) -> tuple[int, int, int]:
    """Checks ``compute_grouped_dbias``; returns ``(N, H, G)``."""
    (n, h), dy_dtype = _rank2(op, "dy", dy, "num_rows, hidden")
    check_float_dtype(op, "dy", dy_dtype)
    g = _as_int(op, "num_groups", num_groups)
    if g < 1:
        raise ValueError(f"{op}: num_groups ({g}) must be >= 1.")
    _check_offsets(op, offsets, g, n, "dy.shape[0]")
    _check_accumulator(op, "dbias", dbias, (g, h))
    return n, h, g


def check_scaled_bias_add_args(y, bias, scales, group_sizes,
                               op: str = SCALED_BIAS_ADD_OP) -> tuple[int, int, int]:
    """Checks ``grouped_scaled_bias_add``; returns ``(N, H, G)``."""
    (n, h), y_dtype = _rank2(op, "y", y, "num_rows, hidden")
    check_float_dtype(op, "y", y_dtype)
    g = _check_grouped_bias(op, bias, h, "y")
    _check_scales(op, scales, n)
    _check_group_sizes(op, group_sizes, g, (n, "y.shape[0]"))
    return n, h, g


BATCHED_RAGGED_DOT_OP = "batched_ragged_dot"


#: jax.lax's precision names (jax.lax.Precision and the dot algorithm presets it takes as strings)
_PRECISION_NAMES = ("default", "high", "highest", "fastest", "float32", "tensorfloat32", "bfloat16",
                    "bfloat16_3x")


def _check_precision(op: str, precision) -> None:
    """``precision`` as ``jax.lax.dot_general`` takes it: None, a name, or a
    ``jax.lax.Precision`` / dot algorithm object or a pair (passed through)."""
    if precision is None:
        return
    if isinstance(precision, (bool, int, float)):
        raise TypeError(f"{op}: precision ({precision!r}) must be None, a jax.lax.Precision or one of "
                        f"{', '.join(map(repr, _PRECISION_NAMES))}, got {type(precision).__name__}.")
    if isinstance(precision, str) and precision.lower() not in _PRECISION_NAMES:
        raise ValueError(f"{op}: precision ({precision!r}) must be one of {', '.join(map(repr, _PRECISION_NAMES))} "
                         "(or None, or a jax.lax.Precision).")


def _check_preferred_type(op: str, preferred_element_type) -> None:
    if preferred_element_type is None:
        return
    try:
        dtype = np.dtype(preferred_element_type)
    except TypeError:
        raise TypeError(f"{op}: preferred_element_type ({preferred_element_type!r}) must be None or a "
                        "float dtype.") from None
    check_float_dtype(op, "preferred_element_type", dtype)


def check_batched_ragged_dot_args(lhs, rhs, group_sizes, capacity, precision=None, preferred_element_type=None,
                                  op: str = BATCHED_RAGGED_DOT_OP) -> tuple[int, int, int, int]:
    """Checks ``batched_ragged_dot`` (``jax.lax.ragged_dot``'s operands);
    returns ``(N, K, G, M)``."""
    _check_precision(op, precision)
    _check_preferred_type(op, preferred_element_type)
    (n, k), l_dtype = _rank2(op, "lhs", lhs, "num_rows, contracting")
    check_float_dtype(op, "lhs", l_dtype)
    r_shape, r_dtype = array_meta(op, "rhs", rhs)
    if len(r_shape) != 3 or r_shape[1] != k or r_shape[0] < 1:
        raise ValueError(f"{op}: rhs shape {r_shape} must be (num_groups, contracting, out) with "
                         f"num_groups >= 1 and contracting = lhs.shape[1] ({k}).")
    check_float_dtype(op, "rhs", r_dtype)
    g = r_shape[0]
    _check_group_sizes(op, group_sizes, g, (n, "lhs.shape[0]"))
    if capacity is not None and _as_int(op, "capacity", capacity) < 1:
        raise ValueError(f"{op}: capacity ({capacity}) must be >= 1 (or None).")
    return n, k, g, r_shape[2]


TILED_RAGGED_DOT_OP = "tiled_ragged_dot"


def check_tiled_ragged_dot_args(lhs, rhs, group_sizes, capacity, tile, chunk, precision=None,
                                preferred_element_type=None,
                                op: str = TILED_RAGGED_DOT_OP) -> tuple[int, int, int, int]:
    """Checks ``tiled_ragged_dot`` (``jax.lax.ragged_dot``'s operands, as
    ``batched_ragged_dot``'s with ``precision`` and ``preferred_element_type``,
    and ``capacity >= 0`` or None, ``tile >= 1``, ``chunk >= 1``); returns
    ``(N, K, G, M)``."""
    dims = check_batched_ragged_dot_args(lhs, rhs, group_sizes, None, precision, preferred_element_type, op=op)
    if capacity is not None and _as_int(op, "capacity", capacity) < 0:
        raise ValueError(f"{op}: capacity ({capacity}) must be >= 0 (0: every row in tiles) or None.")
    for name, value in (("tile", tile), ("chunk", chunk)):
        if _as_int(op, name, value) < 1:
            raise ValueError(f"{op}: {name} ({value}) must be >= 1.")
    return dims


@dataclass(frozen=True)
class DispatchConfig:
    """Validated static configuration of one ``token_dispatch`` call."""

    num_tokens: int
    hidden: int
    num_experts: int
    routing_map_format: RoutingMapFormat
    num_out_tokens: int
    align_size: int | None

    @property
    def num_rows(self) -> int:
        """Rows of the dispatched output: ``num_out_tokens``, or TE's aligned
        worst case ``((num_out_tokens + E * (A - 1)) // A) * A``."""
        a = self.align_size
        if a is None:
            return self.num_out_tokens
        return ((self.num_out_tokens + self.num_experts * (a - 1)) // a) * a


def check_token_dispatch_args(inp, routing_map, num_out_tokens, probs, align_size, num_experts,
                              op: str = TOKEN_DISPATCH_OP) -> DispatchConfig:
    """Checks ``token_dispatch``; returns the config.

    ``E`` is ``routing_map.shape[1]`` for a bool map; for a uint8 map
    (BITMAP_U8) it is ``num_experts``, else ``probs.shape[1]``.
    """
    (t, h), inp_dtype = _rank2(op, "inp", inp, "num_tokens, hidden")
    check_float_dtype(op, "inp", inp_dtype)
    m_shape, m_dtype = _rank2(op, "routing_map", routing_map, "num_tokens, num_experts")
    if m_shape[0] != t:
        raise ValueError(f"{op}: routing_map shape {m_shape} must have num_tokens = inp.shape[0] ({t}) rows.")
    p_shape = None
    if probs is not None:
        p_shape, p_dtype = _rank2(op, "probs", probs, "num_tokens, num_experts")
        check_float_dtype(op, "probs", p_dtype)
    if num_experts is not None:
        num_experts = _as_int(op, "num_experts", num_experts)
        if p_shape is not None and p_shape[1] != num_experts:
            raise ValueError(f"{op}: num_experts ({num_experts}) must equal probs.shape[1] ({p_shape[1]}).")
    elif p_shape is not None and _dtype_name(m_dtype) == "uint8":
        num_experts = p_shape[1]
    elif _dtype_name(m_dtype) == "uint8":
        raise ValueError(f"{op}: num_experts must be given (or probs) with a uint8 routing_map (BITMAP_U8): "
                         "its byte count only bounds it.")
    fmt, e = check_routing_map(op, routing_map, num_experts)
    if p_shape is not None and tuple(p_shape) != (t, e):
        raise ValueError(f"{op}: probs shape {p_shape} must be (num_tokens, num_experts) = ({t}, {e}).")
    n_out = _as_int(op, "num_out_tokens", num_out_tokens)
    if n_out <= 0:
        raise ValueError(f"{op}: num_out_tokens ({n_out}) must be > 0.")
    if align_size is not None:
        align_size = _as_int(op, "align_size", align_size)
        if align_size < 1:
            raise ValueError(f"{op}: align_size ({align_size}) must be >= 1 (or None).")
    return DispatchConfig(num_tokens=t, hidden=h, num_experts=e, routing_map_format=fmt,
                          num_out_tokens=n_out, align_size=align_size)


def check_token_combine_args(inp, row_id_map, merging_probs, pad_offsets,
                             op: str = TOKEN_COMBINE_OP) -> tuple[int, int, int, int]:
    """Checks ``token_combine``; returns ``(R, H, T, E)``."""
    (r, h), inp_dtype = _rank2(op, "inp", inp, "num_rows, hidden")
    check_float_dtype(op, "inp", inp_dtype)
    (t, e), m_dtype = _rank2(op, "row_id_map", row_id_map, "num_tokens, num_experts")
    _check_int_dtype(op, "row_id_map", m_dtype)
    if e < 1:
        raise ValueError(f"{op}: num_experts (row_id_map.shape[1] = 0) must be >= 1.")
    if merging_probs is not None:
        p_shape, p_dtype = array_meta(op, "merging_probs", merging_probs)
        if tuple(p_shape) != (t, e):
            raise ValueError(f"{op}: merging_probs shape {p_shape} must be row_id_map's "
                             f"(num_tokens, num_experts) = ({t}, {e}).")
        check_float_dtype(op, "merging_probs", p_dtype)
    if pad_offsets is not None:
        o_shape, o_dtype = array_meta(op, "pad_offsets", pad_offsets)
        if tuple(o_shape) != (e,):
            raise ValueError(f"{op}: pad_offsets shape {o_shape} must be (num_experts,) = ({e},).")
        _check_int_dtype(op, "pad_offsets", o_dtype)
        if not _is_traced(pad_offsets) and (np.asarray(pad_offsets) < 0).any():
            raise ValueError(f"{op}: pad_offsets ({np.asarray(pad_offsets).tolist()}) must be >= 0.")
    if not _is_traced(row_id_map):
        # concrete: each entry -1 (not routed) or a row of inp, no row twice
        # (out of range would read zeros; a shared row, a token's rows twice)
        rid = np.asarray(row_id_map).reshape(-1)
        bad = (rid < -1) | (rid >= r)
        if bad.any():
            raise ValueError(f"{op}: row_id_map entries must be -1 (not routed) or a row of inp in "
                             f"[0, inp.shape[0]) = [0, {r}), got {int(rid[np.argmax(bad)])}.")
        used = np.sort(rid[rid >= 0])
        if used.size > 1 and (used[1:] == used[:-1]).any():
            dup = int(used[1:][used[1:] == used[:-1]][0])
            raise ValueError(f"{op}: row_id_map must name each row of inp at most once, got row {dup} twice.")
    return r, h, t, e


# ----------------------------------------------------------------------------
# The numba backend of the token-level MoE ops (gpurouter/_ops/grouped_bias.py, gpurouter/_ops/permute.py,
# kernels in gpurouter/kernels/moe/)
# ----------------------------------------------------------------------------

#: the token-level MoE ops with kernels (grouped_scaled_bias_add: its backward;
#: token_dispatch: its row copy and backward)
MOE_KERNEL_OPS = (GROUPED_DBIAS_DSCALES_OP, GROUPED_DBIAS_OP, SCALED_BIAS_ADD_OP, TOKEN_COMBINE_OP,
                  TOKEN_DISPATCH_OP)


def check_moe_kernel_backend(op: str, backend: str) -> str:
    """``backend`` of a token-level MoE op, checked; ``"numba"`` for an op
    without kernels (none left: every op of MOE_KERNEL_OPS has them) is a
    ``NotImplementedError``."""
    check_backend(op, backend)
    if backend == "numba" and op not in MOE_KERNEL_OPS:
        raise moe_no_kernel_error(op)
    return backend


def check_moe_kernel_limit(op: str, name: str, value: int, limit: int) -> None:
    """A valid size beyond what a MoE kernel takes: ``NotImplementedError``."""
    if value > limit:
        raise NotImplementedError(
            f"{op} (numba): {name} ({value}) exceeds the kernel limit of {limit}; use backend=\"jax\"."
        )


PALLAS_RAGGED_DOT_OP = "pallas_ragged_dot"


def check_pallas_ragged_dot_args(lhs, rhs, group_sizes, block_m, block_n, block_k, num_warps, num_stages,
                                 precision=None, preferred_element_type=None, group_offset=None, interpret=None,
                                 op: str = PALLAS_RAGGED_DOT_OP) -> tuple[int, int, int, int]:
    """Checks ``pallas_ragged_dot`` (``jax.lax.ragged_dot``'s operands, as
    ``batched_ragged_dot``'s, and the tile sizes ``block_m``, ``block_n``,
    ``block_k`` powers of two >= 16, ``num_warps``, ``num_stages`` >= 1);
    returns ``(N, K, G, M)``."""
    if group_offset is not None:
        raise ValueError(f"{op}: group_offset must be None (every group of rhs is local; sharded groups are "
                         "not implemented).")
    if interpret is not None and not isinstance(interpret, bool):
        raise TypeError(f"{op}: interpret ({interpret!r}) must be None or a bool.")
    dims = check_batched_ragged_dot_args(lhs, rhs, group_sizes, None, precision, preferred_element_type, op=op)
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        v = _as_int(op, name, value)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{op}: {name} ({value}) must be a power of two >= 16 (a Triton dot's tile).")
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if _as_int(op, name, value) < 1:
            raise ValueError(f"{op}: {name} ({value}) must be >= 1.")
    return dims
