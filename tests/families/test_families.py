"""The family registry (`vlmrl.families`): each `Family` agrees with independent sources (the tiny fixture's own HF
config, the builder class, the parser formats), and lookups name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmrl.families import FAMILIES, Family, TinyRecipe, family_of_model_type, get_family, register_family
from vlmrl.families.qwen_vl import QWEN_LAYOUT
from vlmrl.tokens.base import TokenBuilder
from vlmrl.tools.parsers import get_parser, parser_names

TINY = Path(__file__).resolve().parents[2] / "vlmrl" / "assets" / "tiny"


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.tiny is not None])
def test_tiny_fixture_config_is_a_model_type_of_its_family(name):
    family = FAMILIES[name]
    model_type = json.loads((TINY / family.tiny.assets / "config.json").read_text())["model_type"]
    assert model_type in family.model_types
    claimed = FAMILIES[family_of_model_type(model_type)]  # may be an earlier family sharing the architecture
    assert claimed.tiny.assets == family.tiny.assets and claimed.input_layout is family.input_layout


@pytest.mark.parametrize("name", list(FAMILIES))
def test_builder_and_parser_resolve(name):
    family = FAMILIES[name]
    cls = family.builder_class()
    assert issubclass(cls, TokenBuilder) and FAMILIES[cls.family].builder_class() is cls  # its default family
    if family.tool_parser is not None:
        assert family.tool_parser in parser_names() and get_parser(name) is not None


def test_lookups_name_what_is_wrong():
    with pytest.raises(ValueError, match="unknown model.family 'nope'.*qwen2_5_vl"):
        get_family("nope")
    assert family_of_model_type("qwen3_5") == "qwen3_5_think"  # the first family listing it
    assert family_of_model_type("idefics3") == "idefics3"  # not smolvlm, which lists it second
    assert family_of_model_type("llama") is None
    with pytest.raises(ValueError, match="no tool-call parser for 'gemma3'"):
        get_parser("gemma3")


def test_register_family_reaches_every_consumer(qwen25_processor):
    from vlmrl.modeling.inputs import input_style
    from vlmrl.tokens import builder_families, get_builder
    from vlmrl.tokens.mimo_vl import MiMoVLBuilder
    from vlmrl.tokens.qwen_vl import QwenVLBuilder

    mine = Family(
        name="my_vl",
        builder="vlmrl.tokens.qwen_vl:QwenVLBuilder",
        image_token="<|image_pad|>",
        model_types=("my_vl",),
        input_layout=QWEN_LAYOUT,
        tool_parser="hermes",
    )
    register_family(mine)
    try:
        assert "my_vl" in builder_families() and input_style("my_vl") == "qwen"
        assert family_of_model_type("my_vl") == "my_vl" and type(get_parser("my_vl")).__name__ == "HermesParser"
        builder = get_builder("my_vl", qwen25_processor)  # the builder reads the registry, not a list of its own
        assert type(builder) is QwenVLBuilder and builder.family == "my_vl"
        for cls, other in [(QwenVLBuilder, "gemma3"), (MiMoVLBuilder, "my_vl")]:  # a subclass builds only its own
            with pytest.raises(ValueError, match=f"{cls.__name__} does not build family '{other}'"):
                cls(qwen25_processor, other)
    finally:
        del FAMILIES["my_vl"]


def test_a_family_registered_after_import_reaches_the_tiny_fixture_loader(monkeypatch):
    """`vlmrl.families.tiny.tiny_families()` reads the registry at each call: a copy of qwen2_5_vl registered
    now loads as `tiny:<name>` with Qwen2.5-VL's processor (151643 base + 22 added tokens) and is fetched by
    `python -m vlmrl.modeling fetch`."""
    import dataclasses

    from vlmrl.families.tiny import chat_template, tiny_families, tiny_family
    from vlmrl.modeling import tokenizer_fetch
    from vlmrl.modeling.loading import load_processor

    register_family(dataclasses.replace(FAMILIES["qwen2_5_vl"], name="late_vl", model_types=("late_vl",)))
    try:
        assert tiny_family("late_vl").assets == "qwen2_5_vl" and "late_vl" in tiny_families()
        assert chat_template("late_vl") == chat_template("qwen2_5_vl")
        processor = load_processor("late_vl", "tiny:late_vl")
        assert type(processor).__name__ == "Qwen2_5_VLProcessor" and len(processor.tokenizer) == 151643 + 22
        monkeypatch.setattr(tokenizer_fetch, "family_tokenizer_json", lambda family: Path(family))
        assert tokenizer_fetch.fetch_all()["late_vl"] == Path("late_vl")
    finally:
        del FAMILIES["late_vl"]
    with pytest.raises(ValueError, match="model.family must be one of .*; got 'late_vl'"):
        tiny_family("late_vl")


def test_family_and_recipe_take_keywords_only():
    with pytest.raises(TypeError):
        Family("my_vl", "vlmrl.tokens.qwen_vl:QwenVLBuilder")  # type: ignore[misc]
    with pytest.raises(TypeError):
        TinyRecipe(22, "qwen2_5_vl.jinja", "qwen", "qwen2_5_vl")  # type: ignore[misc]


def test_every_family_with_a_model_has_its_layout_and_only_remote_code_ones_have_none():
    """Each layout is one object shared by its families, named, with its tensor shapes in its docstring."""
    from vlmrl.families.layout import InputLayout

    without = {name for name, f in FAMILIES.items() if f.input_layout is None}
    assert without == {"kimi_vl", "deepseek_vl2"}
    layouts = {id(f.input_layout): f.input_layout for f in FAMILIES.values() if f.input_layout is not None}
    assert sorted(lay.name for lay in layouts.values()) == ["gemma3", "idefics3", "llava_next", "qwen"]
    for layout in layouts.values():
        assert isinstance(layout, InputLayout) and "pixel_values [" in (type(layout).__doc__ or "")
    assert FAMILIES["smolvlm"].input_layout is FAMILIES["idefics3"].input_layout
    assert all(FAMILIES[n].input_layout is QWEN_LAYOUT for n in ("qwen3_5_think", "glm4v_moe", "mimo_vl"))


def test_the_old_module_path_still_imports_with_a_deprecation_warning():
    import importlib
    import sys

    from vlmrl.families import tiny

    sys.modules.pop("vlmrl.modeling.families", None)
    with pytest.warns(DeprecationWarning, match="vlmrl.modeling.families moved to vlmrl.families.tiny"):
        old = importlib.import_module("vlmrl.modeling.families")
    assert old is tiny and old.FamilySpec is TinyRecipe
    assert old.tiny_family("qwen2_5_vl") == FAMILIES["qwen2_5_vl"].tiny and "gemma3" in old.tiny_families()
    assert old.chat_template("gemma3") == tiny.chat_template("gemma3")
