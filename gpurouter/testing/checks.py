"""The conformance checks: does a router keep docs/contract.md? (``gpurouter.testing``)

Each ``check_*`` runs a battery of hypothesis properties against ``fn`` and the
NumPy float64 oracle (:mod:`gpurouter.testing.oracle`), with the contract's
tolerances (:mod:`gpurouter.testing.tolerances`):

- on success it returns a :class:`CheckReport` (properties, examples run, seconds);
- on a violation it raises :class:`CheckFailure`, an ``AssertionError`` whose
  message names the property, the config (as TE keyword arguments) and
  hypothesis's smallest counterexample, with expected vs got; its ``report``
  attribute holds the properties run so far;
- ``fn`` raising, or returning the wrong structure, shapes or dtypes, is a
  violation too, and the message says what ``fn`` returned.

``max_examples`` counts per property (properties whose configs are excluded by
``dtypes``/``score_functions`` are reported as skipped). ``seed`` makes a run
reproducible; without it the hypothesis settings of the current profile decide
(derandomised under the ``ci`` profile of :mod:`gpurouter.testing.profiles`).
``properties`` (keyword-only, optional) runs only the named properties.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis.extra import numpy as hnp

from . import oracle
from .strategies import (
    DTYPES,
    SCORE_FUNCTIONS,
    RouterConfig,
    as_jnp,
    biases,
    group_tied_logits,
    masked_logits,
    min_selection_gap,
    np_dtype,
    random_cotangent,
    router_configs,
    selection_scores,
    tie_biases,
    tie_configs,
    tie_free_logits,
    tied_logits,
    z_loss_logits,
)
from .tolerances import assert_close

__all__ = [
    "CheckFailure",
    "CheckReport",
    "PropertyResult",
    "check_aux_loss",
    "check_aux_scores",
    "check_router_z_loss",
    "check_topk",
]

#: Largest shapes the checks draw (tiny: the float64 oracle is plain Python loops,
#: and kernels on the CUDA simulator pay per launch).
MAX_TOKENS = 4
MAX_EXPERTS = 32


# ----------------------------------------------------------------------------
# Reports and failures
# ----------------------------------------------------------------------------


@dataclass
class PropertyResult:
    """One property of a check: ``status`` is "passed", "failed", "skipped" or "not run"."""

    name: str
    status: str
    examples: int = 0
    seconds: float = 0.0
    detail: str = ""


@dataclass
class CheckReport:
    """What a check ran: one :class:`PropertyResult` per property, in order."""

    op: str
    properties: list[PropertyResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(p.status in ("passed", "skipped") for p in self.properties)

    @property
    def examples(self) -> int:
        return sum(p.examples for p in self.properties)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.properties)

    def table(self) -> str:
        """A plain-text table: property, result, examples, seconds."""
        width = max([len("property")] + [len(p.name) for p in self.properties])
        lines = [f"{self.op}", f"{'property':<{width}}  {'result':<8}  {'examples':>8}  {'seconds':>8}"]
        lines.append("-" * len(lines[-1]))
        for p in self.properties:
            lines.append(f"{p.name:<{width}}  {p.status:<8}  {p.examples:>8}  {p.seconds:>8.2f}"
                         + (f"  ({p.detail})" if p.status == "skipped" and p.detail else ""))
        lines.append(f"{'total':<{width}}  {'passed' if self.passed else 'FAILED':<8}  "
                     f"{self.examples:>8}  {self.seconds:>8.2f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class CheckFailure(AssertionError):
    """A contract violation; ``report`` holds the properties run up to and including it."""

    def __init__(self, message: str, report: CheckReport):
        super().__init__(message)
        self.report = report


class _Violation(Exception):
    """Raised inside a property; hypothesis shrinks it, the runner turns it into CheckFailure."""


class _Skip(Exception):
    """A property with nothing to run under the requested dtypes/score functions."""


def _settings(max_examples: int, seed) -> settings:
    kw = dict(max_examples=int(max_examples), deadline=None, database=None, print_blob=False,
              report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    if seed is not None:
        kw["derandomize"] = False
    return settings(settings.default, **kw)


def _counted(body, count):
    def prop(data):
        body(data)
        count[0] += 1
    return prop


def _run(op: str, props: list[tuple[str, Callable]], only, max_examples: int, seed) -> CheckReport:
    names = [n for n, _ in props]
    if only is not None:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise ValueError(f"{op}: unknown properties {unknown}; choose from {names}")
    if not isinstance(max_examples, int) or isinstance(max_examples, bool) or max_examples < 1:
        raise ValueError(f"{op}: max_examples ({max_examples!r}) must be an int >= 1")
    report = CheckReport(op)
    for name, make in props:
        if only is not None and name not in only:
            continue
        try:
            body = make()
        except _Skip as why:
            report.properties.append(PropertyResult(name, "skipped", detail=str(why)))
            continue
        count = [0]
        test = _settings(max_examples, seed)(given(st.data())(_counted(body, count)))
        if seed is not None:
            test = hypothesis.seed(seed)(test)
        result = PropertyResult(name, "passed")
        report.properties.append(result)
        t0 = time.perf_counter()
        try:
            test()
        except _Violation as v:
            result.status, result.examples = "failed", count[0]
            result.seconds = time.perf_counter() - t0
            for rest, _ in props[props.index((name, make)) + 1:]:
                if only is None or rest in only:
                    report.properties.append(PropertyResult(rest, "not run"))
            raise CheckFailure(f"{op}: property '{name}' failed.\n{v}", report) from None
        result.examples = count[0]
        result.seconds = time.perf_counter() - t0
    return report


# ----------------------------------------------------------------------------
# Calling fn and reading what it returned
# ----------------------------------------------------------------------------


def _describe(obj) -> str:
    if isinstance(obj, (tuple, list)):
        inner = ", ".join(_describe(o) for o in obj)
        return f"{type(obj).__name__} of {len(obj)}: ({inner})"
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return f"{type(obj).__name__} {np.dtype(obj.dtype).name}{list(obj.shape)}"
    return f"{type(obj).__name__} {obj!r}"[:200]


def _call(fn, args, context: str):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any exception of fn is reported as a violation
        raise _Violation(f"{context}\nfn raised {type(e).__name__}: {e}") from None


def _pair(res, shape, dtype, map_shape, context: str, names=("probs", "routing_map")):
    """``(a, b)`` from fn's result: a tuple of two arrays of ``shape``, ``dtype`` and bool."""
    ok = isinstance(res, (tuple, list)) and len(res) == 2 and all(
        hasattr(r, "shape") and hasattr(r, "dtype") for r in res)
    if not ok:
        raise _Violation(f"{context}\nfn must return ({names[0]}, {names[1]}); it returned {_describe(res)}")
    a, b = res
    want = (f"{names[0]} {np.dtype(dtype).name}{list(shape)}, {names[1]} bool{list(map_shape)}")
    if (tuple(a.shape) != tuple(shape) or np.dtype(a.dtype) != np.dtype(dtype)
            or tuple(b.shape) != tuple(map_shape) or np.dtype(b.dtype) != np.dtype(bool)):
        raise _Violation(f"{context}\nfn returned {_describe(res)}; expected ({want})")
    return a, b


