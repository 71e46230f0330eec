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
TRANSPORTS = ("auto", "callback", "ffi", "zero-copy")


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


MOE_OP = "moe"
MOE_ACTIVATIONS = ("silu", "gelu", "relu", "linear")


def check_moe_args(x_shape, gate_shape, wi_0_shape, wi_1_shape, wo_shape, b0_shape, b1_shape, bo_shape,
                   num_experts, num_experts_per_tok, activation_type, align_size, ep_shards: int = 1,
                   op: str = MOE_OP) -> None:
    """Checks the MoE block's shapes and config (TE's weight layouts; with
    expert parallelism over ``ep_shards`` devices the expert weights are this
    device's ``num_experts / ep_shards``)."""
    e = _as_int(op, "num_experts", num_experts)
    k = _as_int(op, "num_experts_per_tok", num_experts_per_tok)
    align_size = _as_int(op, "align_size", align_size)
    if align_size < 0:
        raise ValueError(f"{op}: align_size ({align_size}) must be >= 0 (0: no padding).")
    if e < 1:
        raise ValueError(f"{op}: num_experts ({e}) must be >= 1.")
    if e % ep_shards:
        raise ValueError(f"{op}: num_experts ({e}) must be divisible by the ep_axis size ({ep_shards}).")
    if not 1 <= k <= e:
        raise ValueError(f"{op}: num_experts_per_tok ({k}) must be in [1, num_experts ({e})].")
    if len(x_shape) < 1:
        raise ValueError(f"{op}: x rank (0) must be >= 1 (x is [..., hidden]).")
    h = x_shape[-1]
    if tuple(gate_shape) != (h, e):
        raise ValueError(f"{op}: gate_kernel shape {tuple(gate_shape)} must be (hidden, num_experts) = {(h, e)}.")
    e = e // ep_shards  # the experts whose weights this device holds
    if len(wi_0_shape) != 3 or tuple(wi_0_shape[:2]) != (e, h):
        raise ValueError(f"{op}: wi_0 shape {tuple(wi_0_shape)} must be (local experts, hidden, M) = ({e}, {h}, M).")
    m = wi_0_shape[2]
    if tuple(wi_1_shape) != (e, h, m):
        raise ValueError(f"{op}: wi_1 shape {tuple(wi_1_shape)} must be wi_0's, {(e, h, m)}.")
    if tuple(wo_shape) != (e, m, h):
        raise ValueError(f"{op}: wo shape {tuple(wo_shape)} must be (num_experts, M, hidden) = {(e, m, h)}.")
    for name, got, want in (("wi_0_bias", b0_shape, (e, m)), ("wi_1_bias", b1_shape, (e, m)),
                            ("wo_bias", bo_shape, (e, h))):
        if got is not None and tuple(got) != want:
            raise ValueError(f"{op}: {name} shape {tuple(got)} must be {want}.")
    if activation_type not in MOE_ACTIVATIONS:
        raise ValueError(f"{op}: activation_type ({activation_type!r}) must be one of "
                         f"{', '.join(map(repr, MOE_ACTIVATIONS))}.")


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


# ----------------------------------------------------------------------------
# Token-level MoE ops (gpurouter/moe_ops.py, gpurouter/reference/moe_ops.py):
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


def _check_offsets(op: str, offsets, num_groups: int) -> None:
    """``offsets [G + 1]`` integers; where concrete, non-decreasing."""
    shape, dtype = array_meta(op, "offsets", offsets)
    if tuple(shape) != (num_groups + 1,):
        raise ValueError(f"{op}: offsets shape {shape} must be (num_groups + 1,) = ({num_groups + 1},).")
    _check_int_dtype(op, "offsets", dtype)
    if _is_traced(offsets):
        return
    o = np.asarray(offsets)
    if (np.diff(o) < 0).any():
        raise ValueError(f"{op}: offsets ({o.tolist()}) must be non-decreasing.")


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
    _check_offsets(op, offsets, g)
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
    _check_offsets(op, offsets, g)
    _check_accumulator(op, "dbias", dbias, (g, h))
    return n, h, g


def check_scaled_bias_add_args(y, bias, scales, group_sizes,
                               op: str = SCALED_BIAS_ADD_OP) -> tuple[int, int, int]:
    """Checks ``grouped_scaled_bias_add``; returns ``(N, H, G)``."""
    (n, h), y_dtype = _rank2(op, "y", y, "num_rows, hidden")
    check_float_dtype(op, "y", y_dtype)
    g = _check_grouped_bias(op, bias, h, "y")
    _check_scales(op, scales, n)
    gs_shape, gs_dtype = array_meta(op, "group_sizes", group_sizes)
    if tuple(gs_shape) != (g,):
        raise ValueError(f"{op}: group_sizes shape {gs_shape} must be (num_groups,) = ({g},).")
    _check_int_dtype(op, "group_sizes", gs_dtype)
    if not _is_traced(group_sizes):
        sizes = np.asarray(group_sizes)
        if (sizes < 0).any():
            raise ValueError(f"{op}: group_sizes ({sizes.tolist()}) must be >= 0.")
    return n, h, g


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
    return r, h, t, e


# ----------------------------------------------------------------------------
# The numba backend of the token-level MoE ops (gpurouter/_ops/moe_ops.py,
# kernels in gpurouter/kernels/moe_*.py)
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
