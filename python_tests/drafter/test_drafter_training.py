"""The EAGLE-3 head's training: the unrolled training-time test computes exactly what drafting with the head's cache
computes; the draft vocabulary and its labels; a short run lowers the loss and resumes from its checkpoint."""

import json

import pytest
import torch

from diversed_ext.models.eagle3 import Eagle3Config, Eagle3Head
from diversed_ext.research.drafter_data import coverage_curve, draft_vocabulary
from diversed_ext.research.drafter_training import DrafterTrainConfig, collate, evaluate, prepare, train_drafter
from diversed_ext.research.eagle_unrolled import unrolled_logits

TARGET = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
              rms_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
              max_position_embeddings=256, vocab_size=48, num_hidden_layers=30)
K = 5


def make_head(draft_ids, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    config = Eagle3Config.from_target(TARGET, len(draft_ids))
    head = Eagle3Head(config, torch.nn.Embedding(48, 32).to(dtype)).to(dtype)
    head.set_draft_vocabulary(torch.as_tensor(draft_ids))
    return head


def make_records(count, seed=0, vocab=48):
    """Records shaped as drafter_data writes them, from a made-up sharp 'target' that likes low ids."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(count):
        p = int(torch.randint(3, 7, (1,), generator=g))
        n = int(torch.randint(2, 9, (1,), generator=g))
        tokens = torch.randint(0, vocab, (p + n,), generator=g, dtype=torch.int32)
        label_from = 1  # labels on the prompt's own tokens from position 1, as on a common head's last token
        logits = torch.randn(p + n - 1 - label_from, vocab, generator=g) * 3 - torch.arange(vocab) * 0.2
        logp, ids = torch.log_softmax(logits, -1).topk(K, dim=-1)
        records.append({"tokens": tokens, "prompt_len": p, "label_from": label_from,
                        "aux": torch.randn(p + n - 1, 3 * 32, generator=g).to(torch.bfloat16),
                        "top_ids": ids.to(torch.int32), "top_logp": logp.to(torch.float16)})
    return records


def test_unrolled_training_equals_drafting_with_the_cache():
    """Step j's logits at anchor i equal those of: the target-fed prefix 0..i through step(), then j draft steps each
    fed the previous pre-norm state and the data's next token."""
    draft_ids = list(range(0, 48, 2))
    head = make_head(draft_ids)
    examples = prepare(make_records(3), torch.tensor(draft_ids), 48)
    steps = 3
    batch = collate(examples, steps + 1)
    assert batch["first_label"] == 1
    batch["aux"] = batch["aux"].double()
    with torch.no_grad():
        outputs, start = unrolled_logits(head, batch, steps)
        for row, e in enumerate(examples):
            tokens, aux = e["tokens"], e["aux"].double()
            s = tokens.numel()
            for anchor in range(start, s - 1):
                cache = head.new_cache()
                logits, feature = head.step(tokens[1:anchor + 2], head.fuse(aux[:anchor + 1]), cache)
                logits, feature = logits[-1:], feature[-1:]
                for j in range(steps):
                    if j > 0:
                        if anchor + j + 1 >= s:
                            break
                        logits, feature = head.step(tokens[anchor + j + 1:anchor + j + 2], feature, cache)
                    torch.testing.assert_close(outputs[j][row, anchor - start], logits[0])


def test_draft_vocabulary_takes_the_heaviest_ids_ascending():
    records = make_records(20)
    ids, share = draft_vocabulary(records, 48, 10)
    assert ids.tolist() == sorted(ids.tolist()) and len(set(ids.tolist())) == 10
    curve = coverage_curve(records, 48, [5, 10, 48])
    assert curve[10] == pytest.approx(share) and curve[48] == pytest.approx(1.0) and curve[5] < curve[10]
    # the low ids carry most of the made-up target's mass
    assert sum(i < 16 for i in ids.tolist()) >= 8
    with pytest.raises(ValueError, match="size"):
        draft_vocabulary(records, 48, 0)


def test_labels_outside_the_draft_vocabulary_are_marked():
    records = make_records(2)
    draft_ids = torch.tensor([1, 3, 5])
    (e, *_), full = prepare(records, draft_ids, 48), prepare(records, torch.arange(48), 48)
    inside = torch.isin(records[0]["top_ids"].long(), draft_ids)
    assert torch.equal(e["draft"] >= 0, inside)
    assert torch.equal(full[0]["draft"], records[0]["top_ids"].long())


def test_training_lowers_the_loss_and_resumes(tmp_path):
    torch.manual_seed(0)
    records = make_records(24)
    ids, _ = draft_vocabulary(records, 48, 24)
    head = make_head(ids.tolist(), dtype=torch.float32)
    examples = prepare(records, ids, 48)
    before = evaluate(head, examples[:8], 2)
    config = DrafterTrainConfig(output_dir=str(tmp_path), steps=30, batch_size=4, learning_rate=3e-3,
                                warmup_steps=2, ttt_steps=2, eval_every=30, checkpoint_every=10)
    log = train_drafter(head, examples, examples[:8], config, progress=False)
    assert log[-1]["loss"] < log[0]["loss"]
    assert log[-1]["accept_step1"] > before["accept_step1"]
    assert 0 <= log[-1]["accept_step1"] <= log[-1]["accept_upper_step1"] <= 1
    assert (tmp_path / "training_curve.png").is_file()
    assert len((tmp_path / "train_log.jsonl").read_text().splitlines()) == 30
    # interrupted after step 20 (checkpoint at 20), resumed: the same head as the uninterrupted run
    again = make_head(ids.tolist(), dtype=torch.float32)
    other = DrafterTrainConfig(**{**config.__dict__, "output_dir": str(tmp_path / "b")})
    train_drafter(again, examples, examples[:8], other, progress=False, stop_after=20)
    resumed = make_head(ids.tolist(), dtype=torch.float32)  # the same (shared, unsaved) embeddings
    with torch.no_grad():
        for parameter in resumed.parameters():  # weights the checkpoint must replace
            parameter.add_(torch.randn_like(parameter))
    resumed_log = train_drafter(resumed, examples, examples[:8], other, progress=False, resume=True)
    assert [r["step"] for r in resumed_log] == list(range(1, 31))
    for name, value in head.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, msg=name)


