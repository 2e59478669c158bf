"""Without an engine: the sampler's layout mapping between vLLM's flattened rows and diversed_ext's [B, K] blocks,
and the version check in front of the seams."""

from __future__ import annotations

import pytest
import torch

from diversed_ext import ops
from diversed_ext.vllm_plugin.sampler import PLACEHOLDER_TOKEN_ID, PaddedRows, expand_per_request, vllm_layout


def test_expand_repeats_each_request_over_its_tokens_and_replaces_first():
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # the second request has no tokens
    values = torch.tensor([0.5, 0.7, 0.0, 2.0])
    expanded = expand_per_request(values, cu, 6, replace_from=0.0, replace_to=1.0)
    assert expanded.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 2.0] and expanded.dtype == torch.float32
    top_k = expand_per_request(torch.tensor([5, 7, 9, 11], dtype=torch.int32), cu, 6)
    assert top_k.tolist() == [5, 5, 9, 9, 9, 11] and top_k.dtype == torch.int32


def test_padded_rows_gather_ragged_requests():
    rows = PaddedRows([2, 0, 3], torch.tensor([2, 2, 5]), max_spec_len=3)
    flat = torch.tensor([10, 11, 20, 21, 22])
    assert rows.gather(flat, fill=-7).tolist() == [[10, 11, -7], [-7, -7, -7], [20, 21, 22]]
    assert rows.valid.tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    wide = torch.arange(10.0).reshape(5, 2)
    assert rows.gather(wide, fill=0.5)[1].tolist() == [[0.5, 0.5]] * 3


def test_layout_puts_vllms_bonus_where_every_draft_was_kept():
    rows = PaddedRows([2, 0, 3], torch.tensor([2, 2, 5]), max_spec_len=3)
    result = ops.VerifyResult(tokens=torch.tensor([[10, 11, 99, -1], [98, -1, -1, -1], [20, 5, -1, -1]]),
                              num_accepted=torch.tensor([2, 0, 1]), accept_prob=torch.zeros(3, 3))
    bonus = torch.tensor([[40], [41], [42]], dtype=torch.int32)
    out = vllm_layout(result, rows, bonus)
    assert out.dtype == torch.int32
    assert out.tolist() == [[10, 11, 40, PLACEHOLDER_TOKEN_ID], [41, -1, -1, -1], [20, 5, -1, -1]]


def test_the_installed_vllm_is_the_tested_one():
    from diversed_ext.vllm_plugin.hooks import seam_problems

    assert seam_problems() == []


def test_an_untested_vllm_is_refused_only_when_diversed_is_asked_for(monkeypatch):
    import types

    import vllm

    from diversed_ext.vllm_plugin import hooks

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    assert "vLLM 0.99.0" in hooks.seam_problems()[0]
    with pytest.raises(hooks.DiversedStartupError, match="differs from the one the plugin was tested with"):
        hooks.check_engine(types.SimpleNamespace(additional_config={"diversed": {}}, speculative_config=object()))
    hooks.check_engine(types.SimpleNamespace(additional_config={}, speculative_config=None))  # not asked: no error


def test_the_hooks_are_installed_once_and_keep_vllms_signatures():
    import inspect

    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from diversed_ext.vllm_plugin import register

    register()
    wrapped = InputProcessor._validate_params
    register()  # vLLM loads plugins in several places of one process
    assert InputProcessor._validate_params is wrapped
    assert list(inspect.signature(InputProcessor._validate_params).parameters) == ["self", "params", "supported_tasks"]
    assert getattr(GPUModelRunner, "_diversed_hooked", False)
