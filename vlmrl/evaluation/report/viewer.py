"""The static, self-contained HTML trajectory viewer: each episode's turns (text, inline images and videos, tool
calls and responses, per-turn rewards) and its token sequence coloured by loss mask.

Images come from the messages' refs (file paths; relative ones are tried against the run folder and the current
directory), downscaled and inlined as `data:` URIs; a video shows a strip of up to `VIDEO_FRAMES` evenly spaced
frames. With a history window (`env.keep_images`) each turn says which images and videos it saw and each image or
video the turns that saw it (`vlmrl.evaluation.report.window`). Token ids are decoded with the run's tokenizer
when it loads, else shown as ids. Runs of one repeated id (image placeholders) are folded into one chip `<tok> ×N`.
"""

from __future__ import annotations

import base64
import html
import io
import logging
import re
from pathlib import Path
from typing import Any, Callable

from vlmrl.evaluation.report.window import MEDIA, WindowMarks
from vlmrl.runs.record import TrajectoryRecord
from vlmrl.types import CORRECT, FORMATTED, PARSE_FAIL

log = logging.getLogger("vlmrl.evaluation.report")

TOOL_CALL_RE = re.compile(r"(<tool_call>.*?(?:</tool_call>|$))", re.S)
FOLD_MIN = 4  # fold runs of at least this many identical ids
VIDEO_FRAMES = 8  # the frames of a video's strip, evenly spaced over it


class ImageInliner:
    """ref -> `data:image/...;base64,...` of the image downscaled to `max_side` px (memoised; None if unreadable)."""

    def __init__(self, roots: list[Path], max_side: int = 256):
        self.roots, self.max_side = roots, max_side
        self.cache: dict[str, str | None] = {}

    def resolve(self, ref: str, folders: bool = False) -> Path | None:
        """The file `ref` names (absolute, or relative to one of `roots`); folders: a folder too (a video's frames)."""
        p = Path(ref).expanduser()
        candidates = [p] if p.is_absolute() else [root / p for root in self.roots]
        return next((c for c in candidates if c.is_file() or folders and c.is_dir()), None)

    def __call__(self, ref: str) -> str | None:
        if ref not in self.cache:
            self.cache[ref] = self._encode(ref)
        return self.cache[ref]

    def frames(self, ref: str, files: list[str] | None = None) -> tuple[list[str], int]:
        """(data URIs of up to `VIDEO_FRAMES` evenly spaced frames, the video's frame count) of the video `ref` (a
        file or a folder of frames), or of its list of frame `files`; ([], 0) when it cannot be read."""
        from PIL import Image

        from vlmrl.data.video import BadVideo, read_video

        path: Path | list[Path] | None
        if files:
            found = [self.resolve(f) for f in files]
            path = None if None in found else [p for p in found if p is not None]
        else:
            path = self.resolve(ref, folders=True) if ref else None
        if path is None:
            return [], 0
        total = [0]

        def spaced(meta) -> list[int]:
            total[0] = int(meta.total_num_frames)
            k = min(VIDEO_FRAMES, total[0])
            return sorted({round(i * (total[0] - 1) / max(k - 1, 1)) for i in range(k)})

        try:
            video = read_video(path, spaced, max_pixels=2**62)
        except BadVideo:
            return [], 0
        side = self.max_side // 2
        return [self._encode_image(Image.fromarray(f), side) for f in video.frames], total[0]

    def _encode(self, ref: str) -> str | None:
        from PIL import Image

        path = self.resolve(ref) if ref else None
        if path is None:
            return None
        try:
            with Image.open(path) as im:
                im.load()
                img: Image.Image = im.copy()
        except Exception:  # noqa: BLE001 - an unreadable image becomes a placeholder
            return None
        return self._encode_image(img, self.max_side)

    @staticmethod
    def _encode_image(img: Any, side: int) -> str:
        """A data URI of `img` downscaled to `side` px: the smaller of a 256-colour PNG and a JPEG."""
        from PIL import Image

        img.thumbnail((side, side))
        if img.mode in ("RGBA", "LA", "P"):  # flatten transparency onto white (diagrams are often RGBA)
            rgba = img.convert("RGBA")
            img = Image.new("RGB", rgba.size, (255, 255, 255))
            img.paste(rgba, mask=rgba.split()[-1])
        img = img.convert("RGB")
        encoded = []  # the smaller of a 256-colour PNG (line art) and a JPEG (photos)
        for fmt, mime, out, kw in (
            ("PNG", "image/png", img.quantize(256), {"optimize": True}),
            ("JPEG", "image/jpeg", img, {"quality": 85}),
        ):
            buf = io.BytesIO()
            out.save(buf, format=fmt, **kw)
            encoded.append((len(buf.getvalue()), mime, buf.getvalue()))
        _, mime, data = min(encoded)
        return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def load_tokenizer(run: Any) -> Any | None:
    """The run's tokenizer: from its latest checkpoint's `hf/` folder, else from `model` in config.yaml (tiny
    models and local folders load offline); None if neither loads."""
    for ckpt in run.checkpoints():
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(ckpt))
        except Exception as exc:  # noqa: BLE001 - any load failure: the viewer falls back to ids
            log.info("no tokenizer in %s: %s", ckpt, exc)
    family, path = run.cfg("model.family"), run.cfg("model.name_or_path")
    if family and path:
        try:
            from vlmrl.modeling.loading import load_processor

            return load_processor(family, path).tokenizer
        except Exception as exc:  # noqa: BLE001 - any load failure: the viewer falls back to ids
            log.info("tokenizer of %s did not load (%s); showing token ids", path, exc)
    return None


