"""The argument rules of a verify call, applied together: what verify and verify_logits run on every call that does
not go to the op as given (``_unchecked``), and what the references run on every call."""

from __future__ import annotations

from ._inputs import (normalize_greedy, normalize_num_draft, normalize_offset, normalize_tokens, normalize_uniforms,
                      seed_argument, weight_argument)
from ._rows import check_row_indices, check_row_values, check_verify_layout, normalize_rows
from ._values import check_token_ids, check_values, check_verify_probabilities, read_positions


def prepare_verify(draft_tokens, draft, target, weight, *, num_draft, greedy, uniforms, seed, offset,
                   check_inputs: bool, draft_name: str, target_name: str, kind: str,
                   target_rows=None, draft_rows=None) -> tuple:
    """Validate and normalise every verify argument (probabilities or logits alike), checked call or not; returns
    ``diversed::verify_probs``' positional arguments as a plain tuple (no object built on the serving path; the
    fields are :class:`~diversed_ext.ops._inputs.VerifyArgs`'). Each argument has one rule, whose first test passes a
    value already in the op's layout untouched, so an unchecked call pays a few attribute reads per argument and no
    conversion. Defaults stay scalars or None (VerifyArgs.materialized). A draft of None verifies drafted tokens
    without their distributions (q one-hot at each drafted token). ``target_rows`` / ``draft_rows``: rows read in
    place (``_rows``)."""
    batch, num_positions, vocab = check_verify_layout(draft_tokens, draft, target, target_rows, draft_rows,
                                                      draft_name, target_name, kind)
    device = target.device
    tokens = normalize_tokens(draft_tokens, batch, num_positions, device, draft_name if draft is not None else None,
                              target_name)
    weight_t, weight_value = weight_argument(weight, batch, num_positions, device, check_inputs)
    num_draft_t = normalize_num_draft(num_draft, batch, num_positions, device, check_inputs)
    greedy_t = normalize_greedy(greedy, batch, device)
    uniforms_t = normalize_uniforms(uniforms, batch, num_positions, device, check_inputs)
    if uniforms is not None and seed is not None:
        raise ValueError("pass either uniforms or seed, not both: explicit uniforms replace the generator")
    seeds_t, seed_value, per_row_seed = seed_argument(seed, batch, device)
    offset_i = normalize_offset(offset)
    target_rows_t = normalize_rows(target_rows, "target_rows", target, target_name, batch, num_positions + 1,
                                   "[B, K+1]", device)
    draft_rows_t = normalize_rows(draft_rows, "draft_rows", draft, draft_name, batch, num_positions, "[B, K]", device)
    indexed = target_rows_t is not None or draft_rows_t is not None
    if check_inputs and indexed:
        for rows, name, values, values_name, last_offset in ((target_rows_t, "target_rows", target, target_name, 1),
                                                             (draft_rows_t, "draft_rows", draft, draft_name, 0)):
            if rows is not None:
                read = read_positions(num_draft_t, batch, num_positions, last_offset, device)
                check_row_indices(rows, name, values.shape[0], values_name, read)
    if check_inputs:
        check_token_ids(tokens, num_draft_t, vocab)
        if indexed:
            check_row_values(draft, target, draft_rows_t, target_rows_t, num_draft_t, batch, num_positions,
                             draft_name, target_name, from_logits=kind == "logits")
        elif kind == "logits":
            if draft is not None:
                check_values(draft, draft_name, from_logits=True)
            check_values(target, target_name, from_logits=True)
        else:
            check_verify_probabilities(draft, target, num_draft_t, draft_name, target_name)
    draft = None if draft is None else draft.contiguous()
    return (tokens, draft, target.contiguous(), weight_t, num_draft_t, greedy_t, uniforms_t, seeds_t, offset_i,
            per_row_seed, weight_value, seed_value, target_rows_t, draft_rows_t)
