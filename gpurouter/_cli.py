"""Argument types of the two command lines (``python -m gpurouter`` and its
``bench``): every bad value becomes a one-line argparse error (exit 2)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def comma_list(choices, what: str):
    """A type for a comma-separated, non-empty list of ``choices`` (order kept)."""

    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",")]
        if not text.strip() or any(not s for s in items):
            raise argparse.ArgumentTypeError(f"empty {what} in {text!r}; choose from {', '.join(choices)}")
        bad = [s for s in items if s not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(choices)}")
        return list(dict.fromkeys(items))

    return parse


def matplotlib_missing() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


PLOT_NEEDS = "--plot needs matplotlib: pip install 'gpurouter[bench]'"
USAGE = ("python -m gpurouter [demo] [options]    (route every preset)\n"
         "       python -m gpurouter bench [options]     (time presets, backends, transports)\n"
         "       python -m gpurouter steps [options]     (jitted fwd+bwd steps per backend and transport)\n"
         "       python -m gpurouter moe-bench [options] (the MoE block end to end and by stage)\n"
         "       python -m gpurouter cache info|clear    (the compiled kernels kept on disk)\n"
         "       python -m gpurouter coldstart [options] (first-call times, fresh processes; GPU)\n"
         "       python -m gpurouter check MODULE:FUNCTION --op topk|aux-scores|aux-loss|z-loss  (conformance)")
