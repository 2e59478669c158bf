"""The command line run in a test: a command's status and one-line error, and the model load it makes replaced by a
tiny pair or by a failure (every check of the arguments must come before it)."""

import json

from .models import gsm8k_examples

__all__ = ["run_cli", "refuse_models", "commands_use", "gsm8k_file"]


def run_cli(argv, capsys):
    """(exit status, what the command wrote to stderr, stripped)."""
    from diversed_ext import cli

    status = cli.main(argv)
    return status, capsys.readouterr().err.strip()


def refuse_models(monkeypatch):
    """Fails the test if a command gets as far as loading models."""
    from diversed_ext import cli

    def refuse(*args, **kwargs):
        raise AssertionError("models were loaded before the arguments were checked")
    monkeypatch.setattr(cli.common, "load_models", refuse)


def commands_use(monkeypatch, pair):
    """Every command loads ``pair`` (target, draft, tokenizer) in place of the models its flags name."""
    from diversed_ext import cli

    monkeypatch.setattr(cli.common, "load_models", lambda target, draft, device, **drafter: pair)


def gsm8k_file(path, count=3):
    """:func:`~.models.gsm8k_examples` written to ``path`` as a GSM8K jsonl; returns the path as text."""
    path.write_text("".join(json.dumps(example) + "\n" for example in gsm8k_examples(count)))
    return str(path)
