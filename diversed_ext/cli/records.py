"""What the experiment commands record of their settings in the files they write, and check when they read such a
file back: ``pareto``'s results.json (which ``report`` joins only with parts made under the same settings) and
``validate``'s --tokens file (reused only under the settings it was sampled with)."""

from __future__ import annotations

import hashlib
import os
from typing import Optional

from .common import UsageError, eagle_drafter_asked

# The validate flags that decide which contexts a --tokens file holds. Not --batch-size: prompt i's tokens are those
# it gets alone, whatever its neighbours (docs/decoding.md).
TOKEN_FLAGS = ("task", "data", "skip", "limit", "seed", "temperature", "weight", "max_new_tokens", "max_draft",
               "no_chat_template", "target", "draft", "drafter", "drafter_path")
DIGEST_LENGTH = 16  # hex digits of a head's weights digest: enough to tell two trainings apart


def prompts_record(args, task, examples, specs, head_paths: dict) -> dict:
    """Which prompts a pareto run decoded and how: what `diversed report` checks before it joins runs. ``specs``:
    the run's (label, decoder keyword arguments); ``head_paths``: label -> the --head of each head's point."""
    from ..research.result_sets import RULE_SETTINGS

    return {"task": task.name, "data": _file_name(args.data), "skip": args.skip, "count": len(examples),
            "seed": args.seed, "target": args.target, "draft": args.draft, "drafter": _drafter(args),
            "drafter_path": _file_name(args.drafter_path), "max_draft": args.max_draft,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "chat": task.chat and not args.no_chat_template, "draft_length": args.draft_length,
            "draft_cost": args.draft_cost, "fly_top_k": args.fly_top_k, "batch_size": args.batch_size,
            RULE_SETTINGS: rule_settings(args, specs, head_paths)}


def rule_settings(args, specs, head_paths: dict) -> dict:
    """label -> what a rule ran under that its label does not say: its head (folder name and weights digest) and its
    FLy settings; rules with neither are left out."""
    heads = {label: kwargs["head"] for label, kwargs in specs if label in head_paths}
    identities = {id(heads[label]): head_identity(path, eagle_drafter_asked(args.drafter, args.drafter_path))
                  for label, path in head_paths.items()}
    record = {}
    for label, kwargs in specs:
        settings = dict(identities.get(id(kwargs["head"]), {})) if "head" in kwargs else {}
        fly = kwargs.get("fly")
        if fly is not None:
            settings.update(fly_window=fly.window, fly_threshold=fly.threshold, fly_top_k=fly.top_k)
        if settings:
            record[label] = settings
    return record


def head_identity(path: str, eagle3_drafter: bool) -> dict:
    """A --head as results record it: its folder's name and a digest of its weights file, so that two heads run
    under one label are told apart."""
    from ..head import WEIGHTS_NAME, resolve_head_path

    folder = resolve_head_path(path, eagle3_drafter=eagle3_drafter)
    if os.path.isfile(folder):  # a file inside the head's folder names the folder, as for load_head
        folder = os.path.dirname(folder) or "."
    digest = hashlib.sha256()
    with open(os.path.join(folder, WEIGHTS_NAME), "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"head": os.path.basename(os.path.abspath(folder)), "head_sha256": digest.hexdigest()[:DIGEST_LENGTH]}


def token_settings(args) -> dict:
    """The settings validate samples its contexts under, as a --tokens file records them."""
    values = {name: getattr(args, name) for name in TOKEN_FLAGS}
    return {**values, "data": _file_name(args.data), "drafter": _drafter(args),
            "drafter_path": _file_name(args.drafter_path)}


def check_token_file(args) -> None:
    """An existing --tokens file is reused only under the settings it was sampled with: one a flag changes (or one
    written before files recorded them) is refused, naming the flags, before any model loads."""
    from ..research.validation import recorded_token_settings

    try:
        recorded = recorded_token_settings(args.tokens)
    except ValueError as error:
        raise UsageError(f"--tokens {args.tokens}: {error}") from None
    if recorded is None:
        raise UsageError(f"--tokens {args.tokens}: records no settings it was sampled under (written by an older "
                         "diversed); delete it or pass a new path to sample the contexts again")
    current = token_settings(args)
    changed = [f"--{name.replace('_', '-')} {_shown(recorded.get(name))} (now {_shown(current[name])})"
               for name in TOKEN_FLAGS if recorded.get(name) != current[name]]
    if changed:
        raise UsageError(f"--tokens {args.tokens}: sampled with {', '.join(changed)}; give those flags as they "
                         "were, or delete the file or pass a new path to sample the contexts again")


def _shown(value) -> str:
    return "unset" if value is None else str(value)


def _drafter(args) -> str:
    """What drafted: "model", or the EAGLE-3 drafter (--drafter-path alone implies eagle3)."""
    return args.drafter or ("eagle3" if eagle_drafter_asked(args.drafter, args.drafter_path) else "model")


def _file_name(path: Optional[str]) -> Optional[str]:
    """A data file or folder as a record names it: its name, not this machine's path to it."""
    return os.path.basename(os.path.normpath(path)) if path else None
