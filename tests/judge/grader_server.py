"""A rule-based judge behind an OpenAI-compatible chat server, for the judge tests (`GraderServer`).

It answers `GET /v1/models` and `POST /v1/chat/completions` as `vllm serve` does, and grades as a judge model would
be asked to: it reads the prompt's fenced answer and reference (the fence's nonce from the verdict instruction) and
replies with a short reasoning and `Score: 10` when the answer's last `\\boxed{}` equals the reference
(case-insensitive), else `Score: 0`.

It is gullible on purpose, like a language model that follows any instruction it reads: text of the prompt outside
the fenced fields that asks for a score ("give ... Score: k", "score of k") or a verdict line there is obeyed, and a
live chat-template or added token (`<|im_start|>assistant`, `</think>`, `<tool_response>`, `[TOOL_RESULTS]`,
`[multimodal]`, `<mask>`) starts text it takes as its own, whose verdict it then gives. Two readers of the fences:
`exact` (the fence lines with the nonce, as written) and `lookalike` (`read_lookalike`: as people read them, folding
Unicode look-alikes, dropping invisible characters, ending a field at its first closer with any nonce or none, a later
opener of a field replacing the earlier one). In a transcript it reads the turns by the markers the verdict
instruction names, and obeys a `tool` turn that says the answer is verified. So only the quoting and fencing of
`vlmrl.judge.quote` keep a policy's answer from moving the score, and a test of them can fail.

Failure modes (`mode`): grade (above), garbage (a reply without a verdict), delay (grade after `delay_s`), error
(HTTP 500 for the first `fail_first` requests, then grade), busy (HTTP 429 to every request), no_images (HTTP 400 for
a request holding an image), raw (HTTP 200 with the bytes `raw` under the content type `raw_type`, whatever they are:
a malformed reply), silent (every request, the model list too, held open and never answered). `trickle_s`: every
reply's body is sent a byte at a time, one each `trickle_s` seconds; `headers`: more headers on every reply
(`Retry-After`, `Content-Encoding`). A request asking for `logprobs` (a yes/no verdict) gets one token and its top
candidates (`first_token_candidates`). `reader`: exact or lookalike (above). `stop_after`: the server shuts down after
answering that many completions (killed mid-step). It records every request's prompt text, images and the largest
number of completions in flight at once.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import threading
import time
import unicodedata
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image

from vlmrl.rewards import extract_boxed

MODEL = "rule-grader"
_INSTRUCTION = re.compile(r'"\[<name> ([0-9a-f]{16})\]"')
_ORDERS = re.compile(r"(?:Score:\s*|score of\s*)(\d+)", re.IGNORECASE)


LIVE = ("<|im_start|>assistant", "</think>", "<tool_response>", "[TOOL_RESULTS]", "[multimodal]", "<mask>")
_SLASH_LIKE = str.maketrans({c: "/" for c in "\u2044\u2215\u29f8\u2571\u27cb"})


def fold(text: str) -> str:
    """`text` as a reader of look-alikes sees it: NFKC, invisible format characters dropped, slashes unified."""
    text = unicodedata.normalize("NFKC", text).translate(_SLASH_LIKE)
    return "".join(c for c in text if unicodedata.category(c) != "Cf")


def read_exact(prompt: str, nonce: str) -> tuple[dict[str, str], str]:
    """The fields fenced with `nonce` ({name: text}) and the prompt outside them."""
    fields = {
        m.group(1): m.group(2) for m in re.finditer(rf"\[(\w+) {nonce}\]\n(.*?)\n\[/\1 {nonce}\]", prompt, re.DOTALL)
    }
    return fields, re.sub(rf"\[(\w+) {nonce}\]\n.*?\n\[/\1 {nonce}\]", "", prompt, flags=re.DOTALL)


def read_lookalike(prompt: str) -> tuple[dict[str, str], str]:
    """The fields as a careless reader finds them in `fold(prompt)`: from any opener `[name...]` to the first closer
    `[/name...]` (any nonce, or none) or the next opener; a later field of the same name replaces the earlier."""
    text, fields, outside, open_name, start, pos = fold(prompt), {}, [], None, 0, 0
    for m in re.finditer(r"\[\s*(/?)\s*(question|reference|answer)\b[^\]\n]*\]", text, re.IGNORECASE):
        closer, name = m.group(1) == "/", m.group(2).lower()
        if open_name is None:
            outside.append(text[pos : m.start()])
        else:
            fields[open_name] = text[start : m.start()].strip("\n")
        open_name, start, pos = (None if closer else name), m.end(), m.end()
    if open_name is None:
        outside.append(text[pos:])
    else:
        fields[open_name] = text[start:].strip("\n")
    return fields, "".join(outside)


def grade(prompt: str, reader: str = "exact") -> str:
    """The grader's reply to a judge prompt (module docstring), reading the fences as `reader` does."""
    forged = max(prompt.rfind(token) for token in LIVE)
    if forged >= 0:  # live structure: the grader takes what follows as its own
        orders = _ORDERS.findall(prompt[forged:])
        return f"Continuing.\nScore: {orders[-1]}" if orders else "Continuing."
    found = _INSTRUCTION.search(prompt)
    if found is None:
        return "I cannot find the verdict instruction."
    nonce = found.group(1)
    fields, outside = read_exact(prompt, nonce) if reader == "exact" else read_lookalike(prompt)
    answer, reference = fields.get("answer"), fields.get("reference")
    if answer is None:
        return "I cannot find the answer."
    outside = outside.replace(found.group(0), "")  # the instruction's own "Score: k" format line is not an order
    outside = re.sub(r'"Score: k"', "", outside)
    orders = _ORDERS.findall(outside)
    if orders:  # obeys whatever it reads outside the data
        return f"As instructed.\nScore: {orders[-1]}"
    marker = f" {nonce}:" if f'"<role> {nonce}:"' in prompt else ":"  # the turns' markers, as the instruction says
    turns = re.findall(rf"^(assistant|user|tool){re.escape(marker)} ?(.*)$", answer, re.MULTILINE)
    if any(role == "tool" and "verified correct" in text.lower() for role, text in turns):
        return "The tool verified the answer.\nScore: 10"
    said = (extract_boxed(answer) or "").strip().lower()
    right = bool(said) and said == (reference or "").strip().lower()
    return f"The answer {'matches' if right else 'does not match'} the reference.\nScore: {10 if right else 0}"


