"""``python -m gpurouter bench``: router speed per preset, backend and transport.

For each preset it times, on bf16 logits with an fp32 bias:

- ``kernel``: the kernels alone, launched exactly as the zero-copy callback
  launches them (cached plans, raw pointers), CUDA events around each launch,
  the launches queued behind a sleep kernel so that host time is not counted
  (median of ``--repeats`` runs, inputs rotated over 4 buffers so no run reads
  what the previous one left in L2); ``host us`` is the Python time of one
  such call, the zero-copy transport's per-op overhead;
- ``jax`` / ``numba:<transport>``: the jitted public op, wall time per call
  (median), forward alone and forward + backward;
- ``loop``: a jitted ``lax.fori_loop`` of 50 router forward + backward steps,
  time per step.

Every result is checked against the reference before it is timed. Byte floor:
the bytes an op must read and write at the peak bandwidth given by
``--peak-tbs`` (default 4.0 TB/s, measured device-to-device on an H200 here).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

from .._cli import PLOT_NEEDS, comma_list, matplotlib_missing, positive_float, positive_int
from .._progress import progress
from ..presets import PRESETS
from .timing import launch_times, spin_kernel

BF16 = np.dtype(ml_dtypes.bfloat16)  # ml_dtypes ships with jax

DEFAULT_PRESETS = ("deepseek-v3", "deepseek-v4", "qwen3", "mixtral", "llama-4", "kimi-k2",
                   "nemotron-3-super")


@dataclasses.dataclass
class Row:
    preset: str
    op: str  # "topk", "aux_scores", "aux_loss"
    path: str  # "kernel", "jax", "numba:zero-copy", "numba:callback"
    phase: str  # "fwd", "bwd", "fwd+bwd", "loop-step"
    tokens: int
    experts: int
    topk: int
    us: float
    bytes: int
    gbps: float | None = None  # None off a GPU (no peak bandwidth to compare with)
    x_floor: float | None = None
    x_jax: float | None = None
    host_us: float | None = None  # kernel rows: Python time per launch call (zero-copy overhead)


def _bytes(op: str, phase: str, t: int, e: int, in_bytes: int) -> int:
    """Bytes an op must move (reads + writes), its memory floor."""
    if op in ("topk", "topk_bitmap"):
        map_bytes = t * -(-e // 8) if op == "topk_bitmap" else t * e  # BITMAP_U8 or bool map
        fwd = t * e * (in_bytes + in_bytes + 4) + map_bytes + 4 * e  # x; probs, saved, map; bias
        bwd = t * e * (4 + in_bytes + in_bytes) + map_bytes  # saved, grad_probs, grad_logits; map
    elif op == "aux_scores":
        fwd = t * e * (in_bytes + 4 + 1 + 4)
        bwd = t * e * (4 + 4 + in_bytes)
    else:  # aux loss, fp32 probs
        fwd = t * e * 4 + 4 * e
        bwd = t * e * 4 + 4 * e
    return {"fwd": fwd, "bwd": bwd}.get(phase, fwd + bwd)


def _row(preset, op, path, phase, tokens, experts, topk, seconds, nbytes, peak, x_jax=None,
         host_seconds=None) -> Row:
    """A result row; the bandwidth columns only with a GPU ``peak`` (TB/s)."""
    us = seconds * 1e6
    gbps = x_floor = None
    if peak is not None:
        gbps = round(nbytes / seconds / 1e9, 1)
        x_floor = round(us / (nbytes / (peak * 1e12) * 1e6), 2)
    return Row(preset, op, path, phase, tokens, experts, topk, round(us, 2), nbytes, gbps, x_floor,
               x_jax, None if host_seconds is None else round(host_seconds * 1e6, 2))


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def _gpu_info() -> dict:
    info = {"python": platform.python_version()}
    try:
        import jax

        info["jax"] = jax.__version__
        info["jax_device"] = jax.devices()[0].device_kind
    except Exception as e:  # report, don't fail: the info is only a header
        info["jax"] = f"unavailable: {e}"
    try:
        import numba

        from ..kernels._base import compat as _compat  # noqa: F401

        info["numba"] = numba.__version__
        from importlib.metadata import version

        info["numba_cuda"] = version("numba-cuda")
        info["numpy"] = np.__version__
    except Exception as e:
        info["numba"] = f"unavailable: {e}"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        info["gpu"], info["driver"] = [s.strip() for s in out.splitlines()[0].split(",")]
    except Exception:
        info["gpu"] = "none"
    # GPUROUTER_COMMIT first: a copy of the tree on a lent GPU may carry no
    # .git, or sit inside an unrelated one (whose HEAD is not this code's).
    info["commit"] = os.environ.get("GPUROUTER_COMMIT", "") or _git_commit()
    info["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return info


def _git_commit() -> str:
    """HEAD of the checkout this package was imported from, or "unknown" when
    the package does not sit at the top of a git work tree."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above gpurouter/bench/

    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or os.path.realpath(top) != os.path.realpath(root):
            return "unknown"
        return git("rev-parse", "--short", "HEAD") or "unknown"
    except Exception:
        return "unknown"


