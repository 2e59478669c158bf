"""What every ``diversed`` sub-command shares: the one-line user error, argument types that name what they accept,
the model and head arguments, and loading the pair and the head with errors that name the flag."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from .. import rules
from ..decoding.eagle_drafting import is_eagle_head
from ..decoding.runners import model_device
from ..head import load_head, resolve_head_path, shipped_heads


class UsageError(Exception):
    """A mistake on the command line or in a file it names: printed as one line, exit status 2, no traceback."""


USAGE_EXIT_STATUS = 2


def _number_in(convert, accept, description: str):
    """An argparse type: ``convert(text)``, finite and satisfying ``accept``, else "must be <description>"."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {description}, got {text!r}") from None
        if not (math.isfinite(value) and accept(value)):  # also refuses nan and inf
            raise argparse.ArgumentTypeError(f"must be {description}, got {text}")
        return value
    return parse


def _ruled(convert, rule, description: str):
    """An argparse type: ``convert(text)`` accepted by the library's ``rule`` (:mod:`diversed_ext.rules`), else
    "must be <description>"; the value is returned as written."""
    def parse(text: str):
        try:
            value = convert(text)
            rule(value, "value")
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {description}, got {text}") from None
        return value
    return parse


_positive_int = _number_in(int, lambda value: value >= 1, "an integer >= 1")
_non_negative_int = _number_in(int, lambda value: value >= 0, "an integer >= 0")
_positive_float = _number_in(float, lambda value: value > 0.0, "a finite number > 0")
_unit_float = _ruled(float, rules.weight, rules.WEIGHT)
_weight_of_untrained_head = _ruled(float, rules.positive_weight, rules.POSITIVE_WEIGHT)
_non_negative_float = _ruled(float, rules.non_negative, rules.NON_NEGATIVE)
_temperature = _ruled(float, rules.temperature, rules.TEMPERATURE)
_draft_length = _ruled(int, rules.draft_length, rules.DRAFT_LENGTH)
_seed = _ruled(int, rules.seed, rules.SEED)
_gate_margin = _ruled(float, rules.gate_margin, rules.GATE_MARGIN)
# --drafter: the draft model, or an EAGLE-3 head on the target's hidden states (eagle3-int8: its draft steps' products
# in int8, Eagle3Head.use_int8_products)
DRAFTERS = ("model", "eagle3", "eagle3-int8")
EAGLE_DRAFTERS = ("eagle3", "eagle3-int8")


