"""Config files that cannot be read as configs are one-line errors within a second: a recipe that is not UTF-8 text,
a YAML alias bomb (a few hundred bytes that expand into billions of nodes) as a recipe, in a `config_dir` group file
or as a run folder's config.yaml."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from vlmrl.config import ConfigError, from_yaml, load
from vlmrl.config.yaml_guard import MAX_NODES, expanded_size

LETTERS = "abcdefghi"


def alias_bomb(levels: int = 9) -> str:
    """`levels` levels of 9 aliases each: 9**9 (387 million) leaves in about 400 bytes at 9 levels."""
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip(LETTERS[: levels - 1], LETTERS[1:levels]):
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    return "\n".join(lines) + "\n"


def _one_line_error_in_a_second(*args, **kwargs) -> str:
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load(*args, **kwargs)
    assert time.perf_counter() - t0 < 1.0
    assert "\n" not in str(err.value)
    return str(err.value)


def test_the_bomb_is_what_it_claims():
    import yaml

    assert len(alias_bomb()) < 450
    # 3 levels, hand-derived: a = 1 + 9 = 10 nodes, b = 1 + 9 * 10 = 91, c = 1 + 9 * 91 = 820; the mapping adds itself
    # and its 3 keys: 1 + 3 + 10 + 91 + 820 = 925
    assert expanded_size(yaml.compose(alias_bomb(3), Loader=yaml.SafeLoader), {}) == 925
    assert expanded_size(yaml.compose(alias_bomb(), Loader=yaml.SafeLoader), {}) == MAX_NODES + 1  # capped


def test_a_binary_recipe_is_one_line(tmp_path):
    path = tmp_path / "blob.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe" * 50)
    msg = _one_line_error_in_a_second(str(path))
    assert msg.startswith(f"recipe={path}: {path} is not UTF-8 text (byte 0)")


def test_an_alias_bomb_as_a_recipe_is_one_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text("# @package _global_\n" + alias_bomb())
    msg = _one_line_error_in_a_second(str(path))
    assert f"{path} expands into more than {MAX_NODES:,} YAML nodes" in msg


def test_an_alias_bomb_in_a_config_dir_is_one_line(tmp_path):
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "bomb.yaml").write_text(alias_bomb())
    msg = _one_line_error_in_a_second(None, [f"config_dir={tmp_path}", "env=bomb"])
    assert msg.startswith(f"config_dir={tmp_path}: {tmp_path / 'env' / 'bomb.yaml'} expands into more than")


def test_a_named_recipe_that_is_not_text_is_one_line(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "mine.yaml").write_bytes(b"seed: 1\n\xff\xfe\n")
    msg = _one_line_error_in_a_second("mine", [f"config_dir={tmp_path}"])
    assert "is not UTF-8 text (byte 8)" in msg


def test_a_run_folders_config_yaml_bomb_is_one_line(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(alias_bomb())
    with pytest.raises(ConfigError, match=r"^config.yaml: .* expands into more than"):
        from_yaml(Path(path))