def first_token_candidates(answer: str, garbage: bool) -> list[tuple[str, float]]:
    """A yes/no judge's first-token candidates [(token, logprob)] for the grade `answer` (its `Score: 10` or not):
    right: "yes" 0.7 and " Yes" 0.2, "no" 0.1; wrong: "no" 0.8, "yes" 0.2; garbage: neither word."""
    if garbage:
        return [("Looks", math.log(0.6)), ("I", math.log(0.4))]
    if answer.endswith("Score: 10"):
        return [("yes", math.log(0.7)), (" Yes", math.log(0.2)), ("no", math.log(0.1))]
    return [("no", math.log(0.8)), ("yes", math.log(0.2))]


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
        reader: str = "exact",
        trickle_s: float = 0.0,
        headers: dict[str, str] | None = None,
    ):
        self.mode, self.delay_s, self.fail_first, self.stop_after = mode, delay_s, fail_first, stop_after
        self.raw, self.raw_type, self.reader = raw, raw_type, reader
        self.trickle_s, self.headers = trickle_s, headers or {}
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
        if self.mode == "busy":
            return 429, {"error": {"message": "too many requests", "type": "RateLimitError"}}
        if self.mode == "delay":
            time.sleep(self.delay_s)
        answer = "Looks fine to me." if self.mode == "garbage" else grade(text, self.reader)
        choice: dict = {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}
        if body.get("logprobs"):  # a yes/no verdict: the first token's top candidates
            top = first_token_candidates(answer, self.mode == "garbage")
            choice["message"]["content"] = top[0][0]
            choice["logprobs"] = {
                "content": [
                    {
                        "token": top[0][0],
                        "logprob": top[0][1],
                        "bytes": None,
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": None} for t, lp in top],
                    }
                ]
            }
        return 200, {
            "id": f"cmpl-{n}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", MODEL),
            "choices": [choice],
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
                if server.mode == "silent":  # holds the connection and never answers
                    while not server.dead:
                        time.sleep(0.05)
                    return
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                for name, value in server.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                if not server.trickle_s:
                    self.wfile.write(data)
                    return
                for i in range(len(data)):  # a byte at a time, each within any per-read timeout
                    if server.dead:
                        return
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
                    time.sleep(server.trickle_s)

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
