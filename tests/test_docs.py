"""The repository stands alone: nothing points outside it, every file it names
or links is in it, and the README's example runs as pasted."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "lab" / "results"


def _text_files():
    yield ROOT / "README.md"
    yield ROOT / "CHANGELOG.md"
    yield ROOT / "Makefile"
    yield ROOT / "pyproject.toml"
    for folder in ("docs", "gpurouter", "tests", "tools", ".ci", "lab"):
        for path in sorted((ROOT / folder).rglob("*")):
            text_like = path.suffix in (".md", ".py", ".txt", ".toml", "")
            raw_run = RESULTS in path.parents  # device logs and JSON, as the runs wrote them
            if path.is_file() and text_like and not raw_run and "__pycache__" not in path.parts:
                yield path


#: a file name ending in .md, as prose cites one (``docs/moe.md``, ``CHANGELOG.md``)
MD_NAME = re.compile(r"(?<![\w./-])([\w.-][\w./-]*\.md)\b")
#: files that docs/adding_an_op.md tells the reader to create for its example op ``foo``
RECIPE_EXAMPLES = {"docs/ops/foo.md"}
#: a markdown link's target: ``[text](target)``
LINK = re.compile(r"\]\(([^()\s]+)\)")


def test_nothing_points_outside_the_repository():
    """A clone has no sibling folders (the shared spec folder): the contract is docs/contract.md."""
    outside = re.compile(r"\.\./shared|shared/spec|shared/gpu|\.library/")
    here = pathlib.Path(__file__).resolve()
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _text_files() if p.resolve() != here
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside.search(line)]
    assert not hits, f"paths outside the repository: {hits}"


def test_contract_cited_where_it_lives():
    assert (ROOT / "docs" / "contract.md").is_file()
    old_name = "CONTRACT" + " section"  # how the outside file was cited (split: not a hit here)
    stale = [f"{p.relative_to(ROOT)}:{i}" for p in _text_files()
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if old_name in line]
    assert not stale, f"the outside contract cited at: {stale}"


def test_readme_example_runs_as_pasted():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README has a python example"
    r = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]


def _lines(path: pathlib.Path):
    return enumerate(path.read_text(errors="replace").splitlines(), 1)


def test_every_md_file_named_is_in_the_repository():
    """A ``name.md`` in a page, a docstring, a comment or the project files is a
    file of this repository: by its path from the citing file, or as the end of
    a tracked file's path (``docs/moe.md``, ``kernels/README.md``, ``moe.md``)."""
    tracked = ["/" + p.relative_to(ROOT).as_posix() for p in _text_files() if p.suffix == ".md"]
    here = pathlib.Path(__file__).resolve()
    missing = []
    for path in _text_files():
        if path.resolve() == here:
            continue
        for i, line in _lines(path):
            for name in MD_NAME.findall(line):
                if "://" in line and f"/{name}" in line.split("://", 1)[1]:
                    continue  # part of a URL
                found = ((path.parent / name).is_file() or name in RECIPE_EXAMPLES
                         or any(p.endswith("/" + name) for p in tracked))
                if not found:
                    missing.append(f"{path.relative_to(ROOT)}:{i}: {name}")
    assert not missing, f"*.md names with no such file in the repository: {missing}"


def _anchors(page: pathlib.Path) -> set[str]:
    """The heading anchors GitHub gives a page: lower case, punctuation dropped,
    spaces as hyphens, ``-1``, ``-2`` ... for repeats; headings in code fences skipped."""
    found, seen, fence = set(), {}, False
    for _, line in _lines(page):
        fence ^= line.startswith("```")
        heading = None if fence else re.match(r"#+ (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return found


def test_every_relative_link_in_a_page_resolves():
    """Every markdown link in every .md file that is not a URL points to a file
    or folder that exists, relative to the page, and its ``#anchor`` (if any)
    to a heading of the page it names."""
    broken = []
    for path in _text_files():
        if path.suffix != ".md":
            continue
        for i, line in _lines(path):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):
                    continue  # a URL
                file, _, anchor = target.partition("#")
                dest = path.parent / file if file else path
                if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
                    broken.append(f"{path.relative_to(ROOT)}:{i}: {target}")
    assert not broken, f"relative links to missing files or headings: {broken}"


def test_the_docs_index_links_every_guide():
    """docs/index.md is the front page: every page under docs/ is one link away."""
    index = ROOT / "docs" / "index.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in LINK.findall(index.read_text())}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md")} - {index.resolve()}
    unlinked = sorted(p.relative_to(ROOT).as_posix() for p in pages - linked)
    assert not unlinked, f"docs pages docs/index.md does not link: {unlinked}"


def test_every_lab_result_has_a_line_in_the_index():
    """lab/README.md catalogues lab/results/: a run's file without a line there is an orphan."""
    index = (ROOT / "lab" / "README.md").read_text()
    missing = sorted(p.name for p in RESULTS.iterdir() if f"](results/{p.name})" not in index)
    assert not missing, f"lab/results files with no line in lab/README.md: {missing}"
    stale = sorted(set(re.findall(r"\]\(results/([^)]+)\)", index)) - {p.name for p in RESULTS.iterdir()})
    assert not stale, f"lab/README.md lists files lab/results/ does not have: {stale}"
def test_testing_tutorial_example_runs_and_catches_the_bug():
    """docs/testing-your-router.md's first snippet runs as pasted and prints the violation."""
    text = (ROOT / "docs" / "testing-your-router.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the tutorial has a python example"
    r = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "property 'tie rule' failed" in r.stdout and "routing_map differs" in r.stdout, r.stdout[-2000:]
