"""Module paths named in the package's docstrings and comments, and in the comments of the native sources under
csrc/, stay true: every ``diversed_ext.x.y`` dotted name resolves to a module (and, past the module, a name that
module defines or imports), and every ``diversed_ext/x.py`` or ``csrc/...``, ``bench/...``, ``docs/...`` path names an
existing file. Read statically: nothing is imported."""

import ast
import functools
import re
from pathlib import Path

import pytest

from helpers import REPO_ROOT as ROOT
PACKAGE = ROOT / "diversed_ext"
DOTTED = re.compile(r"\bdiversed_ext(?:\.[A-Za-z_]\w*)+")
# Dotted names that are not module paths: the format name head.json files carry (changing it would orphan them).
# The compiled extension is a module with no source file here.
NOT_MODULE_PATHS = {"diversed_ext.EnsembleHead", "diversed_ext._C"}
FILE_PATH = re.compile(r"\b(?:diversed_ext|csrc|bench|docs|scripts|python_tests)/[\w/.-]*\w"
                       r"\.(?:py|h|cpp|cu|cuh|md|sh)\b")


NATIVE = ROOT / "csrc"
NATIVE_SUFFIXES = (".h", ".cpp", ".cu", ".cuh")


def _sources() -> list:
    return sorted(PACKAGE.rglob("*.py"))


def _native_sources() -> list:
    return sorted(path for path in NATIVE.rglob("*") if path.suffix in NATIVE_SUFFIXES)


def _comment_lines(path: Path):
    """(line number, comment text) of a C++/CUDA file: what follows ``//`` and the inside of ``/* ... */``."""
    in_block = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = ""
        while line:
            if in_block:
                end = line.find("*/")
                text += line if end < 0 else line[:end]
                line = "" if end < 0 else line[end + 2:]
                in_block = end < 0
                continue
            slash, block = line.find("//"), line.find("/*")
            if slash >= 0 and (block < 0 or slash < block):
                text += line[slash + 2:]
                break
            if block < 0:
                break
            line, in_block = line[block + 2:], True
        if text:
            yield number, text


def _native_mentions(pattern: re.Pattern) -> list:
    return [(path.relative_to(ROOT), number, match.group(0).rstrip("."))
            for path in _native_sources() for number, text in _comment_lines(path)
            for match in pattern.finditer(text)]


def _module_file(parts: tuple):
    """The file of module ``parts`` (a package's __init__.py), or None when no such module exists."""
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def _top_level_names(path: Path) -> frozenset:
    """Names a module binds at its top level: definitions, assignments and imports."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name))
    return frozenset(names)


def _resolves(dotted: str) -> bool:
    """The longest prefix of ``dotted`` that is a module exists, and the name after it (if any) is bound there or is
    a submodule of it; attributes past that name (a method) are not checked."""
    parts = tuple(dotted.split("."))
    for length in range(len(parts), 0, -1):
        module = _module_file(parts[:length])
        if module is not None:
            return length == len(parts) or parts[length] in _top_level_names(module)
    return False


def _mentions(pattern: re.Pattern) -> list:
    return [(path.relative_to(ROOT), number, match.group(0).rstrip("."))
            for path in _sources() for number, line in enumerate(path.read_text().splitlines(), 1)
            for match in pattern.finditer(line)]


def test_the_scan_finds_mentions():
    # A regex gone wrong would pass the checks below vacuously.
    assert len(_mentions(DOTTED)) > 20 and len(_mentions(FILE_PATH)) > 5


def test_dotted_module_names_resolve():
    stale = [f"{path}:{number}: {name}" for path, number, name in _mentions(DOTTED)
             if name not in NOT_MODULE_PATHS and not _resolves(name)]
    assert not stale, "dotted names that name no module or attribute:\n" + "\n".join(stale)


def test_native_comments_name_existing_files_and_modules():
    mentions = _native_mentions(FILE_PATH)
    assert len(mentions) > 5  # the scan works
    stale = {(str(path), name) for path, _, name in mentions if not (ROOT / name).is_file()}
    stale |= {(str(path), name) for path, _, name in _native_mentions(DOTTED)
              if name not in NOT_MODULE_PATHS and not _resolves(name)}
    assert not stale, "paths in native comments that name nothing:\n" + "\n".join(
        f"{path}: {name}" for path, name in sorted(stale))


def test_comment_scan_of_native_sources(tmp_path):
    source = tmp_path / "x.h"
    source.write_text("int a;  // see diversed_ext/ops/api.py\n/* one\n   csrc/ops.cpp */ int b;\nint c; /* d */\n")
    assert [(number, text.strip()) for number, text in _comment_lines(source)] == [
        (1, "see diversed_ext/ops/api.py"), (2, "one"), (3, "csrc/ops.cpp"), (4, "d")]


def test_file_paths_exist():
    stale = [f"{path}:{number}: {name}" for path, number, name in _mentions(FILE_PATH) if not (ROOT / name).is_file()]
    assert not stale, "paths that name no file:\n" + "\n".join(stale)


@pytest.mark.parametrize("dotted, expected", [("diversed_ext.forward.llama_runner.LlamaRunner", True),
                                              ("diversed_ext.forward.LlamaRunner.run_rows", True),
                                              ("diversed_ext.fast_llama", False),
                                              ("diversed_ext.ops.no_such_name", False)])
def test_resolution_rule(dotted, expected):
    assert _resolves(dotted) is expected
