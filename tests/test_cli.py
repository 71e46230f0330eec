"""The two command lines: every bad argument is a one-line argparse error
(exit 2, no traceback), and a tiny run prints an aligned table."""

from __future__ import annotations

import statistics
import subprocess
import sys

import numpy as np
import pytest

from gpurouter import __main__ as cli
from gpurouter import _backend
from gpurouter.bench import router as bench


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,msg", [
    (["--tokens", "0"], "argument --tokens: 0 must be >= 1"),
    (["--tokens", "-4"], "argument --tokens: -4 must be >= 1"),
    (["--tokens", "x"], "argument --tokens: 'x' is not an integer"),
    (["--repeats", "0"], "argument --repeats: 0 must be >= 1"),
    (["--backend", "cuda"], "argument --backend: invalid choice: 'cuda'"),
    (["bench", "--repeats", "0"], "argument --repeats: 0 must be >= 1"),
    (["bench", "--loop-steps", "0"], "argument --loop-steps: 0 must be >= 1"),
    (["bench", "--peak-tbs", "0"], "argument --peak-tbs: 0 must be a finite number > 0"),
    (["bench", "--peak-tbs", "inf"], "argument --peak-tbs: inf must be a finite number > 0"),
    (["bench", "--tokens", "-4"], "argument --tokens: -4 must be >= 1"),
    (["bench", "--presets", "bogus"], "argument --presets: unknown preset 'bogus'; choose from deepseek-v3,"),
    (["bench", "--presets", ""], "argument --presets: empty preset in ''; choose from deepseek-v3,"),
    (["bench", "--presets", "qwen3,"], "argument --presets: empty preset in 'qwen3,'"),
    (["bench", "--paths", "bogus"], "argument --paths: unknown path 'bogus'; choose from kernel, jax, "
                                    "numba:zero-copy, numba:callback"),
    (["bench", "--from-json", "/nonexistent.json"], "--from-json /nonexistent.json: not a bench result"),
    (["steps", "--configs", "bogus"], "argument --configs: unknown config 'bogus'; choose from deepseek-v3@256,"),
    (["steps", "--steps", "0"], "argument --steps: 0 must be >= 1"),
    (["steps", "--transports", "bogus"], "argument --transports: unknown transport 'bogus'; choose from ffi,"),
    (["moe-bench", "--shapes", "bogus"], "unknown shape 'bogus'; choose from qwen3-like, deepseek-v3-like"),
    (["moe-bench", "--scale", "2"], "--scale must be in (0, 1], got 2.0"),
    (["moe-bench", "--repeats", "0"], "argument --repeats: 0 must be >= 1"),
    (["moe-bench", "--grouped-matmul", "cublas"], "--grouped-matmul: unknown 'cublas'"),
])
def test_bad_arguments_are_one_line_errors(capsys, argv, msg):
    assert msg in _error(capsys, argv)


def test_paths_that_cannot_run_here_say_why(capsys):
    if _backend.numba_gpu_available():
        pytest.skip("a GPU is here: every path can run")
    for path in ("kernel", "numba:zero-copy"):
        line = _error(capsys, ["bench", "--paths", path])
        assert f"argument --paths: {path} cannot run here: " in line
        assert "numba-cuda" in line or "JAX does not run on a CUDA GPU" in line


def test_demo_numba_without_a_gpu_or_simulator(capsys, monkeypatch):
    monkeypatch.setattr(_backend, "simulator_enabled", lambda: False)
    monkeypatch.setattr(_backend, "numba_gpu_available", lambda: False)
    line = _error(capsys, ["--backend", "numba"])
    assert line.startswith("python -m gpurouter: error: --backend numba: numba-cuda")


def test_plot_without_matplotlib_says_how_to_install(capsys, monkeypatch):
    monkeypatch.setattr(bench, "matplotlib_missing", lambda: True)
    line = _error(capsys, ["bench", "--paths", "jax", "--plot", "x.png"])
    assert line.endswith("--plot needs matplotlib: pip install 'gpurouter[bench]'")


