"""The family registry (`vlmrl.families`): each `Family` agrees with independent sources (the tiny fixture's own HF
config, the builder class, the parser formats), and lookups name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmrl.families import FAMILIES, Family, InputStyle, family_of_model_type, get_family, register_family
from vlmrl.tokens.base import TokenBuilder
from vlmrl.tools.parsers import get_parser, parser_names

TINY = Path(__file__).resolve().parents[1] / "vlmrl" / "assets" / "tiny"


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.tiny is not None])
def test_tiny_fixture_config_is_a_model_type_of_its_family(name):
    family = FAMILIES[name]
    model_type = json.loads((TINY / family.tiny.assets / "config.json").read_text())["model_type"]
    assert model_type in family.model_types
    claimed = FAMILIES[family_of_model_type(model_type)]  # may be an earlier family sharing the architecture
    assert claimed.tiny.assets == family.tiny.assets and claimed.input_style is family.input_style


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

    mine = Family("my_vl", "vlmrl.tokens.qwen_vl:QwenVLBuilder", "<|image_pad|>", ("my_vl",), InputStyle.qwen, "hermes")
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
    """`vlmrl.modeling.families.tiny_families()` reads the registry at each call: a copy of qwen2_5_vl registered
    now loads as `tiny:<name>` with Qwen2.5-VL's processor (151643 base + 22 added tokens) and is fetched by
    `python -m vlmrl.modeling fetch`."""
    import dataclasses

    from vlmrl.modeling import tokenizer_fetch
    from vlmrl.modeling.families import chat_template, tiny_families, tiny_family
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
