"""DIVERSED inside vLLM: a plugin that makes vLLM's speculative decoding verify with diversed_ext.

Installing diversed_ext registers :func:`register` in the ``vllm.general_plugins`` entry-point group, which vLLM
calls in every process it starts (the one that admits requests, the engine core, each worker). Nothing changes
until an engine is built with a ``"diversed"`` entry in its ``additional_config``:

    from vllm import LLM, SamplingParams
    llm = LLM(target, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
              additional_config={"diversed": {"weight": 0.5}})
    llm.generate(prompt, SamplingParams(temperature=1.0, extra_args={"diversed_weight": 0.7}))

Floors: :mod:`.settings` (the configuration's rules, no vLLM import), :mod:`.startup` (what an engine must be, checked
before it starts, and what is refused) with :mod:`.drafters` (the speculative methods, by runner) and :mod:`.seams`
(the fingerprints of the vLLM code the plugin hooks), :mod:`.hooks` (where it attaches to vLLM); on V1's model runner
:mod:`.sampler` (the rejection sampler), :mod:`.weights` and :mod:`.heads` (per-request weights, learned heads and the
hidden states they read); on V2's :mod:`.v2_sampler` and :mod:`.v2_state`.

Supported: the hooked code of vLLM 0.32.0 and 0.33.0 (compared by fingerprint, whatever the version string), on
vLLM's V1 and V2 model runners, with the speculative methods :mod:`.drafters` lists. Every constraint vLLM's logits
processing sets on a request (allowed token ids, bad words, min_tokens, top-k, top-p, ...) holds at any weight. An
engine that would verify some other way refuses to start, naming the setting; a request's bad ``diversed_*`` value is
that request's error.
"""

from __future__ import annotations

import logging

from .settings import (CONFIG_KEY, REQUEST_FLY_THRESHOLD, REQUEST_FLY_WINDOW, REQUEST_GATE_MARGIN, REQUEST_HEAD,
                       REQUEST_WEIGHT, DiversedConfigError)

__all__ = ["register", "CONFIG_KEY", "REQUEST_WEIGHT", "REQUEST_HEAD", "REQUEST_FLY_WINDOW", "REQUEST_FLY_THRESHOLD",
           "REQUEST_GATE_MARGIN", "DiversedConfigError"]
logger = logging.getLogger(__name__)


def register() -> None:
    """vLLM's entry point: wrap the seams in this process. A vLLM whose seams are gone is not an error here (this
    package may sit beside any vLLM); asking such an engine for DIVERSED is, when the engine checks its config."""
    try:
        import vllm  # noqa: F401
    except ImportError:  # called outside vLLM: nothing to attach to
        return
    from .hooks import install

    try:
        install()
    except (ImportError, AttributeError) as error:
        _refuse_diversed_engines(f"this vLLM lacks the seams the plugin attaches to ({error})")


def _refuse_diversed_engines(reason: str) -> None:
    """Make every engine that asks for DIVERSED fail at configuration, through the engine arguments' public
    builder, since the seams are not there to verify with."""
    from vllm.engine.arg_utils import EngineArgs

    from .hooks import DiversedStartupError

    build = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        if CONFIG_KEY in (getattr(self, "additional_config", None) or {}):
            raise DiversedStartupError(f"DIVERSED was asked for but {reason}")
        return build(self, *args, **kwargs)

    EngineArgs.create_engine_config = create_engine_config
    logger.warning("diversed: %s; engines asking for it will refuse to start", reason)
