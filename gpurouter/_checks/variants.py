"""The rules of the router variants of docs/contract.md sections 9-12: the
group-score rules, token masks, traced token counts, compact outputs and
index dtypes, and Quantile Balancing (QB)."""

from __future__ import annotations

import math

import numpy as np

from .common import ScoreFunction, _as_int, _dtype_name, _is_traced, array_meta, check_float_dtype, is_float_dtype

QB_UPDATE_OP = "qb_update_expert_bias"
GROUP_SCORES = ("sum_topk", "top2_sum", "max")
INDEX_DTYPES = ("int32", "int16")
INT32_MAX = 2**31 - 1


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def check_flag(op: str, name: str, value) -> bool:
    """A keyword flag of the variants must be a bool (not 0/1, not None)."""
    if not _is_bool(value):
        raise TypeError(f"{op}: {name} ({value!r}) must be a bool, got {type(value).__name__}.")
    return bool(value)


def check_str_choice(op: str, name: str, value, choices: tuple[str, ...]) -> str:
    """``value``: one of the strings ``choices`` (TypeError for a non-str, ValueError for another str)."""
    listed = ", ".join(map(repr, choices))
    if not isinstance(value, str):
        raise TypeError(f"{op}: {name} ({value!r}) must be a str ({listed}), got {type(value).__name__}.")
    if value not in choices:
        raise ValueError(f"{op}: {name} ({value!r}) must be one of {listed}.")
    return value


def check_group_score(op: str, group_score, grouped: bool, compute_aux_scores: bool,
                      num_experts: int, num_groups: int) -> str:
    """``group_score``: one of :data:`GROUP_SCORES`; a rule other than the
    default needs grouping on and the top-k mode (it would do nothing else)."""
    check_str_choice(op, "group_score", group_score, GROUP_SCORES)
    if group_score == "sum_topk":
        return group_score
    if compute_aux_scores:
        raise ValueError(f"{op}: group_score ({group_score!r}) must be 'sum_topk' with "
                         "compute_aux_scores=True (the aux scores have no groups).")
    if not grouped:
        raise ValueError(f"{op}: group_score ({group_score!r}) needs grouping on (group_topk > 0); "
                         "without groups it would do nothing.")
    if group_score == "top2_sum" and num_experts // num_groups < 2:
        raise ValueError(f"{op}: group_score ('top2_sum') needs num_experts / num_groups "
                         f"({num_experts // num_groups}) >= 2.")
    return group_score


def check_indices_dtype(op: str, indices_dtype, num_experts: int) -> np.dtype:
    """``indices_dtype``: int32 (default) or int16 (``num_experts <= 32768``)."""
    try:
        dtype = np.dtype(indices_dtype)
    except TypeError:
        raise TypeError(f"{op}: indices_dtype ({indices_dtype!r}) must be 'int32' or 'int16'.") from None
    if dtype.name not in INDEX_DTYPES:
        raise TypeError(f"{op}: indices_dtype ({dtype.name}) must be int32 or int16.")
    if dtype.name == "int16" and num_experts > 2**15:
        raise ValueError(f"{op}: indices_dtype int16 needs num_experts ({num_experts}) <= 32768; "
                         "use int32.")
    return dtype


def check_compact(op: str, compact, compute_aux_scores: bool, return_indices: bool, bitmap: bool) -> bool:
    """``compact=True``: ``(weights, indices)`` instead of ``(probs, routing_map)``."""
    compact = check_flag(op, "compact", compact)
    if not compact:
        return False
    if compute_aux_scores:
        raise ValueError(f"{op}: compact must be False with compute_aux_scores=True "
                         "(the aux scores are dense).")
    if return_indices:
        raise ValueError(f"{op}: return_indices must be False with compact=True "
                         "(the compact result already holds the indices).")
    if bitmap:
        raise ValueError(f"{op}: routing_map_format must be BYTEMAP with compact=True "
                         "(no routing map is returned).")
    return True


def check_token_mask(op: str, token_mask, token_shape: tuple[int, ...]) -> None:
    """``token_mask``: bool, the tokens' shape or that shape flattened."""
    shape, dtype = array_meta(op, "token_mask", token_mask)
    if _dtype_name(dtype) != "bool":
        raise TypeError(f"{op}: token_mask must be bool (True = a valid token), got {_dtype_name(dtype)}.")
    flat = (int(np.prod(token_shape, dtype=np.int64)),)
    if tuple(shape) != tuple(token_shape) and tuple(shape) != flat:
        raise ValueError(f"{op}: token_mask shape {tuple(shape)} must be the tokens' shape "
                         f"{tuple(token_shape)} or {flat}.")


