"""Built-in tools and helpers: a safe `calculate`, and image crop/zoom used by image tools.

`calculate` evaluates arithmetic with `simpleeval` (a maintained, AST-walking evaluator; no `eval`), restricted
further here: number literals only (no strings, names other than pi/e/tau, attributes, subscripts, comprehensions,
comparisons or keyword arguments), a whitelist of math functions, and bounded operands (integers above
`MAX_INT_BITS` bits, huge powers and products are refused before they are computed), so every accepted expression
finishes in microseconds. `^` means power, as models write it.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

import simpleeval
from PIL import Image

from vlmrl.tools.spec import ToolArgumentError

MAX_EXPRESSION_CHARS = 512
MAX_INT_BITS = 4096
_REPLACE = {"^": "**", "×": "*", "÷": "/", "−": "-", "π": "pi", "·": "*"}


def _number(x: Any) -> int | float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ToolArgumentError(f"only real numbers are allowed, got {type(x).__name__}")
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise ToolArgumentError("number too large")
    return x


def _binary(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def apply(a: Any, b: Any) -> Any:
        return _number(op(_number(a), _number(b)))

    return apply


def _mul(a: Any, b: Any) -> Any:
    a, b = _number(a), _number(b)
    if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS:
        raise ToolArgumentError("number too large")
    return _number(a * b)


def _pow(a: Any, b: Any) -> Any:
    a, b = _number(a), _number(b)
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 and b * a.bit_length() > MAX_INT_BITS:
        raise ToolArgumentError("number too large")
    if isinstance(a, float) or isinstance(b, float):
        if a < 0 and not float(b).is_integer():
            raise ToolArgumentError("a negative number to a fractional power is not real")
        return _number(math.pow(a, b))
    return _number(a**b)


def _unary(op: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda a: _number(op(_number(a)))


def _fn(f: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        return _number(f(*(_number(a) for a in args)))

    return call


_OPERATORS = {
    ast.Add: _binary(operator.add),
    ast.Sub: _binary(operator.sub),
    ast.Mult: _mul,
    ast.Div: _binary(operator.truediv),
    ast.FloorDiv: _binary(operator.floordiv),
    ast.Mod: _binary(operator.mod),
    ast.Pow: _pow,
    ast.BitXor: _pow,
    ast.USub: _unary(operator.neg),
    ast.UAdd: _unary(operator.pos),
}
_MATH_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "cbrt": lambda x: math.copysign(abs(x) ** (1 / 3), x),
    "exp": math.exp,
    "log": math.log,
    "log10": math.log10,
    "log2": math.log2,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "atan2": math.atan2,
    "degrees": math.degrees,
    "radians": math.radians,
    "hypot": math.hypot,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "min": min,
    "max": max,
}
_FUNCTIONS = {name: _fn(f) for name, f in _MATH_FUNCTIONS.items()}
_NAMES = {"pi": math.pi, "e": math.e, "tau": math.tau}
_ALLOWED_NODES = (ast.Expr, ast.Name, ast.UnaryOp, ast.BinOp, ast.Call, ast.Constant)


class _Calculator(simpleeval.SimpleEval):
    """simpleeval with only the nodes arithmetic needs, and numeric literals only."""

    def __init__(self) -> None:
        super().__init__(operators=dict(_OPERATORS), functions=dict(_FUNCTIONS), names=dict(_NAMES))
        self.nodes: dict[type[ast.AST], Callable[..., Any]] = {
            k: v for k, v in self.nodes.items() if k in _ALLOWED_NODES
        }
        self.nodes[ast.Constant] = self._number_literal

    @staticmethod
    def _number_literal(node: ast.Constant) -> Any:
        return _number(node.value)


def _format(x: int | float) -> str:
    if isinstance(x, int):
        return str(x)
    if math.isfinite(x) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.10g}"


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Supports + - * / // % ** (or ^), parentheses, pi, e, and sqrt, cbrt, exp, log, log10, log2, sin, cos, tan,
    asin, acos, atan, atan2, degrees, radians, hypot, abs, round, floor, ceil, min, max. Trigonometric functions
    use radians: write sin(radians(30)) for degrees.

    Args:
        expression: The expression, e.g. "sqrt(3**2 + 4**2)" or "0.5 * 6 * 8 * sin(radians(30))".
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ToolArgumentError("expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolArgumentError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression
    for old, new in _REPLACE.items():
        text = text.replace(old, new)
    try:
        return _format(_Calculator().eval(text))
    except ToolArgumentError:
        raise
    except simpleeval.InvalidExpression as err:
        raise ToolArgumentError(f"cannot evaluate: {err}") from None
    except (SyntaxError, ValueError, ArithmeticError, TypeError, RecursionError, MemoryError) as err:
        raise ToolArgumentError(f"cannot evaluate: {type(err).__name__}: {err}"[:200]) from None


def crop_image(image: Image.Image, x0: float, y0: float, x1: float, y1: float) -> Image.Image:
    """The region [x0, x1) x [y0, y1) of `image` in pixels (clamped to the image; corners in any order).
    Raises ToolArgumentError for an empty region."""
    w, h = image.size
    left, right = sorted((max(0.0, min(float(x0), w)), max(0.0, min(float(x1), w))))
    top, bottom = sorted((max(0.0, min(float(y0), h)), max(0.0, min(float(y1), h))))
    box = (int(left), int(top), math.ceil(right), math.ceil(bottom))
    if box[2] - box[0] < 1 or box[3] - box[1] < 1:
        raise ToolArgumentError(f"the region ({x0}, {y0}, {x1}, {y1}) is empty inside the {w}x{h} image")
    return image.crop(box)


def zoom_image(image: Image.Image, cx: float, cy: float, factor: float) -> Image.Image:
    """The part of `image` around (cx, cy) that is 1/factor of its size, enlarged by `factor` (1 < factor <= 8)."""
    if not 1.0 < float(factor) <= 8.0:
        raise ToolArgumentError(f"factor must be in (1, 8], got {factor}")
    w, h = image.size
    if not (0 <= cx <= w and 0 <= cy <= h):
        raise ToolArgumentError(f"the centre ({cx}, {cy}) is outside the {w}x{h} image")
    half_w, half_h = w / factor / 2, h / factor / 2
    x0 = min(max(cx - half_w, 0.0), w - 2 * half_w)
    y0 = min(max(cy - half_h, 0.0), h - 2 * half_h)
    region = crop_image(image, x0, y0, x0 + 2 * half_w, y0 + 2 * half_h)
    return region.resize(
        (max(1, round(region.width * factor)), max(1, round(region.height * factor))), Image.Resampling.BICUBIC
    )
