"""``python -m gpurouter check MODULE:FUNCTION --op topk|aux-scores|aux-loss|z-loss|token-dispatch|token-combine``.

Runs one conformance check of :mod:`gpurouter.testing.checks` on a function
named by its import path, prints the table of properties (passed, or failed
with hypothesis's smallest counterexample) and exits 0 when every property
passed, 1 on a violation, and 2 on a usage error (a bad target or option).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from .._cli import positive_int

OPS = ("topk", "aux-scores", "aux-loss", "z-loss", "token-dispatch", "token-combine")
DTYPES = ("float32", "bfloat16", "float16")
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
USAGE = ("python -m gpurouter check MODULE:FUNCTION --op topk|aux-scores|aux-loss|z-loss|token-dispatch|"
         "token-combine [--dispatch MODULE:FUNCTION] [--examples N] [--profile ci|dev|fuzz] [--dtypes ...] "
         "[--score-functions ...] [--no-groups] [--properties NAME,...] [--no-grads] [--seed S]")


def _resolve(parser: argparse.ArgumentParser, target: str):
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        parser.error(f"target {target!r} must be MODULE:FUNCTION (e.g. mypkg.router:topk)")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is a bad target
        parser.error(f"cannot import module {module_name!r} of target {target!r}: {type(e).__name__}: {e}")
    for part in attr.split("."):
        if not hasattr(obj, part):
            parser.error(f"module {module_name!r} has no attribute {attr!r} (target {target!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        parser.error(f"target {target!r} is a {type(obj).__name__}, not a callable")
    return obj


def _progress_line(examples: int, out=None):
    """A listener (``checks.listening``) drawing ``property i/n 'name' example
    j/examples elapsed`` on stderr: one line redrawn on a terminal, else one
    line per property and every 10th example."""
    out = sys.stderr if out is None else out
    tty = bool(getattr(out, "isatty", lambda: False)())
    start = time.perf_counter()

    def draw(op, index, total, name, done):
        line = (f"{op}: property {index + 1}/{total} {name!r}, example {done}/{examples}, "
                f"{time.perf_counter() - start:.0f} s")
        if tty:
            out.write("\r" + line[:110].ljust(110))
            if index + 1 == total and done >= examples:
                out.write("\n")
        elif done == 0 or done % 10 == 0:
            out.write(line + "\n")
        out.flush()
    return draw


def main(argv: list[str]) -> int:
    from .._cli import comma_list

    parser = argparse.ArgumentParser(prog="python -m gpurouter check", usage=USAGE, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="MODULE:FUNCTION, the function to check (importable from here)")
    parser.add_argument("--op", required=True, choices=OPS,
                        help="which contract fn keeps: topk (fused_topk_with_score_function), aux-scores "
                             "(fn(logits, topk, score_function), or TE's op itself, called with "
                             "compute_aux_scores=True), aux-loss (fused_moe_aux_loss), z-loss (router_z_loss), "
                             "token-dispatch / token-combine (TE's permutation.token_dispatch / token_combine)")
    parser.add_argument("--dispatch", default=None,
                        help="MODULE:FUNCTION, the dispatch whose row_id_map the combine reads (token-combine only)")
    parser.add_argument("--examples", type=positive_int, default=None,
                        help="hypothesis examples per property (default 100, or the profile's)")
    parser.add_argument("--profile", choices=("ci", "dev", "fuzz"), default=None,
                        help="a hypothesis profile of gpurouter.testing.profiles (fuzz: 3000 random examples)")
    parser.add_argument("--dtypes", type=comma_list(DTYPES, "dtype"), default=list(DTYPES),
                        help="comma-separated logits/probs dtypes (default all three)")
    parser.add_argument("--score-functions", type=comma_list(SCORE_FUNCTIONS, "score function"),
                        default=list(SCORE_FUNCTIONS), help="comma-separated (topk and aux-scores only)")
    parser.add_argument("--no-groups", action="store_true",
                        help="a router without group-limited routing: no grouped config drawn (topk only)")
    parser.add_argument("--properties", type=lambda v: [p.strip() for p in v.split(",") if p.strip()],
                        default=None, help="comma-separated property names, as the report prints them")
    parser.add_argument("--no-grads", action="store_true", help="skip the gradient properties")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (reproducible runs)")
    args = parser.parse_args(argv)
    try:
        from . import checks, profiles
    except ImportError as e:
        parser.error(str(e))
    fn = _resolve(parser, args.target)
    if (args.op == "token-combine") != (args.dispatch is not None):
        parser.error("--dispatch MODULE:FUNCTION goes with --op token-combine, and only with it")
    extra = () if args.dispatch is None else (_resolve(parser, args.dispatch),)
    if args.op not in ("topk", "aux-scores") and args.score_functions != list(SCORE_FUNCTIONS):
        parser.error(f"--score-functions goes with --op topk or aux-scores, not {args.op}")
    if args.no_groups and args.op != "topk":
        parser.error(f"--no-groups goes with --op topk, not {args.op}")
    examples = args.examples
    if args.profile is not None:
        profiles.load(args.profile)
        if examples is None:
            examples = profiles.PROFILES[args.profile].max_examples
    examples = 100 if examples is None else examples
    kw = dict(max_examples=examples, dtypes=tuple(args.dtypes), grads=not args.no_grads, seed=args.seed)
    if args.op in ("topk", "aux-scores"):
        kw["score_functions"] = tuple(args.score_functions)
    if args.no_groups:
        kw["groups"] = False
    if args.properties is not None:
        kw["properties"] = args.properties
    check = {"topk": checks.check_topk, "aux-scores": checks.check_aux_scores,
             "aux-loss": checks.check_aux_loss, "z-loss": checks.check_router_z_loss,
             "token-dispatch": checks.check_token_dispatch, "token-combine": checks.check_token_combine}[args.op]
    print(f"checking {args.target} (--op {args.op}), {examples} examples per property", flush=True)
    try:
        with checks.listening(_progress_line(examples)):
            report = check(fn, *extra, **kw)
    except ValueError as e:  # the check's own arguments (fn's errors are violations, CheckFailure)
        parser.error(str(e))
    except checks.CheckFailure as failure:
        print(failure.report.table())
        print()
        print(f"FAILED: {failure}")
        return 1
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
