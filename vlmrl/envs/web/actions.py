"""The actions a GUI agent takes, as tools: their schemas for the prompt and how one parsed call becomes a browser
command in CSS pixels. The environment performs them itself (`vlmrl.envs.base.ActionEnvironment`).

    click(x, y)            a left click at a point of the latest screenshot
    type(text)             keystrokes into the focused element
    press(key)             one key: a character, or Enter, Tab, Backspace, Escape, ArrowUp, ...
    scroll(x, y, direction)  the mouse wheel at a point, `direction` up or down, `scroll_px` CSS pixels
    click_element(ref)     (an option) a click on an element of the page's element list (`vlmrl.envs.web.elements`)

Points are in the frame of the image the model saw (`vlmrl.envs.web.frame`). Every way a call can be wrong (did not
parse, unknown name, missing, extra, non-numeric, NaN or huge arguments, a point outside the image, text too long)
raises `InvalidAction` with one line saying why.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from vlmrl.envs.web.browser import Browser, special_key
from vlmrl.envs.web.elements import CLICK, Element
from vlmrl.envs.web.frame import Coordinates, Frame, InvalidAction, as_number
from vlmrl.tools.spec import Tool
from vlmrl.types import ToolCall

MAX_TEXT = 200  # characters one `type` call may send


def click(x: float, y: float) -> str:
    """Click at a point of the latest screenshot.

    Args:
        x: The point's horizontal coordinate.
        y: The point's vertical coordinate.
    """
    return ""


def type_text(text: str) -> str:
    """Type text into the element that has the focus (click it first).

    Args:
        text: The characters to type.
    """
    return ""


def press(key: str) -> str:
    """Press one key.

    Args:
        key: A single character, or a key name: Enter, Tab, Backspace, Escape, Space, ArrowUp, ArrowDown.
    """
    return ""


def scroll(x: float, y: float, direction: str) -> str:
    """Scroll with the mouse wheel at a point of the latest screenshot.

    Args:
        x: The point's horizontal coordinate.
        y: The point's vertical coordinate.
        direction: up or down.
    """
    return ""


def click_element(ref: int) -> str:
    """Click a page element by its number in the latest element list.

    Args:
        ref: The element's number, as listed.
    """
    return ""


_FRAME_TEXT = {
    Coordinates.PIXELS: "in pixels of the latest screenshot as you see it, from its top-left corner",
    Coordinates.RELATIVE_1000: "from 0 to 1000 across the latest screenshot, from its top-left corner",
}


ACTIONS: dict[str, Callable[..., str]] = {
    "click": click,
    "type": type_text,
    "press": press,
    "scroll": scroll,
    "click_element": click_element,
}  # tool name -> its schema function
DEFAULT_ACTIONS = ("click", "type", "press", "scroll")  # click_element: an option (vlmrl.envs.web.elements)
_ARGS = {name: tuple(inspect.signature(fn).parameters) for name, fn in ACTIONS.items()}  # each action's arguments


def action_tools(coordinates: Coordinates, names: tuple[str, ...] = DEFAULT_ACTIONS) -> list[Tool]:
    """The action tools `names` (by default the four pointer and key actions), in `ACTIONS`' order, their point
    arguments described in the model's frame (`coordinates`)."""
    tools = []
    for name, fn in ACTIONS.items():
        if name not in names:
            continue
        tool = Tool.from_function(fn, name)
        schema = copy.deepcopy(tool.schema)
        props = schema["function"]["parameters"]["properties"]
        for axis in ("x", "y") if "x" in props else ():
            props[axis]["description"] = f"{props[axis]['description'][:-1]}, {_FRAME_TEXT[coordinates]}."
        tools.append(dataclasses.replace(tool, schema=schema))
    return tools


@dataclass(frozen=True)
class Action:
    """One checked action: kind (click, type, press, scroll); point: the CSS pixel (column, row) for click and
    scroll; text: what `type` sends, or the key for `press`; dy: the scroll in CSS pixels (down > 0)."""

    kind: str
    point: tuple[int, int] | None = None
    text: str = ""
    dy: int = 0
    ref: int | None = None

    def perform(self, browser: Browser) -> None:
        """Send it to the browser. Raises BrowserFailure."""
        if self.kind == "click" and self.point is not None:
            browser.click(*self.point)
        elif self.kind == "type":
            browser.type_text(self.text)
        elif self.kind == "press":
            browser.press(self.text)
        elif self.kind == "scroll" and self.point is not None:
            browser.scroll(self.point[0], self.point[1], self.dy)
        elif self.kind == "click_element":
            result = browser.js(CLICK, self.ref)
            if result is not True:  # MiniWoB's elementClick returns the error's message
                raise InvalidAction(f"element {self.ref} could not be clicked: {str(result)[:80]}")


def check_action(
    call: ToolCall,
    frame: Frame,
    scroll_px: int,
    names: tuple[str, ...] = DEFAULT_ACTIONS,
    elements: dict[int, Element] | None = None,
) -> Action:
    """The action of one parsed call, mapped into CSS pixels through `frame`; `names`: the actions offered;
    `elements`: the latest element list by ref (for click_element). Raises InvalidAction."""
    if not call.ok:
        raise InvalidAction(f"the call did not parse ({call.status.value}): {call.error}"[:200])
    expected = _ARGS.get(call.name) if call.name in names else None
    if expected is None:
        raise InvalidAction(f"no action named {call.name[:40]!r}; actions: {', '.join(names)}")
    args = call.arguments
    missing = [a for a in expected if a not in args]
    extra = [str(a)[:20] for a in args if a not in expected]
    if missing or extra:
        raise InvalidAction(
            f"{call.name} takes {', '.join(expected)}"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unexpected {', '.join(extra)}" if extra else "")
        )
    if call.name == "click_element":
        ref = as_number(args["ref"], "ref")
        element = (elements or {}).get(int(ref)) if ref == int(ref) else None
        if element is None:
            raise InvalidAction(f"no element {str(ref)[:20]} in the latest element list")
        x, y = element.centre
        return Action("click_element", point=(int(x), int(y)), ref=int(ref))
    if call.name == "type":
        text = args["text"]
        if not isinstance(text, str) or not text or len(text) > MAX_TEXT:
            raise InvalidAction(f"type needs text of 1 to {MAX_TEXT} characters")
        return Action("type", text=text)
    if call.name == "press":
        key = args["key"]
        if not isinstance(key, str):
            raise InvalidAction("press needs a key name or character")
        try:
            special_key(key)
        except ValueError as err:
            raise InvalidAction(str(err)) from None
        return Action("press", text=key)
    point = frame.to_css(args["x"], args["y"])
    if call.name == "click":
        return Action("click", point=point)
    direction = str(args["direction"]).strip().lower()
    if direction not in ("up", "down"):
        raise InvalidAction(f"scroll direction must be up or down, not {direction[:20]!r}")
    return Action("scroll", point=point, dy=scroll_px if direction == "down" else -scroll_px)
