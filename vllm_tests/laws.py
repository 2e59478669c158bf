"""The samples and statistics the law tests compare: token frequencies over many seeded requests, two-sample
chi-square between an engine and vLLM without speculation."""

from __future__ import annotations

from collections import Counter

from engines import PROMPTS, chat

LAW_REQUESTS = 400  # seeded requests per engine
# Per position: an engine follows the target's law when every position's p-value is above it. With fixed seeds a
# correct engine's test is deterministic. vLLM as shipped on the CPU reads uninitialised memory, so how far it strays
# varies from run to run: p ~ 1e-100 with 400 requests once, 3e-6 with 100 once, 1.7e-4 with 200 once.
LAW_ALPHA = 1e-3
LAW_TOKENS = 3  # token 1 comes from the prefill; tokens 2 and 3 from verification
GREEDY_PROMPTS = 4
GREEDY_TOKENS = 32
MIN_BIN = 10  # tokens seen fewer times (both engines together) are pooled into one bin


def greedy_tokens(llm, extra_args=None, *, prompts: int = GREEDY_PROMPTS, tokens: int = GREEDY_TOKENS) -> list:
    """The greedy continuations of the first ``prompts`` prompts, ``tokens`` tokens each (one list a prompt)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, extra_args=extra_args)
    outputs = llm.chat([chat(prompt) for prompt in PROMPTS[:prompts]], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def law_samples(llm, extra_args=None, requests: int = LAW_REQUESTS) -> list:
    """Token ids 2..LAW_TOKENS of ``requests`` seeded requests on one prompt at temperature 1 (one list each)."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=LAW_TOKENS, seed=1000 + index, ignore_eos=True,
                             extra_args=extra_args) for index in range(requests)]
    outputs = llm.chat([chat(PROMPTS[0])] * requests, params, use_tqdm=False)
    return [list(output.outputs[0].token_ids)[1:] for output in outputs]


def two_sample_p(sample_a: list, sample_b: list) -> float:
    """p-value of a chi-square test that two samples of token ids come from one law."""
    from scipy.stats import chi2_contingency

    counts_a, counts_b = Counter(sample_a), Counter(sample_b)
    tokens = sorted(set(counts_a) | set(counts_b))
    kept = [token for token in tokens if counts_a[token] + counts_b[token] >= MIN_BIN]
    pooled = [token for token in tokens if token not in kept]
    table = [[counts[token] for token in kept] + [sum(counts[token] for token in pooled)]
             for counts in (counts_a, counts_b)]
    if not pooled:
        table = [row[:-1] for row in table]
    return float(chi2_contingency(table).pvalue)


def position_p_values(samples: list, reference: list) -> list:
    """One p-value per verified position (tokens 2, 3, ...)."""
    return [two_sample_p([row[position] for row in samples], [row[position] for row in reference])
            for position in range(LAW_TOKENS - 1)]
