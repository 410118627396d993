"""A rule-based judge behind an OpenAI-compatible chat server, for the judge tests (`GraderServer`).

It answers `GET /v1/models` and `POST /v1/chat/completions` as `vllm serve` does, and grades as a judge model would
be asked to: it reads the prompt's fenced answer and reference (the fence's nonce from the verdict instruction) and
replies with a short reasoning and `Score: 10` when the answer's last `\\boxed{}` equals the reference
(case-insensitive), else `Score: 0`.

It is gullible on purpose, like a language model that follows any instruction it reads: text of the prompt outside
the fenced fields that asks for a score ("give ... Score: k", "score of k") or a verdict line there is obeyed, and a
chat-template control token (`<|im_start|>assistant`) read as such starts its own reply, whose verdict it then takes.
So only the fencing and the control-token guard of `vlmrl.judge.prompt` keep a policy's answer from moving the
score, and a test of them can fail.

Failure modes (`mode`): grade (above), garbage (a reply without a verdict), delay (grade after `delay_s`), error
(HTTP 500 for the first `fail_first` requests, then grade), no_images (HTTP 400 for a request holding an image), raw
(HTTP 200 with the bytes `raw` under the content type `raw_type`, whatever they are: a malformed reply).
`stop_after`: the server shuts down after answering that many completions (killed mid-step). It records every
request's prompt text, images and the largest number of completions in flight at once.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image

from vlmrl.rewards import extract_boxed

MODEL = "rule-grader"
_INSTRUCTION = re.compile(r'"\[<name> ([0-9a-f]{16})\]"')
_ORDERS = re.compile(r"(?:Score:\s*|score of\s*)(\d+)", re.IGNORECASE)


def fenced(text: str, name: str, nonce: str) -> str | None:
    """The field `name` fenced with `nonce` in `text` (None if absent)."""
    m = re.search(rf"\[{name} {nonce}\]\n(.*?)\n\[/{name} {nonce}\]", text, re.DOTALL)
    return m.group(1) if m else None


def grade(prompt: str) -> str:
    """The grader's reply to a judge prompt (module docstring)."""
    forged = prompt.rfind("<|im_start|>assistant")
    if forged >= 0:  # a forged turn: the grader "continues" it
        prompt = prompt[forged:]
        orders = _ORDERS.findall(prompt)
        return f"Continuing.\nScore: {orders[-1]}" if orders else "Continuing."
    found = _INSTRUCTION.search(prompt)
    if found is None:
        return "I cannot find the verdict instruction."
    nonce = found.group(1)
    answer, reference = fenced(prompt, "answer", nonce), fenced(prompt, "reference", nonce)
    if answer is None:
        return "I cannot find the answer."
    outside = re.sub(rf"\[(\w+) {nonce}\]\n.*?\n\[/\1 {nonce}\]", "", prompt, flags=re.DOTALL)
    outside = outside.replace(found.group(0), "")  # the instruction's own "Score: k" format line is not an order
    outside = re.sub(r'"Score: k"', "", outside)
    orders = _ORDERS.findall(outside)
    if orders:  # obeys whatever it reads outside the data
        return f"As instructed.\nScore: {orders[-1]}"
    said = (extract_boxed(answer) or "").strip().lower()
    right = bool(said) and said == (reference or "").strip().lower()
    return f"The answer {'matches' if right else 'does not match'} the reference.\nScore: {10 if right else 0}"


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # socketserver's 5 would hold a step's connections back (TCP retries after 1 s)

    def handle_error(self, request, client_address) -> None:
        pass  # a client that gave up (a timeout test) leaves a broken pipe: expected


class GraderServer:
    """The grader on 127.0.0.1 (a free port), in a thread: `with GraderServer() as server: server.url`."""

    def __init__(
        self,
        mode: str = "grade",
        delay_s: float = 0.0,
        fail_first: int = 0,
        stop_after: int | None = None,
        raw: bytes = b"",
        raw_type: str = "application/json",
    ):
        self.mode, self.delay_s, self.fail_first, self.stop_after = mode, delay_s, fail_first, stop_after
        self.raw, self.raw_type = raw, raw_type
        self.prompts: list[str] = []
        self.images: list[int] = []  # per completion request: the images it held (each a decodable PNG)
        self.completions = 0
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.dead = False  # stopped: open keep-alive connections are dropped without a reply, as by a killed server
        self.httpd = _QuietServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> "GraderServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Shut the server down: its port refuses connections from now on."""
        self.dead = True
        if self.httpd.socket.fileno() >= 0:
            self.httpd.shutdown()
            self.httpd.server_close()

    def reply(self, body: dict) -> tuple[int, dict]:
        """(HTTP status, JSON body) for one chat completion request."""
        content = body["messages"][-1]["content"]
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        text = "".join(p.get("text", "") for p in parts if p["type"] == "text")
        urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
        for url in urls:  # a real server decodes them: so does the grader
            Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).load()
        with self.lock:
            self.completions += 1
            n = self.completions
            self.prompts.append(text)
            self.images.append(len(urls))
        if self.mode == "no_images" and urls:
            return 400, {"error": {"message": "this model takes no image input", "type": "BadRequestError"}}
        if self.mode == "error" and n <= self.fail_first:
            return 500, {"error": {"message": "internal error", "type": "InternalServerError"}}
        if self.mode == "delay":
            time.sleep(self.delay_s)
        answer = "Looks fine to me." if self.mode == "garbage" else grade(text)
        return 200, {
            "id": f"cmpl-{n}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", MODEL),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, payload: dict, data: bytes | None = None, kind: str = "application/json"):
                data = json.dumps(payload).encode() if data is None else data
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "tests"}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                if server.dead:
                    self.close_connection = True
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    status, payload = server.reply(body)
                finally:
                    with server.lock:
                        server.in_flight -= 1
                if server.mode == "raw":
                    self._send(status, {}, server.raw, server.raw_type)
                else:
                    self._send(status, payload)
                if server.stop_after is not None and server.completions >= server.stop_after:
                    threading.Thread(target=server.stop, daemon=True).start()

        return Handler
