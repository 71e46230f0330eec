"""Hypothesis strategies that draw only VALID router configurations and inputs.

The constraints live once, in :func:`gpurouter._checks.check_topk_args` and
:func:`gpurouter._checks.check_aux_loss_args`: the strategies construct a
config by design (E % G == 0, K % Kg == 0, Kg <= G, K/Kg <= E/G, bias only
with sigmoid/sqrtsoftplus) and then run the library's own check on it, so a
strategy that drifts from the library fails loudly instead of testing
nothing.

Logits:
- :func:`tie_free_logits` for tests that compare routing maps exactly: rows
  of distinct values on a grid exactly representable in float32, bfloat16 and
  float16, with the draw rejected (``assume``) unless the gap between the
  k-th and (k+1)-th candidate is clear of float32 rounding at both the group
  stage and the expert stage (gaps computed by the float64 oracle);
- :func:`arbitrary_logits` for properties that do not compare indices:
  ties, ``-inf``, NaN, ``+-0.0`` allowed;
- :func:`tied_logits`, :func:`group_tied_logits`, :func:`masked_logits` and
  :func:`forced_indices` for the tie rule, ``-inf``/NaN masks and routing replay.

The loss strategies (:class:`AuxLossConfig`, :func:`aux_loss_configs`,
:func:`aux_loss_inputs`, :func:`z_loss_logits`) live in
:mod:`gpurouter.testing.loss_strategies` and are importable from here too.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import assume
from hypothesis.extra import numpy as hnp

from gpurouter.config import RouterConfig

from . import oracle as oracles
from ._dtypes import DTYPES as DTYPES
from ._dtypes import SCORE_FUNCTIONS as SCORE_FUNCTIONS
from ._dtypes import as_jnp as as_jnp
from ._dtypes import np_dtype as np_dtype
from .loss_strategies import AuxLossConfig as AuxLossConfig
from .loss_strategies import aux_loss_configs as aux_loss_configs
from .loss_strategies import aux_loss_inputs as aux_loss_inputs
from .loss_strategies import z_loss_logits as z_loss_logits

SCALINGS = (1.0, 2.5, 0.5, 5.0)
GRID = 8  # tie-free logits are multiples of 1/GRID: exact in fp32, bf16 and fp16 for |x| < 16
MAX_GRID_EXPERTS = 160  # GRID-step values with |x| < 16 (exact in bf16: 8 significant bits)


# ----------------------------------------------------------------------------
# Router configs
# ----------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def router_configs(draw, *, max_tokens: int = 6, max_experts: int = 64,
                   dtypes=DTYPES, score_functions=SCORE_FUNCTIONS,
                   grouped: bool | None = None, bias: bool | None = None,
                   topk: int | None = None) -> RouterConfig:
    """Valid router configurations (T 1..max_tokens, E 1..max_experts)."""
    num_tokens = draw(st.integers(1, max_tokens))
    num_experts = draw(st.integers(1 if topk is None else topk, max_experts))
    sf = draw(st.sampled_from(score_functions))
    use_groups = draw(st.booleans()) if grouped is None else grouped
    if use_groups:
        num_groups = draw(st.sampled_from(_divisors(num_experts)))
        group_topk = draw(st.integers(1, num_groups))
        per_group = draw(st.integers(1, num_experts // num_groups))
        k = group_topk * per_group
    else:
        k = draw(st.integers(1, num_experts)) if topk is None else topk
        # grouping stays off whenever group_topk <= 0, whatever num_groups says
        num_groups, group_topk = draw(st.sampled_from([(-1, -1), (1, -1), (0, 0)]))
    has_bias = sf != "softmax" and (draw(st.booleans()) if bias is None else bias)
    cfg = RouterConfig(
        num_tokens=num_tokens, num_experts=num_experts, topk=k,
        use_pre_softmax=draw(st.booleans()) if sf == "softmax" else False,
        num_groups=num_groups, group_topk=group_topk,
        scaling_factor=draw(st.sampled_from(SCALINGS)), score_function=sf,
        expert_bias=has_bias, dtype=draw(st.sampled_from(dtypes)))
    cfg.check()  # the single source of the constraints: must pass by construction
    return cfg


# ----------------------------------------------------------------------------
# Logits and biases
# ----------------------------------------------------------------------------


def selection_scores(logits: np.ndarray, cfg: RouterConfig, bias=None) -> np.ndarray:
    """The selection scores ``r`` [T, E] (float64), by the oracle."""
    x = np.asarray(logits, np.float64)
    if cfg.score_function == "softmax":
        return np.stack([oracles.softmax(row) for row in x]) if cfg.use_pre_softmax else x
    s = np.vectorize(lambda v: oracles.activation(v, cfg.score_function))(x)
    return s if bias is None else s + np.asarray(bias, np.float64)[None, :]


def _boundary_gap(values, k: int, eligible=None) -> float:
    """Relative gap between the k-th and (k+1)-th largest eligible value (inf if none)."""
    v = sorted((float(x) for i, x in enumerate(values) if eligible is None or eligible[i]),
               reverse=True)
    if len(v) <= k:
        return np.inf
    a, b = v[k - 1], v[k]
    return (a - b) - (1e-5 * max(abs(a), abs(b)) + 1e-7)


def min_selection_gap(r: np.ndarray, cfg: RouterConfig) -> float:
    """The smallest margin (over rows, group and expert stage) above the tie threshold.

    Positive means every row is tie-free: the k-th/(k+1)-th gap exceeds
    ``1e-5 * |value| + 1e-7`` (100x float32 rounding of the scores).
    """
    gaps = [np.inf]
    for row in np.asarray(r, np.float64):
        eligible = None
        if cfg.grouped:
            per = cfg.topk // cfg.group_topk
            gs = oracles.group_scores(row, cfg.num_groups, per)
            gaps.append(_boundary_gap(gs, cfg.group_topk))
            kept = set(oracles.select_topk(gs, cfg.group_topk))
            size = cfg.num_experts // cfg.num_groups
            eligible = [(i // size) in kept for i in range(len(row))]
        gaps.append(_boundary_gap(row, cfg.topk, eligible))
    return min(gaps)


def grid_row(perm, offset: int) -> np.ndarray:
    """Distinct multiples of 1/GRID, centred, from a permutation of range(E)."""
    perm = np.asarray(perm)
    return ((perm - len(perm) // 2 + offset) / GRID).astype(np.float32)


@st.composite
def biases(draw, cfg: RouterConfig):
    """``expert_bias`` [E] float32 (multiples of 1/64 in [-0.5, 0.5]) or None."""
    if not cfg.has_bias:
        return None
    ints = draw(hnp.arrays(np.int32, (cfg.num_experts,), elements=st.integers(-32, 32)))
    return (ints / 64).astype(np.float32)


@st.composite
def tie_free_logits(draw, cfg: RouterConfig, bias=None) -> np.ndarray:
    """``[T, E]`` float32 logits, exactly representable in ``cfg.dtype``, tie-free.

    Rows are permuted grids (step 1/GRID, so distinct at bf16/fp16 spacing);
    the draw is rejected unless the selection (with ``bias``) is tie-free at
    both stages by a margin well above float32 rounding.
    """
    assert cfg.num_experts <= MAX_GRID_EXPERTS
    rows = []
    for _ in range(cfg.num_tokens):
        perm = draw(st.permutations(range(cfg.num_experts)))
        rows.append(grid_row(perm, draw(st.integers(-8, 8))))
    x = np.stack(rows)
    assert np.array_equal(x.astype(np_dtype(cfg.dtype)).astype(np.float32), x)
    assume(min_selection_gap(selection_scores(x, cfg, bias), cfg) > 0)
    return x


_SPECIALS = (0.0, -0.0, 1.0, -1.0, 2.5, -np.inf, np.nan)


def arbitrary_logits(cfg: RouterConfig, *, allow_nan: bool = True, allow_neg_inf: bool = True):
    """``[T, E]`` float32 logits with ties, ``-inf``, NaN and ``+-0.0`` (rounded to cfg.dtype)."""
    specials = [v for v in _SPECIALS
                if (allow_nan or not np.isnan(v)) and (allow_neg_inf or v != -np.inf)]
    elements = st.one_of(
        st.floats(-20, 20, width=32, allow_nan=False, allow_subnormal=False),
        st.sampled_from(specials))
    dt = np_dtype(cfg.dtype)
    return hnp.arrays(np.float32, cfg.shape, elements=elements).map(
        lambda x: x.astype(dt).astype(np.float32))


def random_cotangent(seed: int, shape, dtype: str = "float32") -> np.ndarray:
    """A standard-normal cotangent, exactly representable in ``dtype``."""
    g = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return g.astype(np_dtype(dtype)).astype(np.float32)


def _distinct_values(dtype: str) -> np.ndarray:
    """Candidate logits for :func:`tie_free_rows_np`: distinct values of ``dtype`` in [-8, 8]."""
    if dtype == "float32":
        return (np.arange(-2048, 2049) / 256).astype(np.float32)
    dt = np_dtype(dtype)
    grid = np.linspace(-8, 8, 1 << 16, dtype=np.float32).astype(dt).astype(np.float32)
    grid = np.unique(grid)
    return grid[(np.abs(grid) >= 1 / 16) | (grid == 0)]


def tie_free_rows_np(seed: int, cfg: RouterConfig, bias=None, *, tries: int = 200) -> np.ndarray:
    """NumPy version of :func:`tie_free_logits` for fixed, larger shapes (E up to ~1000).

    Each row draws ``E`` distinct values of ``cfg.dtype`` in [-8, 8]; rows are
    redrawn (same seed stream) until the selection is tie-free at both stages.
    """
    cand = _distinct_values(cfg.dtype)
    assert len(cand) >= cfg.num_experts
    rng = np.random.default_rng(seed)
    for _ in range(tries):
        x = np.stack([rng.choice(cand, cfg.num_experts, replace=False)
                      for _ in range(cfg.num_tokens)]).astype(np.float32)
        if min_selection_gap(selection_scores(x, cfg, bias), cfg) > 0:
            return x
    raise AssertionError(f"no tie-free logits for {cfg} in {tries} tries")



# ----------------------------------------------------------------------------
# Ties, masks and replay (the conformance checks, gpurouter.testing.checks)
# ----------------------------------------------------------------------------

#: Values of :func:`tied_logits` and :func:`masked_logits`: multiples of 1/2 in [-2, 2],
#: exact in float32, bfloat16 and float16, and far apart after any score function.
TIE_VALUES = (-2.0, -1.5, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 1.5, 2.0)  # -0.0 ties +0.0 (contract section 2)


def tie_configs(**kwargs):
    """:func:`router_configs` whose group scores cannot be near-ties that are not ties.

    Invariants: those of :func:`router_configs`, and, when grouped and the
    selection scores are not the raw logits (sigmoid, sqrtsoftplus, softmax pre),
    ``topk // group_topk <= 2``: a group score is then a sum of at most two
    values, the same in any summation order, so groups holding the same values
    tie exactly in float32 as in float64.
    """
    def ok(cfg: RouterConfig) -> bool:
        raw = cfg.score_function == "softmax" and not cfg.use_pre_softmax
        return not cfg.grouped or raw or cfg.topk // cfg.group_topk <= 2

    return router_configs(**kwargs).filter(ok)


@st.composite
def tie_biases(draw, cfg: RouterConfig):
    """``expert_bias`` for tied rows: float32 ``[E]`` with values in {-0.25, 0, 0.25}, or None.

    Invariants: None unless ``cfg.has_bias``; few distinct values, so experts
    with equal logits often keep equal selection scores (ties survive the bias).
    """
    if not cfg.has_bias:
        return None
    vals = draw(hnp.arrays(np.int8, (cfg.num_experts,), elements=st.integers(-1, 1)))
    return (vals.astype(np.float32) / 4).astype(np.float32)


@st.composite
def tied_logits(draw, cfg: RouterConfig) -> np.ndarray:
    """``[T, E]`` float32 logits with many exact ties.

    Invariants: every value is in :data:`TIE_VALUES` (exact in every dtype of
    :data:`DTYPES`); each row draws from at most 3 of them, so most rows tie
    at the top-K boundary; about a row in four is ``+0.0`` and ``-0.0`` only
    (equal: a row of ties that a sort on the raw bits would order); all finite.
    """
    rows = []
    for _ in range(cfg.num_tokens):
        if draw(st.integers(0, 3), label="signed zeros") == 0:
            levels = [0.0, -0.0]
        else:  # unique by repr: -0.0 and 0.0 are two levels (equal as numbers: a tie)
            levels = draw(st.lists(st.sampled_from(TIE_VALUES), min_size=1, max_size=3, unique_by=repr))
        idx = draw(hnp.arrays(np.int8, (cfg.num_experts,), elements=st.integers(0, len(levels) - 1)))
        rows.append(np.asarray(levels, np.float32)[idx])
    return np.stack(rows).astype(np.float32)


@st.composite
def group_tied_logits(draw, cfg: RouterConfig) -> np.ndarray:
    """``[T, E]`` float32 logits whose groups tie: every group is a permutation of one block.

    Invariants: ``cfg`` is grouped; each row draws one block of ``E / G``
    distinct values of :data:`TIE_VALUES` (or fewer values, repeated, when
    ``E / G > 9``), and each group of that row is a permutation of it. Every
    group score is then equal (same values, at most two summed or raw values:
    use with :func:`tie_configs`), so which groups stay eligible is decided by
    the tie rule alone (the lower group index wins).
    """
    assert cfg.grouped
    size = cfg.num_experts // cfg.num_groups
    rows = []
    for _ in range(cfg.num_tokens):
        block = np.asarray(draw(st.lists(st.sampled_from(TIE_VALUES), min_size=size, max_size=size,
                                         unique=size <= len(TIE_VALUES))), np.float32)
        groups = [block[np.asarray(draw(st.permutations(range(size))))] for _ in range(cfg.num_groups)]
        rows.append(np.concatenate(groups))
    return np.stack(rows).astype(np.float32)


@st.composite
def masked_logits(draw, cfg: RouterConfig, *, allow_nan: bool = True, all_masked_rows: bool = True) -> np.ndarray:
    """``[T, E]`` float32 logits of :data:`TIE_VALUES`, ``-inf`` and NaN: masked experts.

    Invariants: every finite value is in :data:`TIE_VALUES`; each row masks
    (``-inf``, or NaN with ``allow_nan``) a drawn number of experts from 0 to E,
    so rows with fewer than K finite experts are common; with
    ``all_masked_rows`` the first row is entirely ``-inf`` whenever T > 1.
    """
    specials = [-np.inf, np.nan] if allow_nan else [-np.inf]
    rows = []
    for t in range(cfg.num_tokens):
        row = np.asarray(draw(st.lists(st.sampled_from(TIE_VALUES), min_size=cfg.num_experts,
                                       max_size=cfg.num_experts)), np.float32)
        if all_masked_rows and t == 0 and cfg.num_tokens > 1:
            row[:] = -np.inf  # all -inf (no NaN: a row with a NaN only promises its selection)
            rows.append(row)
            continue
        where = draw(st.permutations(range(cfg.num_experts)))[:draw(st.integers(0, cfg.num_experts))]
        for i in where:
            row[i] = draw(st.sampled_from(specials))
        rows.append(row)
    return np.stack(rows).astype(np.float32)


@st.composite
def forced_indices(draw, cfg: RouterConfig) -> np.ndarray:
    """``[T, K]`` int32 expert indices for routing replay (``forced_indices=``).

    Invariants: each row holds ``cfg.topk`` distinct indices in ``[0, E)``, in
    drawn order (not sorted).
    """
    rows = [draw(st.permutations(range(cfg.num_experts)))[: cfg.topk] for _ in range(cfg.num_tokens)]
    return np.asarray(rows, np.int32).reshape(cfg.num_tokens, cfg.topk)


#: Scales of :func:`large_logits`: powers of two, so a scaled grid stays exact in every dtype.
LARGE_SCALES = (64.0, 256.0, 1024.0)


@st.composite
def large_logits(draw, cfg: RouterConfig, bias=None) -> np.ndarray:
    """``[T, E]`` float32 tie-free logits of large magnitude (from -64 up to about 6000).

    Invariants: each :func:`tie_free_logits` row, less its minimum, times a
    scale of :data:`LARGE_SCALES`, minus 64: the smallest logit of a row is
    -64 (its score stays a normal float32: ``exp(-64)`` and ``exp(-32)``), the
    largest is often far above 88.7, where ``exp`` overflows float32; exactly
    representable in float32, bfloat16 and float16; the draw is rejected
    unless the selection (with ``bias``) is tie-free at both stages. Meant for
    softmax and sqrtsoftplus: sigmoid saturates to 1 in float64 at these
    sizes, so its selections are ties.
    """
    scale = np.float32(draw(st.sampled_from(LARGE_SCALES), label="scale"))
    x = draw(tie_free_logits(cfg), label="grid")
    x = ((x - x.min(-1, keepdims=True)) * scale - np.float32(64)).astype(np.float32)
    assert np.array_equal(x.astype(np_dtype(cfg.dtype)).astype(np.float32), x)
    assume(min_selection_gap(selection_scores(x, cfg, bias), cfg) > 0)
    return x