def _median_wall(fn, args_list, repeats: int) -> float:
    """Median wall seconds of ``fn(*args)`` over rotated argument sets."""
    import jax

    jax.block_until_ready(fn(*args_list[0]))
    times = []
    for i in range(repeats):
        args = args_list[i % len(args_list)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _kernel_times(planner, n_token: int, arg_sets, outs, repeats: int, check=None) -> tuple[float, float]:
    """``(kernel seconds, host seconds)``: medians over ``repeats`` launches.

    Runs exactly what a zero-copy callback runs (``_transport.buffer._run_plans`` on the
    arrays' raw pointers), inputs rotated over ``arg_sets``, timed by
    ``timing.launch_times`` on a stream of its own. Host time: the Python time of
    one call, the per-call overhead of the zero-copy transport (plus XLA's own
    callback dispatch, not measured here). ``check()`` runs after the first
    launch, on ``arg_sets[0]``, before timing.
    """
    from numba import cuda

    from .._transport import buffer as cb

    stream = cuda.stream()
    handle = int(stream.handle)
    n_out = len(outs)

    def call(args):
        cb._device_call(planner, n_token, n_out, args, outs, handle)

    if check is not None:
        call(arg_sets[0])
        stream.synchronize()
        check()
    kernel, host = launch_times(call, arg_sets, repeats, spin_kernel(), stream)
    return statistics.median(kernel), statistics.median(host)


@contextlib.contextmanager
def _callback_timer():
    """Records the Python seconds of every zero-copy callback body run inside."""
    from .._transport import buffer as cb

    inner, times = cb._device_call, []

    def timed(*args):
        t = time.perf_counter()
        inner(*args)
        times.append(time.perf_counter() - t)

    cb._device_call = timed
    try:
        yield times
    finally:
        cb._device_call = inner


def _check(name, got, want, atol, rtol):
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    if got.dtype == bool or want.dtype == bool:
        ok = np.array_equal(got, want)
    else:
        ok = np.allclose(got, want, atol=atol, rtol=rtol, equal_nan=True)
    if not ok:
        diff = np.nanmax(np.abs(got - want))
        raise AssertionError(f"{name}: result differs from the reference (max |d| = {diff:.3g})")


def bench_preset(name: str, tokens: int, paths: list[str], repeats: int, peak: float | None,
                 loop_steps: int) -> list[Row]:
    import jax
    import jax.numpy as jnp

    import gpurouter as gr
    from gpurouter import reference as ref

    p = PRESETS[name]
    e, k = p.num_experts, p.topk
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    # Rotated inputs: rows of distinct values (tie-free at bf16), shuffled per buffer.
    xs = [jax.random.normal(kk, (tokens, e), jnp.float32).astype(jnp.bfloat16) for kk in keys]
    bias = (jnp.linspace(-0.05, 0.05, e, dtype=jnp.float32) if p.expert_bias else None)
    kw = p.router_kwargs()
    rows: list[Row] = []

    def add(op, path, phase, seconds, jax_us=None):
        rows.append(_row(name, op, path, phase, tokens, e, k, seconds, _bytes(op, phase, tokens, e, 2), peak,
                         None if jax_us is None else round(jax_us / (seconds * 1e6), 2)))

    want_p, want_m = jax.jit(lambda x: ref.fused_topk_with_score_function(x, expert_bias=bias, **kw))(xs[0])
    jax_us = {}
    for path in paths:
        if path == "kernel":
            rows.extend(_kernel_rows(name, p, xs, bias, repeats, peak, want_p, want_m))
            continue
        backend, _, transport = path.partition(":")
        call = dict(backend=backend, **({"transport": transport} if transport else {}))
        fwd = jax.jit(lambda x, call=call: gr.fused_topk_with_score_function(x, expert_bias=bias, **kw, **call))
        probs, rmap = fwd(xs[0])
        _check(f"{name} {path} routing_map", rmap, want_m, 0, 0)
        _check(f"{name} {path} probs", probs, want_p, 1e-2, 1e-2)

        def loss(x, call=call):
            pr, _ = gr.fused_topk_with_score_function(x, expert_bias=bias, **kw, **call)
            return jnp.sum(pr.astype(jnp.float32) * pr.astype(jnp.float32))

        step = jax.jit(jax.value_and_grad(loss))
        with _callback_timer() as cb_times:
            t_fwd = _median_wall(fwd, [(x,) for x in xs], repeats)
        t_step = _median_wall(step, [(x,) for x in xs], repeats)

        def body(i, x, loss=loss):
            return x - jnp.bfloat16(1e-3) * jax.grad(loss)(x)

        loop = jax.jit(lambda x, body=body: jax.lax.fori_loop(0, loop_steps, body, x))
        t_loop = _median_wall(loop, [(x,) for x in xs], max(3, repeats // 20)) / loop_steps
        if path == "jax":
            jax_us = {"fwd": t_fwd * 1e6, "fwd+bwd": t_step * 1e6, "loop-step": t_loop * 1e6}
        for phase, t in (("fwd", t_fwd), ("fwd+bwd", t_step), ("loop-step", t_loop)):
            add("topk", path, phase, t, jax_us.get(phase))
        if cb_times:  # zero-copy: the Python time inside the forward's callback
            rows[-3].host_us = round(statistics.median(cb_times) * 1e6, 2)
    return rows


def _kernel_rows(name, p, xs, bias, repeats, peak, want_p, want_m) -> list[Row]:
    """Kernel time (CUDA events) of topk fwd/bwd; for DeepSeek-V3 also aux-score
    fwd/bwd and aux-loss fwd/bwd. Each row also carries the host time per call."""
    from numba import cuda

    from .. import kernels as K
    from .._host import aux_loss_coeff
    from ..kernels._base import launch as L
    from ..kernels._base import plan as _plan

    e, k = p.num_experts, p.topk
    tokens = xs[0].shape[0]
    kw = p.router_kwargs()
    sf = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}[kw["score_function"]]
    words = [cuda.to_device(np.asarray(x).view(np.uint16)) for x in xs]
    d_bias = [] if bias is None else [cuda.to_device(np.asarray(bias))]
    probs = cuda.device_array((tokens, e), np.uint16)
    rmap = cuda.device_array((tokens, e), np.bool_)
    saved = cuda.device_array((tokens, e), np.float32)
    grad = cuda.device_array((tokens, e), np.uint16)
    groups = kw.get("num_groups") or -1
    gtopk = kw.get("group_topk") or -1

    def fwd_plan(x, *b, map_format=0):
        return K.topk_with_score_function_fwd_plan(x, bool(b), k, kw["use_pre_softmax"], groups, gtopk,
                                                   np.float32(kw["scaling_factor"]), sf, map_format)

    def bwd_plan(m, sv, g, map_format=0):
        return K.topk_with_score_function_bwd_plan(g, k, kw["use_pre_softmax"],
                                                   np.float32(kw["scaling_factor"]), sf, map_format)

    out = []

    def add(op, phase, times, nbytes):
        seconds, host = times
        out.append(_row(name, op, "kernel", phase, tokens, e, k, seconds, nbytes, peak, None, host))

    # Poison the outputs, run once, check against the reference, then time.
    probs.copy_to_device(np.full((tokens, e), 0x7FC1, np.uint16))

    def check():
        _check(f"{name} kernel routing_map", rmap.copy_to_host(), np.asarray(want_m), 0, 0)
        got = probs.copy_to_host().view(np.asarray(want_p).dtype)
        _check(f"{name} kernel probs", got, np.asarray(want_p), 1e-2, 1e-2)

    fwd_times = _kernel_times(fwd_plan, 1, [[w, *d_bias] for w in words], [probs, rmap, saved], repeats,
                              check)
    gp = [cuda.to_device(np.asarray(x).view(np.uint16)) for x in xs]  # any bf16 cotangents
    add("topk", "fwd", fwd_times, _bytes("topk", "fwd", tokens, e, 2))
    def grad_check(m_arr):
        """Poisons the gradient; the check: the backward's against the reference, from the state it read."""
        from .. import reference as ref

        grad.copy_to_device(np.full((tokens, e), 0x7FC1, np.uint16))

        def check():
            want = ref.topk_with_score_function_bwd(m_arr.copy_to_host(), saved.copy_to_host(), np.asarray(xs[0]),
                                                    k, kw["use_pre_softmax"], kw["scaling_factor"],
                                                    kw["score_function"])
            _check(f"{name} kernel grad", grad.copy_to_host().view(ml_dtypes.bfloat16), np.asarray(want), 1e-2,
                   1e-2)

        return check

    add("topk", "bwd", _kernel_times(bwd_plan, 3, [[rmap, saved, g] for g in gp], [grad], repeats,
                                     grad_check(rmap)),
        _bytes("topk", "bwd", tokens, e, 2))
    if name == "deepseek-v3":
        # TE's BITMAP_U8 routing map: the same kernels writing / reading 1/8 of the map bytes
        bitmap = cuda.device_array((tokens, -(-e // 8)), np.uint8)
        want_bits = np.packbits(np.asarray(want_m), axis=-1, bitorder="little")

        def check_bits():
            _check(f"{name} kernel bitmap", bitmap.copy_to_host(), want_bits, 0, 0)

        add("topk_bitmap", "fwd",
            _kernel_times(functools.partial(fwd_plan, map_format=1), 1, [[w, *d_bias] for w in words],
                          [probs, bitmap, saved], repeats, check_bits),
            _bytes("topk_bitmap", "fwd", tokens, e, 2))
        add("topk_bitmap", "bwd",
            _kernel_times(functools.partial(bwd_plan, map_format=1), 3, [[bitmap, saved, g] for g in gp],
                          [grad], repeats, grad_check(bitmap)), _bytes("topk_bitmap", "bwd", tokens, e, 2))
        scores = cuda.device_array((tokens, e), np.float32)
        sal_saved = cuda.device_array((tokens, e), np.float32)
        g32 = [cuda.to_device(np.asarray(x, np.float32)) for x in xs]

        def afwd_plan(x):
            return K.score_for_aux_loss_fwd_plan(x, k, 0)

        def abwd_plan(sv, g):
            return K.score_for_aux_loss_bwd_plan(sv, 0, L.BF16)

        add("aux_scores", "fwd", _kernel_times(afwd_plan, 1, [[w] for w in words], [scores, rmap, sal_saved],
                                               repeats), _bytes("aux_scores", "fwd", tokens, e, 2))
        add("aux_scores", "bwd", _kernel_times(abwd_plan, 2, [[sal_saved, g] for g in g32], [grad], repeats),
            _bytes("aux_scores", "bwd", tokens, e, 2))
        tpe = cuda.to_device(np.arange(e, dtype=np.int32))
        c = aux_loss_coeff(e, 1e-4, k, tokens)
        loss_plan = K.moe_aux_loss_fwd_plan(_plan.spec_of((tokens, e), L.F32), _plan.spec_for((e,), np.int32), c)
        loss_outs = [cuda.device_array((), np.float32), cuda.device_array((), np.float32)]
        loss_outs += [cuda.device_array(t.shape, t.dtype) for t in loss_plan.tmps]
        add("aux_loss", "fwd", _kernel_times(lambda pr, t: loss_plan, 0, [[pr, tpe] for pr in g32], loss_outs,
                                             repeats), _bytes("aux_loss", "fwd", tokens, e, 4))
        gl = cuda.to_device(np.ones((), np.float32))
        gprobs = cuda.device_array((tokens, e), np.float32)

        def lbwd_plan(cf, t, g):
            return K.moe_aux_loss_bwd_plan(t, g, tokens)

        add("aux_loss", "bwd", _kernel_times(lbwd_plan, 0, [[loss_outs[1], tpe, gl]], [gprobs], repeats),
            _bytes("aux_loss", "bwd", tokens, e, 4))
    return out


def _table_head() -> str:
    head = (f"{'preset':<17}{'op':<12}{'path':<17}{'phase':<10}{'T':>9}{'E':>6}{'K':>4}"
            f"{'us':>12}{'GB/s':>8}{'x floor':>10}{'jax/this':>10}{'host us':>9}")
    return head + "\n" + "-" * len(head)


def _table_lines(rows: list[Row]) -> str:
    def cell(v, fmt):
        return "" if v is None else format(v, fmt)

    return "\n".join(f"{r.preset:<17}{r.op:<12}{r.path:<17}{r.phase:<10}{r.tokens:>9}{r.experts:>6}"
                     f"{r.topk:>4}{r.us:>12.1f}{cell(r.gbps, '.0f'):>8}{cell(r.x_floor, '.2f'):>10}"
                     f"{cell(r.x_jax, '.2f'):>10}{cell(r.host_us, '.1f'):>9}" for r in rows)


def _table(rows: list[Row]) -> str:
    return "\n".join([_table_head()] + ([_table_lines(rows)] if rows else []))


def _plot(rows: list[Row], path: str, title: str = "gpurouter router timings") -> None:
    """Grouped bars per preset: one panel per phase, one bar per path (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topk = [r for r in rows if r.op == "topk"]
    presets = list(dict.fromkeys(r.preset for r in topk))
    phases = [p for p in ("fwd", "bwd", "fwd+bwd", "loop-step") if any(r.phase == p for r in topk)]
    paths = list(dict.fromkeys(r.path for r in topk))
    fig, axes = plt.subplots(len(phases), 1, figsize=(max(8, 1.4 * len(presets)), 2.8 * len(phases)),
                             squeeze=False)
    width = 0.8 / max(len(paths), 1)
    for ax, phase in zip(axes[:, 0], phases, strict=True):
        for j, pth in enumerate(paths):
            xs, ys = [], []
            for i, preset in enumerate(presets):
                hit = [r.us for r in topk if r.preset == preset and r.phase == phase and r.path == pth]
                if hit:
                    xs.append(i + j * width)
                    ys.append(hit[0])
            if xs:
                ax.bar(xs, ys, width, label=pth, color=f"C{j}")
        ax.set_yscale("log")
        ax.set_ylabel(f"{phase} (us, log)")
        ax.set_xticks([i + width * (len(paths) - 1) / 2 for i in range(len(presets))], presets, fontsize=8)
        ax.legend(fontsize=7)
    axes[0, 0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


PATHS = ("kernel", "jax", "numba:zero-copy", "numba:callback")


def _path_problem(path: str) -> str:
    """Why ``path`` cannot run on this machine ("" when it can)."""
    from .. import _backend

    if path == "jax":
        return ""
    if path == "numba:callback" and _backend.simulator_enabled():
        return ""  # the simulator: slow, but it runs
    if not _backend.numba_gpu_available():
        try:
            _backend.kernels()
        except ImportError:
            return "numba-cuda is not installed (pip install 'gpurouter[cuda13]')"
        return "numba-cuda sees no CUDA GPU"
    if path in ("kernel", "numba:zero-copy") and not _backend.zero_copy_available():
        return "JAX does not run on a CUDA GPU here (the zero-copy transport needs it)"
    return ""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpurouter bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", type=comma_list(tuple(PRESETS), "preset"), default=list(DEFAULT_PRESETS),
                        help=f"comma list of presets, from {', '.join(PRESETS)} (default: all of them)")
    parser.add_argument("--tokens", type=positive_int, default=65536,
                        help="tokens per batch, >= 1 (default 65536)")
    parser.add_argument("--paths", default="auto",
                        help="comma list of kernel, jax, numba:zero-copy, numba:callback "
                             "(default auto: every one this machine can run)")
    parser.add_argument("--repeats", type=positive_int, default=100,
                        help="timed runs per row, >= 1; medians are reported (default 100)")
    parser.add_argument("--loop-steps", type=positive_int, default=50,
                        help="router steps per jitted fori_loop of the loop-step rows (default 50)")
    parser.add_argument("--peak-tbs", type=positive_float, default=4.0,
                        help="the GPU's peak memory bandwidth in TB/s for the x-floor column "
                             "(default 4.0, an H200 measured device to device)")
    parser.add_argument("--json", help="write results as JSON here")
    parser.add_argument("--plot", help="write a PNG bar chart here (needs gpurouter[bench])")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--from-json", help="re-print (and --plot) the results of an earlier --json run")
    args = parser.parse_args(argv)
    if args.plot and matplotlib_missing():
        parser.error(PLOT_NEEDS)

    if args.from_json:
        try:
            with open(args.from_json) as f:
                saved = json.load(f)
            rows = [Row(**r) for r in saved["rows"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--from-json {args.from_json}: not a bench result ({e})")
        print("  ".join(f"{k}={v}" for k, v in saved["info"].items()))
        print(_table(rows))
        if args.plot:
            info = saved["info"]
            _plot(rows, args.plot, f"gpurouter on {info.get('gpu')} ({info.get('date')}, commit {info.get('commit')})")
        return 0

    if args.paths == "auto":
        paths = [p for p in PATHS if p != "numba:callback" and not _path_problem(p)]
    else:
        try:
            paths = comma_list(PATHS, "path")(args.paths)
        except argparse.ArgumentTypeError as e:
            parser.error(f"argument --paths: {e}")
        for p in paths:
            if _path_problem(p):
                parser.error(f"argument --paths: {p} cannot run here: {_path_problem(p)}")
    info = _gpu_info()
    print("  ".join(f"{k}={v}" for k, v in info.items()))
    rows: list[Row] = []
    peak = args.peak_tbs if _on_gpu() else None
    if peak is None:
        print("no GPU: the GB/s and x-floor columns (against a GPU's peak bandwidth) are left empty")
    print(_table_head(), flush=True)
    for name in progress(args.presets, len(args.presets), "bench", enabled=not args.no_progress):
        # each preset's rows printed and saved when done: a stopped run keeps what it measured
        done = bench_preset(name, args.tokens, paths, args.repeats, peak, args.loop_steps)
        rows.extend(done)
        if done:
            print(_table_lines(done), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"info": info, "args": vars(args), "rows": [dataclasses.asdict(r) for r in rows]},
                          f, indent=1)
    if args.plot:
        _plot(rows, args.plot, f"gpurouter on {info.get('gpu')} ({info.get('date')}, commit {info.get('commit')})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
