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
