"""Every ``diversed`` command line in the bash blocks of README.md and docs/*.md parses with the command's own parser:
a renamed or removed flag, a changed choice or a value of the wrong type in a documented command (the commands behind
RESULTS.md's figures included) fails here instead of in a reader's terminal. Parsing only: nothing runs.

Optional parts in brackets are parsed as if given, ``...`` is left out, and a bare capital placeholder stands for a
sample value (``--steps N``); other placeholders (``PATH/...``, ``DIR``) are strings the parser takes as they are.
The arguments after ``diversed bench e2e`` belong to the benchmark script's own parser, not to this one.
"""

import argparse
import contextlib
import io
import re
import shlex

import pytest

from diversed_ext.cli import build_parser
from helpers import DOCUMENTS

BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
COMMAND = re.compile(r"^(?:\S*/)?diversed\s")  # `diversed ...` or `.venv/bin/diversed ...`
PLACEHOLDERS = {"N": "4", "K": "3", "M": "1", "W": "2", "T": "0.3"}


def documented_commands() -> list:
    """(document name, command line) of every ``diversed`` command in a bash block, continuation lines joined."""
    found = []
    for document in DOCUMENTS:
        for block in BASH_BLOCK.findall(document.read_text(encoding="utf-8")):
            for line in block.replace("\\\n", " ").splitlines():
                if COMMAND.match(line.strip()):
                    found.append((document.name, " ".join(line.split())))
    return found


def arguments(command: str) -> list:
    """The command's arguments as a reader would type them: brackets dropped, placeholders filled, comments cut."""
    words = shlex.split(command.replace("[", " ").replace("]", " "), comments=True)[1:]
    return [PLACEHOLDERS.get(word, word) for word in words if word != "..."]


COMMANDS = documented_commands()


def test_the_documents_show_commands():
    assert len(COMMANDS) >= 20
    assert {name for name, _ in COMMANDS} >= {"README.md", "decoding.md", "training.md", "RESULTS.md"}


@pytest.mark.parametrize("document, command", COMMANDS, ids=[f"{name}:{command[:60]}" for name, command in COMMANDS])
def test_the_documented_command_parses(document, command):
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parsed = build_parser().parse_args(arguments(command))
    except SystemExit as exit:  # --version prints and exits 0; a parse error exits 2 after saying why
        assert exit.code == 0, f"{document}: `{command}` does not parse: {errors.getvalue().strip()}"
        return
    assert isinstance(parsed, argparse.Namespace) and parsed.command


def test_a_wrong_flag_fails_the_check():
    with pytest.raises(SystemExit) as exit, contextlib.redirect_stderr(io.StringIO()):
        build_parser().parse_args(arguments("diversed eval --methods sd  # a flag that does not exist"))
    assert exit.value.code == 2
