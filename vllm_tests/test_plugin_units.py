"""Without an engine: the sampler's layout mapping between vLLM's flattened rows and diversed_ext's [B, K] blocks,
and the start-up refusals of engines that would verify some other way (the check of vLLM's code in front of the seams
is test_seams.py's)."""

from __future__ import annotations

import math
import types

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


def _speculative(**fields):
    import types

    spec = dict(method="draft_model", rejection_sample_method="standard", enable_adaptive_verification=False,
                num_speculative_tokens=3, fly_window_size=None, fly_entropy_threshold=0.3, fly_entropy_top_k=3)
    spec.update(fields)
    return types.SimpleNamespace(additional_config={"diversed": {"weight": 0.5}}, watermark_config=None,
                                 speculative_config=types.SimpleNamespace(**spec))


@pytest.mark.parametrize("fields, message", [
    (dict(method="dflash"), "speculative method 'dflash'"),
    (dict(parallel_drafting=True), "parallel_drafting=True"),
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


def test_heads_with_step3p5_mtp_are_refused_on_v1_only():
    """V1 proposes Step-3.5's MTP layers outside the hook where heads read hidden states; V2 through sample_draft."""
    from diversed_ext.vllm_plugin import drafters, startup

    def engine(model_type: str, *, v2: bool, heads: bool):
        config = _speculative(method="mtp", use_step3p5_mtp=lambda: model_type == "step3p5_mtp")
        config.use_v2_model_runner = v2
        return startup.speculation_problems(config, heads=heads)

    assert engine("step3p5_mtp", v2=False, heads=True) == [drafters.STEP3P5_V1]
    assert engine("step3p5_mtp", v2=True, heads=True) == engine("step3p5_mtp", v2=False, heads=False) == []
    assert engine("deepseek_mtp", v2=False, heads=True) == []


def test_vllms_fly_becomes_the_ops_fly_on_top_of_the_weight():
    from diversed_ext.vllm_plugin import startup
    from diversed_ext.vllm_plugin.settings import FlySettings

    engine = _speculative(rejection_sample_method="fly", fly_window_size=2, fly_entropy_threshold=0.6)
    settings = startup.check_engine(engine)
    assert settings.weight == 0.5 and settings.fly == FlySettings(window=2, threshold=0.6, top_k=3)
    assert startup.check_engine(_speculative()).fly.window == 0
    engine.additional_config["diversed"]["fly"] = {"window": 1}  # the entry's own FLy wins
    assert startup.check_engine(engine).fly == FlySettings(window=1)


def test_a_greedy_requests_drafts_are_tokens_whatever_its_neighbours():
    """With probabilistic drafts vLLM hands the draft's probabilities only when some request samples: a greedy request
    is verified with q one-hot at its draft either way. The case tells the rules apart: at w = 0.4 the draft (q 0.6,
    p 0.1) is the argmax of nu with q one-hot (0.64 against 0.48), not with q itself (0.40 against 0.44)."""
    from diversed_ext.vllm_plugin.sampler import verify_in_place

    target_logits = torch.tensor([[0.8, 0.1, 0.05, 0.05], [0.25, 0.25, 0.25, 0.25]]).log()
    draft_probs = torch.tensor([[0.2, 0.6, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft_ids, weight, greedy = torch.tensor([1, 0]), torch.tensor([0.4, 0.4]), torch.tensor([True, False])
    mixed = PaddedRows([1, 1], torch.tensor([1, 2]), 1)

    def verify(any_greedy: bool):
        return verify_in_place(mixed, draft_ids, draft_probs, target_logits, weight, greedy, torch.tensor([1, 2]), {},
                               any_greedy=any_greedy)

    alone = verify_in_place(PaddedRows([1], torch.tensor([1]), 1), draft_ids[:1], None, target_logits[:1],
                            weight[:1], greedy[:1], torch.tensor([1]), {})
    assert alone.num_accepted.tolist() == [1]
    assert verify(any_greedy=True).tokens[0].tolist() == alone.tokens[0].tolist()
    assert verify(any_greedy=False).num_accepted[0] == 0  # q read as given would reject it


def test_the_exact_verifier_passes_vllms_own_sampling_settings(monkeypatch):
    """verifier "vllm" on V1 calls vLLM's rejection_sample with its sampler's settings as vLLM's own forward does:
    use_fp64_gumbel, and vLLM 0.33.0's FLy (set by its __init__ from rejection_sample_method "fly"), not dropped."""
    from diversed_ext.vllm_plugin import sampler as plugin_sampler

    calls = []
    monkeypatch.setattr(plugin_sampler.vllm_rejection, "rejection_sample",
                        lambda *args, **kwargs: calls.append(kwargs) or "vLLM's tokens")
    vllm_sampler = types.SimpleNamespace(logprobs_mode="raw_logprobs", use_fp64_gumbel=True)
    exact = plugin_sampler.DiversedRejectionSampler(vllm_sampler).bind(None, "cpu", exact_vllm=True)
    metadata = types.SimpleNamespace(draft_token_ids=None, num_draft_tokens=[1], max_spec_len=1,
                                     cu_num_draft_tokens=None)
    assert exact._accept(metadata, None, None, None, None) == "vLLM's tokens"
    exact.fly_window_size, exact.fly_entropy_threshold, exact.fly_entropy_top_k = 2, 0.6, 4  # as 0.33.0's __init__
    exact._accept(metadata, None, None, None, None)
    assert calls == [dict(use_fp64_gumbel=True),
                     dict(use_fp64_gumbel=True, fly_window_size=2, fly_entropy_threshold=0.6, fly_entropy_top_k=4)]


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


def test_a_requests_fly_window_must_be_below_the_engines_k():
    from diversed_ext.vllm_plugin import hooks, startup
    from diversed_ext.vllm_plugin.settings import RequestChoice, parse_request

    settings = startup.check_engine(_speculative(num_speculative_tokens=3))
    assert settings.num_speculative_tokens == 3
    assert parse_request({"diversed_fly_window": 2}, settings) == RequestChoice(fly_window=2)
    assert parse_request({"diversed_fly_window": 0}, settings) == RequestChoice(fly_window=0)  # FLy off
    with pytest.raises(ValueError, match="diversed_fly_window 3 must be below num_speculative_tokens 3"):
        parse_request({"diversed_fly_window": 3, "diversed_weight": 0.5}, settings)
    params = types.SimpleNamespace(extra_args={"diversed_fly_window": 5})
    with pytest.raises(hooks.DiversedRequestError, match="diversed_fly_window 5 must be below") as refused:
        hooks.check_request(params, settings)
    assert refused.value.parameter == "diversed_fly_window"  # vLLM's validation error: the server answers 400


def _with_vocabularies(target: int, draft: int, *, heads=(), **fields):
    engine = _speculative(**fields)
    engine.additional_config["diversed"]["heads"] = list(heads)
    engine.model_config = types.SimpleNamespace(get_vocab_size=lambda: target)
    engine.speculative_config.draft_model_config = types.SimpleNamespace(get_vocab_size=lambda: draft,
                                                                         hf_config=types.SimpleNamespace())
    return engine


def test_a_draft_vocabulary_other_than_the_targets_is_refused_where_its_distributions_are_read():
    from diversed_ext.vllm_plugin import startup

    assert startup.check_engine(_with_vocabularies(49152, 49152, heads=["default"], draft_sample_method="probabilistic"))
    # token-only drafts of a draft model with its own vocabulary reach the sampler as target ids
    assert startup.check_engine(_with_vocabularies(49152, 32000, use_heterogeneous_vocab=True))
    with pytest.raises(startup.DiversedStartupError, match=r"vocabulary \(32000 tokens.*learned heads"):
        startup.check_engine(_with_vocabularies(49152, 32000, heads=["default"]))
    with pytest.raises(startup.DiversedStartupError, match="draft_sample_method 'probabilistic'"):
        startup.check_engine(_with_vocabularies(49152, 32000, draft_sample_method="probabilistic"))


def test_the_gate_never_keeps_a_token_the_target_forbids():
    """At a margin that keeps every allowed draft, a draft the processed target rules out (a -inf logit, or a logit
    100 below the rest: a probability under the ops' support floor) is not kept, whatever its draft probability."""
    from diversed_ext.vllm_plugin.sampler import gate_keeps_rows

    logits = torch.zeros(4, 16)
    logits[0, 3] = -math.inf
    logits[1, 3] = -100.0
    tokens = torch.tensor([3, 3, 3, 5])
    draft_probs = torch.zeros(4, 16)
    draft_probs[:, 3] = 1.0
    draft_probs[3] = torch.softmax(torch.randn(16, generator=torch.Generator().manual_seed(0)), -1)
    for probs in (None, draft_probs):
        assert gate_keeps_rows(torch.full((4,), 1e6), tokens, probs, logits).tolist() == [False, False, True, True]


def test_the_v1_gate_reads_only_gated_requests_rows():
    """The gate of a batch whose middle request alone is gated keeps exactly what it keeps on that request's rows
    read alone, and nothing of the others; a request with no drafts is skipped."""
    from diversed_ext.vllm_plugin.sampler import gate_keeps_requests, gate_keeps_rows

    generator = torch.Generator().manual_seed(3)
    num_draft = [2, 3, 0, 2]
    cu = torch.tensor([2, 5, 5, 7])
    logits = torch.randn(7, 32, generator=generator) * 3
    tokens = torch.randint(32, (7,), generator=generator)
    tokens[::2] = logits[::2].argmax(-1)  # likely drafts the gate keeps, beside unlikely ones it does not
    metadata = types.SimpleNamespace(num_draft_tokens=num_draft, draft_token_ids=tokens)
    rows = PaddedRows(num_draft, cu, max_spec_len=3)
    greedy = torch.zeros(4, dtype=torch.bool)
    keep = gate_keeps_requests(rows, [1, 2], torch.tensor([0.5, 0.5]), greedy, metadata, None, logits)
    alone = gate_keeps_rows(torch.full((3,), 0.5), tokens[2:5], None, logits[2:5])
    assert keep[1].tolist() == alone.tolist() and alone.any() and not alone.all()
    assert not keep[[0, 2, 3]].any()
    every = gate_keeps_requests(rows, [0, 1, 2, 3], torch.full((4,), 0.5), greedy, metadata, None, logits)
    assert every.tolist() == rows.gather(gate_keeps_rows(torch.full((7,), 0.5), tokens, None, logits),
                                         fill=False).tolist()
    greedy[1] = True  # greedy requests are never gated
    assert not gate_keeps_requests(rows, [1], torch.tensor([0.5]), greedy, metadata, None, logits).any()


class _RaisingHead:
    """A loaded head that fails the test if it is ever run."""

    wants_distributions = True

    def __call__(self, *inputs):
        raise AssertionError("a head ran for requests that did not ask for it")


def _v1_runner(extra_args: list):
    from vllm import SamplingParams

    request_ids = [f"request-{index}" for index in range(len(extra_args))]
    requests = {request_id: types.SimpleNamespace(sampling_params=SamplingParams(extra_args=args))
                for request_id, args in zip(request_ids, extra_args)}
    return types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=request_ids), requests=requests,
                                 device=torch.device("cpu"))


def test_v1_without_head_requests_no_head_runs_and_the_capture_keeps_nothing():
    from diversed_ext.vllm_plugin.settings import EngineSettings
    from diversed_ext.vllm_plugin.weights import RequestWeights

    settings = EngineSettings(weight=0.5, head_paths=("default",))
    capture = types.SimpleNamespace(plan=None, row_of={}, hidden=None, target_hidden=None)
    runner = _v1_runner([None, {"diversed_weight": 0.2}, None])
    weights = RequestWeights(runner, settings, {"default": _RaisingHead()}, capture)
    rows = PaddedRows([3, 3, 3], torch.tensor([3, 6, 9]), max_spec_len=3)
    assert weights(rows, torch.zeros(9, 8), None, torch.arange(9)).tolist() == pytest.approx([0.5, 0.2, 0.5])
    assert weights.gate() is None
    assert capture.plan(runner.input_batch.req_ids) == ([], False)
    mixed = _v1_runner([None, {"diversed_head": "default"}, {"diversed_gate_margin": 2.0}])
    weights = RequestWeights(mixed, settings, {"default": _RaisingHead()}, capture)
    assert capture.plan(mixed.input_batch.req_ids) == ([1], True)
    weights(rows, torch.zeros(9, 8), types.SimpleNamespace(temperature=None), torch.arange(9))
    assert weights.gate()[0] == [2]


def test_the_v1_capture_keeps_only_the_rows_it_is_told_and_their_logits_only_when_read():
    from diversed_ext.vllm_plugin.heads import HiddenStateCapture

    calls = []

    def compute_logits(hidden):
        calls.append(hidden.shape[0])
        return hidden @ torch.ones(hidden.shape[1], 5)

    drafter = types.SimpleNamespace(model=types.SimpleNamespace(compute_logits=compute_logits))
    runner = types.SimpleNamespace(drafter=drafter, input_batch=types.SimpleNamespace(req_ids=["a", "b", "c"]),
                                   sample_tokens=lambda: None, execute_model_state=None, device=torch.device("cpu"))
    hidden = torch.arange(12.0).reshape(3, 4)

    def propose():
        for _ in range(2):
            drafter._sample_draft_tokens(hidden, None)

    drafter.propose, drafter._sample_draft_tokens = propose, lambda hidden_states, metadata: None
    capture = HiddenStateCapture(runner, keep_draft_logits=True)
    capture.plan = lambda request_ids: ([], False)
    drafter.propose()
    assert capture.row_of == {} and calls == []
    capture.plan = lambda request_ids: ([2], False)
    drafter.propose()
    assert capture.row_of == {"c": 0} and capture.hidden.tolist() == [[hidden[2].tolist()] * 2]
    assert capture.logits is None and calls == []
    capture.plan = lambda request_ids: ([0, 2], True)
    drafter.propose()
    assert capture.row_of == {"a": 0, "c": 1} and calls == [2, 2] and capture.logits.shape == (2, 2, 5)


def test_drafted_features_read_the_captured_rows_in_place():
    """What a head reads in the sampler step: the draft's captured raw logits (bfloat16, rows of a [S, Kd, V] table,
    Kd above the step's K) at each request's temperature, beside vLLM's float32 target rows already divided by it;
    the same features as those rows gathered, divided and widened first (0, greedy, counts as 1)."""
    from diversed_ext.head import distribution_features
    from diversed_ext.vllm_plugin.heads import drafted_features

    generator = torch.Generator().manual_seed(4)
    table = (torch.randn(5, 4, 301, generator=generator) * 3).bfloat16()
    table_rows = torch.tensor([3, 0, 3])
    temperature = torch.tensor([0.7, 0.0, 1.6])
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None, None]
    target_logits = torch.randn(11, 301, generator=generator) * 3
    target_rows = torch.tensor([[9, 1, 4], [0, 2, 2], [10, 5, 7]])
    features = drafted_features(table, table_rows, target_logits, target_rows, temperature)
    gathered = distribution_features(table[table_rows, :3].float() / scale, target_logits[target_rows])
    assert features.shape == (3, 3, len(ops.DISTRIBUTION_FEATURES))
    torch.testing.assert_close(features, gathered, atol=2e-6, rtol=0)


def test_stopping_an_engine_finishes_after_vllms_shutdown_race(monkeypatch):
    """The tests' stop_engine: when vLLM's shutdown raises psutil.NoSuchProcess (a child exited while it was being
    named), the engine's processes are shut down again and the client's resources closed."""
    import psutil
    import vllm.v1.utils
    from engines import stop_engine

    calls = []

    def raced():
        raise psutil.NoSuchProcess(123)

    class Resources:
        engine_manager = types.SimpleNamespace(processes=["engine core"])

        def __call__(self):
            calls.append("resources closed")

    resources = Resources()
    core = types.SimpleNamespace(shutdown=raced, resources=resources)
    monkeypatch.setattr(vllm.v1.utils, "shutdown", lambda processes: calls.append(("shut down", processes)))
    stop_engine(types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=core)))
    assert calls == [("shut down", ["engine core"]), "resources closed"]
