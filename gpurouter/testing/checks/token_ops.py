""":func:`check_token_dispatch` and :func:`check_token_combine`: the MoE token
permutation of TE's ``transformer_engine.jax.permutation`` (docs/ops/moe_ops.md).

What is checked is what the contract promises of any implementation; the
``row_id_map`` layout is the implementation's own and is never read, only
handed back to its combine:

- dispatch: ``output`` holds token ``t``'s row at row ``r(t, e)`` for each
  routed pair, expert-major with ascending tokens inside an expert (a copy:
  bit for bit); ``permuted_probs[r(t, e)] = probs[t, e]``; ``tokens_per_expert``
  counts the routed tokens (with ``align_size``: rounded up to its multiple,
  each expert's block padded with zero rows); gradients flow to ``inp`` (the
  sum of a token's copies) and ``probs``;
- combine: ``out[t] = sum_e w[t, e] * inp[r(t, e)]`` (``w = 1`` without merging
  probs), with its gradients to ``inp`` and ``merging_probs``.

Inputs are drawn so that no implementation detail decides a value: every
``num_out_tokens`` is the routed pair count (nothing dropped), and the probs
are in ``(0, 1]`` (TE writes the row of a zero prob as zeros). They are small
by construction (T <= 6, E <= 8, H <= 8) and a failing example is reported as
drawn: hypothesis does not shrink it (every shrink step would trace and
compile ``fn`` for new shapes; minutes for one failure).
"""

from __future__ import annotations

from collections.abc import Sequence

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from .. import moe_oracle
from .._dtypes import DTYPES, as_jnp, np_dtype
from ._compare import _arr, _call, _close, _describe
from ._draws import draw_cotangent
from ._report import CheckReport, _run, _Skip, _Violation

MAX_TOKENS, MAX_EXPERTS, MAX_HIDDEN = 6, 8, 8


def _draw_case(data, dtypes, *, align: bool = False):
    """``(inp [T, H], routing_map bool [T, E], probs float32 [T, E], dtype, align_size)``."""
    t = data.draw(st.integers(1, MAX_TOKENS), label="T")
    e = data.draw(st.integers(1, MAX_EXPERTS), label="E")
    h = data.draw(st.integers(1, MAX_HIDDEN), label="H")
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    rng = np.random.default_rng(seed)
    m = rng.random((t, e)) < data.draw(st.sampled_from([0.2, 0.5, 0.9]), label="density")
    if not m.any():  # TE needs num_out_tokens > 0
        m[rng.integers(t), rng.integers(e)] = True
    inp = rng.integers(-32, 33, (t, h)) / 8.0  # exact in fp32, bf16 and fp16
    probs = rng.integers(1, 65, (t, e)) / 64.0  # in (0, 1], exact in bf16
    align_size = data.draw(st.integers(2, 4), label="align_size") if align else None
    return inp, m, probs.astype(np.float32), dtype, align_size


def _ctx(op: str, inp, m, dtype, extra: str = "", **kw) -> str:
    args = ", ".join(f"{k}={v}" for k, v in kw.items())
    lines = [f"config: {op}(inp={dtype}{list(inp.shape)}, routing_map=bool{list(m.shape)}"
             + (f", {args}" if args else "") + ")",
             "counterexample (hypothesis, not shrunk):", f"  inp = {_arr(inp)}",
             f"  routing_map = {np.asarray(m, int).tolist()}"] + ([extra] if extra else [])
    return "\n".join(lines)


def _exact(got, want, what: str) -> str | None:
    got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if got32.shape != want32.shape:
        return f"{what}: shape {list(got32.shape)}, expected {list(want32.shape)}"
    if not np.array_equal(got32, want32):
        r = int(np.flatnonzero((got32 != want32).reshape(got32.shape[0], -1).any(-1))[0])
        return f"{what} differs at row {r}: expected {_arr(want32[r])}, got {_arr(got32[r])}"
    return None


def _dispatched(res, ctx: str, probs_given: bool, rows: int, h: int, e: int, dtype: str):
    """The five results of a dispatch, with their shapes and dtypes checked."""
    if not (isinstance(res, (tuple, list)) and len(res) == 5):
        raise _Violation(f"{ctx}\nfn must return (output, permuted_probs, row_id_map, pad_offsets, "
                         f"tokens_per_expert); it returned {_describe(res)}")
    out, pp, rid, pad, tpe = res
    if not hasattr(out, "shape") or tuple(out.shape) != (rows, h) or np.dtype(out.dtype) != np.dtype(np_dtype(dtype)):
        raise _Violation(f"{ctx}\noutput must be {dtype}[{rows}, {h}]; got {_describe(out)}")
    if probs_given and (not hasattr(pp, "shape") or tuple(pp.shape) != (rows,)):
        raise _Violation(f"{ctx}\npermuted_probs must have shape [{rows}]; got {_describe(pp)}")
    if not probs_given and pp is not None:
        raise _Violation(f"{ctx}\npermuted_probs must be None without probs; got {_describe(pp)}")
    if not hasattr(tpe, "shape") or tuple(tpe.shape) != (e,):
        raise _Violation(f"{ctx}\ntokens_per_expert must have shape [{e}]; got {_describe(tpe)}")
    return out, pp, rid, pad, tpe