def test_command_refuses_the_test_split_and_missing_data(tmp_path, capsys):
    from diversed_ext.cli import main

    (tmp_path / "test.jsonl").write_text("{}\n")
    assert main(["train-drafter", "--out", str(tmp_path / "o"), "--data", str(tmp_path / "test.jsonl")]) == 2
    assert "training split only" in capsys.readouterr().err
    assert main(["train-drafter", "--out", str(tmp_path / "o"), "--data", str(tmp_path / "train.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_continuation_only_labels_skip_the_prompt():
    examples = prepare(make_records(4), torch.arange(48), 48)
    everything, continuation = collate(examples, 2), collate(examples, 2, continuation_only=True)
    for row, e in enumerate(examples):
        p, s = e["prompt_len"], e["tokens"].numel()
        labelled = (continuation["prob"][row].sum(-1) > 0).nonzero().flatten().tolist()
        assert labelled == list(range(p - 1, s - 1))
        assert (everything["prob"][row].sum(-1) > 0).nonzero().flatten().tolist() == list(range(1, s - 1))
    assert continuation["first_label"] == min(e["prompt_len"] for e in examples) - 1


def test_command_end_to_end_on_a_tiny_pair(tmp_path, monkeypatch):
    """train-drafter generates, trains, checks bfloat16 and saves a head that loads; a rerun resumes the data."""
    import diversed_ext.models as models
    from diversed_ext.cli import main
    from helpers import random_llama
    from helpers.models import EXPERIMENT_VOCAB, CharTokenizer, gsm8k_examples

    target = random_llama(0, vocab_size=EXPERIMENT_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=30,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    monkeypatch.setattr(models, "load_default_pair", lambda: models.ModelPair(target, None, CharTokenizer()))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in gsm8k_examples(12)))
    argv = ["train-drafter", "--out", str(tmp_path / "out"), "--data", str(data), "--data-dir", str(tmp_path / "d"),
            "--prompts", "8", "--holdout", "2", "--gen-batch", "4", "--max-new-tokens", "4", "--top-k", "4",
            "--steps", "2", "--batch-size", "2", "--draft-vocab", "8", "--eval-every", "2"]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["draft_vocab"] == 8 and summary["train_sequences"] == 8 and summary["holdout_sequences"] == 2
    assert 0 <= summary["holdout"]["acceptance_rate_k3"] <= 1
    head = Eagle3Head.from_pretrained(tmp_path / "out", target.get_input_embeddings())
    assert head.config.aux_layer_ids == (2, 15, 27) and head.config.draft_vocab_size == 8
    assert len(list((tmp_path / "d").glob("shard-*.pt"))) == 3
    # --shards 2: the first two batches only, from the same data folder
    assert main(argv + ["--shards", "2", "--out", str(tmp_path / "out2")]) == 0
    assert json.loads((tmp_path / "out2" / "summary.json").read_text())["train_sequences"] == 6
