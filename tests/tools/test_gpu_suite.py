"""``tools/ci/gpu_suite.sh`` places every test file in a named group.

Files in no group run together in one extra group. At 70388aa that group had
grown to 21 files and reached the suite's limit on the GPU, so a new test file
belongs in a group of its own choosing. This reads the groups from the script
with bash and checks: every test file is in a group, every path exists, and a
file is in two groups only when each selects a part of it with ``-k``."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "ci" / "gpu_suite.sh"


def suite_groups() -> list[list[str]]:
    """The script's ``groups`` array, one list of words a group (k expanded)."""
    text = SCRIPT.read_text()
    start = text.index("\ngroups=(")
    block = text[start:text.index("\n)\n", start) + 3]
    show = 'k=tests/kernels\n' + block + 'for g in "${groups[@]}"; do echo "$g"; done\n'
    out = subprocess.run(["bash", "-c", show], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return [line.split() for line in out.splitlines() if line.strip()]


@pytest.mark.skipif(shutil.which("bash") is None, reason="the script is bash")
def test_every_test_file_is_in_a_named_group():
    groups = suite_groups()
    assert len(groups) >= 10
    seen: dict[str, list[bool]] = {}
    for words in groups:
        split = "-k" in words
        paths = [w for w in words if w.startswith("tests")]
        for path in paths:
            assert (ROOT / path).exists(), f"gpu_suite.sh names {path}, which does not exist"
            seen.setdefault(path, []).append(split)
    for path, splits in seen.items():
        assert len(splits) == 1 or all(splits), f"{path} is in {len(splits)} groups without -k"
    listed = set(seen)
    missing = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                     if str(f.relative_to(ROOT)) not in listed
                     and not any(str(f.relative_to(ROOT)).startswith(d + "/") for d in listed))
    assert not missing, f"test files in no group of tools/ci/gpu_suite.sh: {missing}"
