"""The page's elements as text, for element-based actions (`env.actions` with `click_element`).

MiniWoB's own DOM reader, `core.getDOMInfo()` (html/core/core.js), numbers every visible element of the page with a
`ref` it keeps for the episode; `core.elementClick(ref)` clicks one whatever its position (as the `miniwob`
package's CLICK_ELEMENT action does). The list shown to the model holds each element but the page's frame (body,
#wrap, #area) and the instruction (#query, left out by MiniWoB itself): its ref, tag, id and classes, its own text or
value, and whether it has the focus. Colours and positions are not listed: what an element looks like is for the
screenshot to show.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmrl.envs.web.browser import Browser

DOM_INFO = "return core.getDOMInfo();"
CLICK = "return core.elementClick(arguments[0]);"
FRAME_IDS = ("wrap", "area")
MAX_ELEMENTS = 60  # lines listed; past it the list says how many were left out
MAX_TEXT = 40  # characters of an element's text or value


@dataclass(frozen=True)
class Element:
    """One listed element: `ref` (MiniWoB's number), `line` (as shown), `centre` (CSS pixel of its box's centre),
    `leaf` (no listed element inside it: a link, a button, a paragraph, not the list or panel around them)."""

    ref: int
    line: str
    centre: tuple[float, float]
    leaf: bool


def page_elements(browser: Browser) -> list[Element]:
    """The page's elements in document order (module docstring). Raises BrowserFailure."""
    root = browser.js(DOM_INFO)
    out: list[Element] = []
    stack = list(reversed(root.get("children", []))) if isinstance(root, dict) else []
    while stack:
        node = stack.pop()
        stack.extend(reversed(node.get("children", [])))
        ref = node.get("ref")
        if not isinstance(ref, int) or ref < 0 or node.get("id") in FRAME_IDS:  # text runs have negative refs
            continue
        centre = (node["left"] + node["width"] / 2, node["top"] + node["height"] / 2)
        leaf = not any(isinstance(c.get("ref"), int) and c["ref"] >= 0 for c in node.get("children", []))
        out.append(Element(ref, describe(node), centre, leaf))
    return out


def describe(node: dict) -> str:
    """`[ref] tag#id.class "text"` (value= for inputs, `focused` when it has the focus)."""
    tag = str(node.get("tag", "")).lower()
    name = tag + (f"#{node['id']}" if node.get("id") else "")
    name += "".join(f".{c}" for c in str(node.get("classes") or "").split()[:3])
    parts = [f"[{node['ref']}] {name}"]
    text = str(node.get("text") or "").strip()
    if text:
        parts.append(f'"{_short(text)}"')
    if node.get("value") not in (None, ""):
        parts.append(f"value={_short(str(node['value']))!r}")
    if node.get("focused"):
        parts.append("focused")
    return " ".join(parts)


def elements_text(elements: list[Element]) -> str:
    """The list as the model reads it (one line per element, at most MAX_ELEMENTS)."""
    lines = [e.line for e in elements[:MAX_ELEMENTS]]
    if len(elements) > MAX_ELEMENTS:
        lines.append(f"... and {len(elements) - MAX_ELEMENTS} more")
    return "Page elements (for click_element):\n" + "\n".join(lines)


def _short(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."
