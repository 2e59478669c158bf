"""Checks across a command's flags, made before any model loads: a FLy window no K of the run fits, flags that the
methods asked for never read (a setting silently ignored is a mistake worth saying), a value given twice to one flag,
and rules that need a sampling temperature asked for at --temperature 0."""

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
        _refuse_unread(given, (*FLY_FLAGS, "--fly-thresholds"), args.fly,
                       "FLy's points are added with --fly")


def _refuse_unread(given: frozenset, flags: Sequence[str], read: bool, why: str) -> None:
    written = [flag for flag in flags if flag in given]
    if written and not read:
        raise UsageError(f"{written[0]} would be ignored: {why}")


def check_repeated_values(args, given: frozenset) -> None:
    """Each flag that takes several values (--method, --weight(s), --head, --gate-margin...) takes each value once:
    every value is a row labelled by it, and a value given twice would be two rows under one label whose per-prompt
    values are merged, doubling the samples. Compared as parsed, so 0.5 and .5 are one value. ``given``: the flags
    written (:func:`given_flags`); positional lists (report's files) are no flag's."""
    for name, values in vars(args).items():
        flag = "--" + name.replace("_", "-")
        if flag in given and isinstance(values, list):
            repeated = [value for index, value in enumerate(values) if value in values[:index]]
            if repeated:
                shown = format(repeated[0], "g") if isinstance(repeated[0], float) else repeated[0]
                raise UsageError(f"{flag}: {shown} is given twice; each value makes one row, so give it once")


def check_sampling(args) -> None:
    """The gate and typical acceptance read the target's log-probabilities at the sampling temperature, which greedy
    decoding has not: eval's gate and typical methods and pareto's --gate-margin and --typical at a greedy
    --temperature are refused here, by the library's own checks, rather than by the decoder once the models load."""
    from ..decoding import Typical
    from ..decoding.gate import require_sampling
    from ..decoding.typical import check_typical

    if args.command == "eval":
        gated = [method for method in args.method if "gate" in method]
        typical = "typical" in args.method
        gate_words, typical_words = f"--method {' '.join(gated)}", "--method typical"
    elif args.command == "pareto":
        gated, typical = args.gate_margin, args.typical is not None
        gate_words, typical_words = "--gate-margin", "--typical"
    else:
        return
    try:
        if gated:
            words = gate_words
            require_sampling(args.temperature)
        if typical:
            words = typical_words
            check_typical(Typical(), "sd", args.temperature, None, None)
    except ValueError as error:
        raise UsageError(f"--temperature {args.temperature:g} with {words}: {error}") from None
