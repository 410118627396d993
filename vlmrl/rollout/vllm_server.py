"""Server mode of the vLLM engine (`rollout.vllm.mode=server`): an HTTP client of an OpenAI-compatible vLLM server
(no vllm import). Routes, the reload protocol and the server's flags are described in `vlmrl.rollout.vllm_engine`'s
docstring: generation and prompt logprobs through POST `/v1/completions` with token-id prompts; weight sync by
writing `model.safetensors` into `rollout.vllm.sync_dir` (rank 0) and POST `/collective_rpc` (`reload_weights`) +
`/reset_prefix_cache` (both need `VLLM_SERVER_DEV_MODE=1`). Text prompts only."""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from vlmrl.config import VLLMConfig
from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.vllm_convert import completion_body, generation_from_choice, prompt_logprobs_list
from vlmrl.rollout.vllm_weights import _world, write_weights
from vlmrl.types import EnginePrompt, Generation


def no_images(prompt: EnginePrompt) -> None:
    """Raise NotImplementedError for a prompt with images (server mode takes text-only prompts)."""
    if prompt.images:
        raise NotImplementedError("rollout.vllm.mode=server takes text-only prompts (vLLM 0.32's completions "
                                  "route has no images for token-id prompts); use rollout.vllm.mode=colocate for VLMs")


class VLLMServer:
    """The vLLM server at `config.url`; reads timeout_s, served_model and sync_dir from `config` (`rollout.vllm`).
    `served_model`: the given one, else the server's first model. Raises ValueError without `config.url`."""

    def __init__(self, config: VLLMConfig):
        if not config.url:
            raise ValueError("rollout.vllm.mode=server needs rollout.vllm.url")
        self.config = config
        self.url = config.url.rstrip("/")
        self.served_model = config.served_model or self.first_served_model()

    def post(self, path: str, body: dict | None = None, method: str = "POST") -> Any:
        """The decoded JSON response of `method path` with JSON `body` (RuntimeError naming the route on failure)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,  # type: ignore[operator]
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.config.timeout_s) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            if exc.code == 404 and path in ("/collective_rpc", "/reset_prefix_cache"):
                raise RuntimeError(f"vLLM server at {self.url} has no {path}: start it with "
                                   "VLLM_SERVER_DEV_MODE=1 (vLLM 0.32 exposes the reload endpoints only then)") from exc
            raise RuntimeError(f"vLLM server {method} {path} failed ({exc.code}): {detail}") from exc
        return json.loads(text) if text else None

    def first_served_model(self) -> str:
        models = self.post("/v1/models", method="GET")["data"]
        if not models:
            raise RuntimeError(f"vLLM server at {self.url} serves no model")
        return models[0]["id"]

    def generate(self, prompts: list[EnginePrompt], n: int, params: SamplingParams, seeds: Sequence[int | None],
                 eos_ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[list[Generation]]:
        """n samples of each prompt (one request per prompt, sent concurrently: the server batches them)."""
        for p in prompts:
            no_images(p)

        def one(args):
            prompt, seed = args
            body = completion_body(prompt.token_ids, params, n, eos_ids, seed, self.served_model)
            choices = sorted(self.post("/v1/completions", body)["choices"], key=lambda c: c["index"])
            return [generation_from_choice(c, eos_ids, decode) for c in choices]

        with ThreadPoolExecutor(max_workers=max(1, min(32, len(prompts)))) as pool:  # the server batches them
            return list(pool.map(one, zip(prompts, seeds)))

    def prompt_logprobs(self, prompt: EnginePrompt) -> list[float]:
        """The server's log p(ids[t] | ids[:t]) at temperature 1: [T], 0.0 at t = 0."""
        no_images(prompt)
        body = {"model": self.served_model, "prompt": list(prompt.token_ids), "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0}
        choice = self.post("/v1/completions", body)["choices"][0]
        return prompt_logprobs_list(prompt.token_ids, choice["prompt_logprobs"])

    def push_weights(self, module: torch.nn.Module) -> None:
        """Rank 0 writes the module's full state dict into the sync folder and has the server reload it; all ranks
        then meet at a barrier."""
        rank, barrier = _world()
        directory = Path(self.config.sync_dir or Path(tempfile.gettempdir()) / "vlmrl-vllm-sync")
        if rank == 0:
            write_weights(module, directory)
            self.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}})
            self.post("/reset_prefix_cache", {})
        barrier()
