"""Where the plugin attaches to vLLM.

Wrapped once per process, changing nothing unless the engine's additional_config holds a ``"diversed"`` entry:

- ``InputProcessor.__init__``: in the process the user started (``LLM`` or the API server), before any engine
  process starts, the entry and the engine are checked (:mod:`.startup`), so a mistake there is one clear error;
- ``InputProcessor._validate_params``: in the same process, a request's ``diversed_*`` fields are checked before it
  is scheduled, so a bad value is that request's error only (``LLM.generate`` raises a ValueError, the OpenAI server
  answers 400);
- V1's ``GPUModelRunner.__init__`` (the CPU runner subclasses it), after vLLM built its rejection sampler: the runner
  gets a :class:`.sampler.DiversedRejectionSampler` bound to the engine's settings and heads;
- V2's ``GPUModelRunner.load_model`` (V2's CPU runner subclasses it), where V2 builds its rejection sampler: the
  runner gets a :class:`.v2_sampler.DiversedV2RejectionSampler`, the weight tables and, for heads, the captures;
- ``Worker.load_model`` (the CPU worker subclasses it): once the runner is built, a runner that would verify any
  other way refuses to start (:func:`.startup.require_hooked`).
"""

from __future__ import annotations

import functools
import logging

from .settings import EngineSettings, parse_request
from .startup import DiversedStartupError, check_engine, engine_settings, require_hooked, require_tested_vllm

logger = logging.getLogger(__name__)

_INSTALLED = "_diversed_hooked"


def _load_heads(runner, settings: EngineSettings) -> dict:
    from .heads import load_heads

    speculative_config = runner.speculative_config
    return load_heads(settings.head_paths, speculative_config.draft_model_config.get_hidden_size(),
                      runner.model_config.get_hidden_size(),
                      eagle3_drafter=getattr(speculative_config, "method", None) == "eagle3")


def attach_to_v1_runner(runner, settings: EngineSettings) -> None:
    """Replace a V1 runner's rejection sampler (see the module docstring)."""
    from .heads import HiddenStateCapture
    from .sampler import DiversedRejectionSampler
    from .weights import RequestWeights

    if not hasattr(runner, "rejection_sampler"):  # not the last pipeline stage: drafting and sampling happen there
        logger.info("diversed: this pipeline stage does not sample; nothing to replace")
        return
    capture, heads = None, {}
    if settings.head_paths:
        drafter = getattr(runner, "drafter", None)
        if drafter is None or not hasattr(drafter, "_sample_draft_tokens"):
            raise DiversedStartupError("DIVERSED heads read the draft model's hidden states; this engine's drafter "
                                       f"({type(drafter).__name__}) has none: use a static weight")
        heads = _load_heads(runner, settings)
        capture = HiddenStateCapture(runner, any(head.wants_distributions for head in heads.values()))
    sampler = DiversedRejectionSampler(runner.sampler, runner.speculative_config, runner.device)
    exact = settings.verifier == "vllm"
    weights = None if exact else RequestWeights(runner, settings, heads, capture, counts_owner=sampler)
    runner.rejection_sampler = sampler.bind(weights, runner.device, exact_vllm=exact)
    logger.info("diversed: V1 rejection sampler replaced (verifier %s, weight %s, heads %s)", settings.verifier,
                settings.weight, sorted(heads) or "none")


def attach_to_v2_runner(runner, settings: EngineSettings) -> None:
    """Replace a V2 runner's rejection sampler (see the module docstring)."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    from .drafters import real_draft_counts
    from .v2_sampler import DiversedV2RejectionSampler
    from .v2_state import StateWeights

    current = getattr(runner, "rejection_sampler", None)
    if current is None:  # not the last pipeline stage, or no speculation: require_hooked decides
        return
    if type(current) is not RejectionSampler or current.watermark_key is not None:
        return  # a model's own sampler, or a watermarking one: require_hooked refuses it
    heads = {}
    if settings.head_paths:
        speculator = getattr(runner, "speculator", None)
        if not hasattr(speculator, "sample_draft") or getattr(runner, "batch_sharder", None) is not None:
            raise DiversedStartupError("DIVERSED heads read the draft model's hidden states, which this engine's "
                                       f"drafter ({type(speculator).__name__}) or its batch-sharded sampling does not "
                                       "expose: use a static weight")
        heads = _load_heads(runner, settings)
    sampler = DiversedV2RejectionSampler(runner.sampler, runner.speculative_config, runner.device)
    exact = settings.verifier == "vllm"
    weights = None if exact else StateWeights(runner, settings, heads, counts_owner=sampler)
    runner.rejection_sampler = sampler.bind(weights, runner.device, exact_vllm=exact)
    sampler.real_drafts = None if exact else real_draft_counts(runner)  # V2 n-gram's filler is never verified
    logger.info("diversed: V2 rejection sampler replaced (verifier %s, weight %s, heads %s)", settings.verifier,
                settings.weight, sorted(heads) or "none")


class DiversedRequestError(ValueError):
    """A request's diversed_* field is invalid; also a vLLM validation error, so the server answers 400."""


