"""Every input check of gpurouter, and the only place where error text is written.

The public ops (every backend) and the reference call these at trace time, on
static shapes, dtypes and Python scalars, before any callback is built: nothing
is ever raised inside a callback (docs/contract.md section 6).

Exceptions:
- ``ValueError`` for shapes and configuration,
- ``TypeError`` for dtypes,
- ``NotImplementedError`` for valid inputs beyond a kernel's limits.

Each message names the function, the argument, the value seen and the rule.
"""

from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass

import numpy as np

TOPK_OP = "fused_topk_with_score_function"
AUX_LOSS_OP = "fused_moe_aux_loss"
Z_LOSS_OP = "router_z_loss"
BIAS_UPDATE_OP = "update_expert_bias"


class ScoreFunction(enum.IntEnum):
    """Router score function; the values are TransformerEngine's codes.

    Accepts the lower-case names too: ``ScoreFunction("sigmoid")``.
    """

    SIGMOID = 0
    SOFTMAX = 1
    SQRTSOFTPLUS = 2

    @classmethod
    def _missing_(cls, value: object) -> ScoreFunction | None:
        if isinstance(value, str):
            member = cls.__members__.get(value.upper())
            if member is not None:
                return member
        return None


class RoutingMapFormat(enum.IntEnum):
    """Layout of ``routing_map``; the values are TransformerEngine's codes (TE #3009).

    - ``BYTEMAP`` (0): ``bool [..., E]``, one entry per expert.
    - ``BITMAP_U8`` (1): ``uint8 [..., ceil(E / 8)]``; bit ``e % 8`` of byte
      ``e // 8`` is set iff the token routes to expert ``e`` (least significant
      bit first, as ``np.packbits(..., bitorder="little")``); padding bits 0.

    Accepts the names in any case too: ``RoutingMapFormat("bitmap_u8")``.
    """

    BYTEMAP = 0
    BITMAP_U8 = 1

    @classmethod
    def _missing_(cls, value: object) -> RoutingMapFormat | None:
        if isinstance(value, str):
            return cls.__members__.get(value.upper())
        return None


_FLOAT_NAMES = ("float32", "bfloat16", "float16")
_TPE_NAMES = ("int32", "int64", "float32", "bfloat16")
BACKENDS = ("auto", "jax", "numba")
TRANSPORTS = ("auto", "callback", "zero-copy")


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def _is_traced(value) -> bool:
    # A jax Tracer (jit/grad/vmap argument) without importing jax here.
    return any(c.__name__ == "Tracer" and c.__module__.startswith("jax") for c in type(value).__mro__)


def _static_error(op: str, name: str, kind: str) -> TypeError:
    return TypeError(
        f"{op}: {name} must be a static Python {kind}, got a traced value (under jax.jit pass it "
        f"as a static argument, e.g. jax.jit(f, static_argnames=...), or close over it)."
    )


def _as_int(op: str, name: str, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{op}: {name} ({value!r}) must be an int, got bool.")
    if _is_traced(value):
        raise _static_error(op, name, "int")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: {name} ({value!r}) must be an int, got {type(value).__name__}.") from None


def _as_float(op: str, name: str, value) -> float:
    if _is_traced(value):
        raise _static_error(op, name, "int or float")
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"{op}: {name} ({value!r}) must be a Python int or float, got {type(value).__name__}."
        )
    return float(value)


def _as_finite_float(op: str, name: str, value) -> float:
    value = _as_float(op, name, value)
    if not math.isfinite(value):
        raise ValueError(f"{op}: {name} ({value!r}) must be finite.")
    return value


