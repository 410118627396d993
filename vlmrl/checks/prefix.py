"""Is a chat template prefix-preserving? (`vlmrl check-template`, after trl #4300.)

For each scenario (scenarios the template cannot render at all, e.g. tool messages for templates without a tool role,
are reported as not applicable), the processor's full render (`TokenBuilder.render_full`, token ids) of every stage of
the conversation — the prompt before each assistant turn (generation prompt on), the conversation ending with that
turn, the whole conversation — must be a token prefix of the next stage's render. A render that ends with an assistant
turn is compared up to its end-of-turn token (the builder's `close_turn_id`): what a template writes after it (Qwen's
`\n`, LLaVA-NeXT's ` `) is separator text whose tokens may merge with the next message, a boundary rule of the builder.
Each reply, rendered as the last message, must also contain the reply as the model wrote it (whitespace-insensitive),
else the template rewrites what the model generated (e.g. it always drops `<think>` blocks) even if its renders extend
each other. Then the ids a model saw at every turn are a prefix of the final render, continuous tokens equal the full
render (up to recorded boundary tokens), and `concat` export is exact.

When a template is not prefix-preserving (thinking templates drop earlier `<think>` blocks), re-rendering would
train on a history the model never saw: vlmrl keeps the continuous tokens the model really saw and exports one sample
per assistant turn (`individual`); the report says so, and whether the builder declares it (`prefix_mode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from vlmrl.checks import make_builder
from vlmrl.checks.scenarios import Scenario, scenarios, stages
from vlmrl.tokens.base import PrefixMode
from vlmrl.types import Role


@dataclass
class PrefixBreak:
    """Where stage `later` stops extending stage `earlier`: first differing token `position` (in both renders),
    and a few decoded tokens around it from each render. For a reply the template does not render as written,
    earlier = "reply N as generated", position = -1, and the texts are the reply and what the template rendered."""

    earlier: str
    later: str
    position: int
    earlier_text: str
    later_text: str


@dataclass
class ScenarioPrefix:
    name: str
    description: str
    ok: bool
    stages: int
    tokens: int = 0  # length of the final render
    breaks: list[PrefixBreak] = field(default_factory=list)
    error: str = ""  # the template could not render the scenario (e.g. it has no tool role): not applicable

    @property
    def status(self) -> str:
        return "n/a" if self.error else "ok" if self.ok else "FAIL"


@dataclass
class PrefixReport:
    """Result of `check_prefix`: per scenario, and what vlmrl does with this template.

    export_style: "concat" when every scenario is prefix-preserving, else "individual". builder_mode: the builder's
    declared `prefix_mode` ("extends" | "rewrites_history"). consistent: the declaration agrees with the check.
    """

    family: str
    model: str
    prefix_preserving: bool
    builder_mode: str
    export_style: str
    consistent: bool
    advice: str
    scenarios: list[ScenarioPrefix]


def _stage_name(n: int, gen: bool) -> str:
    """e.g. "2 msgs+gen" (the first 2 messages with the generation prompt), "3 msgs" (ending with message 3)."""
    return f"{n} msg{'s' if n != 1 else ''}{'+gen' if gen else ''}"


def _snippet(tokenizer, ids: list[int], pos: int, before: int = 3, after: int = 4) -> str:
    if tokenizer is None:
        return str(ids[max(0, pos - before) : pos + after])
    return tokenizer.decode(ids[max(0, pos - before) : pos]) + "⟦" + tokenizer.decode(ids[pos : pos + after]) + "⟧"


def _squash(text: str) -> str:
    return " ".join(text.split())


def check_scenario(builder, scenario: Scenario) -> ScenarioPrefix:
    """Render every stage of `scenario` with `builder.render_full` and check each is a token prefix of the next, and
    that each reply, rendered as the last message, appears as the model wrote it (whitespace-insensitive): a template
    that drops part of a reply it is given (e.g. a `<think>` block) rewrites what the model generated."""
    tok = getattr(builder, "tokenizer", None) or getattr(getattr(builder, "processor", None), "tokenizer", None)
    msgs = scenario.messages
    plan = stages(msgs)
    replies = [k for k, m in enumerate(msgs) if m.role == Role.ASSISTANT]
    try:
        renders = [builder.render_full(msgs[:n], add_generation_prompt=gen).ids for n, gen in plan]
        histories = (
            {k: builder.render_full(msgs[:k], add_generation_prompt=False).ids for k in replies}
            if tok is not None
            else {}
        )
    except Exception as exc:  # noqa: BLE001 - a template that cannot render a scenario: reported as not applicable
        return ScenarioPrefix(
            scenario.name, scenario.description, True, len(plan), error=f"{type(exc).__name__}: {exc}"
        )
    eos = getattr(builder, "close_turn_id", None)
    rendered = dict(zip(plan, renders))
    breaks = []
    for (a, ids_a), (b, ids_b) in zip(zip(plan, renders), zip(plan[1:], renders[1:])):
        if not a[1]:  # a render ending with an assistant turn: compare up to the reply's end-of-turn token, if any
            start = len(rendered.get((a[0] - 1, True), ()))
            ends = [i for i in range(start, len(ids_a)) if ids_a[i] == eos]
            ids_a = ids_a[: ends[-1] + 1] if ends else ids_a
        if ids_b[: len(ids_a)] != ids_a:
            pos = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
            breaks.append(
                PrefixBreak(_stage_name(*a), _stage_name(*b), pos, _snippet(tok, ids_a, pos), _snippet(tok, ids_b, pos))
            )
    for k, history in histories.items():
        ids = rendered[(k + 1, False)]
        reply = _squash(msgs[k].text_content)
        # histories is empty without a tokenizer
        after = _squash(cast(Any, tok).decode(ids[len(history) :] if ids[: len(history)] == history else ids))
        if reply not in after:
            breaks.append(
                PrefixBreak(
                    f"reply {k + 1} as generated", _stage_name(k + 1, False), -1, repr(reply[:60]), repr(after[:60])
                )
            )
    return ScenarioPrefix(scenario.name, scenario.description, not breaks, len(plan), len(renders[-1]), breaks)


def check_prefix(family: str, processor, model: str = "", only: list[str] | None = None) -> PrefixReport:
    """Check every scenario (or those named in `only`) with `family`'s builder around `processor`.
    Raises ValueError when no scenario matches `only`."""
    results = []
    builder = None
    for sc in scenarios():
        if only and sc.name not in only:
            continue
        builder = make_builder(family, processor, sc.tools)
        results.append(check_scenario(builder, sc))
    if builder is None:
        raise ValueError(f"no scenario matches {only}")
    ok = all(r.ok for r in results)
    declared = PrefixMode(getattr(builder, "prefix_mode", PrefixMode.EXTENDS))
    consistent = ok == (declared is PrefixMode.EXTENDS)
    if ok:
        advice = (
            "prefix-preserving: continuous tokens equal the full render; export `concat` (one sequence per "
            "trajectory) is exact."
        )
    elif declared is PrefixMode.REWRITES_HISTORY:
        advice = (
            "not prefix-preserving (the template rewrites earlier turns): the builder keeps the tokens the model "
            "really saw (builder mode `rewrites_history`) and vlmrl exports `individual` (one sample per "
            "assistant turn) automatically."
        )
    else:
        advice = (
            "not prefix-preserving, but the builder declares `extends`: set `export.style=individual` (one "
            "sample per assistant turn on the tokens the model saw) and fix the builder's `prefix_mode` to "
            "`rewrites_history`, else vlmrl would export `concat` for this template."
        )
    return PrefixReport(
        family=family,
        model=model or family,
        prefix_preserving=ok,
        builder_mode=declared.value,
        export_style="concat" if ok else "individual",
        consistent=consistent,
        advice=advice,
        scenarios=results,
    )
