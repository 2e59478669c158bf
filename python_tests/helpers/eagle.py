"""EAGLE-3 heads for the tiny targets of models.py: distilled for a few steps so that their drafts are sometimes kept
and sometimes rejected (a random head is almost never right, which would leave the rollback paths untested).

diversed_ext's EAGLE-3 model is imported when a head is built.
"""

import contextlib

import torch


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread inside: a head's steps are a dozen tiny ops per row, and on a busy 2-core machine two
    threads fight over them (ten times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def target_features(target, head, tokens):
    """The target's aux hidden states (the head's aux layers) at every position of ``tokens``, and its logits."""
    with torch.no_grad():
        output = target(torch.tensor([tokens]), output_hidden_states=True)
    aux = torch.cat([output.hidden_states[layer][0] for layer in head.config.aux_layer_ids], dim=-1)
    return aux, output.logits[0]


def distilled_head(target, draft_ids, aux_layers, seed, steps=120):
    """An Eagle3Head for ``target`` trained for a few Adam steps to predict the target's next-token law, from the
    target's own sampled continuations (teacher forcing: pair i = (feature i, token i + 1) predicts token i + 2)."""
    from diversed_ext.models.eagle3 import Eagle3Config, Eagle3Head

    config = Eagle3Config.from_target(target.config.to_dict(), len(draft_ids), aux_layer_ids=aux_layers)
    torch.manual_seed(seed)
    head = Eagle3Head(config, target.model.embed_tokens)
    head.set_draft_vocabulary(torch.tensor(draft_ids))
    vocab = target.config.vocab_size
    with torch.no_grad():
        starts = torch.randint(0, vocab, (6, 3), generator=torch.Generator().manual_seed(seed))
        texts = target.generate(starts, max_new_tokens=20, do_sample=True, pad_token_id=0)
    examples = []
    for text in texts.tolist():
        aux, logits = target_features(target, head, text)
        law = logits[1:, draft_ids].softmax(-1)  # the target's law of token i + 2, on the draft vocabulary
        examples.append((torch.tensor(text[1:-1]), aux[:-2], law[:-1]))
    optimiser = torch.optim.Adam(head.parameters(), lr=2e-2)
    for _ in range(steps):
        optimiser.zero_grad()
        loss = 0.0
        for token_ids, aux, law in examples:
            logits, _ = head.step(token_ids, head.fuse(aux), head.new_cache())
            loss = loss - (law * logits.log_softmax(-1)).sum(-1).mean()
        loss.backward()
        optimiser.step()
    return head.eval()
