""":func:`check_aux_scores`: the aux-loss scores (TE's ``compute_aux_scores=True``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume

from .. import oracle
from ..strategies import (
    DTYPES,
    SCORE_FUNCTIONS,
    as_jnp,
    masked_logits,
    min_selection_gap,
    np_dtype,
    tie_free_logits,
    tied_logits,
)
from ._compare import (
    _arr,
    _call,
    _close,
    _map_diff,
    _pair,
)
from ._draws import MAX_EXPERTS, MAX_TIE_EXPERTS, assume_robust, draw_config, draw_cotangent
from ._report import CheckReport, _run, _Skip, _Violation

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


def _as_aux_scores(fn):
    """``fn`` as ``fn(logits, topk, score_function)``: TE's router op (a
    function with a ``compute_aux_scores`` keyword, such as
    ``transformer_engine.jax.router.fused_topk_with_score_function`` or
    gpurouter's) called with ``score_function=`` and ``compute_aux_scores=True``;
    any other function as it is."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): as it is
        return fn
    if "compute_aux_scores" not in params:
        return fn

    @functools.wraps(fn)
    def aux_scores(logits, topk, score_function):
        return fn(logits, topk, score_function=score_function, compute_aux_scores=True)
    return aux_scores


def check_aux_scores(fn, *, max_examples: int = 100, dtypes: Sequence[str] = DTYPES,
                     score_functions: Sequence[str] = SCORE_FUNCTIONS, grads: bool = True, seed=None,
                     properties: Sequence[str] | None = None) -> CheckReport:
    """Checks the aux-loss scores (TE's ``compute_aux_scores=True``) against the contract.

    ``fn(logits, topk, score_function)`` must return ``(scores, routing_map)``:
    float32 scores over all E (softmax, or sigmoid/sqrtsoftplus normalised over
    all E with ``+1e-20``; no bias, groups or scaling) and the bool top-K map of
    the scores, both of the shape of ``logits``. TE's router op itself (a
    function with a ``compute_aux_scores`` keyword) is called as
    ``fn(logits, topk, score_function=..., compute_aux_scores=True)``.

    Properties (``max_examples`` each): values and maps on tie-free inputs; the
    tie rule; ``-inf``/NaN masking; gradients against the oracle (``grads``);
    ``jit``, ``vmap``, ``grad`` under ``jit``, leading dims and T = 0.
    """
    fn = _as_aux_scores(fn)
    dtypes, sfs = tuple(dtypes), tuple(score_functions)
    if any(d not in DTYPES for d in dtypes) or any(s not in SCORE_FUNCTIONS for s in sfs) or not dtypes or not sfs:
        raise ValueError(f"check_aux_scores: dtypes must be among {DTYPES} and score_functions among "
                         f"{SCORE_FUNCTIONS}; got {dtypes}, {sfs}")

    def cfgs(data, max_experts=MAX_EXPERTS):  # TE's aux scores: no groups, no bias
        return draw_config(data, dtypes, sfs, max_experts=max_experts, grouped=False, bias=False)

    def scores_of(x, cfg):
        return oracle.aux_scores_fwd(x, cfg.topk, cfg.score_function)[0]

    def tie_free(data):
        cfg = cfgs(data)
        x = data.draw(tie_free_logits(cfg), label="logits")
        assume(min_selection_gap(scores_of(x, cfg), cfg) > 0)  # tie-free in the scores over all E
        return cfg, x

    def tied(data, logits):
        cfg = cfgs(data, MAX_TIE_EXPERTS)
        x = data.draw(logits(cfg), label="logits")
        assume_robust(cfg, x, r=scores_of(x, cfg))
        return cfg, x

    def values():
        def body(data):
            cfg, x = tie_free(data)
            _aux_forward_check(fn, cfg, x)
        return body

    def ties():
        def body(data):
            _aux_forward_check(fn, *tied(data, tied_logits))
        return body

    def masking():
        def body(data):
            _aux_forward_check(fn, *tied(data, masked_logits))
        return body

    def _grad(data, cfg, x, under_jit=False):
        g = draw_cotangent(data, cfg.shape)
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
