"""Rollout engines and the episode loop."""

from __future__ import annotations

from vlmrl.config import RolloutConfig
from vlmrl.rollout.engine import Engine, SamplingParams


def make_engine(rollout_cfg: RolloutConfig, policy, processor, builder) -> Engine:
    """The engine named by `rollout.engine`: `transformers` (in process, shares the trainer's module) or `vllm`
    (`rollout.vllm.mode`: colocate | server, `rollout.vllm.colocate_engine`: async | sync; its `sync_weights()` must
    follow every update and returns metrics).

    Raises ValueError naming `rollout.engine` for an unknown or unavailable engine.
    """
    if rollout_cfg.engine == "transformers":
        from vlmrl.rollout.hf import TransformersEngine

        tok = processor.tokenizer
        eos = sorted(builder.stop_token_ids)
        return TransformersEngine(
            policy, tok, eos, tok.pad_token_id, builder.image_token_id, suppress_ids=list(builder.placeholder_token_ids)
        )
    if rollout_cfg.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:  # only vlmrl.rollout.vllm imports vllm
            raise ValueError(
                "rollout.engine=vllm needs vLLM: pip install 'vlmrl[vllm]' (CUDA), or the CPU build "
                "as in `make test-vllm`"
            )
        from vlmrl.rollout.vllm.engine import make_vllm_engine

        tok = processor.tokenizer
        eos = sorted(builder.stop_token_ids)
        merge = getattr(getattr(processor, "image_processor", None), "merge_size", None)
        return make_vllm_engine(
            policy,
            processor,
            eos,
            builder.image_token_id,
            rollout_cfg.vllm,
            max_model_len=rollout_cfg.max_context_tokens,
            temperature=rollout_cfg.temperature,
            top_p=rollout_cfg.top_p,
            merge_size=merge if isinstance(merge, int) else None,
        )
    raise ValueError(f"rollout.engine={rollout_cfg.engine!r} is not available (choose: transformers, vllm)")


__all__ = ["Engine", "SamplingParams", "make_engine"]
