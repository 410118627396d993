"""Coordinates in the frame the model saw, without a browser: the processor's presented size (against the
processor's own output), the mapping to CSS pixels (hand-derived numbers), and every bad argument as an invalid
action."""

from __future__ import annotations

import math

import pytest
from PIL import Image

from vlmrl.envs.web.actions import action_tools, check_action
from vlmrl.envs.web.frame import Coordinates, Frame, InvalidAction, coordinates_for
from vlmrl.modeling.loading import load_processor
from vlmrl.tokens import get_builder
from vlmrl.types import ToolCall, ToolCallStatus

SIZES = [(160, 210), (320, 420), (480, 630), (1000, 514), (37, 900), (123, 77)]


@pytest.fixture(scope="module")
def processors(qwen_processors):
    """The session's Qwen2/2.5/3-VL processors, and Qwen3-VL's with min/max pixel overrides (as model.min_pixels and
    model.max_pixels set them)."""
    return {**qwen_processors, "qwen3_vl bounded": load_processor("qwen3_vl", "tiny:qwen3_vl", 50_000, 200_000)}


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl bounded"])
def test_presented_size_is_what_the_processor_makes(processors, name):
    """The builder's presented size equals the processor's own output (image_grid_thw x patch_size) for screenshot
    sizes, small ones it enlarges and large ones it shrinks, with and without min/max pixel overrides."""
    processor = processors[name]
    builder = get_builder(name.split()[0], processor)
    ip = processor.image_processor
    changed = 0
    for w, h in SIZES:
        out = ip(images=[Image.new("RGB", (w, h))], return_tensors="pt")
        _, gh, gw = out["image_grid_thw"][0].tolist()
        assert builder.presented_size(w, h) == (gw * ip.patch_size, gh * ip.patch_size), (name, w, h)
        changed += builder.presented_size(w, h) != (w, h)
    assert changed >= len(SIZES) - 1  # the processor resizes almost every one of them


def test_to_css_by_hand():
    # Qwen2.5-VL: a 160x210 CSS page at scale 2 is a 320x420 screenshot, presented at 308x420
    frame = Frame(160, 210, 308, 420, Coordinates.PIXELS)
    # x = 95 -> centre 95.5 / 308 * 160 = 49.61 -> column 49; y = 337 -> 337.5 / 420 * 210 = 168.75 -> row 168
    assert frame.to_css(95, 337) == (49, 168)
    assert frame.to_css(95.9, 337.2) == (49, 168)  # a fractional point names the pixel it falls in
    assert frame.to_css(0, 0) == (0, 0)
    assert frame.to_css(307, 419) == (159, 209)
    assert frame.to_css("12", "40") == (6, 20)  # 12.5 / 308 * 160 = 6.49; 40.5 / 420 * 210 = 20.25
    # Qwen3-VL: 0-1000 over the image; 500 -> 0.5 * 160 = 80, 250 -> 0.25 * 210 = 52.5 -> 52; 1000 -> the last pixel
    rel = Frame(160, 210, 224, 320, Coordinates.RELATIVE_1000)
    assert rel.to_css(500, 250) == (80, 52)
    assert rel.to_css(1000, 1000) == (159, 209)
    for col, row in [(0, 0), (49, 168), (159, 209), (80, 3)]:  # from_css is to_css's inverse on pixel centres
        assert frame.to_css(*frame.from_css(col, row)) == (col, row)
        assert rel.to_css(*rel.from_css(col, row)) == (col, row)


@pytest.mark.parametrize(
    "x, y",
    [(308, 5), (5, 420), (-1, 5), (1e30, 5), (math.nan, 5), (math.inf, 1), ("left", 3), (None, 2), (True, 3), ([1], 2)],
)
def test_bad_points_are_invalid_actions(x, y):
    with pytest.raises(InvalidAction):
        Frame(160, 210, 308, 420, Coordinates.PIXELS).to_css(x, y)


def test_relative_out_of_range():
    with pytest.raises(InvalidAction, match="0-1000"):
        Frame(160, 210, 224, 320, Coordinates.RELATIVE_1000).to_css(1001, 5)


def test_coordinates_for_families():
    assert coordinates_for("qwen2_5_vl", "auto") is Coordinates.PIXELS
    assert coordinates_for("qwen3_vl", "auto") is Coordinates.RELATIVE_1000
    assert coordinates_for("gemma3", "pixels") is Coordinates.PIXELS
    with pytest.raises(ValueError, match="set env.coordinates"):
        coordinates_for("gemma3", "auto")
    with pytest.raises(ValueError, match="auto, pixels or relative_1000"):
        coordinates_for("qwen3_vl", "percent")


FRAME = Frame(160, 210, 308, 420, Coordinates.PIXELS)


@pytest.mark.parametrize(
    "call, why",
    [
        (ToolCall("", {}, status=ToolCallStatus.MALFORMED_JSON, error="bad json"), "did not parse"),
        (ToolCall("drag", {"x": 1}), "no action named"),
        (ToolCall("click", {"x": 1}), "missing y"),
        (ToolCall("click", {"x": 1, "y": 2, "button": "right"}), "unexpected button"),
        (ToolCall("click", {"x": "nan", "y": 2}), "finite"),
        (ToolCall("type", {"text": ""}), "1 to 200"),
        (ToolCall("type", {"text": "a" * 201}), "1 to 200"),
        (ToolCall("press", {"key": "Hyper"}), "unknown key"),
        (ToolCall("scroll", {"x": 1, "y": 2, "direction": "sideways"}), "up or down"),
    ],
)
def test_bad_calls(call, why):
    with pytest.raises(InvalidAction, match=why):
        check_action(call, FRAME, 50)


def test_good_calls():
    assert check_action(ToolCall("click", {"x": 95, "y": 337}), FRAME, 50).point == (49, 168)
    assert check_action(ToolCall("scroll", {"x": 0, "y": 0, "direction": "Up"}), FRAME, 50).dy == -50
    assert check_action(ToolCall("press", {"key": "enter"}), FRAME, 50).text == "enter"
    assert check_action(ToolCall("type", {"text": "hi"}), FRAME, 50).text == "hi"


def test_action_schemas_name_the_frame():
    pixels = {t.name: t.schema for t in action_tools(Coordinates.PIXELS)}
    rel = {t.name: t.schema for t in action_tools(Coordinates.RELATIVE_1000)}
    assert sorted(pixels) == ["click", "press", "scroll", "type"]
    assert "in pixels" in pixels["click"]["function"]["parameters"]["properties"]["x"]["description"]
    assert "0 to 1000" in rel["scroll"]["function"]["parameters"]["properties"]["y"]["description"]
    assert "0 to 1000" not in pixels["click"]["function"]["parameters"]["properties"]["x"]["description"]
