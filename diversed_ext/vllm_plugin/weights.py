"""Each request's weight on the target for one verification step, in the batch's row order.

A request's ``diversed_weight`` wins, then its ``diversed_head``, then the engine's default (its head, else its
weight). Rows are looked up through the runner: ``input_batch.req_ids`` lists the requests in the order vLLM lays
out the sampler's rows, and ``requests[id].sampling_params.extra_args`` holds what the request asked for. vLLM's
start-up dummy batches have rows but no requests: they get the engine default's static weight.
"""

from __future__ import annotations

import torch

from .heads import head_weights
from .settings import EngineSettings, RequestChoice, parse_request


class RequestWeights:
    """Callable the sampler asks for [B] (all static) or [B, K] (some head) float32 weights each step."""

    def __init__(self, runner, settings: EngineSettings, heads: dict, capture=None, counts_owner=None):
        self.runner = runner
        self.counts_owner = counts_owner  # the sampler, whose counts record tokens verified without their head
        self.settings = settings
        self.heads = heads
        self.capture = capture
        self._choices: dict = {}  # request id -> RequestChoice: extra_args are parsed once per request

    def _choice(self, request_id: str) -> RequestChoice:
        choice = self._choices.get(request_id)
        if choice is None:
            request = self.runner.requests.get(request_id)
            extra_args = getattr(getattr(request, "sampling_params", None), "extra_args", None)
            choice = parse_request(extra_args, self.settings)  # checked on admission already; cannot fail here
            self._choices[request_id] = choice
        return choice

    def _row_plan(self, batch: int) -> list:
        """Per row: a float (static weight) or (head name, request id)."""
        request_ids = list(self.runner.input_batch.req_ids)[:batch]
        live = set(request_ids)
        if len(self._choices) > 4 * max(len(live), 16):  # forget finished requests now and then
            self._choices = {key: value for key, value in self._choices.items() if key in live}
        plan = []
        for row in range(batch):
            if row >= len(request_ids):
                plan.append(self.settings.weight)
                continue
            choice = self._choice(request_ids[row])
            if choice.weight is not None:
                plan.append(choice.weight)
            elif choice.head is not None or self.settings.head is not None:
                plan.append((choice.head or self.settings.head, request_ids[row]))
            else:
                plan.append(self.settings.weight)
        return plan

    def __call__(self, rows, target_logits: torch.Tensor, sampling_metadata, target_logits_indices: torch.Tensor):
        plan = self._row_plan(rows.batch)
        device = target_logits.device
        if all(isinstance(entry, float) for entry in plan):
            return torch.tensor(plan, dtype=torch.float32, device=device)
        weight = torch.tensor([entry if isinstance(entry, float) else self.settings.weight for entry in plan],
                              dtype=torch.float32, device=device)[:, None].repeat(1, rows.width)
        starts = (rows.index[:, 0]).tolist()
        counts = rows.num_draft.tolist()
        temperatures = (sampling_metadata.temperature.tolist() if sampling_metadata.temperature is not None
                        else [0.0] * rows.batch)
        for row, entry in enumerate(plan):
            if isinstance(entry, float) or counts[row] == 0:
                continue
            name, request_id = entry
            flat = slice(starts[row], starts[row] + counts[row])
            row_weight = head_weights(self.heads[name], self.capture, request_id, target_logits_indices[flat],
                                      target_logits[flat], temperatures[row])
            if row_weight is not None:
                weight[row, :counts[row]] = row_weight.to(device)
            elif self.counts_owner is not None:
                self.counts_owner.counts.add_without_head(rows.num_draft[row])
        return weight
