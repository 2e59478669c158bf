"""The EAGLE-3 head: its cache (one pass over T positions equals T single steps; crop and refeed equals the original),
its save/load round trip, its checkpoint layout against the one the vLLM tests build, the full-vocabulary logits, and
the conventions it shares with vLLM (aux layer ids, rotary embedding)."""

import json
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from diversed_ext.models.eagle3 import (AUX_LAYERS_DEFAULT, Eagle3Config, Eagle3Head, aux_hidden_states, rotate)

VLLM_TESTS = Path(__file__).resolve().parents[2] / "vllm_tests"
TARGET = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
              rms_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
              max_position_embeddings=256, vocab_size=17000, num_hidden_layers=30, model_type="llama",
              hidden_act="silu")


def make_head(seed=0, draft_vocab=40, vocab=64, dtype=torch.float64):
    torch.manual_seed(seed)
    config = Eagle3Config.from_target(dict(TARGET, vocab_size=vocab), draft_vocab)
    embed = torch.nn.Embedding(vocab, config.hidden_size).to(dtype)
    head = Eagle3Head(config, embed).to(dtype)
    with torch.no_grad():
        for p in head.parameters():  # norms away from 1 so that a swapped norm shows
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
    ids = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
    head.set_draft_vocabulary(ids)
    return head


def inputs(head, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, head.config.vocab_size, (T,), generator=g)
    aux = torch.randn(T, len(head.config.aux_layer_ids) * head.config.hidden_size, generator=g, dtype=torch.float64)
    return tokens, head.fuse(aux)


def test_step_over_t_positions_equals_single_steps():
    head = make_head()
    tokens, features = inputs(head, 9)
    with torch.no_grad():
        whole = head.new_cache()
        logits, hidden = head.step(tokens, features, whole)
        alone = head.new_cache()
        # a prefix of 4, then one at a time: the same logits and hidden states
        parts = [head.step(tokens[:4], features[:4], alone)]
        parts += [head.step(tokens[i:i + 1], features[i:i + 1], alone) for i in range(4, 9)]
    assert whole.length == alone.length == 9
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), logits)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), hidden)
    assert logits.shape == (9, head.config.draft_vocab_size) and hidden.shape == (9, head.config.hidden_size)


def test_positions_matter():
    """The same inputs fed after a different prefix give different outputs: the cache and rotary positions act."""
    head = make_head()
    tokens, features = inputs(head, 6)
    with torch.no_grad():
        a = head.step(tokens[3:], features[3:], head.new_cache())[0]
        b = head.step(tokens, features, head.new_cache())[0][3:]
    assert not torch.allclose(a, b)


def test_crop_and_refeed_equals_original():
    head = make_head()
    tokens, features = inputs(head, 8)
    other_tokens, other_features = inputs(head, 3, seed=7)
    with torch.no_grad():
        reference = head.step(tokens, features, head.new_cache())
        cache = head.new_cache()
        head.step(tokens[:5], features[:5], cache)
        head.step(other_tokens, other_features, cache)  # drafts later rejected
        cache.crop(5)
        assert cache.length == 5
        refed = head.step(tokens[5:], features[5:], cache)
    torch.testing.assert_close(refed[0], reference[0][5:])
    torch.testing.assert_close(refed[1], reference[1][5:])
    with pytest.raises(ValueError, match="keep"):
        cache.crop(9)


def test_full_vocab_logits_are_minus_infinity_outside():
    head = make_head()
    tokens, features = inputs(head, 3)
    with torch.no_grad():
        logits, _ = head.step(tokens, features, head.new_cache())
    full = head.full_vocab_logits(logits)
    inside = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    inside[head.draft_to_target] = True
    assert full.shape == (3, head.config.vocab_size)
    assert torch.isneginf(full[:, ~inside]).all()
    torch.testing.assert_close(full[:, head.draft_to_target], logits)


def test_save_load_round_trip(tmp_path):
    head = make_head(dtype=torch.float32)
    head.save_pretrained(tmp_path)
    loaded = Eagle3Head.from_pretrained(tmp_path, head.embed_tokens)
    assert loaded.config == head.config
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)
    tokens, features = inputs(head, 5)
    with torch.no_grad():
        a = head.step(tokens, features.float(), head.new_cache())
        b = loaded.step(tokens, features.float(), loaded.new_cache())
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert "embed_tokens.weight" not in head.state_dict()
    # bf16 on disk: loads, close
    head.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    low = Eagle3Head.from_pretrained(tmp_path / "bf16", head.embed_tokens)
    torch.testing.assert_close(low.fc.weight, head.fc.weight, rtol=1e-2, atol=1e-2)


