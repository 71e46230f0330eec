""":func:`check_topk`: a router top-k against docs/contract.md sections 2-3."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import oracle
from ..strategies import (
    DTYPES,
    SCORE_FUNCTIONS,
    RouterConfig,
    as_jnp,
    biases,
    group_tied_logits,
    large_logits,
    masked_logits,
    np_dtype,
    tied_logits,
)
from ._compare import (
    _arr,
    _call,
    _close,
    _map_diff,
    _pair,
)
from ._draws import assume_robust, draw_config, draw_cotangent, draw_tie_config, draw_tie_free
from ._report import CheckReport, _run, _Skip, _Violation

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


def check_topk(fn, *, max_examples: int = 100, dtypes: Sequence[str] = DTYPES,
               score_functions: Sequence[str] = SCORE_FUNCTIONS, grads: bool = True, seed=None,
               properties: Sequence[str] | str | None = None, groups: bool = True) -> CheckReport:
    """Checks a router top-k against docs/contract.md sections 2-3.

    ``fn(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
    score_function, expert_bias)`` (TE's positional order; ``score_function`` a
    str; grouping is on iff ``group_topk > 0``: off, the pair is ``(-1, -1)``,
    ``(0, 0)`` or ``(1, -1)``, as TE's callers pass it; ``expert_bias`` None or
    float32 ``[E]``) must return ``(probs, routing_map)``: probs of the dtype of
    ``logits``, a bool map, both of the shape of ``logits`` (any leading dims).
    ``groups=False``: a router without group-limited routing; no grouped config
    is drawn, and the two group properties are skipped.

    Properties (``max_examples`` each): values and maps on tie-free inputs;
    the same on logits in the thousands (softmax and sqrtsoftplus: no overflow);
    group-limited selection; the bias chooses but never weighs; the tie rule;
    ties of groups; ``-inf``/NaN masking; gradients against the oracle's
    backward with random cotangents, on tie-free and on ``-inf``/NaN-masked rows
    (``grads=True``: an expert off the map gets exactly 0, NaN logit or not, and a
    bias no gradient); ``jit``, ``vmap``, ``grad`` under ``jit``, leading dims and
    T = 0. Returns a :class:`CheckReport`; raises :class:`CheckFailure`.
    """
    dtypes, sfs = tuple(dtypes), tuple(score_functions)
    bad = [d for d in dtypes if d not in DTYPES] + [s for s in sfs if s not in SCORE_FUNCTIONS]
    if bad or not dtypes or not sfs:
        raise ValueError(f"check_topk: dtypes must be among {DTYPES} and score_functions among "
                         f"{SCORE_FUNCTIONS}; got {dtypes}, {sfs}")
    biased = tuple(s for s in sfs if s != "softmax")
    plain = {} if groups else {"grouped": False}  # the draws of every property but the group ones
    unsaturated = tuple(s for s in sfs if s != "sigmoid")

    def values():
        def body(data):
            _topk_forward_check(fn, *draw_tie_free(data, dtypes, sfs, **plain))
        return body

    def large():
        if not unsaturated:
            raise _Skip("no softmax/sqrtsoftplus in score_functions")

        def body(data):  # exp and softplus of logits in the thousands: no overflow to inf or NaN
            cfg = draw_config(data, dtypes, unsaturated, **plain)
            bias = data.draw(biases(cfg), label="expert_bias")
            _topk_forward_check(fn, cfg, data.draw(large_logits(cfg, bias), label="logits"), bias)
        return body

    def grouped():
        if not groups:
            raise _Skip("groups=False")

        def body(data):
            # some group is always excluded
            _topk_forward_check(fn, *draw_tie_free(data, dtypes, sfs, grouped=True, exclude_a_group=True))
        return body

    def bias_only_chooses():
        if not biased:
            raise _Skip("no sigmoid/sqrtsoftplus in score_functions")

        def body(data):
            _topk_forward_check(fn, *draw_tie_free(data, dtypes, biased, bias=True, **plain))
        return body

    def ties():
        def body(data):
            cfg, bias = draw_tie_config(data, dtypes, sfs, **plain)
            x = data.draw(tied_logits(cfg), label="logits")
            assume_robust(cfg, x, bias)
            _topk_forward_check(fn, cfg, x, bias)
        return body

    def group_ties():
        if not groups:
            raise _Skip("groups=False")

        def body(data):
            cfg, _ = draw_tie_config(data, dtypes, sfs, grouped=True, bias=False, exclude_a_group=True)
            x = data.draw(group_tied_logits(cfg), label="logits")
            assume_robust(cfg, x)
            _topk_forward_check(fn, cfg, x, None)
        return body

    def masking():
        def body(data):
            cfg, bias = draw_tie_config(data, dtypes, sfs, **plain)
            x = data.draw(masked_logits(cfg), label="logits")
            assume_robust(cfg, x, bias)
            _topk_forward_check(fn, cfg, x, bias)
        return body

    def _grad_check(data, cfg, x, bias):
        ctx0 = _case(cfg, x, bias)
        g = draw_cotangent(data, cfg.shape, cfg.dtype)
        args = _topk_args(cfg, x, bias)

        def f(a, b):  # b: the bias (None without one); its cotangent must be 0 (contract section 3)
            return _pair(fn(a, *args[1:7], b), cfg.shape, np_dtype(cfg.dtype), cfg.shape, ctx0)[0]

        ctx = _case(cfg, x, bias, f"  cotangent of probs = {_arr(g)}")
        try:
            dx, db = jax.jit(lambda a, b, c: jax.vjp(f, a, b)[1](c))(args[0], args[7], as_jnp(g, cfg.dtype))
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
        if db is not None and np.asarray(db, np.float32).any():
            raise _Violation(f"{ctx}\nexpert_bias got a gradient (contract section 3: gradients flow to the "
                             f"logits only; the bias only selects): {_arr(np.asarray(db, np.float32))}")

    def gradients():
        if not grads:
            raise _Skip("grads=False")

        def body(data):
            cfg, x, bias = draw_tie_free(data, dtypes, sfs, **plain)
            _grad_check(data, cfg, x, bias)
        return body

    def masked_gradients():
        if not grads:
            raise _Skip("grads=False")

        def body(data):
            cfg, bias = draw_tie_config(data, dtypes, sfs, **plain)
            # NaN too, except for softmax pre (one NaN makes the whole row NaN: contract section 2)
            x = data.draw(masked_logits(cfg, allow_nan=not cfg.use_pre_softmax,
                                        all_masked_rows=cfg.score_function != "softmax"), label="logits")
            if cfg.score_function == "softmax":  # an all -inf row is NaN for softmax (contract section 2)
                x[np.isinf(x).all(-1), 0] = 0.0
            assume_robust(cfg, x, bias)
            _grad_check(data, cfg, x, bias)
        return body

    def transforms():
        def body(data):
            cfg, x, bias = draw_tie_free(data, dtypes, sfs, **plain)
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
                g = draw_cotangent(data, cfg.shape, cfg.dtype)
                gj = as_jnp(g, cfg.dtype).astype(jnp.float32)

                def loss(a):
                    return jnp.sum(fn(a, *statics, bj)[0].astype(jnp.float32) * gj)

                dx = run("jax.jit(jax.grad)", jax.jit(jax.grad(loss)), args[0])
                e_dx = oracle.topk_bwd(e_map[0], e_saved[:T], g, **cfg.bwd_kwargs())
                msg = _close(dx, e_dx, "grads", cfg.dtype, E=E, what="grad_logits")
                if msg:
                    raise _Violation(f"{_case(cfg, x, bias, '  under jax.jit(jax.grad(sum(probs * g)))')}\n{msg}")
        return body

    props = [("values (tie-free)", values), ("large logits", large), ("group-limited selection", grouped),
             ("bias chooses, never weighs", bias_only_chooses), ("tie rule", ties),
             ("ties of groups", group_ties), ("-inf and NaN masking", masking),
             ("gradients", gradients), ("gradients with -inf", masked_gradients),
             ("jit, vmap, grad, leading dims, T=0", transforms)]
    return _run("check_topk", props, properties, max_examples, seed)