def check_traced_token_count(op: str, value):
    """A traced ``total_num_tokens``: a 0-d int or float array, used as it is."""
    shape = tuple(getattr(value, "shape", ()))
    if shape != ():
        raise ValueError(f"{op}: total_num_tokens shape {shape} must be () (a scalar).")
    name = _dtype_name(value.dtype)
    if not (np.issubdtype(np.dtype(value.dtype), np.integer) or is_float_dtype(value.dtype)):
        raise TypeError(f"{op}: total_num_tokens must be an int or float scalar, got {name}.")
    return value


def check_qb_args(op: str, *, score_function: ScoreFunction, topk: int, num_experts: int,
                  num_tokens: int, shards: int, grouped: bool, num_groups: int, group_topk: int,
                  has_bias: bool, compute_aux_scores: bool, forced: bool,
                  qb_histogram, qb_bin_bounds) -> int:
    """Quantile Balancing's arguments (contract section 12); returns ``B``."""
    if qb_histogram is None or qb_bin_bounds is None:
        given, missing = ("qb_histogram", "qb_bin_bounds") if qb_bin_bounds is None else (
            "qb_bin_bounds", "qb_histogram")
        raise ValueError(f"{op}: {given} needs {missing} too (Quantile Balancing takes both).")
    if score_function == ScoreFunction.SOFTMAX:
        raise ValueError(f"{op}: qb_histogram needs score_function 'sigmoid' (or 'sqrtsoftplus'), "
                         "got 'softmax'.")
    if not has_bias:
        raise ValueError(f"{op}: qb_histogram needs expert_bias (the bias Quantile Balancing updates).")
    if topk >= num_experts:
        raise ValueError(f"{op}: topk ({topk}) must be < num_experts ({num_experts}) with qb_histogram "
                         "(the cutoff is the (topk+1)-th score).")
    if compute_aux_scores:
        raise ValueError(f"{op}: qb_histogram must be None with compute_aux_scores=True.")
    if forced:
        raise ValueError(f"{op}: qb_histogram must be None with forced_indices (a replay selects nothing).")
    if grouped and group_topk * (num_experts // num_groups) < topk + 1:
        raise ValueError(f"{op}: group_topk * num_experts / num_groups "
                         f"({group_topk * (num_experts // num_groups)}) must be >= topk + 1 ({topk + 1}) "
                         "with qb_histogram (the cutoff is the (topk+1)-th eligible score).")
    hshape, hdtype = array_meta(op, "qb_histogram", qb_histogram)
    if _dtype_name(hdtype) != "int32":
        raise TypeError(f"{op}: qb_histogram must be int32, got {_dtype_name(hdtype)}.")
    if len(hshape) != 2 or hshape[0] != num_experts or hshape[1] < 1:
        raise ValueError(f"{op}: qb_histogram shape {tuple(hshape)} must be (num_experts, num_bins) = "
                         f"({num_experts}, B), B >= 1.")
    check_bin_bounds(op, qb_bin_bounds, "qb_bin_bounds")
    if num_tokens * shards > INT32_MAX:
        raise ValueError(f"{op}: one call adds up to num_tokens ({num_tokens * shards}, all shards) counts "
                         f"to a bin, which must be <= {INT32_MAX}: route fewer tokens per call.")
    return hshape[1]


def check_bin_bounds(op: str, bounds, name: str) -> None:
    """``[lower, upper]`` float bounds; concrete ones finite with ``lower < upper``."""
    bshape, bdtype = array_meta(op, name, bounds)
    if not is_float_dtype(bdtype):
        raise TypeError(f"{op}: {name} must be float (float32 [lower, upper]), got {_dtype_name(bdtype)}.")
    if tuple(bshape) != (2,):
        raise ValueError(f"{op}: {name} shape {tuple(bshape)} must be (2,) ([lower, upper]).")
    if _is_traced(bounds):
        return
    lower, upper = (float(v) for v in np.asarray(bounds, np.float32))
    if not (math.isfinite(lower) and math.isfinite(upper)) or not lower < upper:
        raise ValueError(f"{op}: {name} ({[lower, upper]}) must be finite with lower < upper.")


def check_qb_update_args(histogram, bin_bounds, topk, op: str = QB_UPDATE_OP,
                         expert_bias=None) -> tuple[int, int, int]:
    """``qb_update_expert_bias``'s arguments; returns ``(topk, E, B)``."""
    hshape, hdtype = array_meta(op, "histogram", histogram)
    if _dtype_name(hdtype) != "int32":
        raise TypeError(f"{op}: histogram must be int32, got {_dtype_name(hdtype)}.")
    if len(hshape) != 2 or hshape[0] < 2 or hshape[1] < 1:
        raise ValueError(f"{op}: histogram shape {tuple(hshape)} must be (num_experts, num_bins), "
                         "num_experts >= 2, num_bins >= 1.")
    check_bin_bounds(op, bin_bounds, "bin_bounds")
    topk = _as_int(op, "topk", topk)
    if not 1 <= topk < hshape[0]:
        raise ValueError(f"{op}: topk ({topk}) must be in [1, num_experts) = [1, {hshape[0]}).")
    if expert_bias is not None:
        bshape, bdtype = array_meta(op, "expert_bias", expert_bias)
        check_float_dtype(op, "expert_bias", bdtype)
        if tuple(bshape) != (hshape[0],):
            raise ValueError(f"{op}: expert_bias shape {tuple(bshape)} must be (num_experts,) = ({hshape[0]},).")
    return topk, hshape[0], hshape[1]


class TopkVariants:
    """The checked router-variant arguments of one top-k call (contract sections 9-12)."""

    __slots__ = ("group_score", "compact", "indices_dtype", "qb", "num_bins", "masked", "return_indices")

    def __init__(self, group_score, compact, indices_dtype, qb, num_bins, masked, return_indices):
        self.group_score = group_score
        self.compact = compact
        self.indices_dtype = indices_dtype
        self.qb = qb
        self.num_bins = num_bins
        self.masked = masked
        self.return_indices = return_indices


#: TE's QB histogram modes (its ``NVTEQBHistogramMode``): accepted for a drop-in call, the same counts either way
QB_HISTOGRAM_MODES = ("two_kernel", "fused_atomic")


def check_topk_variants(op: str, cfg, logits_shape, *, return_indices, group_score, compact,
                        indices_dtype, expert_bias, forced, qb_histogram, qb_bin_bounds,
                        token_mask, axis_name, shards: int, qb_histogram_mode=None) -> TopkVariants:
    """Every variant argument of the router top-k, after ``check_topk_args``."""
    num_experts = logits_shape[-1]
    return_indices = check_flag(op, "return_indices", return_indices)
    gs = check_group_score(op, group_score, cfg.grouped, cfg.compute_aux_scores, num_experts,
                           cfg.num_groups)
    idx_dtype = check_indices_dtype(op, indices_dtype, num_experts)
    compact = check_compact(op, compact, cfg.compute_aux_scores, return_indices, cfg.bitmap)
    if idx_dtype.name != "int32" and not (compact or return_indices):
        raise ValueError(f"{op}: indices_dtype ({idx_dtype.name}) needs an index output (compact=True or "
                         "return_indices=True); without one it would do nothing.")
    qb = qb_histogram is not None or qb_bin_bounds is not None
    num_bins = 0
    if qb:
        num_bins = check_qb_args(
            op, score_function=cfg.score_function, topk=cfg.topk, num_experts=num_experts,
            num_tokens=int(np.prod(logits_shape[:-1], dtype=np.int64)), shards=shards,
            grouped=cfg.grouped, num_groups=cfg.num_groups, group_topk=cfg.group_topk,
            has_bias=expert_bias is not None, compute_aux_scores=cfg.compute_aux_scores,
            forced=forced, qb_histogram=qb_histogram, qb_bin_bounds=qb_bin_bounds)
    if qb_histogram_mode is not None:  # (None, the default, or TE's modes: the same counts in either)
        check_str_choice(op, "qb_histogram_mode", qb_histogram_mode, QB_HISTOGRAM_MODES)
        if not qb:
            raise ValueError(f"{op}: qb_histogram_mode needs qb_histogram and qb_bin_bounds.")
    if token_mask is not None:
        if not qb:
            raise ValueError(f"{op}: token_mask needs qb_histogram (the router routes every token; "
                             "a mask only keeps tokens out of the QB counts).")
        check_token_mask(op, token_mask, tuple(logits_shape[:-1]))
    if axis_name is not None and not qb:
        raise ValueError(f"{op}: axis_name needs qb_histogram (it sums the QB counts over the axis).")
    return TopkVariants(gs, compact, idx_dtype, qb, num_bins, token_mask is not None, return_indices)
