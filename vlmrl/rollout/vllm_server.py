"""Server mode of the vLLM engine (`rollout.vllm.mode=server`): an HTTP client of vLLM's own server (no vllm import).

The server: `python -m vllm.entrypoints.openai.api_server --model DIR --enable-scale-out --generation-config vllm
--logprobs-mode processed_logprobs` with `VLLM_SERVER_DEV_MODE=1` (the reload and cache-reset routes exist only
then). Routes used (vLLM 0.32):
- POST `/inference/v1/generate` (token-in/token-out, `--enable-scale-out`): `token_ids` with each image's
  placeholder run collapsed to one token, the images as PNG data URLs in `content_parts` (vLLM's processor expands
  the placeholders again; `return_token_ids` gives the expanded ids back and they must equal ours), and
  `sampling_params`; the response holds each sample's `token_ids`, the sampled token's logprob per token and the
  finish/stop reasons. Prompt logprobs (the weight check) come from the same route with `prompt_logprobs=0`.
- Weight sync: rank 0 writes the full state dict as `model.safetensors` into `rollout.vllm.sync_dir` (a folder the
  server can read), POST `/collective_rpc` `{"method": "reload_weights", "kwargs": {"weights_path": DIR}}`, then
  POST `/reset_prefix_cache` and `/reset_encoder_cache` (cached KV blocks and vision-encoder outputs were computed
  with the old weights).
"""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from vlmrl.config import VLLMConfig
from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.vllm_convert import (
    generate_body,
    generation_from_generate_choice,
    prompt_logprobs_list,
    sampling_kwargs,
)
from vlmrl.rollout.vllm_weights import _world, write_weights
from vlmrl.types import EnginePrompt, Generation

GENERATE = "/inference/v1/generate"
_DEV_ROUTES = ("/collective_rpc", "/reset_prefix_cache", "/reset_encoder_cache")


class VLLMServer:
    """vLLM's server at `config.url` (`rollout.vllm`; also reads timeout_s, served_model, sync_dir).

    image_token_id, merge_size: as `to_vllm_prompt` (placeholder collapsing for prompts with images).
    `served_model`: the given one, else the server's first model. Raises ValueError without `config.url`.
    """

    def __init__(self, config: VLLMConfig, image_token_id: int | None = None, merge_size: int | None = None):
        if not config.url:
            raise ValueError("rollout.vllm.mode=server needs rollout.vllm.url")
        self.config = config
        self.url = config.url.rstrip("/")
        self.image_token_id, self.merge_size = image_token_id, merge_size
        self.served_model = config.served_model or self.first_served_model()

    def post(self, path: str, body: dict | None = None, method: str = "POST") -> Any:
        """The decoded JSON response of `method path` with JSON `body` (RuntimeError naming the route on failure)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.config.timeout_s) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            if exc.code == 404 and path in _DEV_ROUTES:
                raise RuntimeError(
                    f"vLLM server at {self.url} has no {path}: start it with VLLM_SERVER_DEV_MODE=1 "
                    "(vLLM 0.32 exposes the reload and cache-reset routes only then)"
                ) from exc
            if path == GENERATE and exc.code in (403, 404):
                raise RuntimeError(
                    f"vLLM server at {self.url} refuses {path} ({exc.code}): start it with "
                    "--enable-scale-out (vLLM >= 0.32's token-in/token-out route)"
                ) from exc
            raise RuntimeError(f"vLLM server {method} {path} failed ({exc.code}): {detail}") from exc
        return json.loads(text) if text else None

    def first_served_model(self) -> str:
        """The name of the first model the server lists. Raises RuntimeError when it serves none."""
        models = self.post("/v1/models", method="GET")["data"]
        if not models:
            raise RuntimeError(f"vLLM server at {self.url} serves no model")
        return models[0]["id"]

    def _generate(self, prompt: EnginePrompt, sampling: dict) -> dict:
        """The server's response to one prompt; RuntimeError when its expanded prompt ids differ from ours."""
        out = self.post(
            GENERATE, generate_body(prompt, sampling, self.served_model, self.image_token_id, self.merge_size)
        )
        theirs = out.get("prompt_token_ids")
        if theirs is not None and list(theirs) != list(prompt.token_ids):
            raise RuntimeError(
                f"vLLM server expanded the prompt to {len(theirs)} tokens, ours has "
                f"{len(prompt.token_ids)}: its image processing differs from the token builder's "
                "(min/max pixels?); rollouts would be off-policy"
            )
        return out

    def generate(
        self,
        prompt: EnginePrompt,
        n: int,
        params: SamplingParams,
        eos_ids: Sequence[int],
        decode: Callable[[list[int]], str],
    ) -> list[Generation]:
        """n samples of `prompt` (seed `params.seed`; None: the server's) in one request."""
        out = self._generate(prompt, sampling_kwargs(params, n, eos_ids, params.seed))
        choices = sorted(out["choices"], key=lambda c: c["index"])
        return [generation_from_generate_choice(c, eos_ids, decode) for c in choices]

    def prompt_logprobs(self, prompt: EnginePrompt) -> list[float]:
        """The server's log p(ids[t] | ids[:t]) at temperature 1, images included: [T], 0.0 at t = 0."""
        out = self._generate(prompt, {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False})
        return prompt_logprobs_list(prompt.token_ids, out["prompt_logprobs"])

    def push_weights(self, module: torch.nn.Module) -> None:
        """Rank 0 writes the module's full state dict into the sync folder, has the server reload it and reset its
        prefix and encoder caches; all ranks then meet at a barrier."""
        rank, barrier = _world()
        directory = Path(self.config.sync_dir or Path(tempfile.gettempdir()) / "vlmrl-vllm-sync")
        if rank == 0:
            write_weights(module, directory)
            self.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}})
            self.post("/reset_prefix_cache", {})
            self.post("/reset_encoder_cache", {})
        barrier()
