"""Where the plugin attaches to vLLM, and the version check in front of it.

Three class methods are wrapped, once per process, and change nothing unless the engine's additional_config holds
a ``"diversed"`` entry:

- ``InputProcessor.__init__``: in the process the user started (``LLM`` or the API server), before any engine
  process starts, the entry is parsed and the vLLM version checked, so a mistake there is one clear error;
- ``GPUModelRunner.__init__`` (the CPU runner subclasses it): in each worker, after vLLM built its rejection sampler,
  the runner gets a :class:`DiversedRejectionSampler` bound to the engine's settings, its heads, and, for heads, the
  hidden-state capture;
- ``InputProcessor._validate_params``: in the process that admits requests (``LLM`` or the API server), a request's
  ``diversed_*`` fields are checked before it is scheduled, so a bad value is that request's error only
  (``LLM.generate`` raises a ValueError, the OpenAI server answers 400).

The seams are private vLLM code, so an untested vLLM version is refused at start-up whenever DIVERSED is asked for:
silently verifying exactly would be worse than not starting.
"""

from __future__ import annotations

import functools
import inspect
import logging

from .settings import EngineSettings, engine_entry, parse_engine_entry, parse_request

logger = logging.getLogger(__name__)

TESTED_VLLM_VERSIONS = ("0.32.0",)
# The signatures the plugin was written against: (module, qualified name, parameter names).
SEAMS = (
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler.forward",
     ("self", "metadata", "draft_probs", "logits", "sampling_metadata")),
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler._get_logprobs_tensors",
     ("self", "max_num_logprobs", "metadata", "logits", "target_logits", "bonus_logits", "sampled_token_ids")),
    ("vllm.v1.engine.input_processor", "InputProcessor._validate_params", ("self", "params", "supported_tasks")),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer._sample_draft_tokens",
     ("self", "hidden_states", "sampling_metadata")),
)
_INSTALLED = "_diversed_hooked"
NEEDS_SPECULATION = ("additional_config['diversed'] needs speculative decoding: pass a speculative_config (a draft "
                     "model, EAGLE, MTP or ngram)")


class DiversedStartupError(RuntimeError):
    """DIVERSED was asked for but cannot run in this engine (vLLM version, configuration, heads)."""


def _resolve(module_name: str, qualified_name: str):
    import importlib

    target = importlib.import_module(module_name)
    for part in qualified_name.split("."):
        target = getattr(target, part)
    return target


def seam_problems() -> list:
    """What differs from the vLLM the plugin was tested with: the version, and each changed or missing seam."""
    import vllm

    problems = []
    if vllm.__version__ not in TESTED_VLLM_VERSIONS:
        problems.append(f"vLLM {vllm.__version__} (tested: {', '.join(TESTED_VLLM_VERSIONS)})")
    for module_name, qualified_name, parameters in SEAMS:
        try:
            found = tuple(inspect.signature(_resolve(module_name, qualified_name)).parameters)
        except (ImportError, AttributeError) as error:
            problems.append(f"{module_name}.{qualified_name} is missing ({error})")
            continue
        if found != parameters:
            problems.append(f"{module_name}.{qualified_name}{found} (tested: {parameters})")
    return problems


def require_tested_vllm() -> None:
    problems = seam_problems()
    if problems:
        raise DiversedStartupError("DIVERSED was asked for (additional_config['diversed']) but this vLLM differs from "
                                   "the one the plugin was tested with: " + "; ".join(problems))


def engine_settings(vllm_config) -> EngineSettings | None:
    """The engine's parsed settings, or None without a ``"diversed"`` entry (the plugin then stays out)."""
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict) or "diversed" not in additional:
        return None
    return parse_engine_entry(engine_entry(additional))


