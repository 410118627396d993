"""Server mode of the vLLM engine (`rollout.vllm.mode=server`): an HTTP client of vLLM's own server (no vllm import).

The server: `python -m vllm.entrypoints.openai.api_server --model DIR --enable-scale-out --generation-config vllm
--logprobs-mode processed_logprobs` with `VLLM_SERVER_DEV_MODE=1` (the reload and cache-reset routes exist only
then). Routes used (vLLM 0.32):
- POST `/inference/v1/generate` (token-in/token-out, `--enable-scale-out`): `token_ids` with each image's
  placeholder run collapsed to one token, the images as PNG data URLs in `content_parts` (vLLM's processor expands
  the placeholders again; `return_token_ids` gives the expanded ids back and they must equal vlmrl's), and
  `sampling_params`; the response holds each sample's `token_ids`, the sampled token's logprob per token and the
  finish/stop reasons. Prompt logprobs (the weight check) come from the same route with `prompt_logprobs=0`.
  Each engine request is one HTTP request, sent as soon as its episode submits it (`agenerate`, one client thread
  per request in flight), so the server's continuous batching sees every pending episode.
- Weight sync (`rollout.vllm.weight_sync`), rank 0, then all ranks meet at a barrier:
  - `file` (CPU default): the full state dict as `model.safetensors` into `rollout.vllm.sync_dir` (a folder the
    server can read), POST `/collective_rpc` `{"method": "reload_weights", "kwargs": {"weights_path": DIR}}`;
  - `nccl` (GPU default; the server started with `--weight-transfer-config '{"backend": "nccl"}'`): vLLM's own NCCL
    engine (`vllm/distributed/weight_transfer/nccl_engine.py`): the first sync asks GET `/get_world_size` and
    rendezvouses (`/init_weight_transfer_engine`, this rank as NCCL rank 0 at rollout.vllm.nccl_address:nccl_port);
    each sync POSTs `/pause?mode=wait`, `/start_weight_update`, `/update_weights` (names, dtypes, shapes) while the
    packed buckets are broadcast, `/finish_weight_update`, `/resume`. Written to vLLM 0.32's API; never ran here.
  then POST `/reset_prefix_cache` and `/reset_encoder_cache` (cached KV blocks and vision-encoder outputs were
  computed with the old weights).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from vlmrl.config import VLLMConfig
from vlmrl.rollout.engine import GenerateRequest
from vlmrl.rollout.vllm.convert import (
    PROMPT_LOGPROBS,
    TokenIO,
    check_expanded,
    generate_body,
    generation_from_generate_choice,
    prompt_logprobs_list,
)
from vlmrl.rollout.vllm.weights import _world, full_state_items, write_weights
from vlmrl.types import EnginePrompt, Generation

GENERATE = "/inference/v1/generate"
_DEV_ROUTES = ("/collective_rpc", "/reset_prefix_cache", "/reset_encoder_cache", "/get_world_size")


MAX_IN_FLIGHT = 256  # concurrent HTTP requests of one client (one thread each)


class VLLMServer:
    """vLLM's server at `config.url` (`rollout.vllm`; also reads timeout_s, served_model, sync_dir).

    io: stop ids, placeholder collapsing for prompts with images, decoding (`TokenIO`).
    `served_model`: the given one, else the server's first model. Raises ValueError without `config.url`.
    """

    def __init__(self, config: VLLMConfig, io: TokenIO, route: str = "file"):
        if not config.url:
            raise ValueError("rollout.vllm.mode=server needs rollout.vllm.url")
        self.config, self.io, self.route = config, io, route
        self.source: Any = None
        self.client: Any = None  # nccl: `transfer.ServerClient`
        self.sender: Any = None  # nccl: vLLM's trainer-side engine, rendezvoused at the first sync
        self.url = config.url.rstrip("/")
        self.served_model = config.served_model or self.first_served_model()
        self._pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="vlmrl-vllm-http")

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
        """The server's response to one prompt; RuntimeError when its expanded prompt ids differ from vlmrl's."""
        io = self.io
        out = self.post(GENERATE, generate_body(prompt, sampling, self.served_model, io.image_token_id, io.merge_size))
        check_expanded(prompt, out.get("prompt_token_ids"), who="vLLM server")
        return out

    def generate(self, request: GenerateRequest) -> list[Generation]:
        """`request.n` samples of its prompt (seed `request.params.seed`; None: the server's) in one HTTP request."""
        out = self._generate(request.prompt, self.io.sampling(request.params, request.n))
        choices = sorted(out["choices"], key=lambda c: c["index"])
        return [generation_from_generate_choice(c, self.io.eos_ids, self.io.decode) for c in choices]

    async def agenerate(self, request: GenerateRequest) -> list[Generation]:
        """`generate` in one of the client's threads (up to `MAX_IN_FLIGHT` requests in flight; the server batches
        them continuously)."""
        return await asyncio.wrap_future(self._pool.submit(self.generate, request))

    def prompt_logprobs(self, prompt: EnginePrompt) -> list[float]:
        """The server's log p(ids[t] | ids[:t]) at temperature 1, images included: [T], 0.0 at t = 0."""
        out = self._generate(prompt, dict(PROMPT_LOGPROBS))
        return prompt_logprobs_list(prompt.token_ids, out["prompt_logprobs"])

    def close(self) -> None:
        """Stop the client's request threads (after the requests in flight)."""
        self._pool.shutdown(wait=True)

    def push_weights(self, module: torch.nn.Module) -> None:
        """Rank 0 writes the module's full state dict into the sync folder, has the server reload it and reset its
        prefix and encoder caches; all ranks then meet at a barrier."""
        rank, barrier = _world()
        directory = Path(self.config.sync_dir or Path(tempfile.gettempdir()) / "vlmrl-vllm-sync")
        if rank == 0 and self.route == "nccl":
            self._send_nccl(module)
        elif rank == 0:
            write_weights(module, directory)
            self.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}})
        if rank == 0:
            self.post("/reset_prefix_cache", {})
            self.post("/reset_encoder_cache", {})
        barrier()

    def _send_nccl(self, module: torch.nn.Module) -> None:
        """The module's full state dict over vLLM's NCCL weight transfer (see the module docstring)."""
        from vlmrl.rollout.vllm.transfer import ServerClient, items_source, make_sender, send

        items = full_state_items(module)
        if self.sender is None:
            workers = int(self.post("/get_world_size", method="GET")["world_size"])
            self.source = items_source(items)
            self.client = ServerClient(self.post)
            self.sender = make_sender("nccl", self.client, self.source, self.config, workers=workers)
        self.post("/pause?mode=wait", {})
        try:
            self.source.load(items)
            send(self.sender, self.client)
        finally:
            self.source.clear()
            self.post("/resume", {})
