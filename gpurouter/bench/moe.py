"""``python -m gpurouter moe-bench``: the MoE block end to end and by stage.

For each layer shape (the MoE issue's Qwen3-30B-A3B-like layer and
DeepSeek-V3-like slice; ``--scale`` shrinks T and M to fit), the jitted
forward + backward time (gradients of x and every weight) of:

- ``block numba``: ``gpurouter.moe.moe`` with ``backend="numba"`` (the router,
  the aux loss, the dispatch and the combine on the kernels);
- ``block jax``: the same block with ``backend="jax"``: plain jnp, argsort
  dispatch and combine as MaxText does, the same grouped GEMM;

and, on the jax block's inputs, each stage alone (forward + backward): the
router, the dispatch + combine (the row gather and the weighted sum back),
the same on the dispatch / combine kernels (``dispatch+combine numba``),
and the three grouped GEMMs, with their TFLOP/s (6 N H M flops forward,
twice that backward, N = T K rows; also the forward alone). Beside every
grouped-GEMM row, its ceiling: the same three GEMMs as dense GEMMs of the
same FLOPs (``[N, H] @ [H, M]`` and so on, one expert's weights), its time
(``dense GEMMs ms``, ``dense GEMMs fwd ms``), TFLOP/s and the ratio
(``grouped / dense``: 1.0 is the dense rate). The stage times are measured
apart, so they need not add up to the block's. The grouped GEMM of both
blocks and of the GEMM stage is ``--grouped-matmul``: ``auto`` (the block's
default: ``slots`` on an NVIDIA GPU, else ``batched``), ``ragged_dot``
(``jax.lax.ragged_dot``), ``batched``
(:func:`gpurouter.moe.batched_ragged_dot`), ``tiled``
(:func:`gpurouter.moe.tiled_ragged_dot`), ``pallas``
(:func:`gpurouter.moe.pallas_ragged_dot`), ``mosaic``
(:func:`gpurouter.moe.mosaic_ragged_dot`) or ``slots`` (``moe(...,
grouped_matmul="slots")``: the whole expert FFN in capacity slots, filled
from the tokens and summed back into them, which the GEMM stage then times
from the tokens, so that stage includes what dispatch and combine do for
the others); several, comma-separated, give a
row each per shape, timed in the same run (``--grouped-matmul
batched,mosaic``).

Results: a table on stdout, ``--json`` for the numbers. GPU for real figures;
``--tiny`` runs a toy shape anywhere (the tests use it): without numba-cuda
(``make demo`` on a machine with no GPU) the jax rows alone, and on the CUDA
simulator each numba path once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from .._cli import positive_int
from .._progress import progress

#: T, H, E, K, M and the router of each layer
SHAPES = {
    "qwen3-like": (8192, 2048, 128, 8, 768, dict(score_function="softmax")),
    "deepseek-v3-like": (4096, 7168, 256, 8, 2048, dict(score_function="sigmoid", num_groups=8, group_topk=4,
                                                        scaling_factor=2.5)),
}
TINY = (64, 32, 8, 2, 16, dict(score_function="softmax"))
GROUPED_MATMULS = ("auto", "ragged_dot", "batched", "tiled", "pallas", "mosaic", "slots")


def grouped_matmul_of(name: str):
    """The grouped GEMM named by ``--grouped-matmul`` (``"slots"``: the
    block's whole expert FFN in capacity slots, passed on as the name)."""
    import jax

    if name == "slots":
        return name
    if name == "auto":  # the block's default, resolved here as the block does ("slots" or batched_ragged_dot)
        from ..reference.moe import auto_grouped_matmul

        return auto_grouped_matmul(None)

    from ..grouped_gemm import mosaic_ragged_dot, pallas_ragged_dot
    from ..reference.grouped_matmul import batched_ragged_dot, tiled_ragged_dot

    return {"ragged_dot": jax.lax.ragged_dot, "batched": batched_ragged_dot, "tiled": tiled_ragged_dot,
            "pallas": pallas_ragged_dot, "mosaic": mosaic_ragged_dot}[name]


def median_ms(fn, args, repeats: int) -> float:
    """Median wall milliseconds of ``fn(*args)`` (jitted; one warm-up call first)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _inputs(t, h, e, m, dtype):
    import jax
    import numpy as np

    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    s = 1 / np.sqrt(h)
    return [jax.random.normal(ks[0], (t, h)).astype(dtype), (jax.random.normal(ks[1], (h, e)) * s).astype(dtype),
            (jax.random.normal(ks[2], (e, h, m)) * s).astype(dtype),
            (jax.random.normal(ks[3], (e, h, m)) * s).astype(dtype),
            (jax.random.normal(ks[4], (e, m, h)) / np.sqrt(m)).astype(dtype)]


def _block_step(e, k, router, backend, gmm):
    import jax
    import jax.numpy as jnp

    from .. import moe as gmoe

    def loss(x, g, w0, w1, wo):
        out, aux = gmoe.moe(x, g, w0, w1, wo, num_experts=e, num_experts_per_tok=k, aux_loss_coeff=1e-3,
                            backend=backend, grouped_matmul=gmm, **router)
        return jnp.sum(out.astype(jnp.float32) ** 2) + aux
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def scaled_shape(name: str, scale: float):
    """:data:`SHAPES`'s ``name`` with T and M times ``scale`` (``--scale``)."""
    t, h, e, k, m, router = SHAPES[name]
    return (max(e, int(t * scale)), h, e, k, max(8, int(m * scale)), router)


def block_steps(shape: str | None, backend: str, grouped_matmuls: list[str], scale: float = 1.0):
    """The block's jitted forward + backward step for each ``--grouped-matmul``
    name at a shape of :data:`SHAPES` (None: :data:`TINY`) scaled as
    ``--scale``, and their bf16 operands (the probes' entry:
    tools/probes/block_ab.py, block_profile.py)."""
    import jax.numpy as jnp

    t, h, e, k, m, router = TINY if shape is None else scaled_shape(shape, scale)
    steps = {n: _block_step(e, k, router, backend, grouped_matmul_of(n)) for n in grouped_matmuls}
    return steps, _inputs(t, h, e, m, jnp.bfloat16)


def _stage_steps(e, k, router, gmm):
    """(router, dispatch + combine, grouped GEMMs) steps, each forward + backward."""
    import jax
    import jax.numpy as jnp

    from .. import reference as ref

    def route(x, g):
        probs, _ = ref.fused_topk_with_score_function(x @ g, k, **router)
        return jnp.sum(probs.astype(jnp.float32) ** 2)

    def permute(x, idx, w):
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        xs = x[order // k]  # dispatch
        z = jnp.zeros_like(xs).at[order].set(xs).reshape(x.shape[0], k, -1)  # combine
        return jnp.sum((z.astype(jnp.float32) * w[:, :, None]).sum(1) ** 2)

    def permute_numba(x, routing_map, probs):
        from ..moe import token_combine, token_dispatch

        xs, _, rid, _, _ = token_dispatch(x, routing_map, x.shape[0] * k, probs=probs, backend="numba")
        return jnp.sum(token_combine(xs, rid, probs, backend="numba").astype(jnp.float32) ** 2)

    def gemms(xs, sizes, w0, w1, wo):
        if gmm == "slots":  # the block's FFN from tokens to tokens (xs: the tokens, sizes: their experts [T, K])
            from ..reference.slot_experts import slots_token_ffn
            z = slots_token_ffn(xs, sizes, jnp.full(sizes.shape, 1.0 / k, jnp.float32), wi_0=w0, wi_1=w1, wo=wo,
                                wi_0_bias=None, wi_1_bias=None, wo_bias=None, activation=jax.nn.silu,
                                dtype=xs.dtype)
            return jnp.sum(z ** 2)
        hid = jax.nn.silu(gmm(xs, w0, sizes)) * gmm(xs, w1, sizes)
        return jnp.sum(gmm(hid, wo, sizes).astype(jnp.float32) ** 2)

    return (jax.jit(jax.value_and_grad(route, argnums=(0, 1))), jax.jit(jax.value_and_grad(permute, argnums=(0, 2))),
            jax.jit(jax.value_and_grad(permute_numba, argnums=(0, 2))),
            jax.jit(jax.value_and_grad(gemms, argnums=(0, 2, 3, 4))), jax.jit(gemms))


def _dense_steps():
    """The grouped GEMMs' ceiling: the same three GEMMs, forward + backward and
    forward, as dense GEMMs of the same FLOPs (``[N, H] @ [H, M]``, ...)."""
    import jax
    import jax.numpy as jnp

    def gemms(xs, w0, w1, wo):
        hid = jax.nn.silu(xs @ w0) * (xs @ w1)
        return jnp.sum((hid @ wo).astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(gemms, argnums=(0, 1, 2, 3))), jax.jit(gemms)


def run_shape(name, shape, repeats: int, grouped_matmul: str = "auto", numba: bool = True,
              numba_repeats: int | None = None) -> dict:
    """One shape's row. ``numba=False``: the jax block and the jnp stages only
    (no numba-cuda here); ``numba_repeats``: the numba paths' repeats (1 on
    the simulator, whose times only show that the paths run)."""
    import jax
    import jax.numpy as jnp

    t, h, e, k, m, router = shape
    x, g, w0, w1, wo = _inputs(t, h, e, m, jnp.bfloat16)
    gmm = grouped_matmul_of(grouped_matmul)
    row = {"shape": name, "T": t, "H": h, "E": e, "K": k, "M": m, "grouped_matmul": grouped_matmul}
    backends = ("numba", "jax") if numba else ("jax",)
    nrep = repeats if numba_repeats is None else numba_repeats
    for backend in backends:
        row[f"block {backend} ms"] = median_ms(_block_step(e, k, router, backend, gmm), (x, g, w0, w1, wo),
                                               nrep if backend == "numba" else repeats)
    if numba:
        row["block jax / numba"] = row["block jax ms"] / row["block numba ms"]
    route, permute, permute_numba, gemms, gemms_fwd = _stage_steps(e, k, router, gmm)
    idx = jnp.argsort(-(x @ g).astype(jnp.float32), axis=-1)[:, :k].astype(jnp.int32)
    sizes = jnp.bincount(idx.reshape(-1), length=e).astype(jnp.int32)
    xs = jnp.repeat(x, k, axis=0)  # N = T K rows (their order does not change the work)
    # (the group sizes do: ``batched`` multiplies about G * max(n_g) rows; these are the router's)
    weights = jnp.full((t, k), 1.0 / k, jnp.float32)
    row["router ms"] = median_ms(route, (x, g), repeats)
    row["dispatch+combine ms"] = median_ms(permute, (x, idx, weights), repeats)
    routing_map = jnp.zeros((t, e), bool).at[jnp.arange(t)[:, None], idx].set(True)
    probs = jnp.where(routing_map, 1.0 / k, 0.0).astype(x.dtype)
    if numba:
        row["dispatch+combine numba ms"] = median_ms(permute_numba, (x, routing_map, probs), nrep)
    # "slots" has no rows: its stage is the block's FFN from the tokens and their experts to the tokens
    stage = (x, idx) if isinstance(gmm, str) and gmm == "slots" else (xs, sizes)
    row["grouped GEMMs ms"] = median_ms(gemms, (*stage, w0, w1, wo), repeats)
    row["grouped GEMMs fwd ms"] = median_ms(gemms_fwd, (*stage, w0, w1, wo), repeats)
    flops = 18.0 * t * k * h * m
    row["grouped GEMM TFLOP/s"] = flops / (row["grouped GEMMs ms"] * 1e-3) / 1e12
    row["grouped GEMM fwd TFLOP/s"] = flops / 3 / (row["grouped GEMMs fwd ms"] * 1e-3) / 1e12
    dense, dense_fwd = _dense_steps()
    row["dense GEMMs ms"] = median_ms(dense, (xs, w0[0], w1[0], wo[0]), repeats)
    row["dense GEMMs fwd ms"] = median_ms(dense_fwd, (xs, w0[0], w1[0], wo[0]), repeats)
    row["dense GEMM TFLOP/s"] = flops / (row["dense GEMMs ms"] * 1e-3) / 1e12
    row["dense GEMM fwd TFLOP/s"] = flops / 3 / (row["dense GEMMs fwd ms"] * 1e-3) / 1e12
    row["grouped / dense"] = row["dense GEMMs ms"] / row["grouped GEMMs ms"]
    row["grouped / dense fwd"] = row["dense GEMMs fwd ms"] / row["grouped GEMMs fwd ms"]
    for backend in backends:
        row[f"GEMM share of the {backend} block"] = row["grouped GEMMs ms"] / row[f"block {backend} ms"]
    row["device"] = jax.devices()[0].device_kind
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpurouter moe-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated (default: {','.join(SHAPES)})")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies T and M (default 1)")
    parser.add_argument("--grouped-matmul", default="auto",
                        help=f"the grouped GEMM of the blocks and the GEMM stage, one or several comma-separated "
                             f"of {', '.join(GROUPED_MATMULS)} (default auto, the block's)")
    parser.add_argument("--tiny", action="store_true",
                        help="a toy shape instead (any machine: jax rows alone without numba-cuda; for tests)")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed repeats, median (default 10)")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 1:
        parser.error(f"--scale must be in (0, 1], got {args.scale}")
    gmms = [s.strip() for s in args.grouped_matmul.split(",")]
    bad = [g for g in gmms if g not in GROUPED_MATMULS]
    if bad or not gmms:
        parser.error(f"--grouped-matmul: unknown {', '.join(map(repr, bad))}; choose from {', '.join(GROUPED_MATMULS)}")
    names = [s.strip() for s in args.shapes.split(",")]
    bad = [n for n in names if n not in SHAPES]
    if bad:
        parser.error(f"unknown shape {', '.join(map(repr, bad))}; choose from {', '.join(SHAPES)}")
    from .. import _backend

    numba = _backend.numba_usable()
    if not numba and not args.tiny:
        parser.error("the MoE bench times backend=\"numba\": it needs numba-cuda and a GPU "
                     "(--tiny runs anywhere: the jax rows alone without numba-cuda)")
    if not numba:
        print("moe-bench --tiny: numba rows skipped (numba-cuda is not installed, or sees no GPU and "
              "NUMBA_ENABLE_CUDASIM is not set); the jax block and stages only")
    # on the simulator the numba paths run once: their times are the simulator's, not a GPU's
    numba_repeats = 1 if _backend.simulator_enabled() else None
    if numba and numba_repeats:
        print("moe-bench: the CUDA simulator: each numba path runs once (its time is the simulator's)")
    shapes = {"tiny": TINY} if args.tiny else {}
    for n in ([] if args.tiny else names):
        shapes[n] = scaled_shape(n, args.scale)
    runs = [(n, s, g) for n, s in shapes.items() for g in gmms]
    run_list = progress(runs, len(runs), "moe-bench", not args.no_progress, describe=lambda i: f"{i[0]} {i[2]}")
    rows = []
    for n, s, g in run_list:  # each row printed and saved when it is done: a stopped run keeps the rows it had
        rows.append(run_shape(n, s, args.repeats, g, numba, numba_repeats))
        print(", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
