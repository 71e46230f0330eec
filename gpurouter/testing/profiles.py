"""Hypothesis profiles for router tests and the conformance checks.

- ``ci``: derandomised (the same examples on every run: CI never flakes),
  no example database, 25 examples per test;
- ``dev``: 10 random examples (quick local iterations);
- ``fuzz``: 3000 random examples (by hand, nightly, or on a GPU).

Every profile has no deadline (jit compiles and CUDA-simulator launches take
seconds), prints the reproduction blob and allows slow examples.
:func:`register` registers them with hypothesis (under ``prefix + name``);
``settings.load_profile("ci")`` then selects one, or pytest's
``--hypothesis-profile=ci``. The conformance checks start from the loaded
profile's settings (``max_examples`` and ``seed`` given to a check win; with
no profile loaded they are derandomised, as ``ci``).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])

#: name -> the settings of that profile
PROFILES: dict[str, settings] = {
    "ci": settings(derandomize=True, database=None, max_examples=25, **_COMMON),
    "dev": settings(max_examples=10, **_COMMON),
    "fuzz": settings(max_examples=3000, derandomize=False, **_COMMON),
}


def register(prefix: str = "") -> None:
    """Registers the profiles of :data:`PROFILES` with hypothesis as ``prefix + name``."""
    for name, value in PROFILES.items():
        settings.register_profile(prefix + name, value)


def load(name: str) -> None:
    """Registers the profiles (no prefix) and loads ``name`` (one of :data:`PROFILES`)."""
    if name not in PROFILES:
        raise ValueError(f"unknown hypothesis profile {name!r}; choose from {sorted(PROFILES)}")
    register()
    settings.load_profile(name)
