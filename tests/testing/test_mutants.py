"""The conformance checks are sharp: routers that each break one contract point
(the one-line mistakes kernel authors make, tests/testing/_mutants.py) raise
AssertionError; the reference passes (tests/testing/test_dogfood.py). Each
test runs only the property that should catch its mutant, with a fixed seed;
the slow list uses 30 examples, below the default 100 (a catch at 30 is a catch
at the defaults, where hypothesis stops at the first failure). A cheap subset,
float32 and one score function, runs in ``make test``."""

from __future__ import annotations

import re

import pytest

from gpurouter.testing import CheckFailure, check_aux_loss, check_topk

from ._mutants import (
    OTHER_MUTANTS,
    TOPK_MUTANTS,
    normalised_when_k_is_1,
    rounded_scores,
    scaling_never,
    scaling_twice,
)


# On this 2-core CI machine under load a mutant takes 10 s to 3 min (one jit
# compile per example, shrinking included): the whole list is marked slow; a
# cheap subset runs in CI below.
@pytest.mark.slow
@pytest.mark.parametrize("mutant,prop", TOPK_MUTANTS, ids=[f"{m.__name__}-{p}" for m, p in TOPK_MUTANTS])
def test_topk_mutant_is_caught(mutant, prop):
    with pytest.raises(AssertionError) as info:
        check_topk(mutant, max_examples=30, seed=0, properties=[prop], grads=True)
    assert isinstance(info.value, CheckFailure)
    text = str(info.value)
    assert f"property '{prop}' failed" in text and "config: fn(logits=" in text
    assert "smallest counterexample" in text
    if "crashes" not in mutant.__name__:  # caught for its own mistake, not for raising
        assert "fn raised" not in text, text


@pytest.mark.slow
def test_scores_rounded_to_the_logits_dtype_are_caught_at_the_defaults():
    """A half-precision rounding at each step lands on the wrong neighbour of
    the correctly rounded value: the checks hold half probs to half an ulp of
    the float64 oracle (tolerances.assert_rounded_once), not one ulp."""
    with pytest.raises(AssertionError) as info:
        check_topk(rounded_scores, seed=0, properties=["values (tie-free)"], grads=False)
    assert "property 'values (tie-free)' failed" in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("check,mutant,prop", OTHER_MUTANTS, ids=[m.__name__ for _, m, _ in OTHER_MUTANTS])
def test_other_mutants_are_caught(check, mutant, prop):
    with pytest.raises(AssertionError, match=re.escape(f"property '{prop}' failed")) as info:
        check(mutant, max_examples=30, seed=0, properties=[prop])
    if "crashes" not in mutant.__name__:  # caught for its own mistake, not for raising
        assert "raised" not in str(info.value), str(info.value)


# ---- the cheap subset (make test): float32, one score function, few examples --

CHEAP = [
    (scaling_twice, "values (tie-free)", "softmax"),
    (scaling_never, "values (tie-free)", "softmax"),
    (normalised_when_k_is_1, "values (tie-free)", "sigmoid"),
]


@pytest.mark.parametrize("mutant,prop,sf", CHEAP, ids=[m.__name__ for m, _, _ in CHEAP])
def test_mutants_caught_cheaply(mutant, prop, sf):
    with pytest.raises(CheckFailure, match=re.escape(f"property '{prop}' failed")):
        check_topk(mutant, max_examples=10, seed=0, properties=[prop], dtypes=("float32",), score_functions=(sf,))


def test_fn_that_returns_garbage_is_reported_not_a_traceback():
    # (called under jit, the 3 may reach the check as a traced int32 scalar)
    with pytest.raises(AssertionError,
                       match=r"fn must return \(probs, routing_map\); it returned (int 3|ArrayImpl int32\[\])"):
        check_topk(lambda *a: 3, max_examples=2, seed=0, properties=["values (tie-free)"])
    with pytest.raises(AssertionError, match="fn raised RuntimeError: boom"):
        check_aux_loss(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")), max_examples=2, seed=0)