def test_checkpoint_layout_matches_the_vllm_tests_checkpoint(tmp_path):
    """Names, shapes and dtypes of the tensors, and the config keys vLLM reads, equal those of the random EAGLE-3
    checkpoint the vLLM engine tests build; that checkpoint loads here with the same draft vocabulary."""
    from safetensors.torch import load_file

    sys.path.insert(0, str(VLLM_TESTS))
    try:
        import drafters
    finally:
        sys.path.remove(str(VLLM_TESTS))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET))
    pair = namedtuple("Pair", "target")(tmp_path / "target")
    reference = drafters.build_eagle3(pair, tmp_path / "reference")
    ids, _ = drafters.reduced_vocabulary(TARGET["vocab_size"])

    embed = torch.nn.Embedding(TARGET["vocab_size"], TARGET["hidden_size"])
    head = Eagle3Head(Eagle3Config.from_target(TARGET, ids.numel(), drafters.EAGLE3_AUX_LAYERS), embed)
    head.set_draft_vocabulary(ids)
    ours = head.save_pretrained(tmp_path / "ours")

    theirs_t, ours_t = load_file(str(reference / "model.safetensors")), load_file(str(ours / "model.safetensors"))
    assert sorted(ours_t) == sorted(theirs_t)
    for name in theirs_t:
        assert ours_t[name].shape == theirs_t[name].shape, name
        assert ours_t[name].dtype == theirs_t[name].dtype, name
    assert torch.equal(ours_t["d2t"], theirs_t["d2t"]) and torch.equal(ours_t["t2d"], theirs_t["t2d"])
    theirs_c = json.loads((reference / "config.json").read_text())
    ours_c = json.loads((ours / "config.json").read_text())
    for key in ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config", "num_hidden_layers",
                "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "vocab_size", "rope_parameters", "tie_word_embeddings"):
        assert ours_c[key] == theirs_c[key], key
    loaded = Eagle3Head.from_pretrained(reference, embed)
    assert torch.equal(loaded.draft_to_target, ids)


def test_aux_layer_id_is_the_stream_entering_that_layer():
    """Hugging Face's hidden_states[l] is the input of decoder layer l (vLLM's aux layer l): checked with hooks."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=5, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64)).eval()
    entering = {}
    hooks = [layer.register_forward_pre_hook(
        lambda module, args, kwargs, i=i: entering.__setitem__(i, (args[0] if args else kwargs["hidden_states"])),
        with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    ids = torch.tensor([[3, 7, 1, 9]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    aux = aux_hidden_states(out.hidden_states, (0, 2, 4))
    torch.testing.assert_close(aux, torch.cat([entering[0], entering[2], entering[4]], dim=-1))
    with pytest.raises(ValueError, match="layer id 5"):
        aux_hidden_states(out.hidden_states, (1, 5))  # the last entry is post-norm: not a layer's input


def test_rotary_embedding_equals_llamas():
    from transformers.models.llama import modeling_llama as hf

    config = hf.LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=8, rope_theta=100000.0,
                            max_position_embeddings=64)
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    positions = torch.tensor([[0, 3, 4, 5, 11, 40]])
    cos, sin = hf.LlamaRotaryEmbedding(config)(q, positions)
    hq, hk = hf.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(rotate(q, positions.unsqueeze(1), 100000.0), hq)
    torch.testing.assert_close(rotate(k, positions.unsqueeze(1), 100000.0), hk)


def test_bad_arguments_name_themselves():
    head = make_head()
    with pytest.raises(ValueError, match="token_ids"):
        head.step(torch.tensor([1, 2]), torch.zeros(3, 32, dtype=torch.float64), head.new_cache())
    with pytest.raises(ValueError, match="target_ids"):
        head.set_draft_vocabulary(torch.arange(3))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.from_target(TARGET, TARGET["vocab_size"] + 1)
    assert Eagle3Config.from_target(TARGET, 10).aux_layer_ids == AUX_LAYERS_DEFAULT


def test_unsupported_variants_are_refused(tmp_path):
    head = make_head(dtype=torch.float32)
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for change in ({"norm_output": True}, {"eagle_config": {**config["eagle_config"], "norm_before_fc": True}},
                   {"num_hidden_layers": 2}):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match="not supported"):
            Eagle3Head.from_pretrained(tmp_path, head.embed_tokens)
