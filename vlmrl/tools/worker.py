"""The tool worker: a separate process (`python -m vlmrl.tools.worker --memory-mb M --cpu-s S`) that runs tool code.

The trainer never runs tool code itself (`vlmrl.tools.process` starts and kills workers, `vlmrl.tools.isolation`
confines them). Protocol, over the worker's stdin/stdout pipes, one request then one reply:

- request (trainer -> worker, trusted): 8-byte big-endian length + a (cloud)pickled `(nonce, request)`:
  `("import", module)` imports a tool's module ahead of its first call; `("call", fn, kwargs, opts)` runs
  `fn(**kwargs)`; `("new", factory)` makes this worker's environment object;
  `("method", name, kwargs, opts)` calls a method of that object; opts = (ImageBounds, max_chars, want), want:
  "blocks" (text/image content blocks), "observation" (blocks or messages) or "float"; `("ping",)` answers at once.
  Every reply carries its request's `nonce` (a fresh random string per request).
- once started, the worker writes a reply `{"ok": true, "ready": true}` (call timeouts do not count start-up).
- reply (worker -> trainer, untrusted): 8-byte length + UTF-8 JSON, never pickle, so a hostile worker cannot run
  code in the trainer: `{"ok": true, "blocks": [...], "value": x, "retire": bool}` or
  `{"ok": false, "kind": "exception"|"bad_arguments"|"memory", "detail": "..."}`. A text block is
  `{"type": "text", "text": s}`; an image block `{"type": "image", "w": W, "h": H, "rgb": base64(W*H*3 bytes)}`; a
  video block `{"type": "video", "t": T, "w": W, "h": H, "fps": f, "indices": [T source frame indices], "rgb":
  base64(T*H*W*3 bytes)}`.

Forged replies: tool code runs in this process and can write to the reply pipe (it is only a file descriptor), so
the trainer trusts no frame's position: a reply must carry its request's nonce, and after each reply the trainer
pings (`vlmrl.tools.process.WorkerProcess.receive`) -- a frame the tool wrote is then either the call's own result
(the tool controls that anyway) or an extra frame before the pong, which fails the call (`crash`, counted once) and
kills the worker; the next call gets a fresh one and its own answer.

Results are converted here (a `__str__` that never returns hangs this process, whose timeout then kills it), text
is cut to `max_chars` and images are bounded before they are sent. `retire` asks the trainer not to reuse this
worker (the tool left threads running, or its CPU time is nearly spent). Limits (set here, before any tool runs):
RLIMIT_DATA = memory_mb (heap and anonymous memory), RLIMIT_AS = memory_mb + 4 GiB (address space incl. shared
libraries), RLIMIT_CPU soft = cpu_s more CPU seconds per call (SIGXCPU) and hard = HARD_CPU_CALLS * cpu_s for the
worker's life (SIGKILL, for its children too; tool code cannot raise it), RLIMIT_NOFILE = 64, RLIMIT_FSIZE = 16 MiB, no
core files; `--sandboxed` (bwrap: its own pid and user namespace) adds RLIMIT_NPROC = MAX_PROCESSES and kills every
other process of the namespace after each call (`reap_namespace`), so nothing a call started outlives it.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import os
import pickle
import resource
import signal
import struct
import sys
import threading
import time
from typing import Any, BinaryIO

from vlmrl.tools.results import ImageBounds, flatten, to_part
from vlmrl.tools.spec import ToolArgumentError
from vlmrl.types import ImagePart, Message, TextPart, VideoPart

HEADER = struct.Struct(">Q")
ADDRESS_SPACE_EXTRA_MB = 4096  # shared libraries (torch maps ~3 GiB) on top of memory_mb
CGROUP_EXTRA_MB = 256  # a worker's memory cgroup (`vlmrl.tools.cgroups`): the interpreter and its libraries' pages
OPEN_FILES = 64
FILE_SIZE = 16 << 20
MAX_PROCESSES = 64  # processes (and threads) of the worker's user in its sandbox (`--sandboxed`)
HARD_CPU_CALLS = 2  # hard RLIMIT_CPU: the worker's whole life gets this many calls' cpu_s (see `cpu_spent`)
REAP_WAIT_S = 2.0  # how long `reap_namespace` waits for the killed processes to be gone


def reap_namespace() -> int:
    """Kill every process of this worker's pid namespace but itself and bwrap's init (pid 1), and reap its own
    children: whatever a call started ends with it. Only for `--sandboxed` workers (their /proc lists their pid
    namespace alone). Returns how many processes were killed."""
    me, killed = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, me):
            try:
                os.kill(int(name), signal.SIGKILL)
                killed.append(int(name))
            except OSError:
                pass
    deadline = time.monotonic() + REAP_WAIT_S  # SIGKILL is asynchronous: wait until they are gone (or zombies)
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:  # the worker's own children
                pass
        except ChildProcessError:
            pass
        if not any(_running(pid) for pid in killed) or time.monotonic() > deadline:
            return len(killed)
        time.sleep(0.001)


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (bwrap's init reaps the orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def set_limits(memory_mb: int, cpu_s: float, sandboxed: bool = False) -> None:
    """Cap this process (soft = hard, so tool code cannot raise them back unless privileged); `sandboxed` (its own
    user and pid namespace, bwrap) also caps the processes of its user at MAX_PROCESSES (without a user namespace
    that would count the trainer's user's own processes)."""
    mb = 1 << 20
    limits = [
        (resource.RLIMIT_DATA, memory_mb * mb),
        (resource.RLIMIT_AS, (memory_mb + ADDRESS_SPACE_EXTRA_MB) * mb),
        (resource.RLIMIT_NOFILE, OPEN_FILES),
        (resource.RLIMIT_FSIZE, FILE_SIZE),
        (resource.RLIMIT_CORE, 0),
    ]
    if sandboxed:
        limits.append((resource.RLIMIT_NPROC, MAX_PROCESSES))
    for res, value in limits:
        resource.setrlimit(res, (value, value))
    hard = _cpu_used() + HARD_CPU_CALLS * max(1, int(cpu_s))  # a child that ignores SIGXCPU dies here (SIGKILL)
    resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
    _cpu_budget(cpu_s)


def _cpu_used() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return int(usage.ru_utime + usage.ru_stime) + 1


def _cpu_budget(cpu_s: float) -> None:
    """RLIMIT_CPU soft limit at the CPU time used so far + cpu_s (SIGXCPU ends a call that spins past it), never
    above the hard limit `set_limits` fixed."""
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = _cpu_used() + max(1, int(cpu_s))
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def cpu_spent(cpu_s: float) -> bool:
    """True once less than one call's `cpu_s` is left below the hard RLIMIT_CPU: the worker retires (the trainer
    starts a fresh one, so every call gets its full budget)."""
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    return hard != resource.RLIM_INFINITY and _cpu_used() + max(1, int(cpu_s)) > hard


def _block(part: Any) -> dict:
    if isinstance(part, VideoPart):
        video = part.video.read()  # (a VideoFile is decoded here)
        frames, meta = video.frames, video.metadata
        t, h, w = (int(x) for x in frames.shape[:3])
        indices, fps = getattr(meta, "frames_indices", None), getattr(meta, "fps", None)
        if not fps:
            raise ValueError("a video a tool returns needs its frame rate (Video.metadata.fps; read_video sets it)")
        return {
            "type": "video",
            **{"t": t, "w": w, "h": h, "fps": float(fps)},
            "indices": [int(i) for i in indices] if indices is not None else list(range(t)),
            "rgb": base64.b64encode(frames.astype("uint8").tobytes()).decode(),
        }
    if isinstance(part, ImagePart):
        im = part.image
        return {"type": "image", "w": im.width, "h": im.height, "rgb": base64.b64encode(im.tobytes()).decode()}
    return {"type": "text", "text": part.text}


def encode_blocks(result: Any, bounds: ImageBounds, max_chars: int) -> list[dict]:
    """`result` (any tool return value) as JSON content blocks: text cut to `max_chars`, images bounded RGB."""
    blocks = []
    for item in flatten(result):
        part = to_part(item, "")
        if isinstance(part, ImagePart):
            part = ImagePart(bounds.apply(part.image), "")
        elif isinstance(part, VideoPart):
            pass  # bounded by the trainer (`vlmrl.tools.results.video_from_block`)
        else:
            part = TextPart(str(part.text)[:max_chars])
        blocks.append(_block(part))
    return blocks


def _encode(result: Any, bounds: ImageBounds, max_chars: int, want: str) -> dict:
    if want == "float":
        return {"value": float(result)}
    if want == "observation" and isinstance(result, list) and result and all(isinstance(m, Message) for m in result):
        return {
            "messages": [{"role": m.role.value, "blocks": encode_blocks(m.content, bounds, max_chars)} for m in result]
        }
    if want == "observation" and result is None:
        return {"blocks": []}
    return {"blocks": encode_blocks(result, bounds, max_chars)}


def _describe(err: BaseException) -> str:
    try:
        text = f"{type(err).__name__}: {err}"
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails
        text = type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def handle(request: tuple, state: dict) -> dict:
    """One request -> its reply (tool failures become `ok: false` replies; nothing raises)."""
    op = request[0]
    try:
        if op == "import":
            importlib.import_module(request[1])
            return {"ok": True}
        if op == "new":
            state["obj"] = request[1]()
            return {"ok": True}
        if op == "call":
            _, fn, kwargs, (bounds, max_chars, want) = request
        else:
            _, name, kwargs, (bounds, max_chars, want) = request
            fn = getattr(state["obj"], name)
        return {"ok": True, **_encode(fn(**kwargs), bounds, max_chars, want)}
    except ToolArgumentError as err:
        return {"ok": False, "kind": "bad_arguments", "detail": _describe(err)}
    except MemoryError:
        return {"ok": False, "kind": "memory", "detail": "the tool ran out of memory (tools.memory_mb)"}
    except BaseException as err:  # noqa: BLE001 - a tool's failure is data, even SystemExit
        return {"ok": False, "kind": "exception", "detail": _describe(err)}


def _read(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError
    return data


def serve(inp: BinaryIO, out: BinaryIO, cpu_s: float, sandboxed: bool = False) -> None:
    """Answer requests until the trainer closes the pipe (`sandboxed`: end every other process after each)."""
    state: dict = {}
    hello = json.dumps({"ok": True, "ready": True}).encode()
    out.write(HEADER.pack(len(hello)) + hello)  # started: the trainer's timeouts count from here
    out.flush()
    while True:
        try:
            (size,) = HEADER.unpack(_read(inp, HEADER.size))
            nonce, request = pickle.loads(_read(inp, size))
        except EOFError:
            return
        _cpu_budget(cpu_s)
        reply = {"ok": True} if request[0] == "ping" else handle(request, state)
        if sandboxed and request[0] != "ping":
            reap_namespace()
        reply["retire"] = threading.active_count() > 1 or cpu_spent(cpu_s)
        reply["nonce"] = nonce
        try:
            data = json.dumps(reply).encode()
        except (TypeError, ValueError) as err:  # e.g. a float reward that is not finite: still valid JSON
            data = json.dumps({"ok": False, "kind": "exception", "detail": _describe(err)}).encode()
        out.write(HEADER.pack(len(data)) + data)
        out.flush()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vlmrl.tools.worker")
    ap.add_argument("--memory-mb", type=int, required=True)
    ap.add_argument("--cpu-s", type=float, required=True)
    ap.add_argument("--sandboxed", action="store_true", help="its own user and pid namespace (bwrap)")
    args = ap.parse_args(argv)
    inp = os.fdopen(os.dup(0), "rb")  # private copies of the pipes; fds 0/1 become /dev/null and stderr
    out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - for the process lifetime
    set_limits(args.memory_mb, args.cpu_s, args.sandboxed)
    serve(inp, out, args.cpu_s, args.sandboxed)


if __name__ == "__main__":
    main()
