"""The QB kernels (gpurouter/kernels/topk/qb.py): this call's counts bit for bit
``reference._route.qb_call_counts`` (docs/contract.md section 12), on the CUDA
simulator with tiny shapes (the slab partials and their reduce, the no-shared
fallback, the cutoff's quad loads); the public op's numba histogram equal to
jax's; ``gpu`` tests at the Kimi-K2-like shape (T = 65536, E = 384, K = 8,
B = 1000) and at T = 3001 (each launch path over garbage outputs)."""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import gpurouter  # noqa: E402
from gpurouter._checks import ScoreFunction, TopkConfig  # noqa: E402
from gpurouter._ops import qb as op_qb  # noqa: E402
from gpurouter.kernels._base.plan import spec_for  # noqa: E402
from gpurouter.kernels.topk import qb as kqb  # noqa: E402
from gpurouter.kernels.topk import qb_math, qb_tiling  # noqa: E402
from gpurouter.reference._route import qb_call_counts  # noqa: E402

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _ref(x, bias, bounds, num_bins, topk, mask=None, num_groups=-1, group_topk=-1, rule="sum_topk"):
    cfg = TopkConfig(topk, False, num_groups, group_topk, 1.0, ScoreFunction.SIGMOID, False)
    valid = None if mask is None else jnp.asarray(mask)
    return np.asarray(qb_call_counts(jnp.asarray(x), jnp.asarray(bias), cfg, rule, num_bins,
                                     jnp.asarray(bounds, jnp.float32), valid))


def _check(x, bias, bounds, num_bins, topk, mask=None, num_groups=-1, group_topk=-1, rule="sum_topk",
           tiling=None):
    got = kqb.qb_counts(x, np.asarray(bias, np.float32), np.asarray(bounds, np.float32), num_bins, topk,
                        token_mask=mask, num_groups=num_groups, group_topk=group_topk, group_score=rule,
                        tiling=tiling)
    want = _ref(x, bias, bounds, num_bins, topk, mask, num_groups, group_topk, rule)
    assert got.dtype == np.int32 and got.shape == (x.shape[1], num_bins)
    np.testing.assert_array_equal(got, want)
    valid = x.shape[0] if mask is None else int(np.sum(mask))
    assert (got.sum(axis=1) == valid).all(), "one count per valid token in every expert row"
    return got


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_counts_match_reference(dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((12, 16)) * 2).astype(DTYPES[dtype])
    bias = rng.standard_normal(16) * 0.1
    _check(x, bias, [-1.0, 1.0], 8, 3)
    mask = rng.random(12) > 0.3
    _check(x, bias, [-0.5, 0.75], 5, 2, mask=mask)


def test_tie_at_cutoff():
    """Equal biased scores at the cutoff: the cutoff is their value whichever drops
    (TE's three equal logits with k = 2), so their own rb is 0."""
    x = np.full((2, 6), -3.0, np.float32)
    x[:, :3] = 1.0  # three tied experts, k = 2: the third of them is the cutoff
    got = _check(x, np.zeros(6), [-1.0, 1.0], 4, 2)
    # rb = 0 for the tied ones: bin floor((0 + 1) * 4 / 2) = 2
    assert (got[:3, 2] == 2).all()


def test_bin_edges_exact():
    """rb exactly on bin edges (s in {0, 0.5, 1} from logits -100, 0, 100; biases on a
    1/8 grid): floor puts an edge in the bin above it; every edge checked by hand."""
    num_bins, lower, upper = 16, -1.0, 1.0
    bias = np.arange(8, dtype=np.float32) / 8 - 0.5  # -0.5 .. 0.375, exact
    rows = []
    for pattern in ([0.0] * 8, [100.0] * 4 + [0.0] * 4, [-100.0, 0.0, 100.0, 0.0, -100.0, 100.0, 0.0, 0.0]):
        rows.append(pattern)
    x = np.asarray(rows, np.float32)
    got = _check(x, bias, [lower, upper], num_bins, 3)
    s = np.where(x > 50, 1.0, np.where(x < -50, 0.0, 0.5))
    r = s + bias
    alpha = -np.sort(-r, axis=1)[:, 3]
    rb = alpha[:, None] - s
    want_bins = np.clip(np.floor((rb - lower) * (num_bins / (upper - lower))), 0, num_bins - 1).astype(int)
    want = np.zeros((8, num_bins), np.int32)
    for t in range(x.shape[0]):
        for e in range(8):
            want[e, want_bins[t, e]] += 1
    np.testing.assert_array_equal(got, want)



