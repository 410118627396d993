"""`vllm_server(directory)`: vLLM's own OpenAI-compatible server in a subprocess, for the server-mode tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from child_env import child_env  # tests/child_env.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(directory: Path, max_model_len: int, extra: tuple[str, ...] = ()) -> Iterator[str]:
    """The URL of `python -m vllm.entrypoints.openai.api_server` serving the model folder `directory` as "policy"
    (fp32, eager, 256 MiB KV cache, token-in/token-out route on, dev routes on), stopped on exit. Fails the test
    with the server's log tail when it exits or does not answer /health within 300 s."""
    port = _free_port()
    env = child_env(VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    log_path = Path(directory) / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(directory),
        "--served-model-name",
        "policy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(256 << 20),
        "--generation-config",
        "vllm",
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-scale-out",
        *extra,
    ]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            if time.perf_counter() - t0 > 300:
                pytest.fail(f"vLLM server did not start in 300 s:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        print(f"\nvLLM server up in {time.perf_counter() - t0:.1f} s")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):  # a server that exited leaves no group: its log tail says why
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