def test_help_names_bench_and_every_option(capsys):
    for argv, options in ((["--help"], ["--tokens", "--backend", "--dtype", "--repeats", "--no-progress"]),
                          (["bench", "--help"], ["--presets", "--tokens", "--paths", "--repeats",
                                                 "--loop-steps", "--peak-tbs", "--no-progress"])):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        if argv == ["--help"]:
            assert "python -m gpurouter bench" in out.split("\n\n")[0]  # the usage lines
        lines = out.splitlines()
        for opt in options:  # each option's line carries help text besides its METAVAR
            i = next(i for i, ln in enumerate(lines) if ln.strip().startswith(opt))
            words = [w for w in lines[i].split()[1:] if not w.strip("{},").isupper()]
            assert words or lines[i + 1].startswith(" " * 10), f"{opt} has no help text"
        if "bench" in argv:
            assert "deepseek-v3" in out and "nemotron-3-super" in out and "default: all" in out


def test_bench_on_the_cpu_leaves_the_bandwidth_columns_empty(capsys):
    if _backend.numba_gpu_available():
        pytest.skip("a GPU is here")
    assert cli.main(["bench", "--presets", "mixtral", "--tokens", "8", "--repeats", "1",
                     "--loop-steps", "1", "--paths", "jax", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "GB/s and x-floor columns" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("mixtral")]
    assert len(rows) == 3
    head = next(ln for ln in out.splitlines() if ln.startswith("preset"))
    for r in rows:
        assert len(r) <= len(head)
        gbps_cell = r[head.index("us") + 2: head.index("x floor") + 7]
        assert gbps_cell.strip() == "", r


def test_demo_runs_as_a_newcomer_types_it():
    """`python -m gpurouter` in a fresh process: exit 0, no warning, an aligned table."""
    r = subprocess.run([sys.executable, "-m", "gpurouter", "--tokens", "4", "--repeats", "1",
                        "--backend", "jax"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Warning" not in r.stderr and "warn" not in r.stderr.lower(), r.stderr
    assert "deepseek-v3 (jax)" in r.stderr and "('" not in r.stderr  # the progress label, not a tuple
    assert "\r" not in r.stderr  # stderr is a pipe here: plain lines, no carriage returns
    lines = r.stdout.splitlines()
    from gpurouter.presets import PRESETS

    for name in PRESETS:  # "every model preset": all of them, each a row
        assert any(ln.startswith(name + " ") for ln in lines), name
    head = next(ln for ln in lines if ln.startswith("preset"))
    rows = [ln for ln in lines if ln.split() and ln.split()[0] in ("deepseek-v3", "mixtral", "qwen3")]
    assert rows
    for row in rows:  # every column where the header puts it (E/K of Mixtral is "8/2")
        assert row[head.index("E/K"):].split()[0] in ("256/8", "8/2", "128/8")
        assert "(is ref)" in row


@pytest.mark.cuda
@pytest.mark.skipif(not _backend.numba_usable(), reason="the MoE bench times backend='numba'")
@pytest.mark.slow  # its numba rows take ~100 s on the CUDA simulator: the GPU suite runs it;
# make test keeps test_moe_bench_tiny_without_numba_runs_the_jax_rows for the CLI
def test_moe_bench_tiny_runs_and_writes_json(capsys, tmp_path):
    """``python -m gpurouter moe-bench --tiny``: both blocks and every stage
    timed, on the grouped GEMM asked for (``ragged_dot``, the default, is
    the same code with another function; one run keeps CI short)."""
    gmm = "batched"
    import json

    out = tmp_path / "moe.json"
    assert cli.main(["moe-bench", "--tiny", "--repeats", "1", "--no-progress", "--grouped-matmul", gmm,
                     "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["grouped_matmul"] == gmm
    for key in ("block numba ms", "block jax ms", "router ms", "dispatch+combine ms", "dispatch+combine numba ms",
                "grouped GEMMs ms", "grouped GEMM TFLOP/s", "dense GEMMs ms", "dense GEMMs fwd ms",
                "dense GEMM TFLOP/s", "grouped / dense", "grouped / dense fwd"):
        assert row[key] > 0, key
    # the ceiling beside the grouped rows: the ratio is the two times'
    assert row["grouped / dense"] == pytest.approx(row["dense GEMMs ms"] / row["grouped GEMMs ms"])
    assert "block jax / numba=" in capsys.readouterr().out


def test_bench_header_names_the_numba_versions():
    """The results' header says which numba ran them (it said "unavailable: No
    module named 'gpurouter.bench.kernels'" after the bench became a package)."""
    import numba

    info = bench._gpu_info()
    assert info["numba"] == numba.__version__ and info["numba_cuda"] and info["numpy"] == np.__version__


def test_bench_commit_is_this_checkouts_or_unknown(tmp_path):
    """The commit a bench records: this checkout's HEAD, or "unknown" for a
    copy of the package inside another git work tree (a lent GPU's copy of
    the tree sits in one; its HEAD is not this code's)."""
    import os
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(bench.__file__))))
    top = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode == 0 and os.path.realpath(top.stdout.strip()) == os.path.realpath(root):
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        assert bench._git_commit() == head.stdout.strip()
    else:  # a copy of the tree with no .git of its own (as on a lent GPU)
        assert bench._git_commit() == "unknown"
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    shutil.copytree(os.path.join(root, "gpurouter"), tmp_path / "copy" / "gpurouter")
    out = subprocess.run([sys.executable, "-c", "from gpurouter.bench import router; print(router._git_commit())"],
                         cwd=tmp_path / "copy", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "unknown"


@pytest.mark.cuda
def test_sanitize_workload_checks_the_z_loss_and_moe_kernels():
    """tools/ci/sanitize.py (compute-sanitizer's workload): its z-loss and MoE
    cases pass against their float64 oracles, and a wrong result fails them."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "tools" / "ci" / "sanitize.py"
    spec = importlib.util.spec_from_file_location("sanitize_workload", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cases = list(mod._z_loss_and_moe(np.random.default_rng(0), np.float32))
    assert len(cases) == 12 and all(ok for _, ok in cases), [n for n, ok in cases if not ok]
    assert not mod._close(np.ones(3), np.ones(3) * 1.1)


def test_steps_loops_grow_until_they_take_the_minimum_time(monkeypatch):
    """bench_steps: N grows from --steps until an N-step loop takes
    min_loop_s (so host jitter stays small against the 2N - N difference)."""
    import jax
    import jax.numpy as jnp

    from gpurouter.bench import steps as bench_steps

    x = jnp.ones((1 << 16,), jnp.float32)

    def make(n):
        return lambda c: jax.lax.fori_loop(0, n, lambda i, c: jnp.sin(c) + 1.0, c)

    timed = []
    real = bench_steps._time_s
    monkeypatch.setattr(bench_steps, "_time_s", lambda f, x: timed.append(real(f, x)) or timed[-1])
    n, loops = bench_steps._loops(make, x, 2, 0.01)
    assert n > 2 and sorted(loops) == [n, 2 * n]
    # it stopped at the first timed run of at least the minimum (not re-timed here: a second
    # run on a loaded CPU may be faster than the one that decided)
    assert timed[-1] >= 0.01 and all(t < 0.01 for t in timed[:-1])
    assert bench_steps._loops(make, x, 3, 0.0)[0] == 3  # long enough at once: N stays


def test_steps_rows_time_a_configs_paths_in_turns(monkeypatch):
    """One row per config with every path's marginal time and loop length."""
    from gpurouter.bench import steps as bench_steps

    order, diffs = [], []
    real = bench_steps._diff_us

    def spy(n, loops, x):
        order.append(n)
        diffs.append(real(n, loops, x))
        return diffs[-1]

    monkeypatch.setattr(bench_steps, "_diff_us", spy)
    (row,) = bench_steps.step_rows(["qwen3@256"], ["jax", "auto"], 2, 3, False, 0.002)
    assert set(row["loop steps"]) == {"jax", "auto"}
    assert len(order) == 6 and order[0::2] == [row["loop steps"]["jax"]] * 3  # jax, auto, jax, auto, ...
    # a marginal time is a difference of two timings: on a loaded CPU it may even be negative, so the
    # test checks that each path's figure is the median of its own turns, not its sign
    assert row["jax"] == statistics.median(diffs[0::2]) and row["auto"] == statistics.median(diffs[1::2])
    assert "ratio" not in row  # no numba:ffi path asked


def test_progress_redraws_on_a_terminal_only(monkeypatch, capsys):
    from gpurouter import _progress

    list(_progress.progress(range(3), 3, "work"))
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines()[-1].startswith("work 3/3") and len(err.splitlines()) == 4

    class Tty:
        text = ""

        def isatty(self):
            return True

        def write(self, s):
            Tty.text += s

        def flush(self):
            pass

    monkeypatch.setattr(_progress.sys, "stderr", Tty())
    list(_progress.progress(range(3), 3, "work"))
    assert Tty.text.count("\r") == 4 and Tty.text.endswith("\n")


def test_steps_help_says_it_needs_a_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["steps", "--help"])
    assert e.value.code == 0
    assert "Needs JAX on a CUDA GPU" in capsys.readouterr().out


def test_moe_bench_tiny_without_numba_runs_the_jax_rows(capsys, tmp_path, monkeypatch):
    """After `make demo` on a machine without a GPU (no numba-cuda): --tiny still runs, jax rows alone."""
    import json

    monkeypatch.setattr(_backend, "numba_usable", lambda: False)
    out = tmp_path / "moe.json"
    assert cli.main(["moe-bench", "--tiny", "--repeats", "1", "--no-progress", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["block jax ms"] > 0 and "block numba ms" not in row
    assert "numba rows skipped" in capsys.readouterr().out


def test_moe_bench_tiny_slots_times_its_stage_from_the_tokens(tmp_path, monkeypatch):
    """``--grouped-matmul slots`` (jax rows, no numba): the block and its FFN
    stage, which takes the tokens and their experts (it has no rows), run."""
    import json

    monkeypatch.setattr(_backend, "numba_usable", lambda: False)
    out = tmp_path / "moe.json"
    assert cli.main(["moe-bench", "--tiny", "--repeats", "1", "--no-progress", "--grouped-matmul", "slots",
                     "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["grouped_matmul"] == "slots"
    assert row["block jax ms"] > 0 and row["grouped GEMMs ms"] > 0 and row["grouped GEMMs fwd ms"] > 0


def test_moe_bench_keeps_the_rows_done_when_a_run_stops(capsys, tmp_path, monkeypatch):
    """Each row is printed and written to --json when it is done: a run stopped
    in its second row (a timeout, ^C) keeps the first."""
    import json

    from gpurouter.bench import moe as bench_moe

    calls = []

    def one_row(name, shape, repeats, gmm, numba, numba_repeats):
        calls.append(gmm)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return {"shape": name, "grouped_matmul": gmm, "block jax ms": 1.5}

    monkeypatch.setattr(bench_moe, "run_shape", one_row)
    monkeypatch.setattr(_backend, "numba_usable", lambda: False)
    out = tmp_path / "moe.json"
    with pytest.raises(KeyboardInterrupt):
        cli.main(["moe-bench", "--tiny", "--repeats", "1", "--no-progress", "--grouped-matmul", "batched,tiled",
                  "--json", str(out)])
    assert calls == ["batched", "tiled"]
    assert json.loads(out.read_text()) == [{"shape": "tiny", "grouped_matmul": "batched", "block jax ms": 1.5}]
    assert "shape=tiny, grouped_matmul=batched, block jax ms=1.5" in capsys.readouterr().out


def test_bench_keeps_the_rows_done_when_a_run_stops(capsys, tmp_path, monkeypatch):
    """``bench`` prints each preset's rows, and rewrites --json, when that preset
    is done: a run stopped in its second preset (a timeout, ^C) keeps the first."""
    import json

    def one_preset(name, tokens, paths, repeats, peak, loop_steps):
        if name == "qwen3":
            raise KeyboardInterrupt
        return [bench.Row(name, "topk", "jax", "fwd", tokens, 256, 8, 12.5, 1000)]

    monkeypatch.setattr(bench, "bench_preset", one_preset)
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        cli.main(["bench", "--paths", "jax", "--presets", "deepseek-v3,qwen3", "--tokens", "64", "--no-progress",
                  "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["preset"], r["us"]) for r in rows] == [("deepseek-v3", 12.5)]
    printed = capsys.readouterr().out
    assert "preset" in printed and "deepseek-v3" in printed and "12.5" in printed
