"""Every ``diversed`` command line in the bash blocks of README.md and docs/*.md parses with the command's own parser:
a renamed or removed flag, a changed choice or a value of the wrong type in a documented command (the commands behind
RESULTS.md's figures included) fails here instead of in a reader's terminal. Parsing only: nothing runs. How a
documented line becomes arguments (brackets, ``...``, placeholders) is helpers/documents.py's. The arguments after
``diversed bench e2e`` belong to the benchmark script's parser: package/test_documented_benchmarks.py parses them.
"""

import re

import pytest

from diversed_ext.cli import build_parser
from helpers import DOCUMENTS, command_lines, parse_outcome, typed_arguments

COMMAND = re.compile(r"^(?:\S*/)?diversed\s")  # `diversed ...` or `.venv/bin/diversed ...`
COMMANDS = [(document.name, line) for document in DOCUMENTS for line in command_lines(document) if COMMAND.match(line)]


def test_the_documents_show_commands():
    assert len(COMMANDS) >= 20
    assert {name for name, _ in COMMANDS} >= {"README.md", "decoding.md", "training.md", "RESULTS.md"}


@pytest.mark.parametrize("document, command", COMMANDS, ids=[f"{name}:{command[:60]}" for name, command in COMMANDS])
def test_the_documented_command_parses(document, command):
    parsed, exit_code, errors = parse_outcome(build_parser().parse_args, typed_arguments(command)[1:])
    # --version prints and exits 0; a parse error exits 2 after saying why
    assert exit_code in (None, 0), f"{document}: `{command}` does not parse: {errors}"
    assert exit_code == 0 or parsed.command


def test_a_wrong_flag_fails_the_check():
    arguments = typed_arguments("diversed eval --methods sd  # a flag that does not exist")[1:]
    assert parse_outcome(build_parser().parse_args, arguments)[1] == 2
