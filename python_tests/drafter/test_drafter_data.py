"""The drafter's training data: batched, left-padded sampling with the KV cache stores, for every prompt, the aux
hidden states and the soft labels a single unpadded teacher-forced forward of its sequence gives; shards resume."""

import warnings

import torch

from diversed_ext.models.eagle3 import aux_hidden_states
from diversed_ext.research.drafter_data import bf16_matmul_copy, generate_dataset, load_records, sample_batch

from helpers import random_llama

AUX = (0, 1, 3)
K = 6


def tiny_target():
    return random_llama(3, sharpness=4.0, vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                        tie_word_embeddings=True)


PROMPTS = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 3, 12, 13, 2, 4], [5, 6, 7, 30]]


def test_records_equal_an_unpadded_teacher_forced_forward():
    target = tiny_target()
    records = sample_batch(target, PROMPTS, max_new_tokens=7, aux_layer_ids=AUX, eos_ids=[39], top_k=K,
                           generator=torch.Generator().manual_seed(0), label_from=2)
    for prompt, record in zip(PROMPTS, records):
        tokens = record["tokens"].long()
        s = tokens.numel()
        assert tokens[:len(prompt)].tolist() == prompt and record["prompt_len"] == len(prompt)
        with torch.no_grad():
            out = target(tokens[None], output_hidden_states=True)
        torch.testing.assert_close(record["aux"].float(), aux_hidden_states(out.hidden_states, AUX)[0, :s - 1]
                                   .to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)
        logp = torch.log_softmax(out.logits[0, 2:s - 1].float(), -1)
        assert record["top_ids"].shape == (s - 3, K)
        torch.testing.assert_close(record["top_logp"].float(), logp.gather(-1, record["top_ids"].long()),
                                   rtol=1e-2, atol=1e-2)
        assert torch.equal(record["top_ids"][:, 0].long(), logp.argmax(-1))


def test_sampling_passes_the_cache_by_the_name_the_model_takes():
    """transformers 5.2x deprecates ``past_key_values`` where a forward declares ``cache`` (and removes it in 5.40);
    the incremental passes must use whichever name the model declares."""
    target = tiny_target()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        records = sample_batch(target, PROMPTS, max_new_tokens=4, aux_layer_ids=AUX, eos_ids=[39], top_k=K,
                               generator=torch.Generator().manual_seed(0))
    assert all(record["tokens"].numel() > len(prompt) for prompt, record in zip(PROMPTS, records))


def test_sampling_stops_at_eos_and_follows_the_target():
    target = tiny_target()
    eos = list(range(20, 40))  # half the vocabulary ends the sequence: most rows stop early
    records = sample_batch(target, PROMPTS * 4, max_new_tokens=12, aux_layer_ids=AUX, eos_ids=eos, top_k=K,
                           generator=torch.Generator().manual_seed(1))
    stopped = 0
    for prompt, record in zip(PROMPTS * 4, records):
        continuation = record["tokens"][len(prompt):].tolist()
        assert all(t not in eos for t in continuation[:-1])
        stopped += continuation[-1] in eos
        # labels from the shortest prompt's last position on
        assert record["label_from"] == 3 and record["top_ids"].shape[0] == record["tokens"].numel() - 4
    assert stopped >= 6


def test_bf16_copy_stays_close():
    target = tiny_target()
    fast = bf16_matmul_copy(target)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        p = torch.softmax(target(ids).logits, -1)
        q = torch.softmax(fast(ids).logits, -1)
    assert (p - q).abs().sum(-1).max() < 0.05
    assert target.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # the original is untouched


def test_generation_resumes_shard_by_shard(tmp_path):
    target = tiny_target()
    prompts = PROMPTS * 3
    settings = dict(max_new_tokens=5, aux_layer_ids=AUX, eos_ids=[39], top_k=K, batch_size=4, seed=3,
                    progress=False)
    generate_dataset(target, prompts, tmp_path / "a", **settings)
    whole = load_records(tmp_path / "a")
    (tmp_path / "a" / "shard-00001.pt").unlink()
    generate_dataset(target, prompts, tmp_path / "a", **settings)
    again = load_records(tmp_path / "a")
    assert len(whole) == len(again) == len(prompts)
    for x, y in zip(whole, again):
        assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["top_ids"], y["top_ids"])
    assert all(r["label_from"] == 2 for r in whole)  # the prompts share [5, 6, 7]
