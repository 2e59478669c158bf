"""The sampler's layout mapping between vLLM's flattened rows and diversed_ext's [B, K] blocks, without an engine."""

from __future__ import annotations

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
