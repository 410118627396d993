"""Pure conversions between vlmrl's prompts/generations and vLLM's inputs/outputs (no vllm import; unit-tested with
fake vLLM objects). The conventions (image placeholders, logprobs modes, stop reasons) are described in
`vlmrl.rollout.vllm.engine`'s docstring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.vllm.video import VideoIds, collapse_video_spans, video_data
from vlmrl.types import EnginePrompt, Generation, StopReason


# --- conversions to vLLM (pure; unit-tested without vllm) --------------------------------------------------------
def choose_logprobs_mode(temperature: float, top_p: float) -> str:
    """The vLLM `logprobs_mode` whose sampled-token logprobs equal log_softmax(logits / temperature) (see
    `vlmrl.rollout.vllm.engine`)."""
    if top_p < 1.0 and temperature == 1.0:
        return "raw_logprobs"
    return "processed_logprobs"


def logprobs_exact(mode: str, temperature: float, top_p: float) -> bool:
    """True when vLLM's `mode` returns exactly vlmrl's logprob convention for a call with these settings.

    The same rule for both of vLLM's model runners (0.32 and 0.33): the V1 runner (the CPU platform's) takes
    processed logprobs after top-k/top-p (`vllm/v1/sample/ops/topk_topp_sampler.py`), and so does the V2 runner that
    CUDA runs by default (`vllm/v1/worker/gpu/sample/sampler.py`: when processed logprobs are returned the fused
    sampler is not used, and the logprobs come from the logits after `apply_top_k_top_p`)."""
    if mode == "processed_logprobs":
        return top_p >= 1.0
    if mode == "raw_logprobs":
        return temperature == 1.0
    return False


def image_token_counts(prompt: EnginePrompt, merge_size: int | None) -> list[int] | None:
    """Placeholder tokens of each image of `prompt` (grid.prod() // merge**2), or None without processed vision."""
    grids = prompt.image_grid_thw
    if grids is None or not merge_size:
        return None
    return [int(n) for n in (grids.prod(-1) // (merge_size * merge_size)).tolist()]


def collapse_image_placeholders(
    ids: Sequence[int], image_token_id: int, counts: Sequence[int] | None, num_images: int
) -> list[int]:
    """`ids` with each image's run of `image_token_id` reduced to one placeholder (vLLM expands it again).

    counts: each image's expected run length (None: every maximal run is one image). Raises ValueError when the runs
    do not match the images (a cut vision span, a count from other processor settings, a missing image).
    """
    out: list[int] = []
    pending = list(counts) if counts is not None else None
    seen, i = 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out.append(ids[i])
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == image_token_id:
            j += 1
        run = j - i
        if pending is None:
            out.append(image_token_id)
            seen += 1
        else:  # a maximal run may hold several adjacent images
            while run > 0:
                if not pending or pending[0] > run:
                    raise ValueError(
                        f"image placeholder run of {j - i} tokens at {i} does not match the images' "
                        f"token counts {list(counts or [])}"
                    )
                run -= pending.pop(0)
                out.append(image_token_id)
                seen += 1
        i = j
    if seen != num_images or (pending is not None and pending):
        raise ValueError(f"{seen} image placeholder runs in the prompt but {num_images} images")
    return out


def to_vllm_prompt(
    prompt: EnginePrompt, image_token_id: int | None, merge_size: int | None, video: VideoIds | None = None
) -> dict:
    """A vLLM token prompt: `{"prompt_token_ids": ids}` (+ `"multi_modal_data"`: `{"image": [PIL, ...]}` with images,
    `{"video": [(frames, metadata), ...]}` with videos), each image's placeholder run and each video's expanded span
    collapsed to one placeholder (see `vlmrl.rollout.vllm.engine`'s docstring and `vlmrl.rollout.vllm.video`).
    Raises ValueError for a prompt with images but no `image_token_id`, with videos but no `video` ids or merge
    size, and for placeholders that do not match the images or videos."""
    ids = list(prompt.token_ids)
    data: dict[str, list] = {}
    if prompt.images:
        if image_token_id is None:
            raise ValueError("a prompt with images needs the model's image placeholder id")
        counts = image_token_counts(prompt, merge_size)
        ids = collapse_image_placeholders(ids, image_token_id, counts, len(prompt.images))
        data["image"] = list(prompt.images)
    if prompt.videos:
        if video is None or not merge_size:
            raise ValueError("a prompt with videos needs the model's video placeholder ids and merge size")
        ids = collapse_video_spans(prompt, ids, video, merge_size)
        data["video"] = video_data(prompt)
    return {"prompt_token_ids": ids, "multi_modal_data": data} if data else {"prompt_token_ids": ids}


SUPPRESS_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100]; e^-100 ~ 4e-44: never sampled


def sampling_kwargs(
    params: SamplingParams,
    n: int,
    stop_token_ids: Sequence[int],
    seed: int | None,
    suppress_ids: Sequence[int] = (),
) -> dict:
    """Keyword arguments of `vllm.SamplingParams` for one prompt: n samples, the sampled token's logprob
    (`logprobs=0`), no top-k/min-p/penalties (vlmrl's logprobs are of logits / temperature only), vlmrl's stop ids.

    suppress_ids: ids never sampled, the image/video placeholders (`logit_bias` SUPPRESS_BIAS each). vLLM matches
    every placeholder id in a token prompt to the request's images, first come first served, so a sampled one would
    take a later image's features in the next turn's prompt; the transformers engine suppresses the same ids. The
    logprobs are unchanged in `raw_logprobs` mode; in `processed_logprobs` mode they are renormalised over the other
    ids, off by log(1 - p(suppressed)) ~ p(suppressed) per token."""
    extra = {"logit_bias": {int(t): SUPPRESS_BIAS for t in suppress_ids}} if suppress_ids else {}
    return {
        **extra,
        "n": n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": params.max_new_tokens,
        "stop": list(params.stop) or None,
        "stop_token_ids": list(stop_token_ids),
        "seed": seed,
        "logprobs": 0,
        "include_stop_str_in_output": True,
    }


def image_data_url(image: Any) -> str:
    """A PIL image as a lossless `data:image/png;base64,...` URL (what vLLM's server fetches for `image_url`)."""
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def generate_body(
    prompt: EnginePrompt, sampling: dict, model: str, image_token_id: int | None, merge_size: int | None
) -> dict:
    """The JSON body of a POST `/inference/v1/generate` (vLLM's token-in/token-out route, `--enable-scale-out`):
    `token_ids` with each image's placeholder run collapsed to one token (the server expands it, as in
    `to_vllm_prompt`), the images as PNG data URLs in `content_parts` (in prompt order), `sampling` (the
    `vllm.SamplingParams` fields, e.g. `sampling_kwargs(...)`), and `return_token_ids` so the response carries the
    server's expanded prompt ids. Raises ValueError as `to_vllm_prompt`, and for a prompt with videos (the server
    route takes images only: a video would go as an encoded file, which vLLM decodes and samples again)."""
    if prompt.videos:
        raise ValueError("rollout.vllm.mode=server takes no video (rollout.vllm.mode=colocate does)")
    converted = to_vllm_prompt(prompt, image_token_id, merge_size)
    sampling = {k: v for k, v in sampling.items() if v is not None}  # seed None: the server's own
    body: dict[str, Any] = {
        "model": model,
        "token_ids": converted["prompt_token_ids"],
        "sampling_params": sampling,
        "return_token_ids": True,
        "output_mode": "tokens",
    }
    if prompt.images:
        body["content_parts"] = [{"type": "image_url", "url": image_data_url(im)} for im in prompt.images]
    return body


# --- conversions from vLLM --------------------------------------------------------------------------------------
def to_stop_reason(finish_reason: str | None, stop_reason: int | str | None) -> StopReason:
    """vLLM's (finish_reason, stop_reason) -> StopReason (see `vlmrl.rollout.vllm.engine`'s docstring).
    Raises RuntimeError for any other finish_reason (e.g. an aborted request)."""
    if finish_reason == "length":
        return StopReason.LENGTH
    if finish_reason == "stop":
        return StopReason.STOP_STRING if isinstance(stop_reason, str) else StopReason.EOS
    raise RuntimeError(f"vLLM finished a sample with finish_reason={finish_reason!r} (aborted?)")


def _logprob_value(entry: Any) -> float:
    return float(entry.logprob if hasattr(entry, "logprob") else entry["logprob"] if isinstance(entry, dict) else entry)


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """The logprob of each sampled token from vLLM's per-position `{token_id: Logprob}` dicts (a list, or 0.32's
    `FlatLogprobs`, which indexes the same way).
    Raises RuntimeError when vLLM returned no logprobs or not one per sampled token."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs (the request must set logprobs=0)")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
    return [_logprob_value(logprobs[t][tok]) for t, tok in enumerate(token_ids)]


def _finish(
    ids: list[int],
    logprobs: list[float],
    reason: StopReason,
    eos_ids: Sequence[int],
    decode: Callable[[list[int]], str],
) -> Generation:
    if reason is StopReason.EOS and (not ids or ids[-1] not in eos_ids):
        raise RuntimeError(f"vLLM stopped on EOS but the sampled ids end with {ids[-1:]} (expected one of {eos_ids})")
    return Generation(token_ids=ids, logprobs=logprobs, stop_reason=reason, text=decode(ids))


def generation_from_vllm(output: Any, eos_ids: Sequence[int], decode: Callable[[list[int]], str]) -> Generation:
    """A `vllm.CompletionOutput` (token_ids, logprobs, finish_reason, stop_reason) -> Generation."""
    ids = [int(t) for t in output.token_ids]
    reason = to_stop_reason(output.finish_reason, output.stop_reason)
    return _finish(ids, sampled_logprobs(ids, output.logprobs), reason, eos_ids, decode)


def generation_from_generate_choice(
    choice: dict, eos_ids: Sequence[int], decode: Callable[[list[int]], str]
) -> Generation:
    """One `choices[i]` of a `/inference/v1/generate` response (`output_mode="tokens"`, `logprobs=0`) ->
    Generation. Raises RuntimeError when the logprobs do not pair one to one with the token ids."""
    ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        raise RuntimeError("vLLM server returned no logprobs (the request must set sampling_params.logprobs=0)")
    if [int(c["token_id"]) for c in content] != ids:
        raise RuntimeError(
            f"server logprob tokens {[c['token_id'] for c in content][:8]}... differ from its token_ids {ids[:8]}..."
        )
    reason = to_stop_reason(choice.get("finish_reason"), choice.get("stop_reason"))
    return _finish(ids, [float(c["logprob"]) for c in content], reason, eos_ids, decode)


def prompt_logprobs_list(ids: Sequence[int], prompt_logprobs: Sequence[Any]) -> list[float]:
    """vLLM `prompt_logprobs` (None at position 0, then `{token_id: Logprob}` dicts, string keys from the server) ->
    [T] floats, 0.0 at position 0 (the layout of `sequence_logprobs`).
    Raises RuntimeError when there is not one entry per prompt token."""
    if len(prompt_logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(prompt_logprobs)} prompt logprobs for {len(ids)} prompt tokens")
    out = [0.0]
    for t in range(1, len(ids)):
        entry = prompt_logprobs[t]
        value = entry.get(ids[t], entry.get(str(ids[t]))) if isinstance(entry, dict) else entry[ids[t]]
        out.append(_logprob_value(value))
    return out


def max_abs_delta(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """max |a - b| over all positions >= 1 of paired sequences (0.0 when there are none).
    Raises ValueError for paired sequences of different lengths."""
    worst = 0.0
    for x, y in zip(a, b):
        if len(x) != len(y):
            raise ValueError(f"logprob sequences of different lengths ({len(x)} vs {len(y)})")
        worst = max([worst, *(abs(float(p) - float(q)) for p, q in zip(x[1:], y[1:]))])
    return worst


def check_expanded(prompt: EnginePrompt, vllm_ids: Sequence[int] | None, who: str = "vLLM") -> None:
    """Raise RuntimeError when vLLM's expanded prompt ids (None: not returned, nothing to check) differ from the
    prompt's."""
    if vllm_ids is not None and list(vllm_ids) != list(prompt.token_ids):
        raise RuntimeError(
            f"{who} expanded the prompt to {len(vllm_ids)} tokens, ours has {len(prompt.token_ids)}: its image "
            "processing differs from the token builder's (min/max pixels?); rollouts would be off-policy"
        )


@dataclass(frozen=True)
class TokenIO:
    """What converting between vlmrl's prompts/generations and vLLM's needs (both colocated engines and the server
    client): the stop ids (`eos_ids`), the image placeholder id, the image processor's merge size, the
    tokenizer's decode for `Generation.text`, the ids never sampled (`suppress_ids`) and the video span's ids."""

    eos_ids: list[int]
    image_token_id: int | None
    merge_size: int | None
    decode: Callable[[list[int]], str]
    suppress_ids: tuple[int, ...] = ()  # never sampled: the family's placeholder ids (`sampling_kwargs`)
    video: VideoIds | None = None  # the video span's ids (None: the family takes no video here)

    def prompt(self, prompt: EnginePrompt) -> dict:
        """`to_vllm_prompt(prompt)` (placeholders collapsed, images and videos as `multi_modal_data`)."""
        return to_vllm_prompt(prompt, self.image_token_id, self.merge_size, self.video)

    def sampling(self, params: SamplingParams, n: int) -> dict:
        """`sampling_kwargs` for n samples with vlmrl's stop ids and the request's seed."""
        return sampling_kwargs(params, n, self.eos_ids, params.seed, self.suppress_ids)

    def generations(self, prompt: EnginePrompt, output: Any) -> list[Generation]:
        """A `vllm.RequestOutput` for `prompt` -> its samples in index order (RuntimeError: see `check_expanded`)."""
        check_expanded(prompt, output.prompt_token_ids)
        return [
            generation_from_vllm(o, self.eos_ids, self.decode) for o in sorted(output.outputs, key=lambda o: o.index)
        ]

    def prompt_logprobs(self, prompt: EnginePrompt, output: Any) -> list[float]:
        """A `vllm.RequestOutput` with `prompt_logprobs=0` -> [T] logprobs, 0.0 at t = 0."""
        check_expanded(prompt, output.prompt_token_ids)
        return prompt_logprobs_list(prompt.token_ids, output.prompt_logprobs)


PROMPT_LOGPROBS = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False}
"""`vllm.SamplingParams` fields of a prompt-logprobs request (the weight check; temperature 1 in every mode)."""
