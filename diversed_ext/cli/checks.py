"""Checks across a command's flags, made before any model loads: a FLy window no K of the run fits, and flags that
the methods asked for never read (a setting silently ignored is a mistake worth saying)."""

from __future__ import annotations

from typing import Sequence

from .common import UsageError, _draft_lengths

FLY_FLAGS = ("--fly-window", "--fly-threshold", "--fly-top-k")


def given_flags(argv: Sequence[str]) -> frozenset:
    """The long options written on the command line (``--name`` or ``--name=value``), as typed."""
    return frozenset(word.split("=", 1)[0] for word in argv if word.startswith("--"))


def check_fly_window(args) -> None:
    """--fly-window below every K the run drafts at (each --fixed-k, and --max-draft unless the fixed Ks are all the
    run drafts at), checked before models load: a window of K or more never fits after a rejection, which the decoder
    refuses."""
    window = getattr(args, "fly_window", None)
    if window is None:
        return
    lengths, fixed_ks = _draft_lengths(args)
    drafted = [("--fixed-k", k) for k in fixed_ks]
    if not (fixed_ks and lengths == ["fixed"]):
        drafted.append(("--max-draft", args.max_draft))
    for flag, k in drafted:
        if window >= k:
            raise UsageError(f"--fly-window: {window} must be below every K the run drafts at, got {flag} {k}")


def check_flags_read(args, given: frozenset) -> None:
    """eval: the FLy, gate and static-weight flags only beside a method that reads them; pareto: FLy's only with
    --fly. ``given``: the flags written (:func:`given_flags`)."""
    if args.command == "eval":
        methods = args.method
        _refuse_unread(given, FLY_FLAGS, any("fly" in method for method in methods),
                       "no --method adds FLy (fly, static+fly, diversed+fly)")
        _refuse_unread(given, ("--gate-margin",), any("gate" in method for method in methods),
                       "no --method adds the gate (gate, static+gate, diversed+gate)")
        _refuse_unread(given, ("--weight",), any(method.startswith("static") for method in methods),
                       "no --method is a static ensemble (static, static+fly, static+gate)")
    elif args.command == "pareto":
        _refuse_unread(given, ("--fly-window", "--fly-top-k", "--fly-thresholds"), args.fly,
                       "FLy's points are added with --fly")


def _refuse_unread(given: frozenset, flags: Sequence[str], read: bool, why: str) -> None:
    written = [flag for flag in flags if flag in given]
    if written and not read:
        raise UsageError(f"{written[0]} would be ignored: {why}")
