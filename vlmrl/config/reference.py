"""The configuration reference, docs/configuration.md, rendered from the config dataclasses: one table per section
(dotted key, type, default, help from each field's `metadata["help"]`), one per environment that ships in
vlmrl/envs/ (its `config_class`), and the options of each config group in conf/.

    python -m vlmrl.config.reference docs/configuration.md           # write the file
    python -m vlmrl.config.reference --check docs/configuration.md   # exit 1 if the file differs (is stale)

Plain Markdown for GitHub and mkdocs alike: pipes in table cells are escaped, and text between angle brackets is
set as code (it would read as an HTML tag otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Iterator

from omegaconf import OmegaConf

from vlmrl.config.compose import ROOT
from vlmrl.config.schema import ASSETS, Config, EnvConfig
from vlmrl.registry import registry_for

HEADER = """# Configuration reference

Generated from the config dataclasses (vlmrl/config/schema.py and the environments' config classes) by
`python -m vlmrl.config.reference docs/configuration.md`; edit the field's `help` there, not this file.

A run's config is composed by Hydra: conf/config.yaml picks one option of each config group (conf/GROUP/OPTION.yaml,
which sets only what differs from the defaults below), then `recipe=NAME` applies recipes/NAME.yaml, then each
command-line override: `key=value` sets one key (`trainer.lr=3e-4`, `rollout.vllm.mode=server`), `group=option`
picks another group file (`rollout=vllm`, `algorithm=dr_grpo`). `vlmrl show-config recipe=NAME key=value` prints
the result. Unknown keys and values of the wrong type are errors.
"""

_CODE = re.compile(r"(`[^`]*`)")
_ANGLED = re.compile(r"[^\s`(]*<[^<>\s]+>[^\s`,;:)]*")


def field_help(cls: type, name: str) -> str:
    """The help of field `name` of dataclass `cls`: its own `metadata["help"]`, else that of the nearest base class
    that declares the field (a subclass that only changes a default keeps the base's help); "" if none has one."""
    for klass in cls.__mro__:
        own = getattr(klass, "__dataclass_fields__", {}).get(name)
        if own is not None and own.metadata.get("help"):
            return str(own.metadata["help"])
    return ""


def default_of(f: dataclasses.Field) -> Any:
    """The field's default value (its factory called for a mutable default); dataclasses.MISSING if it has none."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def sections(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, type]]:
    """(dotted prefix, dataclass) of `cls` and of every nested section, depth first; the top level's prefix is ""."""
    yield prefix, cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            yield from sections(hints[f.name], f"{prefix}{f.name}.")


def shipped_environments() -> list[tuple[type, type]]:
    """(environment class, its config class) for every registered environment (`vlmrl.envs.base.ENVIRONMENTS`, whose
    built-ins it imports by module name: the config layer itself never imports the environments,
    tests/config/test_config_imports.py) that declares its own `config_class` (an `EnvConfig` subclass), in module
    order."""
    found: list[tuple[type, type]] = []
    environments = registry_for("env._target_")
    for name in environments.names():
        cls = environments.get(name)
        config_class = vars(cls).get("config_class")
        if isinstance(config_class, type) and issubclass(config_class, EnvConfig) and config_class is not EnvConfig:
            if (cls, config_class) not in found:
                found.append((cls, config_class))
    return sorted(found, key=lambda pair: pair[0].__module__)


def group_options(root: Path = ROOT) -> dict[str, dict[str, dict[str, Any]]]:
    """{group: {option: {dotted key: value as written}}} of conf/GROUP/OPTION.yaml (interpolations unresolved)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for path in sorted((root / "conf").glob("*/*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
        out.setdefault(path.parent.name, {})[path.stem] = _flat(node)  # type: ignore[arg-type]
    return out


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or null"
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(f"`{m.value}`" for m in tp)
    return getattr(tp, "__name__", str(tp))


def _yaml(value: Any) -> str:
    """A default as it is written in YAML (flow style); paths inside the package as `${vlmrl_asset:...}`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _yaml(dataclasses.asdict(value))
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        if value.startswith(str(ASSETS)):
            return "${vlmrl_asset:" + Path(value).relative_to(ASSETS).as_posix() + "}"
        return value if value else '""'
    return repr(value)


def _code(text: str) -> str:
    """`text` as a code span (a value holding a pipe or backtick is escaped text instead: a pipe cannot be escaped
    inside a code span in every Markdown dialect)."""
    return _text(text) if ("|" in text or "`" in text) else f"`{text}`"


def _text(text: str) -> str:
    """Help text for a table cell: pipes and asterisks escaped, angle-bracketed words set as code."""
    parts = []
    for i, part in enumerate(_CODE.split(text)):
        if i % 2:  # a code span, kept
            if "|" in part:
                raise ValueError(f"a pipe inside a code span cannot be escaped portably: {part}")
            parts.append(part)
            continue
        part = part.replace("|", "\\|").replace("*", "\\*")
        parts.append(_ANGLED.sub(lambda m: f"`{m.group(0).rstrip('.')}`" + "." * m.group(0).endswith("."), part))
    return "".join(parts)


def _summary(cls: type) -> str:
    """The first paragraph of the class's own docstring, on one line ("" for a dataclass without one)."""
    doc = inspect.cleandoc(vars(cls).get("__doc__") or "")
    return "" if doc.startswith(f"{cls.__name__}(") else doc.split("\n\n")[0].replace("\n", " ")


def _rows(cls: type, prefix: str, only: set[str] | None = None) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]) or (only is not None and f.name not in only):
            continue
        rows.append(
            f"| `{prefix}{f.name}` | {_text(_type_name(hints[f.name]))} | {_code(_yaml(default_of(f)))} | "
            f"{_text(field_help(cls, f.name))} |"
        )
        item = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is list else None
        if isinstance(item, type) and _is_section(item):  # a list of records (env.rewards): a row per item key
            rows += _rows(item, f"{prefix}{f.name}[].")
    return rows


