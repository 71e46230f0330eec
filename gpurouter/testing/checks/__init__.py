"""The conformance checks: does a router keep docs/contract.md? (``gpurouter.testing``)

Each ``check_*`` runs a battery of hypothesis properties against ``fn`` and the
NumPy float64 oracle (:mod:`gpurouter.testing.oracle`), with the contract's
tolerances (:mod:`gpurouter.testing.tolerances`):

- on success it returns a :class:`CheckReport` (properties, examples run, seconds);
- on a violation it raises :class:`CheckFailure`, an ``AssertionError`` whose
  message names the property, the config (as TE keyword arguments) and
  hypothesis's smallest counterexample, with expected vs got; its ``report``
  attribute holds the properties run so far;
- ``fn`` raising, or returning the wrong structure, shapes or dtypes, is a
  violation too, and the message says what ``fn`` returned.

``max_examples`` counts per property (properties whose configs are excluded by
``dtypes``/``score_functions`` are reported as skipped). ``seed`` draws seeded
random examples; without it a run is derandomised (the same examples on every
run) unless a hypothesis profile is loaded, whose randomness then decides
(``fuzz`` of :mod:`gpurouter.testing.profiles`: random). ``properties``
(keyword-only, optional) runs only the named properties (a name, or a list of
names, exactly as the report prints them).
``with listening(fn):`` calls ``fn(op, index, total, property, examples)`` as
each property starts and after each example (a long run's progress).
"""


from ._report import CheckFailure as CheckFailure
from ._report import CheckReport as CheckReport
from ._report import PropertyResult as PropertyResult
from ._report import listening as listening
from .aux_loss import check_aux_loss as check_aux_loss
from .aux_scores import check_aux_scores as check_aux_scores
from .token_ops import check_token_combine as check_token_combine
from .token_ops import check_token_dispatch as check_token_dispatch
from .topk import check_topk as check_topk
from .z_loss import check_router_z_loss as check_router_z_loss

__all__ = [
    "CheckFailure",
    "CheckReport",
    "PropertyResult",
    "check_aux_loss",
    "check_aux_scores",
    "check_router_z_loss",
    "check_token_combine",
    "check_token_dispatch",
    "check_topk",
    "listening",
]