def check_engine(vllm_config) -> EngineSettings | None:
    """Before any engine process starts: the entry's rules, the vLLM version, speculative decoding switched on, and
    every head's folder present (loading them is the workers' job). Returns the engine's settings, or None when it
    has no diversed entry."""
    import os

    from ..head import CONFIG_NAME, resolve_head_path

    settings = engine_settings(vllm_config)
    if settings is None:
        return None
    require_tested_vllm()
    if getattr(vllm_config, "speculative_config", None) is None:
        raise DiversedStartupError(NEEDS_SPECULATION)
    for name in settings.head_paths:
        if not os.path.isfile(os.path.join(resolve_head_path(name), CONFIG_NAME)):
            raise DiversedStartupError(f"head {name!r}: no {CONFIG_NAME} at {resolve_head_path(name)!r} (give a "
                                       "shipped head's name, 'default', or a folder written by diversed train)")
    return settings


def attach_to_runner(runner, settings: EngineSettings) -> None:
    """Replace the runner's rejection sampler (see the module docstring)."""
    from .heads import HiddenStateCapture, load_heads
    from .sampler import DiversedRejectionSampler
    from .weights import RequestWeights

    if getattr(runner, "speculative_config", None) is None:
        raise DiversedStartupError(NEEDS_SPECULATION)
    if not hasattr(runner, "rejection_sampler"):  # not the last pipeline stage: drafting and sampling happen there
        logger.info("diversed: this pipeline stage does not sample; nothing to replace")
        return
    capture, heads = None, {}
    if settings.head_paths:
        drafter = getattr(runner, "drafter", None)
        if drafter is None or not hasattr(drafter, "_sample_draft_tokens"):
            raise DiversedStartupError("DIVERSED heads read the draft model's hidden states; this engine's drafter "
                                       f"({type(drafter).__name__}) has none: use a static weight")
        draft_config = runner.speculative_config.draft_model_config
        heads = load_heads(settings.head_paths, draft_config.get_hidden_size(),
                           runner.model_config.get_hidden_size())
        capture = HiddenStateCapture(runner, any(head.wants_distributions for head in heads.values()))
    sampler = DiversedRejectionSampler(runner.sampler, runner.speculative_config, runner.device)
    weights = None if settings.verifier == "vllm" else RequestWeights(runner, settings, heads, capture)
    runner.rejection_sampler = sampler.bind(weights, runner.device, exact_vllm=settings.verifier == "vllm")
    logger.info("diversed: rejection sampler replaced (verifier %s, weight %s, heads %s)", settings.verifier,
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
    source = sampler.weight_source
    if source is not None:
        status.update(weight=source.settings.weight, head=source.settings.head, heads=sorted(source.heads))
    return status


def install() -> None:
    """Wrap the three seams (idempotent: vLLM may load plugins more than once in a process)."""
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    if getattr(GPUModelRunner, _INSTALLED, False):
        return
    runner_init, validate_params = GPUModelRunner.__init__, InputProcessor._validate_params
    processor_init = InputProcessor.__init__

    def processor_init_checked(self, vllm_config, *args, **kwargs):
        settings = check_engine(vllm_config)  # parsed once here, read by every request's check
        processor_init(self, vllm_config, *args, **kwargs)
        self._diversed_settings = settings

    def __init__(self, vllm_config, *args, **kwargs):
        runner_init(self, vllm_config, *args, **kwargs)
        settings = engine_settings(vllm_config)
        if settings is not None:
            require_tested_vllm()
            attach_to_runner(self, settings)

    def _validate_params(self, params, supported_tasks):
        result = validate_params(self, params, supported_tasks)
        check_request(params, getattr(self, "_diversed_settings", None))
        return result

    __init__.__wrapped__ = runner_init
    _validate_params.__wrapped__ = validate_params
    processor_init_checked.__wrapped__ = processor_init
    GPUModelRunner.__init__ = __init__
    InputProcessor.__init__ = processor_init_checked
    InputProcessor._validate_params = _validate_params
    WorkerBase.diversed_status = worker_status
    setattr(GPUModelRunner, _INSTALLED, True)
