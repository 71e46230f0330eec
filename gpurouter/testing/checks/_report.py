"""The runner of the conformance checks: reports, failures, hypothesis settings."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import hypothesis
import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase, given, settings

# ----------------------------------------------------------------------------
# Reports and failures
# ----------------------------------------------------------------------------


@dataclass
class PropertyResult:
    """One property of a check: ``status`` is "passed", "failed", "skipped" or "not run"."""

    name: str
    status: str
    examples: int = 0
    seconds: float = 0.0
    detail: str = ""


@dataclass
class CheckReport:
    """What a check ran: one :class:`PropertyResult` per property, in order."""

    op: str
    properties: list[PropertyResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(p.status in ("passed", "skipped") for p in self.properties)

    @property
    def examples(self) -> int:
        return sum(p.examples for p in self.properties)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.properties)

    def table(self) -> str:
        """A plain-text table: property, result, examples, seconds."""
        width = max([len("property")] + [len(p.name) for p in self.properties])
        lines = [f"{self.op}", f"{'property':<{width}}  {'result':<8}  {'examples':>8}  {'seconds':>8}"]
        lines.append("-" * len(lines[-1]))
        for p in self.properties:
            lines.append(f"{p.name:<{width}}  {p.status:<8}  {p.examples:>8}  {p.seconds:>8.2f}"
                         + (f"  ({p.detail})" if p.status == "skipped" and p.detail else ""))
        lines.append(f"{'total':<{width}}  {'passed' if self.passed else 'FAILED':<8}  "
                     f"{self.examples:>8}  {self.seconds:>8.2f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class CheckFailure(AssertionError):
    """A contract violation; ``report`` holds the properties run up to and including it."""

    def __init__(self, message: str, report: CheckReport):
        super().__init__(message)
        self.report = report


class _Violation(Exception):
    """Raised inside a property; hypothesis shrinks it, the runner turns it into CheckFailure."""


class _Skip(Exception):
    """A property with nothing to run under the requested dtypes/score functions."""


def _settings(max_examples: int, seed, shrink: bool = True) -> settings:
    kw = dict(max_examples=int(max_examples), deadline=None, database=None, print_blob=False,
              report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    if not shrink:  # the first failing example as drawn (small by construction)
        kw["phases"] = (Phase.explicit, Phase.reuse, Phase.generate)
    if seed is not None:
        kw["derandomize"] = False
    elif settings.default is settings.get_profile("default"):
        # no profile loaded (hypothesis's own default): the same examples on every run, as
        # the ci profile; a loaded profile's randomness decides otherwise (fuzz: random)
        kw["derandomize"] = True
    return settings(settings.default, **kw)


#: who hears each property's progress (:func:`listening`)
_LISTENERS: list = []


@contextlib.contextmanager
def listening(fn: Callable[[str, int, int, str, int], None]) -> Iterator[None]:
    """Within the block, every check calls ``fn(op, index, total, property,
    examples)`` when a property starts (``examples`` 0) and after each of its
    examples (hypothesis's shrinking included): what ``python -m gpurouter
    check`` draws as its progress line."""
    _LISTENERS.append(fn)
    try:
        yield
    finally:
        _LISTENERS.remove(fn)


def _tell(*event) -> None:
    for fn in tuple(_LISTENERS):
        fn(*event)


def _counted(body, count, where=None):
    def prop(data):
        body(data)
        count[0] += 1
        if where is not None:
            _tell(*where, count[0])
    return prop


def _run(op: str, props: list[tuple[str, Callable]], only, max_examples: int, seed,
         shrink: bool = True) -> CheckReport:
    names = [n for n, _ in props]
    if isinstance(only, str):  # one property by its name
        only = [only]
    if only is not None:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise ValueError(f"{op}: unknown properties {unknown}; choose from {names}")
    if not isinstance(max_examples, int) or isinstance(max_examples, bool) or max_examples < 1:
        raise ValueError(f"{op}: max_examples ({max_examples!r}) must be an int >= 1")
    report = CheckReport(op)
    chosen = [n for n in names if only is None or n in only]
    for name, make in props:
        if only is not None and name not in only:
            continue
        where = (op, chosen.index(name), len(chosen), name)
        _tell(*where, 0)
        try:
            body = make()
        except _Skip as why:
            report.properties.append(PropertyResult(name, "skipped", detail=str(why)))
            continue
        count = [0]
        test = _settings(max_examples, seed, shrink)(given(st.data())(_counted(body, count, where)))
        if seed is not None:
            test = hypothesis.seed(seed)(test)
        result = PropertyResult(name, "passed")
        report.properties.append(result)
        t0 = time.perf_counter()
        try:
            test()
        except _Violation as v:
            result.status, result.examples = "failed", count[0]
            result.seconds = time.perf_counter() - t0
            for rest, _ in props[props.index((name, make)) + 1:]:
                if only is None or rest in only:
                    report.properties.append(PropertyResult(rest, "not run"))
            raise CheckFailure(f"{op}: property '{name}' failed.\n{v}", report) from None
        result.examples = count[0]
        result.seconds = time.perf_counter() - t0
    return report
