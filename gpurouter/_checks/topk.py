"""The rules of the router top-k (``fused_topk_with_score_function``, its
forced indices for routing replay) and of a routing map in either format."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .common import (
    RoutingMapFormat,
    ScoreFunction,
    _as_bool,
    _as_finite_float,
    _as_int,
    _dtype_name,
    _is_traced,
    array_meta,
    check_float_dtype,
    routing_map_format_of,
    score_function_of,
    unused_argument_error,
)

TOPK_OP = "fused_topk_with_score_function"


@dataclass(frozen=True)
class TopkConfig:
    """The checked form of one top-k call's static arguments: a
    ``gpurouter.config.RouterConfig``'s router fields with the score function as
    an enum, plus the call's ``compute_aux_scores`` and routing-map format.
    Hashable: the kernels and plans are cached by it. Only
    :func:`check_topk_args` builds one."""

    topk: int
    use_pre_softmax: bool
    num_groups: int
    group_topk: int
    scaling_factor: float
    score_function: ScoreFunction
    compute_aux_scores: bool
    routing_map_format: RoutingMapFormat = RoutingMapFormat.BYTEMAP

    @property
    def bitmap(self) -> bool:
        return self.routing_map_format == RoutingMapFormat.BITMAP_U8

    @property
    def grouped(self) -> bool:
        # Grouping is on iff group_topk > 0 (TE's sentinel is -1).
        return self.group_topk > 0 and not self.compute_aux_scores


def check_topk_args(
    logits_shape: tuple[int, ...],
    logits_dtype,
    topk,
    use_pre_softmax,
    num_groups,
    group_topk,
    scaling_factor,
    score_function,
    expert_bias_shape: tuple[int, ...] | None,
    expert_bias_dtype,
    compute_aux_scores,
    routing_map_format=RoutingMapFormat.BYTEMAP,
    op: str = TOPK_OP,
) -> TopkConfig:
    """Checks the arguments of ``fused_topk_with_score_function``; returns the config."""
    if len(logits_shape) == 0:
        raise ValueError(f"{op}: logits rank (0) must be >= 1 (logits are [..., num_experts]).")
    check_float_dtype(op, "logits", logits_dtype)
    num_experts = logits_shape[-1]
    if num_experts == 0:
        raise ValueError(f"{op}: num_experts (logits.shape[-1] = 0) must be >= 1.")
    topk = _as_int(op, "topk", topk)
    if topk < 1:
        raise ValueError(f"{op}: topk ({topk}) must be >= 1.")
    if topk > num_experts:
        raise ValueError(f"{op}: topk ({topk}) must be <= num_experts ({num_experts}).")
    sf = score_function_of(op, score_function)
    scaling_factor = _as_finite_float(op, "scaling_factor", scaling_factor)
    map_format = routing_map_format_of(op, routing_map_format)
    num_groups = _as_int(op, "num_groups", num_groups)
    group_topk = _as_int(op, "group_topk", group_topk)
    compute_aux_scores = _as_bool(op, "compute_aux_scores", compute_aux_scores)
    use_pre_softmax = _as_bool(op, "use_pre_softmax", use_pre_softmax)
    # One rule for every op: an argument that does nothing here is an error.
    if compute_aux_scores:
        for name, value, default in (("use_pre_softmax", use_pre_softmax, False),
                                     ("group_topk", group_topk, None),
                                     ("scaling_factor", scaling_factor, 1.0),
                                     ("expert_bias", expert_bias_shape, None)):
            unused = value > 0 if name == "group_topk" else value != default
            if unused:
                shown = f"shape {tuple(value)}" if name == "expert_bias" else value
                raise unused_argument_error(op, name, shown, "with compute_aux_scores=True (the aux "
                                            "scores are over all experts: no bias, groups, scaling or pre-softmax)")
    elif use_pre_softmax and sf != ScoreFunction.SOFTMAX:
        raise unused_argument_error(op, "use_pre_softmax", True,
                                    f"with score_function ({sf.name.lower()!r}); it is for softmax only")
    if group_topk > 0 and not compute_aux_scores:
        if num_groups <= 0:
            raise ValueError(
                f"{op}: num_groups ({num_groups}) must be >= 1 when group_topk ({group_topk}) > 0."
            )
        if num_experts % num_groups != 0:
            raise ValueError(
                f"{op}: num_experts ({num_experts}) must be divisible by num_groups ({num_groups})."
            )
        if group_topk > num_groups:
            raise ValueError(
                f"{op}: group_topk ({group_topk}) must be <= num_groups ({num_groups})."
            )
        if topk % group_topk != 0:
            raise ValueError(
                f"{op}: topk ({topk}) must be divisible by group_topk ({group_topk})."
            )
        if topk // group_topk > num_experts // num_groups:
            raise ValueError(
                f"{op}: topk / group_topk ({topk // group_topk}) must be <= "
                f"num_experts / num_groups ({num_experts // num_groups})."
            )
    if expert_bias_shape is not None:
        if sf == ScoreFunction.SOFTMAX:
            raise ValueError(
                f"{op}: expert_bias (shape {tuple(expert_bias_shape)}) must be None with "
                "score_function ('softmax'); the bias is for sigmoid and sqrtsoftplus only."
            )
        if tuple(expert_bias_shape) != (num_experts,):
            raise ValueError(
                f"{op}: expert_bias shape {tuple(expert_bias_shape)} must be "
                f"(num_experts,) = ({num_experts},)."
            )
        check_float_dtype(op, "expert_bias", expert_bias_dtype)
    return TopkConfig(
        topk=topk,
        use_pre_softmax=use_pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        score_function=sf,
        compute_aux_scores=compute_aux_scores,
        routing_map_format=map_format,
    )


def check_forced_indices(op: str, forced_indices, logits_shape, topk: int, compute_aux_scores: bool) -> None:
    """``forced_indices`` (routing replay): ``[..., K]`` integers matching the
    logits' leading dims. Where the values are concrete (not traced), each row's
    indices must lie in ``[0, E)`` and be distinct; traced values get the
    documented result (out-of-range entries select nothing, a repeated one once)."""
    shape, dtype = array_meta(op, "forced_indices", forced_indices)
    if compute_aux_scores:
        raise ValueError(f"{op}: forced_indices must be None with compute_aux_scores=True "
                         "(the aux scores select nothing to replay).")
    want = tuple(logits_shape[:-1]) + (topk,)
    if tuple(shape) != want:
        raise ValueError(f"{op}: forced_indices shape {tuple(shape)} must be logits.shape[:-1] + (topk,) "
                         f"= {want}.")
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{op}: forced_indices must be integers, got {_dtype_name(dtype)}.")
    if _is_traced(forced_indices):
        return
    idx = np.asarray(forced_indices).reshape(-1, topk)
    num_experts = logits_shape[-1]
    bad = np.nonzero(((idx < 0) | (idx >= num_experts)).any(axis=1))[0]
    if bad.size:
        row = int(bad[0])
        raise ValueError(f"{op}: forced_indices row {row} ({idx[row].tolist()}) must lie in "
                         f"[0, num_experts) = [0, {num_experts}).")
    srt = np.sort(idx, axis=1)
    dup = np.nonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))[0]
    if dup.size:
        row = int(dup[0])
        raise ValueError(f"{op}: forced_indices row {row} ({idx[row].tolist()}) must hold topk ({topk}) "
                         "distinct experts.")


def check_routing_map(op: str, routing_map, num_experts,
                      bytemap_only: bool = False) -> tuple[RoutingMapFormat, int]:
    """A routing map of either format (or a BYTEMAP only); returns ``(format, num_experts)``.

    ``bool [..., E]`` is a BYTEMAP (``num_experts``, when given, must be E);
    ``uint8 [..., ceil(E / 8)]`` a BITMAP_U8, which needs ``num_experts``.
    """
    shape, dtype = array_meta(op, "routing_map", routing_map)
    if len(shape) == 0:
        raise ValueError(f"{op}: routing_map rank (0) must be >= 1 (maps are [..., num_experts] "
                         "or [..., ceil(num_experts / 8)]).")
    if num_experts is not None:
        num_experts = _as_int(op, "num_experts", num_experts)
        if num_experts < 1:
            raise ValueError(f"{op}: num_experts ({num_experts}) must be >= 1.")
    name = _dtype_name(dtype)
    if name == "bool":
        if num_experts is not None and shape[-1] != num_experts:
            raise ValueError(f"{op}: routing_map shape {shape} (bool, a BYTEMAP) must end in "
                             f"num_experts ({num_experts}).")
        if shape[-1] == 0:
            raise ValueError(f"{op}: num_experts (routing_map.shape[-1] = 0) must be >= 1.")
        return RoutingMapFormat.BYTEMAP, shape[-1]
    if bytemap_only:
        raise TypeError(f"{op}: routing_map must be bool [..., num_experts] (BYTEMAP), got {name}.")
    if name != "uint8":
        raise TypeError(f"{op}: routing_map must be bool (BYTEMAP) or uint8 (BITMAP_U8), got {name}.")
    if num_experts is None:
        raise ValueError(f"{op}: num_experts must be given with a uint8 routing_map (BITMAP_U8): "
                         "its byte count only bounds it.")
    if shape[-1] != -(-num_experts // 8):
        raise ValueError(f"{op}: routing_map shape {shape} (uint8, a BITMAP_U8) must end in "
                         f"ceil(num_experts / 8) = {-(-num_experts // 8)} for num_experts ({num_experts}).")
    return RoutingMapFormat.BITMAP_U8, num_experts
