"""The vLLM plugin's configuration rules, without vLLM: the engine entry and each request's fields."""

import math

import pytest

from diversed_ext.vllm_plugin.settings import (DEFAULT_WEIGHT, DiversedConfigError, EngineSettings, FlySettings,
                                               RequestChoice, RequestSettings, parse_engine_entry, parse_request,
                                               request_settings)


def test_engine_entry_defaults_to_exact_verification():
    assert parse_engine_entry({}) == EngineSettings(weight=DEFAULT_WEIGHT)
    assert parse_engine_entry(None).weight == 1.0


def test_engine_entry_weight_head_and_heads():
    settings = parse_engine_entry({"weight": 0.25, "heads": ["a", "b", "a"]})
    assert settings.weight == 0.25 and settings.head is None and list(settings.head_paths) == ["a", "b"]
    settings = parse_engine_entry({"head": "default", "heads": ["x"]})
    assert settings.head == "default" and list(settings.head_paths) == ["default", "x"]
    assert parse_engine_entry({"weight": 0}).weight == 0.0


@pytest.mark.parametrize("entry, message", [
    ([0.5], "must be a mapping"), ({"weight": 1.5}, r"in \[0, 1\]"), ({"weight": math.nan}, r"in \[0, 1\]"),
    ({"weight": "0.5"}, "must be a number"), ({"weight": True}, "must be a number"), ({"wieght": 1}, "unknown keys"),
    ({"weight": 0.5, "head": "a"}, "not both"), ({"heads": "a"}, "must be a list"), ({"head": ""}, "non-empty"),
    ({"heads": [3]}, r"\['heads'\]\[0\]"), ({"verifier": "exact"}, "must be one of"),
    ({"verifier": "vllm", "heads": ["a"]}, "takes no weight or heads"),
])
def test_bad_engine_entries_name_the_key(entry, message):
    with pytest.raises(DiversedConfigError, match=message):
        parse_engine_entry(entry)


def test_requests_pick_a_weight_or_a_loaded_head():
    settings = parse_engine_entry({"weight": 0.5, "heads": ["fast"]})
    assert parse_request(None, settings) == RequestChoice()
    assert parse_request({"other_plugin": 1}, settings) == RequestChoice()
    assert parse_request({"diversed_weight": 1}, settings) == RequestChoice(weight=1.0)
    assert parse_request({"diversed_head": "fast"}, settings) == RequestChoice(head="fast")
    assert parse_request({"other_plugin": 1}, None) == RequestChoice()  # engines without the entry ignore others


@pytest.mark.parametrize("extra_args, message", [
    ({"diversed_weight": -0.1}, "diversed_weight"), ({"diversed_weight": math.inf}, "diversed_weight"),
    ({"diversed_weight": None}, "diversed_weight"), ({"diversed_weight": [0.5]}, "diversed_weight"),
    ({"diversed_head": "slow"}, r"diversed_head must name a head this engine loaded \(\['fast'\]\)"),
    ({"diversed_head": 3}, "diversed_head"), ({"diversed_w": 0.5}, "unknown request field 'diversed_w'"),
    ({"diversed_weight": 0.5, "diversed_head": "fast"}, "not both"),
])
def test_bad_request_fields_are_value_errors_naming_the_field(extra_args, message):
    with pytest.raises(ValueError, match=message):
        parse_request(extra_args, parse_engine_entry({"heads": ["fast"]}))


def test_request_fields_need_an_engine_that_verifies_with_diversed():
    with pytest.raises(ValueError, match="no additional_config"):
        parse_request({"diversed_weight": 0.5}, None)
    with pytest.raises(ValueError, match="verifies exactly"):
        parse_request({"diversed_weight": 0.5}, parse_engine_entry({"verifier": "vllm"}))


def test_fly_in_the_engine_entry_and_per_request():
    settings = parse_engine_entry({"weight": 0.5, "fly": {"window": 2}})
    assert settings.fly == FlySettings(window=2, threshold=0.3, top_k=3)
    assert parse_engine_entry({}).fly.window == 0  # off unless asked for
    assert parse_engine_entry({"fly": {"window": 1, "threshold": 0.6, "top_k": 5}}).fly == FlySettings(1, 0.6, 5)
    assert parse_request({"diversed_fly_window": 1, "diversed_weight": 0.7}, settings) == RequestChoice(
        weight=0.7, fly_window=1)
    assert parse_request({"diversed_fly_threshold": 0}, settings) == RequestChoice(fly_threshold=0.0)