def _enum_of(op: str, name: str, enum_cls, value, choices: str):
    """``value`` as a member of ``enum_cls``: the member, its int code or its name (a str)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, np.integer)):
        raise TypeError(
            f"{op}: {name} ({value!r}) must be a str ({choices}), an int code or a "
            f"gpurouter.{enum_cls.__name__}, got {type(value).__name__}."
        )
    try:
        return enum_cls(value)
    except ValueError:
        raise ValueError(
            f"{op}: {name} ({value!r}) must be one of {choices} or a gpurouter.{enum_cls.__name__}."
        ) from None


def score_function_of(op: str, score_function) -> ScoreFunction:
    """Normalises ``score_function`` (enum, TE code or lower-case name)."""
    return _enum_of(op, "score_function", ScoreFunction, score_function,
                    "'softmax', 'sigmoid', 'sqrtsoftplus'")


def routing_map_format_of(op: str, routing_map_format) -> RoutingMapFormat:
    """Normalises ``routing_map_format`` (enum, TE code or name in any case)."""
    return _enum_of(op, "routing_map_format", RoutingMapFormat, routing_map_format,
                    "'bytemap', 'bitmap_u8'")


def array_meta(op: str, name: str, x) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` of the array argument ``name``; anything but an array
    (or a Python / NumPy scalar) is a ``TypeError`` naming it.

    Lists and tuples are refused as JAX's own ``jnp`` functions refuse them
    (an implicit conversion would hide a host-to-device copy per call).
    """
    if isinstance(x, (list, tuple)):
        raise TypeError(
            f"{op}: {name} must be an array (jax.Array or numpy.ndarray), got {type(x).__name__}; "
            f"wrap it as jnp.asarray({name})."
        )
    if isinstance(x, (bool, int, float, np.generic)):
        return (), np.result_type(x)
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(
            f"{op}: {name} must be an array (jax.Array or numpy.ndarray), got {type(x).__name__}."
        )
    return tuple(x.shape), np.dtype(x.dtype)


def check_float_dtype(op: str, name: str, dtype) -> None:
    """``name`` must be float32, bfloat16 or float16 (float64 too for the jax backend)."""
    got = _dtype_name(dtype)
    if got not in _FLOAT_NAMES and got != "float64":
        raise TypeError(
            f"{op}: {name} must be float32, bfloat16 or float16 (or float64 with "
            f"backend=\"jax\"), got {got}."
        )


