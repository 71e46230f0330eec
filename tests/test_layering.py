"""Source rules of the package, read as plain text (no import, no GPU, no
``cuda`` marker: they run in every CI).

- The import graph of every ``gpurouter/**/*.py`` (relative and absolute
  imports, function-level ones included) has no cycle.
- No file is over ``MAX_LINES`` lines (``LONG_FILES`` lists the exceptions,
  each with its reason).
- Every kernel module has its test: a module of ``gpurouter/kernels`` that
  defines a ``@cuda.jit`` kernel (not a device function) is tested by
  ``tests/kernels/test_<module>.py``.
- The kernel layer (HOUSE_STYLE): no jax, no host<->device copies outside
  ``_base/launch.py``, no warp intrinsics (``WARP_INTRINSICS`` lists the
  exceptions: GPU-only branches with a shared-memory twin on the simulator,
  each with the GPU test that runs them), ``_compat`` imported before
  numba.cuda.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gpurouter"
KERNELS = PACKAGE / "kernels"
KERNEL_TESTS = ROOT / "tests" / "kernels"

MAX_LINES = 400
#: files allowed over MAX_LINES, with the reason
LONG_FILES = {
    "gpurouter/bench/router.py": "the benchmark CLI's tables and plots; not a kernel or op module",
}


def _sources():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the gpurouter modules it imports (anywhere in the file).

    ``from X import y`` names module ``X.y`` when that is a module, else
    ``X``; a module outside package ``X`` importing from it also runs
    ``X/__init__.py`` first, so that is an edge too."""
    paths = {_module_name(p): p for p in _sources()}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        edges = set()

        def add(target: str, importer: str = name, edges: set = edges):
            if target not in modules or target == importer:
                return
            edges.add(target)
            # a dotted target from outside its package runs the package's __init__ first
            parent = target.rpartition(".")[0]
            while parent and not (importer == parent or importer.startswith(parent + ".")):
                if parent in modules:
                    edges.add(parent)
                parent = parent.rpartition(".")[0]

        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    add(sub if sub in modules else source)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_relative_absolute_and_function_level_imports():
    graph = _import_graph()
    assert "gpurouter.kernels._base.launch" in graph["gpurouter.kernels._base.plan"]  # from ._launch import ...
    assert "gpurouter._checks" in graph["gpurouter.kernels.topk.plans"]  # from .._checks import ...
    assert "gpurouter.kernels._base.pointer" in graph["gpurouter._transport.buffer"]  # in a function
    assert {"gpurouter.kernels", "gpurouter.kernels._base.launch"} <= graph["gpurouter.bench.router"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles (each a set of modules that import each other): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_no_file_over_max_lines():
    long = {}
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and rel not in LONG_FILES:
            long[rel] = n
    assert not long, f"files over {MAX_LINES} lines (split them by job): {long}"


def _defines_a_kernel(src: str) -> bool:
    return re.search(r"^\s*@cuda\.jit\s*$", src, re.M) is not None


def _kernel_modules():
    return sorted(p for p in KERNELS.rglob("*.py") if "__pycache__" not in p.parts)


def _kernel_key(path) -> str:
    return path.relative_to(KERNELS).as_posix()


def test_every_kernel_module_has_its_test():
    # tests/kernels mirrors the folders: kernels/topk/warp/fwd.py -> tests/kernels/topk/warp/test_fwd.py
    missing = [_kernel_key(p) for p in _kernel_modules()
               if _defines_a_kernel(p.read_text())
               and not (KERNEL_TESTS / p.relative_to(KERNELS).parent / f"test_{p.stem}.py").exists()]
    assert not missing, f"kernel modules without their mirrored tests/kernels/<dir>/test_<module>.py: {missing}"


def test_kernel_layer_never_imports_jax():
    for path in _kernel_modules():
        assert not re.search(r"^\s*(import jax|from jax)", path.read_text(), re.M), _kernel_key(path)


def test_kernel_modules_never_move_arrays():
    for path in _kernel_modules():
        if _kernel_key(path) not in ("_base/launch.py", "_base/plan.py"):
            assert "to_device" not in path.read_text(), \
                f"{_kernel_key(path)}: host<->device copies belong in _base/launch.py"


#: kernel modules allowed warp intrinsics on the GPU only (their simulator
#: twin in shared memory), with the test (file::name) that runs them on a GPU
WARP_INTRINSICS = {
    "losses/z_io.py": "tests/kernels/losses/test_z_loss_vec.py::test_lane_reducers_fixed_tree",
    "moe/rows.py": "tests/kernels/moe/test_grouped_bias.py::test_lane_tree_sums_fixed_order",
    "topk/warp/lanes.py": "tests/kernels/topk/warp/test_fwd.py::test_warp_sorts_and_scans",
}


def test_no_warp_intrinsics():
    # the simulator has none of them; the kernels use shared memory + syncthreads,
    # except the WARP_INTRINSICS modules behind ``if simulator_enabled():``
    pattern = r"shfl_|syncwarp|ballot_sync|all_sync|any_sync|activemask"
    for path in _kernel_modules():
        src, key = path.read_text(), _kernel_key(path)
        if key in WARP_INTRINSICS:
            test_file, test_name = WARP_INTRINSICS[key].split("::")
            assert f"def {test_name}(" in (ROOT / test_file).read_text(), key
            assert "if simulator_enabled():" in src, key
            continue
        assert not re.search(pattern, src), key


def test_compat_imported_first():
    # (every kernels module loads after kernels/__init__.py, which imports _compat
    # first; the modules that compile kernels or device functions say so too)
    for path in _kernel_modules():
        src = path.read_text()
        if re.search(r"^\s*@cuda\.jit", src, re.M):
            first = re.search(r"^from \.+(_base)? import compat", src, re.M)
            assert first, _kernel_key(path)
            assert first.start() < src.index("from numba import cuda"), _kernel_key(path)