@pytest.mark.parametrize("entry, message", [
    ({"fly": 2}, "must be a mapping"), ({"fly": {"windw": 1}}, "unknown keys"),
    ({"fly": {"window": -1}}, r"\['fly'\]\['window'\] must be >= 0"),
    ({"fly": {"window": 1.5}}, "window"), ({"fly": {"threshold": math.nan}}, "threshold"),
    ({"fly": {"top_k": 0}}, r"top_k'\] must lie in \[1, 32\]"),
    ({"verifier": "vllm", "fly": {"window": 1}}, "nor FLy"),
])
def test_bad_fly_entries_name_the_key(entry, message):
    with pytest.raises(DiversedConfigError, match=message):
        parse_engine_entry(entry)


@pytest.mark.parametrize("extra_args, message", [
    ({"diversed_fly_window": -1}, "diversed_fly_window must be >= 0"),
    ({"diversed_fly_window": "2"}, "diversed_fly_window"),
    ({"diversed_fly_threshold": -0.1}, "diversed_fly_threshold must be >= 0"),
])
def test_bad_fly_request_fields_are_value_errors(extra_args, message):
    with pytest.raises(ValueError, match=message):
        parse_request(extra_args, parse_engine_entry({}))


def test_a_requests_choice_wins_over_the_engines_defaults():
    settings = parse_engine_entry({"head": "h", "heads": ["g"], "fly": {"window": 2, "threshold": 0.5}})
    assert request_settings(RequestChoice(), settings) == RequestSettings(1.0, "h", 2, 0.5)
    assert request_settings(RequestChoice(weight=0.3), settings) == RequestSettings(0.3, None, 2, 0.5)
    assert request_settings(RequestChoice(head="g", fly_window=0), settings) == RequestSettings(1.0, "g", 0, 0.5)
    static = parse_engine_entry({"weight": 0.4})
    assert request_settings(RequestChoice(fly_threshold=0.1), static) == RequestSettings(0.4, None, 0, 0.1)


def test_the_gate_in_the_engine_entry_and_per_request():
    assert parse_engine_entry({}).gate_margin is None  # off unless asked for
    settings = parse_engine_entry({"weight": 0.5, "gate_margin": 4})
    assert settings.gate_margin == 4.0 and request_settings(RequestChoice(), settings).gate_margin == 4.0
    choice = parse_request({"diversed_gate_margin": -1.5, "diversed_head": "h"},
                           parse_engine_entry({"heads": ["h"]}))
    assert choice == RequestChoice(head="h", gate_margin=-1.5)
    assert request_settings(choice, settings) == RequestSettings(0.5, "h", 0, 0.3, -1.5)
    assert request_settings(RequestChoice(weight=0.2), parse_engine_entry({})).gate_margin is None


@pytest.mark.parametrize("entry, message", [
    ({"gate_margin": math.inf}, r"\['gate_margin'\] must be a finite number of nats"),
    ({"gate_margin": "4"}, "gate_margin"),
    ({"verifier": "vllm", "gate_margin": 1.0}, "nor FLy or the gate"),
])
def test_bad_gate_entries_name_the_key(entry, message):
    with pytest.raises(DiversedConfigError, match=message):
        parse_engine_entry(entry)


@pytest.mark.parametrize("value", [math.nan, -math.inf, "1", None, True])
def test_a_bad_request_gate_margin_is_a_value_error(value):
    with pytest.raises(ValueError, match="diversed_gate_margin"):
        parse_request({"diversed_gate_margin": value}, parse_engine_entry({}))


def test_the_plugin_package_imports_without_vllm():
    import diversed_ext.vllm_plugin as plugin

    plugin.register()  # vLLM absent here: nothing to attach to, no error
    assert plugin.REQUEST_WEIGHT == "diversed_weight"


@pytest.mark.parametrize("method, default_draft", [("eagle3", "smollm2-135m-eagle3"),
                                                   ("draft_model", "SmolLM2-135M-Instruct-int8"),
                                                   ("eagle", "SmolLM2-135M-Instruct-int8")])
def test_the_default_head_of_an_engine_is_the_one_for_its_drafter(method, default_draft):
    """A worker loads "default" as the default head, or in an eagle3 engine as the one trained on EAGLE-3 states
    (each head's pair names the drafter it was trained with)."""
    from types import SimpleNamespace

    from diversed_ext.vllm_plugin.hooks import _load_heads

    hidden = SimpleNamespace(get_hidden_size=lambda: 576)
    runner = SimpleNamespace(speculative_config=SimpleNamespace(method=method, draft_model_config=hidden),
                             model_config=hidden)
    heads = _load_heads(runner, parse_engine_entry({"heads": ["default", "smollm2-135m-lambda4"]}))
    assert heads["default"].config.pair["draft"] == default_draft
    assert heads["smollm2-135m-lambda4"].config.pair["draft"] == "SmolLM2-135M-Instruct-int8"  # names stay names