def check_backend(op: str, backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend ({backend!r}) must be one of {', '.join(map(repr, BACKENDS))}.")
    return backend


def check_transport(op: str, transport: str) -> str:
    if transport not in TRANSPORTS:
        raise ValueError(
            f"{op}: transport ({transport!r}) must be one of {', '.join(map(repr, TRANSPORTS))}."
        )
    return transport


def check_kernel_dtype(op: str, name: str, dtype) -> None:
    """The numba kernels compute in fp32 and take 32- and 16-bit floats only."""
    got = _dtype_name(dtype)
    if got == "float64":
        raise TypeError(
            f"{op}: {name} dtype (float64) must be float32, bfloat16 or float16 with "
            "backend=\"numba\" (the kernels compute in float32); cast, or use backend=\"jax\"."
        )


@dataclass(frozen=True)
class TopkConfig:
    """Validated, hashable static configuration of one top-k call."""

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
    compute_aux_scores = bool(compute_aux_scores)
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
        use_pre_softmax=bool(use_pre_softmax),
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


def kernel_feature_error(op: str, argument: str) -> NotImplementedError:
    return NotImplementedError(f'{op} (numba): {argument} is not in the kernels yet; use backend="jax".')


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


def check_z_loss_args(logits_shape, logits_dtype, coeff, total_num_tokens, shards: int = 1,
                      op: str = Z_LOSS_OP) -> tuple[float, int]:
    """Checks ``router_z_loss``'s arguments; returns ``(coeff, T)``, ``T``
    defaulting to the rows times ``shards`` (1 when there are no rows: the
    loss of no tokens is 0, not 0/0)."""
    if len(logits_shape) == 0:
        raise ValueError(f"{op}: logits rank (0) must be >= 1 (logits are [..., num_experts]).")
    check_float_dtype(op, "logits", logits_dtype)
    if logits_shape[-1] == 0:
        raise ValueError(f"{op}: num_experts (logits.shape[-1] = 0) must be >= 1.")
    coeff = _as_finite_float(op, "coeff", coeff)
    if total_num_tokens is None:
        return coeff, max(int(np.prod(logits_shape[:-1])) * shards, 1)
    total_num_tokens = _as_int(op, "total_num_tokens", total_num_tokens)
    if total_num_tokens <= 0:
        raise ValueError(f"{op}: total_num_tokens ({total_num_tokens}) must be > 0.")
    return coeff, total_num_tokens


def check_bias_update_args(bias_shape, bias_dtype, tpe_shape, tpe_dtype, rate,
                           op: str = BIAS_UPDATE_OP) -> None:
    """Checks ``update_expert_bias``'s arguments (``rate`` may be a traced scalar)."""
    if len(bias_shape) != 1 or bias_shape[0] == 0:
        raise ValueError(f"{op}: expert_bias shape {tuple(bias_shape)} must be (num_experts,), num_experts >= 1.")
    check_float_dtype(op, "expert_bias", bias_dtype)
    if tuple(tpe_shape) != tuple(bias_shape):
        raise ValueError(f"{op}: tokens_per_expert shape {tuple(tpe_shape)} must be (num_experts,) = "
                         f"{tuple(bias_shape)}.")
    got = _dtype_name(tpe_dtype)
    if got not in _TPE_NAMES + ("float16", "float64", "uint32", "int16", "uint8"):
        raise TypeError(f"{op}: tokens_per_expert must be integer or float counts, got {got}.")
    if _is_traced(rate) or hasattr(rate, "shape"):
        if tuple(getattr(rate, "shape", ())) != ():
            raise ValueError(f"{op}: rate shape {tuple(rate.shape)} must be () (a scalar).")
        return
    _as_finite_float(op, "rate", rate)


def simulator_collectives_warning(missing_flags) -> str:
    return (
        "gpurouter: the CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1) but JAX's backends started "
        "before gpurouter could raise XLA's CPU collective timeouts; a sharded jit that runs simulator "
        "kernels on several CPU devices may abort the process. Set XLA_FLAGS=\"" + " ".join(missing_flags)
        + "\" before JAX starts (docs/testing.md)."
    )


def unbound_axis_error(op: str, axis_name) -> ValueError:
    return ValueError(
        f"{op}: axis_name ({axis_name!r}) must be a mesh axis bound here (inside "
        "jax.shard_map, vmap or pmap over it), or None."
    )


@dataclass(frozen=True)
class AuxLossConfig:
    """Validated, hashable static configuration of one aux-loss call."""

    topk: int
    coeff: float
    total_num_tokens: int
    num_experts: int


def check_aux_loss_args(
    probs_shape: tuple[int, ...],
    probs_dtype,
    tpe_shape: tuple[int, ...],
    tpe_dtype,
    topk,
    coeff,
    total_num_tokens,
    num_experts,
    op: str = AUX_LOSS_OP,
) -> AuxLossConfig:
    """Checks the arguments of ``fused_moe_aux_loss``; returns the config."""
    if len(probs_shape) != 2:
        raise ValueError(
            f"{op}: probs shape {tuple(probs_shape)} must have rank 2 ([num_tokens, num_cols])."
        )
    check_float_dtype(op, "probs", probs_dtype)
    rows, cols = probs_shape
    if cols == 0:
        raise ValueError(f"{op}: num_cols (probs.shape[1] = 0) must be >= 1.")
    if tuple(tpe_shape) != (cols,):
        raise ValueError(
            f"{op}: tokens_per_expert shape {tuple(tpe_shape)} must be (num_cols,) = ({cols},)."
        )
    got = _dtype_name(tpe_dtype)
    if got not in _TPE_NAMES:
        raise TypeError(
            f"{op}: tokens_per_expert must be int32, int64, float32 or bfloat16, got {got}."
        )
    topk = _as_int(op, "topk", topk)
    if topk < 1:
        raise ValueError(f"{op}: topk ({topk}) must be >= 1.")
    coeff = _as_float(op, "coeff", coeff)
    if num_experts is None:
        num_experts = cols
    num_experts = _as_int(op, "num_experts", num_experts)
    if num_experts < 1:
        raise ValueError(f"{op}: num_experts ({num_experts}) must be >= 1.")
    if topk > num_experts:
        raise ValueError(f"{op}: topk ({topk}) must be <= num_experts ({num_experts}).")
    if cols % num_experts != 0:
        raise ValueError(
            f"{op}: num_cols (probs.shape[1] = {cols}) must be a multiple of "
            f"num_experts ({num_experts})."
        )
    if total_num_tokens is None:
        # No tokens and no count: the loss is an empty sum, 0. T = 1 keeps C
        # finite (C * 0 = 0, and the gradient is [0, C]) instead of 0/0.
        total_num_tokens = max(rows, 1)
    total_num_tokens = _as_int(op, "total_num_tokens", total_num_tokens)
    if total_num_tokens <= 0:
        raise ValueError(f"{op}: total_num_tokens ({total_num_tokens}) must be > 0.")
    return AuxLossConfig(
        topk=topk, coeff=coeff, total_num_tokens=total_num_tokens, num_experts=num_experts
    )