def _table(rows: list[str]) -> list[str]:
    return ["| Key | Type | Default | Help |", "| --- | --- | --- | --- |", *rows, ""]


def _env_section(env_cls: type, config_class: type, options: list[str]) -> list[str]:
    base = {f.name: default_of(f) for f in dataclasses.fields(EnvConfig)}
    changed = {
        f.name
        for f in dataclasses.fields(config_class)
        if f.name != "_target_" and (f.name not in base or default_of(f) != base[f.name])
    }
    title = f"### `{env_cls.__module__}.{env_cls.__name__}`"
    picked = ", ".join(f"`env={o}`" for o in options) or "no conf/env option"
    doc = _summary(env_cls) or _summary(config_class)
    lines = [title, "", f"{_text(doc)} Config class `{config_class.__name__}`; picked by {picked}.", ""]
    if not changed:
        return lines + ["The keys of `env` above, with their defaults.", ""]
    return lines + [
        "Its keys beyond `env` above, or with another default:",
        "",
        *_table(_rows(config_class, "env.", changed)),
    ]


def render() -> str:
    """The whole reference as Markdown."""
    lines = [HEADER]
    for prefix, cls in sections():
        name = prefix[:-1] or "Top level"
        lines += [f"## {name}", "", _text(_summary(cls)), "", *_table(_rows(cls, prefix))]
    groups = group_options()
    targets: dict[str, list[str]] = {}
    for option, keys in groups.get("env", {}).items():
        targets.setdefault(str(keys.get("_target_")), []).append(option)
    lines += ["## Environments", "", "Each environment's own config class; `env._target_` picks it.", ""]
    for env_cls, config_class in shipped_environments():
        lines += _env_section(env_cls, config_class, targets.get(f"{env_cls.__module__}.{env_cls.__name__}", []))
    lines += ["## Config groups", "", "What each option of a group sets (`group=option`; conf/GROUP/OPTION.yaml).", ""]
    lines += ["| Group | Option | Sets |", "| --- | --- | --- |"]
    for group, options in groups.items():
        for option, keys in options.items():
            sets = ", ".join(_code(f"{group}.{k}={_yaml(v)}") for k, v in keys.items()) or "nothing (the defaults)"
            lines.append(f"| {group} | {option} | {sets} |")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the reference to PATH, or with --check compare: 0 if equal, 1 (and a message) if it differs."""
    parser = argparse.ArgumentParser(prog="python -m vlmrl.config.reference", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if PATH differs from the rendered reference")
    parser.add_argument("path", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.path.is_file() or args.path.read_text() != text:
            print(f"{args.path} is stale: run python -m vlmrl.config.reference {args.path}", file=sys.stderr)
            return 1
        return 0
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
