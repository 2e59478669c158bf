"""Each request's weight on the target for one V1 verification step, in the batch's row order.

Each request's settings come from :func:`.settings.request_settings`. V1 lays out the sampler's rows in the order of
``input_batch.req_ids`` and keeps each request's ``sampling_params.extra_args`` in ``runner.requests``; rows move
between steps as requests come and go, so a step's plan (the static weights as one device tensor, which rows use
which head, which rows are gated) is built on the host when the batch's requests change and reused while they do not.
vLLM's start-up dummy batches have rows but no requests: they get the engine default's static weight.

Nothing runs for a request that did not ask for it: each head runs once per step over the rows that chose it, the
gate reads only the rows of gated requests, and the capture keeps only head requests' rows (:meth:`capture_plan`).
A batch whose requests use neither costs what a static batch costs. The only work per request is a dictionary lookup,
on the host, of where each head request's drafts lie in the captured proposal (V1 keys rows by request id); nothing
waits for the device. A head request whose drafts were not captured is verified at the engine's static weight and
counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .heads import head_weights
from .settings import EngineSettings, RequestChoice, parse_request, request_settings


@dataclass
class StepPlan:
    """What a batch of requests asked for: static weights [B] on the device, each head's rows, the gated rows."""

    request_ids: tuple
    static: torch.Tensor
    head_rows: dict  # head name -> (row indices [M] on the device, their request ids)
    fly: dict  # the ops' FLy arguments for these rows: fly_window [B], fly_threshold [B], fly_top_k
    gate: tuple | None  # (the gated rows' indices, a host list, and their margins [G] on the device); None: none


class RequestWeights:
    """Callable the sampler asks for [B] (all static) or [B, K] (some head) float32 weights each step."""

    def __init__(self, runner, settings: EngineSettings, heads: dict, capture=None, counts_owner=None):
        self.runner = runner
        self.settings = settings
        self.heads = heads
        self.capture = capture
        self.counts_owner = counts_owner  # the sampler, whose counts record tokens verified without their head
        self._choices: dict = {}  # request id -> RequestChoice: extra_args are parsed once per request
        self._plan: StepPlan | None = None
        if capture is not None:
            capture.plan = self.capture_plan

    def _choice(self, request_id) -> RequestChoice:
        choice = self._choices.get(request_id)
        if choice is None:
            request = self.runner.requests.get(request_id)
            extra_args = getattr(getattr(request, "sampling_params", None), "extra_args", None)
            choice = parse_request(extra_args, self.settings)  # checked on admission already; cannot fail here
            self._choices[request_id] = choice
        return choice

    def _head_of(self, request_id):
        return request_settings(self._choice(request_id), self.settings).head

    def capture_plan(self, request_ids: list) -> tuple:
        """(the rows of a proposing batch whose requests use a head, whether any of their heads reads the draft's
        distributions): what the capture keeps of that proposal."""
        heads = [self._head_of(request_id) for request_id in request_ids]
        rows = [row for row, head in enumerate(heads) if head is not None]
        return rows, any(self.heads[heads[row]].wants_distributions for row in rows)

    def _plan_for(self, request_ids: tuple, batch: int, device) -> StepPlan:
        if self._plan is not None and self._plan.request_ids == request_ids:
            return self._plan
        self._choices = {key: value for key, value in self._choices.items() if key in set(request_ids)}
        static, head_rows, windows, thresholds, gated, margins = [], {}, [], [], [], []
        for row in range(batch):
            choice = self._choice(request_ids[row]) if row < len(request_ids) else RequestChoice()
            request = request_settings(choice, self.settings)
            if request.head is not None and row < len(request_ids):
                head_rows.setdefault(request.head, []).append(row)
            static.append(request.weight)
            windows.append(request.fly_window)
            thresholds.append(request.fly_threshold)
            if request.gate_margin is not None and row < len(request_ids):
                gated.append(row)
                margins.append(request.gate_margin)
        rows = {name: (torch.tensor(indices, dtype=torch.int64, device=device),
                       [request_ids[index] for index in indices]) for name, indices in head_rows.items()}
        fly_arguments = dict(fly_window=torch.tensor(windows, dtype=torch.int64, device=device),
                             fly_threshold=torch.tensor(thresholds, dtype=torch.float32, device=device),
                             fly_top_k=self.settings.fly.top_k)
        gate = (gated, torch.tensor(margins, dtype=torch.float32, device=device)) if gated else None
        self._plan = StepPlan(request_ids, torch.tensor(static, dtype=torch.float32, device=device), rows,
                              fly_arguments, gate)
        return self._plan

    def fly(self) -> dict:
        """The ops' FLy arguments of this step's rows (planned with its weights)."""
        return self._plan.fly

    def gate(self):
        """(the gated rows, a host list of row indices, and their margins [G]) of this step, or None when no request
        of it is gated (planned with its weights)."""
        return self._plan.gate

    def __call__(self, rows, target_logits: torch.Tensor, sampling_metadata, target_logits_indices: torch.Tensor):
        device = target_logits.device
        plan = self._plan_for(tuple(self.runner.input_batch.req_ids[:rows.batch]), rows.batch, device)
        if not plan.head_rows:
            return plan.static
        weight = plan.static[:, None].repeat(1, rows.width)
        temperature = (sampling_metadata.temperature if sampling_metadata.temperature is not None
                       else torch.zeros(rows.batch, dtype=torch.float32, device=device))
        for name, (head_rows, request_ids) in plan.head_rows.items():
            proposal = [self.capture.row_of.get(request_id, -1) for request_id in request_ids]
            captured = torch.tensor([row >= 0 for row in proposal], dtype=torch.bool, device=device)
            if self.counts_owner is not None:
                self.counts_owner.counts.add_without_head(torch.where(captured, 0, rows.num_draft[head_rows]))
            if self.capture.hidden is None or self.capture.target_hidden is None or not any(row >= 0
                                                                                          for row in proposal):
                continue
            proposal_rows = torch.tensor([max(row, 0) for row in proposal], dtype=torch.int64, device=device)
            head_weight = head_weights(self.heads[name], self.capture, proposal_rows, rows.index[head_rows],
                                       target_logits, target_logits_indices, temperature[head_rows])
            weight[head_rows] = torch.where(captured[:, None], head_weight, weight[head_rows])
        return weight