def test_reference_bins_are_one_formula_eager_and_under_jit():
    """``qb_bins`` is ``floor((rb - lower) * (B / (upper - lower)))``, the scale rounded
    once, eagerly and under jit (XLA rewrote the old ``(... * B) / width`` into a
    reciprocal product, reassociated differently under jit): the kernels' formula."""
    from gpurouter.reference.variants import qb_bins

    rb = (np.random.default_rng(11).standard_normal(2_000_000) * 0.7).astype(np.float32)
    bounds = np.array([-1.1, 1.05], np.float32)
    scale = np.float32(np.float32(1000) / np.float32(bounds[1] - bounds[0]))
    want = np.clip(np.floor(np.float32(1) * (rb - bounds[0]).astype(np.float32) * scale), 0, 999)
    eager = np.asarray(qb_bins(jnp.asarray(rb), jnp.asarray(bounds), 1000))
    jitted = np.asarray(jax.jit(lambda r, b: qb_bins(r, b, 1000))(rb, bounds))
    np.testing.assert_array_equal(eager, want.astype(np.int32))
    np.testing.assert_array_equal(jitted, eager)

def test_end_bins_nan_and_inf():
    """Bounds narrower than the scores clamp into the end bins; a NaN logit's rb is NaN
    (bin 0) and its r -inf at the cutoff; +-inf logits are exact 1 and 0."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((12, 8)).astype(np.float32) * 3
    x[0, 1] = np.nan
    x[1, :] = np.nan
    x[2, 3], x[2, 4] = np.inf, -np.inf
    got = _check(x, rng.standard_normal(8) * 0.1, [-0.01, 0.01], 6, 2)
    assert got[:, 0].sum() + got[:, -1].sum() > 0.8 * got.sum(), "most counts in the end bins"
    assert got[1, 0] >= 1, "the NaN logit counts in bin 0"


def test_mask():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(8) * 0.2
    assert _check(x, bias, [-1, 1], 4, 2, mask=np.zeros(16, bool)).sum() == 0
    _check(x, bias, [-1, 1], 4, 2, mask=np.arange(16) % 3 != 0)


@pytest.mark.parametrize("rule", ["sum_topk", "top2_sum", "max"])
def test_groups(rule):
    """Group-limited QB: the cutoff among the kept groups' experts, each rule."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    x[:3] = np.tile(x[:3, :4], 4)  # four equal groups: the lower two stay
    bias = np.tile(rng.standard_normal(4) * 0.1, 4)
    _check(x, bias, [-1, 1], 8, 4, mask=np.arange(8) != 5, num_groups=4, group_topk=2, rule=rule)



def test_group_tie_keeps_the_lower_group():
    """Groups 0 and 1 tie on their max: group 0 stays (Kg = 1), so the cutoff is its
    4th value (logit -2), not group 1's (0.3); counts as the reference's."""
    x = np.array([[1.0, -2.0, -2.0, -2.0, 1.0, 0.5, 0.4, 0.3] + [-3.0] * 8], np.float32)
    got = _check(x, np.zeros(16), [-1.0, 1.0], 8, 3, num_groups=4, group_topk=1, rule="max")
    s = 1 / (1 + np.exp(-x[0].astype(np.float64)))
    alpha = s[1]  # sigmoid(-2)
    assert got[0, int(np.floor((alpha - s[0] + 1) * 8 / 2))] == 1  # well inside a bin

