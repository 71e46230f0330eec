"""Source rules of the kernel layer (HOUSE_STYLE): checked by grep, no GPU needed."""

from __future__ import annotations

import pathlib
import re

import pytest

pytestmark = pytest.mark.cuda  # kernel-layer tests (these need no GPU, only the sources)

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "gpurouter" / "kernels"
OPS = ("topk.py", "token_rows.py", "aux_scores.py", "aux_loss.py", "z_loss.py")


def _src(name):
    return (KERNELS / name).read_text()


def test_no_jax_import():
    for path in KERNELS.glob("*.py"):
        assert not re.search(r"^\s*(import jax|from jax)", path.read_text(), re.M), path.name


def test_ops_never_move_arrays():
    for name in OPS:
        assert "to_device" not in _src(name), f"{name}: host<->device copies belong in _launch.py"


def test_no_warp_intrinsics():
    # the simulator has none of them; the kernels use shared memory + syncthreads only
    for name in OPS:
        assert not re.search(r"shfl_|syncwarp|ballot_sync|all_sync|any_sync|activemask",
                             _src(name)), name


def test_compat_imported_first():
    for name in OPS + ("_launch.py",):
        src = _src(name)
        assert src.index("from . import _compat") < src.index("from numba import cuda"), name
