"""What the documents show, for the tests that hold them to the code: their prose and fenced blocks, their command
lines, the command arguments a reader would type, and what a parser makes of them (README.md and docs/*.md are
DOCUMENTS in helpers/__init__.py)."""

import contextlib
import io
import re
import shlex

__all__ = ["prose_lines", "fenced_blocks", "command_lines", "typed_arguments", "parse_outcome"]

FENCED_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`([^`]+)`")
# A bare capital in a documented command stands for a value of its flag (`--steps N`): these are sample values.
PLACEHOLDERS = {"N": "4", "K": "3", "M": "1", "W": "2", "T": "0.3"}


def prose_lines(document):
    """The document's lines outside fenced code blocks (where a '#' starts a comment, not a heading)."""
    in_code = False
    for line in document.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            yield line


def fenced_blocks(document, language: str) -> list:
    """The bodies of the document's ```<language> blocks, in order."""
    return [body for lang, body in FENCED_BLOCK.findall(document.read_text(encoding="utf-8")) if lang == language]


def command_lines(document, *, inline: bool = False) -> list:
    """Every command line of the document's bash blocks (continuation lines joined, whitespace collapsed) and, with
    ``inline``, every inline code span of its prose (a span may run over a line break)."""
    lines = [" ".join(line.split()) for block in fenced_blocks(document, "bash")
             for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    if inline:
        prose = "\n".join(prose_lines(document))
        lines += [" ".join(span.split()) for span in INLINE_CODE.findall(prose)]
    return lines


def typed_arguments(words: str) -> list:
    """The arguments as a reader would type them: optional parts in brackets given, ``...`` left out, capital
    placeholders filled with sample values, a trailing comment cut."""
    split = shlex.split(words.replace("[", " ").replace("]", " "), comments=True)
    return [PLACEHOLDERS.get(word, word) for word in split if word != "..."]


def parse_outcome(parse, arguments: list) -> tuple:
    """``(namespace, exit code, what it wrote to stderr)`` of an argparse ``parse(arguments)``: the namespace and None
    when it parses, None and the exit status when it exits (0 for --version or --help, 2 for an error)."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            return parse(arguments), None, errors.getvalue()
    except SystemExit as exit:
        return None, exit.code, errors.getvalue().strip()
