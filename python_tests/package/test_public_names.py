"""Every public name (a package's ``__all__``) exists, carries a docstring, and is named in the documents.

A name is "named" when it stands in code in README.md or docs/*.md: a fenced block, or an inline span (`` `name` ``,
`` `name(...)` ``, `` `dx.name` ``..., which may run over a line break within its paragraph). So a newcomer who meets
the name in code finds it in the docs, and a name added to ``__all__`` without a word of documentation fails here.
"""

import importlib
import inspect
import re

import pytest

from helpers import DOCUMENTS

PUBLIC_MODULES = ("diversed_ext", "diversed_ext.ops", "diversed_ext.decoding", "diversed_ext.models",
                  "diversed_ext.forward", "diversed_ext.head", "diversed_ext.rules", "diversed_ext.vllm_plugin",
                  "diversed_ext.research.sandbox", "diversed_ext.cli")
FENCED_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`((?:[^`\n]|\n(?!\s*\n))+)`")  # no blank line inside: spans end with their paragraph
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def words_in_code_spans(text: str) -> set:
    """The identifiers in ``text``'s fenced blocks and inline code spans."""
    blocks = FENCED_BLOCK.findall(text)
    prose = FENCED_BLOCK.sub("", text)
    return {word for code in [*blocks, *CODE_SPAN.findall(prose)] for word in IDENTIFIER.findall(code)}


DOCUMENTED = set().union(*(words_in_code_spans(path.read_text(encoding="utf-8")) for path in DOCUMENTS))


def _public(module_name: str) -> list:
    module = importlib.import_module(module_name)
    return [(name, getattr(module, name, None)) for name in module.__all__]


def _cases():
    return [pytest.param(module_name, name, obj, id=f"{module_name}.{name}")
            for module_name in PUBLIC_MODULES for name, obj in _public(module_name)]


def test_the_scan_reads_code_spans_only():
    text = ("Call `dx.verify(draft,\n w=0.5)` or `SpeculativeDecoder`; summarize is prose.\n\nA ` tick\n\n"
            "alone, then\n```python\nfrom m import gate\n```\n")
    assert words_in_code_spans(text) == {"dx", "verify", "draft", "w", "SpeculativeDecoder", "python", "from", "m",
                                         "import", "gate"}


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_all_lists_each_name_once_and_each_exists(module_name):
    module = importlib.import_module(module_name)
    assert len(set(module.__all__)) == len(module.__all__), f"{module_name}.__all__ repeats a name"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names what the module lacks: {missing}"


@pytest.mark.parametrize("module_name, name, obj", _cases())
def test_public_name_is_documented(module_name, name, obj):
    assert name in DOCUMENTED, f"{module_name}.{name} is public but no document names it in a code span"
    if inspect.isclass(obj) or inspect.isroutine(obj):
        assert inspect.getdoc(obj), f"{module_name}.{name} has no docstring"
