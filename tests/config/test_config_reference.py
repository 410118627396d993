"""docs/configuration.md is the reference rendered from the config dataclasses (and is current); every config field
has its help; conf/ group files set only what differs from the dataclass defaults (plus the key naming the option)."""

from __future__ import annotations

import dataclasses
import re
import typing
from enum import Enum
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from vlmrl.config import EnvConfig
from vlmrl.config.compose import import_path
from vlmrl.config.reference import default_of, field_help, main, render, sections, shipped_environments

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
# keys a group file may set to the default value: the key that names the option (trainer=zero2: zero_stage 2, ...)
IDENTITY_KEYS = {
    "algorithm.name",
    "data.path",
    "env._target_",
    "export.style",
    "model.family",
    "model.name_or_path",
    "resume.mode",
    "rollout.engine",
    "trainer.zero_stage",
}


def _config_classes() -> list[type]:
    """Every config dataclass: the sections of `Config`, the shipped environments' config classes and the records
    their list fields hold (env.rewards' `RewardSpec`)."""
    found = [cls for _, cls in sections()] + [config_class for _, config_class in shipped_environments()]
    for cls in list(found):
        for tp in typing.get_type_hints(cls).values():
            item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
            if isinstance(item, type) and dataclasses.is_dataclass(item) and item not in found:
                found.append(item)
    return found


def test_docs_configuration_md_is_current():
    assert DOC.read_text() == render(), "docs/configuration.md is stale: python -m vlmrl.config.reference " + str(DOC)


def test_every_config_field_has_help():
    classes = _config_classes()
    assert len(classes) >= 20  # 13 sections + 9 environments (some share nothing) + RewardSpec
    missing = [f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c) if not field_help(c, f.name)]
    assert not missing, f"fields without metadata help: {missing}"


def test_check_mode_exits_1_on_a_stale_file_and_0_on_a_current_one(tmp_path, capsys):
    path = tmp_path / "configuration.md"
    assert main(["--check", str(path)]) == 1  # missing
    path.write_text(render().replace("| `trainer.lr` |", "| `trainer.learning_rate` |"))
    assert main(["--check", str(path)]) == 1
    assert "stale" in capsys.readouterr().err
    assert main([str(path)]) == 0 and main(["--check", str(path)]) == 0


def test_table_rows_have_their_columns_with_pipes_escaped():
    for line in render().splitlines():
        if line.startswith("| "):
            cells = re.split(r"(?<!\\)\|", line)[1:-1]
            assert len(cells) in (3, 4), line  # key/type/default/help, or group/option/sets
    from vlmrl.config.reference import _text

    assert _text("a | b `code` <out>/x") == "a \\| b `code` `<out>/x`"


def test_enums_list_their_values():
    text = render()
    assert "| `export.style` | one of `concat`, `individual` |" in text
    assert "| `resume.mode` | one of `auto`, `never` |" in text


def _defaults_of(cls: type, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        value = default_of(f)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(_defaults_of(type(value), f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value.value if isinstance(value, Enum) else value
    return out


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _group_files() -> list[Path]:
    return sorted((ROOT / "conf").glob("*/*.yaml"))


@pytest.mark.parametrize("path", _group_files(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_group_file_sets_no_key_to_its_default(path):
    group = path.parent.name
    keys = _flat(OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {})  # type: ignore[arg-type]
    if group == "env":
        config_class = import_path(str(keys["_target_"]), "env._target_").config_class
    else:
        config_class = {prefix[:-1]: cls for prefix, cls in sections()}[group]
    assert group != "env" or issubclass(config_class, EnvConfig)
    defaults = _defaults_of(config_class)
    for key, value in keys.items():
        dotted = f"{group}.{key}"
        assert key in defaults, f"{path.name}: {dotted} is not a key of {config_class.__name__}"
        if dotted not in IDENTITY_KEYS:
            assert value != defaults[key], f"{path.name}: {dotted}={value!r} is the dataclass default; drop it"


def test_config_yaml_holds_only_the_defaults_list():
    node = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "config.yaml"), resolve=False)
    assert set(node) == {"defaults"}  # type: ignore[arg-type]
