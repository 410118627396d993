"""A transformers `generate` engine: in process, CPU or GPU, sharing the policy module with the trainer.

`generate_batch` left-pads every row of every pending request (n rows per request) into ONE `model.generate` call.
Positions stay exact under left padding: `generate` derives them from the attention mask (Qwen-VL: `get_rope_index`
with the mask, M-RoPE over the unpadded tokens only). Each row is sampled by `sampling.RowSampler` from its own
generator (seed `derive_seed(request seed, k)` for sample k), so a request's samples do not depend on the batch.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import GenerationConfig, LogitsProcessorList

from vlmrl.modeling.inputs import family_of_model, model_inputs
from vlmrl.modeling.video_positions import use_reference_video_positions
from vlmrl.rollout.engine import Engine, GenerateRequest, SamplingParams, derive_seed
from vlmrl.rollout.sampling import RowSampler
from vlmrl.rollout.vision_cache import VisionCache, supports
from vlmrl.types import EnginePrompt, Generation, StopReason, VideoInputs, VisionInputs


@dataclass
class _Row:
    """One sampled continuation: a request's prompt and params, and this sample's seed."""

    prompt: EnginePrompt
    params: SamplingParams
    seed: int


class TransformersEngine(Engine):
    """Samples with `model.generate`, all pending requests in one left-padded batch.

    policy: a callable returning a context manager that yields the current policy module (for ZeRO-3 the trainer
    gathers the parameters inside it; `session()` enters it once per rollout). eos_ids: ids that end a turn (e.g.
    Qwen's `<|im_end|>` and `<|endoftext|>`). pad_id: the left-padding id (None: eos_ids[0]). image_token_id: the
    placeholder id (mm_token_type_ids / token_type_ids). family: the model family, whose image inputs
    `vlmrl.modeling.inputs.model_inputs` builds (None: read from the model's `config.model_type`; a model of no
    known family, e.g. a text-only LM, gets the Qwen-VL inputs). suppress_ids: ids never sampled (default: the image
    placeholder). cache_vision: within a `session()`, encode each image once and hand the model the cached vision
    outputs on later turns (`vlmrl.rollout.vision_cache`; families with Qwen-VL inputs). video_token_id: the video
    placeholder id (Qwen-VL's `<|video_pad|>`; with cache_vision each video is encoded once a session too).
    """

    def __init__(
        self,
        policy: Callable[[], AbstractContextManager[torch.nn.Module]],
        tokenizer,
        eos_ids: list[int],
        pad_id: int | None,
        image_token_id: int,
        family: str | None = None,
        suppress_ids: list[int] | None = None,
        cache_vision: bool = True,
        video_token_id: int | None = None,
    ):
        self.policy = policy
        # placeholder ids never sampled (as vLLM, `vlmrl.rollout.vllm.convert.sampling_kwargs`); suppressed in
        # sampling only: the returned logprobs are of the unsuppressed distribution, like the trainer's
        self.suppress_ids = list(suppress_ids) if suppress_ids is not None else [image_token_id]
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self.pad_id = pad_id if pad_id is not None else self.eos_ids[0]
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.family = family
        self._module: torch.nn.Module | None = None
        self.cache_vision = cache_vision
        self._vision: VisionCache | None = None  # the current session's (one rollout, one set of weights)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Enter the policy context once for a whole rollout (collective under ZeRO-3); nested sessions reuse it."""
        if self._module is not None:
            yield
            return
        with self.policy() as model:
            self._module, self._vision = model, VisionCache() if self.cache_vision else None
            try:
                yield
            finally:
                self._module, self._vision = None, None

    def weights_changed(self) -> None:
        """A new vision cache: the images' encoder outputs were computed with the old weights."""
        if self._vision is not None:
            self._vision = VisionCache()

    def generate(self, prompts: list[EnginePrompt], n: int, params: SamplingParams) -> list[list[Generation]]:
        """n samples of each prompt; prompt i gets seed `params.seed + i` (None: drawn from torch's global RNG)."""
        seeds = [None if params.seed is None else params.seed + i for i in range(len(prompts))]
        return self.generate_batch(
            [
                GenerateRequest(
                    p, n, SamplingParams(params.max_new_tokens, params.temperature, params.top_p, list(params.stop), s)
                )
                for p, s in zip(prompts, seeds)
            ]
        )

    @torch.no_grad()
    def generate_batch(self, requests: list[GenerateRequest]) -> list[list[Generation]]:
        """All requests' rows in one left-padded `generate` (one per distinct stop-string list). Returns
        [len(requests)][request.n]. A request without a seed gets one from torch's global RNG (in request order)."""
        rows: list[_Row] = []
        for req in requests:
            seed = req.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, ()))
            rows += [_Row(req.prompt, req.params, derive_seed(seed, k)) for k in range(req.n)]
        gens: list[Generation | None] = [None] * len(rows)
        by_stop: dict[tuple[str, ...], list[int]] = {}
        for i, row in enumerate(rows):
            by_stop.setdefault(tuple(row.params.stop), []).append(i)
        model_cm = contextlib.nullcontext(self._module) if self._module is not None else self.policy()
        with model_cm as model:
            for stop, idx in by_stop.items():
                for i, gen in zip(idx, self._sample(model, [rows[i] for i in idx], list(stop))):
                    gens[i] = gen
        out, start = [], 0
        for req in requests:
            out.append(gens[start : start + req.n])
            start += req.n
        return out  # type: ignore[return-value]

    def _batch_inputs(self, model: torch.nn.Module, rows: list[_Row]) -> dict:
        """The family's generate kwargs for the left-padded rows (`vlmrl.modeling.inputs.model_inputs`): input_ids and
        attention_mask [B, T] (0 on padding), the rows' images concatenated in row order; on the model's device,
        pixel values in the model's dtype."""
        width = max(len(r.prompt.token_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            n = len(row.prompt.token_ids)
            ids[b, width - n :] = torch.tensor(row.prompt.token_ids, dtype=torch.long)
            mask[b, width - n :] = 1
        visions = [part for r in rows for part in r.prompt.vision_parts]  # concatenated once, below
        videos = [part for r in rows for part in r.prompt.video_parts]  # concatenated only without the cache
        device = next(model.parameters()).device
        family = self.family or family_of_model(model)
        if family is None:  # not a known VLM family: a text-only LM, or a Qwen-VL-like model
            family = "qwen2_5_vl"
            if not visions and not videos:
                return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        if videos:  # Qwen-VL: video placeholders are type 2
            keys = [v for r in rows for v in r.prompt.videos]
            images = [im for r in rows for im in r.prompt.images]
            return self._video_inputs(model, family, ids, mask, (visions, images), (videos, keys))
        if visions and self._vision is not None and supports(model, family):  # each image encoded once a rollout
            inputs = model_inputs(family, ids, None, self.image_token_id, mask)
            inputs = {k: v.to(device) for k, v in inputs.items()}
            inputs["image_grid_thw"] = VisionInputs.grids(visions).to(device)  # type: ignore[union-attr]
            images = [im for r in rows for im in r.prompt.images]
            inputs["mm_encoder_outputs"] = {"image": self._vision.encoder_outputs(model, visions, images)}
            return inputs
        inputs = model_inputs(family, ids, VisionInputs.cat(visions), self.image_token_id, mask)
        return {k: v.to(device, dtype=model.dtype) if k == "pixel_values" else v.to(device) for k, v in inputs.items()}

    def _video_inputs(
        self,
        model,
        family: str,
        ids: torch.Tensor,
        mask: torch.Tensor,
        images: tuple[list[VisionInputs], list],
        videos: tuple[list[VideoInputs], list],
    ) -> dict:
        """`model_inputs` with the videos, mm_token_type_ids 2 on the video placeholders. images: the rows' processed
        image parts and their images; videos: the rows' processed videos and their `Video` objects (in order). Within
        a session each image and video is encoded once (`VisionCache`, `mm_encoder_outputs`); otherwise the pixels
        go to the model (`VideoInputs.as_kwargs`).

        Raises ValueError for an engine without the family's video placeholder id."""
        if self.video_token_id is None:
            raise ValueError("a prompt with videos needs the family's video placeholder id (video_token_id)")
        (visions, pictures), (processed, keys) = images, videos
        cache = self._vision if self._vision is not None and supports(model, family) else None
        inputs = model_inputs(family, ids, None if cache else VisionInputs.cat(visions), self.image_token_id, mask)
        inputs["mm_token_type_ids"] = inputs["mm_token_type_ids"].masked_fill(ids == self.video_token_id, 2)
        use_reference_video_positions()  # Qwen2/2.5-VL: the text after a video as the reference places it
        device, dtype = next(model.parameters()).device, model.dtype
        if cache is None:
            inputs.update(VideoInputs.cat(processed).as_kwargs())  # type: ignore[union-attr]
            return {
                k: v.to(device, dtype=dtype) if k.startswith("pixel_values") else v.to(device)
                for k, v in inputs.items()
            }
        inputs = {k: v.to(device) for k, v in {**inputs, **VideoInputs.grid_kwargs(processed)}.items()}
        encoded = {"video": cache.video_outputs(model, processed, keys)}
        if visions:
            inputs["image_grid_thw"] = VisionInputs.grids(visions).to(device)  # type: ignore[union-attr]
            encoded["image"] = cache.encoder_outputs(model, visions, pictures)
        inputs["mm_encoder_outputs"] = encoded
        return inputs

    def _sample(self, model, rows: list[_Row], stop: list[str]) -> list[Generation]:
        inputs = self._batch_inputs(model, rows)
        width = inputs["input_ids"].shape[1]
        max_new = [r.params.max_new_tokens for r in rows]
        sampler = RowSampler(
            [r.seed for r in rows],
            max_new,
            [r.params.temperature for r in rows],
            [r.params.top_p for r in rows],
            width,
            self.suppress_ids,
            self.eos_ids[0],
            inputs["input_ids"].device,
        )
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max(max_new),
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            stop_strings=stop or None,
        )
        # greedy over RowSampler's one-hot scores; the model's own generation_config (repetition_penalty,
        # suppress_tokens, ...) is swapped out so that no other logits processor touches the logits
        saved, was_training = model.generation_config, model.training
        model.generation_config = GenerationConfig()
        model.eval()
        try:
            seqs = model.generate(
                **inputs,
                generation_config=config,
                logits_processor=LogitsProcessorList([sampler]),
                tokenizer=self.tokenizer if stop else None,
            )
        finally:
            model.generation_config = saved
            model.train(was_training)
        new, logprobs = seqs[:, width:].tolist(), sampler.logprobs().tolist()
        return [self._trim(new[b][:m], logprobs[b][:m], row.params) for b, (row, m) in enumerate(zip(rows, max_new))]

    def _trim(self, ids: list[int], logprobs: list[float], params: SamplingParams) -> Generation:
        """Cut a padded sampled row at its end: a stop string (HF pads after it), else the first EOS (kept), else
        max length."""
        first_eos = next((t for t, tok in enumerate(ids) if tok in self.eos_ids), None)
        end = len(ids) if first_eos is None else first_eos
        if params.stop:
            for t in range(end):
                if any(s in self.tokenizer.decode(ids[: t + 1]) for s in params.stop):
                    return self._gen(ids[: t + 1], logprobs[: t + 1], StopReason.STOP_STRING)
        if first_eos is not None:
            return self._gen(ids[: end + 1], logprobs[: end + 1], StopReason.EOS)
        return self._gen(ids, logprobs, StopReason.LENGTH)

    def _gen(self, ids: list[int], logprobs: list[float], reason: StopReason) -> Generation:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(token_ids=ids, logprobs=logprobs, stop_reason=reason, text=text)