def _rows(m, align_size) -> int:
    n = int(np.asarray(m).sum())
    if align_size is None:
        return n
    return ((n + m.shape[1] * (align_size - 1)) // align_size) * align_size


def check_token_dispatch(fn, *, max_examples: int = 100, dtypes: Sequence[str] = DTYPES, grads: bool = True,
                         seed=None, properties: Sequence[str] | None = None) -> CheckReport:
    """Checks a token dispatch (TE's ``permutation.token_dispatch``).

    ``fn(inp, routing_map, num_out_tokens, probs, align_size)`` is called
    positionally: ``inp [T, H]`` in ``dtype``, ``routing_map`` bool ``[T, E]``,
    ``num_out_tokens`` the routed pair count (a Python int), ``probs`` float32
    ``[T, E]`` or None, ``align_size`` None or an int. It returns ``(output,
    permuted_probs, row_id_map, pad_offsets, tokens_per_expert)``.

    Properties (``max_examples`` each): values (with and without probs);
    ``align_size`` (padded blocks of zero rows, padded counts); gradient
    (``grads``: ``d_inp`` sums a token's copies, ``d_probs`` the rows' cotangents);
    ``jit``.
    """
    dtypes = _dtypes_of("check_token_dispatch", dtypes)

    def compare(data, align: bool, jit: bool = False):
        inp, m, probs, dtype, align_size = _draw_case(data, dtypes, align=align)
        with_probs = align or data.draw(st.booleans(), label="with probs")
        p = probs if with_probs else None
        n, rows = int(m.sum()), _rows(m, align_size)
        ctx = _ctx("fn", inp, m, dtype, "  under jax.jit" if jit else "", num_out_tokens=n,
                   probs="float32" if with_probs else None, align_size=align_size)
        def call(a, b, c):  # num_out_tokens and align_size stay Python ints under jit
            return fn(a, b, n, c, align_size)

        args = (as_jnp(inp, dtype), jnp.asarray(m), None if p is None else jnp.asarray(p))
        res = _call(jax.jit(call) if jit else call, args, ctx)
        out, pp, _, _, tpe = _dispatched(res, ctx, with_probs, rows, inp.shape[1], m.shape[1], dtype)
        w_out, w_pp, _, _, w_tpe = moe_oracle.dispatch(inp, m, n, p, align_size)
        for msg in (_exact(out, np.asarray(w_out).astype(np_dtype(dtype)), "output"),
                    _exact(np.asarray(tpe).astype(np.int64), np.asarray(w_tpe), "tokens_per_expert"),
                    None if p is None else _exact(pp, w_pp.astype(np.float32), "permuted_probs")):
            if msg:
                raise _Violation(f"{ctx}\n{msg}")

    def values():
        return lambda data: compare(data, align=False)

    def aligned():
        return lambda data: compare(data, align=True)

    def gradient():
        if not grads:
            raise _Skip("grads=False")

        def body(data):
            inp, m, probs, dtype, _ = _draw_case(data, dtypes)
            n = int(m.sum())
            g_out = draw_cotangent(data, (n, inp.shape[1]), dtype)
            g_pp = draw_cotangent(data, (n,))
            ctx = _ctx("fn", inp, m, dtype, f"  cotangents: output {_arr(g_out)}, permuted_probs {_arr(g_pp)}",
                       num_out_tokens=n, probs="float32", align_size=None)

            def f(a, b):
                res = fn(a, jnp.asarray(m), n, b, None)
                return res[0], res[1]

            try:
                (out, pp), pullback = jax.vjp(f, as_jnp(inp, dtype), jnp.asarray(probs))
                d_inp, d_probs = pullback((as_jnp(g_out, dtype), jnp.asarray(g_pp, pp.dtype)))
            except Exception as e:  # noqa: BLE001 - any exception of fn is reported as a violation
                raise _Violation(f"{ctx}\njax.vjp of fn raised {type(e).__name__}: {e}") from None
            _, _, rid, _, _ = moe_oracle.dispatch(inp, m, n, probs)
            w_inp, w_probs = moe_oracle.dispatch_bwd(g_out, g_pp, rid)
            for msg in (_close(d_inp, w_inp, "grads", dtype, E=m.shape[1], what="grad_inp"),
                        _close(np.where(m, np.asarray(d_probs, np.float32), 0.0), w_probs, "grads", "float32",
                               E=1, what="grad_probs")):
                if msg:
                    raise _Violation(f"{ctx}\n{msg}")
        return body

    def transforms():
        return lambda data: compare(data, align=False, jit=True)

    props = [("values", values), ("align_size", aligned), ("gradient", gradient), ("jit", transforms)]
    return _run("check_token_dispatch", props, properties, max_examples, seed, shrink=False)


def check_token_combine(fn, dispatch, *, max_examples: int = 100, dtypes: Sequence[str] = DTYPES,
                        grads: bool = True, seed=None, properties: Sequence[str] | None = None) -> CheckReport:
    """Checks a token combine (TE's ``permutation.token_combine``) with the
    ``row_id_map`` and ``pad_offsets`` of the same implementation's ``dispatch``
    (called as :func:`check_token_dispatch` calls it; check it there too).

    ``fn(inp, row_id_map, merging_probs, pad_offsets)`` is called positionally:
    ``inp [R, H]`` in ``dtype`` (any rows: not only the dispatched ones),
    ``merging_probs`` float32 ``[T, E]`` or None. It returns ``[T, H]`` in
    ``inp``'s dtype: ``out[t] = sum_e w[t, e] * inp[r(t, e)]``.

    Properties (``max_examples`` each): values (weighted and not, with and
    without ``align_size``); gradient (``grads``) to ``inp`` and ``merging_probs``;
    ``jit``.
    """
    dtypes = _dtypes_of("check_token_combine", dtypes)

    def case(data):
        inp, m, probs, dtype, _ = _draw_case(data, dtypes)
        align_size = data.draw(st.sampled_from([None, 2, 4]), label="align_size")
        weighted = data.draw(st.booleans(), label="weighted")
        n, rows = int(m.sum()), _rows(m, align_size)
        ctx = _ctx("dispatch", inp, m, dtype, num_out_tokens=n, probs="float32", align_size=align_size)
        res = _call(dispatch, (as_jnp(inp, dtype), jnp.asarray(m), n, jnp.asarray(probs), align_size), ctx)
        _, _, rid, pad, _ = _dispatched(res, ctx, True, rows, inp.shape[1], m.shape[1], dtype)
        y = np.random.default_rng(data.draw(st.integers(0, 2**16), label="rows seed")).integers(
            -32, 33, (rows, inp.shape[1])) / 8.0
        w = probs if weighted else None
        ctx = _ctx("fn", inp, m, dtype, f"  inp of the combine = {_arr(y)}", merging_probs=w is not None,
                   align_size=align_size)
        _, _, w_rid, _, _ = moe_oracle.dispatch(inp, m, n, probs, align_size)
        return y, w, dtype, rid, pad, w_rid, m, ctx

    def combined(res, t, h, dtype, ctx):
        if not hasattr(res, "shape") or tuple(res.shape) != (t, h) or np.dtype(res.dtype) != np.dtype(np_dtype(dtype)):
            raise _Violation(f"{ctx}\nfn must return {dtype}[{t}, {h}]; got {_describe(res)}")
        return res

    def compare(data, jit: bool):
        y, w, dtype, rid, pad, w_rid, m, ctx = case(data)
        args = (as_jnp(y, dtype), rid, None if w is None else jnp.asarray(w), pad)
        f = jax.jit(fn) if jit else fn
        out = combined(_call(f, args, ctx + ("\n  under jax.jit" if jit else "")), m.shape[0], y.shape[1], dtype, ctx)
        msg = _close(out, moe_oracle.combine(y, w_rid, w), "grads", dtype, E=m.shape[1], what="output")
        if msg:
            raise _Violation(f"{ctx}\n{msg}")

    def values():
        return lambda data: compare(data, jit=False)

    def gradient():
        if not grads:
            raise _Skip("grads=False")

        def body(data):
            y, w, dtype, rid, pad, w_rid, m, ctx = case(data)
            g = draw_cotangent(data, (m.shape[0], y.shape[1]), dtype)
            ctx += f"\n  cotangent of the output = {_arr(g)}"
            try:
                if w is None:
                    out, pullback = jax.vjp(lambda a: fn(a, rid, None, pad), as_jnp(y, dtype))
                    (d_inp,), d_w = pullback(as_jnp(g, dtype)), None
                else:
                    out, pullback = jax.vjp(lambda a, b: fn(a, rid, b, pad), as_jnp(y, dtype), jnp.asarray(w))
                    d_inp, d_w = pullback(as_jnp(g, dtype))
            except Exception as e:  # noqa: BLE001 - any exception of fn is reported as a violation
                raise _Violation(f"{ctx}\njax.vjp of fn raised {type(e).__name__}: {e}") from None
            w_inp, w_w = moe_oracle.combine_bwd(g, y, w_rid, w)
            msgs = [_close(d_inp, w_inp, "grads", dtype, E=m.shape[1], what="grad_inp")]
            if w is not None:
                msgs.append(_close(np.where(m, np.asarray(d_w, np.float32), 0.0), np.where(m, w_w, 0.0), "grads",
                                   dtype, E=y.shape[1], what="grad_merging_probs"))
            for msg in msgs:
                if msg:
                    raise _Violation(f"{ctx}\n{msg}")
        return body

    def transforms():
        return lambda data: compare(data, jit=True)

    props = [("values", values), ("gradient", gradient), ("jit", transforms)]
    return _run("check_token_combine", props, properties, max_examples, seed, shrink=False)


def _dtypes_of(op: str, dtypes) -> tuple[str, ...]:
    dtypes = tuple(dtypes)
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"{op}: dtypes must be among {DTYPES}; got {dtypes}")
    return dtypes