def _scalar(res, dtype, context: str):
    if not (hasattr(res, "shape") and hasattr(res, "dtype")) or tuple(res.shape) != () \
            or np.dtype(res.dtype) != np.dtype(dtype):
        raise _Violation(f"{context}\nfn returned {_describe(res)}; expected a {np.dtype(dtype).name} scalar "
                         "(shape ())")
    return res


def _arr(a) -> str:
    return np.array2string(np.asarray(a, np.float32), precision=6, separator=", ", threshold=10_000,
                           max_line_width=120)


def _close(got, want, kind, dtype, E=None, what="") -> str | None:
    try:
        assert_close(got, want, kind, dtype, E=E, check_dtype=False, err_msg=what)
    except AssertionError as e:
        return f"{e}\n  expected {what} = {_arr(want)}\n  got      {what} = {_arr(got)}"
    return None


def _map_diff(got, want, what="routing_map") -> str | None:
    got, want = np.asarray(got, bool), np.asarray(want, bool)
    if np.array_equal(got, want):
        return None
    g2, w2 = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    t = int(np.flatnonzero((g2 != w2).any(-1))[0])
    return (f"{what} differs at token {t}: expected experts {np.flatnonzero(w2[t]).tolist()}, "
            f"got {np.flatnonzero(g2[t]).tolist()}")


# ----------------------------------------------------------------------------
# Tie robustness: ties are decided by the rule; near-ties that are not ties are skipped
# ----------------------------------------------------------------------------


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(a), abs(b)) + 1e-6


def _ambiguous_row(keys, ident, num_groups: int, per_group: int) -> bool:
    """True when two entries (or groups) are within float32 rounding without being
    structurally equal (same logit and bias): float32 may order them either way."""
    n = len(keys)
    for i in range(n):
        for j in range(i + 1, n):
            a, b = keys[i], keys[j]
            if math.isinf(a) or math.isinf(b) or ident[i] == ident[j]:
                continue
            if _near(a, b):
                return True
    if num_groups > 0:
        size = n // num_groups
        tops = [sorted(keys[g * size:(g + 1) * size], reverse=True)[:per_group] for g in range(num_groups)]
        sums = [float(sum(t)) for t in tops]
        for g in range(num_groups):
            for h in range(g + 1, num_groups):
                if tops[g] == tops[h] or math.isinf(sums[g]) or math.isinf(sums[h]):
                    continue
                if _near(sums[g], sums[h]):
                    return True
    return False


def _robust(x, r, cfg_groups: tuple[int, int], bias=None) -> bool:
    """Every row of selection scores ``r`` is free of non-structural near-ties."""
    num_groups, per_group = cfg_groups
    x = np.asarray(x, np.float64)
    for t in range(x.shape[0]):
        keys = [oracle.selection_key(v) for v in r[t]]
        ident = [("nan",) if math.isnan(x[t, i]) else (float(x[t, i]), 0.0 if bias is None else float(bias[i]))
                 for i in range(x.shape[1])]
        if _ambiguous_row(keys, ident, num_groups, per_group):
            return False
    return True