class TokenText:
    """id -> display text with the tokenizer (memoised), or `#id` without one."""

    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tok: int) -> str:
        if tok not in self.cache:
            text = f"#{tok}"
            if self.tokenizer is not None:
                try:
                    text = self.tokenizer.decode([tok], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode is shown as the id
                    pass
            self.cache[tok] = text
        return self.cache[tok]


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _text_html(text: str, role: str) -> str:
    """Message text with `<tool_call>` blocks of assistant replies set apart."""
    if role != "assistant":
        return f'<pre class="text">{_esc(text)}</pre>'
    parts = TOOL_CALL_RE.split(text)
    out = []
    for i, part in enumerate(parts):
        if not part:
            continue
        css = "toolcall" if i % 2 == 1 else "text"
        out.append(f'<pre class="{css}">{_esc(part)}</pre>')
    return "".join(out)


def _image_html(ref: str, inline: Callable[[str], str | None], note: str = "") -> str:
    uri = inline(ref)
    note = f" · {_esc(note)}" if note else ""
    if uri is None:
        return f'<div class="noimg">image not found: {_esc(ref)}{note}</div>'
    cap = f"{_esc(Path(ref).name)}{note}"
    return f'<figure><img src="{uri}" alt="{_esc(ref)}"><figcaption>{cap}</figcaption></figure>'


def _video_html(ref: str, inline: Any, note: str = "", files: list[str] | None = None) -> str:
    """A video as a strip of its frames (`ImageInliner.frames`; `files`: its list of frame files), captioned with
    its name and frame count."""
    uris, total = inline.frames(ref, files) if hasattr(inline, "frames") else ([], 0)
    note = f" · {_esc(note)}" if note else ""
    if not uris:
        return f'<div class="noimg">video not found: {_esc(ref)}{note}</div>'
    strip = "".join(f'<img src="{u}" alt="frame">' for u in uris)
    cap = f"video {_esc(Path(ref).name)}: {len(uris)} of its {total} frames{note}"
    return f'<figure class="video">{strip}<figcaption>{cap}</figcaption></figure>'


def _num(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else "NaN"


def _turn_breakdown(rec: TrajectoryRecord, a: int) -> list[str]:
    """Badges of how turn `a`'s reward was made (the record's `reward_breakdown`): the environment's reward, each
    reward function's score, the overlong penalty; none for a record without a breakdown."""
    turns = (rec.breakdown or {}).get("turns") or []
    if a >= len(turns) or not isinstance(turns[a], dict):
        return []
    part = turns[a]
    funcs = part.get("funcs") or {}
    if not funcs and not part.get("penalty"):
        return []  # the turn's reward is the environment's
    bits = [f'<span class="badge">env {_num(part.get("env"))}</span>']
    bits += [f'<span class="badge">{_esc(str(k).rpartition(":")[2])}: {_num(v)}</span>' for k, v in funcs.items()]
    if part.get("penalty"):
        bits.append(f'<span class="badge bad">overlong {_num(part["penalty"])}</span>')
    return bits


def _episode_breakdown(rec: TrajectoryRecord) -> str:
    """Badges of the episode's reward parts: the judge's score and weight, why the reward is unusable."""
    bd = rec.breakdown or {}
    bits = ""
    if "judge" in bd:
        bits += f'<span class="badge">judge {_num(bd["judge"])} × {_num(bd.get("judge_weight"))}</span>'
    if bd.get("unusable"):
        bits += f'<span class="badge bad">excluded: {_esc(str(bd["unusable"]))}</span>'
    return bits


def _turn_info(rec: TrajectoryRecord, a: int) -> str:
    """The badge line of assistant turn `a`: reward, correct, parse status, stop reason, format, tool calls, the
    other metrics the environment reported, and the policy version that sampled it (when recorded per turn)."""
    if a >= len(rec.turns):
        return ""
    turn = rec.turns[a]
    bits = [f'<span class="badge">reward {turn.reward:.3g}</span>', *_turn_breakdown(rec, a)]
    if not turn.is_tool_turn:
        ok = turn.correct
        bits.append(f'<span class="badge {"ok" if ok else "bad"}">{"correct" if ok else "wrong"}</span>')
        bits.append(f'<span class="badge">parse: {_esc(turn.legacy_parse_status())}</span>')
    if turn.stop_reason is not None:
        bits.append(f'<span class="badge">stop: {_esc(turn.stop_reason.value)}</span>')
    if FORMATTED in turn.metrics:
        bits.append(f'<span class="badge">{"boxed" if turn.formatted else "no box"}</span>')
    for key, value in turn.metrics.items():
        if key not in (CORRECT, FORMATTED, PARSE_FAIL):
            bits.append(f'<span class="badge">{_esc(key)}: {value:.3g}</span>')
    if a < len(rec.turn_spans):
        start, end = rec.turn_spans[a]
        bits.append(f'<span class="badge">{end - start} tokens</span>')
    if a < len(rec.turn_policy_versions):  # continuous rollouts: the weights that sampled the turn
        bits.append(f'<span class="badge">policy v{rec.turn_policy_versions[a]}</span>')
    html_calls = ""
    for i, call in enumerate(turn.tool_calls):
        err = (turn.tool_errors[i] if i < len(turn.tool_errors) else "") or call.error
        css = "bad" if err or not call.ok else "ok"
        args = _esc(str(call.arguments))
        html_calls += (
            f'<div class="call {css}">tool call <b>{_esc(call.name)}</b>({args})'
            f" · {_esc(call.status.value)}{' · ' + _esc(str(err)) if err else ''}</div>"
        )
    return f'<div class="info">{" ".join(bits)}</div>{html_calls}'


def _clicks_html(rec: TrajectoryRecord, a: int, ref: str, inline: Callable[[str], str | None]) -> str:
    """Turn `a`'s marks (an action environment's clicks, `TurnRecord.marks`) as dots on the image the turn acted on
    (the last image before it); "" without marks or that image."""
    turn_marks = rec.turns[a].marks if a < len(rec.turns) else []
    uri = inline(ref) if turn_marks and ref else None
    if uri is None:
        return ""
    dots = "".join(f'<span class="dot" style="left:{100 * x:.2f}%;top:{100 * y:.2f}%"></span>' for x, y in turn_marks)
    where = ", ".join(f"({x:.3f}, {y:.3f})" for x, y in turn_marks)
    return (
        f'<figure class="clicks"><div class="pin"><img src="{uri}" alt="{_esc(ref)}">{dots}</div>'
        f"<figcaption>acted at {_esc(where)} of {_esc(Path(ref).name)}</figcaption></figure>"
    )


def messages_html(rec: TrajectoryRecord, inline: Callable[[str], str | None]) -> str:
    """The conversation; with a history window, each image and video names the turns that saw it and each turn the
    items it saw (`WindowMarks`)."""
    out, a, item, last_image = [], 0, 0, ""
    marks = WindowMarks.of(rec)
    for msg in rec.messages:
        role = str(msg.get("role", "?"))
        body = []
        for part in msg.get("content", []):
            kind, ref = part.get("type"), str(part.get("ref", ""))
            last_image = ref if kind == "image" else last_image
            if kind in MEDIA:
                note = marks.item_note(item) if marks is not None else ""
                files = part.get("frames") if isinstance(part.get("frames"), list) else None
                body.append(
                    _image_html(ref, inline, note) if kind == "image" else _video_html(ref, inline, note, files)
                )
                item += 1
            else:
                body.append(_text_html(str(part.get("text", "")), role))
        info = ""
        if role == "assistant":
            info = _turn_info(rec, a) + _clicks_html(rec, a, last_image, inline)
            if marks is not None:
                info += f'<div class="info"><span class="badge">{_esc(marks.turn_note(a))}</span></div>'
            label = f"assistant · turn {a + 1}"
            a += 1
        else:
            label = "tool response" if role == "tool" else role
        out.append(f'<div class="msg {_esc(role)}"><div class="role">{_esc(label)}</div>{"".join(body)}{info}</div>')
    return "".join(out)


def tokens_html(rec: TrajectoryRecord, text_of: Callable[[int], str]) -> str:
    """The trajectory's ids, one span per token (runs of a repeated id folded), class by loss mask; boundary tokens
    inserted by the builder are outlined. Hover: id, mask, rollout logprob."""
    ids = rec.input_ids
    mask = rec.loss_mask or [0] * len(ids)
    lps = rec.logprobs or [0.0] * len(ids)
    boundary = {b.position: b.reason for b in rec.boundary}
    out, i = [], 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[i] and mask[j] == mask[i] and j not in boundary and i not in boundary:
            j += 1
        css = "m1" if mask[i] else "m0"
        if i in boundary:
            css += " bd"
        if j - i >= FOLD_MIN:
            title = f"id {ids[i]} ×{j - i} · mask {mask[i]}"
            out.append(f'<span class="{css} fold" title="{title}">{_esc(text_of(ids[i]))} ×{j - i}</span>')
        else:
            for k in range(i, j):
                title = f"id {ids[k]} · mask {mask[k]}" + (f" · logprob {lps[k]:.3f}" if mask[k] else "")
                if k in boundary:
                    title += f" · inserted: {boundary[k]}"
                out.append(f'<span class="{css}" title="{_esc(title)}">{_esc(text_of(ids[k]))}</span>')
        i = j
    n1 = sum(1 for m in mask if m)
    return (
        f'<details class="tokens"><summary>tokens: {len(ids)} ({n1} with loss mask 1, {len(ids) - n1} mask 0, '
        f'{len(boundary)} inserted at boundaries)</summary><div class="toks">{"".join(out)}</div></details>'
    )


def trajectory_id(rec: TrajectoryRecord, idx: int, section: str) -> str:
    return f"{section}-{idx}"


def _end(rec: TrajectoryRecord) -> str:
    return rec.end_reason.value if rec.end_reason is not None else ""


def trajectory_html(rec: TrajectoryRecord, idx: int, section: str, inline, text_of) -> str:
    correct = rec.correct
    where = f"step {rec.step} · task {rec.task_id}"
    where += f" · sample {rec.sample}" if rec.sample is not None else f" · group {rec.group}"
    head = (
        f'<span class="badge">reward {rec.reward:.3g}</span>'
        f'<span class="badge">advantage {rec.advantage:+.3g}</span>'
        f'<span class="badge {"ok" if correct else "bad"}">{"correct" if correct else "wrong"}</span>'
        f'<span class="badge">{len(rec.turns)} turn(s)</span>'
        f'<span class="badge">end: {_esc(_end(rec))}</span>'
        f"{_episode_breakdown(rec)}"
    )
    stats = rec.tool_stats
    if stats.calls:
        head += f'<span class="badge">tools: {stats.calls} call(s), {stats.failed} failed</span>'
    return (
        f'<section class="traj" id="{trajectory_id(rec, idx, section)}"><h3>#{idx} · {_esc(where)}</h3>'
        f'<div class="info">{head}</div>{messages_html(rec, inline)}{tokens_html(rec, text_of)}</section>'
    )


def select(records: list[TrajectoryRecord], limit: int) -> list[tuple[int, TrajectoryRecord]]:
    """(index, record) of at most `limit` records spread evenly over the run (all if limit <= 0)."""
    indexed = list(enumerate(records))
    if limit <= 0 or len(indexed) <= limit:
        return indexed
    return [indexed[round(i * (len(indexed) - 1) / (limit - 1))] for i in range(limit)] if limit > 1 else indexed[:1]


def index_html(chosen: list[tuple[int, TrajectoryRecord]], section: str) -> str:
    rows = []
    for idx, rec in chosen:
        correct = rec.correct
        who = rec.sample if rec.sample is not None else rec.group
        rows.append(
            f'<tr><td><a href="#{trajectory_id(rec, idx, section)}">#{idx}</a></td><td>{rec.step}'
            f"</td><td>{_esc(rec.task_id)}</td><td>{who}</td>"
            f'<td>{rec.reward:.3g}</td><td class="{"ok" if correct else "bad"}">'
            f"{'yes' if correct else 'no'}</td><td>{len(rec.turns)}</td>"
            f"<td>{_esc(_end(rec))}</td></tr>"
        )
    head = (
        "<tr><th>#</th><th>step</th><th>task</th><th>sample/group</th><th>reward</th><th>correct</th>"
        "<th>turns</th><th>end</th></tr>"
    )
    body = "".join(rows)
    return f'<div class="scroll idx"><table class="metrics"><thead>{head}</thead><tbody>{body}</tbody></table></div>'


def section_html(
    title: str,
    section: str,
    records: list[TrajectoryRecord],
    limit: int,
    inline,
    text_of,
    problems: list[str] | None = None,
) -> str:
    """The viewer section of `records` (at most `limit`, `select`); a record that cannot be rendered becomes a note
    on the page and a line in `problems`."""
    if not records:
        return ""
    chosen = select(records, limit)
    note = f"{len(chosen)} of {len(records)} trajectories"
    if len(chosen) < len(records):
        note += " (spread over the run)"
    shown, body = [], []
    for idx, rec in chosen:  # a record of unexpected shape becomes a note, not a crash of the whole report
        try:
            body.append(trajectory_html(rec, idx, section, inline, text_of))
            index_html([(idx, rec)], section)
            shown.append((idx, rec))
        except Exception as exc:  # noqa: BLE001 - a malformed record is listed as a problem, not fatal
            if problems is not None:
                problems.append(f"{title}: record #{idx} cannot be shown ({type(exc).__name__}: {exc})")
            body.append(f'<p class="noimg">record #{idx} cannot be shown ({_esc(type(exc).__name__)})</p>')
    return f'<h2>{_esc(title)}</h2><p class="note">{note}</p>{index_html(shown, section)}{"".join(body)}'