def _device(text: str) -> str:
    """An argparse type: ``cpu``, or a CUDA device torch can see (``cuda``, ``cuda:N``)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= visible:
        raise argparse.ArgumentTypeError(f"{text}: torch sees {visible} GPU(s) on this machine")
    return text


def library_defaults(*functions) -> dict:
    """name -> default of every keyword argument of ``functions`` (the first one naming it wins). The commands take
    their defaults from the functions they call, so the command line and the Python API cannot disagree."""
    defaults = {}
    for function in functions:
        for name, parameter in inspect.signature(function).parameters.items():
            if parameter.default is not inspect.Parameter.empty:
                defaults.setdefault(name, parameter.default)
    return defaults


def _add_model_arguments(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """The pair, K, temperature, length and seed flags, with ``defaults`` (from :func:`library_defaults`)."""
    parser.add_argument("--target", help="target model name or folder (default: the embedded SmolLM2-135M pair)")
    parser.add_argument("--draft", help="draft model name or folder (default: an int8 copy of the target)")
    parser.add_argument("--drafter", choices=DRAFTERS, default=None,
                        help="what drafts: the draft model (default), or eagle3, an EAGLE-3 head on the target's "
                        "hidden states (default: the one shipped for the default pair; see --drafter-path); "
                        "eagle3-int8: the same head with its draft steps' products in int8 (faster, drafts differ "
                        "slightly from the float checkpoint's)")
    parser.add_argument("--drafter-path", metavar="FOLDER",
                        help="the EAGLE-3 head's folder (config.json, model.safetensors); implies --drafter eagle3")
    parser.add_argument("--device", type=_device, default="cpu",
                        help="where the target (and a float draft) run: cpu or cuda[:N] (default %(default)s; the "
                        "default pair's int8 draft stays on the CPU)")
    parser.add_argument("--max-draft", type=_draft_length, default=defaults["max_draft"],
                        help="K, the most tokens drafted per round (default %(default)s)")
    parser.add_argument("--temperature", type=_temperature, default=defaults["temperature"],
                        help="0 = greedy (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=defaults["max_new_tokens"],
                        help="default %(default)s")
    seed = defaults["seed"]
    parser.add_argument("--seed", type=_seed, default=seed,
                        help="default " + ("a fresh one each run" if seed is None else "%(default)s"))
    parser.add_argument("--no-chat-template", action="store_true", help="tokenize the prompt as plain text")


def _add_draft_length_arguments(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """--draft-length (one policy, or with ``several`` one or more, plus the fixed sweep's --fixed-k) and
    --draft-cost."""
    from ..decoding import DEFAULT_DRAFT_LENGTH, DRAFT_LENGTHS, GainDraftLength

    about = ("how many tokens each request drafts a round: fixed (--max-draft every round), transformers' heuristic "
             "schedule or confidence threshold, or gain (ours: draft while one more draft raises the expected tokens "
             "per unit of time); the adaptive ones draft at most --max-draft")
    if several:
        parser.add_argument("--draft-length", choices=DRAFT_LENGTHS, nargs="+", default=[DEFAULT_DRAFT_LENGTH],
                            help=f"one or more policies, each a row per method: {about} (default %(default)s)")
        parser.add_argument("--fixed-k", type=_draft_length, nargs="+",
                            help="the K of each fixed row (a sweep; default: --max-draft alone); the table then "
                            "compares every policy with each method's best fixed K")
    else:
        parser.add_argument("--draft-length", choices=DRAFT_LENGTHS, default=DEFAULT_DRAFT_LENGTH,
                            help=f"{about} (default %(default)s)")
    draft_cost = library_defaults(GainDraftLength)["draft_cost"]
    parser.add_argument("--draft-cost", type=_non_negative_float,
                        help="for --draft-length gain: a draft pass's time over a target pass's "
                        f"(default {draft_cost:g}, the default pair's on a 2-core CPU)")


def _add_fly_arguments(parser: argparse.ArgumentParser) -> None:
    """FLy's settings (the methods fly, static+fly and diversed+fly; lossy: see docs/decoding.md)."""
    parser.add_argument("--fly-window", type=_positive_int,
                        help="FLy's window W (< --max-draft; default vLLM's, min(6, K - 1))")
    parser.add_argument("--fly-threshold", type=_non_negative_float, default=rules.FLY_DEFAULT_THRESHOLD,
                        help="FLy's entropy threshold tau (default %(default)s)")
    parser.add_argument("--fly-top-k", type=_ruled(int, rules.fly_top_k, rules.FLY_TOP_K),
                        default=rules.FLY_DEFAULT_TOP_K,
                        help="how many of the target's largest probabilities FLy's entropy sums, at most "
                        f"{rules.FLY_MAX_TOP_K} (default %(default)s)")


def _add_gate_argument(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """The log-probability gate's margin (the methods gate, static+gate and diversed+gate; lossy: see
    docs/decoding.md); ``several``: a sweep, one point per margin."""
    if several:
        parser.add_argument("--gate-margin", type=_gate_margin, nargs="+", default=[],
                            help="also the gate's point (sd with it) and each head's with it, at each margin in nats")
    else:
        parser.add_argument("--gate-margin", type=_gate_margin, default=rules.GATE_DEFAULT_MARGIN,
                            help="the gate's margin in nats: a draft is kept outright when its target log-probability "
                            "is within it of a rejection's expected one (default %(default)s)")


def _gates(margins) -> list:
    from ..decoding import Gate

    return [Gate(margin) for margin in margins]


def _fly_settings(args):
    """The Fly of the --fly-* flags."""
    from ..decoding import Fly

    try:
        return Fly(args.fly_window, args.fly_threshold, args.fly_top_k)
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None


@contextlib.contextmanager
def _decoder_error() -> Iterator[None]:
    """A decoder refusing a combination of flags (a draft length that needs the draft's probabilities next to an
    n-gram drafter, say) as a one-line usage error; the decoder's message names the argument."""
    try:
        yield
    except (TypeError, ValueError) as error:
        message = str(error)
        if "draft_length" in message or "draft_cost" in message:
            raise UsageError(message.replace("draft_length", "--draft-length")
                             .replace("draft_cost", "--draft-cost")) from None
        raise


def _check_draft_cost(args) -> None:
    """--draft-cost only with a gain policy: a cost nothing reads is a mistake worth saying."""
    if args.draft_cost is not None and "gain" not in _draft_lengths(args)[0]:
        raise UsageError("--draft-cost applies to --draft-length gain")


def _draft_lengths(args) -> tuple[list[str], list[int]]:
    """The --draft-length names (one or several) and --fixed-k values, each once."""
    lengths = args.draft_length if isinstance(args.draft_length, list) else [args.draft_length]
    return list(dict.fromkeys(lengths)), list(dict.fromkeys(getattr(args, "fixed_k", None) or []))


def _draft_length_words(args) -> str:
    """"K = 3", "draft length gain (at most 8)" or, for several, the list of them."""
    lengths, fixed_ks = _draft_lengths(args)
    fixed_ks = fixed_ks or [args.max_draft]
    words = []
    for name in lengths:
        words.append(f"K = {', '.join(map(str, fixed_ks))}" if name == "fixed"
                     else f"draft length {name} (at most {args.max_draft})")
    return "; ".join(words)


def _add_batch_argument(parser: argparse.ArgumentParser, defaults: dict) -> None:
    parser.add_argument("--batch-size", type=_positive_int, default=defaults["batch_size"],
                        help="prompts decoded together per target pass (default %(default)s; 1: one after another); "
                             "tokens/s is then every token over the wall time of the batches")


def eagle_drafter_asked(drafter: Optional[str], drafter_path: Optional[str]) -> bool:
    """Whether --drafter / --drafter-path ask for an EAGLE-3 head to draft (a --drafter-path implies one)."""
    return drafter in EAGLE_DRAFTERS or drafter_path is not None


def pair_names(args) -> dict:
    """The names of the models a run uses, as a head trained on them records them (head.json's ``pair``) and as a
    head loaded for them is checked against: the default pair's target, and its int8 draft or the EAGLE-3 head's
    folder name; a model named on the command line is left out (its name says nothing a head could check)."""
    from ..models import DEFAULT_PAIR
    from ..models.eagle3 import default_drafter_path

    if args.target is not None:
        return {}
    names = {"target": DEFAULT_PAIR["target"]}
    if args.drafter_path is not None:
        names["draft"] = os.path.basename(os.path.normpath(args.drafter_path))
    elif args.drafter in EAGLE_DRAFTERS:
        names["draft"] = default_drafter_path().name
    elif args.draft is None:
        names["draft"] = DEFAULT_PAIR["draft"]
    return names


def load_models(target: Optional[str], draft: Optional[str], device: str = "cpu", *, drafter: Optional[str] = None,
                drafter_path: Optional[str] = None):
    """(target, draft, tokenizer): the default pair, or the pair named on the command line, on ``device``. With
    ``drafter`` "eagle3" or "eagle3-int8" (or a ``drafter_path``), the draft is an EAGLE-3 head on the target's hidden
    states: the one at ``drafter_path``, else the one shipped for the default pair; "eagle3-int8" runs its draft
    steps' products in int8."""
    if drafter == "model" and drafter_path is not None:
        raise UsageError("--drafter-path names an EAGLE-3 head: it goes with --drafter eagle3, not --drafter model")
    if eagle_drafter_asked(drafter, drafter_path):
        if draft is not None:
            raise UsageError(f"--drafter {drafter or 'eagle3'} drafts in place of a draft model: drop --draft")
        flag, folder = _eagle_folder(drafter_path)  # before any model loads
        target_model, _, tokenizer = _load_pair(target, None, device)
        head = _load_eagle_head(flag, folder, target_model)
        return target_model, head.use_int8_products(drafter == "eagle3-int8"), tokenizer
    return _load_pair(target, draft, device)


def load_command_models(args):
    """:func:`load_models` for a command's --target, --draft, --device, --drafter and --drafter-path."""
    return load_models(args.target, args.draft, args.device, drafter=getattr(args, "drafter", None),
                       drafter_path=getattr(args, "drafter_path", None))


def _eagle_folder(path: Optional[str]) -> tuple[str, str]:
    """(the flag to name in errors, the EAGLE-3 head's folder): ``path``, or the shipped head's folder."""
    from ..models.eagle3 import default_drafter_path

    if path is not None:
        if not os.path.isdir(path):
            raise UsageError(f"--drafter-path {path}: no such folder")
        return f"--drafter-path {path}", path
    try:
        return "--drafter eagle3", str(default_drafter_path())
    except FileNotFoundError as error:
        raise UsageError(f"--drafter eagle3: {error}; pass --drafter-path FOLDER") from None


def _load_eagle_head(flag: str, folder: str, target):
    """The EAGLE-3 head in ``folder`` for ``target``, on its device, or a one-line error naming ``flag``."""
    import torch

    from safetensors import SafetensorError

    from ..decoding.eagle_drafting import EagleDrafter
    from ..models.eagle3 import Eagle3Head

    try:
        head = Eagle3Head.from_pretrained(folder, target.get_input_embeddings(), dtype=torch.float32)
        head = head.to(model_device(target))
        EagleDrafter(head, target, model_device(target))  # refuses a head built for another target, with the reason
        return head
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as error:
        raise UsageError(f"cannot load {flag}: {error}") from None


def _load_pair(target: Optional[str], draft: Optional[str], device: str):
    from ..models import load_default_pair, load_pair

    if target is None:
        if draft is not None:
            raise UsageError("--draft needs --target")
        return load_default_pair(device=device)
    for flag, name in (("--target", target), ("--draft", draft)):
        # Nothing is downloaded here, so a name that is not a folder cannot load: say so before transformers does.
        if name is not None and not os.path.isdir(name):
            raise UsageError(f"{flag} {name}: no such model folder")
        if name is not None:
            _check_weight_files(flag, name)
    try:
        return load_pair(target, draft, device=device)
    except (OSError, ValueError) as error:
        models = f"--target {target}" + (f" and --draft {draft}" if draft is not None else "")
        raise UsageError(f"cannot load {models}: {error}") from None


def _check_weight_files(flag: str, folder: str) -> None:
    """Each safetensors file of a model folder opens (its header only is read), so a damaged one is named with its
    flag before transformers loads either model."""
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as error:  # safetensors raises its own SafetensorError, and OSError
            raise UsageError(f"{flag} {folder}: {path.name} is not a readable safetensors file ({error})") from None


def check_head_arguments(paths, args) -> None:
    """Each --head in ``paths`` read before any model loads (its folder, config and weights, and the pair it was
    trained for against this run's: a head of the int8 draft refused with an EAGLE-3 drafter, and the reverse; its
    sizes are checked once the models load), so a mistake in one costs no model load: a one-line error naming it."""
    eagle3_drafter = eagle_drafter_asked(getattr(args, "drafter", None), getattr(args, "drafter_path", None))
    for path in paths:
        if not os.path.exists(resolve_head_path(path, eagle3_drafter=eagle3_drafter)):
            raise UsageError(f"--head {path}: no such head folder, and no shipped head of that name "
                             f"({', '.join(['default', *shipped_heads()])})")
        _read_head(path, eagle3_drafter=eagle3_drafter, pair=pair_names(args))


def _load_head(path: str, target, draft):
    """The head at ``path`` for this pair, on the target's device, or a one-line error (exit 2) naming the folder and
    what is wrong. ``"default"`` with an EAGLE-3 head drafting is the default recipe trained on such a head's states."""
    head = _read_head(path, target=target, draft=draft, eagle3_drafter=is_eagle_head(draft))
    return head.to(model_device(target))


def _read_head(path: str, **options):
    """:func:`~diversed_ext.head.load_head` of ``path``, or a one-line error (exit 2) naming it and what is wrong."""
    try:
        return load_head(path, **options)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load --head {path}: {error}") from None


def _require_writable_folder(flag: str, path: str) -> None:
    """Create ``path`` and prove it writable now, before hours of work produce results that cannot be saved."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as error:
        raise UsageError(f"{flag} {path}: not writable ({error.strerror or error})") from None


def _write_text(folder: str, name: str, text: str) -> str:
    path = os.path.join(folder, name)
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text + "\n")
    return path
