"""gpurouter.testing is optional: ``import gpurouter`` never imports hypothesis, and
``import gpurouter.testing`` without it names the extra to install."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_import_gpurouter_imports_no_hypothesis():
    r = _run("import sys, gpurouter; print('hypothesis' in sys.modules)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"


def test_testing_without_hypothesis_names_the_extra():
    r = _run("import sys\nsys.modules['hypothesis'] = None\n"
             "try:\n    import gpurouter.testing\nexcept ImportError as e:\n    print('IMPORTERROR', e)\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "IMPORTERROR" in r.stdout and "pip install 'gpurouter[testing]'" in r.stdout


def test_public_names():
    import gpurouter.testing as gt

    for name in ("check_topk", "check_aux_scores", "check_aux_loss", "check_router_z_loss", "check_token_dispatch",
                 "check_token_combine", "CheckFailure",
                 "CheckReport", "strategies", "oracle", "tolerances", "profiles"):
        assert hasattr(gt, name), name
    assert issubclass(gt.CheckFailure, AssertionError)


def test_cli_bad_target_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "gpurouter", "check", "no_such_module_xyz:f", "--op", "topk"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "cannot import module" in r.stderr


def test_cli_checks_the_reference_and_prints_the_table():
    r = subprocess.run([sys.executable, "-m", "gpurouter", "check", "gpurouter.reference:router_z_loss",
                        "--op", "z-loss", "--examples", "2", "--seed", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "value and dtype" in r.stdout and "total" in r.stdout and "passed" in r.stdout
    # the progress on stderr (not a terminal here: one line a property start and every 10th example)
    assert "check_router_z_loss: property 1/" in r.stderr and "example 0/2" in r.stderr


def test_listening_hears_every_property_and_example():
    from gpurouter import reference
    from gpurouter.testing import checks

    events = []
    with checks.listening(lambda *e: events.append(e)):
        report = checks.check_router_z_loss(reference.router_z_loss, max_examples=3, seed=0)
    ran = [p for p in report.properties if p.status == "passed"]
    starts = [e for e in events if e[4] == 0]
    assert [e[3] for e in starts] == [p.name for p in report.properties]
    assert {e[2] for e in events} == {len(report.properties)}
    for p in ran:  # each example heard, counting up to what the report says ran
        assert [e[4] for e in events if e[3] == p.name and e[4]] == list(range(1, p.examples + 1))
    assert not checks._report._LISTENERS  # the block took its listener away


def test_cli_token_combine_needs_its_dispatch():
    r = subprocess.run([sys.executable, "-m", "gpurouter", "check", "gpurouter.reference.permute:token_combine",
                        "--op", "token-combine"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--dispatch" in r.stderr, r.stderr[-2000:]


def test_cli_checks_the_reference_token_combine():
    r = subprocess.run([sys.executable, "-m", "gpurouter", "check", "gpurouter.reference.permute:token_combine",
                        "--op", "token-combine", "--dispatch", "gpurouter.reference.permute:token_dispatch",
                        "--examples", "2", "--seed", "0", "--no-grads"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "check_token_combine" in r.stdout and "passed" in r.stdout


def test_progress_line_redraws_one_line_on_a_terminal():
    import io

    from gpurouter.testing._cli import _progress_line

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    draw = _progress_line(2, out)
    for event in (("op", 0, 2, "a", 0), ("op", 0, 2, "a", 1), ("op", 1, 2, "b", 0), ("op", 1, 2, "b", 2)):
        draw(*event)
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
    assert "property 2/2 'b', example 2/2" in text


def test_check_aux_scores_takes_te_s_router_op_as_it_is():
    """A function with a ``compute_aux_scores`` keyword (TE's op, gpurouter's)
    is called as the aux scores; before, its third positional argument
    (``use_pre_softmax``) got the score function, a TypeError at once."""
    import gpurouter
    from gpurouter.testing import checks

    report = checks.check_aux_scores(gpurouter.fused_topk_with_score_function, max_examples=2, seed=0,
                                     dtypes=("float32",), properties=("values (tie-free)",))
    assert report.passed and report.examples == 2
    r = subprocess.run([sys.executable, "-m", "gpurouter", "check", "gpurouter:fused_topk_with_score_function",
                        "--op", "aux-scores", "--examples", "1", "--seed", "0", "--dtypes", "float32",
                        "--no-grads"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_checks_are_derandomised_without_a_profile():
    """No hypothesis profile loaded (hypothesis's own default) and no seed: the checks
    draw the same examples on every run (as the ci profile); a seed gives seeded
    random draws; a loaded profile keeps its own randomness."""
    from hypothesis import settings

    from gpurouter.testing.checks._report import _settings

    loaded = settings.default
    try:
        settings.load_profile("default")
        assert _settings(5, None).derandomize is True
        assert _settings(5, 3).derandomize is False
        settings.register_profile("gpurouter-test-random", settings(derandomize=False))
        settings.load_profile("gpurouter-test-random")
        assert _settings(5, None).derandomize is False
    finally:
        settings.register_profile("gpurouter-test-restore", loaded)
        settings.load_profile("gpurouter-test-restore")


def test_check_topk_without_groups_and_one_property_by_name():
    """``groups=False``: a router that knows nothing of groups passes (no grouped config
    is drawn, the group properties are skipped); ``properties`` takes one name as a str."""
    import jax
    import jax.numpy as jnp

    from gpurouter.testing import check_topk

    def softmax_topk(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function,
                     expert_bias):
        assert not (group_topk is not None and group_topk > 0), "no groups here"
        x = logits.astype(jnp.float32)
        x = jnp.where(jnp.isnan(x), -jnp.inf, x)
        _, idx = jax.lax.top_k(x, topk)
        rmap = jnp.any(jax.nn.one_hot(idx, x.shape[-1], dtype=bool), axis=-2)
        xf = logits.astype(jnp.float32)
        w = jax.nn.softmax(xf if use_pre_softmax else jnp.where(rmap, xf, -jnp.inf), axis=-1)
        return jnp.where(rmap, scaling_factor * w, 0.0).astype(logits.dtype), rmap

    report = check_topk(softmax_topk, score_functions=("softmax",), dtypes=("float32",), groups=False,
                        max_examples=5, grads=False, properties=["values (tie-free)", "group-limited selection"])
    assert [(p.name, p.status) for p in report.properties] == [
        ("values (tie-free)", "passed"), ("group-limited selection", "skipped")]
    one = check_topk(softmax_topk, score_functions=("softmax",), dtypes=("float32",), groups=False,
                     max_examples=3, grads=False, properties="values (tie-free)")
    assert [p.name for p in one.properties] == ["values (tie-free)"]


def test_cli_options_that_do_not_apply_are_usage_errors():
    """``--score-functions`` off topk / aux-scores, ``--no-groups`` off topk and an unknown
    ``--properties`` name: exit 2 with a message, not a silent run or a traceback."""
    base = [sys.executable, "-m", "gpurouter", "check"]
    for args, says in ((["gpurouter.reference:router_z_loss", "--op", "z-loss", "--score-functions", "softmax"],
                        "--score-functions goes with --op topk or aux-scores"),
                       (["gpurouter.reference:router_z_loss", "--op", "z-loss", "--no-groups"],
                        "--no-groups goes with --op topk"),
                       (["gpurouter.reference:router_z_loss", "--op", "z-loss", "--properties", "nope",
                         "--examples", "1"], "unknown properties ['nope']")):
        r = subprocess.run(base + args, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and says in r.stderr, r.stderr[-2000:]
