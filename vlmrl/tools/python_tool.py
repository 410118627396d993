"""The built-in `python` tool: a code interpreter over the episode's images ("thinking with images", PyVision).

    tools.environment: vlmrl.tools.python_tool:PythonInterpreter      (recipe geometry3k_code_tiny)

One `PythonInterpreter` per episode, in that episode's own worker process (`vlmrl.tools.objects.RemoteObject`,
confined like every tool worker, `vlmrl.tools.isolation`): state lives across the episode's calls and never
across episodes (a new episode gets a new object in a new process). The code is the model's, so hostile by
construction: it runs only there, with the worker's limits (`tools.timeout_s` per call, `tools.cpu_s`,
`tools.memory_mb`), and its worker never holds the task's answer (`reset` gets the task's public view,
`vlmrl.envs.Environment.tool_view`; `sees_answer` is False).

What the code sees: `image` (the episode's first image, RGB PIL), `images` (all of the prompt's), `show(img)` to
return an image, and the standard library plus PIL (`Image`, `ImageDraw`, `ImageOps`). What comes back, as content
blocks: what it printed, then the value of its last line if that is an expression (as in a notebook), then the
images it `show()`ed or returned (at most MAX_IMAGES, each bounded to the processor's pixel range by the worker). An
exception comes back as its last TRACEBACK_LINES traceback lines, as text: the model reads it and retries. Output
text is cut to MAX_OUTPUT_CHARS (then to `tools.max_tool_response_tokens`).
"""

from __future__ import annotations

import ast
import contextlib
import io
import traceback
from typing import Any

from PIL import Image, ImageDraw, ImageOps

MAX_IMAGES = 4  # images one call may return
MAX_OUTPUT_CHARS = 4000  # printed text + the last value's repr, per call
TRACEBACK_LINES = 6


class _Output(io.StringIO):
    """stdout of one call, capped at MAX_OUTPUT_CHARS (the rest is counted, not kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def write(self, s: str) -> int:
        room = MAX_OUTPUT_CHARS - self.tell()
        if room < len(s):
            self.dropped += len(s) - max(room, 0)
            s = s[: max(room, 0)]
        super().write(s)
        return len(s)


class PythonInterpreter:
    """A stateful Python interpreter for one episode (see the module docstring)."""

    sees_answer = False  # reset() gets the task without its answer (`vlmrl.envs.tool_env.ToolEnvironment`)

    def reset(self, task: Any) -> None:
        """Start the episode's namespace with its images."""
        images = [p.image.convert("RGB") for m in task.messages for p in m.content if hasattr(p, "image")]
        self.shown: list[Image.Image] = []
        self.namespace: dict[str, Any] = {
            "__name__": "__main__",
            "image": images[0] if images else None,
            "images": images,
            "show": self._show,
            "Image": Image,
            "ImageDraw": ImageDraw,
            "ImageOps": ImageOps,
        }

    def _show(self, img: Any) -> None:
        """Return `img` (a PIL image) with this call's result."""
        if not isinstance(img, Image.Image):
            raise TypeError(f"show() takes a PIL image, not {type(img).__name__}")
        self.shown.append(img)

    def python(self, code: str) -> list:
        """Run Python code in this episode's interpreter (variables persist between calls). `image` is the
        problem's diagram as a PIL image (`images`: all of them); call show(img) to see an image; PIL's Image,
        ImageDraw and ImageOps are imported. Returns what the code printed and the value of its last line.

        Args:
            code: The Python code to run.
        """
        self.shown = []
        out = _Output()
        value: Any = None
        try:
            tree = ast.parse(code, "<python>", "exec")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            assert last is None or isinstance(last, ast.Expr)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                exec(compile(tree, "<python>", "exec"), self.namespace)  # noqa: S102 - the tool's purpose
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), "<python>", "eval"), self.namespace)  # noqa: S307
        except Exception as err:  # noqa: BLE001 - the model's error is its result
            lines = traceback.format_exception(type(err), err, err.__traceback__)
            out.write("".join(lines[-TRACEBACK_LINES:]))
        return self._result(out, value)

    def _result(self, out: _Output, value: Any) -> list:
        if isinstance(value, Image.Image):
            self.shown.append(value)
            value = None
        text = out.getvalue()
        if value is not None:
            text += repr(value)[: max(MAX_OUTPUT_CHARS - len(text), 0)]
        if out.dropped:
            text += f"\n[output cut: {out.dropped} more characters]"
        images = self.shown[:MAX_IMAGES]
        if len(self.shown) > MAX_IMAGES:
            text += f"\n[{len(self.shown) - MAX_IMAGES} more image(s) not shown: at most {MAX_IMAGES} per call]"
        return [text or "(no output)", *(im.convert("RGB") for im in images)]