def _groups_of(cfg: RouterConfig) -> tuple[int, int]:
    return (cfg.num_groups, cfg.topk // cfg.group_topk) if cfg.grouped else (0, 0)


# ----------------------------------------------------------------------------
# check_topk
# ----------------------------------------------------------------------------


def _te_call(cfg: RouterConfig, bias, shape=None) -> str:
    shape = cfg.shape if shape is None else shape
    b = "None" if bias is None else f"float32[{cfg.num_experts}]"
    return (f"config: fn(logits={cfg.dtype}{list(shape)}, topk={cfg.topk}, "
            f"use_pre_softmax={cfg.use_pre_softmax}, num_groups={cfg.num_groups}, "
            f"group_topk={cfg.group_topk}, scaling_factor={cfg.scaling_factor}, "
            f"score_function={cfg.score_function!r}, expert_bias={b})")


def _case(cfg, x, bias, extra: str = "", shape=None) -> str:
    lines = [_te_call(cfg, bias, shape), "smallest counterexample (hypothesis):", f"  logits = {_arr(x)}"]
    if bias is not None:
        lines.append(f"  expert_bias = {_arr(bias)}")
    if extra:
        lines.append(extra)
    return "\n".join(lines)


def _topk_args(cfg: RouterConfig, x, bias):
    bj = None if bias is None else jnp.asarray(np.asarray(bias, np.float32))
    return (as_jnp(x, cfg.dtype), cfg.topk, cfg.use_pre_softmax, cfg.num_groups, cfg.group_topk,
            cfg.scaling_factor, cfg.score_function, bj)


@functools.lru_cache(maxsize=16)
def _jit_topk(fn):
    """``fn`` under ``jax.jit`` (the statics static): one compile per config, not one per op."""
    return jax.jit(fn, static_argnums=(1, 2, 3, 4, 5, 6))


def _topk_forward_check(fn, cfg: RouterConfig, x, bias, *, nan_rows_values: bool = False) -> None:
    """Map exactly the oracle's; probs within the contract's tolerance; 0 off the map."""
    ctx = _case(cfg, x, bias)
    probs, rmap = _pair(_call(_jit_topk(fn), _topk_args(cfg, x, bias), ctx), cfg.shape, np_dtype(cfg.dtype),
                        cfg.shape, ctx)
    rmap = np.asarray(rmap)
    counts = rmap.sum(-1)
    if (counts != cfg.topk).any():
        t = int(np.flatnonzero(counts != cfg.topk)[0])
        raise _Violation(f"{ctx}\nevery token selects exactly topk={cfg.topk} experts; token {t} selected "
                         f"{int(counts[t])}: {np.flatnonzero(rmap[t]).tolist()}")
    e_probs, e_map, _ = oracle.topk_fwd(x, expert_bias=bias, **cfg.kwargs())
    diff = _map_diff(rmap, e_map)
    if diff:
        raise _Violation(f"{ctx}\n{diff}")
    pn = np.asarray(probs)  # its own dtype: the half tolerance is one ulp of it
    p = pn.astype(np.float32)
    off = p[~rmap]
    if off.size and not (off == 0).all():
        raise _Violation(f"{ctx}\nprobs off the routing map must be exactly 0; got {_arr(p)}")
    rows = np.ones(cfg.num_tokens, bool)
    if not nan_rows_values:  # rows with a NaN logit: only the selection is promised
        rows = ~np.isnan(np.asarray(x)).any(-1)
    msg = _close(pn[rows], e_probs[rows], "probs", cfg.dtype, what="probs")
    if msg:
        raise _Violation(f"{ctx}\n{msg}")


def _draw_cfg(data, dtypes, score_functions, **kw) -> RouterConfig:
    return data.draw(router_configs(max_tokens=MAX_TOKENS, max_experts=MAX_EXPERTS, dtypes=dtypes,
                                    score_functions=score_functions, **kw), label="config")


def check_topk(fn, *, max_examples: int = 100, dtypes: Sequence[str] = DTYPES,
               score_functions: Sequence[str] = SCORE_FUNCTIONS, grads: bool = True, seed=None,
               properties: Sequence[str] | None = None) -> CheckReport:
    """Checks a router top-k against docs/contract.md sections 2-3.

    ``fn(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
    score_function, expert_bias)`` (TE's positional order; ``score_function`` a
    str, ``num_groups``/``group_topk`` -1 when off, ``expert_bias`` None or
    float32 ``[E]``) must return ``(probs, routing_map)``: probs of the dtype of
    ``logits``, a bool map, both of the shape of ``logits`` (any leading dims).

    Properties (``max_examples`` each): values and maps on tie-free inputs;
    group-limited selection; the bias chooses but never weighs; the tie rule;
    ties of groups; ``-inf``/NaN masking; gradients against the oracle's
    backward with random cotangents, on tie-free and on ``-inf``-masked rows
    (``grads=True``); ``jit``, ``vmap``, ``grad`` under ``jit``, leading dims and
    T = 0. Returns a :class:`CheckReport`; raises :class:`CheckFailure`.
    """
    dtypes, sfs = tuple(dtypes), tuple(score_functions)
    bad = [d for d in dtypes if d not in DTYPES] + [s for s in sfs if s not in SCORE_FUNCTIONS]
    if bad or not dtypes or not sfs:
        raise ValueError(f"check_topk: dtypes must be among {DTYPES} and score_functions among "
                         f"{SCORE_FUNCTIONS}; got {dtypes}, {sfs}")
    biased = tuple(s for s in sfs if s != "softmax")

    def values():
        def body(data):
            cfg = _draw_cfg(data, dtypes, sfs)
            bias = data.draw(biases(cfg), label="expert_bias")
            x = data.draw(tie_free_logits(cfg, bias), label="logits")
            _topk_forward_check(fn, cfg, x, bias)
        return body

    def groups():
        def body(data):
            cfg = _draw_cfg(data, dtypes, sfs, grouped=True)
            assume(cfg.group_topk < cfg.num_groups)  # some group is excluded
            bias = data.draw(biases(cfg), label="expert_bias")
            x = data.draw(tie_free_logits(cfg, bias), label="logits")
            _topk_forward_check(fn, cfg, x, bias)
        return body

    def bias_only_chooses():
        if not biased:
            raise _Skip("no sigmoid/sqrtsoftplus in score_functions")

        def body(data):
            cfg = _draw_cfg(data, dtypes, biased, bias=True)
            bias = data.draw(biases(cfg), label="expert_bias")
            x = data.draw(tie_free_logits(cfg, bias), label="logits")
            _topk_forward_check(fn, cfg, x, bias)
        return body

    def ties():
        def body(data):
            cfg = data.draw(tie_configs(max_tokens=MAX_TOKENS, max_experts=16, dtypes=dtypes,
                                        score_functions=sfs), label="config")
            bias = data.draw(tie_biases(cfg), label="expert_bias")
            x = data.draw(tied_logits(cfg), label="logits")
            assume(_robust(x, selection_scores(x, cfg, bias), _groups_of(cfg), bias))
            _topk_forward_check(fn, cfg, x, bias)
        return body

    def group_ties():
        def body(data):
            cfg = data.draw(tie_configs(max_tokens=MAX_TOKENS, max_experts=16, dtypes=dtypes,
                                        score_functions=sfs, grouped=True, bias=False), label="config")
            assume(cfg.group_topk < cfg.num_groups)
            x = data.draw(group_tied_logits(cfg), label="logits")
            assume(_robust(x, selection_scores(x, cfg), _groups_of(cfg)))
            _topk_forward_check(fn, cfg, x, None)
        return body

    def masking():
        def body(data):
            cfg = data.draw(tie_configs(max_tokens=MAX_TOKENS, max_experts=16, dtypes=dtypes,
                                        score_functions=sfs), label="config")
            bias = data.draw(tie_biases(cfg), label="expert_bias")
            x = data.draw(masked_logits(cfg), label="logits")
            r = selection_scores(x, cfg, bias)
            assume(_robust(x, r, _groups_of(cfg), bias))
            _topk_forward_check(fn, cfg, x, bias)
        return body

    def _grad_check(data, cfg, x, bias):
        ctx0 = _case(cfg, x, bias)
        seed_ = data.draw(st.integers(0, 2**16), label="cotangent seed")
        g = random_cotangent(seed_, cfg.shape, cfg.dtype)
        args = _topk_args(cfg, x, bias)

        def f(a):
            return _pair(fn(a, *args[1:]), cfg.shape, np_dtype(cfg.dtype), cfg.shape, ctx0)[0]

        ctx = _case(cfg, x, bias, f"  cotangent of probs = {_arr(g)}")
        try:
            dx = jax.jit(lambda a, c: jax.vjp(f, a)[1](c)[0])(args[0], as_jnp(g, cfg.dtype))
        except _Violation:
            raise
        except Exception as e:  # noqa: BLE001
            raise _Violation(f"{ctx}\njax.vjp of fn raised {type(e).__name__}: {e}") from None
        if np.dtype(dx.dtype) != np.dtype(np_dtype(cfg.dtype)):
            raise _Violation(f"{ctx}\ngrad_logits must have the dtype of logits ({cfg.dtype}); got {dx.dtype}")
        _, e_map, e_saved = oracle.topk_fwd(x, expert_bias=bias, **cfg.kwargs())
        e_dx = oracle.topk_bwd(e_map, e_saved, g, **cfg.bwd_kwargs())
        msg = _close(dx, e_dx, "grads", cfg.dtype, E=cfg.num_experts, what="grad_logits")
        if msg:
            raise _Violation(f"{ctx}\n{msg}")

    def gradients():
        if not grads:
            raise _Skip("grads=False")

        def body(data):
            cfg = _draw_cfg(data, dtypes, sfs)
            bias = data.draw(biases(cfg), label="expert_bias")
            x = data.draw(tie_free_logits(cfg, bias), label="logits")
            _grad_check(data, cfg, x, bias)
        return body

    def masked_gradients():
        if not grads:
            raise _Skip("grads=False")

        def body(data):
            cfg = data.draw(tie_configs(max_tokens=MAX_TOKENS, max_experts=16, dtypes=dtypes,
                                        score_functions=sfs), label="config")
            bias = data.draw(tie_biases(cfg), label="expert_bias")
            x = data.draw(masked_logits(cfg, allow_nan=False,
                                        all_masked_rows=cfg.score_function != "softmax"), label="logits")
            if cfg.score_function == "softmax":  # an all -inf row is NaN for softmax (contract section 2)
                x[np.isinf(x).all(-1), 0] = 0.0
            assume(_robust(x, selection_scores(x, cfg, bias), _groups_of(cfg), bias))
            _grad_check(data, cfg, x, bias)
        return body

    def transforms():
        def body(data):
            cfg = _draw_cfg(data, dtypes, sfs)
            bias = data.draw(biases(cfg), label="expert_bias")
            x = data.draw(tie_free_logits(cfg, bias), label="logits")
            args = _topk_args(cfg, x, bias)
            statics, bj, dt = args[1:7], args[7], np_dtype(cfg.dtype)
            T, E = cfg.shape
            xb = np.stack([x, x[::-1]])  # [2, T, E]
            e_probs, e_map, e_saved = oracle.topk_fwd(xb.reshape(2 * T, E), expert_bias=bias, **cfg.kwargs())
            e_probs, e_map = e_probs.reshape(2, T, E), e_map.reshape(2, T, E)

            def compare(res, shape, what, want_p, want_m):
                ctx = _case(cfg, x, bias, f"  under {what}", shape=shape)
                p, m = _pair(res, shape, dt, shape, ctx)
                diff = _map_diff(m, want_m)
                msg = diff or _close(p, want_p, "probs", cfg.dtype, what="probs")
                if msg:
                    raise _Violation(f"{ctx}\n{msg}")

            def run(what, f, *a):
                try:
                    return f(*a)
                except _Violation:
                    raise
                except Exception as e:  # noqa: BLE001
                    raise _Violation(f"{_case(cfg, x, bias)}\nfn raised {type(e).__name__} under {what}: {e}") \
                        from None

            xbj = as_jnp(xb, cfg.dtype)
            compare(run("jax.jit", jax.jit(lambda a, b: fn(a, *statics, b)), args[0], bj),
                    (T, E), "jax.jit", e_probs[0], e_map[0])
            compare(run("leading dims [2, T, E]", _jit_topk(fn), xbj, *statics, bj), (2, T, E),
                    "leading dims [2, T, E]", e_probs, e_map)
            compare(run("jax.vmap", jax.jit(jax.vmap(lambda a: fn(a, *statics, bj))), xbj), (2, T, E),
                    "jax.vmap over a batch of [T, E]", e_probs, e_map)
            for empty in ((0, E), (2, 0, E)):
                ctx = _case(cfg, x, bias, f"  on empty logits of shape {empty} (T = 0)", shape=empty)
                _pair(run(f"T = 0 {empty}", _jit_topk(fn), jnp.zeros(empty, dt), *statics, bj), empty, dt, empty,
                      ctx)
            if grads:
                g = random_cotangent(data.draw(st.integers(0, 2**16), label="cotangent seed"), cfg.shape, cfg.dtype)
                gj = as_jnp(g, cfg.dtype).astype(jnp.float32)

                def loss(a):
                    return jnp.sum(fn(a, *statics, bj)[0].astype(jnp.float32) * gj)

                dx = run("jax.jit(jax.grad)", jax.jit(jax.grad(loss)), args[0])
                e_dx = oracle.topk_bwd(e_map[0], e_saved[:T], g, **cfg.bwd_kwargs())
                msg = _close(dx, e_dx, "grads", cfg.dtype, E=E, what="grad_logits")
                if msg:
                    raise _Violation(f"{_case(cfg, x, bias, '  under jax.jit(jax.grad(sum(probs * g)))')}\n{msg}")
        return body

    props = [("values (tie-free)", values), ("group-limited selection", groups),
             ("bias chooses, never weighs", bias_only_chooses), ("tie rule", ties),
             ("ties of groups", group_ties), ("-inf and NaN masking", masking),
             ("gradients", gradients), ("gradients with -inf", masked_gradients),
             ("jit, vmap, grad, leading dims, T=0", transforms)]
    return _run("check_topk", props, properties, max_examples, seed)


# ----------------------------------------------------------------------------
# check_aux_scores
# ----------------------------------------------------------------------------


def _aux_case(cfg, x, extra="", shape=None) -> str:
    shape = cfg.shape if shape is None else shape
    lines = [f"config: fn(logits={cfg.dtype}{list(shape)}, topk={cfg.topk}, "
             f"score_function={cfg.score_function!r})  (TE's compute_aux_scores=True)",
             "smallest counterexample (hypothesis):", f"  logits = {_arr(x)}"]
    if extra:
        lines.append(extra)
    return "\n".join(lines)


def _aux_forward_check(fn, cfg, x) -> None:
    ctx = _aux_case(cfg, x)
    res = _call(jax.jit(fn, static_argnums=(1, 2)), (as_jnp(x, cfg.dtype), cfg.topk, cfg.score_function), ctx)
    scores, rmap = _pair(res, cfg.shape, np.float32, cfg.shape, ctx, names=("scores", "routing_map"))
    rmap = np.asarray(rmap)
    counts = rmap.sum(-1)
    if (counts != cfg.topk).any():
        t = int(np.flatnonzero(counts != cfg.topk)[0])
        raise _Violation(f"{ctx}\nevery token selects exactly topk={cfg.topk} experts; token {t} selected "
                         f"{int(counts[t])}")
    e_scores, e_map, _ = oracle.aux_scores_fwd(x, cfg.topk, cfg.score_function)
    diff = _map_diff(rmap, e_map)
    if diff:
        raise _Violation(f"{ctx}\n{diff}")
    rows = ~np.isnan(np.asarray(x)).any(-1)
    msg = _close(np.asarray(scores)[rows], e_scores[rows], "probs", "float32", what="scores")
    if msg:
        raise _Violation(f"{ctx}\n{msg}")


def check_aux_scores(fn, *, max_examples: int = 100, dtypes: Sequence[str] = DTYPES,
                     score_functions: Sequence[str] = SCORE_FUNCTIONS, grads: bool = True, seed=None,
                     properties: Sequence[str] | None = None) -> CheckReport:
    """Checks the aux-loss scores (TE's ``compute_aux_scores=True``) against the contract.

    ``fn(logits, topk, score_function)`` must return ``(scores, routing_map)``:
    float32 scores over all E (softmax, or sigmoid/sqrtsoftplus normalised over
    all E with ``+1e-20``; no bias, groups or scaling) and the bool top-K map of
    the scores, both of the shape of ``logits``.

    Properties (``max_examples`` each): values and maps on tie-free inputs; the
    tie rule; ``-inf``/NaN masking; gradients against the oracle (``grads``);
    ``jit``, ``vmap``, ``grad`` under ``jit``, leading dims and T = 0.
    """
    dtypes, sfs = tuple(dtypes), tuple(score_functions)
    if any(d not in DTYPES for d in dtypes) or any(s not in SCORE_FUNCTIONS for s in sfs) or not dtypes or not sfs:
        raise ValueError(f"check_aux_scores: dtypes must be among {DTYPES} and score_functions among "
                         f"{SCORE_FUNCTIONS}; got {dtypes}, {sfs}")

    def cfgs(data, max_experts=MAX_EXPERTS):
        return data.draw(router_configs(max_tokens=MAX_TOKENS, max_experts=max_experts, dtypes=dtypes,
                                        score_functions=sfs, grouped=False, bias=False), label="config")

    def scores_of(x, cfg):
        return oracle.aux_scores_fwd(x, cfg.topk, cfg.score_function)[0]

    def tie_free(data):
        cfg = cfgs(data)
        x = data.draw(tie_free_logits(cfg), label="logits")
        assume(min_selection_gap(scores_of(x, cfg), cfg) > 0)
        return cfg, x

    def values():
        def body(data):
            cfg, x = tie_free(data)
            _aux_forward_check(fn, cfg, x)
        return body

    def ties():
        def body(data):
            cfg = cfgs(data, 16)
            x = data.draw(tied_logits(cfg), label="logits")
            assume(_robust(x, scores_of(x, cfg), (0, 0)))
            _aux_forward_check(fn, cfg, x)
        return body

    def masking():
        def body(data):
            cfg = cfgs(data, 16)
            x = data.draw(masked_logits(cfg), label="logits")
            assume(_robust(x, scores_of(x, cfg), (0, 0)))
            _aux_forward_check(fn, cfg, x)
        return body

    def _grad(data, cfg, x, under_jit=False):
        g = random_cotangent(data.draw(st.integers(0, 2**16), label="cotangent seed"), cfg.shape)
        what = "jax.jit(jax.grad(sum(scores * g)))" if under_jit else "jax.vjp"
        ctx = _aux_case(cfg, x, f"  cotangent of scores = {_arr(g)}  (under {what})")

        def f(a):
            res = fn(a, cfg.topk, cfg.score_function)
            return _pair(res, cfg.shape, np.float32, cfg.shape, ctx, names=("scores", "routing_map"))[0]

        try:
            if under_jit:
                dx = jax.jit(jax.grad(lambda a: jnp.sum(f(a) * jnp.asarray(g))))(as_jnp(x, cfg.dtype))
            else:
                dx = jax.jit(lambda a, c: jax.vjp(f, a)[1](c)[0])(as_jnp(x, cfg.dtype), jnp.asarray(g))
        except _Violation:
            raise
        except Exception as e:  # noqa: BLE001
            raise _Violation(f"{ctx}\n{what} of fn raised {type(e).__name__}: {e}") from None
        if np.dtype(dx.dtype) != np.dtype(np_dtype(cfg.dtype)):
            raise _Violation(f"{ctx}\ngrad_logits must have the dtype of logits ({cfg.dtype}); got {dx.dtype}")
        _, _, saved = oracle.aux_scores_fwd(x, cfg.topk, cfg.score_function)
        msg = _close(dx, oracle.aux_scores_bwd(saved, g, cfg.score_function), "grads", cfg.dtype,
                     E=cfg.num_experts, what="grad_logits")
        if msg:
            raise _Violation(f"{ctx}\n{msg}")

    def gradients():
        if not grads:
            raise _Skip("grads=False")

        def body(data):
            cfg, x = tie_free(data)
            _grad(data, cfg, x)
        return body

    def transforms():
        def body(data):
            cfg, x = tie_free(data)
            T, E = cfg.shape
            xb = np.stack([x, x[::-1]])
            e_s, e_m, _ = oracle.aux_scores_fwd(xb.reshape(2 * T, E), cfg.topk, cfg.score_function)
            e_s, e_m = e_s.reshape(2, T, E), e_m.reshape(2, T, E)
            k, sf = cfg.topk, cfg.score_function

            def check(what, f, a, shape, want_s, want_m):
                ctx = _aux_case(cfg, x, f"  under {what}", shape=shape)
                s, m = _pair(_call(f, (a,), ctx), shape, np.float32, shape, ctx, names=("scores", "routing_map"))
                msg = _map_diff(m, want_m) or _close(s, want_s, "probs", "float32", what="scores")
                if msg:
                    raise _Violation(f"{ctx}\n{msg}")

            xj, xbj = as_jnp(x, cfg.dtype), as_jnp(xb, cfg.dtype)
            check("jax.jit", jax.jit(lambda a: fn(a, k, sf)), xj, (T, E), e_s[0], e_m[0])
            check("leading dims [2, T, E]", jax.jit(lambda a: fn(a, k, sf)), xbj, (2, T, E), e_s, e_m)
            check("jax.vmap", jax.jit(jax.vmap(lambda a: fn(a, k, sf))), xbj, (2, T, E), e_s, e_m)
            for empty in ((0, E), (2, 0, E)):
                ctx = _aux_case(cfg, x, f"  on empty logits of shape {empty} (T = 0)", shape=empty)
                _pair(_call(jax.jit(lambda a: fn(a, k, sf)), (jnp.zeros(empty, np_dtype(cfg.dtype)),), ctx), empty,
                      np.float32, empty,
                      ctx, names=("scores", "routing_map"))
            if grads:
                _grad(data, cfg, x, under_jit=True)
        return body

    props = [("values (tie-free)", values), ("tie rule", ties), ("-inf and NaN masking", masking),
             ("gradients", gradients), ("jit, vmap, grad, leading dims, T=0", transforms)]
    return _run("check_aux_scores", props, properties, max_examples, seed)


# ----------------------------------------------------------------------------
# check_aux_loss
# ----------------------------------------------------------------------------


@st.composite
def _aux_loss_case(draw, dtypes):
    num_tokens = draw(st.integers(1, 8), label="T")
    num_experts = draw(st.integers(1, 16), label="E")
    topk = draw(st.integers(1, num_experts), label="topk")
    coeff = draw(st.sampled_from([1e-2, 1.0, 0.5, 2.0]), label="coeff")
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    tpe_dtype = draw(st.sampled_from(["int32", "float32"]), label="tokens_per_expert dtype")
    probs = draw(hnp.arrays(
        np.float32, (num_tokens, num_experts), elements=st.floats(0, 1, width=16, allow_subnormal=False)))
    probs = probs.astype(np_dtype(dtype)).astype(np.float32)
    tpe = draw(hnp.arrays(np.int32, (num_experts,), elements=st.integers(0, 64)))
    return probs, tpe, topk, coeff, dtype, tpe_dtype


def _aux_loss_ctx(probs, tpe, topk, coeff, dtype, tpe_dtype, extra="") -> str:
    t, e = probs.shape
    return "\n".join([f"config: fn(probs={dtype}[{t}, {e}], tokens_per_expert={tpe_dtype}[{e}], topk={topk}, "
                      f"coeff={coeff})", "smallest counterexample (hypothesis):", f"  probs = {_arr(probs)}",
                      f"  tokens_per_expert = {np.asarray(tpe).tolist()}"] + ([extra] if extra else []))


def check_aux_loss(fn, *, max_examples: int = 100, dtypes: Sequence[str] = DTYPES, grads: bool = True,
                   seed=None, properties: Sequence[str] | None = None) -> CheckReport:
    """Checks the MoE aux loss (contract section 4) and its gradient.

    ``fn(probs, tokens_per_expert, topk, coeff)`` must return a scalar of the
    dtype of ``probs``: ``C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c]``
    with ``C = E * coeff / (topk * T * T)``, ``T`` = rows and ``E`` = columns of
    ``probs``; its gradient with respect to ``probs`` is ``C * tokens_per_expert[c]``
    times the cotangent (none to the counts).

    Properties (``max_examples`` each): value and dtype; gradient (``grads``);
    ``jit``.
    """
    dtypes = tuple(dtypes)
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"check_aux_loss: dtypes must be among {DTYPES}; got {dtypes}")

    def args_of(case):
        probs, tpe, topk, coeff, dtype, tpe_dtype = case
        return as_jnp(probs, dtype), jnp.asarray(tpe.astype(tpe_dtype)), topk, coeff

    def value_check(case, out, ctx):
        probs, tpe, topk, coeff, dtype, _ = case
        loss = _scalar(out, np_dtype(dtype), ctx)
        want, _ = oracle.aux_loss_fwd(probs, tpe, topk, coeff)
        msg = _close(np.asarray(loss.astype(jnp.float32)), np.float64(want), "aux_loss", dtype, what="loss")
        if msg:
            raise _Violation(f"{ctx}\n{msg}")

    def values():
        def body(data):
            case = data.draw(_aux_loss_case(dtypes), label="inputs")
            ctx = _aux_loss_ctx(*case)
            value_check(case, _call(fn, args_of(case), ctx), ctx)
        return body

    def gradient():
        if not grads:
            raise _Skip("grads=False")

        def body(data):
            case = data.draw(_aux_loss_case(dtypes), label="inputs")
            probs, tpe, topk, coeff, dtype, _ = case
            g = data.draw(st.sampled_from([1.0, -0.5, 3.0]), label="cotangent")
            ctx = _aux_loss_ctx(*case, extra=f"  cotangent of the loss = {g}")
            a, n, k, c = args_of(case)
            try:
                out, pullback = jax.vjp(lambda p: fn(p, n, k, c), a)
                _scalar(out, np_dtype(dtype), ctx)
                (dp,) = pullback(jnp.asarray(g, out.dtype))
            except _Violation:
                raise
            except Exception as e:  # noqa: BLE001
                raise _Violation(f"{ctx}\njax.vjp of fn raised {type(e).__name__}: {e}") from None
            if np.dtype(dp.dtype) != np.dtype(np_dtype(dtype)):
                raise _Violation(f"{ctx}\ngrad_probs must have the dtype of probs ({dtype}); got {dp.dtype}")
            _, cc = oracle.aux_loss_fwd(probs, tpe, topk, coeff)
            want = oracle.aux_loss_bwd(cc, tpe, g, probs.shape[0])
            msg = _close(dp, want, "grads", dtype, E=probs.shape[1], what="grad_probs")
            if msg:
                raise _Violation(f"{ctx}\n{msg}")
        return body

    def jitted():
        def body(data):
            case = data.draw(_aux_loss_case(dtypes), label="inputs")
            ctx = _aux_loss_ctx(*case, extra="  under jax.jit")
            a, n, k, c = args_of(case)
            value_check(case, _call(jax.jit(lambda p, q: fn(p, q, k, c)), (a, n), ctx), ctx)
        return body

    props = [("value and dtype", values), ("gradient", gradient), ("jit", jitted)]
    return _run("check_aux_loss", props, properties, max_examples, seed)


