"""The shared rules of gpurouter's checks: static scalars, arrays, dtypes,
backends and transports, and the two enums every op takes (``ScoreFunction``,
``RoutingMapFormat``), plus the messages of the environment (the simulator's
collectives, an unbound mesh axis).

Every other module of :mod:`gpurouter._checks` builds on these helpers; none
of them imports jax (a traced value is recognised by its class name).
"""

from __future__ import annotations

import enum
import math
import operator

import numpy as np


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


def is_float_dtype(dtype) -> bool:
    """Any float dtype, bfloat16 included (NumPy does not count ml_dtypes' bfloat16 as floating)."""
    return np.issubdtype(np.dtype(dtype), np.floating) or _dtype_name(dtype) == "bfloat16"


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


def _as_bool(op: str, name: str, value) -> bool:
    """A flag: ``True``/``False`` (or ``numpy.bool_``) only; truthiness would
    turn ``"no"`` on (docs/contract.md section 6)."""
    if _is_traced(value):
        raise _static_error(op, name, "bool")
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} ({value!r}) must be a bool (True or False), got {type(value).__name__}.")
    return bool(value)


as_bool = _as_bool  # the public names of the package (gpurouter/_checks/__init__.py)


def unused_argument_error(op: str, name: str, value, why: str) -> ValueError:
    """An argument that does nothing in the chosen mode (docs/contract.md section 6);
    ``value`` is shown by its repr, or as given when it is already a description (a str)."""
    shown = value if isinstance(value, str) else repr(value)
    return ValueError(f"{op}: {name} ({shown}) does nothing {why}; leave it at its default.")


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


as_finite_float = _as_finite_float


def check_array_rank(op: str, name: str, shape, rank: int, what: str) -> None:
    """``name`` must have rank ``rank`` (``what``: its dims, e.g. ``[num_experts]``)."""
    if len(shape) != rank:
        raise ValueError(f"{op}: {name} shape {tuple(shape)} must have rank {rank} ({what}).")


def check_kernel_dtype(op: str, name: str, dtype) -> None:
    """The numba kernels compute in fp32 and take 32- and 16-bit floats only."""
    got = _dtype_name(dtype)
    if got == "float64":
        raise TypeError(
            f"{op}: {name} dtype (float64) must be float32, bfloat16 or float16 with "
            "backend=\"numba\" (the kernels compute in float32); cast, or use backend=\"jax\"."
        )


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
