"""Every script under tools/ answers ``--help`` on a CPU (the CUDA simulator).

The probes and the CI scripts import the bench's timing API and kernel modules;
a move or a rename there must not break them silently. This imports each script
and runs its ``main`` with ``--help``: argparse prints the usage and exits 0
before any GPU work."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import pathlib
import sys

import pytest

pytestmark = pytest.mark.cuda  # the scripts import numba.cuda (the simulator in CI)

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"
SCRIPTS = sorted([*TOOLS.glob("probes/*.py"), *TOOLS.glob("ci/*.py")])


def test_tools_are_split_into_ci_and_probes():
    assert sorted(p.name for p in TOOLS.iterdir() if not p.name.startswith(".")) == ["ci", "probes"]
    assert SCRIPTS, "no scripts found under tools/"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_answers_help(path, monkeypatch):
    spec = importlib.util.spec_from_file_location(f"_tool_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    monkeypatch.syspath_prepend(str(path.parent))  # as when run as a script: its folder first
    spec.loader.exec_module(module)
    assert hasattr(module, "main"), f"{path.name} has no main()"
    takes_argv = bool(inspect.signature(module.main).parameters)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        module.main(["--help"]) if takes_argv else module.main()
    assert exit_info.value.code in (0, None), f"{path.name} --help exited {exit_info.value.code}"
    assert "usage" in out.getvalue().lower(), f"{path.name} --help printed no usage:\n{out.getvalue()[:500]}"