# ----------------------------------------------------------------------------
# check_router_z_loss
# ----------------------------------------------------------------------------


def _z_ctx(x, dtype, coeff, extra="", shape=None) -> str:
    shape = list(np.shape(x)) if shape is None else list(shape)
    return "\n".join([f"config: fn(logits={dtype}{shape}, coeff={coeff})",
                      "smallest counterexample (hypothesis):", f"  logits = {_arr(x)}"] + ([extra] if extra else []))


def _z_close(got, want, coeff, what="loss") -> str | None:
    got = float(np.asarray(got, np.float32))
    bound = 1e-5 * abs(want) + 1e-6 * abs(coeff)
    if not abs(got - want) <= bound:  # NaN fails
        return f"{what}: |got - expected| = {abs(got - want)!r} > bound {bound!r}; expected {want!r}, got {got!r}"
    return None


def check_router_z_loss(fn, *, max_examples: int = 100, dtypes: Sequence[str] = DTYPES, grads: bool = True,
                        seed=None, properties: Sequence[str] | None = None) -> CheckReport:
    """Checks the router z-loss of ST-MoE (``coeff * sum_t lse_t^2 / T``, float32).

    ``fn(logits, coeff)`` takes ``[..., E]`` logits (every leading dim a token)
    and returns a float32 scalar; a row of all ``-inf`` contributes 0 and gets a
    zero gradient (finite), and still counts in ``T``.

    Properties (``max_examples`` each): value and dtype (``-inf`` masks and
    all-``-inf`` rows included); gradient (``grads``); ``jit`` and leading dims.
    """
    dtypes = tuple(dtypes)
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"check_router_z_loss: dtypes must be among {DTYPES}; got {dtypes}")

    def draw(data):
        return data.draw(z_loss_logits(max_tokens=6, max_experts=MAX_EXPERTS, dtypes=dtypes), label="inputs")

    def values():
        def body(data):
            x, dtype, coeff = draw(data)
            ctx = _z_ctx(x, dtype, coeff)
            loss = _scalar(_call(fn, (as_jnp(x, dtype), coeff), ctx), np.float32, ctx)
            msg = _z_close(loss, oracle.z_loss(x, coeff), coeff)
            if msg:
                raise _Violation(f"{ctx}\n{msg}")
        return body

    def gradient():
        if not grads:
            raise _Skip("grads=False")

        def body(data):
            x, dtype, coeff = draw(data)
            g = data.draw(st.sampled_from([1.0, -0.5, 3.0]), label="cotangent")
            ctx = _z_ctx(x, dtype, coeff, f"  cotangent of the loss = {g}")
            try:
                out, pullback = jax.vjp(lambda a: fn(a, coeff), as_jnp(x, dtype))
                _scalar(out, np.float32, ctx)
                (dx,) = pullback(jnp.float32(g))
            except _Violation:
                raise
            except Exception as e:  # noqa: BLE001
                raise _Violation(f"{ctx}\njax.vjp of fn raised {type(e).__name__}: {e}") from None
            if np.dtype(dx.dtype) != np.dtype(np_dtype(dtype)):
                raise _Violation(f"{ctx}\ngrad_logits must have the dtype of logits ({dtype}); got {dx.dtype}")
            want = g * oracle.z_loss_grad(x, coeff)
            msg = _close(dx, want, "grads", dtype, E=x.shape[1], what="grad_logits")
            if msg:
                raise _Violation(f"{ctx}\n{msg}")
        return body

    def transforms():
        def body(data):
            x, dtype, coeff = draw(data)
            want = oracle.z_loss(x, coeff)
            ctx = _z_ctx(x, dtype, coeff, "  under jax.jit")
            out = _scalar(_call(jax.jit(lambda a: fn(a, coeff)), (as_jnp(x, dtype),), ctx), np.float32, ctx)
            msg = _z_close(out, want, coeff)
            if msg:
                raise _Violation(f"{ctx}\n{msg}")
            t = x.shape[0]
            if t % 2 == 0:
                shape = (2, t // 2, x.shape[1])
                ctx = _z_ctx(x, dtype, coeff, f"  with leading dims {shape}", shape=shape)
                out = _scalar(_call(jax.jit(lambda a: fn(a, coeff)), (as_jnp(x.reshape(shape), dtype),), ctx),
                              np.float32, ctx)
                msg = _z_close(out, want, coeff)
                if msg:
                    raise _Violation(f"{ctx}\n{msg}")
        return body

    props = [("value and dtype", values), ("gradient", gradient), ("jit, leading dims", transforms)]
    return _run("check_router_z_loss", props, properties, max_examples, seed)
