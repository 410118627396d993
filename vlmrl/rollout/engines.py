"""Rollout engines (`rollout.engine`), registered by name in `ROLLOUT_ENGINES`: `transformers` (the
trainer's own module, in process) and `vllm` (`vlmrl.rollout.vllm`). Each is one factory decorated with
`@register_engine(name, ...)`; what the rest of the code needs to know about an engine is an attribute of its
`EngineSpec`, never a comparison with its name. A new engine is its own module plus one config line
`rollout.engine=package.module:name`. The factories import their engine modules when called, so registering costs
nothing (vllm stays unimported until `rollout.engine=vllm` builds an engine).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from vlmrl.config.validate import resolve_vllm_config
from vlmrl.registry import Registry

if TYPE_CHECKING:
    from vlmrl.config import Config, RolloutConfig
    from vlmrl.rollout.engine import Engine

# (rollout config, policy: a callable giving a context manager over the trainer's module, processor, token builder)
EngineFactory = Callable[["RolloutConfig", Any, Any, Any], "Engine"]


@dataclass(frozen=True)
class EngineSpec:
    """A registered rollout engine.

    make: the factory; shares_policy_module: it samples with the trainer's own module (so off-policy rollouts need a
    frozen copy of the behaviour weights, and an eval may gather its module once for all its generate calls);
    needs_rollout_correction: its logprobs come from another implementation of the policy than the trainer's
    (`algorithm.rollout_correction=auto` turns TIS on); configure: resolves the engine's own settings in place when
    the config loads (recorded in the run folder's config.yaml), or None; video: the reason a rollout config of this
    engine passes no video to the model, None when it does (`vlmrl.rollout.engine_video_refusal`), or None (the
    field) for an engine that takes no video.
    """

    name: str
    make: EngineFactory
    shares_policy_module: bool = False
    needs_rollout_correction: bool = True
    configure: Optional[Callable[["Config"], None]] = None
    video: Optional[Callable[["RolloutConfig"], Optional[str]]] = None


ROLLOUT_ENGINES: Registry[EngineSpec] = Registry("rollout.engine", ("vlmrl.rollout.engines",))


def register_engine(
    name: str,
    *,
    shares_policy_module: bool = False,
    needs_rollout_correction: bool = True,
    configure: Optional[Callable[["Config"], None]] = None,
    video: Optional[Callable[["RolloutConfig"], Optional[str]]] = None,
) -> Callable[[EngineFactory], EngineFactory]:
    """Decorator: register an engine factory under `name` (the attributes as `EngineSpec`'s)."""

    def deco(make: EngineFactory) -> EngineFactory:
        spec = EngineSpec(name, make, shares_policy_module, needs_rollout_correction, configure, video)
        ROLLOUT_ENGINES.add(name, spec)
        return make

    return deco


def _takes_video(rollout_cfg: RolloutConfig) -> Optional[str]:
    return None


def _vllm_video(rollout_cfg: RolloutConfig) -> Optional[str]:
    """vLLM takes videos as decoded frames in process (`vlmrl.rollout.vllm.video`); its server would decode and sample
    an encoded file again."""
    if rollout_cfg.vllm.mode == "server":
        return "rollout.vllm.mode=server takes no video (rollout.vllm.mode=colocate does)"
    return None


@register_engine("transformers", shares_policy_module=True, needs_rollout_correction=False, video=_takes_video)
def transformers_engine(rollout_cfg: RolloutConfig, policy: Any, processor: Any, builder: Any) -> Engine:
    """`model.generate` of the trainer's module (`vlmrl.rollout.hf.TransformersEngine`), batched."""
    from vlmrl.rollout.hf import TransformersEngine

    tok = processor.tokenizer
    eos = sorted(builder.stop_token_ids)
    return TransformersEngine(
        policy,
        tok,
        eos,
        tok.pad_token_id,
        builder.image_token_id,
        suppress_ids=list(builder.placeholder_token_ids),
        video_token_id=builder.video_token_id,
    )


@register_engine("vllm", configure=resolve_vllm_config, video=_vllm_video)
def vllm_engine(rollout_cfg: RolloutConfig, policy: Any, processor: Any, builder: Any) -> Engine:
    """vLLM (`rollout.vllm.mode`: colocate | server, `rollout.vllm.colocate_engine`: async | sync); its
    `sync_weights()` must follow every update. Raises ValueError when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:  # only vlmrl.rollout.vllm imports vllm
        python = "%d.%d" % sys.version_info[:2]
        floor = "" if sys.version_info >= (3, 11) else f" (vLLM 0.32 and 0.33 need Python >= 3.11; this is {python})"
        raise ValueError(
            f"rollout.engine=vllm needs vLLM{floor}: pip install 'vlmrl[vllm]' (CUDA), or the CPU build as in "
            "`make test-vllm`"
        )
    from vlmrl.rollout.vllm.engine import make_vllm_engine

    merge = getattr(getattr(processor, "image_processor", None), "merge_size", None)
    return make_vllm_engine(
        policy,
        processor,
        sorted(builder.stop_token_ids),
        builder.image_token_id,
        rollout_cfg.vllm,
        max_model_len=rollout_cfg.max_context_tokens,
        temperature=rollout_cfg.temperature,
        top_p=rollout_cfg.top_p,
        merge_size=merge if isinstance(merge, int) else None,
        suppress_ids=builder.placeholder_token_ids,
        video=video_ids(builder),
    )


def video_ids(builder: Any) -> Any:
    """The video span's ids of `builder`'s family for vLLM (`vlmrl.rollout.vllm.video.VideoIds`), or None when it
    takes no video here."""
    from vlmrl.rollout.vllm.video import VideoIds

    if builder.video_token_id is None or len(builder.vision_tokens) != 2:
        return None
    start, end = (int(builder.tokenizer.convert_tokens_to_ids(t)) for t in builder.vision_tokens)
    return VideoIds(int(builder.video_token_id), start, end, bool(builder.video_timestamps))
