"""``gpurouter.testing``: a conformance suite for anyone's MoE router (``pip install gpurouter[testing]``).

One call says whether a router keeps docs/contract.md (TransformerEngine's
contract, with gpurouter's documented tie, ``-inf`` and NaN rules), or gives
the smallest input where it does not:

    >>> from gpurouter.testing import check_topk
    >>> report = check_topk(my_router)          # doctest: +SKIP
    >>> print(report)                           # doctest: +SKIP

- :mod:`gpurouter.testing.checks`: :func:`check_topk`, :func:`check_aux_scores`,
  :func:`check_aux_loss`, :func:`check_router_z_loss`, and the MoE token
  permutation's :func:`check_token_dispatch` and :func:`check_token_combine`
  (one module each; they raise
  :class:`CheckFailure`, an ``AssertionError``, on a violation, and return a
  :class:`CheckReport` otherwise);
- :mod:`gpurouter.testing.strategies`: hypothesis strategies of valid configs
  and inputs (tie-free, tied, masked, biases, forced indices, aux-loss inputs;
  the loss inputs from :mod:`gpurouter.testing.loss_strategies`);
- :mod:`gpurouter.testing.oracle`: the NumPy float64 oracle of the router
  ops, written from the contract (independent of ``gpurouter.reference``),
  with the losses' oracle of :mod:`gpurouter.testing.loss_oracle`;
  :mod:`gpurouter.testing.moe_oracle`: the same for the token-level MoE ops;
- :mod:`gpurouter.testing.tolerances`: the contract's tolerance table and the
  comparators (``assert_close``, ``assert_topk_equivalent``);
- :mod:`gpurouter.testing.profiles`: the ``ci``, ``dev`` and ``fuzz`` profiles.

Needs hypothesis; ``import gpurouter`` alone never imports it.
"""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess by tests/testing/test_package.py
    raise ImportError(
        "gpurouter.testing needs hypothesis, which is not installed: pip install 'gpurouter[testing]'"
    ) from e

from . import oracle as oracle
from . import profiles as profiles
from . import strategies as strategies
from . import tolerances as tolerances
from .checks import CheckFailure as CheckFailure
from .checks import CheckReport as CheckReport
from .checks import PropertyResult as PropertyResult
from .checks import check_aux_loss as check_aux_loss
from .checks import check_aux_scores as check_aux_scores
from .checks import check_router_z_loss as check_router_z_loss
from .checks import check_token_combine as check_token_combine
from .checks import check_token_dispatch as check_token_dispatch
from .checks import check_topk as check_topk