@functools.lru_cache(maxsize=None)
def _validation_error_class():
    """A request error that is both vLLM's validation error (HTTP 400) and a ValueError, made once: vLLM is
    imported only when the first bad request arrives."""
    from vllm.exceptions import VLLMValidationError

    class DiversedValidationError(VLLMValidationError, DiversedRequestError):
        pass

    return DiversedValidationError


def check_request(params, settings: EngineSettings | None) -> None:
    """Refuse a request whose ``diversed_*`` extra_args are invalid for an engine with these settings (None: the
    engine has no diversed entry)."""
    extra_args = getattr(params, "extra_args", None)
    if not extra_args:
        return
    try:
        parse_request(extra_args, settings)
    except ValueError as error:
        field = next((key for key in extra_args if isinstance(key, str) and key.startswith("diversed_")), "diversed")
        raise _validation_error_class()(str(error), parameter=field, value=extra_args.get(field)) from None


def worker_status(worker) -> dict:
    """The plugin's state in one worker: ``LLM.collective_rpc("diversed_status")`` returns one dict a worker."""
    runner = getattr(worker, "model_runner", None)
    sampler = getattr(runner, "rejection_sampler", None)
    if sampler is None or not hasattr(sampler, "status"):
        return {"sampler": type(sampler).__name__ if sampler is not None else None, "verifier": None}
    status = sampler.status()
    # Asynchronous scheduling (vLLM's default on GPUs) also verifies steps whose tokens vLLM then drops, for a request
    # that finished the step before, so the counts here include those.
    status["async_scheduling"] = bool(runner.vllm_config.scheduler_config.async_scheduling)
    source = sampler.weight_source
    if source is not None:
        status.update(weight=source.settings.weight, head=source.settings.head,
                      heads=sorted(source.settings.head_paths), gate_margin=source.settings.gate_margin)
    return status


def _attach_if_asked(runner, attach) -> None:
    """In a worker: give a runner whose engine asked for DIVERSED the plugin's sampler, once vLLM built its own."""
    settings = engine_settings(runner.vllm_config)
    if settings is not None and getattr(runner, "speculative_config", None) is not None:
        require_tested_vllm()
        attach(runner, settings)


def _wrap(owner, name: str, wrapper) -> None:
    """Replace ``owner.name`` by ``wrapper``, which keeps its name, docstring and ``__wrapped__``."""
    setattr(owner, name, functools.update_wrapper(wrapper, getattr(owner, name), updated=()))


def install() -> None:
    """Wrap the seams (idempotent: vLLM may load plugins more than once in a process)."""
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerBase

    if getattr(InputProcessor, _INSTALLED, False):
        return
    processor_init, validate_params = InputProcessor.__init__, InputProcessor._validate_params
    v1_init, v2_load_model, worker_load_model = V1Runner.__init__, V2Runner.load_model, Worker.load_model

    def processor_init_checked(self, vllm_config, *args, **kwargs):
        settings = check_engine(vllm_config)  # parsed once here, read by every request's check
        processor_init(self, vllm_config, *args, **kwargs)
        self._diversed_settings = settings

    def _validate_params(self, params, supported_tasks):
        result = validate_params(self, params, supported_tasks)
        check_request(params, getattr(self, "_diversed_settings", None))
        return result

    def v1_runner_init(self, vllm_config, *args, **kwargs):
        v1_init(self, vllm_config, *args, **kwargs)
        _attach_if_asked(self, attach_to_v1_runner)

    def v2_runner_load_model(self, *args, **kwargs):
        v2_load_model(self, *args, **kwargs)
        _attach_if_asked(self, attach_to_v2_runner)

    def load_model_checked(self, *args, **kwargs):
        worker_load_model(self, *args, **kwargs)
        settings = engine_settings(self.vllm_config)
        if settings is not None:
            require_hooked(self.model_runner, settings)

    _wrap(InputProcessor, "__init__", processor_init_checked)
    _wrap(InputProcessor, "_validate_params", _validate_params)
    _wrap(V1Runner, "__init__", v1_runner_init)
    _wrap(V2Runner, "load_model", v2_runner_load_model)
    _wrap(Worker, "load_model", load_model_checked)
    WorkerBase.diversed_status = worker_status
    setattr(InputProcessor, _INSTALLED, True)
