"""The lean forward's floor (diversed_ext.forward): the verify ops and the head never load it (nor the models), and a
build without the forward's native ops keeps decoding through the models' own forward while what needs those ops says
so."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from diversed_ext.decoding.runners import HFRunner, make_runner  # noqa: E402
from diversed_ext.forward import _native  # noqa: E402
from diversed_ext.forward import ForwardOpsMissing, LlamaRunner, pack_float, pack_int8, supports_fast_forward  # noqa
from helpers import forward_llama  # noqa: E402

def _run_python(code: str) -> dict:
    """``code`` in a fresh interpreter (imports cannot be undone in this one); it prints one JSON object."""
    # The same diversed_ext as this process: the installed package (a checkout has no built library unless it was
    # built in place, and then PYTHONPATH names it and passes through).
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_verify_ops_do_not_load_the_forward():
    loaded = _run_python("import json, sys, diversed_ext, diversed_ext.ops; "
                         "print(json.dumps(sorted(m for m in sys.modules if m.startswith('diversed_ext.forward'))))")
    assert loaded == []


def test_the_head_loads_neither_the_models_nor_the_forward():
    # What a server imports to run a head: the head, its rules and the ops, nothing of the models or the lean forward.
    loaded = _run_python("import json, sys, diversed_ext.head, diversed_ext.rules; print(json.dumps(sorted(m for m in "
                         "sys.modules if m.startswith(('diversed_ext.models', 'diversed_ext.forward')))))")
    assert loaded == []


def test_the_rules_import_neither_torch_nor_vllm():
    # The package's __init__ loads the ops (and torch); the rules module itself needs only the standard library, so
    # the vLLM plugin's settings can use it before any engine or tensor exists.
    import ast
    import diversed_ext.rules as rules

    tree = ast.parse(Path(rules.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "math", "numbers"}, imported


@pytest.fixture
def without_forward_ops(monkeypatch):
    """This process as a verify-only build would see it: none of the forward's ops defined."""
    monkeypatch.setattr(_native, "_op_defined", lambda name: False)
    _native.forward_ops_built.cache_clear()
    yield
    monkeypatch.undo()
    _native.forward_ops_built.cache_clear()


def test_without_the_forward_ops_decoding_runs_the_models_own_forward(without_forward_ops):
    model = forward_llama(0)
    assert not supports_fast_forward(model)
    assert isinstance(make_runner(model, torch.device("cpu"), fast_forward=True), HFRunner)


def test_without_the_forward_ops_what_needs_them_says_so(without_forward_ops):
    with pytest.raises(ForwardOpsMissing, match=r"LlamaRunner needs .*diversed::int8_pack"):
        LlamaRunner(forward_llama(0))
    with pytest.raises(ForwardOpsMissing, match="pack_int8 needs"):
        pack_int8([(torch.ones(2, 4, dtype=torch.int8), 0.1, None)])
    with pytest.raises(ForwardOpsMissing, match="pack_float needs"):
        pack_float([(torch.ones(2, 4), None)])


def test_this_build_carries_the_forward_ops():
    # The suite's other forward tests would skip nothing silently: they need these ops and this build has them.
    assert _native.forward_ops_built()
    assert supports_fast_forward(forward_llama(0))