def test_tilings_same_counts():
    """Several slabs and chunks, one expert a block, global atomics (no shared
    budget), a thread a token and 8 lanes a token at the cutoff, 3 and 1 token
    rows a histogram step count the same."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((20, 12)).astype(np.float16)
    bias = rng.standard_normal(12) * 0.1
    base = _check(x, bias, [-1, 1], 7, 3)
    for t in (kqb.QbTiling(slab_tokens=4, target_blocks=64, smem_bytes=4 * 7 * 5, cutoff_lanes=1),
              kqb.QbTiling(smem_bytes=4 * 7, hist_threads=8, cutoff_threads=8, cutoff_lanes=8, hist_unroll=3),
              kqb.QbTiling(smem_bytes=0, slab_tokens=8, target_blocks=4, hist_unroll=1)):
        np.testing.assert_array_equal(_check(x, bias, [-1, 1], 7, 3, tiling=t), base)


@pytest.mark.parametrize("experts", [20, 18])
def test_cutoff_quads_same_bits(experts):
    """bf16 logits: the cutoff lanes reading four experts a load (E = 20: two quads
    a step and a tail quad with 2 lanes; E = 18: not a multiple of 4, the scalar
    path) count the reference's bits, as the one-expert-a-load path does; NaN
    logits, equal scores and masked rows included."""
    rng = np.random.default_rng(14)
    x = (rng.standard_normal((9, experts)) * 2).astype(ml_dtypes.bfloat16)
    x[0, 5] = np.nan
    x[1, :6] = 1.5  # six equal scores (zero bias there): a tie at the cutoff
    bias = rng.standard_normal(experts) * 0.1
    bias[:6] = 0.0
    mask = np.arange(9) != 4
    plan = kqb.qb_counts_plan(spec_for(x.shape, x.dtype), True, 3, 6,
                              tiling=kqb.QbTiling(cutoff_threads=8, cutoff_lanes=2))
    assert plan.steps[0].kernel is kqb.qb_cutoff_lanes_kernel(kqb.BF16, 3, 2, True, qb_math.default_exp_mode(),
                                                              experts % 4 == 0)
    for quads in (True, False):
        _check(x, bias, [-1.0, 1.0], 6, 3, mask=mask,
               tiling=kqb.QbTiling(cutoff_threads=8, cutoff_lanes=2, cutoff_quads=quads))


def _plan_counts_poisoned(x, bias, bounds, num_bins, topk, mask, tiling, exp_mode=None):
    """The plan's steps launched by hand on arrays where the counts and every
    scratch word start as garbage (-7): what the kernels do not write shows."""
    from numba import cuda

    from gpurouter.kernels._base import launch as L
    from gpurouter.kernels._base import plan as _plan

    plan = kqb.qb_counts_plan(_plan.spec_for(x.shape, x.dtype), mask is not None, topk, num_bins,
                              exp_mode=exp_mode, tiling=tiling)
    ins = [L.host_words(x), cuda.to_device(np.asarray(bias, np.float32)),
           cuda.to_device(np.asarray(bounds, np.float32))]
    if mask is not None:
        ins.append(cuda.to_device(np.asarray(mask, np.bool_)))
    arrays = {"in": ins, "out": [cuda.to_device(np.full(sp.shape, -7, sp.dtype)) for sp in plan.outs],
              "tmp": [cuda.to_device(np.full(sp.shape, -7, sp.dtype)) for sp in plan.tmps]}
    for st in plan.steps:
        L.launch(st.kernel, st.grid, st.block, 0, st.shared, *(_plan._resolve(a, arrays) for a in st.args))
    return plan, arrays["out"][0].copy_to_host()


@pytest.mark.parametrize("case", ["slabs", "one slab", "no shared budget"])
def test_every_bin_written_over_garbage(case):
    """The counts and the scratch start as garbage: with shared counts every bin is
    stored (several slabs through ``partial`` and ``qb_reduce``, a partial last slab
    and a partial last expert chunk, masked rows in the unrolled steps and in the
    tail; one slab straight into the counts); without a shared budget ``qb_zero``
    clears the counts before the global atomics. Bit for bit the reference."""
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((23, 6)) * 2).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(6) * 0.1
    bounds = [-0.9, 0.8]
    mask = np.arange(23) % 5 != 2
    tiling = {
        # 4 experts a chunk (2 chunks, the last of 2), 4 threads: one token row a
        # block in chunk 0 (hist_unroll 8: one 8-row step in the full slabs, the
        # 7-token slab all tail), two in chunk 1; 3 slabs of 8, 8, 7 tokens
        "slabs": kqb.QbTiling(smem_bytes=4 * 5 * 4, hist_threads=4, slab_tokens=8, target_blocks=6),
        "one slab": kqb.QbTiling(hist_threads=6, slab_tokens=64),
        "no shared budget": kqb.QbTiling(smem_bytes=4 * 5 - 1, hist_threads=6, slab_tokens=8, target_blocks=6),
    }[case]
    plan, got = _plan_counts_poisoned(x, bias, bounds, 5, 2, mask, tiling)
    kernels = [st.kernel for st in plan.steps]
    assert (kqb.qb_reduce_kernel in kernels) == (case == "slabs")
    assert (kqb.qb_zero_kernel in kernels) == (case == "no shared budget")
    want = _ref(x, bias, bounds, 5, 2, mask)
    np.testing.assert_array_equal(got.reshape(6, 5), want)
    assert (want.sum(axis=1) == mask.sum()).all()


def test_slab_layout_matches_reference_unmasked_f32():
    """Several slabs and chunks, every token valid, fp32 logits: the slab sums through
    the launcher equal the reference (each slab's partial rows land at their expert)."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((18, 10)).astype(np.float32)
    bias = rng.standard_normal(10) * 0.1
    t = kqb.QbTiling(smem_bytes=4 * 6 * 3, hist_threads=3, slab_tokens=5, target_blocks=16)
    grid, _, shared, chunk, chunks, slab = qb_tiling.hist_tiling(18, 10, 6, t)
    assert (chunk, chunks, grid // chunks, shared) == (3, 4, 4, 4 * 3 * 6)  # 4 slabs of 5, 5, 5, 3 tokens
    _check(x, bias, [-1.0, 1.0], 6, 4, tiling=t)


@pytest.mark.parametrize("kw", [
    {},
    {"compact": True, "token_mask": "mask"},
    {"num_groups": 4, "group_topk": 2, "group_score": "top2_sum"},
])
def test_public_op_numba_equals_jax(kw):
    """The histogram ``gr.fused_topk_with_score_function(..., backend="numba")`` returns
    is jax's, bit for bit (and the kernels counted it: the exp check passed)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((2, 6, 16)).astype(np.float32)).astype(jnp.bfloat16)
    kw = dict(kw)
    if kw.get("token_mask") == "mask":
        kw["token_mask"] = jnp.asarray(rng.random((2, 6)) > 0.4)
    args = dict(score_function="sigmoid", expert_bias=jnp.asarray(rng.standard_normal(16) * 0.1, jnp.float32),
                qb_histogram=jnp.asarray(rng.integers(0, 9, (16, 10)), jnp.int32),
                qb_bin_bounds=jnp.array([-0.8, 0.9], jnp.float32), **kw)
    want = gpurouter.fused_topk_with_score_function(x, 4, backend="jax", **args)[-1]
    got = jax.jit(lambda v: gpurouter.fused_topk_with_score_function(v, 4, backend="numba", **args)[-1])(x)
    assert op_qb.use_kernels(TopkConfig(4, False, -1, -1, 1.0, ScoreFunction.SIGMOID, False), "callback")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))



def test_gradient_flows_past_the_counts():
    """The kernels' counts take no gradient (the kernel call is never differentiated):
    grad of the probs on numba is jax's (the sigmoid backward)."""
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
    kw = dict(score_function="sigmoid", expert_bias=jnp.asarray(rng.standard_normal(16) * 0.1, jnp.float32),
              qb_histogram=jnp.zeros((16, 4), jnp.int32), qb_bin_bounds=jnp.array([-1.0, 1.0], jnp.float32))
    cot = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
    grads = [jax.grad(lambda v, b=b: jnp.sum(gpurouter.fused_topk_with_score_function(v, 4, backend=b, **kw)[0]
                                             * cot))(x) for b in ("numba", "jax")]
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(grads[1]), rtol=1e-4, atol=1e-6)

@pytest.mark.gpu
def test_kimi_shape_on_gpu():
    """T = 65536, E = 384, K = 8, B = 1000, bf16 (and 10% of the tokens masked): the
    public op's numba histogram (the kernels, through XLA) equals the jnp counts
    bit for bit; the kernels' sigmoid is jax's on the device."""
    probe = op_qb._probe_values(False)
    want_s = np.asarray(jax.nn.sigmoid(jnp.asarray(probe))).view(np.uint32)
    for mode in qb_math.EXP_MODES:  # which modes match (printed for the record)
        got_s = qb_math.qb_sigmoid_probe(probe, mode).view(np.uint32)
        print(f"qb exp_mode {mode}: sigmoid bit-equal to jax on the GPU: {np.array_equal(got_s, want_s)} "
              f"({int(np.sum(got_s != want_s))} of {probe.size} differ)")
    print(f"qb kernel_exp_mode(): {op_qb.kernel_exp_mode()}")
    assert op_qb.kernel_exp_mode() is not None, "no exp mode matches jax.nn.sigmoid on this GPU"
    rng = np.random.default_rng(37)
    x = jnp.asarray(rng.standard_normal((65536, 384)).astype(np.float32)).astype(jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(384) * 0.05, jnp.float32)
    bounds = jnp.array([-1.1, 1.05], jnp.float32)
    hist = jnp.zeros((384, 1000), jnp.int32)
    mask = jnp.asarray(np.arange(65536) % 10 != 0)
    for kw in ({}, {"token_mask": mask}):
        f = jax.jit(lambda v, h, kw=kw: gpurouter.fused_topk_with_score_function(
            v, 8, score_function="sigmoid", expert_bias=bias, qb_histogram=h, qb_bin_bounds=bounds,
            backend="numba", **kw)[-1])
        got = np.asarray(f(x, hist))
        want = _ref(x, bias, bounds, 1000, 8, None if not kw else kw["token_mask"])
        np.testing.assert_array_equal(got, want)
        assert got.sum() == 384 * (65536 if not kw else int(np.sum(mask)))


@pytest.mark.gpu
def test_slab_reduce_and_fallback_on_gpu():
    """On a GPU (real shared and global atomics, 16-bit loads): T = 3001, E = 384,
    B = 1000, bf16, every 7th token masked: the default tiling (several slabs:
    partial + qb_reduce; the cutoff's 8-byte quad loads), one slab (the cutoff one
    expert a load), and B = 13000 (a row over the 48 KiB budget: qb_zero + global
    atomics) count the reference's bits, over garbage outputs."""
    mode = op_qb.kernel_exp_mode()
    assert mode is not None, "no exp mode matches jax.nn.sigmoid on this GPU"
    rng = np.random.default_rng(38)
    x = rng.standard_normal((3001, 384)).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(384) * 0.05
    bounds = [-1.1, 1.05]
    mask = np.arange(3001) % 7 != 3
    for bins, tiling, kind in ((1000, kqb.QB_TILING, "slabs"),
                               (1000, kqb.QbTiling(slab_tokens=4096, cutoff_quads=False), "one slab"),
                               (13000, kqb.QB_TILING, "no shared budget")):
        plan, got = _plan_counts_poisoned(x, bias, bounds, bins, 8, mask, tiling, mode)
        kernels = [st.kernel for st in plan.steps]
        assert (kqb.qb_reduce_kernel in kernels) == (kind == "slabs"), kind
        assert (kqb.qb_zero_kernel in kernels) == (kind == "no shared budget"), kind
        np.testing.assert_array_equal(got.reshape(384, bins), _ref(x, bias, bounds, bins, 8, mask), err_msg=kind)
        print(f"qb {kind}: {len(plan.steps)} launches, counts equal the reference")


def test_token_sharded_jit_counts_per_shard():
    """Token-sharded logits under jit (explicit sharding): the kernels count each
    shard's tokens and the counts are summed: jax's unsharded histogram."""
    n = jax.device_count()
    if n < 2:
        pytest.skip(f"needs >= 2 devices of the default backend, have {n}")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((2 * n, 8)), jnp.float32)
    mask = jnp.asarray(np.arange(2 * n) % 3 != 1)
    args = dict(score_function="sigmoid", expert_bias=jnp.asarray(rng.standard_normal(8) * 0.1, jnp.float32),
                qb_histogram=jnp.zeros((8, 5), jnp.int32), qb_bin_bounds=jnp.array([-1.0, 1.0], jnp.float32),
                token_mask=mask)
    want = gpurouter.fused_topk_with_score_function(x, 2, backend="jax", **args)[-1]
    mesh = jax.make_mesh((n,), ("data",))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        got = jax.jit(lambda v: gpurouter.fused_topk_with_score_function(v, 2, backend="numba", **args)[-1])(xs)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_vmap_and_shard_map_axis_name():
    """Under vmap the kernels run once per element; inside shard_map with
    ``axis_name`` each shard's counts are summed once: jax's histograms."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(10)
    kw = dict(score_function="sigmoid", expert_bias=jnp.asarray(rng.standard_normal(8) * 0.1, jnp.float32),
              qb_bin_bounds=jnp.array([-1.0, 1.0], jnp.float32))
    x = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
    h = jnp.asarray(rng.integers(0, 3, (3, 8, 4)), jnp.int32)
    got, want = (jax.vmap(lambda v, hh, b=b: gpurouter.fused_topk_with_score_function(
        v, 2, backend=b, qb_histogram=hh, **kw)[-1])(x, h) for b in ("numba", "jax"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    xs = jax.device_put(jnp.asarray(rng.standard_normal((2 * n, 8)), jnp.float32), NamedSharding(mesh, P("data", None)))

    def run(backend):
        def local(v):
            return gpurouter.fused_topk_with_score_function(v, 2, backend=backend, axis_name="data",
                                                            qb_histogram=jnp.zeros((8, 4), jnp.int32), **kw)[-1]
        return np.asarray(jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data", None), out_specs=P()))(xs))

    got = run("numba")
    np.testing.assert_array_equal(got, run("jax"))
    assert got.sum() == 2 * n * 8
